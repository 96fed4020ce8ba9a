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

import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from keyshred._extras import require
from keyshred.errors import ConfigError
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
    UNIQUE (subject_ref, scope)
);
CREATE INDEX IF NOT EXISTS ks_dek_epoch ON ks_dek (kek_epoch);
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


class PostgresKeyStore(_SqlKeyStore):
    """Wrapped DEKs, tombstones and wrapped secrets in PostgreSQL."""

    _mark = "%s"
    _prefix = "ks_"

    def __init__(self, url: str) -> None:
        self._psycopg = require("psycopg", extra="postgres")
        self._dsn = _dsn(url)
        self._lock = threading.Lock()
        self._local = threading.local()
        self._conns: list[Any] = []
        try:
            with self._tx() as cur:
                cur.execute(_PG_SCHEMA)
        except self._psycopg.OperationalError:
            raise ConfigError("the PostgreSQL key store cannot be reached") from None

    # -- connections -----------------------------------------------------------------

    def _conn(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None or conn.closed:
            conn = self._psycopg.connect(self._dsn, autocommit=False)
            self._local.conn = conn
            with self._lock:
                self._conns.append(conn)
        return conn

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        conn = self._conn()
        try:
            with conn.cursor() as cur:
                yield cur
            conn.commit()
        except BaseException:
            conn.rollback()
            raise

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

    def destroy(self, key_ids: Sequence[bytes], tombstone: Tombstone) -> int:
        with self._tx() as cur:
            cur.execute("DELETE FROM ks_dek WHERE key_id = ANY(%s)", (list(key_ids),))
            deleted = int(cur.rowcount or 0)
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
        with self._psycopg.connect(self._dsn, autocommit=False) as conn:
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            dek = conn.execute(f"SELECT {_DEK_COLUMNS} FROM ks_dek").fetchall()  # noqa: S608
            tombs = conn.execute(
                "SELECT tombstone_id, subject_ref, scope, erased_at FROM ks_tombstone"
            ).fetchall()
            tkeys = conn.execute("SELECT key_id, tombstone_id FROM ks_tombstone_key").fetchall()
            secrets = conn.execute(
                "SELECT name, kek_provider, kek_epoch, wrapped FROM ks_secret"
            ).fetchall()
            conn.rollback()
        db = sqlite3.connect(":memory:")
        try:
            db.executescript(_SCHEMA)
            db.executemany(
                "INSERT INTO dek VALUES (?,?,?,?,?,?,?,?)",
                [(bytes(k), t, r, s, p, e, bytes(w), _ts(c)) for k, t, r, s, p, e, w, c in dek],
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
        with self._lock:
            for conn in self._conns:
                try:
                    conn.close()
                except self._psycopg.Error:
                    continue
            self._conns.clear()
        self._local = threading.local()

    def __repr__(self) -> str:
        return "PostgresKeyStore()"
