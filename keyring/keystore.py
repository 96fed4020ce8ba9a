"""The key store: wrapped DEKs, tombstones and wrapped system secrets.

``KeyStore`` is the interface; ``SqlKeyStore`` its one implementation, on SQLAlchemy
Core (``keyshred.db``) for the embedded profile's SQLite file and the distributed
profile's PostgreSQL (tables: ``keyshred.keyring.schema``; schema changes: Alembic
revisions in ``keyshred.keyring.migrations``). ``SQLiteKeyStore(path)`` and
``keyshred.keyring.pgstore.PostgresKeyStore(url)`` are its two constructors. The store
only ever holds *wrapped* key material and pseudonymous names: a key id, a
subject_ref, a scope, the KEK epoch. It never sees a subject id or a plaintext DEK.

SQLite specifics that matter for erasure:

- ``secure_delete=ON`` overwrites deleted rows with zeros in the database file;
- after a destroy the WAL is checkpointed and truncated, so the wrapped DEK's bytes
  are in neither the database nor its ``-wal`` file (tests scan both).

PostgreSQL keeps a deleted row's bytes until ``VACUUM`` reuses the space, and in its
WAL: ``destroy`` runs ``VACUUM`` afterwards (see ``keyshred.keyring.pgstore``).

Destroying keys and writing their tombstone happen in one transaction, so a crash can
never leave a key deleted without the tombstone that lets restores replay it. One
live DEK per (subject_ref, scope, owner set) is a unique index: ``INSERT … ON CONFLICT
DO NOTHING``, then read back, so the first writer wins across processes and machines.
``snapshot`` returns an embedded (SQLite) key store image (read in one ``REPEATABLE
READ`` transaction on PostgreSQL), which is what backups seal and restores open.

Above 600 lines because it holds the whole key store: the interface (about 260 lines
of records and documented abstract methods), its one implementation, and the three
in-memory operations on snapshot images that backups use; splitting the images out
(``keyring/images.py``) is the next step.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from keyshred import db
from keyshred._pooling import sqlite_busy
from keyshred.errors import (
    BackendUnavailable,
    ConfigError,
    IntegrityError,
    KekEpochDestroyed,
    KeyshredError,
)
from keyshred.keyring import schema
from keyshred.keyring.migrations import statements as migration_statements
from keyshred.keyring.migrations import unversioned_to_0001
from keyshred.keyring.schema import timestamp

__all__ = [
    "EpochKeyRecord",
    "KeyRecord",
    "KeyStore",
    "SQLiteKeyStore",
    "SecretRecord",
    "SqlKeyStore",
    "Tombstone",
    "owner_subject",
    "owner_tag",
    "owner_token",
]


def owner_token(subject_ref: str, scope: str | None = None) -> str:
    """How an owner is named in a key's owner set: ``ref`` for the whole subject (a
    mention: the data is about the person), ``ref@scope`` for its data in one scope
    (the source of a derived asset), so withdrawing consent for that scope destroys
    the keys of what was derived from it, and erasing the subject destroys both."""
    return subject_ref if scope is None else f"{subject_ref}@{scope}"


def owner_subject(token: str) -> str:
    """The subject_ref of an owner token (subject_refs never hold ``@``)."""
    return token.split("@", 1)[0]


def owner_tag(owners: Sequence[str]) -> str:
    """The name of an owner set in the key store's unique key: ``""`` for a holder's
    own scope key, else a hash of the sorted other owners (a set of any size fits an
    index; the owners themselves are listed in the owner table)."""
    if not owners:
        return ""
    joined = "\x00".join(sorted(set(owners))).encode("utf-8")
    return hashlib.sha256(b"keyshred/owner-set\x00" + joined).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """One wrapped DEK: the only form in which a DEK is ever stored."""

    key_id: bytes
    tenant: str
    subject_ref: str
    scope: str
    kek_provider: str
    kek_epoch: int
    wrapped: bytes
    created_at: datetime
    # ``owner_tag(owners)``: "" for the holder's own scope key. The other owners
    # (subjects the data under this key is about) are in ``owners`` when the record
    # was built for an insert or read with ``owned_by``/``owners_of``.
    owner_tag: str = ""
    owners: tuple[str, ...] = ()

    def __repr__(self) -> str:
        shared = f", shared_by={len(self.owners) or '?'}" if self.owner_tag else ""
        return (
            f"KeyRecord(key_id={self.key_id.hex()!r}, subject_ref={self.subject_ref!r}, "
            f"scope={self.scope!r}, kek={self.kek_provider}:{self.kek_epoch}{shared})"
        )


@dataclass(frozen=True, slots=True)
class SecretRecord:
    """A wrapped system secret (subject-ref key, receipt signing key, ...)."""

    name: str
    kek_provider: str
    kek_epoch: int
    wrapped: bytes

    def __repr__(self) -> str:
        return f"SecretRecord(name={self.name!r}, kek={self.kek_provider}:{self.kek_epoch})"


@dataclass(frozen=True, slots=True)
class EpochKeyRecord:
    """One epoch key of a KEK lineage (``live`` or ``archive``), wrapped by the
    provider's key version ``provider_epoch``. The epoch key wraps DEKs and system
    secrets locally; only it ever goes to the provider."""

    lineage: str
    epoch: int
    kek_provider: str
    provider_epoch: int
    wrapped: bytes
    created_at: datetime

    def __repr__(self) -> str:
        return (
            f"EpochKeyRecord(lineage={self.lineage!r}, epoch={self.epoch}, "
            f"kek={self.kek_provider}:{self.provider_epoch})"
        )


@dataclass(frozen=True, slots=True)
class Tombstone:
    """Proof that keys were destroyed: replayed against every restored key store."""

    tombstone_id: str
    subject_ref: str
    scope: str | None
    key_ids: tuple[bytes, ...]
    erased_at: datetime

    def __repr__(self) -> str:
        return (
            f"Tombstone(id={self.tombstone_id!r}, subject_ref={self.subject_ref!r}, "
            f"scope={self.scope!r}, keys={len(self.key_ids)}, erased_at={self.erased_at})"
        )


class KeyStore(ABC):
    """Persistence for wrapped DEKs, tombstones and wrapped system secrets."""

    @abstractmethod
    def get(self, key_id: bytes) -> KeyRecord | None: ...

    @abstractmethod
    def get_many(self, key_ids: Sequence[bytes]) -> dict[bytes, KeyRecord]: ...

    @abstractmethod
    def find(self, subject_ref: str, scope: str, tag: str = "") -> KeyRecord | None:
        """The live DEK of (holder subject_ref, scope, owner set tag), if any."""

    @abstractmethod
    def for_subject(self, subject_ref: str, scope: str | None = None) -> list[KeyRecord]:
        """Every DEK the subject holds (of one scope, or all), whatever its owners."""

    @abstractmethod
    def owned_by(self, subject_ref: str, scope: str | None = None) -> list[KeyRecord]:
        """Every DEK other subjects hold that ``subject_ref`` co-owns (its
        ``owners`` filled in): what the subject's erasure destroys besides its own.
        With ``scope``: the keys co-owned by its data in that scope only
        (``owner_token(ref, scope)``), what withdrawing that scope destroys."""

    @abstractmethod
    def owners_of(self, key_ids: Sequence[bytes]) -> dict[bytes, tuple[str, ...]]:
        """The other owners of each shared key (keys without other owners are absent)."""

    @abstractmethod
    def insert(self, record: KeyRecord) -> KeyRecord:
        """Insert (with its ``owners``), or return the record another writer inserted
        first for the same (subject_ref, scope, owner_tag): exactly one live DEK per
        owner set, even across processes."""

    @abstractmethod
    def older_than(self, epoch: int, limit: int) -> list[KeyRecord]:
        """Up to ``limit`` records wrapped by an epoch below ``epoch``."""

    @abstractmethod
    def update_wrapped(
        self,
        updates: Sequence[tuple[bytes, int, bytes]],
        *,
        kek_provider: str | None = None,
        live_epoch: int | None = None,
    ) -> None:
        """Replace (key_id, epoch, wrapped) after a re-wrap (and the wrapping
        provider's name, if given). With ``live_epoch``, only while that live epoch
        key still exists (checked in the same transaction): ``KekEpochDestroyed``
        otherwise, so nothing is ever re-wrapped under a destroyed epoch."""

    @abstractmethod
    def wrapped_by(self, kek_provider: str, limit: int) -> list[KeyRecord]:
        """Up to ``limit`` records whose ``kek_provider`` is exactly this one."""

    @abstractmethod
    def destroy(self, key_ids: Sequence[bytes], tombstone: Tombstone) -> int:
        """Delete the keys and record the tombstone atomically; returns keys deleted."""

    @abstractmethod
    def tombstone_for(self, key_id: bytes) -> Tombstone | None: ...

    @abstractmethod
    def tombstones(self, since: datetime | None = None) -> list[Tombstone]: ...

    @abstractmethod
    def tombstone(self, tombstone_id: str) -> Tombstone | None:
        """The tombstone of that id, if one was written."""

    @abstractmethod
    def is_tombstoned(self, subject_ref: str, scope: str) -> bool:
        """Whether keys of (subject_ref, scope) were destroyed (subject-wide or scope)."""

    @abstractmethod
    def get_secret(self, name: str) -> SecretRecord | None: ...

    @abstractmethod
    def put_secret(self, record: SecretRecord, *, replace: bool = False) -> SecretRecord:
        """Store a secret; without ``replace`` an existing one wins and is returned."""

    @abstractmethod
    def secrets(self) -> list[SecretRecord]: ...

    @abstractmethod
    def delete_secret(self, name: str) -> bool:
        """Delete a secret (a rotated identifier key version); True if it existed."""

    @abstractmethod
    def counts(self) -> dict[str, int]:
        """Row counts for status output (keys, tombstones, secrets)."""

    # -- epoch keys (two-level KEK lineages) ----------------------------------------

    @abstractmethod
    def epoch_keys(self, lineage: str) -> list[EpochKeyRecord]:
        """The epoch keys of a lineage, oldest first."""

    @abstractmethod
    def insert_epoch_key(self, record: EpochKeyRecord) -> EpochKeyRecord:
        """Insert, or return the one another writer inserted first for the same
        (lineage, epoch)."""

    @abstractmethod
    def destroy_epoch_keys(self, lineage: str, before: int, markers: Sequence[str]) -> list[int]:
        """Delete the epoch keys of ``lineage`` older than ``before`` and return their
        epochs, in one transaction that refuses (``EpochInUse``, nothing deleted)
        while a key or secret wrapped by one of ``markers`` is still under an epoch
        older than ``before``."""

    @abstractmethod
    def snapshot(self) -> bytes:
        """A consistent copy of the whole store as an embedded (SQLite) key store
        file: what a backup seals under the current KEK epoch."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release resources."""


_DEK_COLUMNS = (
    "key_id, tenant, subject_ref, scope, kek_provider, kek_epoch, wrapped, created_at, owner_tag"
)
_EPOCH_COLUMNS = "lineage, epoch, kek_provider, provider_epoch, wrapped, created_at"
LIVE_LINEAGE = "live"
_CHUNK = 500  # keys per IN (...) list: under SQLite's bound-parameter limit


def _aware(value: datetime | str) -> datetime:
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _altered(what: str) -> IntegrityError:
    # The value is not quoted: it is (part of) a wrapped key.
    return IntegrityError(
        f"a {what} row of the key store does not hold its columns' types "
        "(the table was altered by hand)"
    )


def _record(row: Sequence[Any]) -> KeyRecord:
    """A key row (columns in ``_DEK_COLUMNS`` order); ``IntegrityError`` for a row
    whose columns were altered to other types."""
    key_id, tenant, subject_ref, scope, provider, epoch, wrapped, created, tag = row[:9]
    try:
        return KeyRecord(
            db.blob(key_id),
            str(tenant),
            str(subject_ref),
            str(scope),
            str(provider),
            int(epoch),
            db.blob(wrapped),
            _aware(created),
            str(tag or ""),
        )
    except (TypeError, ValueError):
        raise _altered("key") from None


def _epoch_record(row: Sequence[Any]) -> EpochKeyRecord:
    lineage, epoch, provider, provider_epoch, wrapped, created = row
    try:
        return EpochKeyRecord(
            str(lineage),
            int(epoch),
            str(provider),
            int(provider_epoch),
            db.blob(wrapped),
            _aware(created),
        )
    except (TypeError, ValueError):
        raise _altered("epoch key") from None


def _secret(row: Sequence[Any]) -> SecretRecord:
    name, provider, epoch, wrapped = row
    try:
        return SecretRecord(str(name), str(provider), int(epoch), db.blob(wrapped))
    except (TypeError, ValueError):
        raise _altered("secret") from None


def _chunks(items: Sequence[bytes]) -> Iterator[list[bytes]]:
    unique = list(dict.fromkeys(items))
    for start in range(0, len(unique), _CHUNK):
        yield unique[start : start + _CHUNK]


def engine_url(url: str) -> str:
    """The SQLAlchemy URL of a key store: ``sqlite:///path``, or PostgreSQL through
    psycopg (``postgresql://`` and ``postgres://`` URLs are taken as psycopg's)."""
    for prefix in ("postgresql+psycopg2://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    if url.startswith(("postgresql+psycopg://", "sqlite:///")):
        return url
    raise ConfigError("keyring.store_url is a postgresql:// URL")


class SqlKeyStore(KeyStore):
    """The key store on SQLAlchemy Core, one class for both dialects: the embedded
    profile's SQLite file (``sqlite:///…/keys/keystore.db``) and the distributed
    profile's PostgreSQL (``postgresql://…``), through ``keyshred.db.create_engine``
    (bounded pool; "database locked" and "server unreachable" raised as
    ``BackendUnavailable``). Opening brings the schema to the newest revision.

    ``busy_timeout`` (SQLite) is how many seconds a call waits for another process's
    lock before it raises ``BackendUnavailable``."""

    def __init__(
        self,
        url: str,
        *,
        pool_size: int = 2,
        max_overflow: int = 8,
        pool_timeout: float = 30.0,
        pre_ping: bool = False,
        busy_timeout: float = 30.0,
    ) -> None:
        self.engine = db.create_engine(
            engine_url(url),
            what="key store",
            pool_size=pool_size,
            max_overflow=max_overflow,
            pool_timeout=pool_timeout,
            pre_ping=pre_ping,
            busy_timeout_ms=int(busy_timeout * 1000),
        )
        self.dialect = self.engine.dialect.name
        self._pg = self.dialect == "postgresql"
        self._path = Path(db.sqlite_file(self.engine.url) or "") if not self._pg else None
        if not self._pg:
            # A key written is a key the data sealed under it needs: the commit is on
            # disk before the caller seals (WAL's NORMAL could lose it on power loss).
            sa.event.listen(self.engine, "connect", _synchronous_full)
        self._t = schema.tables(schema.prefix_for(self.dialect))
        self._insert = postgresql.insert if self._pg else sqlite.insert
        self._prepare()
        _STORES.add(self)
        try:
            with self._typed():
                self._open_schema()
        except BackendUnavailable:
            self.engine.dispose()
            if self._pg:
                raise ConfigError("the PostgreSQL key store cannot be reached") from None
            raise
        except sa.exc.DBAPIError:
            self.engine.dispose()
            raise KeyshredError(f"the key store at {self._where()} cannot be opened") from None
        except BaseException:  # refused (ConfigError): no pooled connection stays open
            self.engine.dispose()
            raise

    def _prepare(self) -> None:
        """The hot paths' statements, built once with bound parameters: building a
        statement per call cost more than running it (SQLAlchemy then finds the
        compiled form in its cache)."""
        d, e = self._t.dek.c, self._t.epoch_key.c
        self._get = self._dek_select.where(d.key_id == sa.bindparam("k"))
        self._find = self._dek_select.where(
            d.subject_ref == sa.bindparam("r"),
            d.scope == sa.bindparam("s"),
            d.owner_tag == sa.bindparam("g"),
        )
        self._guard = (
            sa.select(sa.literal(1))
            .where(e.lineage == LIVE_LINEAGE, e.epoch == sa.bindparam("e"))
            .with_for_update(read=True)
        )
        self._insert_dek = self._insert(self._t.dek).on_conflict_do_nothing()
        self._insert_owner = self._insert(self._t.dek_owner).on_conflict_do_nothing()
        self._get_secret = self._secret_select.where(self._t.secret.c.name == sa.bindparam("n"))
        # The two reads behind every cold unwrap and every new-subject put run as
        # driver SQL compiled once by SQLAlchemy, on a pooled connection without the
        # Connection/Result layers (keyshred.db.cursor): through them a lookup cost
        # 0.5 ms against 0.07 ms for the hand-written SQL this store replaced.
        dialect = self.engine.dialect
        self._get_sql = db.compile_sql(dialect, self._get)
        self._find_sql = db.compile_sql(dialect, self._find)

    def _where(self) -> str:
        return str(self._path) if self._path is not None else "PostgreSQL"

    def _open_schema(self) -> None:
        """Bring the tables to the newest revision; a store from before versioned
        migrations is first brought to revision 0001 as every open did before. A
        store already at the newest revision costs one read (``keyshred.db.migrate``)."""
        db.migrate(
            self.engine,
            schema.MIGRATIONS,
            schema.VERSION_TABLE,
            legacy_table=self._t.dek.name,
            legacy_revision="0001",
            prepare_legacy=unversioned_to_0001,
            head=schema.HEAD,
            models=self._t.metadata,  # a new store: built from the tables, stamped
            what="key store",
        )

    @property
    def path(self) -> Path:
        """The SQLite file (``KeyshredError`` on PostgreSQL)."""
        if self._path is None:
            raise KeyshredError("a PostgreSQL key store has no file")
        return self._path

    # -- transactions ----------------------------------------------------------------

    @contextmanager
    def _typed(self) -> Iterator[None]:
        """Pool exhaustion is ``BackendUnavailable`` too (the engine maps the
        driver's errors itself)."""
        try:
            yield
        except sa.exc.TimeoutError:
            raise db.unavailable(TimeoutError(), "key store") from None

    @contextmanager
    def _write(self) -> Iterator[sa.Connection]:
        """One write transaction (``BEGIN IMMEDIATE`` on SQLite)."""
        with self._typed(), db.write(self.engine) as conn:
            yield conn

    def _rows(
        self, statement: sa.Executable, params: dict[str, Any] | None = None
    ) -> list[tuple[Any, ...]]:
        with self._typed(), self.engine.connect() as conn:
            return [tuple(row) for row in conn.execute(statement, params)]

    def _guard_live_epoch(self, conn: sa.Connection, epoch: int) -> None:
        """Inside a write transaction: refuse to write under a live epoch whose key
        was destroyed (another process rotated and destroyed it meanwhile). Read
        under a share lock on PostgreSQL: a destroy of this epoch waits for the
        writer's commit and then sees its row (and refuses)."""
        if conn.execute(self._guard, {"e": epoch}).first() is None:
            raise KekEpochDestroyed(f"live KEK epoch {epoch} is destroyed")

    # -- keys ------------------------------------------------------------------------

    @property
    def _dek_select(self) -> sa.Select[Any]:
        d = self._t.dek.c
        return sa.select(
            d.key_id,
            d.tenant,
            d.subject_ref,
            d.scope,
            d.kek_provider,
            d.kek_epoch,
            d.wrapped,
            d.created_at,
            d.owner_tag,
        )

    def _hot_rows(self, sql: str, params: dict[str, Any]) -> list[Any]:
        with self._typed(), db.cursor(self.engine, write=False, what="key store") as cur:
            cur.execute(sql, params)
            return list(cur.fetchall())

    def get(self, key_id: bytes) -> KeyRecord | None:
        rows = self._hot_rows(self._get_sql, {"k": key_id})
        return _record(rows[0]) if rows else None

    def get_many(self, key_ids: Sequence[bytes]) -> dict[bytes, KeyRecord]:
        out: dict[bytes, KeyRecord] = {}
        for part in _chunks(key_ids):
            for row in self._rows(self._dek_select.where(self._t.dek.c.key_id.in_(part))):
                rec = _record(row)
                out[rec.key_id] = rec
        return out

    def find(self, subject_ref: str, scope: str, tag: str = "") -> KeyRecord | None:
        rows = self._hot_rows(self._find_sql, {"r": subject_ref, "s": scope, "g": tag})
        return _record(rows[0]) if rows else None

    def for_subject(self, subject_ref: str, scope: str | None = None) -> list[KeyRecord]:
        d = self._t.dek.c
        query = self._dek_select.where(d.subject_ref == subject_ref)
        if scope is not None:
            query = query.where(d.scope == scope)
        return [_record(r) for r in self._rows(query)]

    def owned_by(self, subject_ref: str, scope: str | None = None) -> list[KeyRecord]:
        o = self._t.dek_owner.c
        if scope is None:
            # The subject itself and every ``ref@scope`` of it: a range on the
            # primary key ("@" sorts just before "A"; subject_refs are lower-case
            # base32).
            who = sa.or_(
                o.owner_ref == subject_ref,
                sa.and_(o.owner_ref >= subject_ref + "@", o.owner_ref < subject_ref + "A"),
            )
        else:
            who = o.owner_ref == owner_token(subject_ref, scope)
        keys = sa.select(o.key_id).where(who)
        records = [
            _record(r) for r in self._rows(self._dek_select.where(self._t.dek.c.key_id.in_(keys)))
        ]
        owners = self.owners_of([r.key_id for r in records])
        return [replace(r, owners=owners.get(r.key_id, ())) for r in records]

    def owners_of(self, key_ids: Sequence[bytes]) -> dict[bytes, tuple[str, ...]]:
        o = self._t.dek_owner.c
        out: dict[bytes, list[str]] = {}
        for part in _chunks(key_ids):
            for kid, owner in self._rows(
                sa.select(o.key_id, o.owner_ref).where(o.key_id.in_(part))
            ):
                out.setdefault(bytes(kid), []).append(str(owner))
        return {k: tuple(sorted(v)) for k, v in out.items()}

    def insert(self, record: KeyRecord) -> KeyRecord:
        if owner_tag(record.owners) != record.owner_tag:
            raise KeyshredError("a key record's owner tag does not match its owners")
        with self._write() as conn:
            if record.kek_provider.endswith("@" + LIVE_LINEAGE):
                self._guard_live_epoch(conn, record.kek_epoch)
            conn.execute(
                self._insert_dek,
                {
                    "key_id": record.key_id,
                    "tenant": record.tenant,
                    "subject_ref": record.subject_ref,
                    "scope": record.scope,
                    "kek_provider": record.kek_provider,
                    "kek_epoch": record.kek_epoch,
                    "wrapped": record.wrapped,
                    "created_at": record.created_at,
                    "owner_tag": record.owner_tag,
                },
            )
            # In the same transaction: a shared key is never without its owner index
            # (an erasure finds it by any owner). Rows of a losing writer's key id
            # name a key that does not exist, and are removed below.
            if record.owners:
                conn.execute(
                    self._insert_owner,
                    [{"owner_ref": owner, "key_id": record.key_id} for owner in record.owners],
                )
        existing = self.find(record.subject_ref, record.scope, record.owner_tag)
        if existing is None:  # pragma: no cover - only if destroyed in between
            raise KeyshredError("the key was destroyed while it was being created")
        if existing.key_id != record.key_id and record.owners:
            with self._write() as conn:
                conn.execute(
                    sa.delete(self._t.dek_owner).where(self._t.dek_owner.c.key_id == record.key_id)
                )
        return replace(existing, owners=record.owners)

    def older_than(self, epoch: int, limit: int) -> list[KeyRecord]:
        query = self._dek_select.where(self._t.dek.c.kek_epoch < epoch).limit(limit)
        return [_record(r) for r in self._rows(query)]

    def update_wrapped(
        self,
        updates: Sequence[tuple[bytes, int, bytes]],
        *,
        kek_provider: str | None = None,
        live_epoch: int | None = None,
    ) -> None:
        d = self._t.dek
        values: dict[str, Any] = {"kek_epoch": sa.bindparam("e"), "wrapped": sa.bindparam("w")}
        if kek_provider is not None:
            values["kek_provider"] = kek_provider
        statement = d.update().where(d.c.key_id == sa.bindparam("k")).values(**values)
        with self._write() as conn:
            if live_epoch is not None:
                self._guard_live_epoch(conn, live_epoch)
            if updates:
                conn.execute(statement, [{"k": k, "e": e, "w": w} for k, e, w in updates])

    def wrapped_by(self, kek_provider: str, limit: int) -> list[KeyRecord]:
        query = self._dek_select.where(self._t.dek.c.kek_provider == kek_provider).limit(limit)
        return [_record(r) for r in self._rows(query)]

    def destroy(self, key_ids: Sequence[bytes], tombstone: Tombstone) -> int:
        d, o = self._t.dek, self._t.dek_owner
        deleted = 0
        with self._write() as conn:
            for part in _chunks(key_ids):
                deleted += int(conn.execute(d.delete().where(d.c.key_id.in_(part))).rowcount or 0)
                conn.execute(o.delete().where(o.c.key_id.in_(part)))
            conn.execute(
                self._insert(self._t.tombstone)
                .values(
                    tombstone_id=tombstone.tombstone_id,
                    subject_ref=tombstone.subject_ref,
                    scope=tombstone.scope,
                    erased_at=tombstone.erased_at,
                )
                .on_conflict_do_nothing()
            )
            if tombstone.key_ids:
                conn.execute(
                    self._insert(self._t.tombstone_key).on_conflict_do_nothing(),
                    [
                        {"key_id": k, "tombstone_id": tombstone.tombstone_id}
                        for k in tombstone.key_ids
                    ],
                )
        self._scrub(d)
        return deleted

    def _scrub(self, table: sa.Table) -> None:
        """After a delete: leave no copy of the deleted rows where this database can
        remove it. SQLite (``secure_delete`` zeroed the pages in the database file):
        checkpoint and truncate the WAL. PostgreSQL: ``VACUUM`` the table, which frees
        the dead tuples' space but does not overwrite it (see ``pgstore``)."""
        if self._pg:
            try:
                with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
                    c.exec_driver_sql(f"VACUUM {table.name}")  # one of the schema's tables
            except (sa.exc.DBAPIError, BackendUnavailable, sa.exc.TimeoutError):
                pass  # autovacuum does it later; the KEK epoch bounds the copies anyway
            return
        self._scrub_wal()

    def _scrub_wal(self) -> None:
        """Checkpoint and truncate the WAL so deleted rows leave no copy in it.

        A concurrent reader can make the checkpoint partial; retry briefly. If it
        still cannot complete, the wrapped keys stay in the WAL until the next
        checkpoint, and remain useless once their KEK epoch is destroyed.
        """
        for _ in range(50):
            # Outside any transaction (a pooled connection's own BEGIN would hold a
            # read snapshot the checkpoint has to wait for).
            with self._typed():
                raw = self.engine.raw_connection()
            try:
                busy, _, _ = raw.driver_connection.execute(  # type: ignore[union-attr]
                    "PRAGMA wal_checkpoint(TRUNCATE)"
                ).fetchone()
            except sqlite3.OperationalError as exc:
                if not sqlite_busy(exc):
                    raise
                busy = 1
            finally:
                raw.close()
            if not busy:
                return
            time.sleep(0.01)

    # -- tombstones ------------------------------------------------------------------

    def _tombstones(self, where: sa.ColumnElement[bool] | None) -> list[Tombstone]:
        t, k = self._t.tombstone, self._t.tombstone_key
        query = (
            sa.select(t.c.tombstone_id, t.c.subject_ref, t.c.scope, t.c.erased_at, k.c.key_id)
            .select_from(t.outerjoin(k, k.c.tombstone_id == t.c.tombstone_id))
            .order_by(t.c.erased_at, t.c.tombstone_id, k.c.key_id)
        )
        if where is not None:
            query = query.where(where)
        found: dict[str, tuple[Any, Any, Any, list[bytes]]] = {}
        for tid, ref, scope, erased, key_id in self._rows(query):
            entry = found.setdefault(str(tid), (ref, scope, erased, []))
            if key_id is not None:
                entry[3].append(bytes(key_id))
        return [
            Tombstone(
                tid, str(ref), None if scope is None else str(scope), tuple(keys), _aware(erased)
            )
            for tid, (ref, scope, erased, keys) in found.items()
        ]

    def tombstone_for(self, key_id: bytes) -> Tombstone | None:
        k = self._t.tombstone_key.c
        owner = sa.select(k.tombstone_id).where(k.key_id == key_id).scalar_subquery()
        found = self._tombstones(self._t.tombstone.c.tombstone_id == owner)
        return found[0] if found else None

    def tombstones(self, since: datetime | None = None) -> list[Tombstone]:
        return self._tombstones(None if since is None else self._t.tombstone.c.erased_at > since)

    def tombstone(self, tombstone_id: str) -> Tombstone | None:
        found = self._tombstones(self._t.tombstone.c.tombstone_id == tombstone_id)
        return found[0] if found else None

    def is_tombstoned(self, subject_ref: str, scope: str) -> bool:
        t = self._t.tombstone.c
        query = (
            sa.select(sa.literal(1))
            .where(t.subject_ref == subject_ref, sa.or_(t.scope.is_(None), t.scope == scope))
            .limit(1)
        )
        return bool(self._rows(query))

    # -- secrets ---------------------------------------------------------------------

    @property
    def _secret_select(self) -> sa.Select[Any]:
        s = self._t.secret.c
        return sa.select(s.name, s.kek_provider, s.kek_epoch, s.wrapped)

    def get_secret(self, name: str) -> SecretRecord | None:
        rows = self._rows(self._get_secret, {"n": name})
        return _secret(rows[0]) if rows else None

    def put_secret(self, record: SecretRecord, *, replace: bool = False) -> SecretRecord:
        statement = self._insert(self._t.secret).values(
            name=record.name,
            kek_provider=record.kek_provider,
            kek_epoch=record.kek_epoch,
            wrapped=record.wrapped,
        )
        if replace:
            new = statement.excluded
            statement = statement.on_conflict_do_update(
                index_elements=["name"],
                set_={
                    "kek_provider": new.kek_provider,
                    "kek_epoch": new.kek_epoch,
                    "wrapped": new.wrapped,
                },
            )
        else:
            statement = statement.on_conflict_do_nothing(index_elements=["name"])
        with self._write() as conn:
            if record.kek_provider.endswith("@" + LIVE_LINEAGE):
                self._guard_live_epoch(conn, record.kek_epoch)
            conn.execute(statement)
        stored = self.get_secret(record.name)
        assert stored is not None  # noqa: S101 - just written in a committed transaction
        return stored

    def secrets(self) -> list[SecretRecord]:
        return [_secret(r) for r in self._rows(self._secret_select.order_by(self._t.secret.c.name))]

    def delete_secret(self, name: str) -> bool:
        s = self._t.secret
        with self._write() as conn:
            return bool(conn.execute(s.delete().where(s.c.name == name)).rowcount)

    def counts(self) -> dict[str, int]:
        """Row counts: keys (``dek``, of which ``shared`` have other owners),
        tombstones and secrets."""
        t = self._t
        count = sa.func.count()
        query = sa.select(
            sa.select(count).select_from(t.dek).scalar_subquery(),
            sa.select(count).select_from(t.dek).where(t.dek.c.owner_tag != "").scalar_subquery(),
            sa.select(count).select_from(t.tombstone).scalar_subquery(),
            sa.select(count).select_from(t.secret).scalar_subquery(),
        )
        (row,) = self._rows(query)
        return dict(zip(("dek", "shared", "tombstone", "secret"), map(int, row), strict=True))

    # -- epoch keys ------------------------------------------------------------------

    def epoch_keys(self, lineage: str) -> list[EpochKeyRecord]:
        e = self._t.epoch_key.c
        query = (
            sa.select(e.lineage, e.epoch, e.kek_provider, e.provider_epoch, e.wrapped, e.created_at)
            .where(e.lineage == lineage)
            .order_by(e.epoch)
        )
        return [_epoch_record(r) for r in self._rows(query)]

    def insert_epoch_key(self, record: EpochKeyRecord) -> EpochKeyRecord:
        with self._write() as conn:
            conn.execute(
                self._insert(self._t.epoch_key)
                .values(
                    lineage=record.lineage,
                    epoch=record.epoch,
                    kek_provider=record.kek_provider,
                    provider_epoch=record.provider_epoch,
                    wrapped=record.wrapped,
                    created_at=record.created_at,
                )
                .on_conflict_do_nothing()
            )
        for stored in self.epoch_keys(record.lineage):
            if stored.epoch == record.epoch:
                return stored
        raise KekEpochDestroyed(  # pragma: no cover - only if destroyed in between
            f"{record.lineage} KEK epoch {record.epoch} was destroyed while it was created"
        )

    def destroy_epoch_keys(self, lineage: str, before: int, markers: Sequence[str]) -> list[int]:
        e, d, s = self._t.epoch_key, self._t.dek, self._t.secret
        doomed_where = sa.and_(e.c.lineage == lineage, e.c.epoch < before)
        with self._write() as conn:
            doomed = [
                int(r[0])
                for r in conn.execute(sa.select(e.c.epoch).where(doomed_where).order_by(e.c.epoch))
            ]
            # Delete first: on PostgreSQL this waits for any writer holding a share
            # lock on one of these rows, whose key or secret the checks below see.
            conn.execute(e.delete().where(doomed_where))
            for marker in markers:
                for table in (d, s):
                    blocking = (
                        sa.select(sa.literal(1))
                        .select_from(table)
                        .where(table.c.kek_provider == marker, table.c.kek_epoch < before)
                        .limit(1)
                    )
                    if conn.execute(blocking).first() is not None:
                        raise KeyshredError(
                            f"keys are still wrapped by {lineage} KEK epochs before {before}; "
                            "re-wrap them first (rotate or rewrap)"
                        )
        self._scrub(e)
        return doomed

    # -- snapshots -------------------------------------------------------------------

    def snapshot(self) -> bytes:
        if self._pg:
            return self._pg_snapshot()
        copy = sqlite3.connect(":memory:")
        try:
            with self._typed():
                raw = self.engine.raw_connection()
            try:
                with _busy_typed():
                    raw.driver_connection.backup(copy)  # type: ignore[union-attr]
            finally:
                raw.close()
            image = bytearray(copy.serialize())
        finally:
            copy.close()
        # Header bytes 18-19 say "WAL"; a copy is a plain rollback-journal file
        # (an in-memory database cannot open a WAL image, and opening the restored
        # file switches it back to WAL).
        image[18:20] = b"\x01\x01"
        return bytes(image)

    def _pg_snapshot(self) -> bytes:
        """Every table read in one ``REPEATABLE READ`` transaction, written into an
        in-memory SQLite key store migrated like any other."""
        t = self._t
        order = (t.dek, t.dek_owner, t.tombstone, t.tombstone_key, t.secret, t.epoch_key)
        with (
            self._typed(),
            self.engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn,
            conn.begin(),
        ):
            rows = [[dict(r._mapping) for r in conn.execute(sa.select(table))] for table in order]
        image = db.create_engine("sqlite://", what="key store snapshot")
        try:
            db.migrate(
                image, schema.MIGRATIONS, schema.VERSION_TABLE, head=schema.HEAD, what="key store"
            )
            lite = schema.tables("")
            targets = (
                lite.dek,
                lite.dek_owner,
                lite.tombstone,
                lite.tombstone_key,
                lite.secret,
                lite.epoch_key,
            )
            with db.write(image) as conn:
                for target, data in zip(targets, rows, strict=True):
                    if data:
                        conn.execute(target.insert(), data)
            raw = image.raw_connection()
            try:
                return bytes(raw.driver_connection.serialize())  # type: ignore[union-attr]
            finally:
                raw.close()
        finally:
            image.dispose()

    def close(self) -> None:
        self.engine.dispose()

    def _forked(self) -> None:
        """In a forked child: the parent's pooled connections stay the parent's (a
        connection must not cross a fork); the child opens its own."""
        self.engine.dispose(close=False)

    def __repr__(self) -> str:
        where = "PostgreSQL" if self._pg else f"path={str(self._path)!r}"
        return f"{type(self).__name__}({where})"


def _synchronous_full(dbapi_connection: Any, _: Any) -> None:
    dbapi_connection.execute("PRAGMA synchronous=FULL")


@contextmanager
def _busy_typed() -> Iterator[None]:
    """``BackendUnavailable`` for SQLite's "database is locked" on a raw driver
    connection (the engine maps errors of its own statements)."""
    try:
        yield
    except sqlite3.OperationalError as exc:
        if not sqlite_busy(exc):
            raise
        raise BackendUnavailable(
            f"another process holds the key store's lock; retry ({type(exc).__name__})"
        ) from None


_STORES: weakref.WeakSet[SqlKeyStore] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for store in list(_STORES):
        store._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _migrate(image: sqlite3.Connection) -> None:
    """Bring a snapshot image from before versioned migrations to revision 0001's
    schema in memory, as ``unversioned_to_0001`` does for a store (a snapshot from
    before owner sets, or before the lineages). A versioned image is left alone: it
    is brought to the newest revision when a store opens it."""
    names = {r[0] for r in image.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if schema.VERSION_TABLE in names:
        return
    columns = [r[1] for r in image.execute("PRAGMA table_info(dek)")]
    ddl = migration_statements("sqlite")
    if columns and "owner_tag" not in columns:
        old = "key_id, tenant, subject_ref, scope, kek_provider, kek_epoch, wrapped, created_at"
        image.execute("ALTER TABLE dek RENAME TO dek_before_owner_sets")
        image.execute(ddl[0])  # the key table of 0001
        image.execute(
            f"INSERT INTO dek ({old}, owner_tag) SELECT {old}, '' FROM dek_before_owner_sets"  # noqa: S608
        )
        image.execute("DROP TABLE dek_before_owner_sets")
        image.execute("DROP INDEX IF EXISTS dek_epoch")
    for statement in ddl:
        image.execute(statement)


class SQLiteKeyStore(SqlKeyStore):
    """The embedded profile's key store: one SQLite file, mode 0600 (a
    ``SqlKeyStore`` on ``sqlite:///path``), and what backups do with key store
    images (snapshots) in memory.

    ``busy_timeout`` is how many seconds a call waits for another process's lock
    before it raises ``BackendUnavailable``."""

    def __init__(
        self, path: str | os.PathLike[str], *, busy_timeout: float = 30.0, pool_size: int = 2
    ) -> None:
        super().__init__(db.sqlite_url(Path(path)), busy_timeout=busy_timeout, pool_size=pool_size)

    @staticmethod
    def describe_snapshot(data: bytes) -> tuple[list[str], list[str]]:
        """(subject_refs with a live key, tombstone ids) of a snapshot, read in
        memory: a snapshot is never written to disk unsealed just to be looked at.
        A subject with a live key holds one or co-owns one (another holder's data
        about it): either way the generation can yield data about it."""
        db = sqlite3.connect(":memory:")
        try:
            db.deserialize(data)
            owned = db.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'dek_owner'"
            ).fetchone()
            query = "SELECT subject_ref FROM dek"
            if owned:  # a snapshot from before owner sets has no owner table
                query += (
                    " UNION SELECT substr(o.owner_ref, 1, instr(o.owner_ref || '@', '@') - 1)"
                    " FROM dek_owner o JOIN dek d ON d.key_id = o.key_id"
                )
            refs = [r[0] for r in db.execute(f"SELECT DISTINCT * FROM ({query}) ORDER BY 1")]  # noqa: S608
            tombs = [r[0] for r in db.execute("SELECT tombstone_id FROM tombstone ORDER BY 1")]
        except sqlite3.DatabaseError:
            raise KeyshredError("the key store snapshot cannot be read") from None
        finally:
            db.close()
        return [str(r) for r in refs], [str(t) for t in tombs]

    @staticmethod
    def apply_tombstones(data: bytes, tombstones: Sequence[Tombstone]) -> bytes:
        """A snapshot with ``tombstones`` applied, in memory: their keys deleted and
        the tombstones recorded. ``VACUUM`` rebuilds the image, so no free page keeps
        a deleted key's bytes: what a restore writes to disk never held them."""
        db = sqlite3.connect(":memory:")
        try:
            db.deserialize(data)
            db.execute("PRAGMA secure_delete=ON")
            with db:
                _migrate(db)  # a snapshot from before owner sets has no owner table
                for tomb in tombstones:
                    db.executemany("DELETE FROM dek WHERE key_id = ?", [(k,) for k in tomb.key_ids])
                    db.executemany(
                        "DELETE FROM dek_owner WHERE key_id = ?", [(k,) for k in tomb.key_ids]
                    )
                    db.execute(
                        "INSERT OR IGNORE INTO tombstone VALUES (?,?,?,?)",
                        (
                            tomb.tombstone_id,
                            tomb.subject_ref,
                            tomb.scope,
                            timestamp(tomb.erased_at),
                        ),
                    )
                    db.executemany(
                        "INSERT OR IGNORE INTO tombstone_key VALUES (?,?)",
                        [(k, tomb.tombstone_id) for k in tomb.key_ids],
                    )
            db.execute("VACUUM")
            return bytes(db.serialize())
        except sqlite3.DatabaseError:
            raise KeyshredError("the key store snapshot cannot be read") from None
        finally:
            db.close()

    @staticmethod
    def rewrap_image(
        data: bytes,
        rewrap_keys: Callable[[list[KeyRecord]], list[tuple[str, int, bytes]]],
        rewrap_secrets: Callable[[list[SecretRecord]], list[tuple[str, int, bytes]]],
        epoch_key: EpochKeyRecord | None,
        *,
        page: int = 5000,
    ) -> bytes:
        """A snapshot whose every key and secret is re-wrapped (by the callables,
        which return (kek_provider, epoch, wrapped) per record) and whose epoch keys
        are replaced by ``epoch_key`` alone, in memory. ``VACUUM`` rebuilds the
        image, so no free page keeps a replaced wrapping or epoch key: this is how a
        backup generation's key store stops depending on the live lineage."""
        db = sqlite3.connect(":memory:")
        try:
            db.deserialize(data)
            db.execute("PRAGMA secure_delete=ON")
            with db:
                _migrate(db)  # a snapshot from before owner sets or the lineages
                last = b""
                while True:
                    rows = db.execute(
                        f"SELECT {_DEK_COLUMNS} FROM dek WHERE key_id > ? "  # noqa: S608
                        "ORDER BY key_id LIMIT ?",
                        (last, page),
                    ).fetchall()
                    if not rows:
                        break
                    records = [_record(r) for r in rows]
                    new = rewrap_keys(records)
                    db.executemany(
                        "UPDATE dek SET kek_provider = ?, kek_epoch = ?, wrapped = ? "
                        "WHERE key_id = ?",
                        [(*w, r.key_id) for r, w in zip(records, new, strict=True)],
                    )
                    last = records[-1].key_id
                secrets = [
                    SecretRecord(str(n), str(p), int(e), bytes(w))
                    for n, p, e, w in db.execute(
                        "SELECT name, kek_provider, kek_epoch, wrapped FROM secret ORDER BY name"
                    )
                ]
                db.executemany(
                    "UPDATE secret SET kek_provider = ?, kek_epoch = ?, wrapped = ? WHERE name = ?",
                    [(*w, s.name) for s, w in zip(secrets, rewrap_secrets(secrets), strict=True)],
                )
                db.execute("DELETE FROM epoch_key")
                if epoch_key is not None:
                    db.execute(
                        f"INSERT INTO epoch_key ({_EPOCH_COLUMNS}) VALUES (?,?,?,?,?,?)",  # noqa: S608
                        (
                            epoch_key.lineage,
                            epoch_key.epoch,
                            epoch_key.kek_provider,
                            epoch_key.provider_epoch,
                            epoch_key.wrapped,
                            timestamp(epoch_key.created_at),
                        ),
                    )
            db.execute("VACUUM")
            return bytes(db.serialize())
        except sqlite3.DatabaseError:
            raise KeyshredError("the key store snapshot cannot be read") from None
        finally:
            db.close()

    @classmethod
    def from_snapshot(cls, path: str | os.PathLike[str], data: bytes) -> SQLiteKeyStore:
        """Write a snapshot as a new key store file (mode 0600) and open it."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        return cls(target)
