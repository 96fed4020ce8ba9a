"""Completion webhooks: a signed callback to each configured endpoint when an
erasure request settles (``Config.webhooks``; signing and HTTP in ``keyshred.webhooks``).

The events (``keyshred.config.WEBHOOK_EVENTS``) are ``<family>.<outcome>``: the
family ``erasure`` (a subject or scope erasure) or ``consent.withdrawal`` (the scope
erasure of a withdrawn consent), the outcome ``completed`` (the receipt is signed),
``manual_review`` (a human must look) or ``rejected``. Retention runs and tombstone
replays send none.

Each delivery is a ``webhook`` job (``keyshred.jobs``), written by ``enqueue`` in the
very transaction that records the request's new state (the coordinator's save: a
transactional outbox), so a crash can neither lose a callback nor send one for a
state that was never committed. Its dedupe key and its ``webhook-id`` both derive
from the request id, the event and the endpoint: one job per (request, event,
endpoint), the same message id on every attempt, so a receiver drops a duplicate.
A worker (``keyshred worker``, ``ks.jobs.run_pending()``) makes one HTTP attempt per
run; a 5xx, 408, 429, a timeout or a refused connection is a retry after the
endpoint's backoff (full jitter), any other answer outside 2xx (a 4xx, a redirect)
is final, and a delivery that used up the endpoint's ``attempts`` is dead-lettered
(the job's ``manual_review``, audited ``webhook.failed``). None of it touches the
erasure request's own state.

The message body is JSON of ids only, built from the request row at each attempt
(the same bytes every time): ``type``, ``timestamp`` (when the state was recorded),
``data`` with ``request_id``, ``kind``, ``state``, ``subject_ref``, ``scope`` and, once
completed, the receipt's path on the HTTP API and the SHA-256 of the receipt as
issued (its compact JWS). Never a subject id, a value or the endpoint's secret or
URL: job rows and audit events name the endpoint by its ``name``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import sqlalchemy as sa
import urllib3
from sqlalchemy.engine import Connection

from keyshred import webhooks
from keyshred.audit import AuditLog
from keyshred.config import WebhookSettings
from keyshred.erasure.requests import COMPLETED, MANUAL_REVIEW, REJECTED, ErasureRequest, iso
from keyshred.errors import InvalidInput, WebhookDeliveryFailed
from keyshred.jobs import Job, JobOutcome, JobQueue
from keyshred.schema import deletion_requests
from keyshred.storage.catalog import Catalog

__all__ = ["JOB_KIND", "RECEIPT_PATH", "CompletionWebhooks", "event_of", "message_id"]

JOB_KIND = "webhook"
# Where the HTTP API serves a request's receipt (keyshred.api.erasure).
RECEIPT_PATH = "/v1/erasure-requests/{request_id}/receipt"
_FAMILIES = {"erasure": "erasure", "consent-withdrawal": "consent.withdrawal"}
_OUTCOMES = (COMPLETED, MANUAL_REVIEW, REJECTED)


def event_of(req: ErasureRequest) -> str | None:
    """The webhook event ``req``'s state is, or None (not a settled state, or a
    kind of request that sends none)."""
    if req.state not in _OUTCOMES or "replay" in req.doc:
        return None
    family = _FAMILIES.get(str(req.doc.get("kind", "erasure")))
    return None if family is None else f"{family}.{req.state}"


def message_id(request_id: str, event: str, endpoint: str) -> str:
    """The ``webhook-id`` of ``event`` of ``request_id`` sent to ``endpoint``: the
    same on every attempt and from every worker (``msg_`` and 130 bits of a hash)."""
    digest = hashlib.sha256("\x00".join((request_id, event, endpoint)).encode()).digest()
    return "msg_" + base64.b32encode(digest).decode("ascii")[:26].lower()


class CompletionWebhooks:
    """The outbox half (``enqueue``, called by the coordinator's save) and the
    delivery half (``run_job``, the ``webhook`` job's handler)."""

    def __init__(
        self,
        endpoints: Sequence[WebhookSettings],
        catalog: Catalog,
        audit: AuditLog,
        jobs: JobQueue | None,
        *,
        environ: Mapping[str, str] | None = None,
        random: Callable[[], float] | None = None,
    ) -> None:
        self.endpoints = tuple(endpoints)
        self._by_name = {e.endpoint: e for e in self.endpoints}
        self._catalog = catalog
        self._audit = audit
        self._jobs = jobs
        self._environ = environ
        self._random = random or secrets.SystemRandom().random

    def enqueue(self, conn: Connection, req: ErasureRequest) -> int:
        """Write the deliveries of ``req``'s new state in ``conn`` (the transaction
        saving it); how many endpoints want it. Idempotent: a state saved again
        (a resumed request) finds its jobs there already."""
        if not self.endpoints or self._jobs is None:
            return 0
        event = event_of(req)
        if event is None:
            return 0
        wanted = [e for e in self.endpoints if event in e.events]
        for endpoint in wanted:
            msg_id = message_id(req.request_id, event, endpoint.endpoint)
            self._jobs.enqueue(
                JOB_KIND,
                {
                    "request_id": req.request_id,
                    "event": event,
                    "endpoint": endpoint.endpoint,
                    "at": iso(req.updated_at),
                },
                dedupe_key=f"{JOB_KIND}:{msg_id}",
                max_attempts=endpoint.attempts,
                conn=conn,
            )
        return len(wanted)

    def body(self, job: Job) -> bytes:
        """The message of ``job``: the same bytes on every attempt."""
        p = job.payload
        with self._catalog.engine.connect() as conn:
            row = conn.execute(
                sa.select(
                    deletion_requests.c.subject_ref,
                    deletion_requests.c.scope,
                    deletion_requests.c.doc,
                    deletion_requests.c.receipt,
                ).where(deletion_requests.c.request_id == p["request_id"])
            ).first()
        if row is None:
            raise InvalidInput("the webhook's erasure request is not in the catalog")
        event = p["event"]
        data: dict[str, Any] = {
            "request_id": p["request_id"],
            "kind": str(json.loads(row.doc).get("kind", "erasure")),
            "state": event.rsplit(".", 1)[1],
            "subject_ref": row.subject_ref,
            "scope": row.scope,
        }
        if data["state"] == COMPLETED and row.receipt is not None:
            data["receipt"] = {
                "path": RECEIPT_PATH.format(request_id=quote(p["request_id"], safe="")),
                "sha256": hashlib.sha256(row.receipt.encode("utf-8")).hexdigest(),
            }
        at = datetime.fromisoformat(p["at"]).astimezone(UTC)
        message = {
            "type": event,
            "timestamp": at.isoformat().replace("+00:00", "Z"),
            "data": data,
        }
        return json.dumps(message, sort_keys=True, separators=(",", ":")).encode("utf-8")

    def run_job(self, job: Job, stop: Callable[[], bool]) -> JobOutcome:
        """The ``webhook`` job's handler: one signed attempt (see the module
        docstring for how each answer ends the run)."""
        del stop  # one HTTP attempt is one unit
        p = job.payload
        endpoint = self._by_name.get(p["endpoint"])
        if endpoint is None:
            # Configured when the state was recorded, not any more: an operator's
            # choice, left for them to see in the dead letter.
            return self._final(job, "WebhookEndpointUnknown")
        secret = self._secret(endpoint)
        if secret is None:
            # The variable is missing in this worker: another (or this one,
            # restarted) may have it.
            return self._retry(job, endpoint, "WebhookSecretMissing")
        try:
            body = self.body(job)
        except InvalidInput:
            return self._final(job, "WebhookRequestUnknown")
        msg_id = message_id(p["request_id"], p["event"], endpoint.endpoint)
        try:
            with urllib3.PoolManager() as pool:  # one attempt: no connection kept
                delivery = webhooks.deliver(
                    endpoint.url,
                    body,
                    secret,
                    msg_id=msg_id,
                    max_attempts=1,
                    timeout=endpoint.timeout_seconds,
                    pool=pool,
                )
        except InvalidInput:
            # A secret from the environment that is no whsec_ secret.
            return self._final(job, "WebhookSecretInvalid")
        except WebhookDeliveryFailed as exc:
            answer = "NoAnswer" if exc.status is None else f"HTTP{exc.status}"
            if webhooks.is_retryable(exc.status):
                return self._retry(job, endpoint, f"WebhookDeliveryFailed.{answer}")
            return self._final(job, f"WebhookRefused.{answer}")
        self._audit.record(
            "webhook.delivered",
            request_id=p["request_id"],
            event_type=p["event"],
            endpoint=endpoint.endpoint,
            message_id=msg_id,
            attempts=job.attempts,
            status=delivery.status,
        )
        return JobOutcome.done()

    def _secret(self, endpoint: WebhookSettings) -> str | None:
        if endpoint.secret is not None:
            return endpoint.secret.get_secret_value()
        environ = os.environ if self._environ is None else self._environ
        value = environ.get(str(endpoint.secret_env))
        return value or None

    def _retry(self, job: Job, endpoint: WebhookSettings, error: str) -> JobOutcome:
        if job.attempts >= job.max_attempts:
            return self._final(job, error)  # the queue would dead-letter it: say so
        cap = min(
            endpoint.backoff_max_seconds, endpoint.backoff_seconds * 2 ** max(0, job.attempts - 1)
        )
        return JobOutcome.retry(error, backoff=cap * self._random())

    def _final(self, job: Job, error: str) -> JobOutcome:
        p = job.payload
        self._audit.record(
            "webhook.failed",
            request_id=p["request_id"],
            event_type=p["event"],
            endpoint=p["endpoint"],
            message_id=message_id(p["request_id"], p["event"], p["endpoint"]),
            attempts=job.attempts,
            error=error,
        )
        return JobOutcome.review(error)
