"""The key store: wrapped DEKs, tombstones and wrapped system secrets.

``KeyStore`` is the interface; ``SQLiteKeyStore`` is the embedded profile's
implementation; ``keyshred.keyring.pgstore.PostgresKeyStore`` the distributed one. The store
only ever holds *wrapped* key material and pseudonymous names: a key id, a
subject_ref, a scope, the KEK epoch. It never sees a subject id or a plaintext DEK.

SQLite specifics that matter for erasure:

- ``secure_delete=ON`` overwrites deleted rows with zeros in the database file;
- after a destroy the WAL is checkpointed and truncated, so the wrapped DEK's bytes
  are in neither the database nor its ``-wal`` file (tests scan both).

Destroying keys and writing their tombstone happen in one transaction, so a crash can
never leave a key deleted without the tombstone that lets restores replay it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from keyshred._pooling import sqlite_busy
from keyshred.errors import BackendUnavailable, KekEpochDestroyed, KeyshredError

__all__ = [
    "EpochKeyRecord",
    "KeyRecord",
    "KeyStore",
    "SQLiteKeyStore",
    "SecretRecord",
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


_SCHEMA = """
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

_DEK_COLUMNS = (
    "key_id, tenant, subject_ref, scope, kek_provider, kek_epoch, wrapped, created_at, owner_tag"
)
_EPOCH_COLUMNS = "lineage, epoch, kek_provider, provider_epoch, wrapped, created_at"
LIVE_LINEAGE = "live"


def _epoch_record(row: Sequence[Any]) -> EpochKeyRecord:
    lineage, epoch, provider, provider_epoch, wrapped, created = row
    if isinstance(created, str):
        created = datetime.fromisoformat(created)
    return EpochKeyRecord(
        str(lineage),
        int(epoch),
        str(provider),
        int(provider_epoch),
        bytes(wrapped),
        created if created.tzinfo else created.replace(tzinfo=UTC),
    )


def _ts(value: datetime) -> str:
    return value.astimezone(UTC).isoformat(timespec="microseconds")


def _record(row: Sequence[Any]) -> KeyRecord:
    """A key row of either SQL store (SQLite keeps times as ISO text, PostgreSQL as
    ``timestamptz``)."""
    key_id, tenant, subject_ref, scope, provider, epoch, wrapped, created, tag = row[:9]
    if isinstance(created, str):
        created = datetime.fromisoformat(created)
    return KeyRecord(
        bytes(key_id),
        str(tenant),
        str(subject_ref),
        str(scope),
        str(provider),
        int(epoch),
        bytes(wrapped),
        created if created.tzinfo else created.replace(tzinfo=UTC),
        str(tag or ""),
    )


@functools.cache
def _statements(mark: str, prefix: str, lock: str = "") -> dict[str, str]:
    """The statements both SQL stores share, for one placeholder style and table
    prefix (constants only: nothing here comes from input)."""
    dek, secret = f"{prefix}dek", f"{prefix}secret"
    select = f"SELECT {_DEK_COLUMNS} FROM {dek} WHERE "  # noqa: S608
    secret_columns = "name, kek_provider, kek_epoch, wrapped"  # noqa: S105 - column names
    upsert = ", ".join(f"{c} = excluded.{c}" for c in ("kek_provider", "kek_epoch", "wrapped"))
    sql = {
        "get": select + "key_id = ?",
        "find": select + "subject_ref = ? AND scope = ? AND owner_tag = ?",
        "for_subject": select + "subject_ref = ?",
        "for_scope": select + "subject_ref = ? AND scope = ?",
        "owned_by": f"SELECT {_DEK_COLUMNS} FROM {dek} WHERE key_id IN "  # noqa: S608
        f"(SELECT key_id FROM {prefix}dek_owner WHERE owner_ref = ?)",
        # The subject itself and every ``ref@scope`` of it: a range on the primary
        # key ("@" sorts just before "A"; subject_refs are lower-case base32).
        "owned_by_subject": f"SELECT {_DEK_COLUMNS} FROM {dek} WHERE key_id IN "  # noqa: S608
        f"(SELECT key_id FROM {prefix}dek_owner WHERE owner_ref = ? "
        "OR (owner_ref >= ? AND owner_ref < ?))",
        "owner_rows": f"SELECT key_id, owner_ref FROM {prefix}dek_owner WHERE key_id = ?",  # noqa: S608
        "insert_owner": f"INSERT INTO {prefix}dek_owner (owner_ref, key_id) VALUES (?,?) "  # noqa: S608
        "ON CONFLICT DO NOTHING",
        "older_than": select + "kek_epoch < ? LIMIT ?",
        "insert": f"INSERT INTO {dek} ({_DEK_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?) "  # noqa: S608
        "ON CONFLICT DO NOTHING",
        "update_wrapped": f"UPDATE {dek} SET kek_epoch = ?, wrapped = ? WHERE key_id = ?",  # noqa: S608
        "update_wrapped_provider": f"UPDATE {dek} SET kek_provider = ?, kek_epoch = ?, "  # noqa: S608
        "wrapped = ? WHERE key_id = ?",
        "wrapped_by": select + "kek_provider = ? LIMIT ?",
        "blocking_dek": f"SELECT 1 FROM {dek} WHERE kek_provider = ? AND kek_epoch < ? LIMIT 1",  # noqa: S608
        "blocking_secret": f"SELECT 1 FROM {secret} WHERE kek_provider = ? "  # noqa: S608
        "AND kek_epoch < ? LIMIT 1",
        # Read under a share lock on PostgreSQL: a destroy of this epoch waits for
        # the writer's commit and then sees its row (and refuses).
        "guard_epoch": f"SELECT 1 FROM {prefix}epoch_key WHERE lineage = ? AND epoch = ?{lock}",  # noqa: S608
        "epoch_keys": f"SELECT {_EPOCH_COLUMNS} FROM {prefix}epoch_key "  # noqa: S608
        "WHERE lineage = ? ORDER BY epoch",
        "insert_epoch_key": f"INSERT INTO {prefix}epoch_key ({_EPOCH_COLUMNS}) "  # noqa: S608
        "VALUES (?,?,?,?,?,?) ON CONFLICT DO NOTHING",
        "doomed_epochs": f"SELECT epoch FROM {prefix}epoch_key WHERE lineage = ? "  # noqa: S608
        "AND epoch < ? ORDER BY epoch",
        "delete_epochs": f"DELETE FROM {prefix}epoch_key WHERE lineage = ? AND epoch < ?",  # noqa: S608
        "is_tombstoned": f"SELECT 1 FROM {prefix}tombstone WHERE subject_ref = ? "  # noqa: S608
        "AND (scope IS NULL OR scope = ?) LIMIT 1",
        "get_secret": f"SELECT {secret_columns} FROM {secret} WHERE name = ?",  # noqa: S608
        "secrets": f"SELECT {secret_columns} FROM {secret} ORDER BY name",  # noqa: S608
        "delete_secret": f"DELETE FROM {secret} WHERE name = ?",  # noqa: S608
        "put_secret": f"INSERT INTO {secret} ({secret_columns}) VALUES (?,?,?,?) "  # noqa: S608
        "ON CONFLICT (name) DO NOTHING",
        "replace_secret": f"INSERT INTO {secret} ({secret_columns}) VALUES (?,?,?,?) "  # noqa: S608
        f"ON CONFLICT (name) DO UPDATE SET {upsert}",
    }
    sql.update(
        {f"count_{t}": f"SELECT COUNT(*) FROM {prefix}{t}" for t in ("dek", "tombstone", "secret")}  # noqa: S608
    )
    sql["count_shared"] = f"SELECT COUNT(*) FROM {dek} WHERE owner_tag <> ''"  # noqa: S608
    return {name: text.replace("?", mark) for name, text in sql.items()}


class _SqlKeyStore(KeyStore):
    """What the SQLite and PostgreSQL stores share: the statements on keys,
    tombstone checks and secrets. A subclass gives its placeholder (``_mark``),
    table prefix, transactions (``_tx`` yields something with ``execute`` and
    ``executemany``), queries and how it binds a time."""

    _mark = "?"
    _prefix = ""
    _share_lock = ""

    @abstractmethod
    def _tx(self) -> Any: ...

    @abstractmethod
    def _query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]: ...

    @abstractmethod
    def _bind_time(self, value: datetime) -> Any: ...

    @property
    def _sql(self) -> dict[str, str]:
        return _statements(self._mark, self._prefix, self._share_lock)

    def _guard_live_epoch(self, db: Any, epoch: int) -> None:
        """Inside a write transaction: refuse to write under a live epoch whose key
        was destroyed (another process rotated and destroyed it meanwhile)."""
        if db.execute(self._sql["guard_epoch"], (LIVE_LINEAGE, epoch)).fetchone() is None:
            raise KekEpochDestroyed(f"live KEK epoch {epoch} is destroyed")

    # -- keys ----------------------------------------------------------------------

    def get(self, key_id: bytes) -> KeyRecord | None:
        rows = self._query(self._sql["get"], (key_id,))
        return _record(rows[0]) if rows else None

    def find(self, subject_ref: str, scope: str, tag: str = "") -> KeyRecord | None:
        rows = self._query(self._sql["find"], (subject_ref, scope, tag))
        return _record(rows[0]) if rows else None

    def for_subject(self, subject_ref: str, scope: str | None = None) -> list[KeyRecord]:
        if scope is None:
            rows = self._query(self._sql["for_subject"], (subject_ref,))
        else:
            rows = self._query(self._sql["for_scope"], (subject_ref, scope))
        return [_record(r) for r in rows]

    def owned_by(self, subject_ref: str, scope: str | None = None) -> list[KeyRecord]:
        if scope is None:
            args: tuple[str, ...] = (subject_ref, subject_ref + "@", subject_ref + "A")
            rows = self._query(self._sql["owned_by_subject"], args)
        else:
            rows = self._query(self._sql["owned_by"], (owner_token(subject_ref, scope),))
        records = [_record(r) for r in rows]
        owners = self.owners_of([r.key_id for r in records])
        return [replace(r, owners=owners.get(r.key_id, ())) for r in records]

    def owners_of(self, key_ids: Sequence[bytes]) -> dict[bytes, tuple[str, ...]]:
        out: dict[bytes, list[str]] = {}
        for key_id in dict.fromkeys(key_ids):
            for kid, owner in self._query(self._sql["owner_rows"], (key_id,)):
                out.setdefault(bytes(kid), []).append(str(owner))
        return {k: tuple(sorted(v)) for k, v in out.items()}

    def insert(self, record: KeyRecord) -> KeyRecord:
        if owner_tag(record.owners) != record.owner_tag:
            raise KeyshredError("a key record's owner tag does not match its owners")
        with self._tx() as db:
            if record.kek_provider.endswith("@" + LIVE_LINEAGE):
                self._guard_live_epoch(db, record.kek_epoch)
            db.execute(
                self._sql["insert"],
                (
                    record.key_id,
                    record.tenant,
                    record.subject_ref,
                    record.scope,
                    record.kek_provider,
                    record.kek_epoch,
                    record.wrapped,
                    self._bind_time(record.created_at),
                    record.owner_tag,
                ),
            )
            # In the same transaction: a shared key is never without its owner index
            # (an erasure finds it by any owner). Rows of a losing writer's key id
            # name a key that does not exist, and are removed below.
            db.executemany(
                self._sql["insert_owner"], [(owner, record.key_id) for owner in record.owners]
            )
        existing = self.find(record.subject_ref, record.scope, record.owner_tag)
        if existing is None:  # pragma: no cover - only if destroyed in between
            raise KeyshredError("the key was destroyed while it was being created")
        if existing.key_id != record.key_id and record.owners:
            self._drop_owner_rows([record.key_id])
        return replace(existing, owners=record.owners)

    def _drop_owner_rows(self, key_ids: Sequence[bytes]) -> None:
        with self._tx() as db:
            db.executemany(
                f"DELETE FROM {self._prefix}dek_owner WHERE key_id = {self._mark}",  # noqa: S608
                [(k,) for k in key_ids],
            )

    def older_than(self, epoch: int, limit: int) -> list[KeyRecord]:
        return [_record(r) for r in self._query(self._sql["older_than"], (epoch, limit))]

    def update_wrapped(
        self,
        updates: Sequence[tuple[bytes, int, bytes]],
        *,
        kek_provider: str | None = None,
        live_epoch: int | None = None,
    ) -> None:
        with self._tx() as db:
            if live_epoch is not None:
                self._guard_live_epoch(db, live_epoch)
            if kek_provider is None:
                db.executemany(
                    self._sql["update_wrapped"],
                    [(epoch, wrapped, key_id) for key_id, epoch, wrapped in updates],
                )
            else:
                db.executemany(
                    self._sql["update_wrapped_provider"],
                    [(kek_provider, epoch, wrapped, key_id) for key_id, epoch, wrapped in updates],
                )

    def wrapped_by(self, kek_provider: str, limit: int) -> list[KeyRecord]:
        return [_record(r) for r in self._query(self._sql["wrapped_by"], (kek_provider, limit))]

    # -- tombstones ----------------------------------------------------------------

    def is_tombstoned(self, subject_ref: str, scope: str) -> bool:
        return bool(self._query(self._sql["is_tombstoned"], (subject_ref, scope)))

    # -- secrets -------------------------------------------------------------------

    def get_secret(self, name: str) -> SecretRecord | None:
        rows = self._query(self._sql["get_secret"], (name,))
        if not rows:
            return None
        n, provider, epoch, wrapped = rows[0]
        return SecretRecord(str(n), str(provider), int(epoch), bytes(wrapped))

    def put_secret(self, record: SecretRecord, *, replace: bool = False) -> SecretRecord:
        with self._tx() as db:
            if record.kek_provider.endswith("@" + LIVE_LINEAGE):
                self._guard_live_epoch(db, record.kek_epoch)
            db.execute(
                self._sql["replace_secret" if replace else "put_secret"],
                (record.name, record.kek_provider, record.kek_epoch, record.wrapped),
            )
        stored = self.get_secret(record.name)
        assert stored is not None  # noqa: S101 - just written in a committed transaction
        return stored

    def secrets(self) -> list[SecretRecord]:
        return [
            SecretRecord(str(n), str(p), int(e), bytes(w))
            for n, p, e, w in self._query(self._sql["secrets"])
        ]

    def delete_secret(self, name: str) -> bool:
        with self._tx() as db:
            return bool(db.execute(self._sql["delete_secret"], (name,)).rowcount)

    def counts(self) -> dict[str, int]:
        """Row counts: keys (``dek``, of which ``shared`` have other owners),
        tombstones and secrets."""
        return {
            t: int(self._query(self._sql[f"count_{t}"])[0][0])
            for t in ("dek", "shared", "tombstone", "secret")
        }

    # -- epoch keys ----------------------------------------------------------------

    def epoch_keys(self, lineage: str) -> list[EpochKeyRecord]:
        return [_epoch_record(r) for r in self._query(self._sql["epoch_keys"], (lineage,))]

    def insert_epoch_key(self, record: EpochKeyRecord) -> EpochKeyRecord:
        with self._tx() as db:
            db.execute(
                self._sql["insert_epoch_key"],
                (
                    record.lineage,
                    record.epoch,
                    record.kek_provider,
                    record.provider_epoch,
                    record.wrapped,
                    self._bind_time(record.created_at),
                ),
            )
        for stored in self.epoch_keys(record.lineage):
            if stored.epoch == record.epoch:
                return stored
        raise KekEpochDestroyed(  # pragma: no cover - only if destroyed in between
            f"{record.lineage} KEK epoch {record.epoch} was destroyed while it was created"
        )

    def destroy_epoch_keys(self, lineage: str, before: int, markers: Sequence[str]) -> list[int]:
        with self._tx() as db:
            doomed = [int(r[0]) for r in db.execute(self._sql["doomed_epochs"], (lineage, before))]
            # Delete first: on PostgreSQL this waits for any writer holding a share
            # lock on one of these rows, whose key or secret the checks below see.
            db.execute(self._sql["delete_epochs"], (lineage, before))
            for marker in markers:
                for table in ("blocking_dek", "blocking_secret"):
                    if db.execute(self._sql[table], (marker, before)).fetchone() is not None:
                        raise KeyshredError(
                            f"keys are still wrapped by {lineage} KEK epochs before {before}; "
                            "re-wrap them first (rotate or rewrap)"
                        )
        self._after_epoch_destroy()
        return doomed

    def _after_epoch_destroy(self) -> None:
        """Hook: scrub what the deleted epoch-key rows left behind (WAL, free pages)."""


def _migrate(db: sqlite3.Connection) -> None:
    """Bring a key store (or snapshot image) from before owner sets up to date, inside
    the caller's transaction: the key table gains ``owner_tag`` and its unique key
    becomes (subject_ref, scope, owner_tag), which SQLite can only do by rebuilding the
    table; the owner table is created. Existing keys are all scope keys (tag "")."""
    columns = [r[1] for r in db.execute("PRAGMA table_info(dek)")]
    if not columns:
        return  # a new store: the schema script makes every table
    if "owner_tag" not in columns:
        db.execute("ALTER TABLE dek RENAME TO dek_before_owner_sets")
        db.execute(_SCHEMA.split(";", maxsplit=1)[0])  # the new key table
        old = "key_id, tenant, subject_ref, scope, kek_provider, kek_epoch, wrapped, created_at"
        db.execute(
            f"INSERT INTO dek ({old}, owner_tag) SELECT {old}, '' FROM dek_before_owner_sets"  # noqa: S608
        )
        db.execute("DROP TABLE dek_before_owner_sets")
        db.execute("DROP INDEX IF EXISTS dek_epoch")
    for statement in _SCHEMA.split(";"):
        if "dek_owner" in statement or "dek_epoch" in statement:
            db.execute(statement)


@contextmanager
def _lock_waits_typed() -> Iterator[None]:
    """Raise ``BackendUnavailable`` for SQLite's "database is locked" (another
    process held the key store's lock past the busy timeout): nothing was changed
    and the next call may succeed. Other errors pass: a full disk is typed
    ``StorageFull`` at the facade, which needs the driver's error to tell."""
    try:
        yield
    except sqlite3.OperationalError as exc:
        if not sqlite_busy(exc):
            raise
        # The driver's message is left out, as for the catalog's.
        raise BackendUnavailable(
            f"another process holds the key store's lock; retry ({type(exc).__name__})"
        ) from None


class SQLiteKeyStore(_SqlKeyStore):
    """The embedded profile's key store: one SQLite file, mode 0600.

    ``busy_timeout`` is how many seconds a call waits for another process's lock
    before it raises ``BackendUnavailable``."""

    def __init__(self, path: str | os.PathLike[str], *, busy_timeout: float = 30.0) -> None:
        self._path = Path(path)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        if not self._path.exists():
            os.close(os.open(self._path, os.O_WRONLY | os.O_CREAT, 0o600))
        self._lock = threading.RLock()
        try:
            with _lock_waits_typed():
                self._db = sqlite3.connect(
                    self._path, timeout=busy_timeout, isolation_level=None, check_same_thread=False
                )
                self._db.execute("PRAGMA secure_delete=ON")
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=FULL")
                with self._lock:
                    self._db.execute("BEGIN IMMEDIATE")
                    try:
                        _migrate(self._db)
                    except BaseException:
                        self._db.execute("ROLLBACK")
                        raise
                    self._db.execute("COMMIT")
                self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError:
            raise KeyshredError(f"the key store at {self._path} cannot be opened") from None

    @property
    def path(self) -> Path:
        return self._path

    # -- transactions --------------------------------------------------------------

    def _tx(self) -> _Tx:
        return _Tx(self._db, self._lock)

    def _query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock, _lock_waits_typed():
            return self._db.execute(sql, tuple(args)).fetchall()

    def _bind_time(self, value: datetime) -> str:
        return _ts(value)

    # -- keys ----------------------------------------------------------------------

    def get_many(self, key_ids: Sequence[bytes]) -> dict[bytes, KeyRecord]:
        out: dict[bytes, KeyRecord] = {}
        for start in range(0, len(key_ids), 500):
            part = list(key_ids[start : start + 500])
            marks = ",".join("?" * len(part))
            for row in self._query(
                f"SELECT {_DEK_COLUMNS} FROM dek WHERE key_id IN ({marks})",  # noqa: S608
                part,
            ):
                rec = _record(row)
                out[rec.key_id] = rec
        return out

    def destroy(self, key_ids: Sequence[bytes], tombstone: Tombstone) -> int:
        with self._tx() as db:
            deleted = 0
            for key_id in key_ids:
                deleted += db.execute("DELETE FROM dek WHERE key_id = ?", (key_id,)).rowcount
                db.execute("DELETE FROM dek_owner WHERE key_id = ?", (key_id,))
            db.execute(
                "INSERT OR IGNORE INTO tombstone VALUES (?,?,?,?)",
                (
                    tombstone.tombstone_id,
                    tombstone.subject_ref,
                    tombstone.scope,
                    _ts(tombstone.erased_at),
                ),
            )
            db.executemany(
                "INSERT OR IGNORE INTO tombstone_key VALUES (?,?)",
                [(k, tombstone.tombstone_id) for k in tombstone.key_ids],
            )
        self._scrub_wal()
        return deleted

    def _after_epoch_destroy(self) -> None:
        self._scrub_wal()

    def _scrub_wal(self) -> None:
        """Checkpoint and truncate the WAL so deleted rows leave no copy in it.

        A concurrent reader can make the checkpoint partial; retry briefly. If it
        still cannot complete, the wrapped keys stay in the WAL until the next
        checkpoint, and remain useless once their KEK epoch is destroyed.
        """
        for _ in range(50):
            with self._lock, _lock_waits_typed():
                busy, _, _ = self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            if not busy:
                return
            time.sleep(0.01)

    # -- tombstones ----------------------------------------------------------------

    def _tombstone(self, row: tuple[Any, ...]) -> Tombstone:
        tid, subject_ref, scope, erased = row
        keys = self._query(
            "SELECT key_id FROM tombstone_key WHERE tombstone_id = ? ORDER BY key_id", (tid,)
        )
        return Tombstone(
            str(tid),
            str(subject_ref),
            None if scope is None else str(scope),
            tuple(bytes(k[0]) for k in keys),
            datetime.fromisoformat(str(erased)),
        )

    def tombstone_for(self, key_id: bytes) -> Tombstone | None:
        rows = self._query(
            "SELECT t.tombstone_id, t.subject_ref, t.scope, t.erased_at FROM tombstone t "
            "JOIN tombstone_key k ON k.tombstone_id = t.tombstone_id WHERE k.key_id = ?",
            (key_id,),
        )
        return self._tombstone(rows[0]) if rows else None

    def tombstones(self, since: datetime | None = None) -> list[Tombstone]:
        if since is None:
            rows = self._query("SELECT * FROM tombstone ORDER BY erased_at, tombstone_id")
        else:
            rows = self._query(
                "SELECT * FROM tombstone WHERE erased_at > ? ORDER BY erased_at, tombstone_id",
                (_ts(since),),
            )
        return [self._tombstone(r) for r in rows]

    def snapshot(self) -> bytes:
        with self._lock, _lock_waits_typed():
            copy = sqlite3.connect(":memory:")
            try:
                self._db.backup(copy)  # one step: a single consistent read
                image = bytearray(copy.serialize())
            finally:
                copy.close()
        # Header bytes 18-19 say "WAL"; a copy is a plain rollback-journal file
        # (an in-memory database cannot open a WAL image, and opening the restored
        # file switches it back to WAL).
        image[18:20] = b"\x01\x01"
        return bytes(image)

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
                        (tomb.tombstone_id, tomb.subject_ref, tomb.scope, _ts(tomb.erased_at)),
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
                _migrate(db)  # a snapshot from before owner sets
                for statement in _SCHEMA.split(";"):  # ... or before the lineages
                    if "epoch_key" in statement or "dek_wrap" in statement:
                        db.execute(statement)
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
                            _ts(epoch_key.created_at),
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

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __repr__(self) -> str:
        return f"SQLiteKeyStore(path={str(self._path)!r})"


class _Tx:
    """``BEGIN IMMEDIATE`` … ``COMMIT`` under the store's lock (rollback on error).
    A lock another process holds past the busy timeout is ``BackendUnavailable``."""

    def __init__(self, db: sqlite3.Connection, lock: threading.RLock) -> None:
        self._db = db
        self._lock = lock

    def __enter__(self) -> sqlite3.Connection:
        self._lock.acquire()
        try:
            with _lock_waits_typed():
                self._db.execute("BEGIN IMMEDIATE")
        except BaseException:
            self._lock.release()
            raise
        return self._db

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            if exc_type is None:
                with _lock_waits_typed():
                    self._commit()
            else:
                self._db.execute("ROLLBACK")
        finally:
            self._lock.release()

    def _commit(self) -> None:
        try:
            self._db.execute("COMMIT")
        except sqlite3.Error:
            # A failed COMMIT can leave the transaction open; end it, so the
            # connection's next BEGIN does not fail on it.
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise
