CREATE TABLE IF NOT EXISTS dek (
    key_id       BLOB PRIMARY KEY,
    tenant       TEXT NOT NULL,
    subject_ref  TEXT NOT NULL,
    scope        TEXT NOT NULL,
    kek_provider TEXT NOT NULL,
    kek_epoch    INTEGER NOT NULL,
    wrapped      BLOB NOT NULL,
    created_at   TEXT NOT NULL,
    owner_tag    TEXT NOT NULL DEFAULT '',
    UNIQUE (subject_ref, scope, owner_tag)
);
CREATE INDEX IF NOT EXISTS dek_epoch ON dek (kek_epoch);
CREATE TABLE IF NOT EXISTS dek_owner (
    owner_ref    TEXT NOT NULL,
    key_id       BLOB NOT NULL,
    PRIMARY KEY (owner_ref, key_id)
);
CREATE INDEX IF NOT EXISTS dek_owner_key ON dek_owner (key_id);
CREATE TABLE IF NOT EXISTS tombstone (
    tombstone_id TEXT PRIMARY KEY,
    subject_ref  TEXT NOT NULL,
    scope        TEXT,
    erased_at    TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS tombstone_time ON tombstone (erased_at);
CREATE TABLE IF NOT EXISTS tombstone_key (
    key_id       BLOB PRIMARY KEY,
    tombstone_id TEXT NOT NULL REFERENCES tombstone (tombstone_id)
);
CREATE TABLE IF NOT EXISTS secret (
    name         TEXT PRIMARY KEY,
    kek_provider TEXT NOT NULL,
    kek_epoch    INTEGER NOT NULL,
    wrapped      BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS dek_wrap ON dek (kek_provider, kek_epoch);
CREATE TABLE IF NOT EXISTS epoch_key (
    lineage        TEXT NOT NULL,
    epoch          INTEGER NOT NULL,
    kek_provider   TEXT NOT NULL,
    provider_epoch INTEGER NOT NULL,
    wrapped        BLOB NOT NULL,
    created_at     TEXT NOT NULL,
    PRIMARY KEY (lineage, epoch)
);
