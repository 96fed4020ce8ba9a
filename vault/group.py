"""Group commit for the vault: tokens handed out before their rows are stored, and
nothing lost when the process dies.

With ``tokens.group_commit_ms > 0`` (the embedded default) ``sanitize`` does not
commit its rows. It journals them (``keyshred.vault.journal``: a copy into a file
of this process mapped into memory, which a crash of the process does not lose; the
promise the embedded catalog's own commit makes, since SQLite in WAL mode with
``synchronous=NORMAL`` writes but does not fsync), holds them here, and returns; the
rows are written many calls per transaction within that many milliseconds, by the
caller that finds the interval over, or by a background flusher when calls stop.

Why it exists (issue 20's rule: keep it only if it is at least 1.5x the best
simple design, measured in the same run): a SQLite transaction costs more than the
rest of a one-message ``sanitize`` (detection, sealing, token ids) together; one
transaction per interval instead of one per call made ``sanitize`` 1.9x faster at
low load (benchmarks/README.md, "Issue #20"). PostgreSQL's default is a commit per
call: its commits are fsync'd by the server, which a journal in the page cache
would weaken.

What holds while rows wait:

- they resolve at once in this process (``row``, ``lookup``), and another process
  that meets one waits for it up to the interval (``TokenStore.pending_window``);
- the flush re-reads every held subject's guard in its transaction, so a subject
  suppressed meanwhile has its held rows dropped, never stored; an erasure drops
  them here too (``drop``);
- the journal of a process that died is replayed by the next vault that opens the
  folder (``recover``) under the same guard rules, expired rows dropped;
- a background flush that fails is retried at the next interval (the rows stay held
  and journaled); each failure is counted (``on_flush_failure``: the metrics
  counter), logged with the exception's type only (a message could quote a row),
  audited once per run of failures, and shown by ``status()``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from keyshred.db import micros
from keyshred.errors import IntegrityError, SubjectSuppressed
from keyshred.storage import faults
from keyshred.vault.journal import Segment, TokenJournal, encode
from keyshred.vault.store import TokenStore

__all__ = ["GroupCommit", "VaultStatus"]

_log = logging.getLogger("keyshred.vault")
FLUSHER_NAME = "keyshred-token-flusher"


@dataclass(frozen=True)
class VaultStatus:
    """``ks.vault.status()``: group commit's state in this process."""

    group_commit_ms: float
    pending: int  # rows issued, not stored yet
    flush_failures: int  # background flushes that failed (each retried)
    consecutive_failures: int  # since the last flush that succeeded
    last_failure_at: datetime | None
    last_failure: str | None  # the exception's type name, never its message

    def as_dict(self) -> dict[str, Any]:
        return {
            k: v.isoformat() if isinstance(v, datetime) else v for k, v in self.__dict__.items()
        }


class _Held:
    """Token rows held for group commit: one generation. The vault fills one while
    a flush stores the one before, and both resolve; a flush takes a generation
    whole, so nothing is done row by row on the way out."""

    __slots__ = ("epochs", "guards", "lookups", "rows", "tokens")

    def __init__(self) -> None:
        self.rows: list[tuple[Any, ...]] = []  # in issue order (ks_tokens columns)
        self.epochs: list[int] = []  # each row's guard epoch when it was issued
        self.guards: set[tuple[str, str, int]] = set()  # (subject_ref, scope, epoch)
        self.tokens: dict[str, tuple[Any, ...]] = {}  # token -> row
        # (subject_ref, scope, purpose, lookup) -> token, of deterministic rows
        self.lookups: dict[tuple[str, str, str, bytes], str] = {}

    def add(self, epoch: int, rows: list[tuple[Any, ...]]) -> None:
        """The rows of one call (one subject, scope, purpose and mode)."""
        first = rows[0]
        self.rows += rows
        self.epochs += [epoch] * len(rows)
        self.guards.add((first[2], first[3], epoch))
        tokens = self.tokens
        for row in rows:
            tokens[row[1]] = row
        if first[6]:
            for row in rows:
                self.lookups[(row[2], row[3], row[5], row[7])] = row[1]

    def extend(self, later: _Held) -> None:
        """Append a later generation (a failed flush's rows go back in front)."""
        self.rows += later.rows
        self.epochs += later.epochs
        self.guards |= later.guards
        self.tokens.update(later.tokens)
        self.lookups.update(later.lookups)

    def drop(self, subject_ref: str, scope: str | None) -> int:
        """Forget the rows of a subject (or one scope of it); returns how many."""
        kept = [
            (epoch, row)
            for epoch, row in zip(self.epochs, self.rows, strict=True)
            if row[2] != subject_ref or (scope is not None and row[3] != scope)
        ]
        dropped = len(self.rows) - len(kept)
        if dropped:
            self.rows = [row for _, row in kept]
            self.epochs = [epoch for epoch, _ in kept]
            self.guards = {(row[2], row[3], epoch) for epoch, row in kept}
            self.tokens = {row[1]: row for row in self.rows}
            self.lookups = {k: t for k, t in self.lookups.items() if t in self.tokens}
        return dropped


class GroupCommit:
    """The held rows of one vault, its journal and its flusher."""

    def __init__(
        self,
        store: TokenStore,
        interval_ms: float,
        journal: Path | None,
        *,
        clock: Callable[[], datetime],
        audit: Any,
        on_flush_failure: Callable[[], None] | None = None,
    ) -> None:
        self._store = store
        self.interval = max(0.0, interval_ms) / 1000.0
        self._clock = clock
        self._audit = audit
        self._on_flush_failure = on_flush_failure
        self._held = _Held()
        self._storing = _Held()
        self._pending_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        self._flushed_at = self._issued_at = time.monotonic()
        self._failures = self._failing = 0
        self._failed_at: datetime | None = None
        self._failure: str | None = None
        # Every held row is journaled; the folder also holds what dead processes
        # left, stored by ``recover``.
        self._journal = None if journal is None else TokenJournal(journal)
        self._detached: list[Segment] = []  # segments whose rows a flush has taken

    # -- holding -------------------------------------------------------------------

    def hold(self, epoch: int, rows: list[tuple[Any, ...]]) -> None:
        """Journal one call's rows and keep them pending until a flush. Ids are
        unique by construction (enciphered unique numbers), so the text may go out
        before its rows are stored."""
        record = None if self._journal is None else encode(epoch, rows)
        with self._pending_lock:
            if record is not None:
                self._journal.append(record)  # type: ignore[union-attr]
            self._held.add(epoch, rows)
        self._issued_at = now = time.monotonic()
        if now - self._flushed_at >= self.interval:
            # Busy: the caller flushes, once per interval. A background thread
            # flushing while callers run would trade the GIL back and forth on
            # every row the database steps through.
            self.flush()
        elif self._flusher is None:
            self._start_flusher()

    def row(self, token: str) -> tuple[Any, ...] | None:
        """A held row by its token (None if it is not held)."""
        with self._pending_lock:
            return self._held.tokens.get(token) or self._storing.tokens.get(token)

    def lookups(
        self, subject_ref: str, scope: str, purpose: str, lookups: list[bytes]
    ) -> dict[bytes, str]:
        """lookup -> token of the held deterministic rows among ``lookups``."""
        out: dict[bytes, str] = {}
        with self._pending_lock:
            for held in (self._held, self._storing):
                for lookup in lookups:
                    token = held.lookups.get((subject_ref, scope, purpose, lookup))
                    if token is not None:
                        out[lookup] = token
        return out

    def drop(self, subject_ref: str, scope: str | None) -> int:
        """Forget the subject's (scope's) held rows, then store the others and zero
        the journal segments that held the dropped ones (sealed under keys an erasure
        destroys, but gone all the same). Returns how many were held."""
        with self._pending_lock:
            dropped = self._held.drop(subject_ref, scope)
            # A flush storing this generation re-checks the guard in its transaction.
            self._storing.drop(subject_ref, scope)
        self.flush()
        return dropped

    # -- flushing ------------------------------------------------------------------

    def _start_flusher(self) -> None:
        with self._pending_lock:
            if self._flusher is not None and self._flusher.is_alive():
                return
            self._stop.clear()
            self._flusher = threading.Thread(
                target=self._flush_loop, name=FLUSHER_NAME, daemon=True
            )
            self._flusher.start()

    def _flush_loop(self) -> None:
        # Idle: what callers left pending is written within the interval.
        interval = self.interval
        while not self._stop.is_set():
            self._stop.wait(interval)
            now = time.monotonic()
            if not self._held.rows or now - self._flushed_at < interval:
                continue
            if now - self._issued_at < interval / 2 and now - self._flushed_at < 2 * interval:
                continue  # callers are busy: the next one flushes inline
            try:
                self.flush()
            except Exception as exc:  # noqa: BLE001 - retried next interval; never kills the flusher
                self._flush_failed(exc)

    def _flush_failed(self, exc: Exception) -> None:
        """Count, log and (first of a run) audit a failed background flush. Only the
        exception's type: a database error's message can quote the rows. A run of
        failures is logged at its 1st, 2nd, 4th, 8th... failure (the counter and
        ``status()`` have every one)."""
        kind = type(exc).__name__
        self._failures += 1
        self._failing += 1
        self._failed_at, self._failure = self._clock(), kind
        if self._on_flush_failure is not None:
            self._on_flush_failure()
        if self._failing & (self._failing - 1) == 0:  # a power of two: no flood
            _log.warning(
                "token flush failed (%s, %d in a row); the tokens stay held and "
                "journaled, retried in %.0f ms",
                kind,
                self._failing,
                self.interval * 1000,
            )
        if self._failing == 1:
            # The catalog may be what fails: then so does this, and the log stands.
            with contextlib.suppress(Exception):
                self._audit.record("vault.flush_failed", error=kind)

    def status(self) -> VaultStatus:
        with self._pending_lock:
            pending = len(self._held.rows) + len(self._storing.rows)
        return VaultStatus(
            self.interval * 1000,
            pending,
            self._failures,
            self._failing,
            self._failed_at,
            self._failure,
        )

    def flush(self) -> int:
        """Write every held row now; returns how many were stored. A subject
        suppressed (or erased and re-admitted) meanwhile has its rows dropped."""
        with self._flush_lock:  # one flush at a time: a batch is written once
            try:
                stored = self._flush()
            finally:
                self._flushed_at = time.monotonic()
            self._failing = 0  # a run of background failures ends here
            return stored

    def _flush(self) -> int:
        with self._pending_lock:
            batch = self._storing = self._held
            self._held = _Held()
            # The segments that journaled these rows leave with them (appends hold
            # the same lock): they are emptied once the rows are stored.
            if self._journal is not None:
                self._detached += self._journal.detach()
        try:
            stored = self._store_group(batch.rows, batch.epochs, batch.guards)
            faults.reached("vault.after_store")
        except BaseException:
            with self._pending_lock:  # held again, in front of what came meanwhile
                batch.extend(self._held)
                self._held, self._storing = batch, _Held()
            raise
        with self._pending_lock:
            self._storing = _Held()
        if self._detached and self._journal is not None:
            # Every row of these segments was in this batch or an earlier one, or
            # was dropped with its erased subject.
            self._journal.release(self._detached)
            self._detached = []
        return stored

    def _store_group(
        self, rows: list[tuple[Any, ...]], epochs: list[int], guards: set[tuple[str, str, int]]
    ) -> int:
        """Store held (or replayed) rows under their guards. Rows whose number is
        stored already are skipped (``existing_ok``): numbers are never issued twice,
        so such a row is this one, stored by an earlier try — a batch held again
        after a failure part-way through the per-subject path below, or a journal
        replayed after its rows were stored."""
        if not rows:
            return 0
        insert = self._store.insert
        try:
            insert(rows, guards, existing_ok=True)
            return len(rows)
        except SubjectSuppressed:
            pass
        # A subject went under suppression meanwhile: write the others group by
        # group; the suppressed subject's rows are never stored.
        groups: dict[tuple[str, str, int], list[tuple[Any, ...]]] = {}
        for epoch, row in zip(epochs, rows, strict=True):
            groups.setdefault((row[2], row[3], epoch), []).append(row)
        stored = 0
        for guard, group in groups.items():
            try:
                insert(group, [guard], existing_ok=True)
                stored += len(group)
            except SubjectSuppressed:
                continue
            faults.reached("vault.after_group")
        return stored

    # -- dead processes' journals ----------------------------------------------------

    def recover(self) -> int:
        """Store what processes that died with group commit left in their journals;
        returns how many rows were stored. Rows already stored are skipped; rows of a
        subject suppressed or erased since (its deletion epoch moved) and expired
        rows are dropped. A segment that fails its checks is set aside as
        ``*.corrupt``, audited, and reported with ``IntegrityError`` once the others
        are done."""
        journal = self._journal
        if journal is None:
            return 0
        stored, corrupt = 0, 0
        for segment in journal.orphans():
            try:
                records = segment.read()
            except IntegrityError:
                corrupt += 1
                with contextlib.suppress(OSError):
                    segment.path.rename(segment.path.with_suffix(".corrupt"))
                journal.retire([segment])
                self._audit.record("vault.journal_corrupt", segment=segment.path.stem)
                continue
            now = micros(self._clock())
            live = [(epoch, row) for epoch, row in records if row[9] > now]
            rows = [row for _, row in live]
            epochs = [epoch for epoch, _ in live]
            guards = {(row[2], row[3], epoch) for epoch, row in live}
            stored += self._store_group(rows, epochs, guards)
            journal.retire([segment])
        if corrupt:
            raise IntegrityError(f"{corrupt} token journal segment(s) failed their checks")
        return stored

    def recover_quietly(self) -> None:
        """``recover`` where its failure must not fail the caller: a corrupt segment
        is already audited and set aside; one that cannot be read or deleted now
        stays for the next try."""
        with contextlib.suppress(IntegrityError, SubjectSuppressed, OSError):
            self.recover()

    # -- life --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the flusher and write what is held (the journal then goes)."""
        self._stop.set()
        if self._flusher is not None:
            self._flusher.join(timeout=10)
            self._flusher = None
        self.flush()
        if self._journal is not None:
            self._journal.close()

    def forked(self) -> None:
        """In a forked child: what is held and the journal are the parent's (the
        child would store the parent's rows twice); locks may have been held by a
        thread that is not here."""
        self._pending_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._flusher = None
        self._held = _Held()
        self._storing = _Held()
        detached, self._detached = self._detached, []
        if self._journal is not None:
            self._journal.forget(detached)
