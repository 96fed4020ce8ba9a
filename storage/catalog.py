"""The catalog: asset index, provenance, consent records and the subject guard.

One code path on SQLite (embedded profile) and PostgreSQL (distributed profile)
through SQLAlchemy Core. Only pseudonymous values are stored: subject_refs, asset
ids, scopes, purposes, categories, keyed lookup hashes, timestamps. Never a subject
id, a namespace, a key or a value.

The guard is the first thing every read and write consults. ``suppress`` bumps the
subject's deletion epoch and marks it suppressed in one transaction; asset
registration re-reads the guard inside its own write transaction (``BEGIN
IMMEDIATE`` on SQLite, ``SELECT … FOR SHARE`` on PostgreSQL), so no asset can be
registered for a subject after the transaction that suppressed it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import sqlite3
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from keyshred._pooling import unreachable
from keyshred.db import Micros, create_engine, micros, sqlite_url, unavailable, utc
from keyshred.errors import (
    ConfigError,
    InvalidInput,
    StaleEpoch,
    SubjectSuppressed,
)

__all__ = [
    "ACTIVE",
    "ASSET_COLUMNS",
    "DECLARED",
    "DETECTED",
    "SUPPRESSED",
    "AssetRow",
    "Catalog",
    "CatalogSnapshot",
    "ConsentRecord",
    "GuardState",
    "Micros",
    "micros",
    "sqlite_url",
    "utc",
]

_MISSING = object()
_T = TypeVar("_T")
ACTIVE = "active"
SUPPRESSED = "suppressed"
ERASED = "erased"
DECLARED = "declared"
DETECTED = "detected"

metadata = sa.MetaData()


assets = sa.Table(
    "ks_assets",
    metadata,
    sa.Column("asset_id", sa.String(64), primary_key=True),
    sa.Column("subject_ref", sa.String(64), nullable=False),
    sa.Column("scope", sa.String(128), nullable=False),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("storage_system", sa.String(32), nullable=False),
    sa.Column("storage_key", sa.String(512), nullable=False),
    sa.Column("purpose", sa.String(128), nullable=False),
    sa.Column("category", sa.String(128), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("retain_until", sa.DateTime(timezone=True), nullable=True),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("lookup", sa.String(64), nullable=True),
    sa.Column("producer", sa.String(128), nullable=True),
    sa.Column("producer_version", sa.String(64), nullable=True),
    sa.Index("ks_assets_subject", "subject_ref", "scope", "kind"),
    sa.Index("ks_assets_retain", "retain_until"),
)

ASSET_COLUMNS = tuple(c.name for c in assets.columns)
_TIME_COLUMNS = tuple(i for i, c in enumerate(assets.columns) if isinstance(c.type, sa.DateTime))

asset_sources = sa.Table(
    "ks_asset_sources",
    metadata,
    sa.Column("asset_id", sa.String(64), primary_key=True),
    sa.Column("source_id", sa.String(64), primary_key=True),
    sa.Index("ks_asset_sources_source", "source_id"),
)

asset_mentions = sa.Table(
    "ks_asset_mentions",
    metadata,
    sa.Column("asset_id", sa.String(64), primary_key=True),
    sa.Column("subject_ref", sa.String(64), primary_key=True),
    # "declared" by the writer, or "detected" in the value by a registered identifier
    # (keyshred.storage.mentions). Catalogs from before it gain it at open.
    sa.Column("how", sa.String(16), nullable=False, server_default=DECLARED),
    sa.Index("ks_asset_mentions_subject", "subject_ref"),
)

# Identifiers a subject registered (keyshred.storage.mentions): their keyed lookup
# hashes, and the normal form sealed under the subject's own key (``sealed``: so a
# new identifier key version can re-hash it; an erased subject's sealed values die
# with its keys), never the identifier in clear. The primary key leads with the
# hash, so it is the index the write path's lookup (``hash IN …``) probes; one hash
# may stand for several subjects (two people of one name), and each is a mention.
# Catalogs from before ``sealed`` gain it at open; their rows keep NULL (they cannot
# be re-hashed, see ``rehash_identifiers``).
identifiers = sa.Table(
    "ks_identifiers",
    metadata,
    sa.Column("hash", sa.String(64), primary_key=True),
    sa.Column("subject_ref", sa.String(64), primary_key=True),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("sealed", sa.LargeBinary, nullable=True),
    sa.Index("ks_identifiers_subject", "subject_ref"),
)

# The identifier key version the hashes of ks_identifiers are under (one row, id 1;
# absent means version 1). Registration and re-hashing lock it, so a registration
# hashed under a version a concurrent re-hash replaced is refused and redone.
identifier_key_version = sa.Table(
    "ks_identifier_key",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("version", sa.Integer, nullable=False),
)

# The kinds of identifier ever registered (names as "name:<words>"), one row each,
# never deleted: the write path skips detection while there is none, and generates
# name n-grams only of the lengths registered.
identifier_kinds = sa.Table(
    "ks_identifier_kinds",
    metadata,
    sa.Column("kind", sa.String(16), primary_key=True),
)

consents = sa.Table(
    "ks_consents",
    metadata,
    sa.Column("consent_id", sa.String(64), primary_key=True),
    sa.Column("subject_ref", sa.String(64), nullable=False),
    sa.Column("purpose", sa.String(128), nullable=False),
    sa.Column("category", sa.String(128), nullable=False),
    sa.Column("actions", sa.String(256), nullable=False),
    sa.Column("start_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("end_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("policy_version", sa.String(64), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
    sa.Index("ks_consents_subject", "subject_ref", "purpose", "category"),
)

subject_guard = sa.Table(
    "ks_subject_guard",
    metadata,
    sa.Column("subject_ref", sa.String(64), primary_key=True),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("deletion_epoch", sa.Integer, nullable=False),
    sa.Column("suppressed_scopes", sa.Text, nullable=False, server_default="[]"),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
)


# -- tables of the erasure coordinator and the audit log (keyshred.erasure, .audit) --

deletion_requests = sa.Table(
    "ks_deletion_requests",
    metadata,
    sa.Column("request_id", sa.String(64), primary_key=True),
    sa.Column("subject_ref", sa.String(64), nullable=False),
    sa.Column("scope", sa.String(128), nullable=True),
    sa.Column("state", sa.String(32), nullable=False),
    sa.Column("requested_by", sa.String(128), nullable=False),
    sa.Column("reason", sa.String(256), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("doc", sa.Text, nullable=False),  # JSON: steps done, per-store details
    sa.Column("receipt", sa.Text, nullable=True),
    sa.Index("ks_deletion_requests_subject", "subject_ref"),
)

audit_events = sa.Table(
    "ks_audit",
    metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("event", sa.String(64), nullable=False),
    sa.Column("subject_ref", sa.String(64), nullable=True),
    sa.Column("request_id", sa.String(64), nullable=True),
    sa.Column("data", sa.Text, nullable=False),
    sa.Column("prev_hash", sa.String(64), nullable=False),
    sa.Column("hash", sa.String(64), nullable=False),
)

audit_anchor = sa.Table(
    "ks_audit_anchor",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("pruned_through", sa.Integer, nullable=False),
    sa.Column("last_hash", sa.String(64), nullable=False),
    sa.Column("pruned_at", sa.DateTime(timezone=True), nullable=False),
)

legal_holds = sa.Table(
    "ks_legal_holds",
    metadata,
    sa.Column("hold_id", sa.String(64), primary_key=True),
    sa.Column("subject_ref", sa.String(64), nullable=False),
    sa.Column("scope", sa.String(128), nullable=True),
    sa.Column("reason", sa.String(256), nullable=False),
    sa.Column("owner", sa.String(128), nullable=False),
    sa.Column("placed_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("released_at", sa.DateTime(timezone=True), nullable=True),
    sa.Index("ks_legal_holds_subject", "subject_ref"),
)


# -- LangGraph threads and checkpoints (keyshred.storage.checkpoints) ----------------
# Thread ids are stored as keyed pseudonyms (and, sealed, for listing); checkpoints
# and writes as envelope ciphertext under the thread's own key, so deleting a thread
# is crypto-erasure too. Namespaces, checkpoint ids, run ids, task ids and channel
# names are graph structure, not personal data, and stay plaintext for the queries.

threads = sa.Table(
    "ks_threads",
    metadata,
    sa.Column("thread_ref", sa.String(64), primary_key=True),
    sa.Column("subject_ref", sa.String(64), nullable=False),
    sa.Column("scope", sa.String(128), nullable=False),  # the policy scope
    sa.Column("thread", sa.LargeBinary, nullable=False),  # sealed thread id
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Index("ks_threads_subject", "subject_ref"),
)

checkpoints = sa.Table(
    "ks_checkpoints",
    metadata,
    sa.Column("thread_ref", sa.String(64), primary_key=True),
    sa.Column("checkpoint_ns", sa.String(512), primary_key=True),
    sa.Column("checkpoint_id", sa.String(64), primary_key=True),
    sa.Column("parent_checkpoint_id", sa.String(64), nullable=True),
    sa.Column("subject_ref", sa.String(64), nullable=False),
    sa.Column("run_id", sa.String(128), nullable=True),
    sa.Column("data", sa.LargeBinary, nullable=False),  # sealed checkpoint + metadata
    sa.Index("ks_checkpoints_subject", "subject_ref"),
    sa.Index("ks_checkpoints_run", "run_id"),
)

checkpoint_writes = sa.Table(
    "ks_checkpoint_writes",
    metadata,
    sa.Column("thread_ref", sa.String(64), primary_key=True),
    sa.Column("checkpoint_ns", sa.String(512), primary_key=True),
    sa.Column("checkpoint_id", sa.String(64), primary_key=True),
    sa.Column("task_id", sa.String(128), primary_key=True),
    sa.Column("idx", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("subject_ref", sa.String(64), nullable=False),
    sa.Column("channel", sa.String(256), nullable=False),
    sa.Column("task_path", sa.String(512), nullable=False),
    sa.Column("data", sa.LargeBinary, nullable=False),  # sealed value
    sa.Index("ks_checkpoint_writes_subject", "subject_ref"),
)


def _sqlite_time(value: Any) -> Any:
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


_OPEN = GuardState(ACTIVE, 0)


def _guard_state(row: Any) -> GuardState:
    if row is None:
        return _OPEN
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


def _consent(row: Any) -> ConsentRecord:
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


class Catalog:
    """The asset index and policy state on SQLite or PostgreSQL."""

    def __init__(
        self,
        url: str,
        *,
        create: bool = True,
        pool_size: int = 5,
        max_overflow: int = 10,
        pool_timeout: float = 30.0,
        pre_ping: bool = False,
    ) -> None:
        self.url = url
        self.engine: Engine = create_engine(
            url,
            what="catalog",
            pool_size=pool_size,
            max_overflow=max_overflow,
            pool_timeout=pool_timeout,
            pre_ping=pre_ping,
        )
        self.dialect = self.engine.dialect.name
        self._mark = "?" if self.dialect == "sqlite" else "%s"  # DBAPI placeholders
        self._generation: _GuardGeneration | None = None
        if self.dialect == "sqlite":
            self._sqlite_setup()
        if create:
            try:
                metadata.create_all(self.engine)
            except sa.exc.OperationalError:
                raise ConfigError("the catalog database cannot be reached") from None
            inspector = sa.inspect(self.engine)
            if "how" not in {c["name"] for c in inspector.get_columns("ks_asset_mentions")}:
                self._add_mention_how()
            if "sealed" not in {c["name"] for c in inspector.get_columns("ks_identifiers")}:
                self._add_identifier_sealed()
        self.on_stale: Callable[[], None] | None = None  # counts refused stale jobs
        # The vault's tokens as assets, set by the vault (``keyshred.vault.store``),
        # whose tables the catalog does not know: a subject's (scope's), and one by id.
        self.token_assets: Callable[[str, str | None], list[AssetRow]] | None = None
        self.token_asset: Callable[[str], AssetRow | None] | None = None
        _CATALOGS.add(self)
        self._sql = self._compile_hot_statements()
        # subject_ref -> (guard generation when read, guard): embedded catalogs only
        self._guards: dict[str, tuple[int, GuardState]] = {}

    def _add_mention_how(self) -> None:
        """A catalog from before mention provenance: add ``how`` (every existing
        mention was declared). Another process opening the catalog at the same time
        may add it first: PostgreSQL skips it then, SQLite says so and we re-check."""
        exists = "IF NOT EXISTS " if self.dialect == "postgresql" else ""
        try:
            with self.engine.begin() as conn:
                conn.exec_driver_sql(
                    f"ALTER TABLE ks_asset_mentions ADD COLUMN {exists}"
                    f"how VARCHAR(16) NOT NULL DEFAULT '{DECLARED}'"
                )
        except sa.exc.OperationalError:
            columns = sa.inspect(self.engine).get_columns("ks_asset_mentions")
            if "how" not in {c["name"] for c in columns}:
                raise

    def _add_identifier_sealed(self) -> None:
        """A catalog from before sealed identifiers: add ``sealed`` (NULL for every
        existing row; see ``rehash_identifiers``). Concurrent opens as for ``how``."""
        exists = "IF NOT EXISTS " if self.dialect == "postgresql" else ""
        blob = "BYTEA" if self.dialect == "postgresql" else "BLOB"
        try:
            with self.engine.begin() as conn:
                conn.exec_driver_sql(f"ALTER TABLE ks_identifiers ADD COLUMN {exists}sealed {blob}")
        except sa.exc.OperationalError:
            columns = sa.inspect(self.engine).get_columns("ks_identifiers")
            if "sealed" not in {c["name"] for c in columns}:
                raise

    # -- the hot path: SQLAlchemy Core statements, compiled once per dialect -------
    #
    # Every put and get consults the guard and every put registers an asset. Going
    # through SQLAlchemy's execution machinery cost ~180 us per statement here, more
    # than the whole rest of a put; so the statements on those paths are built with
    # SQLAlchemy Core, compiled once for the dialect, and run on a DBAPI connection
    # checked out of the engine's pool for the one operation (a checkout costs a few
    # microseconds; a connection kept per thread leaked one per short-lived thread).
    # Cold paths use SQLAlchemy connections as usual.

    def _compile_hot_statements(self) -> dict[str, str]:
        guard = sa.select(
            subject_guard.c.status,
            subject_guard.c.deletion_epoch,
            subject_guard.c.suppressed_scopes,
        ).where(subject_guard.c.subject_ref == sa.bindparam("subject_ref"))
        statements: dict[str, Any] = {
            "guard": guard,
            "guard_positional": guard,
            "guard_lock": guard.with_for_update(read=True)
            if self.dialect == "postgresql"
            else guard,
            "insert_asset": assets.insert().values(
                {c.name: sa.bindparam(c.name) for c in assets.columns}
            ),
            "insert_source": asset_sources.insert().values(
                asset_id=sa.bindparam("asset_id"), source_id=sa.bindparam("source_id")
            ),
            "insert_mention": asset_mentions.insert().values(
                asset_id=sa.bindparam("asset_id"),
                subject_ref=sa.bindparam("subject_ref"),
                how=sa.bindparam("how"),
            ),
            "delete_asset": assets.delete().where(assets.c.asset_id == sa.bindparam("asset_id")),
            "delete_sources": asset_sources.delete().where(
                asset_sources.c.asset_id == sa.bindparam("asset_id")
            ),
            "delete_mentions": asset_mentions.delete().where(
                asset_mentions.c.asset_id == sa.bindparam("asset_id")
            ),
            "asset_ids": sa.select(assets.c.asset_id, assets.c.scope).where(
                assets.c.subject_ref == sa.bindparam("subject_ref"),
                assets.c.kind == sa.bindparam("kind"),
            ),
            "consents_for": sa.select(consents).where(
                consents.c.subject_ref == sa.bindparam("subject_ref"),
                consents.c.purpose == sa.bindparam("purpose"),
                consents.c.category == sa.bindparam("category"),
                consents.c.status == ACTIVE,
            ),
        }
        dialect = self.engine.dialect
        out = self.compile(statements, positional={"insert_asset", "guard_positional"})
        # Constant binds (status = 'active') compile as parameters; give their values.
        self._constants = {
            k: v.value
            for k, v in statements["consents_for"].compile(dialect=dialect).binds.items()
            if k.startswith("status")
        }
        return out

    def compile(self, statements: dict[str, Any], positional: Iterable[str] = ()) -> dict[str, str]:
        """Compile SQLAlchemy Core statements once for this dialect, with named
        parameters (``:name`` on SQLite, ``%(name)s`` on psycopg) unless
        ``positional`` names them; run them with ``hot``."""
        dialect = self.engine.dialect
        keep = set(positional)
        out = {}
        for name, stmt in statements.items():
            compiled = stmt.compile(dialect=dialect, compile_kwargs={"literal_binds": False})
            text = str(compiled)
            if self.dialect == "sqlite" and name not in keep:
                # sqlite3 takes :name parameters with a dict, like psycopg's %(name)s.
                for key in compiled.positiontup or ():
                    text = text.replace("?", f":{key}", 1)
            out[name] = text
        return out

    def hot(self, write: bool) -> Any:
        """A DBAPI cursor on a pooled connection, in a transaction for writes
        (``BEGIN IMMEDIATE`` on SQLite): for statements from ``compile``."""
        return self._hot(write)

    def guard_in(self, cur: Any, subject_ref: str, *, lock: bool = True) -> GuardState:
        """The guard read inside ``hot``'s transaction (``FOR SHARE`` on PostgreSQL)."""
        return self._guard_row(cur, subject_ref, lock)

    @staticmethod
    def guard_of(status: Any, epoch: Any, scopes: Any) -> GuardState:
        """A guard from its three columns read by another statement (a join); a
        subject without a guard row (``status`` None) is active."""
        return _guard_state(None if status is None else (status, epoch, scopes))

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

    def _checkout(self) -> Any:
        """A DBAPI connection from the pool (its proxy: ``close`` returns it)."""
        try:
            return self.engine.raw_connection()
        except Exception as exc:
            if unreachable(self.dialect, self.engine.dialect.dbapi, exc):
                raise unavailable(exc) from None
            raise

    @contextmanager
    def _hot(self, write: bool) -> Iterator[Any]:
        """A DBAPI cursor on a connection checked out for this one operation, in a
        transaction for writes; on SQLite a read of one statement runs in
        autocommit (a single SELECT is atomic by itself). The connection goes back
        to the pool however the block ends; one the driver found broken is dropped."""
        fairy = self._checkout()
        try:
            conn = fairy.driver_connection
            cur = conn.cursor()
            try:
                if self.dialect == "sqlite" and not write:
                    yield cur
                else:
                    yield from self._in_transaction(conn, cur)
            finally:
                with contextlib.suppress(Exception):  # a dead connection's cursor
                    cur.close()
        except Exception as exc:
            if not unreachable(self.dialect, self.engine.dialect.dbapi, exc):
                raise
            if getattr(fairy.driver_connection, "closed", False):
                fairy.invalidate()  # not back into the pool
            raise unavailable(exc) from None
        finally:
            fairy.close()

    def _in_transaction(self, conn: Any, cur: Any) -> Iterator[Any]:
        """``_hot``'s write transaction around the caller's block."""
        sqlite = self.dialect == "sqlite"
        if sqlite:
            cur.execute("BEGIN IMMEDIATE")
        try:
            yield cur
        except BaseException:
            # A connection that died mid-transaction cannot roll back; the server
            # drops its transaction by itself, and the caller's error says more.
            with contextlib.suppress(Exception):
                cur.execute("ROLLBACK") if sqlite else conn.rollback()
            raise
        if sqlite:
            cur.execute("COMMIT")
        else:
            conn.commit()

    def _marks(self, n: int) -> str:
        """``n`` positional placeholders of this dialect (never values)."""
        return ", ".join([self._mark] * n)

    def _guard_row(self, cur: Any, subject_ref: str, lock: bool) -> GuardState:
        cur.execute(self._sql["guard_lock" if lock else "guard"], {"subject_ref": subject_ref})
        return _guard_state(cur.fetchone())

    def _guard_rows(self, cur: Any, refs: Iterable[str]) -> dict[str, GuardState]:
        """The guards of many subjects in one read per chunk (locked ``FOR SHARE`` on
        PostgreSQL, inside the caller's write transaction); absent ones are active."""
        lock = " FOR SHARE" if self.dialect == "postgresql" else ""
        out: dict[str, GuardState] = {}
        for chunk in _chunks(sorted(refs)):
            cur.execute(
                "SELECT subject_ref, status, deletion_epoch, suppressed_scopes "  # noqa: S608
                f"FROM ks_subject_guard WHERE subject_ref IN ({self._marks(len(chunk))}){lock}",
                chunk,
            )
            for row in cur.fetchall():
                out[str(row[0])] = _guard_state(row[1:])
        return out

    def _sqlite_setup(self) -> None:
        path = self.engine.url.database
        if path and path != ":memory:":
            p = Path(path)
            self._generation = _GuardGeneration(p.with_name(p.name + ".guardgen"))

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        with self.engine.connect().execution_options(ks_write=True) as conn, conn.begin():
            yield conn

    def transaction(self) -> Any:
        """A write transaction (``BEGIN IMMEDIATE`` on SQLite) as a context manager."""
        return self._write()

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with self.engine.connect() as conn, conn.begin():
            yield conn

    def _lock_guard(self, conn: Connection, subject_ref: str) -> GuardState:
        query = sa.select(
            subject_guard.c.status,
            subject_guard.c.deletion_epoch,
            subject_guard.c.suppressed_scopes,
        ).where(subject_guard.c.subject_ref == subject_ref)
        if self.dialect == "postgresql":
            query = query.with_for_update()
        return _guard_state(conn.execute(query).first())

    # -- the subject guard ---------------------------------------------------------

    def guard(self, subject_ref: str) -> GuardState:
        generation = self._generation
        if generation is not None:
            # The hottest read of all (every put, get and sanitize). Every guard
            # change makes the shared generation odd before its transaction and
            # even after its commit, so a guard read at the current (even)
            # generation is still the guard: no statement at all. The generation
            # is read before the row, so a change that lands in between only makes
            # the cached read look older than it is.
            current = generation.value()
            hit = self._guards.get(subject_ref)
            if hit is not None and hit[0] == current:
                return hit[1]
            if current & 1:
                # A guard change is in flight, or its process died during one: read
                # the row and cache nothing until the change has settled.
                current = generation.settle_abandoned()
            # One autocommit SELECT on a pooled connection.
            with self._hot(write=False) as cur:
                row = cur.execute(self._sql["guard_positional"], (subject_ref,)).fetchone()
            state = _guard_state(row)
            if not current & 1:
                if len(self._guards) >= _GUARD_CACHE:
                    self._guards.clear()
                self._guards[subject_ref] = (current, state)
            return state
        if self.dialect == "sqlite":  # in memory: one connection, no other process
            with self._hot(write=False) as cur:
                row = cur.execute(self._sql["guard_positional"], (subject_ref,)).fetchone()
            return _guard_state(row)
        with self._hot(write=False) as cur:
            return self._guard_row(cur, subject_ref, lock=False)

    def enforce(
        self,
        subject_ref: str,
        state: GuardState,
        expected_epoch: int | None,
        scope: str | None = None,
    ) -> int:
        """Raise ``SubjectSuppressed``/``StaleEpoch`` for ``state``, or return the epoch."""
        on_stale = self.on_stale
        if state.status != ACTIVE:
            raise SubjectSuppressed(f"subject_ref {subject_ref} is {state.status}")
        if scope is not None and scope in state.scopes:
            raise SubjectSuppressed(f"scope {scope!r} of subject_ref {subject_ref} is suppressed")
        if expected_epoch is not None and expected_epoch < state.epoch:
            if on_stale is not None:
                on_stale()
            raise StaleEpoch(
                f"subject_ref {subject_ref} is at deletion epoch {state.epoch}; "
                f"this operation carries epoch {expected_epoch}"
            )
        return state.epoch

    def check_guard(
        self, subject_ref: str, expected_epoch: int | None = None, scope: str | None = None
    ) -> int:
        """Raise ``SubjectSuppressed``/``StaleEpoch`` or return the current epoch."""
        generation = self._generation
        if generation is not None and expected_epoch is None:
            # The usual answer, inline (every put, get and sanitize): a cached guard
            # of an active subject whose scope is not suppressed.
            hit = self._guards.get(subject_ref)
            if hit is not None and hit[0] == generation.value():
                state = hit[1]
                if state.status == ACTIVE and (scope is None or scope not in state.scopes):
                    return state.epoch
        return self.enforce(subject_ref, self.guard(subject_ref), expected_epoch, scope)

    def suppress(self, subject_ref: str, scope: str | None = None) -> int:
        """Suppress the subject (or one scope of it) and bump its deletion epoch, in
        one transaction; returns the new epoch."""
        now = datetime.now(UTC)
        with self._changing_guard():
            with self._write() as conn:
                state = self._lock_guard(conn, subject_ref)
                if scope is None:
                    status, scopes = SUPPRESSED, state.scopes
                else:
                    status, scopes = state.status, state.scopes | {scope}
                self._upsert_guard(conn, subject_ref, status, state.epoch + 1, now, scopes=scopes)
            self._guard_changed()
        return state.epoch + 1

    def set_guard(self, subject_ref: str, status: str) -> None:
        """Change the subject-wide status, keeping the epoch (``active`` re-admits)."""
        now = datetime.now(UTC)
        with self._changing_guard():
            with self._write() as conn:
                state = self._lock_guard(conn, subject_ref)
                self._upsert_guard(conn, subject_ref, status, state.epoch, now, scopes=state.scopes)
            self._guard_changed()

    def release_scope(self, subject_ref: str, scope: str) -> None:
        """Lift a scope's suppression (after its erasure): new writes get a new key."""
        now = datetime.now(UTC)
        with self._changing_guard():
            with self._write() as conn:
                state = self._lock_guard(conn, subject_ref)
                self._upsert_guard(
                    conn, subject_ref, state.status, state.epoch, now, scopes=state.scopes - {scope}
                )
            self._guard_changed()

    @contextmanager
    def _changing_guard(self) -> Iterator[None]:
        """Around a guard change's transaction: the shared generation turns odd
        before it begins, so no process trusts a cached guard from then on, and
        turns even again only after the commit (``_guard_changed``). A process that
        dies in between leaves it odd: every process reads guards from the
        database until the next reader finds nobody changing one and settles it."""
        if self._generation is None:
            yield
            return
        with self._generation.changing():
            yield

    def _guard_changed(self) -> None:
        """After a guard change has committed: cached guards may count again, from
        the new generation on."""
        if self._generation is not None:
            self._generation.settle()

    def _upsert_guard(
        self,
        conn: Connection,
        subject_ref: str,
        status: str,
        epoch: int,
        now: datetime,
        *,
        scopes: frozenset[str] = frozenset(),
    ) -> None:
        values = {
            "status": status,
            "deletion_epoch": epoch,
            "updated_at": now,
            "suppressed_scopes": json.dumps(sorted(scopes)),
        }
        updated = conn.execute(
            subject_guard.update()
            .where(subject_guard.c.subject_ref == subject_ref)
            .values(**values)
        ).rowcount
        if not updated:
            conn.execute(subject_guard.insert().values(subject_ref=subject_ref, **values))

    # -- assets --------------------------------------------------------------------

    def register(
        self,
        rows: Sequence[AssetRow],
        *,
        expected_epoch: int | None = None,
        replace: bool = True,
        remove: Sequence[str] = (),
    ) -> None:
        """Insert (or, with ``replace``, replace) assets and delete ``remove``,
        re-checking every subject's guard in the same write transaction: nothing is
        written if any subject is suppressed or the epoch is stale."""
        if not rows and not remove:
            return
        self.insert_assets(
            [self.asset_params(r) for r in rows],
            scopes={(r.subject_ref, r.scope) for r in rows},
            expected_epoch=expected_epoch,
            replace=[*remove, *(r.asset_id for r in rows)] if replace or remove else (),
            sources=[(r.asset_id, src) for r in rows for src in r.sources],
            mentions=[(r.asset_id, m) for r in rows for m in set(r.mentions)],
        )

    def asset_params(self, r: AssetRow) -> tuple[Any, ...]:
        """An asset as ``insert_assets`` takes it: its ``ASSET_COLUMNS``, times bound
        for this dialect."""
        values = [getattr(r, name) for name in ASSET_COLUMNS]
        for i in _TIME_COLUMNS:
            if values[i] is not None:
                values[i] = self.time_param(values[i])
        return tuple(values)

    def insert_assets(
        self,
        params: Sequence[tuple[Any, ...]],
        *,
        scopes: Iterable[tuple[str, str]],
        expected_epoch: int | None = None,
        replace: Sequence[str] = (),
        sources: Sequence[tuple[str, str]] = (),
        mentions: Sequence[tuple[str, str]] = (),
        detected: Collection[tuple[str, str]] = (),
    ) -> None:
        """``register``'s one transaction, for callers that build rows themselves
        (a batch of memories): ``params`` are tuples in ``ASSET_COLUMNS`` order with
        times from ``time_param``; ``replace`` names assets (and their edges) to
        delete first; ``sources``/``mentions`` are ``(asset_id, other)`` edges, those
        of ``mentions`` also in ``detected`` recorded as found in the value rather
        than declared. The guard of every ``(subject_ref, scope)`` is re-checked in
        the transaction."""
        sql = self._sql
        with self._hot(write=True) as cur:
            states: dict[str, GuardState] = {}
            for ref, scope in scopes:
                state = states.get(ref)
                if state is None:
                    state = states[ref] = self._guard_row(cur, ref, True)
                self.enforce(ref, state, expected_epoch, scope)
            if replace:
                ids = [{"asset_id": a} for a in dict.fromkeys(replace)]
                for name in ("delete_sources", "delete_mentions", "delete_asset"):
                    cur.executemany(sql[name], ids)
            if not params:
                return
            bound: Sequence[Any] = params
            if self.dialect != "sqlite":
                bound = [dict(zip(ASSET_COLUMNS, row, strict=True)) for row in params]
            if len(bound) == 1:
                cur.execute(sql["insert_asset"], bound[0])
            else:
                cur.executemany(sql["insert_asset"], bound)
            if sources:
                cur.executemany(
                    sql["insert_source"], [{"asset_id": a, "source_id": s} for a, s in sources]
                )
            if mentions:
                # A mention of a subject suppressed or erased meanwhile: refused in the
                # transaction that would record it (its erasure's closure may already
                # have been taken, and would miss this asset).
                for ref, state in self._guard_rows(cur, {m for _, m in mentions}).items():
                    if state.status != ACTIVE:
                        raise SubjectSuppressed(
                            f"the memory is about subject_ref {ref}, which is being erased "
                            "or was erased"
                        )
                found = set(detected)
                cur.executemany(
                    sql["insert_mention"],
                    [
                        {
                            "asset_id": a,
                            "subject_ref": m,
                            "how": DETECTED if (a, m) in found else DECLARED,
                        }
                        for a, m in mentions
                    ],
                )

    def time_param(self, value: datetime) -> Any:
        """A datetime as this dialect's hot statements bind it."""
        return _sqlite_time(value) if self.dialect == "sqlite" else value

    def update_assets(self, asset_ids: Sequence[str], **values: Any) -> int:
        """Update metadata columns (status, retain_until, …) of existing assets."""
        allowed = {"status", "retain_until", "storage_key", "lookup"}
        if not set(values) <= allowed:
            raise InvalidInput(f"only {sorted(allowed)} can be updated")
        with self._write() as conn:
            n = 0
            for chunk in _chunks(asset_ids):
                n += conn.execute(
                    assets.update().where(assets.c.asset_id.in_(chunk)).values(**values)
                ).rowcount
            return n

    @staticmethod
    def _delete_ids(conn: Connection, ids: Sequence[str]) -> int:
        n = 0
        for chunk in _chunks(ids):
            conn.execute(asset_sources.delete().where(asset_sources.c.asset_id.in_(chunk)))
            conn.execute(asset_mentions.delete().where(asset_mentions.c.asset_id.in_(chunk)))
            n += conn.execute(assets.delete().where(assets.c.asset_id.in_(chunk))).rowcount
        return n

    def delete(self, asset_ids: Sequence[str]) -> int:
        """Physically remove asset rows and their provenance edges."""
        with self._write() as conn:
            return self._delete_ids(conn, asset_ids)

    @staticmethod
    def subject_filter(subject_ref: str, scope: str | None, table: sa.Table = assets) -> Any:
        """The rows of ``table`` (assets, tokens) of a subject, or of one scope."""
        where = table.c.subject_ref == subject_ref
        return where if scope is None else sa.and_(where, table.c.scope == scope)

    def asset_kinds(self, subject_ref: str, scope: str | None = None) -> dict[str, str]:
        """Asset id -> kind of every asset of the subject (or one of its scopes)."""
        with self._read() as conn:
            out = {
                str(a): str(k)
                for a, k in conn.execute(
                    sa.select(assets.c.asset_id, assets.c.kind).where(
                        self.subject_filter(subject_ref, scope)
                    )
                )
            }
        if self.token_assets is not None:
            out.update((t.asset_id, t.kind) for t in self.token_assets(subject_ref, scope))
        return out

    def delete_subject_assets(self, subject_ref: str, scope: str | None = None) -> int:
        """Delete every asset of the subject (or scope) and its provenance edges in
        three statements, however many assets there are."""
        own = sa.select(assets.c.asset_id).where(self.subject_filter(subject_ref, scope))
        with self._write() as conn:
            conn.execute(asset_sources.delete().where(asset_sources.c.asset_id.in_(own)))
            conn.execute(asset_mentions.delete().where(asset_mentions.c.asset_id.in_(own)))
            return int(
                conn.execute(
                    assets.delete().where(self.subject_filter(subject_ref, scope))
                ).rowcount
            )

    def _rows(self, conn: Connection, where: Any) -> list[AssetRow]:
        rows = conn.execute(sa.select(assets).where(where)).all()
        if not rows:
            return []
        ids = [r.asset_id for r in rows]
        srcs: dict[str, list[str]] = {}
        mens: dict[str, list[str]] = {}
        for chunk in _chunks(ids):
            for a, s in conn.execute(
                sa.select(asset_sources.c.asset_id, asset_sources.c.source_id).where(
                    asset_sources.c.asset_id.in_(chunk)
                )
            ):
                srcs.setdefault(a, []).append(s)
            for a, m in conn.execute(
                sa.select(asset_mentions.c.asset_id, asset_mentions.c.subject_ref).where(
                    asset_mentions.c.asset_id.in_(chunk)
                )
            ):
                mens.setdefault(a, []).append(m)
        return [
            AssetRow(
                r.asset_id,
                r.subject_ref,
                r.scope,
                r.kind,
                r.storage_system,
                r.storage_key,
                r.purpose,
                r.category,
                utc(r.created_at),  # type: ignore[arg-type]
                utc(r.retain_until),
                r.status,
                r.lookup,
                r.producer,
                r.producer_version,
                tuple(sorted(srcs.get(r.asset_id, ()))),
                tuple(sorted(mens.get(r.asset_id, ()))),
            )
            for r in rows
        ]

    def assets(
        self,
        subject_ref: str,
        *,
        scope: str | None = None,
        kind: str | None = None,
        status: str | None = None,
    ) -> list[AssetRow]:
        where = self.subject_filter(subject_ref, scope)
        if kind is not None:
            where = sa.and_(where, assets.c.kind == kind)
        if status is not None:
            where = sa.and_(where, assets.c.status == status)
        with self._read() as conn:
            rows = self._rows(conn, where)
        if kind in (None, "token") and status in (None, "live") and self.token_assets:
            rows += self.token_assets(subject_ref, scope)
        return rows

    def asset_ids(self, subject_ref: str, kind: str) -> dict[str, str]:
        """Asset id -> scope of a subject's assets of one kind."""
        with self._hot(write=False) as cur:
            cur.execute(self._sql["asset_ids"], {"subject_ref": subject_ref, "kind": kind})
            return {row[0]: row[1] for row in cur.fetchall()}

    def asset(self, asset_id: str) -> AssetRow | None:
        with self._read() as conn:
            rows = self._rows(conn, assets.c.asset_id == asset_id)
        if not rows and asset_id.startswith("<") and self.token_asset is not None:
            return self.token_asset(asset_id)  # a token of the vault
        return rows[0] if rows else None

    def count(self, subject_ref: str | None = None, kind: str | None = None) -> int:
        query = sa.select(sa.func.count()).select_from(assets)
        if subject_ref is not None:
            query = query.where(assets.c.subject_ref == subject_ref)
        if kind is not None:
            query = query.where(assets.c.kind == kind)
        with self._read() as conn:
            return int(conn.execute(query).scalar_one())

    def expired(self, kind: str, now: datetime) -> dict[str, list[str]]:
        """Asset ids of ``kind`` whose retain-until has passed, by subject_ref."""
        out: dict[str, list[str]] = {}
        with self._read() as conn:
            for asset_id, ref in conn.execute(
                sa.select(assets.c.asset_id, assets.c.subject_ref).where(
                    assets.c.kind == kind,
                    assets.c.retain_until.is_not(None),
                    assets.c.retain_until <= now,
                )
            ):
                out.setdefault(str(ref), []).append(str(asset_id))
        return out

    def subjects_with(self, kind: str) -> list[str]:
        """subject_refs that hold assets of ``kind`` and are not suppressed."""
        with self._read() as conn:
            refs = [
                str(r)
                for (r,) in conn.execute(
                    sa.select(assets.c.subject_ref).where(assets.c.kind == kind).distinct()
                )
            ]
            hidden = {
                str(r)
                for (r,) in conn.execute(
                    sa.select(subject_guard.c.subject_ref).where(subject_guard.c.status != ACTIVE)
                )
            }
        return sorted(r for r in refs if r not in hidden)

    def derived_from(self, source_ids: Iterable[str]) -> list[AssetRow]:
        """Assets whose provenance names any of ``source_ids`` (reverse index)."""
        ids = list(source_ids)
        found: set[str] = set()
        with self._read() as conn:
            for chunk in _chunks(ids):
                found.update(
                    conn.execute(
                        sa.select(asset_sources.c.asset_id).where(
                            asset_sources.c.source_id.in_(chunk)
                        )
                    ).scalars()
                )
            return self._rows(conn, assets.c.asset_id.in_(sorted(found))) if found else []

    def derived_from_subject(self, subject_ref: str, scope: str | None = None) -> list[AssetRow]:
        """Assets of other subjects (or scopes) whose provenance names any asset of
        this subject (scope): one join, however many assets the subject has."""
        own = sa.select(assets.c.asset_id).where(self.subject_filter(subject_ref, scope))
        with self._read() as conn:
            ids = set(
                conn.execute(
                    sa.select(asset_sources.c.asset_id).where(asset_sources.c.source_id.in_(own))
                ).scalars()
            )
            own_ids = set(conn.execute(own).scalars())
            ids -= own_ids
            return self._rows(conn, assets.c.asset_id.in_(sorted(ids))) if ids else []

    def source_owners(self, source_ids: Iterable[str]) -> dict[str, set[str]]:
        """Every owner each source asset is about, as owner tokens
        (``keyshred.keyring.keystore.owner_token``): its holder's data in its scope
        (``ref@scope``) and the subjects it mentions (``ref``), and the same of its own
        sources, transitively (a derived asset of a derived asset). One recursive
        query over the provenance and mention tables, however many sources and
        levels. Sources the catalog does not hold (erased) have no owners."""
        ids = sorted(set(source_ids))
        if not ids:
            return {}
        # UNION, not UNION ALL: a cycle in the provenance graph ends the walk.
        sql = sa.text(
            f"""
            WITH RECURSIVE walk(root, asset_id) AS (
                SELECT asset_id, asset_id FROM {assets.name} WHERE asset_id IN :ids
                UNION
                SELECT walk.root, s.source_id FROM walk
                JOIN {asset_sources.name} s ON s.asset_id = walk.asset_id
            )
            SELECT walk.root, a.subject_ref || '@' || a.scope FROM walk
            JOIN {assets.name} a ON a.asset_id = walk.asset_id
            UNION
            SELECT walk.root, m.subject_ref FROM walk
            JOIN {asset_mentions.name} m ON m.asset_id = walk.asset_id
            """  # noqa: S608 - table names are ours, values are bound
        ).bindparams(sa.bindparam("ids", expanding=True))
        out: dict[str, set[str]] = {}
        with self._read() as conn:
            for root, owner in conn.execute(sql, {"ids": ids}):
                out.setdefault(str(root), set()).add(str(owner))
        return out

    def any_source_in(self, source_ids: Sequence[str]) -> int:
        """How many provenance edges still name one of ``source_ids``."""
        n = 0
        with self._read() as conn:
            for chunk in _chunks(list(source_ids), 900):
                n += int(
                    conn.execute(
                        sa.select(sa.func.count())
                        .select_from(asset_sources)
                        .where(asset_sources.c.source_id.in_(chunk))
                    ).scalar_one()
                )
        return n

    def mentioning(self, subject_ref: str) -> list[AssetRow]:
        with self._read() as conn:
            ids = list(
                conn.execute(
                    sa.select(asset_mentions.c.asset_id).where(
                        asset_mentions.c.subject_ref == subject_ref
                    )
                ).scalars()
            )
            return self._rows(conn, assets.c.asset_id.in_(ids)) if ids else []

    def detected_mentions(self, asset_id: str) -> frozenset[str]:
        """The subjects an asset mentions because their identifiers were found in its
        value (not declared): a rewrite that keeps the mentions keeps how they came."""
        with self._read() as conn:
            return frozenset(
                conn.execute(
                    sa.select(asset_mentions.c.subject_ref).where(
                        asset_mentions.c.asset_id == asset_id,
                        asset_mentions.c.how == DETECTED,
                    )
                ).scalars()
            )

    def mention_counts(self) -> dict[str, int]:
        """Mentions recorded, by how they came: ``{"declared": n, "detected": m}``."""
        counts = {DECLARED: 0, DETECTED: 0}
        with self._read() as conn:
            for how, n in conn.execute(
                sa.select(asset_mentions.c.how, sa.func.count()).group_by(asset_mentions.c.how)
            ):
                counts[str(how)] = int(n)
        return counts

    # -- registered identifiers (keyshred.storage.mentions) -------------------------

    def add_identifiers(
        self,
        subject_ref: str,
        rows: Iterable[tuple[str, str, bytes | None]],
        kinds: Iterable[str],
        version: int = 1,
    ) -> int | None:
        """Store ``(hash, kind, sealed normal form)`` of a subject's identifiers,
        hashed under identifier key ``version``, and ``kinds``
        (``keyshred.storage.mentions`` marks: the kinds, names by their number of
        words) among the kinds ever registered; returns how many hashes were new, or
        None (nothing stored) when the catalog's hashes are under another version
        (hash again under ``identifier_version()`` and retry). The subject's guard
        is re-read in the same write transaction: a suppressed or erased subject
        registers nothing."""
        wanted = {h: (k, sealed) for h, k, sealed in rows}
        now = datetime.now(UTC)
        with self._write() as conn:
            self.enforce(subject_ref, self._lock_guard(conn, subject_ref), None)
            if self._lock_identifier_version(conn, exclusive=False) != version:
                return None
            have = set(
                conn.execute(
                    sa.select(identifiers.c.hash).where(identifiers.c.subject_ref == subject_ref)
                ).scalars()
            )
            new = [
                {"hash": h, "subject_ref": subject_ref, "kind": k, "created_at": now, "sealed": b}
                for h, (k, b) in wanted.items()
                if h not in have
            ]
            if new:
                # A concurrent registration of the same identifier is no error.
                conn.execute(self._insert_ignore(identifiers), new)
            marks = [{"kind": k} for k in sorted(set(kinds))]
            if marks:
                conn.execute(self._insert_ignore(identifier_kinds), marks)
        return len(new)

    def _lock_identifier_version(self, conn: Connection, *, exclusive: bool) -> int:
        """The identifier key version, its row created if absent and locked (shared
        for a registration, exclusive for a re-hash) until ``conn`` commits. SQLite
        write transactions are serialised anyway."""
        conn.execute(self._insert_ignore(identifier_key_version), [{"id": 1, "version": 1}])
        query = sa.select(identifier_key_version.c.version).where(identifier_key_version.c.id == 1)
        if self.dialect == "postgresql":
            query = query.with_for_update(read=not exclusive)
        return int(conn.execute(query).scalar_one())

    def identifier_version(self) -> int:
        """The identifier key version the registered hashes are under."""
        with self._read() as conn:
            version = conn.execute(
                sa.select(identifier_key_version.c.version).where(identifier_key_version.c.id == 1)
            ).scalar()
        return 1 if version is None else int(version)

    def rehash_identifiers(
        self, version: int, rehash: Callable[[str, str, bytes], str | None]
    ) -> tuple[int, int, int]:
        """Move every registered identifier to identifier key ``version`` in one
        write transaction (concurrent lookups see the old hashes until it commits,
        then the new ones; a concurrent registration waits for it and is redone):
        ``rehash(subject_ref, kind, sealed)`` gives a row's new hash, or None when
        its subject's key is gone (the row is deleted). Rows without a sealed value
        (registered before it existed) cannot be re-hashed: they are kept as they
        are, matching nothing any more, until the subject registers them again.
        Returns (re-hashed, deleted, kept)."""
        done = deleted = kept = 0
        with self._write() as conn:
            self._lock_identifier_version(conn, exclusive=True)
            rows = conn.execute(
                sa.select(
                    identifiers.c.hash,
                    identifiers.c.subject_ref,
                    identifiers.c.kind,
                    identifiers.c.sealed,
                )
            ).all()
            moves: list[dict[str, Any]] = []
            gone: list[dict[str, Any]] = []
            for old, ref, kind, sealed in rows:
                if sealed is None:
                    kept += 1
                    continue
                new = rehash(str(ref), str(kind), bytes(sealed))
                if new is None:
                    gone.append({"o": old, "r": ref})
                elif new != old:
                    moves.append({"o": old, "r": ref, "n": new})
                done += new is not None
            where = sa.and_(
                identifiers.c.hash == sa.bindparam("o"),
                identifiers.c.subject_ref == sa.bindparam("r"),
            )
            if gone:
                conn.execute(identifiers.delete().where(where), gone)
            if moves:
                conn.execute(
                    identifiers.update().where(where).values(hash=sa.bindparam("n")), moves
                )
            conn.execute(
                identifier_key_version.update()
                .where(identifier_key_version.c.id == 1)
                .values(version=version)
            )
        deleted = len(gone)
        return done, deleted, kept

    def _insert_ignore(self, table: sa.Table) -> Any:
        """``INSERT … ON CONFLICT DO NOTHING`` in this dialect."""
        if self.dialect == "postgresql":
            from sqlalchemy.dialects import postgresql

            return postgresql.insert(table).on_conflict_do_nothing()
        from sqlalchemy.dialects import sqlite

        return sqlite.insert(table).on_conflict_do_nothing()

    def delete_identifiers(self, subject_ref: str) -> int:
        """Delete every identifier hash of the subject (``forget_identifiers``, and
        the erasure's catalog step)."""
        with self._write() as conn:
            return int(
                conn.execute(
                    identifiers.delete().where(identifiers.c.subject_ref == subject_ref)
                ).rowcount
            )

    def count_identifiers(self, subject_ref: str) -> int:
        with self._read() as conn:
            return int(
                conn.execute(
                    sa.select(sa.func.count())
                    .select_from(identifiers)
                    .where(identifiers.c.subject_ref == subject_ref)
                ).scalar_one()
            )

    def identifier_kinds(self) -> frozenset[str]:
        """The kinds of identifier registered at least once in this catalog (see
        ``add_identifiers``)."""
        with self._read() as conn:
            return frozenset(conn.execute(sa.select(identifier_kinds.c.kind)).scalars())

    def identifier_subjects(self, hashes: Collection[str]) -> list[tuple[str, str]]:
        """``(hash, subject_ref)`` of every registered identifier among ``hashes``,
        in one statement however many there are (a JSON array on SQLite, an array
        on PostgreSQL: one parameter, one plan)."""
        if not hashes:
            return []
        if self.dialect == "sqlite":
            sql = (
                "SELECT hash, subject_ref FROM ks_identifiers "
                "WHERE hash IN (SELECT value FROM json_each(?))"
            )
            param: Any = json.dumps(list(hashes))
        else:
            sql = "SELECT hash, subject_ref FROM ks_identifiers WHERE hash = ANY(%s)"
            param = list(hashes)
        with self._hot(write=False) as cur:
            cur.execute(sql, (param,))
            return [(str(h), str(r)) for h, r in cur.fetchall()]

    # -- consent -------------------------------------------------------------------

    def grant_consent(
        self,
        subject_ref: str,
        purpose: str,
        category: str,
        *,
        actions: Sequence[str] = ("store", "use"),
        start_at: datetime | None = None,
        end_at: datetime | None = None,
        policy_version: str = "1",
    ) -> ConsentRecord:
        now = datetime.now(UTC)
        start = utc(start_at) or now
        end = utc(end_at)
        if end is not None and end <= start:
            raise InvalidInput("a consent must end after it starts")
        if not actions:
            raise InvalidInput("a consent allows at least one action")
        record = ConsentRecord(
            uuid.uuid4().hex,
            subject_ref,
            purpose,
            category,
            tuple(sorted(set(actions))),
            start,
            end,
            policy_version,
            ACTIVE,
            now,
            None,
        )
        with self._write() as conn:
            conn.execute(
                consents.insert().values(
                    consent_id=record.consent_id,
                    subject_ref=subject_ref,
                    purpose=purpose,
                    category=category,
                    actions=json.dumps(list(record.actions)),
                    start_at=start,
                    end_at=end,
                    policy_version=policy_version,
                    status=ACTIVE,
                    created_at=now,
                    revoked_at=None,
                )
            )
        return record

    def revoke_consent(self, subject_ref: str, purpose: str, category: str) -> int:
        """Mark every active consent for (subject, purpose, category) revoked; the
        records stay as history with their policy versions."""
        now = datetime.now(UTC)
        with self._write() as conn:
            return conn.execute(
                consents.update()
                .where(
                    consents.c.subject_ref == subject_ref,
                    consents.c.purpose == purpose,
                    consents.c.category == category,
                    consents.c.status == ACTIVE,
                )
                .values(status="revoked", revoked_at=now)
            ).rowcount

    def consents(self, subject_ref: str) -> list[ConsentRecord]:
        with self._read() as conn:
            rows = conn.execute(
                sa.select(consents)
                .where(consents.c.subject_ref == subject_ref)
                .order_by(consents.c.created_at)
            ).all()
        return [_consent(r) for r in rows]

    def active_consent(
        self, subject_ref: str, purpose: str, category: str, action: str, at: datetime
    ) -> ConsentRecord | None:
        params = {
            "subject_ref": subject_ref,
            "purpose": purpose,
            "category": category,
            **self._constants,
        }
        with self._hot(write=False) as cur:
            cur.execute(self._sql["consents_for"], params)
            names = [d[0] for d in cur.description]
            rows = [_Row(dict(zip(names, r, strict=True))) for r in cur.fetchall()]
        covering = [c for c in map(_consent, rows) if c.covers(action, at)]
        return max(
            covering, key=lambda c: c.end_at or datetime.max.replace(tzinfo=UTC), default=None
        )

    def delete_consents(self, subject_ref: str) -> int:
        with self._write() as conn:
            return conn.execute(
                consents.delete().where(consents.c.subject_ref == subject_ref)
            ).rowcount

    # -- snapshots (backups) -------------------------------------------------------

    @contextmanager
    def snapshot(self) -> Iterator[CatalogSnapshot]:
        """The catalog at this instant. SQLite: a one-step copy through SQLite's
        backup API (a single read, milliseconds); PostgreSQL: a ``REPEATABLE READ``
        transaction pinned by its first read. The backup takes it while writers are
        frozen and exports it after they resume."""
        if self.dialect == "sqlite":
            fairy = self.engine.raw_connection()
            try:
                copy = sqlite3.connect(":memory:", check_same_thread=False)
                fairy.driver_connection.backup(copy)  # type: ignore[union-attr]
            finally:
                fairy.close()
            try:
                yield CatalogSnapshot(None, copy)
            finally:
                copy.close()
            return
        conn = self.engine.connect()
        try:
            conn = conn.execution_options(isolation_level="REPEATABLE READ")
            with conn.begin():
                conn.execute(sa.select(sa.func.count()).select_from(subject_guard)).scalar()
                yield CatalogSnapshot(conn, None)
        finally:
            conn.close()

    def close(self) -> None:
        if self._generation is not None:
            self._generation.close()
            self._generation = None
        self.engine.dispose()

    def _forked(self) -> None:
        """In a forked child: the parent's connections stay the parent's (a database
        connection must not cross a fork); the child opens its own."""
        if self._generation is not None:
            self._generation.forked()
        self.engine.dispose(close=False)

    def __repr__(self) -> str:
        return f"Catalog(dialect={self.dialect!r})"


_CATALOGS: weakref.WeakSet[Catalog] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for catalog in list(_CATALOGS):
        catalog._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


_GUARD_CACHE = 20_000  # subjects whose guard a process keeps (then it starts over)


class _GuardGeneration:
    """A counter shared by every process of an embedded catalog (an 8-byte file next
    to it, mapped into memory) that each guard change moves: to an odd value before
    its transaction begins, to the next even one after it committed. Reading it
    costs a memory load instead of a statement; a process caches a guard only under
    an even value and reads it again once the value has moved.

    The change holds the file's lock (``flock``, released by the kernel when its
    process dies) from the odd value to the even one, so a crash between the commit
    and the even value leaves an odd counter and nothing cached is trusted; a
    reader that can take the lock knows nobody is changing a guard and settles it.
    """

    def __init__(self, path: Path) -> None:
        if not path.exists():
            # Created with its content in one step (a link), so no process ever
            # maps a half-made file or resets a counter another one has moved.
            tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, bytes(8))
            finally:
                os.close(fd)
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
            tmp.unlink()
        self._path = path
        self._fd = os.open(path, os.O_RDWR)
        self._pid = os.getpid()
        self._map = mmap.mmap(self._fd, 8)
        # ``flock`` excludes other processes only (threads share the descriptor).
        self._lock = threading.Lock()

    def value(self) -> int:
        return int.from_bytes(self._map[:8], "little")

    def _store(self, value: int) -> None:
        self._map[:8] = (value % 2**64).to_bytes(8, "little")

    def _descriptor(self) -> int:
        if self._pid != os.getpid():
            # A forked child shares the parent's open file, and with it the lock:
            # its own descriptor makes the two changes exclude each other.
            self._fd = os.open(self._path, os.O_RDWR)
            self._pid = os.getpid()
        return self._fd

    @contextmanager
    def changing(self) -> Iterator[None]:
        """Hold the change: odd now, even (``settle``) at the latest on the way out."""
        with self._lock:
            fd = self._descriptor()
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                value = self.value()
                self._store(value + 1 if value % 2 == 0 else value + 2)
                yield
            finally:
                self.settle()
                fcntl.flock(fd, fcntl.LOCK_UN)

    def settle(self) -> None:
        """Make the counter even: called holding the change, after the commit."""
        value = self.value()
        if value % 2:
            self._store(value + 1)

    def settle_abandoned(self) -> int:
        """The counter, made even first if it is odd only because the process that
        was changing a guard died: nobody holds the change any more."""
        if not self._lock.acquire(blocking=False):
            return self.value()  # a thread of this process is changing a guard
        try:
            fd = self._descriptor()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return self.value()  # another process is changing one
            try:
                self.settle()
                return self.value()
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            self._lock.release()

    def forked(self) -> None:
        """In a forked child: a lock held by a parent's thread is nobody's here."""
        self._lock = threading.Lock()

    def close(self) -> None:
        with contextlib.suppress(ValueError, BufferError):
            self._map.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)


class CatalogSnapshot:
    """The catalog at one instant; ``export`` writes it as an embedded catalog."""

    def __init__(self, conn: Connection | None, copy: sqlite3.Connection | None) -> None:
        self._conn = conn
        self._copy = copy

    def export(self, path: str | os.PathLike[str]) -> None:
        """Write every table into a new SQLite catalog file at ``path``."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        if self._copy is not None:
            out = sqlite3.connect(target)
            try:
                self._copy.backup(out)
            finally:
                out.close()
            return
        assert self._conn is not None  # noqa: S101 - one of the two is set
        engine = sa.create_engine(sqlite_url(target), future=True)
        try:
            metadata.create_all(engine)
            with engine.begin() as dst:
                for table in metadata.sorted_tables:
                    result = self._conn.execute(sa.select(table)).mappings()
                    while batch := result.fetchmany(5000):
                        dst.execute(table.insert(), [dict(r) for r in batch])
        finally:
            engine.dispose()


class _Row:
    """Attribute access over a DBAPI row dict (what ``_consent`` reads)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)


def _chunks(items: Sequence[_T], size: int = 500) -> Iterator[list[_T]]:
    for start in range(0, len(items), size):
        yield list(items[start : start + size])
