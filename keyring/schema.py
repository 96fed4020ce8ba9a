"""The key store's tables, one SQLAlchemy Core definition for SQLite and PostgreSQL.

Table and index names carry a per-dialect prefix: none in the embedded profile's own
SQLite file (``dek``, ``tombstone``, ... as every existing store and backup snapshot
has them), ``ks_`` on PostgreSQL, where the key store may share a database and schema
with the catalog. Both dialects get the same columns, keys and indexes; schema
changes are Alembic revisions in ``keyshred.keyring:migrations`` (version table
``ks_alembic_keys``), and a test compares the migrated database with these tables.

Times are ISO-8601 text on SQLite (as the key store always kept them) and
``timestamptz`` on PostgreSQL (``Time``); both bind and return aware UTC datetimes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

__all__ = [
    "HEAD",
    "MIGRATIONS",
    "VERSION_TABLE",
    "KeyStoreTables",
    "Time",
    "prefix_for",
    "tables",
]

# Where the revisions live and which table records the applied one (its own name, so
# the key store and the catalog can share one PostgreSQL schema).
MIGRATIONS = "keyshred.keyring:migrations"
VERSION_TABLE = "ks_alembic_keys"
# The newest revision in migrations/versions/ (``keyshred.db.migrate``'s head; a test
# compares it with Alembic's).
HEAD = "0003"

_PREFIXES = {"sqlite": "", "postgresql": "ks_"}


def prefix_for(dialect: str) -> str:
    """The table-name prefix of the key store on ``dialect`` ("sqlite", "postgresql")."""
    return _PREFIXES[dialect]


def timestamp(value: datetime) -> str:
    """A time as the key store's SQLite text: UTC ISO-8601 with microseconds."""
    return value.astimezone(UTC).isoformat(timespec="microseconds")


class Time(sa.types.TypeDecorator[datetime]):
    """An aware UTC datetime: ISO text on SQLite, ``timestamptz`` on PostgreSQL."""

    impl = sa.Text
    cache_ok = True

    def load_dialect_impl(self, dialect: sa.Dialect) -> sa.types.TypeEngine[Any]:
        if dialect.name == "postgresql":
            return dialect.type_descriptor(postgresql.TIMESTAMP(timezone=True))
        return dialect.type_descriptor(sa.Text())

    def process_bind_param(self, value: Any, dialect: sa.Dialect) -> Any:
        if value is None or dialect.name == "postgresql":
            return value
        return timestamp(value) if isinstance(value, datetime) else value

    def process_result_value(self, value: Any, dialect: sa.Dialect) -> datetime | None:
        if value is None:
            return None
        if isinstance(value, str):
            value = datetime.fromisoformat(value)
        assert isinstance(value, datetime)  # noqa: S101 - the column's type
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value


@dataclass(frozen=True, slots=True)
class KeyStoreTables:
    """The key store's tables for one prefix."""

    metadata: sa.MetaData
    dek: sa.Table
    dek_owner: sa.Table
    tombstone: sa.Table
    tombstone_key: sa.Table
    secret: sa.Table
    epoch_key: sa.Table


@functools.cache
def tables(prefix: str) -> KeyStoreTables:
    """The key store's tables named with ``prefix`` (``prefix_for(dialect)``)."""
    p = prefix
    md = sa.MetaData()
    dek = sa.Table(
        f"{p}dek",
        md,
        sa.Column("key_id", sa.LargeBinary, primary_key=True),
        sa.Column("tenant", sa.Text, nullable=False),
        sa.Column("subject_ref", sa.Text, nullable=False),
        sa.Column("scope", sa.Text, nullable=False),
        sa.Column("kek_provider", sa.Text, nullable=False),
        sa.Column("kek_epoch", sa.Integer, nullable=False),
        sa.Column("wrapped", sa.LargeBinary, nullable=False),
        sa.Column("created_at", Time, nullable=False),
        # "" for a holder's own scope key, else the hash of the other owners
        # (``keystore.owner_tag``): one live DEK per (holder, scope, owner set).
        sa.Column("owner_tag", sa.Text, nullable=False, server_default=""),
        sa.Index(f"{p}dek_owner_set", "subject_ref", "scope", "owner_tag", unique=True),
        sa.Index(f"{p}dek_epoch", "kek_epoch"),
        sa.Index(f"{p}dek_wrap", "kek_provider", "kek_epoch"),
    )
    dek_owner = sa.Table(
        f"{p}dek_owner",
        md,
        sa.Column("owner_ref", sa.Text, primary_key=True),
        sa.Column("key_id", sa.LargeBinary, primary_key=True),
        sa.Index(f"{p}dek_owner_key", "key_id"),
    )
    tombstone = sa.Table(
        f"{p}tombstone",
        md,
        sa.Column("tombstone_id", sa.Text, primary_key=True),
        sa.Column("subject_ref", sa.Text, nullable=False),
        sa.Column("scope", sa.Text, nullable=True),
        sa.Column("erased_at", Time, nullable=False),
        # ``tombstones(since=)`` ranges over the time, ``is_tombstoned`` looks up the
        # subject: before revision 0002 each dialect had only one of the two.
        sa.Index(f"{p}tombstone_time", "erased_at"),
        sa.Index(f"{p}tombstone_subject", "subject_ref"),
    )
    tombstone_key = sa.Table(
        f"{p}tombstone_key",
        md,
        sa.Column("key_id", sa.LargeBinary, primary_key=True),
        sa.Column(
            "tombstone_id",
            sa.Text,
            sa.ForeignKey(f"{p}tombstone.tombstone_id"),
            nullable=False,
        ),
        # A tombstone's keys by the tombstone (``tombstone_for``'s join; revision 0003).
        sa.Index(f"{p}tombstone_key_tombstone", "tombstone_id", "key_id"),
    )
    secret = sa.Table(
        f"{p}secret",
        md,
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("kek_provider", sa.Text, nullable=False),
        sa.Column("kek_epoch", sa.Integer, nullable=False),
        sa.Column("wrapped", sa.LargeBinary, nullable=False),
    )
    epoch_key = sa.Table(
        f"{p}epoch_key",
        md,
        sa.Column("lineage", sa.Text, primary_key=True),
        sa.Column("epoch", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("kek_provider", sa.Text, nullable=False),
        sa.Column("provider_epoch", sa.Integer, nullable=False),
        sa.Column("wrapped", sa.LargeBinary, nullable=False),
        sa.Column("created_at", Time, nullable=False),
    )
    return KeyStoreTables(md, dek, dek_owner, tombstone, tombstone_key, secret, epoch_key)
