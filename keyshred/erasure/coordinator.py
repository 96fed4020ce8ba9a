"""The erasure coordinator: a persisted, resumable state machine per request.

It is wired with the stores (``keyshred.storage.erasable.Erasable``), the catalog,
the keyring and small explicit collaborators (audit log, metrics, backup hooks,
policy, the subject reference function); never with the facade.

Steps, each idempotent and recorded before the next starts, so a crash at any point
resumes where it stopped and nothing becomes readable again:

1. ``suppress``      stores evict; guard + deletion epoch bump in one transaction;
                     stores evict again
2. ``destroy_keys``  the scope DEKs, and the keys of other holders' data the subject
                     co-owns (mentions, derived assets): from here every copy is
                     unreadable
3. ``closure``       the subject's assets and, by reverse provenance and mentions,
                     every derived asset built from them (recorded, then acted on),
                     with the assets each destroyed co-owned key made unreadable
4. ``drop_<store>``  each ``DROP``-phase store's ``erase`` (memories, vectors, vault,
                     checkpoints, exports): partitions, datasets, tokens, threads
5. ``catalog``       the subject's assets (and, for a subject, consents and
                     registered identifiers) deleted
6. ``<store>``       each ``REBUILD``-phase store's ``erase``: ``derived`` rebuilds
                     each derived asset from its remaining sources with the pinned
                     producer version, or drops it; an unknown producer stops the
                     request in ``manual_review`` (``ProducerUnknown``)
7. ``external``      vendor deletion hooks: acknowledgement or ``deletion_not_verifiable``
8. ``tombstone``     the key store's tombstone (key ids, subject_ref, time) confirmed
   ``backups``       the tombstone journaled on the backup target (restores replay it)
                     and the subject's segment objects deleted there, every version
9. ``verify``        keys fail to unwrap, every store's ``verify``, no asset, mention
                     or registered identifier left, probes not found by key or
                     semantic search
10. ``receipt``      signed from what the steps recorded, stored; the subject stays
                     ``erased`` until re-admitted (one of whom nothing was found
                     becomes active again unless the request asked to ``block``)

Three kinds of request run these steps (``keyshred.erasure.extent``): a subject or
scope erasure, the retention scanner's listed memories and a replayed tombstone.

Every request is recorded with its ``erasure`` job (``keyshred.jobs``) in one
transaction, so no request exists that no worker would finish: ``submit`` records
and leaves it to the workers, ``ks.erase`` runs its own job in the caller, and a
caller killed mid-run leaves a job any worker takes over. ``run_job`` is the job's
handler; a worker's stop check is consulted between steps, so a stopping worker
finishes the step it is in and leaves the request to the next one. A save that
records a settled state (completed, manual_review, rejected) writes that state's
completion webhooks (``keyshred.erasure.callbacks``) in the same transaction.
"""

from __future__ import annotations

import inspect
import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from keyshred.audit import AuditLog
from keyshred.config import WebhookSettings
from keyshred.db import utc
from keyshred.erasure import items
from keyshred.erasure.callbacks import CompletionWebhooks
from keyshred.erasure.eviction import receipt_metrics
from keyshred.erasure.extent import BackupHooks, Partitions, Wiring, extent_of
from keyshred.erasure.holds import HoldsMixin
from keyshred.erasure.lease import Lease, LeaseLost, claim
from keyshred.erasure.receipt import build_receipt, found_data
from keyshred.erasure.requests import (
    AUTHORIZED,
    COMPLETED,
    LEGACY_STEPS,
    LEGAL_HOLD,
    MANUAL_REVIEW,
    MAX_ATTEMPTS,
    PROPAGATING,
    REJECTED,
    REQUESTED,
    RETRYABLE,
    SUPPRESSED,
    VERIFYING,
    ErasureRequest,
    ExternalProcessor,
    ProducerUnknown,
    VerificationFailed,
    check_request,
    is_safe,
    iso,
    now,
    safe,
)
from keyshred.erasure.steps import closure, verify
from keyshred.errors import InvalidInput, KeyshredError, NotFound
from keyshred.ids import SubjectLike
from keyshred.jobs import Job, JobOutcome, JobQueue
from keyshred.keyring.keyring import Keyring
from keyshred.keyring.keystore import Tombstone
from keyshred.metrics import Metrics
from keyshred.receipts import Receipt, load_receipt, sign_receipt
from keyshred.schema import deletion_requests, legal_holds
from keyshred.storage.catalog import Catalog
from keyshred.storage.erasable import DROP, Erasable, StoreErasure
from keyshred.storage.policy import Policy
from keyshred.tracing import span

if TYPE_CHECKING:
    import os

    from keyshred.residue import ResidueReport

__all__ = ["JOB_KIND", "ErasureCoordinator", "job_key"]

_STATE_AFTER = {
    "suppress": SUPPRESSED,
    "tombstone": VERIFYING,
    "backups": VERIFYING,
    "verify": VERIFYING,
    "receipt": COMPLETED,
}
# Why a request in manual_review may continue: a producer registered since.
_REVIEW_PRODUCER = "producer"
# The job kind of every request, and how soon a job whose request another worker
# runs now is due again (its run ends the job anyway; this one then sees the end).
JOB_KIND = "erasure"
_BUSY_DELAY = 1.0
# How a run ended, for its job: ran (to a state), busy (another worker holds the
# request), lost (its lease was taken over), stopped (the worker is stopping).
_RAN, _BUSY, _LOST, _STOPPED = "ran", "busy", "lost", "stopped"


def job_key(request_id: str) -> str:
    """The dedupe key of a request's job: one job per request."""
    return f"erasure:{request_id}"


class ErasureCoordinator(HoldsMixin):
    """``ks.erasure``: requests, resumption, status, receipts, holds, processors."""

    def __init__(
        self,
        stores: Sequence[Erasable],
        catalog: Catalog,
        keyring: Keyring,
        *,
        partitions: Partitions,
        audit: AuditLog,
        metrics: Metrics,
        backups: BackupHooks,
        policy: Policy,
        subject_ref: Callable[[SubjectLike], str],
        residue: Callable[[Sequence[str], Sequence[str | os.PathLike[str]]], ResidueReport]
        | None = None,
        on_step: Callable[[str, ErasureRequest], None] | None = None,
        lease_seconds: float = 60.0,
        jobs: JobQueue | None = None,
        webhooks: Sequence[WebhookSettings] = (),
    ) -> None:
        names = [s.name for s in stores]
        if len(set(names)) != len(names):
            raise InvalidInput(f"stores need distinct names: {names}")
        self._w = Wiring(tuple(stores), catalog, keyring, partitions, backups, metrics)
        self._catalog = catalog
        self._keyring = keyring
        self._audit = audit
        self._metrics = metrics
        self._policy = policy
        self._ref = subject_ref
        self._residue = residue
        self._processors: list[ExternalProcessor] = []
        self.on_step = on_step
        # Called after a step acted and before it is recorded (fault tests kill
        # a worker there: inside the step, its effects done, its record not).
        self.on_step_acted: Callable[[str, ErasureRequest], None] | None = None
        self._jobs = jobs
        # Completion webhooks: their jobs are written by ``_save`` with the state
        # they announce; ``webhooks.run_job`` is the ``webhook`` job's handler.
        self.webhooks = CompletionWebhooks(webhooks, catalog, audit, jobs)
        # Requests this process runs now, by id and running thread: their saves are
        # conditional on the lease (keyshred.erasure.lease). By thread too: a thread
        # whose lease ran out while another thread of this process took the request
        # over still finds its own (lost) lease, and records nothing more.
        self._lease_seconds = lease_seconds
        self._leases: dict[tuple[str, int], Lease] = {}
        self._probes = _Probes()
        # Jobs claimed by the very transaction that recorded their request
        # (``request(claim=True)``: ``ks.erase`` runs its request itself, so no
        # worker takes it, and its probes, from under it), by request id.
        self._claimed: dict[str, Job] = {}
        drop = [s for s in stores if s.phase == DROP]
        rebuild = [s for s in stores if s.phase != DROP]
        self._store_steps = {f"drop_{s.name}": s for s in drop} | {s.name: s for s in rebuild}
        self.steps: tuple[str, ...] = (
            "suppress",
            "destroy_keys",
            "closure",
            *(f"drop_{s.name}" for s in drop),
            "catalog",
            *(s.name for s in rebuild),
            "external",
            "tombstone",
            "backups",
            "verify",
            "receipt",
        )

    @property
    def stores(self) -> tuple[Erasable, ...]:
        """The stores this coordinator erases from, in step order."""
        return self._w.stores

    # -- persistence ---------------------------------------------------------------

    def _load(self, request_id: str) -> ErasureRequest:
        with self._catalog.engine.connect() as conn:
            row = conn.execute(
                sa.select(deletion_requests).where(deletion_requests.c.request_id == request_id)
            ).first()
        if row is None:
            raise NotFound(f"no erasure request {request_id}")
        doc = json.loads(row.doc)
        # A request recorded by an earlier release names some steps differently.
        doc["done"] = [LEGACY_STEPS.get(s, s) for s in doc.get("done", [])]
        details = doc.get("details", {})
        for old, new in LEGACY_STEPS.items():
            if old in details:
                details[new] = details.pop(old)
        _upgrade_legacy_details(row.scope, doc)
        return ErasureRequest(
            row.request_id,
            row.subject_ref,
            row.scope,
            row.state,
            row.requested_by,
            row.reason,
            utc(row.created_at),  # type: ignore[arg-type]
            utc(row.updated_at),  # type: ignore[arg-type]
            row.attempts,
            doc,
        )

    def _save(
        self,
        req: ErasureRequest,
        receipt: str | None = None,
        *,
        also: Callable[[Any], None] | None = None,
        doc: bool = True,
    ) -> None:
        """Record the request (under its lease, if this worker holds one) and, in the
        same transaction, ``also``'s statements (its long lists' rows). ``doc=False``:
        the document has not changed (a step's per-item progress, which is rows
        only), so it is not written again."""
        req.updated_at = now()
        values: dict[str, Any] = {
            "state": req.state,
            "updated_at": req.updated_at,
            "attempts": req.attempts,
        }
        if doc:
            values["doc"] = json.dumps(req.doc, sort_keys=True)
        if receipt is not None:
            values["receipt"] = receipt
        lease = self._leases.get((req.request_id, threading.get_ident()))
        where = deletion_requests.c.request_id == req.request_id if lease is None else lease.where()
        with self._catalog.transaction() as conn:
            saved = conn.execute(deletion_requests.update().where(where).values(**values)).rowcount
            if saved == 1 and also is not None:
                also(conn)
            if saved == 1:
                # The outbox: a settled state's webhooks commit with it, or not at all.
                self.webhooks.enqueue(conn, req)
        if lease is not None and (saved != 1 or lease.lost):
            # Another worker holds the request now: record nothing more (its run
            # records what this one did not).
            raise LeaseLost()

    def _set_state(self, req: ErasureRequest, state: str, **data: Any) -> None:
        if state in (COMPLETED, REJECTED, MANUAL_REVIEW):
            self._probes.drop(req.request_id)  # nothing will verify them any more
        if req.state != state:
            req.state = state
            self._save(req)
            self._audit.record(
                "erasure.state",
                subject_ref=req.subject_ref,
                request_id=req.request_id,
                state=state,
                **data,
            )
            self._metrics.state(state)

    # -- the API -------------------------------------------------------------------

    def request(
        self,
        subject_ref: str,
        scope: str | None,
        *,
        requested_by: str,
        reason: str,
        request_id: str | None = None,
        probes: Sequence[str] = (),
        assets: Sequence[str] | None = None,
        kind: str = "erasure",
        block: bool = False,
        claim: bool = False,
        identity: Mapping[str, str] | None = None,
    ) -> ErasureRequest:
        """Record a request (idempotent by ``request_id``) without running it;
        ``claim``: its job is leased to this process in the same transaction
        (``take_claimed`` hands it over to run), so no worker starts it first.

        A subject erasure that finds nothing of the subject (no key, no asset, no
        store holding anything) says so (``found_data`` False, in the request and its
        receipt) and leaves the id free for later writes; ``block=True`` keeps the id
        ``erased`` all the same (until re-admitted), as an erasure that found data does.

        ``assets`` narrows the request to exactly those memory assets of the subject
        (the retention scanner's requests): they are deleted physically with their
        vectors and catalog rows and derived assets are rebuilt, but no key is
        destroyed (the scope's other memories share it) and the subject stays active.

        ``identity`` is how the requester's identity was verified (the HTTP API's
        identity-verification hook decides it): plain metadata (the same alphabet
        as ``requested_by``), kept in the request and stated in its receipt.
        """
        check_request(scope, requested_by, reason, probes)
        checked = _identity(identity)
        request_id = request_id or uuid.uuid4().hex
        safe("request id", request_id)
        if scope is not None and not scope.startswith("~"):  # "~…": internal key scopes
            self._policy.scope(scope)
        try:
            existing = self._load(request_id)
        except NotFound:
            pass
        else:
            if existing.subject_ref != subject_ref or existing.scope != scope:
                raise InvalidInput(f"request {request_id} exists for another subject or scope")
            return existing
        doc: dict[str, Any] = {"done": [], "details": {}, "kind": safe("kind", kind)}
        if block:
            doc["block"] = True
        if checked is not None:
            doc["identity"] = checked
        if assets is not None:
            doc["assets"] = sorted({safe("asset id", a) for a in assets})
        valid = is_safe(requested_by) and is_safe(reason)
        if probes:
            # How many, never what: a request resumed elsewhere says it could not
            # check them (``verify``).
            doc["probes"] = len(probes)
        try:
            job = self._insert_request(
                request_id,
                subject_ref=subject_ref,
                scope=scope,
                requested_by=requested_by,
                reason=reason,
                doc=doc,
                claim=claim and valid,
            )
        except sa.exc.IntegrityError:
            # Another caller recorded the same id between our read and our insert (a
            # client retrying its POST): idempotent, as if we had read it first.
            existing = self._load(request_id)
            if existing.subject_ref != subject_ref or existing.scope != scope:
                raise InvalidInput(
                    f"request {request_id} exists for another subject or scope"
                ) from None
            return existing
        if job is not None:
            self._claimed[request_id] = job
        if probes and valid:
            # Probe strings stay in this process's memory only: written into the
            # request row they would sit in the catalog's pages and WAL (the drill's
            # byte scan found exactly that). A resumed request verifies without them.
            self._probes.keep(request_id, list(probes))
        self._audit.record(
            "erasure.requested",
            subject_ref=subject_ref,
            request_id=request_id,
            scope=scope,
            requested_by=requested_by if valid else "invalid",
        )
        self._metrics.state(REQUESTED)
        req = self._load(request_id)
        if not valid:
            self._set_state(req, REJECTED, why="requested_by and reason must be plain metadata")
        return req

    def _insert_request(
        self,
        request_id: str,
        *,
        subject_ref: str,
        scope: str | None,
        requested_by: str,
        reason: str,
        doc: dict[str, Any],
        claim: bool = False,
    ) -> Job | None:
        """The request row and its job, in one transaction (the outbox); the job
        as leased to this process with ``claim`` (None without)."""
        valid = is_safe(requested_by) and is_safe(reason)
        at = now()
        with self._catalog.transaction() as conn:
            conn.execute(
                deletion_requests.insert().values(
                    request_id=request_id,
                    subject_ref=subject_ref,
                    scope=scope,
                    state=REQUESTED,
                    requested_by=requested_by if valid else "invalid",
                    reason=reason if valid else "invalid",
                    created_at=at,
                    updated_at=at,
                    attempts=0,
                    doc=json.dumps(doc),
                    receipt=None,
                )
            )
            if self._jobs is None:
                return None
            # The transactional outbox: the request and its job commit together.
            payload, key = {"request_id": request_id}, job_key(request_id)
            if claim:
                return self._jobs.enqueue_leased(JOB_KIND, payload, dedupe_key=key, conn=conn)
            self._jobs.enqueue(JOB_KIND, payload, dedupe_key=key, conn=conn)
            return None

    def take_claimed(self, request_id: str) -> Job | None:
        """The job ``request(claim=True)`` leased to this process, once."""
        return self._claimed.pop(request_id, None)

    def submit(
        self,
        subject: SubjectLike,
        scope: str | None = None,
        *,
        requested_by: str,
        reason: str,
        request_id: str | None = None,
        block: bool = False,
        identity: Mapping[str, str] | None = None,
    ) -> ErasureRequest:
        """Record an erasure request and its job, and return it without running it:
        a worker (``keyshred worker``, ``ks.jobs.run_pending()``) runs it. What the
        HTTP API calls. Idempotent by ``request_id``; ``identity`` as ``request``."""
        return self.request(
            self._ref(subject),
            scope,
            requested_by=requested_by,
            reason=reason,
            request_id=request_id,
            block=block,
            identity=identity,
        )

    def release_hold(self, hold_id: str) -> None:
        """Release a hold; the requests it held go back to the workers (their jobs
        are queued again), so none waits for a ``resume``."""
        with self._catalog.engine.connect() as conn:
            held = conn.execute(
                sa.select(legal_holds.c.subject_ref).where(legal_holds.c.hold_id == hold_id)
            ).scalar()
        super().release_hold(hold_id)
        if self._jobs is None or held is None:
            return
        for req in self.requests(subject_ref=str(held)):
            if req.state == LEGAL_HOLD:
                key = job_key(req.request_id)
                if self._jobs.find(key) is None:
                    # Held before its catalog had jobs: it gets one now.
                    self._jobs.enqueue(JOB_KIND, {"request_id": req.request_id}, dedupe_key=key)
                else:
                    self._jobs.reopen(key)

    def job_id(self, request_id: str) -> str | None:
        """The id of the request's job (None: recorded before jobs, or no queue)."""
        if self._jobs is None:
            return None
        job = self._jobs.find(job_key(request_id))
        return None if job is None else job.job_id

    def status(self, request_id: str) -> ErasureRequest:
        return self._load(request_id)

    def resume(self, request_id: str) -> ErasureRequest:
        """Continue a request that stopped: a crash, a failed step, a released hold,
        or a derived asset's producer registered since it went to manual review."""
        return self.run(request_id)

    def requests(
        self, subject: SubjectLike | None = None, *, subject_ref: str | None = None
    ) -> list[ErasureRequest]:
        """Every request (of one subject, or by ``subject_ref=``), oldest first."""
        ref = self._maybe_ref(subject, subject_ref)
        query = sa.select(deletion_requests.c.request_id).order_by(deletion_requests.c.created_at)
        if ref is not None:
            query = query.where(deletion_requests.c.subject_ref == ref)
        with self._catalog.engine.connect() as conn:
            ids = list(conn.execute(query).scalars())
        return [self._load(i) for i in ids]

    def receipt(self, request_id: str) -> Receipt | None:
        with self._catalog.engine.connect() as conn:
            text = conn.execute(
                sa.select(deletion_requests.c.receipt).where(
                    deletion_requests.c.request_id == request_id
                )
            ).scalar()
        return None if text is None else load_receipt(text)

    def residue_scan(
        self, probes: Sequence[str], paths: Sequence[str | os.PathLike[str]]
    ) -> ResidueReport:
        """Search every file under ``paths`` (a data folder, backups, exports) for
        the probes, raw and decrypted with every key the live keyring still opens
        (``keyshred.residue``); the report holds probe indexes, never probes."""
        if self._residue is None:
            raise KeyshredError("this coordinator has no residue scanner")
        return self._residue(probes, paths)

    def register_processor(self, processor: ExternalProcessor) -> None:
        safe("processor name", processor.name)
        self._processors.append(processor)

    def replay(self, tombstone: Tombstone) -> ErasureRequest:
        """Replay a tombstone from elsewhere (a restore): the same steps as an
        erasure, without holds, external calls, backup deletion or a receipt."""
        request_id = f"replay-{tombstone.tombstone_id}"
        req = self.request(
            tombstone.subject_ref,
            tombstone.scope,
            requested_by="backup-restore",
            reason="tombstone-replay",
            request_id=request_id,
        )
        if "replay" not in req.doc:
            req.doc["replay"] = {
                "tombstone_id": tombstone.tombstone_id,
                "key_ids": [k.hex() for k in tombstone.key_ids],
                "erased_at": iso(tombstone.erased_at),
            }
            self._save(req)
        return self.run(request_id)

    # -- running -------------------------------------------------------------------

    def run(self, request_id: str, *, stop: Callable[[], bool] | None = None) -> ErasureRequest:
        """Run (or resume) a request until it completes, waits on a hold, or fails.
        One worker at a time runs a request (its lease, ``keyshred.erasure.lease``):
        while another holds it this waits up to ``erasure.lease_seconds`` for it to
        finish or for its lease to run out (a killed worker), then returns the
        request as it stands. ``stop`` is consulted between steps: once it says so,
        the run returns the request as it stands (resumable)."""
        with span("keyshred.erasure.run", {"keyshred.request_id": request_id}) as run_span:
            req, how = self._run(request_id, stop=stop, wait=True)
            run_span.set("keyshred.state", req.state)
        if (
            how == _RAN
            and self._jobs is not None
            and req.state
            in (
                COMPLETED,
                REJECTED,
                LEGAL_HOLD,
            )
        ):
            # Run here directly (a resume, a replay): its queued job has nothing left.
            self._jobs.finish_queued(job_key(request_id))
        return req

    def run_job(self, job: Job, stop: Callable[[], bool]) -> JobOutcome:
        """The ``erasure`` job's handler: run the request, say how the job ends."""
        request_id = job.payload["request_id"]
        with span("keyshred.erasure.run", {"keyshred.request_id": request_id}) as run_span:
            req, how = self._run(request_id, stop=stop, wait=False)
            run_span.set("keyshred.state", req.state)
        if how == _STOPPED:
            return JobOutcome.later(0.0)
        if how in (_BUSY, _LOST):
            return JobOutcome.later(_BUSY_DELAY)
        if req.state in (COMPLETED, LEGAL_HOLD, REJECTED):
            return JobOutcome.done()
        if req.state == MANUAL_REVIEW:
            review = "ProducerUnknown" if req.doc.get("review") == _REVIEW_PRODUCER else None
            return JobOutcome.review(review or "ManualReview")
        if req.state == RETRYABLE:
            if job.attempts >= job.max_attempts:
                # The job's last attempt: the queue dead-letters it, and the request
                # says so too (not "retryable" with nothing left to retry it).
                self._set_state(req, MANUAL_REVIEW, why="its job ran out of attempts")
                return JobOutcome.review(str(req.error or "Error"))
            return JobOutcome.retry(str(req.error or "Error"))
        return JobOutcome.later(_BUSY_DELAY)

    def _run(
        self, request_id: str, *, stop: Callable[[], bool] | None, wait: bool
    ) -> tuple[ErasureRequest, str]:
        # The request's lease is the only exclusion: two threads of this process
        # run two requests side by side (a worker's --concurrency), and one request
        # once, like two processes do.
        deadline = time.monotonic() + self._lease_seconds + 1.0
        while (lease := claim(self._catalog, request_id, self._lease_seconds)) is None:
            req = self._load(request_id)  # NotFound for an unknown id
            if req.state in (COMPLETED, REJECTED):
                return req, _RAN
            if not wait or time.monotonic() > deadline:
                return req, _BUSY
            time.sleep(0.05)
        mine = (request_id, threading.get_ident())
        self._leases[mine] = lease
        try:
            return self._run_leased(request_id, stop)
        except LeaseLost:
            return self._load(request_id), _LOST
        finally:
            del self._leases[mine]
            lease.release()

    def _run_leased(
        self, request_id: str, stop: Callable[[], bool] | None
    ) -> tuple[ErasureRequest, str]:
        req = self._load(request_id)
        if req.state in (COMPLETED, REJECTED):
            return req, _RAN
        if req.state == MANUAL_REVIEW and req.doc.get("review") != _REVIEW_PRODUCER:
            return req, _RAN
        if req.state == REQUESTED:
            self._set_state(req, AUTHORIZED, requested_by=req.requested_by)
        if "destroy_keys" not in req.steps_done and extent_of(self._w, req).holds_apply:
            holds = self.holds(subject_ref=req.subject_ref, scope=req.scope)
            if holds:
                req.doc["held"] = True
                self._set_state(req, "legal_hold", holds=[h.hold_id for h in holds])
                return req, _RAN
        # A request waiting for a producer's rebuild function is not failing: its
        # resumes before the application registers one use up no attempt.
        counted = not (req.state == MANUAL_REVIEW and req.doc.get("review") == _REVIEW_PRODUCER)
        if counted:
            req.attempts += 1
        if req.attempts > 1:
            self._metrics.retry()
        if req.attempts > MAX_ATTEMPTS:
            req.doc.pop("review", None)
            self._set_state(req, MANUAL_REVIEW, why="too many attempts")
            return req, _RAN
        self._save(req)
        for step in self.steps:
            if step in req.steps_done:
                continue
            if stop is not None and stop():
                # Between steps: the next run resumes here. A stop is no failure:
                # it uses up none of the request's attempts.
                if counted:
                    req.attempts -= 1
                    self._save(req)
                return req, _STOPPED
            try:
                details = self._step(step, req)
                if self.on_step_acted is not None:
                    self.on_step_acted(step, req)
            except (VerificationFailed, ProducerUnknown) as exc:
                req.doc["error"] = str(exc)
                if isinstance(exc, ProducerUnknown):
                    req.doc["review"] = _REVIEW_PRODUCER
                self._set_state(req, MANUAL_REVIEW, step=step)
                return req, _RAN
            except (KeyshredError, OSError, sa.exc.SQLAlchemyError) as exc:
                req.doc["error"] = f"{step}: {type(exc).__name__}"
                self._metrics.failure(step)
                self._set_state(req, RETRYABLE, step=step, error=type(exc).__name__)
                return req, _RAN
            req.doc["details"][step] = details
            req.doc["done"].append(step)
            req.doc.pop("error", None)
            req.doc.pop("review", None)
            lists = req.cache.pop("lists", {}) if step == "closure" else {}

            def settle(conn: Any, step: str = step, lists: dict[str, list[str]] = lists) -> None:
                # The step's progress goes with the record that marks it done; the
                # closure's lists come with it.
                items.clear(conn, req.request_id, items.progress_list(step))
                for name, ids in lists.items():
                    items.write(conn, req.request_id, name, ids)

            self._save(req, also=settle)
            # Recorded under the lease (a lost lease raised above): once per request.
            self._metrics.erasure_step_recorded(
                step,
                req.doc.get("kind", "erasure"),
                (req.updated_at - req.created_at).total_seconds(),
            )
            self._set_state(req, _STATE_AFTER.get(step, PROPAGATING), step=step)
            if self.on_step is not None:
                self.on_step(step, req)
        last = self.steps[-1]
        if last in req.steps_done and req.state != _STATE_AFTER[last]:
            # A run died between the last step's record and its state (their own
            # transactions): the state, with the webhooks it announces, now.
            self._set_state(req, _STATE_AFTER[last], step=last)
        return req, _RAN

    # -- steps ---------------------------------------------------------------------

    def _step(self, step: str, req: ErasureRequest) -> dict[str, Any]:
        attributes = {
            "keyshred.request_id": req.request_id,
            "keyshred.kind": str(req.doc.get("kind", "erasure")),
            "keyshred.step": step,
            "keyshred.state": req.state,
        }
        with span(f"keyshred.erasure.{step}", attributes):
            store = self._store_steps.get(step)
            if store is not None:
                return self._store_step(step, store, req)
            method: Callable[[ErasureRequest], dict[str, Any]] = getattr(self, f"_step_{step}")
            return method(req)

    def _store_step(self, step: str, store: Erasable, req: ErasureRequest) -> dict[str, Any]:
        """One store's ``erase``; per-item progress (derived rebuilds) is recorded as
        it goes, so a resumed step does not act twice on the same asset."""
        legacy = req.doc.get("progress", {}).pop(step, None)
        if legacy is not None:
            # Recorded in the document by an earlier release: into rows, once.
            entries = [dict(d) for d in legacy]

            def move(conn: Any) -> None:
                for pos, entry in enumerate(entries):
                    items.put_entry(
                        conn, req.request_id, step, entry["asset_id"], pos=pos, entry=entry
                    )

            self._save(req, also=move)
        done, first = items.progress(self._catalog, req.request_id, step)
        positions = itertools.count(first)

        def record(item: str, entry: Mapping[str, Any] | None) -> None:
            # Rows only: the document, whose size grows with the closure (its shared
            # keys' assets), is not rewritten twice per item.
            if entry is None:
                self._save(
                    req,
                    also=lambda c: items.drop_entry(c, req.request_id, step, item),
                    doc=False,
                )
            else:
                pos = next(positions)
                self._save(
                    req,
                    also=lambda c: items.put_entry(
                        c, req.request_id, step, item, pos=pos, entry=entry
                    ),
                    doc=False,
                )

        base = extent_of(self._w, req).target()
        target = type(base)(
            base.subject_ref,
            base.scope,
            base.assets,
            base.erased,
            base.closure,
            tuple(done),
            record,
        )
        result: StoreErasure = store.erase(target)
        return result.to_doc()

    def _step_suppress(self, req: ErasureRequest) -> dict[str, Any]:
        return extent_of(self._w, req).suppress()

    def _step_destroy_keys(self, req: ErasureRequest) -> dict[str, Any]:
        return extent_of(self._w, req).destroy_keys()

    def _step_closure(self, req: ErasureRequest) -> dict[str, Any]:
        details = closure(self._w, req)
        # The id lists go into rows with the step's record (``keyshred.erasure.items``);
        # the document, rewritten at every later record, keeps their lengths.
        own, found = list(details.pop("own")), list(details.pop("closure"))
        details["own_n"], details["closure_n"] = len(own), len(found)
        req.cache["lists"] = {"own": own, "closure": found}
        req.cache["closure_lists"] = (tuple(own), tuple(found))
        return details

    def _step_catalog(self, req: ErasureRequest) -> dict[str, Any]:
        extent = extent_of(self._w, req)
        assets, consents = extent.drop_catalog()
        packages = extent.drop_packages()
        return {"assets": assets, "consents": consents, "packages": packages, "at": iso(now())}

    def _step_external(self, req: ErasureRequest) -> dict[str, Any]:
        if not extent_of(self._w, req).calls_processors:
            return {"calls": []}
        calls = list(req.doc.get("external_done", []))
        answered = {c["processor"] for c in calls}
        for processor in self._processors:
            if processor.name in answered:
                continue
            answer = _call_processor(processor, req)
            calls.append(
                {
                    "processor": processor.name,
                    "status": "acknowledged" if answer.verified else "deletion_not_verifiable",
                    "detail": answer.detail[:256],
                    "at": iso(now()),
                }
            )
            req.doc["external_done"] = calls
            self._save(req)
            self._audit.record(
                "erasure.external",
                subject_ref=req.subject_ref,
                request_id=req.request_id,
                processor=processor.name,
                verified=answer.verified,
            )
        return {"calls": calls}

    def _step_tombstone(self, req: ErasureRequest) -> dict[str, Any]:
        keys = req.doc["details"]["destroy_keys"]
        store = self._keyring.store
        for key_hex in keys["key_ids"]:
            if store.tombstone_for(bytes.fromhex(key_hex)) is None:
                raise KeyshredError(f"no tombstone for key {key_hex}")
        return {"tombstone_id": keys["tombstone_id"], "keys": len(keys["key_ids"])}

    def _step_backups(self, req: ErasureRequest) -> dict[str, Any]:
        if not extent_of(self._w, req).deletes_backups:
            return {"targets": 0, "objects_deleted": 0}
        keys = req.doc["details"]["destroy_keys"]
        if not keys["key_ids"]:
            return {"targets": 0, "objects_deleted": 0}
        tombstone = self._keyring.store.tombstone_for(bytes.fromhex(keys["key_ids"][0]))
        if tombstone is None:
            raise KeyshredError("the tombstone is missing")
        return self._w.backups.on_erasure(tombstone, whole_subject=req.scope is None)

    def _step_verify(self, req: ErasureRequest) -> dict[str, Any]:
        # What the steps deleted from the catalog (hot records, the superseded
        # values the derived step purged) leaves SQLite's WAL first: its frames
        # keep the pages the deleting commits replaced until they are overwritten,
        # and a request that destroyed no key (retention, a scope) deleted values
        # sealed under live keys. (No-op on PostgreSQL.)
        self._catalog.scrub()
        probes = [p for p in self._probes.get(req.request_id) if p]
        return verify(self._w, req, probes, list(self._store_steps), self._save)

    def _step_receipt(self, req: ErasureRequest) -> dict[str, Any]:
        d = req.doc["details"]
        keys = d["destroy_keys"]
        completed = now()
        extent = extent_of(self._w, req)
        if not extent.signs_receipt:
            extent.finish(found=True)
            self._audit.record(
                "erasure.replayed",
                subject_ref=req.subject_ref,
                request_id=req.request_id,
                keys=len(keys["key_ids"]),
            )
            return {"at": iso(completed)}
        store_steps = list(self._store_steps)
        req.doc["found_data"] = found_data(d, store_steps)
        signed_before = self.receipt(req.request_id)
        if signed_before is not None:
            # A run before this one signed and saved the receipt, then died (or lost
            # its lease) before recording the step: the receipt stands, signed once;
            # only what that run may not have logged yet is logged now.
            extent.finish(found=req.doc["found_data"] or bool(req.doc.get("block")))
            if self._audit.events(request_id=req.request_id, event="erasure.completed"):
                return {"at": iso(signed_before.completed_at)}
            completed = signed_before.completed_at
        else:
            backups = extent.backup_coverage(
                datetime.fromisoformat(keys["at"]), d.get("backups", {}).get("objects_deleted", 0)
            )
            metrics = receipt_metrics(self._catalog, req)  # eviction everywhere
            receipt = build_receipt(req, store_steps, completed, backups, metrics)
            signed = sign_receipt(receipt, self._keyring.receipt_signer())
            extent.finish(found=req.doc["found_data"] or bool(req.doc.get("block")))
            self._save(req, receipt=signed.serialize())
            self._metrics.completion_latency((completed - req.created_at).total_seconds())
        derived = sum(len(d[s].get("actions", [])) for s in store_steps if s in d)
        self._audit.record(
            "erasure.completed",
            subject_ref=req.subject_ref,
            request_id=req.request_id,
            keys=len(keys["key_ids"]),
            derived=derived,
            found_data=bool(req.doc["found_data"]),
        )
        return {"at": iso(completed)}


def _identity(identity: Mapping[str, str] | None) -> dict[str, str] | None:
    """The identity-verification metadata of a request, checked: at most 8 entries,
    names and values of plain metadata (they land in the receipt)."""
    if identity is None:
        return None
    if not isinstance(identity, Mapping) or len(identity) > 8:
        raise InvalidInput("identity is a mapping of at most 8 names to plain metadata")
    return {safe("identity name", k): safe("identity value", v) for k, v in identity.items()}


def _call_processor(processor: ExternalProcessor, req: ErasureRequest) -> Any:
    """Ask a processor to delete, with the request id as its idempotency key when
    its ``delete`` takes one (``idempotency_key=``): a request resumed after a
    crash between the vendor's answer and its record asks again with the same key,
    so the vendor acts once. A processor written before takes two arguments."""
    try:
        params = inspect.signature(processor.delete).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    takes_key = "idempotency_key" in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
    )
    if takes_key:
        return processor.delete(req.subject_ref, req.scope, idempotency_key=req.request_id)  # type: ignore[call-arg]
    return processor.delete(req.subject_ref, req.scope)


# What the stores' steps recorded before they were ``Erasable`` (keyshred 0.1): the
# store's name, count and time, the action the receipt named for the extent, and
# the derived step's ``actions`` (its progress under ``derived_done``).
_LEGACY_ACTIONS = {
    "drop_memories": ("memories", "partition-dropped", "scope-dropped"),
    "drop_vectors": ("vectors", "dataset-dropped", "scope-deleted"),
    "drop_vault": ("vault", "tokens-deleted", "tokens-deleted"),
    "drop_checkpoints": ("checkpoints", "threads-deleted", "threads-deleted"),
}


def _upgrade_legacy_details(scope: str | None, doc: dict[str, Any]) -> None:
    """A request an earlier release left half done (an upgrade while it ran) resumes
    with its steps' results in today's form, so its receipt is built and signed."""
    details: dict[str, Any] = doc.setdefault("details", {})
    for step, (store, whole, scoped) in _LEGACY_ACTIONS.items():
        d = details.get(step)
        if isinstance(d, dict) and "store" not in d and "count" in d:
            count = int(d["count"])
            details[step] = {
                "store": store,
                "action": whole if scope is None else scoped,
                "count": count,
                "at": d.get("at") or now().isoformat(),
                "actions": [],
                "found": count > 0,
            }
    derived = details.get("derived")
    if isinstance(derived, dict) and "store" not in derived and "actions" in derived:
        actions = list(derived["actions"])
        details["derived"] = {
            "store": "derived",
            "action": "rebuilt-or-dropped",
            "count": len(actions),
            "at": now().isoformat(),
            "actions": actions,
            "found": bool(actions),
        }
    if "derived_done" in doc:  # a derived step killed halfway: its progress
        doc.setdefault("progress", {}).setdefault("derived", doc.pop("derived_done"))


class _Probes:
    """Probe strings of the requests this process recorded, in memory only, until
    the request settles here (completed, rejected, sent to review) or, if another
    process finishes it, an hour after it was recorded."""

    def __init__(self, ttl_seconds: float = 3600.0) -> None:
        self._ttl = ttl_seconds
        self._lock = threading.Lock()
        self._kept: dict[str, tuple[list[str], float]] = {}

    def keep(self, request_id: str, probes: list[str]) -> None:
        with self._lock:
            self._purge()
            self._kept[request_id] = (probes, time.monotonic() + self._ttl)

    def get(self, request_id: str) -> list[str]:
        with self._lock:
            self._purge()
            entry = self._kept.get(request_id)
            return [] if entry is None else list(entry[0])

    def drop(self, request_id: str) -> None:
        with self._lock:
            self._kept.pop(request_id, None)

    def __len__(self) -> int:
        with self._lock:
            self._purge()
            return len(self._kept)

    def _purge(self) -> None:
        now = time.monotonic()
        for rid in [r for r, (_, until) in self._kept.items() if until <= now]:
            del self._kept[rid]

    def __repr__(self) -> str:
        return f"_Probes(requests={len(self._kept)})"
