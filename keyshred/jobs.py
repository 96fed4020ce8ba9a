"""Jobs: work that outlives a call, as leased rows of the catalog (``ks_jobs``).

Erasure requests (subject and scope erasures, consent withdrawals), retention runs,
backup maintenance and completion webhook deliveries are jobs. Any worker process
on any machine claims a due job, runs it under a lease with a heartbeat, and
settles it: ``succeeded``, back to ``queued`` after a failed run (exponential
backoff with full jitter, counted), back to ``queued`` without counting (the work
was busy elsewhere or the worker is stopping), or ``manual_review`` (the dead
letter: ``jobs.max_attempts`` runs failed, or an error no retry can fix). A worker
killed while it runs a job leaves its lease to run out (at once for a dead process
of the same machine); the next claim takes the job over.

Why a table of our own and not a job library such as procrastinate: procrastinate is
PostgreSQL-only (its in-memory connector is for tests), while the embedded profile
(SQLite) must run the very same jobs. The table reuses the erasure requests' lease
design (``keyshred.leases``: the database's clock, conditional saves), so one design
serves both databases:

- PostgreSQL: ``SELECT … FOR UPDATE SKIP LOCKED LIMIT 1`` picks a due job no other
  claimer is looking at, then a conditional ``UPDATE`` sets the lease;
- SQLite: one writer at a time; the same select and conditional ``UPDATE`` run in
  one ``BEGIN IMMEDIATE`` transaction.

A payload is JSON of ids and subject_refs only, never a subject id, a probe or any
value: ``enqueue`` refuses any value that is not a short id-like string (a request
id's letters, digits and ``._:/+()#,-``: no ``@``, no spaces). ``enqueue(...,
conn=)`` writes the job in the caller's transaction (a transactional outbox: the
erasure request and its job commit together). ``dedupe_key`` makes one job per
key: one retention run per period across every worker, one job per erasure request,
one delivery per (request, event, endpoint). A job may have its own ``max_attempts``
and a handler its own backoff (``JobOutcome.retry(error, backoff=…)``): a webhook
endpoint's schedule.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from keyshred.config import JobSettings
from keyshred.errors import InvalidInput, NotFound
from keyshred.leases import Heartbeat, db_now_us, dead_here, host, new_owner, until
from keyshred.schema import jobs as _T
from keyshred.storage.catalog import Catalog

__all__ = [
    "MANUAL_REVIEW",
    "NON_RETRYABLE",
    "QUEUED",
    "RUNNING",
    "STATES",
    "SUCCEEDED",
    "Handler",
    "Job",
    "JobOutcome",
    "JobQueue",
    "JobRunner",
    "check_payload",
]

QUEUED, RUNNING, SUCCEEDED, MANUAL_REVIEW = "queued", "running", "succeeded", "manual_review"
STATES = (QUEUED, RUNNING, SUCCEEDED, MANUAL_REVIEW)
# Errors that no retry fixes: the job goes to manual_review at once.
NON_RETRYABLE: tuple[type[BaseException], ...] = (InvalidInput, NotFound)

# The request ids' alphabet (``keyshred.erasure.requests.safe``) without the space
# and the ``@``: what an e-mail address or a name needs is refused in a payload.
_ID = re.compile(r"[A-Za-z0-9._:/+()#,-]{1,128}")
# A request id is the caller's own metadata, already in the request row, its
# receipt and its audit events, in the alphabet ``safe`` checks (a space and ``@``
# included): its job carries it, and keys its dedupe, as it is.
_REQUEST_ID = re.compile(r"[A-Za-z0-9 ._:@/+()#,-]{1,128}")
_DEDUPE = re.compile(r"[A-Za-z0-9 ._:@/+()#,-]{1,200}")
_KEY = re.compile(r"[a-z_]{1,32}")
_KIND = re.compile(r"[a-z][a-z0-9._-]{0,63}")
_US = 1_000_000


def check_payload(payload: dict[str, str]) -> dict[str, str]:
    """``payload`` if every key is a short name and every value an id-like string
    (ids and subject_refs); ``InvalidInput`` otherwise, naming the key only."""
    if not isinstance(payload, dict):
        raise InvalidInput("a job payload is a dict of names to ids")
    for key, value in payload.items():
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise InvalidInput("a job payload's keys are 1-32 lower-case letters and _")
        pattern = _REQUEST_ID if key == "request_id" else _ID
        if not isinstance(value, str) or not pattern.fullmatch(value):
            raise InvalidInput(
                f"job payload {key!r} must be an id or a subject_ref (1-128 characters "
                "of letters, digits and ._:/+()#,-): a job never carries a subject id "
                "or a value"
            )
    return dict(payload)


@dataclass(frozen=True, slots=True)
class Job:
    """One row of ``ks_jobs``; times are microseconds by the database's clock."""

    job_id: str
    kind: str
    payload: dict[str, str]
    state: str
    attempts: int
    max_attempts: int
    run_after_us: int
    lease_owner: str | None
    lease_until_us: int | None
    last_error: str | None
    dedupe_key: str | None
    created_us: int
    updated_us: int


_MAX_DELAY_SECONDS = 366 * 86_400  # a year and a day: longer is no schedule
_MAX_ATTEMPTS = 100  # as jobs.max_attempts


@dataclass(frozen=True, slots=True)
class JobOutcome:
    """What a handler says of a run: ``done``, ``retry`` (a failure: counted, with
    backoff: the queue's, or ``backoff`` seconds), ``review`` (dead letter at once)
    or ``later`` (not counted: busy elsewhere, or the worker is stopping; due again
    after ``delay`` seconds)."""

    action: str
    error: str | None = None
    delay: float = 0.0
    backoff: float | None = None

    @classmethod
    def done(cls) -> JobOutcome:
        return cls("done")

    @classmethod
    def retry(cls, error: str, backoff: float | None = None) -> JobOutcome:
        """A failed run; ``backoff``: its own wait before the next (a webhook
        endpoint's schedule), else the queue's."""
        return cls("retry", error, backoff=backoff)

    @classmethod
    def review(cls, error: str) -> JobOutcome:
        return cls("review", error)

    @classmethod
    def later(cls, delay: float = 0.0) -> JobOutcome:
        return cls("later", None, delay)


# A handler gets the job (ids only) and a stop check it consults between steps.
Handler = Callable[[Job, Callable[[], bool]], JobOutcome]


def _error_name(error: str | None) -> str | None:
    """An error as the table keeps it: a class-like name, nothing else."""
    if error is None:
        return None
    name = error.rsplit(":", 1)[-1].strip()
    return name[:128] if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", name) else "Error"


class JobQueue:
    """``ks_jobs``: enqueue, claim, settle, list (see the module docstring)."""

    def __init__(self, catalog: Catalog, settings: JobSettings) -> None:
        self._catalog = catalog
        self.settings = settings
        self._dialect = catalog.dialect
        self._rand = secrets.SystemRandom()

    # -- writing -------------------------------------------------------------------

    def enqueue(
        self,
        kind: str,
        payload: dict[str, str],
        *,
        dedupe_key: str | None = None,
        delay: float = 0,
        conn: Connection | None = None,
        max_attempts: int | None = None,
    ) -> str:
        """A new job's id (or, with a ``dedupe_key`` already taken, that job's id).
        ``conn``: write it in the caller's transaction; ``max_attempts``: its own
        runs before the dead letter (default ``jobs.max_attempts``)."""
        if not isinstance(kind, str) or not _KIND.fullmatch(kind):
            raise InvalidInput("a job kind is a short lower-case name")
        if dedupe_key is not None and (
            not isinstance(dedupe_key, str) or not _DEDUPE.fullmatch(dedupe_key)
        ):
            raise InvalidInput("a dedupe key is an id-like string")
        if (
            isinstance(delay, bool)
            or not isinstance(delay, int | float)
            or not 0 <= delay <= _MAX_DELAY_SECONDS
        ):
            raise InvalidInput(f"a job's delay is 0 to {_MAX_DELAY_SECONDS} seconds")
        if max_attempts is not None and (
            isinstance(max_attempts, bool)
            or not isinstance(max_attempts, int)
            or not 1 <= max_attempts <= _MAX_ATTEMPTS
        ):
            raise InvalidInput(f"a job's max_attempts is 1 to {_MAX_ATTEMPTS}")
        doc = json.dumps(check_payload(payload), sort_keys=True)
        if conn is None:
            with self._catalog.transaction() as own:
                return self._insert(own, kind, doc, dedupe_key, delay, max_attempts=max_attempts)
        return self._insert(conn, kind, doc, dedupe_key, delay, max_attempts=max_attempts)

    def enqueue_leased(
        self, kind: str, payload: dict[str, str], *, dedupe_key: str, conn: Connection
    ) -> Job | None:
        """A new job, leased to the caller from the start (run it with
        ``JobRunner.run``): no worker can claim it before the caller does, and if
        the caller dies its lease runs out and any worker takes it. None if the
        dedupe key is taken already (that job is claimed the usual way)."""
        if not isinstance(kind, str) or not _KIND.fullmatch(kind):
            raise InvalidInput("a job kind is a short lower-case name")
        if not isinstance(dedupe_key, str) or not _DEDUPE.fullmatch(dedupe_key):
            raise InvalidInput("a dedupe key is an id-like string")
        doc = json.dumps(check_payload(payload), sort_keys=True)
        owner = new_owner()
        job_id = self._insert(conn, kind, doc, dedupe_key, 0.0, owner=owner)
        row = conn.execute(sa.select(_T).where(_T.c.job_id == job_id)).one()
        return _job(row) if row.lease_owner == owner else None

    def _insert(
        self,
        conn: Connection,
        kind: str,
        doc: str,
        dedupe_key: str | None,
        delay: float,
        *,
        owner: str | None = None,
        max_attempts: int | None = None,
    ) -> str:
        job_id = uuid.uuid4().hex
        now = db_now_us(self._dialect)
        values = {
            "job_id": job_id,
            "kind": kind,
            "payload": doc,
            "state": QUEUED if owner is None else RUNNING,
            "attempts": 0 if owner is None else 1,
            "max_attempts": self.settings.max_attempts if max_attempts is None else max_attempts,
            "run_after": until(self._dialect, max(0.0, delay)),
            "lease_owner": owner,
            "lease_until": None
            if owner is None
            else until(self._dialect, self.settings.lease_seconds),
            "last_error": None,
            "dedupe_key": dedupe_key,
            "created_at": now,
            "updated_at": now,
        }
        if dedupe_key is None:
            conn.execute(_T.insert().values(**values))
            return job_id
        # ON CONFLICT DO NOTHING: a duplicate leaves the caller's transaction usable.
        conn.execute(self._catalog.insert_ignore(_T).values(**values))
        found = conn.execute(sa.select(_T.c.job_id).where(_T.c.dedupe_key == dedupe_key)).scalar()
        return str(found)

    def claim(self, kinds: Iterable[str] | None = None, *, job_id: str | None = None) -> Job | None:
        """A due job (of ``kinds``; or exactly ``job_id``), leased to this caller,
        its attempts counted; None if there is none. Due: queued and past its
        ``run_after``, or running under a lease that ran out or whose holder was a
        process of this machine that died."""
        owner = new_owner()
        d = self._dialect
        now = db_now_us(d)
        with self._catalog.transaction() as conn:
            holders = conn.execute(
                sa.select(_T.c.lease_owner)
                .where(_T.c.state == RUNNING, _T.c.lease_owner.like(f"{host()}:%"))
                .distinct()
            ).scalars()
            dead = [h for h in holders if h is not None and dead_here(h)]
            taken_over = sa.or_(
                _T.c.lease_until < now,
                _T.c.lease_owner.in_(dead) if dead else sa.false(),
            )
            due = sa.or_(
                sa.and_(_T.c.state == QUEUED, _T.c.run_after <= now),
                sa.and_(_T.c.state == RUNNING, taken_over),
            )
            query = sa.select(_T.c.job_id).where(due)
            if kinds is not None:
                query = query.where(_T.c.kind.in_(list(kinds)))
            if job_id is not None:
                query = query.where(_T.c.job_id == job_id)
            query = query.order_by(_T.c.run_after).limit(1)
            if d == "postgresql":
                query = query.with_for_update(skip_locked=True)
            picked = conn.execute(query).scalar()
            if picked is None:
                return None
            claimed = conn.execute(
                _T.update()
                .where(_T.c.job_id == picked, due)
                .values(
                    state=RUNNING,
                    lease_owner=owner,
                    lease_until=until(d, self.settings.lease_seconds),
                    attempts=_T.c.attempts + 1,
                    updated_at=now,
                )
            ).rowcount
            if claimed != 1:
                return None
            row = conn.execute(sa.select(_T).where(_T.c.job_id == picked)).one()
        return _job(row)

    def heartbeat(self, job: Job) -> Heartbeat:
        """Renew ``job``'s lease while it runs (``stop()`` it when the run ends)."""
        return Heartbeat(
            self._catalog.engine,
            _T.c.job_id == job.job_id,
            _T,
            str(job.lease_owner),
            self.settings.lease_seconds,
            name=f"keyshred-job-{job.job_id[:12]}",
        )

    def _settle(self, job: Job, **values: Any) -> bool:
        """Save ``values`` if ``job``'s lease is still this claimer's (a worker that
        stalled past its lease records nothing over its successor's run)."""
        values |= {"lease_owner": None, "lease_until": None}
        values["updated_at"] = db_now_us(self._dialect)
        with self._catalog.transaction() as conn:
            saved = conn.execute(
                _T.update()
                .where(_T.c.job_id == job.job_id, _T.c.lease_owner == job.lease_owner)
                .values(**values)
            ).rowcount
        return bool(saved == 1)

    def complete(self, job: Job) -> bool:
        return self._settle(job, state=SUCCEEDED, last_error=None)

    def dead_letter(self, job: Job, error: str | None) -> bool:
        return self._settle(job, state=MANUAL_REVIEW, last_error=_error_name(error))

    def backoff(self, attempts: int) -> float:
        """Seconds before a job that failed ``attempts`` runs is due again: full
        jitter over an exponential cap (a retry storm spreads out)."""
        s = self.settings
        cap = min(s.backoff_max_seconds, s.backoff_base_seconds * 2 ** max(0, attempts - 1))
        return self._rand.uniform(0, cap)

    def retry(self, job: Job, exc: BaseException | str, *, backoff: float | None = None) -> bool:
        """A failed run: again after a backoff (``backoff`` seconds if given, else
        ``backoff(attempts)``), or ``manual_review`` once the job has run its
        ``max_attempts`` times."""
        error = exc if isinstance(exc, str) else type(exc).__name__
        if job.attempts >= job.max_attempts:
            return self.dead_letter(job, error)
        delay = self.backoff(job.attempts) if backoff is None else backoff
        return self._settle(
            job,
            state=QUEUED,
            run_after=until(self._dialect, min(max(0.0, delay), _MAX_DELAY_SECONDS)),
            last_error=_error_name(error),
        )

    def requeue(self, job: Job, delay: float = 0.0) -> bool:
        """Back to the queue without counting the run (busy elsewhere, stopping)."""
        return self._settle(
            job,
            state=QUEUED,
            attempts=sa.func.max(_T.c.attempts - 1, 0)
            if self._dialect == "sqlite"
            else sa.func.greatest(_T.c.attempts - 1, 0),
            run_after=until(self._dialect, max(0.0, delay)),
        )

    def settle(self, job: Job, outcome: JobOutcome) -> bool:
        if outcome.action == "done":
            return self.complete(job)
        if outcome.action == "review":
            return self.dead_letter(job, outcome.error)
        if outcome.action == "later":
            return self.requeue(job, outcome.delay)
        return self.retry(job, outcome.error or "Error", backoff=outcome.backoff)

    def reopen(self, dedupe_key: str) -> None:
        """Queue the finished job of ``dedupe_key`` again, due now, its attempts
        reset (what it waited for is over: a released legal hold)."""
        now = db_now_us(self._dialect)
        with self._catalog.transaction() as conn:
            conn.execute(
                _T.update()
                .where(_T.c.dedupe_key == dedupe_key, _T.c.state.in_([SUCCEEDED, MANUAL_REVIEW]))
                .values(state=QUEUED, attempts=0, run_after=now, last_error=None, updated_at=now)
            )

    def finish_queued(self, dedupe_key: str) -> None:
        """Mark the queued job of ``dedupe_key`` succeeded: its work was done by a
        caller directly (a resume, a replay), so no worker need claim it."""
        with self._catalog.transaction() as conn:
            conn.execute(
                _T.update()
                .where(_T.c.dedupe_key == dedupe_key, _T.c.state == QUEUED)
                .values(state=SUCCEEDED, updated_at=db_now_us(self._dialect))
            )

    # -- reading -------------------------------------------------------------------

    def get(self, job_id: str) -> Job:
        with self._catalog.engine.connect() as conn:
            row = conn.execute(sa.select(_T).where(_T.c.job_id == job_id)).first()
        if row is None:
            raise NotFound(f"no job {job_id}")
        return _job(row)

    def find(self, dedupe_key: str) -> Job | None:
        with self._catalog.engine.connect() as conn:
            row = conn.execute(sa.select(_T).where(_T.c.dedupe_key == dedupe_key)).first()
        return None if row is None else _job(row)

    def by_keys(self, dedupe_keys: Sequence[str]) -> dict[str, Job]:
        """Jobs by their dedupe key, for the keys that have one."""
        out: dict[str, Job] = {}
        with self._catalog.engine.connect() as conn:
            for start in range(0, len(dedupe_keys), 500):
                chunk = list(dedupe_keys[start : start + 500])
                for row in conn.execute(sa.select(_T).where(_T.c.dedupe_key.in_(chunk))):
                    out[str(row.dedupe_key)] = _job(row)
        return out

    def list(
        self, states: Iterable[str] | None = None, *, kinds: Iterable[str] | None = None
    ) -> list[Job]:
        """Jobs (in ``states``, of ``kinds``), oldest first."""
        query = sa.select(_T).order_by(_T.c.created_at, _T.c.job_id)
        if states is not None:
            query = query.where(_T.c.state.in_(list(states)))
        if kinds is not None:
            query = query.where(_T.c.kind.in_(list(kinds)))
        with self._catalog.engine.connect() as conn:
            return [_job(r) for r in conn.execute(query)]

    def depth(self) -> dict[str, int]:
        """Jobs per state (every state, zeros included)."""
        with self._catalog.engine.connect() as conn:
            rows = conn.execute(sa.select(_T.c.state, sa.func.count()).group_by(_T.c.state)).all()
        return dict.fromkeys(STATES, 0) | {str(s): int(n) for s, n in rows}

    def oldest_queued_age_seconds(self) -> float:
        """How long the oldest queued job has waited since it was enqueued (by the
        database's clock); 0 with none queued."""
        with self._catalog.engine.connect() as conn:
            age = conn.execute(
                sa.select(db_now_us(self._dialect) - sa.func.min(_T.c.created_at)).where(
                    _T.c.state == QUEUED
                )
            ).scalar()
        return 0.0 if age is None else max(0.0, int(age) / _US)


class JobRunner:
    """``ks.jobs``: the queue and the handlers by kind; runs claimed jobs."""

    # ``ks.jobs.queue`` is guarded as ``ks.jobs`` is (keyshred._handle.Guarded).
    GUARDED_PARTS: ClassVar[tuple[str, ...]] = ("queue",)

    def __init__(self, queue: JobQueue, *, on_retry: Callable[[str], None] | None = None) -> None:
        self.queue = queue
        self._handlers: dict[str, Handler] = {}
        # Called with the job's kind when a run ends in a retry (the handle's
        # ``keyshred_job_retries_total{kind}``).
        self._on_retry = on_retry
        # Jobs running in this process now, and whether the handle is closing:
        # ``drain`` asks them to stop at their next step and waits for them.
        self._running = 0
        self._idle = threading.Condition()
        self._draining = threading.Event()

    def drain(self, timeout: float) -> bool:
        """Ask every job running in this process to stop at its next step (it goes
        back to the queue, resumable: ``JobOutcome.later``), refuse to claim more,
        and wait up to ``timeout`` seconds for them; whether none is left."""
        self._draining.set()
        with self._idle:
            return self._idle.wait_for(lambda: self._running == 0, timeout)

    def _stopping(self, stop: Callable[[], bool] | None) -> Callable[[], bool]:
        draining = self._draining.is_set
        if stop is None:
            return draining
        return lambda: draining() or stop()

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self._handlers)

    def register(self, kind: str, handler: Handler) -> None:
        if not _KIND.fullmatch(kind):
            raise InvalidInput("a job kind is a short lower-case name")
        self._handlers[kind] = handler

    def run(
        self, job: Job, stop: Callable[[], bool] | None = None, *, reraise: bool = False
    ) -> Job:
        """Run a claimed job under its heartbeat and settle it; the job after.
        ``reraise``: settle a failed run, then raise its error (a caller running
        its own job sees what it always saw)."""
        with self._idle:
            self._running += 1
        try:
            return self._run(job, self._stopping(stop), reraise=reraise)
        finally:
            with self._idle:
                self._running -= 1
                self._idle.notify_all()

    def _run(self, job: Job, stop: Callable[[], bool], *, reraise: bool) -> Job:
        beat = self.queue.heartbeat(job)
        failure: BaseException | None = None
        try:
            handler = self._handlers.get(job.kind)
            if handler is None:
                outcome = JobOutcome.review("UnknownJobKind")
            else:
                try:
                    outcome = handler(job, stop)
                except NON_RETRYABLE as exc:
                    outcome, failure = JobOutcome.review(type(exc).__name__), exc
                except Exception as exc:  # noqa: BLE001 - any failure is a retry (then dead letter)
                    outcome, failure = JobOutcome.retry(type(exc).__name__), exc
        finally:
            beat.stop()
        if not beat.lost:
            self.queue.settle(job, outcome)
            if outcome.action == "retry" and self._on_retry is not None:
                self._on_retry(job.kind)
        if reraise and failure is not None:
            raise failure
        return self.queue.get(job.job_id)

    def run_id(
        self, job_id: str, stop: Callable[[], bool] | None = None, *, reraise: bool = False
    ) -> Job | None:
        """Claim exactly ``job_id`` and run it; None if it is not due or another
        worker holds it."""
        job = self.queue.claim(job_id=job_id)
        return None if job is None else self.run(job, stop, reraise=reraise)

    def run_pending(
        self,
        kinds: Iterable[str] | None = None,
        *,
        stop: Callable[[], bool] | None = None,
        limit: int | None = None,
    ) -> int:
        """Claim and run due jobs (of ``kinds``; default every registered kind)
        until none is due, ``stop()`` says so or ``limit`` ran; how many ran."""
        wanted = list(self._handlers) if kinds is None else list(kinds)
        ran = 0
        stop = self._stopping(stop)
        while (limit is None or ran < limit) and not stop():
            job = self.queue.claim(wanted)
            if job is None:
                break
            self.run(job, stop)
            ran += 1
        return ran


def _job(row: Any) -> Job:
    return Job(
        job_id=str(row.job_id),
        kind=str(row.kind),
        payload=dict(json.loads(row.payload)),
        state=str(row.state),
        attempts=int(row.attempts),
        max_attempts=int(row.max_attempts),
        run_after_us=int(row.run_after),
        lease_owner=row.lease_owner,
        lease_until_us=None if row.lease_until is None else int(row.lease_until),
        last_error=row.last_error,
        dedupe_key=row.dedupe_key,
        created_us=int(row.created_at),
        updated_us=int(row.updated_at),
    )
