"""The vault's token rows: written and read on the catalog's engine.

``TokenStore`` runs the vault's statements (``keyshred.vault.schema``) on the catalog's
pooled engine: the hot ones (a sanitize's insert, a deterministic lookup) compiled
once with SQLAlchemy Core and run on DBAPI cursors, the cold ones through
SQLAlchemy connections. A sanitize's rows go in one write transaction that checks
the subject's guard again inside it, so no token of a suppressed subject is ever
stored and a token a sanitize returned is committed before it returns.

On an embedded (file) catalog the inserts run on one connection this store takes
from the catalog's pool and keeps, one transaction at a time under a lock: SQLite
lets one writer in at a time anyway, and a checkout and return per call cost as
much as the transaction's statements (measured, issue 20). Inside ``BEGIN
IMMEDIATE`` no guard change can commit, so the catalog's guard cache (valid while
the shared guard generation has not moved) answers for the transaction without a
statement. On PostgreSQL each insert checks a connection out of the pool and reads
the guard ``FOR SHARE`` in its transaction.

It also shows the catalog the tokens as the assets they are (``Catalog.token_assets``
and ``token_asset``): the catalog lists them without knowing the vault's tables.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from itertools import chain
from typing import Any

import sqlalchemy as sa

from keyshred._pooling import unreachable
from keyshred.db import sqlite_file, unavailable, utc
from keyshred.storage.catalog import AssetRow, Catalog
from keyshred.storage.catalog_base import OPEN
from keyshred.vault.schema import TOKEN_BLOCK, TOKEN_COLUMNS, TOKEN_KIND, create, token_blocks
from keyshred.vault.schema import tokens as tokens_table

__all__ = ["TokenStore", "block_mark", "skip_blocks"]

_DETERMINISTIC = TOKEN_COLUMNS.index("deterministic")
_VALUE = TOKEN_COLUMNS.index("value")
# Token rows per INSERT statement (11 parameters a row; SQLite takes 32,766): chunks
# of 256, then 32, then the rest one by one. A message carries a few tokens, a
# ``sanitize_many`` batch hundreds.
_ROWS_PER_INSERT = (256, 32)
_CHUNK = 500  # lookups per IN (...) list


@functools.lru_cache(maxsize=16)
def _multi_row(sql: str, rows: int) -> str:
    """``INSERT … VALUES (…)`` with ``rows`` value lists."""
    head, _, tail = sql.partition(" VALUES ")
    values, close, rest = tail.partition(")")
    return f"{head} VALUES {', '.join([values + close] * rows)}{rest}"


class TokenStore:
    """The token rows of one catalog."""

    def __init__(
        self, catalog: Catalog, number_of: Callable[[str], int | None], *, create_tables: bool
    ) -> None:
        self.catalog = catalog
        self._number_of = number_of
        if create_tables:
            create(catalog.engine)
        self._sqlite = catalog.dialect == "sqlite"
        # In memory the pool has one connection per thread: nothing to keep.
        self._keep = sqlite_file(catalog.engine.url) is not None
        self._writer: Any = None  # the kept pool connection (its proxy)
        self._write_lock = threading.Lock()
        self._mark = "?" if self._sqlite else "%s"
        values: dict[str, Any] = {c.name: sa.bindparam(c.name) for c in tokens_table.columns}
        compiled = catalog.compile(
            {
                "insert": tokens_table.insert().values(values),
                "replay": catalog.insert_ignore(tokens_table).values(values),
            },
            positional={"insert", "replay"},
        )
        self._insert, self._replay = compiled["insert"], compiled["replay"]
        catalog.token_assets = self.assets
        catalog.token_asset = self.asset

    # -- the hot path ------------------------------------------------------------

    def insert(
        self,
        rows: Sequence[Sequence[Any]],
        guards: Iterable[tuple[str, str, int]],
        *,
        existing_ok: bool = False,
    ) -> None:
        """Store token rows (values in ``TOKEN_COLUMNS`` order, times as microseconds)
        in one transaction that re-reads the guard of every ``(subject_ref, scope,
        epoch)`` of theirs: nothing is stored if any of them is suppressed or its
        epoch moved past the one given (``SubjectSuppressed``/``StaleEpoch``). One
        call's rows carry one guard; a group commit's, every subject's it holds.
        ``existing_ok`` skips rows whose number is stored already (a journal replayed
        after its rows were stored)."""
        if not rows:
            return
        guards = list(guards)
        catalog = self.catalog
        if self._keep:
            with self._write_lock:
                self._insert_kept(rows, guards, existing_ok)
            return
        with catalog.hot(write=True) as cur:
            self._enforce_in(cur, guards)
            sql = self._replay if existing_ok else self._insert
            if self._sqlite:
                self._insert_sqlite(cur, sql, rows)
            elif len(rows) == 1:  # psycopg: named parameters
                cur.execute(sql, dict(zip(TOKEN_COLUMNS, rows[0], strict=True)))
            else:
                cur.executemany(sql, [dict(zip(TOKEN_COLUMNS, row, strict=True)) for row in rows])

    def _enforce_in(self, cur: Any, guards: list[tuple[str, str, int]]) -> None:
        """Every guard read in the write transaction of ``cur`` (``FOR SHARE`` on
        PostgreSQL; one statement per 500 subjects for a group)."""
        catalog = self.catalog
        if len(guards) == 1:
            ref, scope, epoch = guards[0]
            catalog.enforce(ref, catalog.guard_in(cur, ref), epoch, scope)
            return
        states = catalog.guards_in(cur, {ref for ref, _, _ in guards})
        for ref, scope, epoch in guards:
            catalog.enforce(ref, states.get(ref, OPEN), epoch, scope)

    def _insert_kept(
        self, rows: Sequence[Sequence[Any]], guards: list[tuple[str, str, int]], existing_ok: bool
    ) -> None:
        """``insert`` on the kept connection of an embedded catalog."""
        catalog = self.catalog
        try:
            if self._writer is None:
                self._writer = catalog.engine.raw_connection()
            cur = self._writer.driver_connection.cursor()
            cur.execute("BEGIN IMMEDIATE")
        except Exception as exc:
            self._drop_writer()
            if unreachable(catalog.dialect, catalog.engine.dialect.dbapi, exc):
                raise unavailable(exc) from None
            raise
        try:
            # The write lock is held: the guard reads now are the transaction's.
            for ref, scope, epoch in guards:
                if catalog.check_guard(ref, scope=scope) != epoch:
                    catalog.check_guard(ref, epoch, scope)  # StaleEpoch
            self._insert_sqlite(cur, self._replay if existing_ok else self._insert, rows)
            cur.execute("COMMIT")
        except BaseException as exc:
            with contextlib.suppress(Exception):
                cur.execute("ROLLBACK")
            if isinstance(exc, Exception) and unreachable(
                catalog.dialect, catalog.engine.dialect.dbapi, exc
            ):
                raise unavailable(exc) from None
            raise
        finally:
            with contextlib.suppress(Exception):
                cur.close()

    def _drop_writer(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.close()  # back to the pool

    def close(self) -> None:
        """Return the kept connection to the pool."""
        with self._write_lock:
            self._drop_writer()

    def forked(self) -> None:
        """In a forked child: the kept connection is the parent's (the catalog's pool
        forgets it too); the lock may have been held by a thread that is not here."""
        self._writer = None
        self._write_lock = threading.Lock()

    def _insert_sqlite(self, cur: Any, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        """Rows through Python's ``sqlite3``, bound positionally from one flat list,
        many rows per statement: one step through SQLite's VM per chunk instead of
        a bind, step and reset per row (few statement sizes, each prepared once and
        cached by ``sqlite3``).

        ``sqlite3`` binds ``int``, ``float``, ``str`` and ``bytearray`` as they are,
        but passes ``bool``, ``None`` and ``bytes`` through its adapter registry
        first (a third of what storing a row cost). So ``deterministic`` goes in as
        an ``int`` and the sealed ``value`` as a ``bytearray`` (SQLite stores the
        same integer and the same blob)."""
        width = len(TOKEN_COLUMNS)
        flat = list(chain.from_iterable(rows))
        flat[_DETERMINISTIC::width] = map(int, flat[_DETERMINISTIC::width])
        flat[_VALUE::width] = map(bytearray, flat[_VALUE::width])
        count, at = len(rows), 0
        for size in _ROWS_PER_INSERT:
            if count - at >= size:
                stmt = _multi_row(sql, size)
                while count - at >= size:
                    cur.execute(stmt, flat[at * width : (at + size) * width])
                    at += size
        while at < count:
            cur.execute(sql, flat[at * width : (at + 1) * width])
            at += 1

    def lookups(
        self, subject_ref: str, scope: str, purpose: str, lookups: Sequence[bytes]
    ) -> dict[bytes, str]:
        """lookup -> token of the subject's stored deterministic tokens for
        ``purpose`` (the lowest-numbered, if racing processes issued two)."""
        out: dict[bytes, str] = {}
        mark = self._mark
        for start in range(0, len(lookups), _CHUNK):
            chunk = list(lookups[start : start + _CHUNK])
            with self.catalog.hot(write=False) as cur:
                cur.execute(
                    "SELECT lookup, token FROM ks_tokens WHERE "  # noqa: S608 - placeholders only
                    f"lookup IN ({', '.join([mark] * len(chunk))}) AND subject_ref = {mark} "
                    f"AND scope = {mark} AND purpose = {mark} ORDER BY number DESC",
                    [*chunk, subject_ref, scope, purpose],
                )
                found = cur.fetchall()
            out.update({bytes(r[0]): str(r[1]) for r in found})  # the lowest number wins
        return out

    def row(self, number: int) -> Any:
        """The stored row of ``number`` (None if there is none)."""
        with self.catalog.engine.connect() as conn:
            return conn.execute(
                sa.select(tokens_table).where(tokens_table.c.number == number)
            ).first()

    # -- numbers -----------------------------------------------------------------

    def block(self, group_commit_ms: float = 0.0) -> int:
        """A fresh block of token numbers, never handed out before: its first number
        (``TOKEN_BLOCK`` numbers from there on are the caller's, whose tokens wait up
        to ``group_commit_ms`` before they are written)."""
        with self.catalog.transaction() as conn:
            block = conn.execute(
                token_blocks.insert().values(
                    taken_at=datetime.now(UTC), group_commit_ms=group_commit_ms
                )
            ).inserted_primary_key
        assert block is not None  # noqa: S101 - an insert has a key
        return int(block[0]) * TOKEN_BLOCK

    def pending_window(self, number: int, slack: float, now: datetime) -> float:
        """How long (seconds) a token number without a row may still wait in its
        issuing process's group commit: 0 unless its block went to a process with
        group commit and the block's next stored number (if any) was issued less
        than that interval plus ``slack`` ago. A process stores what it issued within
        its interval, so an older later number means this one was stored too (and
        deleted since); a very recent one may have overtaken it between threads."""
        block = number // TOKEN_BLOCK
        t = tokens_table.c
        with self.catalog.engine.connect() as conn:
            window = conn.execute(
                sa.select(token_blocks.c.group_commit_ms).where(token_blocks.c.block == block)
            ).scalar()
            if not window:
                return 0.0  # never handed out (forged), or its tokens commit per call
            later = conn.execute(
                sa.select(t.created_at)
                .where(t.number > number, t.number < (block + 1) * TOKEN_BLOCK)
                .order_by(t.number)
                .limit(1)
            ).scalar()
        seconds = float(window) / 1000.0
        if later is not None:
            age = (now - utc(later)).total_seconds()  # type: ignore[operator]
            if age >= seconds + slack:
                return 0.0
        return seconds + slack

    def block_mark(self) -> int:
        """The highest block of token numbers handed out so far (0 for none)."""
        return block_mark(self.catalog)

    def skip_blocks(self, through: int) -> None:
        """Hand out no block up to ``through`` from now on (``skip_blocks``)."""
        skip_blocks(self.catalog, through)

    # -- subjects ----------------------------------------------------------------

    def delete_subject(self, subject_ref: str, scope: str | None = None) -> int:
        """Delete the subject's (scope's) rows; returns how many went."""
        where = self.catalog.subject_filter(subject_ref, scope, tokens_table)
        with self.catalog.transaction() as conn:
            return int(conn.execute(tokens_table.delete().where(where)).rowcount)

    def count(self, subject_ref: str, scope: str | None = None) -> int:
        """Stored tokens of the subject (or of one of its scopes)."""
        where = self.catalog.subject_filter(subject_ref, scope, tokens_table)
        with self.catalog.engine.connect() as conn:
            return int(
                conn.execute(
                    sa.select(sa.func.count()).select_from(tokens_table).where(where)
                ).scalar_one()
            )

    # -- tokens as assets (the catalog's hooks) ------------------------------------

    def assets(self, subject_ref: str, scope: str | None = None) -> list[AssetRow]:
        """The subject's (scope's) tokens as the assets they are."""
        return self._asset_rows(self.catalog.subject_filter(subject_ref, scope, tokens_table))

    def asset(self, token: str) -> AssetRow | None:
        """One token's asset row, by its number (its id deciphered)."""
        number = self._number_of(token)
        if number is None:
            return None
        rows = self._asset_rows(
            sa.and_(tokens_table.c.number == number, tokens_table.c.token == token)
        )
        return rows[0] if rows else None

    def _asset_rows(self, where: Any) -> list[AssetRow]:
        t = tokens_table.c
        with self.catalog.engine.connect() as conn:
            found = conn.execute(
                sa.select(t.token, t.subject_ref, t.scope, t.purpose, t.created_at, t.expires_at)
                .where(where)
                .order_by(t.number)
            ).all()
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
            for r in found
        ]


def block_mark(catalog: Catalog) -> int:
    """The highest block of token numbers handed out from ``catalog`` (0 for none)."""
    with catalog.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.max(token_blocks.c.block))).scalar() or 0)


def skip_blocks(catalog: Catalog, through: int) -> None:
    """Hand out no block up to ``through`` from ``catalog`` from now on. A restored
    catalog gets the live one's mark: blocks taken after the snapshot were used by
    tokens that are gone with the restore but may still sit in texts and logs, and a
    number issued twice would make such a token resolve to the new token's value."""
    if through <= block_mark(catalog):
        return
    with catalog.transaction() as conn:
        conn.execute(token_blocks.insert().values(block=through, taken_at=datetime.now(UTC)))
        if catalog.dialect == "postgresql":
            # An explicit key does not move a serial's sequence; SQLite's
            # AUTOINCREMENT continues above the largest key by itself.
            conn.execute(
                sa.text("SELECT setval(pg_get_serial_sequence('ks_token_blocks', 'block'), :n)"),
                {"n": through},
            )
