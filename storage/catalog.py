"""The catalog: asset index, provenance, registered identifiers, consent records and
the subject guard, on SQLite (embedded profile) or PostgreSQL (distributed profile).

``Catalog`` composes its parts (``catalog_guard``, ``catalog_assets``,
``catalog_identifiers``, ``catalog_consents`` on ``catalog_base``); this module holds
the vault's token rows, which the catalog lists as assets, and snapshots. Tables are
defined in ``keyshred.storage.schema``; schema changes are the Alembic revisions of
``keyshred.migrations``, which the facade runs before it opens the catalog.
"""

from __future__ import annotations

import functools
import os
import sqlite3
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from itertools import chain
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from keyshred.db import Micros, create_engine, micros, sqlite_url, utc
from keyshred.errors import ConfigError
from keyshred.storage.catalog_assets import ASSET_COLUMNS, AssetsMixin
from keyshred.storage.catalog_base import (
    ACTIVE,
    ERASED,
    SUPPRESSED,
    AssetRow,
    ConsentRecord,
    GuardState,
)
from keyshred.storage.catalog_base import OPEN as _OPEN
from keyshred.storage.catalog_base import chunks as _chunks
from keyshred.storage.catalog_consents import ConsentsMixin
from keyshred.storage.catalog_identifiers import IdentifiersMixin
from keyshred.storage.schema import (
    DECLARED,
    DETECTED,
    VERSION_TABLE,
    asset_mentions,
    asset_sources,
    assets,
    consents,
    metadata,
    subject_guard,
)

__all__ = [
    "ACTIVE",
    "ASSET_COLUMNS",
    "DECLARED",
    "DETECTED",
    "ERASED",
    "SUPPRESSED",
    "TOKEN_BLOCK",
    "TOKEN_COLUMNS",
    "TOKEN_KIND",
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

# Token rows per INSERT statement in a group commit (11 parameters a row; SQLite
# takes 32,766): chunks of 256, then 32, then the rest one by one.
_ROWS_PER_INSERT = (256, 32)


# The vault's tokens. Each row is a token asset in full (subject_ref, scope, purpose,
# retain-until = expires_at, storage = this table; tokens derive from nothing), so
# tokens get no second row in ``ks_assets``: ``assets()`` and ``asset_kinds()`` list
# them with kind ``token``. One row per token halves what a sanitize writes. The key
# is the token's number, which its id enciphers (``keyshred.keyring.tokenid``):
# numbers come in blocks per process, so rows append, and a token finds its row by
# primary key; no index of random ids takes random inserts. ``lookup`` (deterministic
# tokens only) is the HMAC of the value under a key derived from the subject's DEK.
TOKEN_KIND = "token"  # noqa: S105 - an asset kind, not a secret
TOKEN_BLOCK = 1024  # numbers a process takes at a time

tokens = sa.Table(
    "ks_tokens",
    metadata,
    # INTEGER PRIMARY KEY on SQLite: the rowid itself.
    sa.Column(
        "number",
        sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
        primary_key=True,
        autoincrement=False,
    ),
    sa.Column("token", sa.String(64), nullable=False),
    sa.Column("subject_ref", sa.String(64), nullable=False),
    sa.Column("scope", sa.String(128), nullable=False),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("purpose", sa.String(128), nullable=False),
    sa.Column("deterministic", sa.Boolean, nullable=False),
    sa.Column("lookup", sa.LargeBinary(32), nullable=True),
    # Microseconds since 1970 UTC (``Micros``): bound as integers on the hot path.
    sa.Column("created_at", Micros, nullable=False),
    sa.Column("expires_at", Micros, nullable=False),
    sa.Column("value", sa.LargeBinary, nullable=False),  # envelope ciphertext
    sa.Index("ks_tokens_subject", "subject_ref", "scope"),
)
sa.Index(
    "ks_tokens_lookup",
    tokens.c.lookup,
    sqlite_where=tokens.c.lookup.is_not(None),
    postgresql_where=tokens.c.lookup.is_not(None),
)
# One row per block of token numbers handed to a process; never deleted, so a number
# is never issued twice (block b holds b * TOKEN_BLOCK .. b * TOKEN_BLOCK + 1023).
token_blocks = sa.Table(
    "ks_token_blocks",
    metadata,
    sa.Column("block", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("taken_at", sa.DateTime(timezone=True), nullable=False),
    # The taking process's group-commit interval: how long its tokens may wait in
    # its memory before they are written (0: written before they are handed out).
    sa.Column("group_commit_ms", sa.Float, nullable=False, server_default="0"),
    sqlite_autoincrement=True,
)
TOKEN_COLUMNS = tuple(c.name for c in tokens.columns)
_TOKEN_DETERMINISTIC = TOKEN_COLUMNS.index("deterministic")
_TOKEN_VALUE = TOKEN_COLUMNS.index("value")


class Catalog(AssetsMixin, IdentifiersMixin, ConsentsMixin):
    """The asset index and policy state on SQLite or PostgreSQL.

    With ``create`` the catalog's tables are brought up to date at open:
    ``migrate(engine)`` when given (the facade passes ``keyshred.migrations.
    migrate_catalog``: Alembic revisions, a catalog from an older release upgraded in
    place), otherwise the storage tables that are missing are created as they are
    defined now (a catalog used on its own, by tests and tools; it is stamped and
    upgraded like any unversioned catalog when the facade opens it later). The
    storage layer does not import the migrations: they assemble the tables of the
    layers above it."""

    def __init__(
        self,
        url: str,
        *,
        create: bool = True,
        migrate: Callable[[Engine], None] | None = None,
        pool_size: int = 5,
        max_overflow: int = 10,
        pool_timeout: float = 30.0,
        pre_ping: bool = False,
    ) -> None:
        self.url = url
        self.engine = create_engine(
            url,
            what="catalog",
            pool_size=pool_size,
            max_overflow=max_overflow,
            pool_timeout=pool_timeout,
            pre_ping=pre_ping,
        )
        self.dialect = self.engine.dialect.name
        self._mark = "?" if self.dialect == "sqlite" else "%s"  # DBAPI placeholders
        if create:
            try:
                if migrate is not None:
                    migrate(self.engine)
                else:
                    metadata.create_all(self.engine)
            except sa.exc.OperationalError:
                self.engine.dispose()
                raise ConfigError("the catalog database cannot be reached") from None
            except BaseException:
                self.engine.dispose()
                raise
        self._guard_setup()
        self.on_stale = None
        # token -> its row number (set by the vault; None for what is not a token)
        self.token_number: Callable[[str], int | None] | None = None
        # The vault's flush: reads of token assets first store this process's tokens
        # held for group commit, so a process reads its own writes.
        self.flush_tokens: Callable[[], object] | None = None
        _CATALOGS.add(self)
        self._sql = self._compile_hot_statements()

    def _compile_hot_statements(self) -> dict[str, str]:
        """The statements of the paths every put and get takes, compiled once."""
        bp = sa.bindparam
        guard = sa.select(
            subject_guard.c.status,
            subject_guard.c.deletion_epoch,
            subject_guard.c.suppressed_scopes,
        ).where(subject_guard.c.subject_ref == bp("subject_ref"))
        statements: dict[str, Any] = {
            "guard": guard,
            "guard_positional": guard,
            "guard_lock": guard.with_for_update(read=True)
            if self.dialect == "postgresql"
            else guard,
            "insert_asset": assets.insert().values({c.name: bp(c.name) for c in assets.columns}),
            "insert_source": asset_sources.insert().values(
                asset_id=bp("asset_id"), source_id=bp("source_id")
            ),
            "insert_mention": asset_mentions.insert().values(
                asset_id=bp("asset_id"), subject_ref=bp("subject_ref"), how=bp("how")
            ),
            "delete_asset": assets.delete().where(assets.c.asset_id == bp("asset_id")),
            "insert_token": tokens.insert().values({c.name: bp(c.name) for c in tokens.columns}),
            "insert_token_replay": self._insert_ignore(tokens).values(
                {c.name: bp(c.name) for c in tokens.columns}
            ),
            "delete_sources": asset_sources.delete().where(
                asset_sources.c.asset_id == bp("asset_id")
            ),
            "delete_mentions": asset_mentions.delete().where(
                asset_mentions.c.asset_id == bp("asset_id")
            ),
            "asset_ids": sa.select(assets.c.asset_id, assets.c.scope).where(
                assets.c.subject_ref == bp("subject_ref"), assets.c.kind == bp("kind")
            ),
            "consents_for": sa.select(consents).where(
                consents.c.subject_ref == bp("subject_ref"),
                consents.c.purpose == bp("purpose"),
                consents.c.category == bp("category"),
                consents.c.status == bp("active"),
            ),
        }
        # On SQLite these bind by position (a tuple: cheaper per row than a dict).
        positional = {"insert_asset", "insert_token", "insert_token_replay", "guard_positional"}
        self.token_columns = TOKEN_COLUMNS
        return self.compile(statements, positional=positional)

    def insert_tokens(
        self,
        rows: Sequence[Sequence[Any]],
        scopes: Iterable[tuple[str, str, int | None]],
        *,
        existing_ok: bool = False,
    ) -> None:
        """Store token rows (values in ``token_columns`` order, times as ``micros``),
        re-checking the guard of every ``(subject_ref, scope,
        expected epoch)`` in the same write transaction: nothing is stored if any
        of them is suppressed or its epoch is stale. ``existing_ok`` skips rows whose
        number is stored already (a journal replayed after its rows were stored)."""
        if not rows:
            return
        with self._hot(write=True) as cur:
            scopes = list(scopes)
            if len(scopes) == 1:
                ref, scope, epoch = scopes[0]
                self.enforce(ref, self._guard_row(cur, ref, True), epoch, scope)
            else:  # a group commit: every subject's guard in one read
                states = self._guard_rows(cur, {ref for ref, _, _ in scopes})
                for ref, scope, epoch in scopes:
                    self.enforce(ref, states.get(ref, _OPEN), epoch, scope)
            sql = self._sql["insert_token_replay" if existing_ok else "insert_token"]
            if self.dialect == "sqlite":
                self._insert_sqlite(cur, sql, rows)
            elif len(rows) == 1:
                cur.execute(sql, dict(zip(self.token_columns, rows[0], strict=True)))
            else:
                cur.executemany(
                    sql, [dict(zip(self.token_columns, row, strict=True)) for row in rows]
                )

    def _insert_sqlite(self, cur: Any, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        """Token rows through Python's ``sqlite3``, bound positionally from one flat
        list. Many rows per statement: one step through SQLite's VM per chunk
        instead of a bind, step and reset per row (few statement sizes, so each is
        prepared once and cached).

        ``sqlite3`` binds ``int``, ``float``, ``str`` and ``bytearray`` as they are,
        but passes anything else (``bool``, ``None``, ``bytes``) through its adapter
        registry first: a tuple built and looked up and two attribute lookups per
        value, a third of what storing a token row cost. So ``deterministic`` goes
        in as an ``int`` and the sealed ``value`` as a ``bytearray`` (SQLite stores
        the same integer and the same blob)."""
        width = len(self.token_columns)
        flat = list(chain.from_iterable(rows))
        flat[_TOKEN_DETERMINISTIC::width] = map(int, flat[_TOKEN_DETERMINISTIC::width])
        flat[_TOKEN_VALUE::width] = map(bytearray, flat[_TOKEN_VALUE::width])
        count, at = len(rows), 0
        for size in _ROWS_PER_INSERT:
            if count - at >= size:
                stmt = self._multi_row(sql, size)
                while count - at >= size:
                    cur.execute(stmt, flat[at * width : (at + size) * width])
                    at += size
        while at < count:
            cur.execute(sql, flat[at * width : (at + 1) * width])
            at += 1

    @staticmethod
    @functools.lru_cache(maxsize=16)
    def _multi_row(sql: str, rows: int) -> str:
        """``INSERT … VALUES (…)`` with ``rows`` value lists."""
        head, _, tail = sql.partition(" VALUES ")
        values, close, rest = tail.partition(")")
        return f"{head} VALUES {', '.join([values + close] * rows)}{rest}"

    def token_block(self, group_commit_ms: float = 0.0) -> int:
        """A fresh block of token numbers, never handed out before: its first number
        (``TOKEN_BLOCK`` numbers from there on are the caller's, whose tokens wait
        up to ``group_commit_ms`` before they are written)."""
        with self._write() as conn:
            block = conn.execute(
                token_blocks.insert().values(
                    taken_at=datetime.now(UTC), group_commit_ms=group_commit_ms
                )
            ).inserted_primary_key
        assert block is not None  # noqa: S101 - an insert has a key
        return int(block[0]) * TOKEN_BLOCK

    def token_pending_window(
        self, number: int, slack: float = 0.5, now: datetime | None = None
    ) -> float:
        """How long (seconds) a token number without a row may still wait in its
        issuing process's group commit: 0 unless its block was handed out to a
        process with group commit and the block's next stored number (if any) was
        issued less than that interval plus ``slack`` ago. A process flushes what
        it issued within its interval, so an older later number means this one was
        flushed too (and deleted since); a very recent one may have overtaken it
        between two threads."""
        block = number // TOKEN_BLOCK
        with self._read() as conn:
            window = conn.execute(
                sa.select(token_blocks.c.group_commit_ms).where(token_blocks.c.block == block)
            ).scalar()
            if not window:
                return 0.0  # never issued (forged), or issued by a commit per call
            later = conn.execute(
                sa.select(tokens.c.created_at)
                .where(tokens.c.number > number, tokens.c.number < (block + 1) * TOKEN_BLOCK)
                .order_by(tokens.c.number)
                .limit(1)
            ).scalar()
        seconds = float(window) / 1000.0
        if later is not None:
            age = ((now or datetime.now(UTC)) - utc(later)).total_seconds()  # type: ignore[operator]
            if age >= seconds + slack:
                return 0.0
        return seconds + slack

    def token_block_mark(self) -> int:
        """The highest block of token numbers handed out so far (0 for none)."""
        with self._read() as conn:
            return int(conn.execute(sa.select(sa.func.max(token_blocks.c.block))).scalar() or 0)

    def skip_token_blocks(self, through: int) -> None:
        """Hand out no block up to ``through`` from now on. A restored catalog gets the
        live one's mark: blocks taken after the snapshot were used by tokens that are
        gone with the restore but may still sit in texts and logs, and a number
        issued twice would make such a token resolve to the new token's value."""
        if through <= self.token_block_mark():
            return
        with self._write() as conn:
            conn.execute(token_blocks.insert().values(block=through, taken_at=datetime.now(UTC)))
            if self.dialect == "postgresql":
                # An explicit key does not move a serial's sequence; SQLite's
                # AUTOINCREMENT continues above the largest key by itself.
                conn.execute(
                    sa.text(
                        "SELECT setval(pg_get_serial_sequence('ks_token_blocks', 'block'), :n)"
                    ),
                    {"n": through},
                )

    def _marks(self, n: int) -> str:
        """``n`` positional placeholders of this dialect (never values)."""
        return ", ".join([self._mark] * n)

    def token_lookups(
        self, subject_ref: str, scope: str, purpose: str, lookups: Sequence[bytes]
    ) -> dict[bytes, str]:
        """lookup -> token of the subject's stored deterministic tokens for ``purpose``
        (the lowest-numbered, if racing processes issued two)."""
        out: dict[bytes, str] = {}
        for chunk in _chunks(lookups):
            with self._hot(write=False) as cur:
                cur.execute(
                    "SELECT lookup, token FROM ks_tokens WHERE "  # noqa: S608
                    f"lookup IN ({self._marks(len(chunk))}) AND subject_ref = {self._mark} "
                    f"AND scope = {self._mark} AND purpose = {self._mark} ORDER BY number DESC",
                    [*chunk, subject_ref, scope, purpose],
                )
                found = cur.fetchall()
            out.update({bytes(r[0]): str(r[1]) for r in found})  # the lowest number wins
        return out

    def asset_kinds(self, subject_ref: str, scope: str | None = None) -> dict[str, str]:
        """Asset id -> kind of every asset of the subject (or one of its scopes)."""
        self._settle_tokens()
        with self._read() as conn:
            out = {
                str(a): str(k)
                for a, k in conn.execute(
                    sa.select(assets.c.asset_id, assets.c.kind).where(
                        self.subject_filter(subject_ref, scope)
                    )
                )
            }
            where = self.subject_filter(subject_ref, scope, tokens)
            for (t,) in conn.execute(sa.select(tokens.c.token).where(where)):
                out[str(t)] = TOKEN_KIND
        return out

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
        with_tokens = kind in (None, TOKEN_KIND) and status in (None, "live")
        if with_tokens:
            self._settle_tokens()
        with self._read() as conn:
            rows = self._rows(conn, where)
            if with_tokens:
                rows += self._token_rows(conn, self.subject_filter(subject_ref, scope, tokens))
        return rows

    def _settle_tokens(self) -> None:
        if self.flush_tokens is not None:
            self.flush_tokens()

    @staticmethod
    def _token_rows(conn: Connection, where: Any) -> list[AssetRow]:
        """Token rows seen as the assets they are."""
        return [
            AssetRow(
                r.token,
                r.subject_ref,
                r.scope,
                TOKEN_KIND,
                "catalog",
                "ks_tokens",
                r.purpose,
                "token",
                utc(r.created_at),  # type: ignore[arg-type]
                utc(r.expires_at),
            )
            for r in conn.execute(
                sa.select(
                    tokens.c.token,
                    tokens.c.subject_ref,
                    tokens.c.scope,
                    tokens.c.purpose,
                    tokens.c.created_at,
                    tokens.c.expires_at,
                ).where(where)
            )
        ]

    def asset(self, asset_id: str) -> AssetRow | None:
        if asset_id.startswith("<"):
            self._settle_tokens()
        with self._read() as conn:
            rows = self._rows(conn, assets.c.asset_id == asset_id)
            if not rows and asset_id.startswith("<"):
                # A token's row by its number when the vault has said how to read
                # one (``token_number``); without it, a scan.
                number = self.token_number(asset_id) if self.token_number else None
                where = tokens.c.token == asset_id
                if number is not None:
                    where = sa.and_(tokens.c.number == number, where)
                rows = self._token_rows(conn, where)
        return rows[0] if rows else None

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
                # The revision the tables are at, so the copy opens without upgrades
                # it does not need.
                if VERSION_TABLE in sa.inspect(self._conn).get_table_names():
                    version = sa.Table(
                        VERSION_TABLE,
                        sa.MetaData(),
                        sa.Column("version_num", sa.String(32), primary_key=True),
                    )
                    version.create(dst)
                    rows = self._conn.execute(sa.select(version)).mappings().all()
                    if rows:
                        dst.execute(version.insert(), [dict(r) for r in rows])
        finally:
            engine.dispose()
