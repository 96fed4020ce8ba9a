"""The key store's Alembic revisions (``env.py``, ``versions/``), and how a store
written before versioned migrations joins them.

Revision ``0001`` is the schema main@fae494a creates on each dialect (``FAE494A``,
kept verbatim: the two dialects' indexes had drifted). A store from before versioned
migrations (a key table but no ``ks_alembic_keys``) is brought to that schema by
what every open ran until then (``unversioned_to_0001``: the owner-set change of #19,
then the idempotent DDL), then stamped ``0001`` and upgraded like any other.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Connection

__all__ = ["FAE494A", "unversioned_to_0001"]

_SQLITE = """
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
"""

_POSTGRESQL = """
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
"""

FAE494A = {"sqlite": _SQLITE, "postgresql": _POSTGRESQL}


def statements(dialect: str) -> list[str]:
    """The fae494a DDL of ``dialect``, one statement each."""
    return [s.strip() for s in FAE494A[dialect].split(";") if s.strip()]


def unversioned_to_0001(conn: Connection) -> None:
    """Inside the caller's write transaction: bring a store from before versioned
    migrations to revision 0001's schema, as every open did before (idempotent).

    A store from before owner sets (#19) gains ``owner_tag`` and its unique key
    becomes (subject_ref, scope, owner_tag): SQLite can only do that by rebuilding
    the key table; existing keys are all scope keys (tag "")."""
    dialect = conn.dialect.name
    key_table = "dek" if dialect == "sqlite" else "ks_dek"
    inspector = sa.inspect(conn)
    if key_table in inspector.get_table_names():
        columns = {c["name"] for c in inspector.get_columns(key_table)}
        if "owner_tag" not in columns:
            _owner_sets(conn, dialect)
    for statement in statements(dialect):
        conn.exec_driver_sql(statement)


def _owner_sets(conn: Connection, dialect: str) -> None:
    if dialect == "postgresql":
        conn.exec_driver_sql("LOCK TABLE ks_dek IN ACCESS EXCLUSIVE MODE")
        conn.exec_driver_sql(
            "ALTER TABLE ks_dek ADD COLUMN IF NOT EXISTS owner_tag TEXT NOT NULL DEFAULT ''"
        )
        conn.exec_driver_sql(
            "ALTER TABLE ks_dek DROP CONSTRAINT IF EXISTS ks_dek_subject_ref_scope_key"
        )
        return
    old = "key_id, tenant, subject_ref, scope, kek_provider, kek_epoch, wrapped, created_at"
    conn.exec_driver_sql("ALTER TABLE dek RENAME TO dek_before_owner_sets")
    conn.exec_driver_sql(statements("sqlite")[0])  # the key table of 0001
    conn.exec_driver_sql(
        f"INSERT INTO dek ({old}, owner_tag) SELECT {old}, '' FROM dek_before_owner_sets"  # noqa: S608
    )
    conn.exec_driver_sql("DROP TABLE dek_before_owner_sets")
    conn.exec_driver_sql("DROP INDEX IF EXISTS dek_epoch")
