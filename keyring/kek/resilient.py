"""Retries, a circuit breaker and call counters around any KEK provider.

``ResilientKek`` is a decorator (Tink's ``KmsClient`` wrappers are the model): it is a
``KekProvider`` itself and forwards every call to the provider it wraps, so the
keyring never knows it is there. The configuration (``keyshred._backends``) puts it
around every provider it builds.

- **Retries**: only transient failures (``KekUnavailable``: the service cannot be
  reached, is sealed or restarting) are retried, with exponential backoff and full
  jitter (``tenacity``'s ``wait_random_exponential``: each wait is uniform in
  ``[0, min(cap, initial * 2**n)]``), at most ``retries`` times and never past
  ``retry_max_seconds`` since the first attempt (a wait that would end past it is
  not taken). An ``IntegrityError``, a destroyed epoch or a refusal (``KekError``)
  is an answer, not an outage: it is raised at once.
- **Circuit**: after ``circuit_failures`` transient failures in a row (attempts, the
  retries included) the circuit opens for ``circuit_reset_seconds``: every call fails
  at once with ``KekCircuitOpen`` (a ``KekUnavailable``) naming when the service is
  tried again, instead of each caller waiting out its own retries against a service
  that is down. After the cool-down the circuit is half-open: one trial call goes
  through (others still fail fast); its success closes the circuit, its failure
  opens it for another cool-down.
- **Counters**: per operation, the calls that reached the provider, the calls that
  failed in the end, the retries and the calls refused by the open circuit
  (``counts()``), and how often the circuit opened (``circuit_opened``). ``on_call``
  is told ``(op, outcome)`` for each, outcome one of ``ok``, ``error``, ``retry``,
  ``open``: both are operation names and fixed words, never anything of a subject
  or a key, so they can be metric labels as they are.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TypeVar

import tenacity

from keyshred.errors import InvalidInput, KekCircuitOpen, KekUnavailable
from keyshred.keyring.kek import Context, DestroyedEpoch, EpochInfo, KekProvider, WrappedKey

__all__ = ["OUTCOMES", "CallCounts", "Circuit", "ResilientKek"]

T = TypeVar("T")
OUTCOMES = ("ok", "error", "retry", "open")
"""The outcomes ``on_call`` reports."""

Observer = Callable[[str, str], None]


@dataclass(slots=True)
class CallCounts:
    """One operation's counters (a snapshot when read through ``counts()``)."""

    calls: int = 0  # attempts that reached the provider, retries included
    errors: int = 0  # calls that failed in the end (after their retries)
    retries: int = 0  # attempts repeated after a transient failure
    open: int = 0  # calls refused at once by the open circuit


class Circuit:
    """A consecutive-failure circuit breaker: closed, open until a time, half-open
    with one trial call in flight. Thread-safe; ``clock`` is monotonic seconds."""

    def __init__(
        self,
        failures: int,
        reset_seconds: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        if failures < 1:
            raise InvalidInput("kek_circuit_failures must be at least 1")
        if reset_seconds <= 0:
            raise InvalidInput("kek_circuit_reset_seconds must be positive")
        self._threshold = failures
        self._reset = reset_seconds
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._failures = 0
        self._open_until: float | None = None
        self._trial = False  # a half-open trial call is in flight
        self.times_opened = 0

    @property
    def state(self) -> str:
        """``closed``, ``open`` or ``half-open`` (safe to log)."""
        with self._lock:
            if self._open_until is None:
                return "closed"
            if self._trial or self._clock() >= self._open_until:
                return "half-open"
            return "open"

    def admit(self, provider: str) -> None:
        """Let a call through, or raise ``KekCircuitOpen``."""
        with self._lock:
            if self._open_until is None:
                return
            now = self._clock()
            if now >= self._open_until and not self._trial:
                self._trial = True  # half-open: this call is the one trial
                return
            wait = max(0.0, self._open_until - now)  # 0: a trial call is in flight
        retry_at = self._wall() + timedelta(seconds=wait)
        raise KekCircuitOpen(
            f"the KEK service ({provider}) is down: its last {self._threshold} calls "
            f"failed in a row, so calls fail fast; it is tried again at "
            f"{retry_at.isoformat(timespec='seconds')} (in {wait:.1f} s)",
            retry_at,
        )

    def succeeded(self) -> None:
        with self._lock:
            self._failures = 0
            self._open_until = None
            self._trial = False

    def failed(self) -> bool:
        """Record a transient failure; True if it opened (or re-opened) the circuit."""
        with self._lock:
            self._failures += 1
            if self._trial or (self._open_until is None and self._failures >= self._threshold):
                self._trial = False
                self._open_until = self._clock() + self._reset
                self.times_opened += 1
                return True
            return False

    def released(self) -> None:
        """A trial call ended with an answer that says nothing about the service's
        health one way or the other (it cannot: any answer means it is up)."""
        self.succeeded()


class ResilientKek(KekProvider):
    """A provider with retries, a circuit breaker and counters around another."""

    def __init__(
        self,
        inner: KekProvider,
        *,
        retries: int = 3,
        retry_max_seconds: float = 5.0,
        retry_initial_seconds: float = 0.05,
        retry_cap_seconds: float = 1.0,
        circuit_failures: int = 5,
        circuit_reset_seconds: float = 10.0,
        on_call: Observer | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if retries < 0:
            raise InvalidInput("kek_retries must be 0 or more")
        if retry_max_seconds < 0 or retry_initial_seconds <= 0 or retry_cap_seconds <= 0:
            raise InvalidInput("KEK retry times must be positive")
        self.inner = inner
        self.name = inner.name  # the records' markers name the real provider
        self.on_call = on_call
        self.circuit = Circuit(circuit_failures, circuit_reset_seconds, clock=clock)
        self._retries = retries
        self._budget = retry_max_seconds
        self._clock = clock
        self._sleep = sleep
        # tenacity's full-jitter wait; the loop is ours, to put the circuit
        # between attempts and bound the total time (a wait past it is not taken).
        self._retrying = tenacity.Retrying()
        self._jitter = tenacity.wait_random_exponential(
            multiplier=retry_initial_seconds, max=retry_cap_seconds
        )
        self._lock = threading.Lock()
        self._counts: dict[str, CallCounts] = {}

    # -- counters ------------------------------------------------------------------

    def _note(self, op: str, outcome: str) -> None:
        with self._lock:
            c = self._counts.setdefault(op, CallCounts())
            if outcome == "ok":
                c.calls += 1
            elif outcome == "error":
                c.errors += 1
            elif outcome == "retry":
                c.retries += 1
            else:
                c.open += 1
        if self.on_call is not None:
            self.on_call(op, outcome)

    def _attempted_and_failed(self, op: str) -> None:
        with self._lock:
            self._counts.setdefault(op, CallCounts()).calls += 1

    def counts(self) -> dict[str, CallCounts]:
        """A snapshot of every operation's counters."""
        with self._lock:
            return {
                op: CallCounts(c.calls, c.errors, c.retries, c.open)
                for op, c in self._counts.items()
            }

    def total_calls(self) -> int:
        """Calls that reached the provider, every operation and retry included."""
        with self._lock:
            return sum(c.calls for c in self._counts.values())

    def reset_counts(self) -> None:
        with self._lock:
            self._counts.clear()

    @property
    def circuit_opened(self) -> int:
        return self.circuit.times_opened

    # -- the call ------------------------------------------------------------------

    def _call(self, op: str, fn: Callable[[], T]) -> T:
        started = self._clock()
        attempt = 0
        while True:
            try:
                self.circuit.admit(self.inner.name)
            except KekCircuitOpen:
                self._note(op, "open")
                raise
            try:
                result = fn()
            except KekCircuitOpen:  # a nested wrapper's: already counted there
                self.circuit.released()
                self._note(op, "error")
                raise
            except KekUnavailable:
                self._attempted_and_failed(op)
                opened = self.circuit.failed()  # then no retry: it would fail fast
                attempt += 1
                wait = self._wait(attempt)
                elapsed = self._clock() - started
                if opened or attempt > self._retries or elapsed + wait > self._budget:
                    self._note(op, "error")
                    raise
                self._note(op, "retry")
                self._sleep(wait)
                continue
            except BaseException:
                # An answer (a refusal, a forged blob, a destroyed epoch): the
                # service is up, so it counts for the circuit as a success.
                self._attempted_and_failed(op)
                self.circuit.released()
                self._note(op, "error")
                raise
            self.circuit.succeeded()
            self._note(op, "ok")
            return result

    def _wait(self, attempt: int) -> float:
        """Full jitter: uniform in [0, min(cap, initial * 2**(attempt-1)) ]."""
        state = tenacity.RetryCallState(self._retrying, None, (), {})
        state.attempt_number = attempt
        return float(self._jitter(state))

    # -- provider interface --------------------------------------------------------

    def current_epoch(self) -> int:
        return self._call("current_epoch", self.inner.current_epoch)

    def epochs(self) -> list[EpochInfo]:
        return self._call("epochs", self.inner.epochs)

    def wrap(self, key: bytes, context: Context) -> WrappedKey:
        return self._call("wrap", lambda: self.inner.wrap(key, context))

    def unwrap(self, wrapped: WrappedKey, context: Context) -> bytes:
        return self._call("unwrap", lambda: self.inner.unwrap(wrapped, context))

    def wrap_many(self, items: Sequence[tuple[bytes, Context]]) -> list[WrappedKey]:
        return self._call("wrap_many", lambda: self.inner.wrap_many(items))

    def unwrap_many(self, items: Sequence[tuple[WrappedKey, Context]]) -> list[bytes]:
        return self._call("unwrap_many", lambda: self.inner.unwrap_many(items))

    def rewrap_many(self, items: Sequence[tuple[WrappedKey, Context]]) -> list[WrappedKey]:
        return self._call("rewrap_many", lambda: self.inner.rewrap_many(items))

    def rotate(self) -> int:
        # Retried like the rest: a rotation whose answer was lost and is sent again
        # makes one more, unused version, destroyed with the others by the schedule.
        return self._call("rotate", self.inner.rotate)

    def destroy_epochs_before(self, epoch: int) -> list[DestroyedEpoch]:
        return self._call("destroy_epochs_before", lambda: self.inner.destroy_epochs_before(epoch))

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"ResilientKek({self.inner!r}, circuit={self.circuit.state})"
