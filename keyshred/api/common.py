"""Helpers the resource modules share: the body's subject, the identity hook's
verdict, the owner check, and JSON views of erasure requests."""

from __future__ import annotations

from typing import Any

from keyshred.api.operations import Call
from keyshred.api.problems import Problem
from keyshred.erasure import ErasureRequest
from keyshred.erasure.requests import is_safe
from keyshred.ids import Subject

__all__ = ["check_owner", "request_view", "subject_of", "verify_identity"]


def subject_of(call: Call) -> Subject:
    """The subject named in the call's body (its tenant, or the store's)."""
    body = call.body
    return Subject(body.subject, body.tenant or call.ks.config.tenant)


def verify_identity(call: Call, subject: Subject, action: str) -> dict[str, str]:
    """Ask the identity hook; a refusal is a 403, a broken hook a 500 naming no
    more than that. Returns the decision as plain metadata."""
    principal = call.principal
    try:
        decision = call.services.identity(principal, subject, action)
    except Exception:  # noqa: BLE001 - the deployment's hook: any failure is a refusal
        raise Problem(
            500, "identity-hook-failed", "The identity verification hook failed"
        ) from None
    if not decision.allowed:
        raise Problem(
            403,
            "identity-not-verified",
            "The requester's identity is not verified for this subject",
            "the identity verification hook refused the request",
        )
    metadata = decision.metadata(principal.actor)
    if not all(is_safe(v) for v in metadata.values()):
        # It would land in the receipt: the hook must state a method, not evidence.
        raise Problem(500, "identity-hook-failed", "The identity verification hook failed")
    return metadata


def check_owner(call: Call, requested_by: str) -> None:
    """A requester sees only what it asked for; operators and auditors see all."""
    if call.principal.role == "requester" and requested_by != call.principal.actor:
        raise Problem(403, "forbidden", "This request was made by another caller")


def request_view(req: ErasureRequest, steps: tuple[str, ...], has_receipt: bool) -> dict[str, Any]:
    details = req.doc.get("details", {})
    timings = {
        step: str(d["at"])
        for step, d in details.items()
        if isinstance(d, dict) and isinstance(d.get("at"), str)
    }
    step = None
    if req.state != "completed":
        step = next((s for s in steps if s not in req.steps_done), None)
    identity = req.doc.get("identity")
    return {
        "request_id": req.request_id,
        "subject_ref": req.subject_ref,
        "scope": req.scope,
        "kind": str(req.doc.get("kind", "erasure")),
        "state": req.state,
        "requested_by": req.requested_by,
        "reason": req.reason,
        "created_at": req.created_at.isoformat(),
        "updated_at": req.updated_at.isoformat(),
        "attempts": req.attempts,
        "steps_done": req.steps_done,
        "step_times": timings,
        "step": step,
        "error": req.error,
        "error_class": _error_class(req),
        "found_data": req.found_data,
        "identity": dict(identity) if isinstance(identity, dict) else None,
        "receipt_available": has_receipt,
    }


def _error_class(req: ErasureRequest) -> str | None:
    """The exception class of the request's last failure: a failed step records
    ``step: Class``; a verification or unknown producer its own message."""
    error = req.error
    if error is None:
        return None
    _, sep, name = error.rpartition(": ")
    if sep and name.isidentifier():
        return name
    return "ProducerUnknown" if req.doc.get("review") == "producer" else "VerificationFailed"
