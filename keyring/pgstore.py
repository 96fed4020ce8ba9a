"""``PostgresKeyStore``: the distributed profile's key store (``keyshred[postgres]``).

Same contract as ``SQLiteKeyStore`` (see ``keyshred.keyring.keystore``), on
PostgreSQL through psycopg, so several stateless workers on several machines share
one set of wrapped DEKs and tombstones:

- one live DEK per (subject_ref, scope) by a unique constraint (``INSERT … ON
  CONFLICT DO NOTHING``, then read back: the first writer wins everywhere);
- ``destroy`` deletes the keys and writes the tombstone in one transaction;
- ``snapshot`` reads every table in one ``REPEATABLE READ`` transaction and returns
  an embedded (SQLite) key store image, which is what backups seal and restores open.

PostgreSQL keeps a deleted row's bytes in the table file until ``VACUUM`` reuses the
space (a dead tuple), and in its WAL; ``destroy`` runs ``VACUUM`` on the key table
afterwards, which frees the space but does not overwrite it. What still bounds those
copies is the KEK: a wrapped DEK is useless once its epoch is destroyed, which the
backup schedule does (``ks.backup.maintain``).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.pool import QueuePool

from keyshred._extras import require
from keyshred._pooling import replace_hung_up, unreachable
from keyshred.errors import BackendUnavailable, ConfigError
from keyshred.keyring.keystore import (
    _DEK_COLUMNS,
    _SCHEMA,
    KeyRecord,
    Tombstone,
    _record,
    _SqlKeyStore,
    _ts,
)

__all__ = ["PostgresKeyStore"]

_PG_SCHEMA = """
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
"""


def _dsn(url: str) -> str:
    """A libpq connection string from a SQLAlchemy-style or libpq URL."""
    for prefix in ("postgresql+psycopg://", "postgresql+psycopg2://"):
        if url.startswith(prefix):
            return "postgresql://" + url[len(prefix) :]
    if url.startswith(("postgresql://", "postgres://")) or "=" in url:
        return url
    raise ConfigError("keyring.store_url is a postgresql:// URL")


# A store from before owner sets: the column, and the unique key moved from
# (subject_ref, scope) to (subject_ref, scope, owner_tag). Run only when the column is
# missing (ALTER TABLE locks the table even when it changes nothing).
_PG_MIGRATE_OWNERS = """
LOCK TABLE ks_dek IN ACCESS EXCLUSIVE MODE;
ALTER TABLE ks_dek ADD COLUMN IF NOT EXISTS owner_tag TEXT NOT NULL DEFAULT '';
ALTER TABLE ks_dek DROP CONSTRAINT IF EXISTS ks_dek_subject_ref_scope_key;
"""
_PG_HAS_OWNERS = (
    "SELECT 1 FROM information_schema.columns WHERE table_schema = current_schema() "
    "AND table_name = 'ks_dek' AND column_name = 'owner_tag'"
)


class PostgresKeyStore(_SqlKeyStore):
    """Wrapped DEKs, tombstones and wrapped secrets in PostgreSQL."""

    _mark = "%s"
    _prefix = "ks_"

    def __init__(
        self,
        url: str,
        *,
        pool_size: int = 2,
        max_overflow: int = 8,
        pool_timeout: float = 30.0,
        pre_ping: bool = False,
    ) -> None:
        self._psycopg = require("psycopg", extra="postgres")
        self._dsn = _dsn(url)
        # One bounded pool (SQLAlchemy's, over psycopg): a connection is checked
        # out for one transaction and returned, and replaced at checkout if its
        # server hung up (``keyshred._pooling``), so a restarted server costs a
        # reconnect instead of every later call.
        self._engine = sa.create_engine(
            "postgresql+psycopg://",
            creator=self._connect,
            poolclass=QueuePool,
            pool_size=pool_size,
            max_overflow=max_overflow,
            pool_timeout=pool_timeout,
            pool_pre_ping=pre_ping,
        )
        replace_hung_up(self._engine)
        _STORES.add(self)
        try:
            with self._tx() as cur:
                cur.execute(
                    "SELECT 1 FROM information_schema.tables WHERE table_schema = "
                    "current_schema() AND table_name = 'ks_dek'"
                )
                if cur.fetchone() is not None:
                    cur.execute(_PG_HAS_OWNERS)
                    if cur.fetchone() is None:
                        cur.execute(_PG_MIGRATE_OWNERS)
                cur.execute(_PG_SCHEMA)
        except BackendUnavailable:
            self._engine.dispose()
            raise ConfigError("the PostgreSQL key store cannot be reached") from None

    # -- connections -----------------------------------------------------------------

    def _connect(self) -> Any:
        return self._psycopg.connect(self._dsn, autocommit=False)

    def _unreachable(self, exc: BaseException) -> bool:
        """Whether a driver error means the server cannot be reached (refused or
        dropped connection, no pooled connection free), not a conflict or a bug."""
        return unreachable("postgresql", self._psycopg, exc)

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        """A cursor in one transaction on a pooled connection, returned afterwards
        (dropped from the pool if the driver found it broken)."""
        try:
            fairy = self._engine.raw_connection()
        except Exception as exc:
            if self._unreachable(exc):
                raise self._unavailable(exc) from None
            raise
        conn: Any = fairy.driver_connection
        try:
            try:
                with conn.cursor() as cur:
                    yield cur
                conn.commit()
            except BaseException:
                with contextlib.suppress(Exception):  # a dead connection cannot
                    conn.rollback()
                raise
        except Exception as exc:
            if not self._unreachable(exc):
                raise
            if conn.closed:
                fairy.invalidate()
            raise self._unavailable(exc) from None
        finally:
            fairy.close()

    @staticmethod
    def _unavailable(exc: BaseException) -> BackendUnavailable:
        # The driver's message is left out: it can quote a statement's parameters.
        return BackendUnavailable(
            f"the PostgreSQL key store cannot be reached ({type(exc).__name__})"
        )

    def _query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._tx() as cur:
            cur.execute(sql, tuple(args))
            return list(cur.fetchall())

    def _bind_time(self, value: datetime) -> datetime:
        return value

    # -- keys ------------------------------------------------------------------------

    def get_many(self, key_ids: Sequence[bytes]) -> dict[bytes, KeyRecord]:
        if not key_ids:
            return {}
        rows = self._query(
            f"SELECT {_DEK_COLUMNS} FROM ks_dek WHERE key_id = ANY(%s)",  # noqa: S608
            (list(key_ids),),
        )
        return {bytes(r[0]): _record(r) for r in rows}

    def owners_of(self, key_ids: Sequence[bytes]) -> dict[bytes, tuple[str, ...]]:
        if not key_ids:
            return {}
        rows = self._query(
            "SELECT key_id, array_agg(owner_ref ORDER BY owner_ref) FROM ks_dek_owner "
            "WHERE key_id = ANY(%s) GROUP BY key_id",
            (list(key_ids),),
        )
        return {bytes(k): tuple(str(o) for o in owners) for k, owners in rows}

    def destroy(self, key_ids: Sequence[bytes], tombstone: Tombstone) -> int:
        with self._tx() as cur:
            cur.execute("DELETE FROM ks_dek WHERE key_id = ANY(%s)", (list(key_ids),))
            deleted = int(cur.rowcount or 0)
            cur.execute("DELETE FROM ks_dek_owner WHERE key_id = ANY(%s)", (list(key_ids),))
            cur.execute(
                "INSERT INTO ks_tombstone VALUES (%s,%s,%s,%s) ON CONFLICT DO NOTHING",
                (
                    tombstone.tombstone_id,
                    tombstone.subject_ref,
                    tombstone.scope,
                    tombstone.erased_at,
                ),
            )
            cur.executemany(
                "INSERT INTO ks_tombstone_key VALUES (%s,%s) ON CONFLICT DO NOTHING",
                [(k, tombstone.tombstone_id) for k in tombstone.key_ids],
            )
        self._vacuum()
        return deleted

    def _vacuum(self) -> None:
        """Free the deleted rows' space (VACUUM runs outside a transaction)."""
        try:
            with self._psycopg.connect(self._dsn, autocommit=True) as conn:
                conn.execute("VACUUM ks_dek")
        except self._psycopg.Error:
            pass  # autovacuum does it later; the KEK epoch bounds the copies anyway

    # -- tombstones --------------------------------------------------------------------

    def _tombstones(self, where: str, args: Sequence[Any]) -> list[Tombstone]:
        # ``where`` is one of this module's constants, never input.
        rows = self._query(
            "SELECT t.tombstone_id, t.subject_ref, t.scope, t.erased_at, "  # noqa: S608
            "COALESCE(array_agg(k.key_id ORDER BY k.key_id) "
            "FILTER (WHERE k.key_id IS NOT NULL), '{}') "
            "FROM ks_tombstone t LEFT JOIN ks_tombstone_key k "
            "ON k.tombstone_id = t.tombstone_id "
            f"{where} GROUP BY t.tombstone_id ORDER BY t.erased_at, t.tombstone_id",
            args,
        )
        return [
            Tombstone(
                str(tid),
                str(ref),
                None if scope is None else str(scope),
                tuple(bytes(k) for k in keys),
                erased,
            )
            for tid, ref, scope, erased, keys in rows
        ]

    def tombstone_for(self, key_id: bytes) -> Tombstone | None:
        found = self._tombstones(
            "WHERE t.tombstone_id = (SELECT tombstone_id FROM ks_tombstone_key WHERE key_id = %s)",
            (key_id,),
        )
        return found[0] if found else None

    def tombstones(self, since: datetime | None = None) -> list[Tombstone]:
        if since is None:
            return self._tombstones("", ())
        return self._tombstones("WHERE t.erased_at > %s", (since,))

    # -- snapshots -----------------------------------------------------------------------

    def snapshot(self) -> bytes:
        with self._tx() as cur:  # its first statement: before any read
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            dek = cur.execute(f"SELECT {_DEK_COLUMNS} FROM ks_dek").fetchall()  # noqa: S608
            tombs = cur.execute(
                "SELECT tombstone_id, subject_ref, scope, erased_at FROM ks_tombstone"
            ).fetchall()
            tkeys = cur.execute("SELECT key_id, tombstone_id FROM ks_tombstone_key").fetchall()
            owners = cur.execute("SELECT owner_ref, key_id FROM ks_dek_owner").fetchall()
            secrets = cur.execute(
                "SELECT name, kek_provider, kek_epoch, wrapped FROM ks_secret"
            ).fetchall()
        db = sqlite3.connect(":memory:")
        try:
            db.executescript(_SCHEMA)
            db.executemany(
                f"INSERT INTO dek ({_DEK_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?)",  # noqa: S608
                [
                    (bytes(k), t, r, s, p, e, bytes(w), _ts(c), g)
                    for k, t, r, s, p, e, w, c, g in dek
                ],
            )
            db.executemany(
                "INSERT INTO dek_owner (owner_ref, key_id) VALUES (?,?)",
                [(o, bytes(k)) for o, k in owners],
            )
            db.executemany(
                "INSERT INTO tombstone VALUES (?,?,?,?)",
                [(i, r, s, _ts(at)) for i, r, s, at in tombs],
            )
            db.executemany(
                "INSERT INTO tombstone_key VALUES (?,?)", [(bytes(k), i) for k, i in tkeys]
            )
            db.executemany(
                "INSERT INTO secret VALUES (?,?,?,?)",
                [(n, p, e, bytes(w)) for n, p, e, w in secrets],
            )
            db.commit()
            return bytes(db.serialize())
        finally:
            db.close()

    def close(self) -> None:
        self._engine.dispose()

    def _forked(self) -> None:
        """In a forked child: the parent's pooled connections stay the parent's (a
        connection must not cross a fork); the child opens its own."""
        self._engine.dispose(close=False)

    def __repr__(self) -> str:
        return "PostgresKeyStore()"


_STORES: weakref.WeakSet[PostgresKeyStore] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for store in list(_STORES):
        store._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)
