"""The subject guard: the first thing every read and write consults.

``suppress`` bumps the subject's deletion epoch and marks it suppressed in one
transaction, which also publishes the subject's eviction event
(``keyshred.storage.events``: every process drops what it caches of the subject
once the suppression has committed, never before); every write re-reads the guard
inside its own write transaction (``BEGIN IMMEDIATE`` on SQLite, ``SELECT … FOR
SHARE`` on PostgreSQL), so nothing is written for a subject after the transaction
that suppressed it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from keyshred import db
from keyshred.errors import InvalidInput, StaleEpoch, SubjectSuppressed
from keyshred.storage import events
from keyshred.storage.catalog_base import (
    ACTIVE,
    ERASED,
    SUPPRESSED,
    CatalogBase,
    GuardState,
    chunks,
    guard_state,
)
from keyshred.storage.schema import subject_guard

__all__ = ["GuardMixin"]


class GuardMixin(CatalogBase):
    """The guard's reads and changes."""

    _generation: _GuardGeneration | None
    guard_changes: int
    # subject_ref -> (guard generation when read, guard): embedded catalogs only
    _guards: dict[str, tuple[int, GuardState]]

    def _guard_setup(self) -> None:
        self._generation = None
        self._guards = {}
        # Guard changes this process began (a suppression here): with the eviction
        # events of other processes' changes, what a long read watches to read the
        # guard again (``CheckpointStore.checkpoints``).
        self.guard_changes = 0
        path = db.sqlite_file(self.engine.url)
        if path is not None:
            p = Path(path)
            self._generation = _GuardGeneration(p.with_name(p.name + ".guardgen"))

    @property
    def guard_cached(self) -> bool:
        """Whether ``check_guard`` answers from memory while no guard changed (an
        embedded SQLite file's shared generation): reading it is then ~free."""
        return self._generation is not None

    def guard_in(self, cur: Any, subject_ref: str, *, lock: bool = True) -> GuardState:
        """The guard read inside ``hot``'s transaction (``FOR SHARE`` on PostgreSQL)."""
        return self._guard_row(cur, subject_ref, lock)

    def guards_in(self, cur: Any, refs: Iterable[str]) -> dict[str, GuardState]:
        """Many subjects' guards read inside ``hot``'s transaction (``FOR SHARE`` on
        PostgreSQL); a subject without a guard row is absent (active)."""
        return self._guard_rows(cur, refs)

    @staticmethod
    def guard_of(status: Any, epoch: Any, scopes: Any) -> GuardState:
        """A guard from its three columns read by another statement (a join); a
        subject without a guard row (``status`` None) is active."""
        return guard_state(None if status is None else (status, epoch, scopes))

    def _guard_row(self, cur: Any, subject_ref: str, lock: bool) -> GuardState:
        cur.execute(self._sql["guard_lock" if lock else "guard"], {"subject_ref": subject_ref})
        return guard_state(cur.fetchone())

    def _guard_rows(
        self, cur: Any, refs: Iterable[str], *, lock: bool = True
    ) -> dict[str, GuardState]:
        """The guards of many subjects in one read per chunk (with ``lock``, locked
        ``FOR SHARE`` on PostgreSQL, inside the caller's write transaction); absent
        ones are active, and absent from the answer."""
        out: dict[str, GuardState] = {}
        for chunk in chunks(sorted(refs)):
            cur.execute(self._guards_sql(len(chunk), lock=lock), chunk)
            for row in cur.fetchall():
                out[str(row[0])] = guard_state(row[1:])
        return out

    def guards(self, refs: Iterable[str]) -> dict[str, GuardState]:
        """Many subjects' guards as they are now, in one autocommit read per chunk
        (no lock, nothing cached: a scan over many subjects would churn the guard
        cache of the hot path); a subject without a guard row is active."""
        wanted = set(refs)
        with self._hot(write=False) as cur:
            found = self._guard_rows(cur, wanted, lock=False)
        return {ref: found.get(ref, guard_state(None)) for ref in wanted}

    def _guards_sql(self, n: int, *, lock: bool = True) -> str:
        """The guards of ``n`` subjects, bound by position (compiled once per ``n``;
        ``chunks`` makes few different ones)."""
        key = f"guards_{n}" if lock else f"guards_read_{n}"
        sql = self._sql.get(key)
        if sql is None:
            g = subject_guard.c
            query = sa.select(g.subject_ref, g.status, g.deletion_epoch, g.suppressed_scopes)
            query = query.where(g.subject_ref.in_([sa.bindparam(f"r{i}") for i in range(n)]))
            if lock and self.dialect == "postgresql":
                query = query.with_for_update(read=True)
            sql = self._sql[key] = db.compile_sql(self.engine.dialect, query, positional=True)
        return sql

    def _lock_guard(self, conn: Connection, subject_ref: str) -> GuardState:
        query = sa.select(
            subject_guard.c.status,
            subject_guard.c.deletion_epoch,
            subject_guard.c.suppressed_scopes,
        ).where(subject_guard.c.subject_ref == subject_ref)
        if self.dialect == "postgresql":
            query = query.with_for_update()
        return guard_state(conn.execute(query).first())

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
            state = guard_state(row)
            if not current & 1:
                if len(self._guards) >= _GUARD_CACHE:
                    self._guards.clear()
                self._guards[subject_ref] = (current, state)
            return state
        if self.dialect == "sqlite":  # in memory: one connection, no other process
            with self._hot(write=False) as cur:
                row = cur.execute(self._sql["guard_positional"], (subject_ref,)).fetchone()
            return guard_state(row)
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
        if expected_epoch is not None and type(expected_epoch) is not int:
            # A caller's value (``put(..., epoch=)``): compared below, "1" < 2 raised
            # TypeError.
            raise InvalidInput("a deletion epoch is an int")
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

    def owners_suppressed(self, owners: Iterable[str]) -> bool:
        """Whether any owner token of a shared key (``ref``, or ``ref@scope``: its
        data in that scope) names a subject, or a scope of it, that is suppressed or
        erased. What is sealed under that key is data about them: unreadable from
        their suppression on, as it will be once their erasure destroys the key."""
        for token in owners:
            subject, _, scope = token.partition("@")
            state = self.guard(subject)
            if state.status != ACTIVE or (scope and scope in state.scopes):
                return True
        return False

    def suppress(self, subject_ref: str, scope: str | None = None) -> int:
        """Suppress the subject (or one scope of it) and bump its deletion epoch, in
        one transaction; returns the new epoch."""
        now = datetime.now(UTC)
        with self._changing_guard():
            with self._write() as conn:
                state = self._lock_guard(conn, subject_ref)
                if scope is None:
                    # An erased subject (an earlier erasure, or an id blocked) stays
                    # erased: refused as a suppressed one is, and a request that then
                    # finds nothing must not re-admit it (``set_guard``'s ``only_from``).
                    status = ERASED if state.status == ERASED else SUPPRESSED
                    scopes = state.scopes
                else:
                    status, scopes = state.status, state.scopes | {scope}
                self._upsert_guard(conn, subject_ref, status, state.epoch + 1, now, scopes=scopes)
                # Last in the transaction: its clock reading is the nearest to the
                # commit, at which PostgreSQL delivers it.
                event = events.publish(conn, subject_ref, scope, state.epoch + 1)
            self._guard_changed()
        events.deliver(self.engine, event)  # SQLite: this process's handles, now
        return state.epoch + 1

    def announce_eviction(self, subject_ref: str, scope: str | None, epoch: int) -> None:
        """Publish a suppression's eviction event again, in a transaction of its own:
        after the keys' destruction, so that what a read in flight cached between
        the suppression and the destruction leaves every process as well (no new
        key can be loaded after it)."""
        with self._write() as conn:
            event = events.publish(conn, subject_ref, scope, epoch)
        events.deliver(self.engine, event)

    def set_guard(
        self,
        subject_ref: str,
        status: str,
        *,
        only_from: str | None = None,
        unless: Callable[[Connection], bool] | None = None,
    ) -> bool:
        """Change the subject-wide status, keeping the epoch (``active`` re-admits);
        with ``only_from``, only if the status is that one now, and with ``unless``,
        only if it answers False, asked in the transaction that holds the guard's
        row (another erasure under way). Returns whether the status was set."""
        now = datetime.now(UTC)
        with self._changing_guard():
            with self._write() as conn:
                state = self._lock_guard(conn, subject_ref)
                change = only_from is None or state.status == only_from
                if change and unless is not None and unless(conn):
                    change = False
                if change:
                    self._upsert_guard(
                        conn, subject_ref, status, state.epoch, now, scopes=state.scopes
                    )
            self._guard_changed()
        return change

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
        self.guard_changes += 1
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

    Kept for a measured end-to-end gain (issue 20, ``bench_memories.py``, one run
    window, embedded catalog): warm get p50 0.03 ms with it against 0.10 ms without
    (0.49x against 1.44x LangGraph's SqliteStore); puts wait for an fsync either way.
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
