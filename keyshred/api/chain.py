"""The audit chain for auditors: events (metadata only: subject_refs, request ids,
states, actors) and a verification of the hash chain."""

from __future__ import annotations

from keyshred.api.models import AuditEventsView, AuditVerifyView
from keyshred.api.operations import Call, Operation, Reply
from keyshred.api.problems import Problem
from keyshred.errors import IntegrityError

__all__ = ["OPERATIONS"]

_MAX = 1000


def _int(call: Call, name: str, default: int, low: int, high: int) -> int:
    values = call.query.get(name)
    if not values:
        return default
    try:
        value = int(values[-1])
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise Problem(422, "invalid-input", "The request is not valid", f"{name} is {low}-{high}")
    return value


def _last(call: Call, name: str) -> str | None:
    values = call.query.get(name)
    return values[-1] if values else None


def events(call: Call) -> Reply:
    after = _int(call, "after", 0, 0, 2**62)
    limit = _int(call, "limit", 100, 1, _MAX)
    request_id = _last(call, "request_id")
    event = _last(call, "event")
    found = call.ks.audit.events(request_id=request_id, event=event)
    page = [e for e in found if e.seq > after][:limit]
    return Reply(
        200,
        {
            "events": [
                {
                    "seq": e.seq,
                    "at": e.at.isoformat(),
                    "event": e.event,
                    "subject_ref": e.subject_ref,
                    "request_id": e.request_id,
                    "data": e.data,
                    "hash": e.hash,
                }
                for e in page
            ]
        },
    )


def verify(call: Call) -> Reply:
    try:
        n = call.ks.audit.verify()
    except IntegrityError as exc:
        return Reply(200, {"intact": False, "events_checked": 0, "detail": str(exc)})
    return Reply(200, {"intact": True, "events_checked": n, "detail": None})


OPERATIONS = (
    Operation(
        "GET",
        "/v1/audit/events",
        "audit.events",
        "Audit events in order (metadata only), after a sequence number",
        frozenset({"auditor"}),
        events,
        response=AuditEventsView,
        errors=(422,),
        query=(
            ("after", "Only events with a higher sequence number."),
            ("limit", "At most this many (1-1000, default 100)."),
            ("request_id", "Only events of this request."),
            ("event", "Only events of this name."),
        ),
        tag="audit",
    ),
    Operation(
        "GET",
        "/v1/audit/verify",
        "audit.verify",
        "Recompute the audit hash chain",
        frozenset({"auditor"}),
        verify,
        response=AuditVerifyView,
        tag="audit",
    ),
)
