CREATE TABLE IF NOT EXISTS ks_dek (
    key_id       BYTEA PRIMARY KEY,
    tenant       TEXT NOT NULL,
    subject_ref  TEXT NOT NULL,
    scope        TEXT NOT NULL,
    kek_provider TEXT NOT NULL,
    kek_epoch    INTEGER NOT NULL,
    wrapped      BYTEA NOT NULL,
    created_at   TIMESTAMPTZ NOT NULL,
    owner_tag    TEXT NOT NULL DEFAULT ''
);
CREATE UNIQUE INDEX IF NOT EXISTS ks_dek_owner_set ON ks_dek (subject_ref, scope, owner_tag);
CREATE INDEX IF NOT EXISTS ks_dek_epoch ON ks_dek (kek_epoch);
CREATE TABLE IF NOT EXISTS ks_dek_owner (
    owner_ref    TEXT NOT NULL,
    key_id       BYTEA NOT NULL,
    PRIMARY KEY (owner_ref, key_id)
);
CREATE INDEX IF NOT EXISTS ks_dek_owner_key ON ks_dek_owner (key_id);
CREATE TABLE IF NOT EXISTS ks_tombstone (
    tombstone_id TEXT PRIMARY KEY,
    subject_ref  TEXT NOT NULL,
    scope        TEXT,
    erased_at    TIMESTAMPTZ NOT NULL
);
CREATE INDEX IF NOT EXISTS ks_tombstone_subject ON ks_tombstone (subject_ref);
CREATE TABLE IF NOT EXISTS ks_tombstone_key (
    key_id       BYTEA PRIMARY KEY,
    tombstone_id TEXT NOT NULL REFERENCES ks_tombstone (tombstone_id)
);
CREATE TABLE IF NOT EXISTS ks_secret (
    name         TEXT PRIMARY KEY,
    kek_provider TEXT NOT NULL,
    kek_epoch    INTEGER NOT NULL,
    wrapped      BYTEA NOT NULL
);
CREATE INDEX IF NOT EXISTS ks_dek_wrap ON ks_dek (kek_provider, kek_epoch);
CREATE TABLE IF NOT EXISTS ks_epoch_key (
    lineage        TEXT NOT NULL,
    epoch          INTEGER NOT NULL,
    kek_provider   TEXT NOT NULL,
    provider_epoch INTEGER NOT NULL,
    wrapped        BYTEA NOT NULL,
    created_at     TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (lineage, epoch)
);
