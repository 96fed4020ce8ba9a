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
from datetime import UTC, datetime
from typing import Any

from keyshred._extras import require
from keyshred.errors import ConfigError, KeyshredError
from keyshred.keyring.keystore import (
    _SCHEMA,
    KeyRecord,
    KeyStore,
    SecretRecord,
    Tombstone,
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

_COLS = "key_id, tenant, subject_ref, scope, kek_provider, kek_epoch, wrapped, created_at"


def _record(row: Sequence[Any]) -> KeyRecord:
    key_id, tenant, subject_ref, scope, provider, epoch, wrapped, created = row
    return KeyRecord(
        bytes(key_id),
        str(tenant),
        str(subject_ref),
        str(scope),
        str(provider),
        int(epoch),
        bytes(wrapped),
        created if created.tzinfo else created.replace(tzinfo=UTC),
    )


def _dsn(url: str) -> str:
    """A libpq connection string from a SQLAlchemy-style or libpq URL."""
    for prefix in ("postgresql+psycopg://", "postgresql+psycopg2://"):
        if url.startswith(prefix):
            return "postgresql://" + url[len(prefix) :]
    if url.startswith(("postgresql://", "postgres://")) or "=" in url:
        return url
    raise ConfigError("keyring.store_url is a postgresql:// URL")


class PostgresKeyStore(KeyStore):
    """Wrapped DEKs, tombstones and wrapped secrets in PostgreSQL."""

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

    # -- keys ------------------------------------------------------------------------

    def get(self, key_id: bytes) -> KeyRecord | None:
        rows = self._query(f"SELECT {_COLS} FROM ks_dek WHERE key_id = %s", (key_id,))  # noqa: S608
        return _record(rows[0]) if rows else None

    def get_many(self, key_ids: Sequence[bytes]) -> dict[bytes, KeyRecord]:
        if not key_ids:
            return {}
        rows = self._query(
            f"SELECT {_COLS} FROM ks_dek WHERE key_id = ANY(%s)",  # noqa: S608
            (list(key_ids),),
        )
        return {bytes(r[0]): _record(r) for r in rows}

    def find(self, subject_ref: str, scope: str) -> KeyRecord | None:
        rows = self._query(
            f"SELECT {_COLS} FROM ks_dek WHERE subject_ref = %s AND scope = %s",  # noqa: S608
            (subject_ref, scope),
        )
        return _record(rows[0]) if rows else None

    def for_subject(self, subject_ref: str, scope: str | None = None) -> list[KeyRecord]:
        if scope is None:
            rows = self._query(
                f"SELECT {_COLS} FROM ks_dek WHERE subject_ref = %s",  # noqa: S608
                (subject_ref,),
            )
        else:
            rows = self._query(
                f"SELECT {_COLS} FROM ks_dek WHERE subject_ref = %s AND scope = %s",  # noqa: S608
                (subject_ref, scope),
            )
        return [_record(r) for r in rows]

    def insert(self, record: KeyRecord) -> KeyRecord:
        with self._tx() as cur:
            cur.execute(
                f"INSERT INTO ks_dek ({_COLS}) VALUES (%s,%s,%s,%s,%s,%s,%s,%s) "  # noqa: S608
                "ON CONFLICT DO NOTHING",
                (
                    record.key_id,
                    record.tenant,
                    record.subject_ref,
                    record.scope,
                    record.kek_provider,
                    record.kek_epoch,
                    record.wrapped,
                    record.created_at,
                ),
            )
        existing = self.find(record.subject_ref, record.scope)
        if existing is None:  # pragma: no cover - only if destroyed in between
            raise KeyshredError("the key was destroyed while it was being created")
        return existing

    def older_than(self, epoch: int, limit: int) -> list[KeyRecord]:
        rows = self._query(
            f"SELECT {_COLS} FROM ks_dek WHERE kek_epoch < %s LIMIT %s",  # noqa: S608
            (epoch, limit),
        )
        return [_record(r) for r in rows]

    def update_wrapped(self, updates: Sequence[tuple[bytes, int, bytes]]) -> None:
        with self._tx() as cur:
            cur.executemany(
                "UPDATE ks_dek SET kek_epoch = %s, wrapped = %s WHERE key_id = %s",
                [(epoch, wrapped, key_id) for key_id, epoch, wrapped in updates],
            )

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

    def is_tombstoned(self, subject_ref: str, scope: str) -> bool:
        return bool(
            self._query(
                "SELECT 1 FROM ks_tombstone WHERE subject_ref = %s "
                "AND (scope IS NULL OR scope = %s) LIMIT 1",
                (subject_ref, scope),
            )
        )

    # -- secrets -------------------------------------------------------------------------

    def get_secret(self, name: str) -> SecretRecord | None:
        rows = self._query(
            "SELECT name, kek_provider, kek_epoch, wrapped FROM ks_secret WHERE name = %s", (name,)
        )
        if not rows:
            return None
        n, provider, epoch, wrapped = rows[0]
        return SecretRecord(str(n), str(provider), int(epoch), bytes(wrapped))

    def put_secret(self, record: SecretRecord, *, replace: bool = False) -> SecretRecord:
        conflict = (
            "ON CONFLICT (name) DO UPDATE SET kek_provider = EXCLUDED.kek_provider, "
            "kek_epoch = EXCLUDED.kek_epoch, wrapped = EXCLUDED.wrapped"
            if replace
            else "ON CONFLICT (name) DO NOTHING"
        )
        with self._tx() as cur:
            cur.execute(
                f"INSERT INTO ks_secret VALUES (%s,%s,%s,%s) {conflict}",  # noqa: S608
                (record.name, record.kek_provider, record.kek_epoch, record.wrapped),
            )
        stored = self.get_secret(record.name)
        assert stored is not None  # noqa: S101 - just written in a committed transaction
        return stored

    def secrets(self) -> list[SecretRecord]:
        return [
            SecretRecord(str(n), str(p), int(e), bytes(w))
            for n, p, e, w in self._query(
                "SELECT name, kek_provider, kek_epoch, wrapped FROM ks_secret ORDER BY name"
            )
        ]

    def counts(self) -> dict[str, int]:
        out = {}
        for name, table in (
            ("dek", "ks_dek"),
            ("tombstone", "ks_tombstone"),
            ("secret", "ks_secret"),
        ):
            out[name] = int(self._query(f"SELECT COUNT(*) FROM {table}")[0][0])  # noqa: S608
        return out

    # -- snapshots -----------------------------------------------------------------------

    def snapshot(self) -> bytes:
        with self._psycopg.connect(self._dsn, autocommit=False) as conn:
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            dek = conn.execute(f"SELECT {_COLS} FROM ks_dek").fetchall()  # noqa: S608
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

            def ts(value: datetime) -> str:
                return value.astimezone(UTC).isoformat(timespec="microseconds")

            db.executemany(
                "INSERT INTO dek VALUES (?,?,?,?,?,?,?,?)",
                [(bytes(k), t, r, s, p, e, bytes(w), ts(c)) for k, t, r, s, p, e, w, c in dek],
            )
            db.executemany(
                "INSERT INTO tombstone VALUES (?,?,?,?)",
                [(i, r, s, ts(at)) for i, r, s, at in tombs],
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
