"""Rate limits per credential: a token bucket each, in this process's memory.

A simple in-process limiter, deliberately: each uvicorn worker process keeps its own
buckets, so with ``--workers N`` a credential may make up to N times the configured
rate in all. A limit shared by every process (and machine) would live in the
catalog database or a cache server; this one is the first line, not a quota.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

__all__ = ["TokenBuckets"]


class TokenBuckets:
    """``take(credential)`` spends one token of that credential's bucket (``burst``
    tokens, refilled at ``per_second``): 0.0 if allowed, else the seconds until a
    token is back (the ``Retry-After``)."""

    def __init__(
        self,
        per_second: float,
        burst: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_credentials: int = 10_000,
    ) -> None:
        self._rate = per_second
        self._burst = float(burst)
        self._clock = clock
        self._max = max_credentials
        self._buckets: dict[str, tuple[float, float]] = {}  # credential -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, credential: str) -> float:
        now = self._clock()
        with self._lock:
            tokens, at = self._buckets.get(credential, (self._burst, now))
            tokens = min(self._burst, tokens + (now - at) * self._rate)
            if tokens >= 1.0:
                self._store(credential, tokens - 1.0, now)
                return 0.0
            self._store(credential, tokens, now)
            return (1.0 - tokens) / self._rate

    def _store(self, credential: str, tokens: float, at: float) -> None:
        if credential not in self._buckets and len(self._buckets) >= self._max:
            # Full buckets carry no state worth keeping: forget those first.
            full = [c for c, (t, a) in self._buckets.items() if t >= self._burst]
            for c in full or list(self._buckets)[: self._max // 10]:
                del self._buckets[c]
        self._buckets[credential] = (tokens, at)

    @staticmethod
    def retry_after(seconds: float) -> str:
        """The ``Retry-After`` header's value: whole seconds, at least 1."""
        return str(max(1, math.ceil(seconds)))
