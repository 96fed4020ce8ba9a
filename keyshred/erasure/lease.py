"""The lease on an erasure request: one worker runs a request at a time.

Any process on any machine may run or resume a request (``ks.erase``, ``resume``,
the retention run, a restore's replay). Before it runs a step it claims the
request's lease in the catalog — one conditional ``UPDATE`` that succeeds only if
nobody holds the lease or its holder's lease has run out — and a heartbeat thread
renews it every third of ``erasure.lease_seconds`` while the steps run. Every save
of the request's progress is conditional on still holding the lease
(``LeaseLost`` otherwise), so a worker that stalled past its lease (a long pause,
a partition from the database) and woke up cannot record a step, sign a receipt or
log ``erasure.completed`` after another worker took the request over. A killed
worker's lease runs out (at once for a process of the same machine, known dead by
its pid); the next run claims it and resumes where the steps recorded stopped
(every step is idempotent).
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import uuid

import sqlalchemy as sa

from keyshred.schema import deletion_requests
from keyshred.storage.catalog import Catalog

__all__ = ["Lease", "LeaseLost", "claim"]

_T = deletion_requests


class LeaseLost(Exception):
    """Another worker took the request over: this one stops without recording."""


class Lease:
    """A held lease: ``owner`` names it in conditional saves; ``release`` ends it."""

    def __init__(self, catalog: Catalog, request_id: str, owner: str, seconds: float) -> None:
        self._catalog = catalog
        self.request_id = request_id
        self.owner = owner
        self._seconds = seconds
        self._stop = threading.Event()
        self.lost = False
        self._beat = threading.Thread(
            target=self._heartbeat, name=f"keyshred-lease-{request_id[:16]}", daemon=True
        )
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self._seconds / 3):
            try:
                with self._catalog.transaction() as conn:
                    renewed = conn.execute(
                        _T.update()
                        .where(_T.c.request_id == self.request_id, _T.c.lease_owner == self.owner)
                        .values(lease_until=_until(self._catalog.dialect, self._seconds))
                    ).rowcount
            except Exception:  # noqa: BLE001, S112 - the database is away: try again next beat
                continue
            if renewed != 1:
                self.lost = True  # the next conditional save raises LeaseLost
                return

    def where(self) -> sa.ColumnElement[bool]:
        """The condition a save of the request's progress adds: still ours."""
        return sa.and_(_T.c.request_id == self.request_id, _T.c.lease_owner == self.owner)

    def release(self) -> None:
        self._stop.set()
        self._beat.join()
        try:
            with self._catalog.transaction() as conn:
                conn.execute(
                    _T.update().where(self.where()).values(lease_owner=None, lease_until=None)
                )
        except Exception:  # noqa: BLE001 - it runs out by itself
            return


def _db_now_us(dialect: str) -> sa.ColumnElement[int]:
    """The database's clock in microseconds since 1970 (``lease_until``'s unit):
    every worker dates leases by the one clock they share, so a worker whose own
    clock runs ahead cannot take over a live lease."""
    if dialect == "postgresql":
        sql = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT)"
    else:
        sql = "CAST((julianday('now') - 2440587.5) * 86400000000.0 AS INTEGER)"
    return sa.literal_column(sql, sa.BigInteger)


def _until(dialect: str, seconds: float) -> sa.ColumnElement[int]:
    return _db_now_us(dialect) + int(seconds * 1_000_000)


def _host() -> str:
    """This machine, as a lease names it: a digest (a host name is nobody's data,
    but the catalog has no need of it)."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:12]


def _dead_here(owner: str) -> bool:
    """Whether ``owner`` is a process of this machine that no longer runs: its
    lease need not run out (a worker killed here is known dead at once)."""
    host, _, rest = owner.partition(":")
    pid_text = rest.partition(":")[0]
    if host != _host() or not pid_text.isdigit() or int(pid_text) == os.getpid():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive, another user's
    return False


def claim(catalog: Catalog, request_id: str, seconds: float) -> Lease | None:
    """The request's lease if nobody holds it (or its holder's ran out, or its
    holder was a process of this machine that died), else None."""
    owner = f"{_host()}:{os.getpid()}:{uuid.uuid4().hex[:16]}"
    dialect = catalog.dialect
    free = sa.or_(_T.c.lease_owner.is_(None), _T.c.lease_until < _db_now_us(dialect))
    with catalog.transaction() as conn:
        holder = conn.execute(
            sa.select(_T.c.lease_owner).where(_T.c.request_id == request_id)
        ).scalar()
        if holder is not None and _dead_here(str(holder)):
            free = sa.or_(free, _T.c.lease_owner == holder)
        claimed = conn.execute(
            _T.update()
            .where(_T.c.request_id == request_id, free)
            .values(lease_owner=owner, lease_until=_until(dialect, seconds))
        ).rowcount
    return Lease(catalog, request_id, owner, seconds) if claimed == 1 else None
