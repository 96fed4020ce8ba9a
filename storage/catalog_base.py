"""The catalog's shared parts: its row types, guard states, and the plumbing every
part of ``Catalog`` runs statements through (``keyshred.storage.catalog`` composes
the guard, assets, identifiers and consent parts on top of it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from keyshred import db
from keyshred.db import utc

__all__ = [
    "ACTIVE",
    "ERASED",
    "OPEN",
    "SUPPRESSED",
    "AssetRow",
    "CatalogBase",
    "ConsentRecord",
    "GuardState",
    "chunks",
    "consent_record",
    "guard_state",
    "sqlite_time",
]

_T = TypeVar("_T")
ACTIVE = "active"
SUPPRESSED = "suppressed"
ERASED = "erased"


def sqlite_time(value: Any) -> Any:
    """Bind a datetime the way SQLAlchemy's SQLite DATETIME stores it (naive UTC)."""
    if isinstance(value, datetime):
        if value.tzinfo is UTC:  # the common case: drop the "+00:00"
            return value.isoformat(sep=" ", timespec="microseconds")[:-6]
        return (
            value.astimezone(UTC).replace(tzinfo=None).isoformat(sep=" ", timespec="microseconds")
        )
    return value


@dataclass(frozen=True, slots=True)
class GuardState:
    """A subject's guard: its status, deletion epoch and suppressed scopes."""

    status: str
    epoch: int
    scopes: frozenset[str] = frozenset()


OPEN = GuardState(ACTIVE, 0)


def guard_state(row: Any) -> GuardState:
    if row is None:
        return OPEN
    scopes = frozenset(json.loads(row[2])) if row[2] and row[2] != "[]" else frozenset()
    return GuardState(row[0], int(row[1]), scopes)


@dataclass(frozen=True, slots=True)
class AssetRow:
    """One catalogued asset. Every field is pseudonymous or metadata."""

    asset_id: str
    subject_ref: str
    scope: str
    kind: str
    storage_system: str
    storage_key: str
    purpose: str
    category: str
    created_at: datetime
    retain_until: datetime | None
    status: str = "live"
    lookup: str | None = None
    producer: str | None = None
    producer_version: str | None = None
    sources: tuple[str, ...] = field(default=())
    mentions: tuple[str, ...] = field(default=())

    def values(self) -> dict[str, Any]:
        return {
            "asset_id": self.asset_id,
            "subject_ref": self.subject_ref,
            "scope": self.scope,
            "kind": self.kind,
            "storage_system": self.storage_system,
            "storage_key": self.storage_key,
            "purpose": self.purpose,
            "category": self.category,
            "created_at": self.created_at,
            "retain_until": self.retain_until,
            "status": self.status,
            "lookup": self.lookup,
            "producer": self.producer,
            "producer_version": self.producer_version,
        }


@dataclass(frozen=True, slots=True)
class ConsentRecord:
    consent_id: str
    subject_ref: str
    purpose: str
    category: str
    actions: tuple[str, ...]
    start_at: datetime
    end_at: datetime | None
    policy_version: str
    status: str
    created_at: datetime
    revoked_at: datetime | None

    def covers(self, action: str, at: datetime) -> bool:
        return (
            self.status == ACTIVE
            and action in self.actions
            and self.start_at <= at
            and (self.end_at is None or at < self.end_at)
        )


def consent_record(row: Any) -> ConsentRecord:
    return ConsentRecord(
        row.consent_id,
        row.subject_ref,
        row.purpose,
        row.category,
        tuple(json.loads(row.actions)),
        utc(row.start_at),  # type: ignore[arg-type]
        utc(row.end_at),
        row.policy_version,
        row.status,
        utc(row.created_at),  # type: ignore[arg-type]
        utc(row.revoked_at),
    )


class CatalogBase:
    """What every part of the catalog shares: the engine, its dialect, the hot
    statements, and transactions."""

    url: str
    engine: Engine
    dialect: str
    on_stale: Callable[[], None] | None  # counts refused stale jobs
    _sql: dict[str, str]  # the hot statements (``compile``)

    def compile(self, statements: dict[str, Any], positional: Iterable[str] = ()) -> dict[str, str]:
        """Compile SQLAlchemy Core statements once for this dialect (``keyshred.db.
        compile_sql``), with named parameters (``:name`` on SQLite, ``%(name)s`` on
        psycopg, bound with a dict); on SQLite those ``positional`` names are bound
        by position (``?``, a tuple: cheaper per row). Run them with ``hot``."""
        dialect = self.engine.dialect
        keep = set(positional) if self.dialect == "sqlite" else set()
        return {
            name: db.compile_sql(dialect, stmt, positional=name in keep)
            for name, stmt in statements.items()
        }

    def _hot(self, write: bool, snapshot: bool = False) -> Any:
        """A DBAPI cursor on a connection checked out of the pool for one operation,
        in a transaction for writes (``keyshred.db.cursor``)."""
        return db.cursor(self.engine, write=write, snapshot=snapshot)

    def hot(self, write: bool, *, snapshot: bool = False) -> Any:
        """A DBAPI cursor on a pooled connection, in a transaction for writes
        (``BEGIN IMMEDIATE`` on SQLite): for statements from ``compile``. A read
        with ``snapshot`` sees one instant across its statements."""
        return self._hot(write, snapshot)

    def scrub(self) -> None:
        """After deleting ciphertext: on SQLite checkpoint and truncate the WAL, so
        the deleted rows' old pages are in no file (``secure_delete`` zeroes them in
        the database itself). Retried briefly if a reader holds the WAL."""
        if self.dialect != "sqlite":
            return
        for _ in range(50):
            with self._hot(write=False) as cur:
                busy, _, _ = cur.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            if not busy:
                return
            time.sleep(0.01)

    def _write(self) -> AbstractContextManager[Connection]:
        return db.write(self.engine)

    def transaction(self) -> Any:
        """A write transaction (``BEGIN IMMEDIATE`` on SQLite) as a context manager
        (typed ``Any`` as it always was: its callers index driver results freely)."""
        return db.write(self.engine)

    def read(self) -> AbstractContextManager[Connection]:
        """A read transaction (a plain ``BEGIN``: it waits for no writer, where
        ``transaction``'s ``BEGIN IMMEDIATE`` does)."""
        return db.read(self.engine)

    def insert_ignore(self, table: sa.Table) -> Any:
        """``INSERT … ON CONFLICT DO NOTHING`` in this dialect."""
        if self.dialect == "postgresql":
            from sqlalchemy.dialects import postgresql

            return postgresql.insert(table).on_conflict_do_nothing()
        from sqlalchemy.dialects import sqlite

        return sqlite.insert(table).on_conflict_do_nothing()


def chunks(items: Sequence[_T], size: int = 500) -> Iterator[list[_T]]:
    for start in range(0, len(items), size):
        yield list(items[start : start + size])
