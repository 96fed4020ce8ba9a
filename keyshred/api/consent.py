"""Consent: grant, and withdraw (a withdrawal revokes the consent at once and
records a scope erasure request for the workers: 202, as an erasure)."""

from __future__ import annotations

from keyshred.api.common import subject_of, verify_identity
from keyshred.api.erasure import request_reply
from keyshred.api.models import ConsentGrant, ConsentView, ConsentWithdraw, ErasureRequestView
from keyshred.api.operations import Call, Operation, Reply

__all__ = ["OPERATIONS"]


def grant(call: Call) -> Reply:
    body: ConsentGrant = call.body
    subject = subject_of(call)
    verify_identity(call, subject, "consent.grant")
    # An erased (or being erased) id takes no consent until it is re-admitted.
    call.ks.catalog.check_guard(call.ks.subject_ref(subject))
    record = call.ks.consent.grant(
        subject,
        scope=body.scope,
        category=body.category,
        actions=tuple(body.actions),
        end_at=body.end_at,
        policy_version=body.policy_version,
    )
    view = {
        "subject_ref": record.subject_ref,
        "purpose": record.purpose,
        "category": record.category,
        "actions": list(record.actions),
        "status": record.status,
        "policy_version": record.policy_version,
        "start_at": record.start_at.isoformat(),
        "end_at": None if record.end_at is None else record.end_at.isoformat(),
    }
    return Reply(201, view)


def withdraw(call: Call) -> Reply:
    body: ConsentWithdraw = call.body
    subject = subject_of(call)
    identity = verify_identity(call, subject, "consent.withdraw")
    req = call.ks.consent.submit_withdrawal(
        subject,
        body.scope,
        category=body.category,
        requested_by=call.principal.actor,
        identity=identity,
    )
    return request_reply(call, req.request_id, 202)


OPERATIONS = (
    Operation(
        "POST",
        "/v1/consents",
        "consent.grant",
        "Record consent for a scope's purpose and category",
        frozenset({"requester", "operator"}),
        grant,
        status=201,
        body=ConsentGrant,
        response=ConsentView,
        errors=(403, 409, 422),
        tag="consent",
    ),
    Operation(
        "POST",
        "/v1/consents/withdrawals",
        "consent.withdraw",
        "Withdraw consent: revoked now, the scope erased by a worker (202, Location)",
        frozenset({"requester", "operator"}),
        withdraw,
        status=202,
        body=ConsentWithdraw,
        response=ErasureRequestView,
        errors=(403, 409, 422),
        tag="consent",
    ),
)
