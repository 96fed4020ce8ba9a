"""``Worker``: runs the catalog's jobs (``keyshred.jobs``) until stopped.

``keyshred worker`` runs one: ``concurrency`` threads each claim a due job, run it
under its lease and settle it, then look again (every ``jobs.poll_seconds`` when
nothing is due). Stopping (``stop`` set; the CLI sets it on SIGTERM and SIGINT)
lets each thread finish the erasure step it is in: the coordinator consults the
stop check between steps, releases the request's lease and the job goes back to
the queue uncounted, so the next worker resumes at the next step.

Periodic jobs are enqueued by the workers themselves with a dedupe key per
period (``retention:<period>``, ``backup.maintain:<period>``): however many
workers run, each period has one retention run and one maintenance run
(``jobs.retention_every_seconds``, ``jobs.backup_maintain_every_seconds``; 0 turns
one off). On SQLite (the embedded profile) one runner is enough and the only kind
that helps: the database has one writer; ``ks.jobs.run_pending()`` runs the same
jobs in the application's own process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from keyshred.errors import KeyshredError
from keyshred.facade import Keyshred

__all__ = ["PERIODIC", "Worker"]

# Periodic job kinds and the setting (in ``jobs``) that says how often.
PERIODIC = {
    "retention": "retention_every_seconds",
    "backup.maintain": "backup_maintain_every_seconds",
}


class Worker:
    """Runs ``ks``'s jobs (of ``kinds``, default every kind) in ``concurrency``
    threads until stopped; see the module docstring."""

    def __init__(
        self, ks: Keyshred, *, concurrency: int = 1, kinds: Iterable[str] | None = None
    ) -> None:
        if concurrency < 1:
            raise KeyshredError("a worker runs at least one thread")
        self._ks = ks
        # SQLite has one writer: more threads of one process would only queue on it.
        self.concurrency = 1 if ks.catalog.dialect == "sqlite" else concurrency
        self.kinds = None if kinds is None else tuple(kinds)
        self.ran = 0
        self._count = threading.Lock()
        # kind -> (dedupe key, job id) of the period this process last enqueued
        self._enqueued: dict[str, tuple[str, str]] = {}

    def enqueue_periodic(self, now: float | None = None) -> list[str]:
        """Enqueue this period's periodic jobs (one per period across every worker:
        the dedupe key is the period's number); their ids."""
        settings = self._ks.config.jobs
        at = time.time() if now is None else now
        ids = []
        for kind, setting in PERIODIC.items():
            every = float(getattr(settings, setting))
            if every <= 0 or (self.kinds is not None and kind not in self.kinds):
                continue
            period = str(int(at // every))
            key = f"{kind}:{period}"
            known = self._enqueued.get(kind)
            if known is None or known[0] != key:  # one insert per period, not per poll
                job_id = self._ks.jobs.queue.enqueue(kind, {"period": period}, dedupe_key=key)
                known = self._enqueued[kind] = (key, job_id)
            ids.append(known[1])
        return ids

    def run_once(self, stop: threading.Event | None = None) -> int:
        """Enqueue the periodic jobs due, then run every due job; how many ran."""
        stop = stop or threading.Event()
        self.enqueue_periodic()
        return self._ks.jobs.run_pending(self.kinds, stop=stop.is_set)

    def run(self, stop: threading.Event) -> None:
        """Claim and run jobs until ``stop`` is set; returns once every thread has
        finished the step it was in."""
        threads = [
            threading.Thread(target=self._loop, args=(stop,), name=f"keyshred-worker-{i}")
            for i in range(self.concurrency)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _loop(self, stop: threading.Event) -> None:
        poll = self._ks.config.jobs.poll_seconds
        while not stop.is_set():
            try:
                ran = self.run_once(stop)
            except Exception:  # noqa: BLE001 - the database is away: look again after a poll
                ran = 0
            with self._count:
                self.ran += ran
            if not ran:
                stop.wait(poll)
