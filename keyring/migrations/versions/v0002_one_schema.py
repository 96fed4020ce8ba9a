"""One schema on both dialects.

- The tombstone table gets both indexes, on the time and on the subject (SQLite had
  only the first, PostgreSQL only the second).
- SQLite's key table gets its unique key as the named unique index PostgreSQL has
  (``dek_owner_set``) instead of an unnamed table constraint.
- SQLite's primary-key columns become ``NOT NULL`` as on PostgreSQL (SQLite lets a
  non-integer primary key hold NULL unless it says so).

SQLite changes a constraint only by rebuilding the table (create, copy, drop,
rename); with ``secure_delete`` on, the old table's pages are overwritten as they are
freed. The DDL is written out here, frozen: the models in ``keyring/schema.py`` may
change later, this revision may not.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_SQLITE_TABLES = {
    "dek": """
        key_id       BLOB NOT NULL PRIMARY KEY,
        tenant       TEXT NOT NULL,
        subject_ref  TEXT NOT NULL,
        scope        TEXT NOT NULL,
        kek_provider TEXT NOT NULL,
        kek_epoch    INTEGER NOT NULL,
        wrapped      BLOB NOT NULL,
        created_at   TEXT NOT NULL,
        owner_tag    TEXT NOT NULL DEFAULT ''
    """,
    "dek_owner": """
        owner_ref    TEXT NOT NULL,
        key_id       BLOB NOT NULL,
        PRIMARY KEY (owner_ref, key_id)
    """,
    "tombstone": """
        tombstone_id TEXT NOT NULL PRIMARY KEY,
        subject_ref  TEXT NOT NULL,
        scope        TEXT,
        erased_at    TEXT NOT NULL
    """,
    "tombstone_key": """
        key_id       BLOB NOT NULL PRIMARY KEY,
        tombstone_id TEXT NOT NULL REFERENCES tombstone (tombstone_id)
    """,
    "secret": """
        name         TEXT NOT NULL PRIMARY KEY,
        kek_provider TEXT NOT NULL,
        kek_epoch    INTEGER NOT NULL,
        wrapped      BLOB NOT NULL
    """,
    "epoch_key": """
        lineage        TEXT NOT NULL,
        epoch          INTEGER NOT NULL,
        kek_provider   TEXT NOT NULL,
        provider_epoch INTEGER NOT NULL,
        wrapped        BLOB NOT NULL,
        created_at     TEXT NOT NULL,
        PRIMARY KEY (lineage, epoch)
    """,
}

_SQLITE_INDEXES = (
    "CREATE UNIQUE INDEX dek_owner_set ON dek (subject_ref, scope, owner_tag)",
    "CREATE INDEX dek_epoch ON dek (kek_epoch)",
    "CREATE INDEX dek_wrap ON dek (kek_provider, kek_epoch)",
    "CREATE INDEX dek_owner_key ON dek_owner (key_id)",
    "CREATE INDEX tombstone_time ON tombstone (erased_at)",
    "CREATE INDEX tombstone_subject ON tombstone (subject_ref)",
)


def _columns(body: str) -> str:
    names = [line.split()[0] for line in body.strip().splitlines()]
    return ", ".join(n.rstrip(",") for n in names if n != "PRIMARY")


def upgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        op.execute("CREATE INDEX ks_tombstone_time ON ks_tombstone (erased_at)")
        return
    for name, body in _SQLITE_TABLES.items():
        columns = _columns(body)
        op.execute(f"CREATE TABLE {name}_0002 ({body})")
        op.execute(f"INSERT INTO {name}_0002 ({columns}) SELECT {columns} FROM {name}")  # noqa: S608
        op.execute(f"DROP TABLE {name}")  # and its indexes
        op.execute(f"ALTER TABLE {name}_0002 RENAME TO {name}")
    for statement in _SQLITE_INDEXES:
        op.execute(statement)


def downgrade() -> None:
    raise NotImplementedError("the key store is never downgraded")
