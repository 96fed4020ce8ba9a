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
(every step is idempotent). The lease columns, the database clock and the
heartbeat are ``keyshred.leases``'s, shared with jobs (``keyshred.jobs``).
"""

from __future__ import annotations

import sqlalchemy as sa

from keyshred.leases import Heartbeat, db_now_us, dead_here, new_owner, until
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
        self._beat = Heartbeat(
            catalog.engine,
            _T.c.request_id == request_id,
            _T,
            owner,
            seconds,
            name=f"keyshred-lease-{request_id[:16]}",
        )
        self._stop = self._beat.stop_event  # a test stalls a holder through it

    @property
    def lost(self) -> bool:
        return self._beat.lost

    def where(self) -> sa.ColumnElement[bool]:
        """The condition a save of the request's progress adds: still ours."""
        return sa.and_(_T.c.request_id == self.request_id, _T.c.lease_owner == self.owner)

    def release(self) -> None:
        self._beat.stop()
        try:
            with self._catalog.transaction() as conn:
                conn.execute(
                    _T.update().where(self.where()).values(lease_owner=None, lease_until=None)
                )
        except Exception:  # noqa: BLE001 - it runs out by itself
            return


def claim(catalog: Catalog, request_id: str, seconds: float) -> Lease | None:
    """The request's lease if nobody holds it (or its holder's ran out, or its
    holder was a process of this machine that died), else None."""
    owner = new_owner()
    dialect = catalog.dialect
    free = sa.or_(_T.c.lease_owner.is_(None), _T.c.lease_until < db_now_us(dialect))
    with catalog.transaction() as conn:
        holder = conn.execute(
            sa.select(_T.c.lease_owner).where(_T.c.request_id == request_id)
        ).scalar()
        if holder is not None and dead_here(str(holder)):
            free = sa.or_(free, _T.c.lease_owner == holder)
        claimed = conn.execute(
            _T.update()
            .where(_T.c.request_id == request_id, free)
            .values(lease_owner=owner, lease_until=until(dialect, seconds))
        ).rowcount
    return Lease(catalog, request_id, owner, seconds) if claimed == 1 else None
