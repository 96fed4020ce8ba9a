"""Rate limits per credential: a token bucket each.

``TokenBuckets`` keeps them in this process's memory: the embedded profile's one
process. ``SharedBuckets`` keeps them in the catalog when it is PostgreSQL, so every
uvicorn worker and every machine of a deployment spends from the same bucket: one
``INSERT … ON CONFLICT DO UPDATE … RETURNING`` per call, timed by the database's
clock (hosts need not agree), committed with ``synchronous_commit = off`` (a bucket
lost in a crash only refills early: not worth a WAL flush per call). If the
catalog cannot be reached the call falls back to this process's own bucket: the
request itself then fails on the catalog it needs, with its own 503.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Protocol

import sqlalchemy as sa

from keyshred.api.problems import Problem
from keyshred.errors import BackendUnavailable
from keyshred.schema import api_rate
from keyshred.storage.catalog import Catalog

__all__ = ["Buckets", "SharedBuckets", "TokenBuckets", "buckets_for", "rate_limited"]

_log = logging.getLogger("keyshred.api")
_TENANT = "api-rate"
# Every this many calls a process deletes the rows of buckets that have refilled
# (they carry no state): the table holds the credentials active lately, not all.
_SWEEP_EVERY = 1000


class Buckets(Protocol):
    def take(self, credential: str) -> float: ...


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


class SharedBuckets:
    """The buckets in the catalog's ``ks_api_rate`` (PostgreSQL), shared by every
    process; rows are named by a keyed hash of the credential (``keyed_hash`` is the
    keyring's ``subject_ref``: an HMAC under the store's ref key)."""

    def __init__(
        self,
        catalog: Catalog,
        keyed_hash: Callable[[str, str], str],
        per_second: float,
        burst: int,
    ) -> None:
        self._catalog = catalog
        self._hash = keyed_hash
        self._rate = per_second
        self._burst = float(burst)
        self._local = TokenBuckets(per_second, burst)
        self._calls = 0
        self._warned = False
        self._lock = threading.Lock()

    def take(self, credential: str) -> float:
        plain = hashlib.sha256(credential.encode("utf-8", "surrogatepass")).hexdigest()
        name = self._hash(plain, _TENANT)
        try:
            tokens, allowed = self._spend(name)
        except (BackendUnavailable, sa.exc.SQLAlchemyError) as exc:
            if not self._warned:  # once: an outage would otherwise log every call
                self._warned = True
                _log.warning("rate limits fall back to this process (%s)", type(exc).__name__)
            return self._local.take(credential)
        self._warned = False
        return 0.0 if allowed else (1.0 - tokens) / self._rate

    def _spend(self, name: str) -> tuple[float, bool]:
        from sqlalchemy.dialects import postgresql

        t = api_rate
        now = sa.cast(sa.extract("epoch", sa.func.statement_timestamp()), sa.Float)
        refilled = sa.func.least(self._burst, t.c.tokens + (now - t.c.at) * self._rate)
        stmt = (
            postgresql.insert(t)
            .values(credential=name, tokens=self._burst - 1.0, at=now, allowed=True)
            .on_conflict_do_update(
                index_elements=[t.c.credential],
                set_={
                    "tokens": sa.case((refilled >= 1.0, refilled - 1.0), else_=refilled),
                    "allowed": refilled >= 1.0,
                    "at": now,
                },
            )
            .returning(t.c.tokens, t.c.allowed)
        )
        with self._lock:
            self._calls += 1
            sweep = self._calls % _SWEEP_EVERY == 0
        with self._catalog.transaction() as conn:
            conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
            row = conn.execute(stmt).one()
            if sweep:
                full_after = self._burst / self._rate + 60.0
                conn.execute(t.delete().where(t.c.at < now - full_after))
        return float(row.tokens), bool(row.allowed)


def buckets_for(
    catalog: Catalog, keyed_hash: Callable[[str, str], str], per_second: float, burst: int
) -> Buckets:
    """Shared buckets on a PostgreSQL catalog (several processes may serve it);
    this process's own on SQLite (one process serves it)."""
    if catalog.dialect == "postgresql":
        return SharedBuckets(catalog, keyed_hash, per_second, burst)
    return TokenBuckets(per_second, burst)


def rate_limited(wait: float) -> Problem:
    """The ``429`` for a credential whose bucket is empty for ``wait`` seconds."""
    return Problem(
        429,
        "rate-limited",
        "Too many requests for this credential",
        headers={"Retry-After": TokenBuckets.retry_after(wait)},
    )
