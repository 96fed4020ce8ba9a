"""Erasure requests: create (202, recorded for the workers), read, list, receipt.

The API records requests (``ks.erasure.submit``) and reports them; workers run
them (``keyshred worker``, ``ks.jobs.run_pending()``).
"""

from __future__ import annotations

import json

from keyshred.api.common import check_owner, request_view, subject_of, verify_identity
from keyshred.api.models import (
    ErasureRequestCreate,
    ErasureRequestList,
    ErasureRequestView,
    ReceiptView,
)
from keyshred.api.operations import Call, Operation, Reply
from keyshred.api.problems import Problem
from keyshred.erasure.requests import REQUEST_STATES
from keyshred.errors import NotFound

__all__ = ["OPERATIONS", "request_reply"]

BASE = "/v1/erasure-requests"


def request_reply(call: Call, request_id: str, status: int = 200) -> Reply:
    """The request's view; with its ``Location`` for a 202."""
    ks = call.ks
    req = ks.erasure.status(request_id)
    body = request_view(req, ks.erasure.steps, ks.erasure.receipt(request_id) is not None)
    headers = {"Location": f"{BASE}/{request_id}"} if status == 202 else {}
    return Reply(status, body, headers, request_id=request_id)


def create(call: Call) -> Reply:
    body: ErasureRequestCreate = call.body
    subject = subject_of(call)
    identity = verify_identity(call, subject, "erasure.create")
    req = call.ks.erasure.submit(
        subject,
        body.scope,
        requested_by=call.principal.actor,
        reason=body.reason,
        block=body.block,
        identity=identity,
    )
    return request_reply(call, req.request_id, 202)


def get(call: Call) -> Reply:
    request_id = call.params["request_id"]
    req = call.ks.erasure.status(request_id)
    check_owner(call, req.requested_by)
    return request_reply(call, request_id)


def receipt(call: Call) -> Reply:
    request_id = call.params["request_id"]
    req = call.ks.erasure.status(request_id)
    check_owner(call, req.requested_by)
    issued = call.ks.erasure.receipt(request_id)
    if issued is None:
        raise NotFound(f"request {request_id} has no receipt yet (state {req.state})")
    body = {
        "request_id": request_id,
        "form": issued.form,
        "jws": issued.jws,
        # Exactly what was signed (the JWS payload), for the JSON form its fields.
        "receipt": json.loads(issued.payload()),
        "kid": issued.kid,
    }
    return Reply(200, body, request_id=request_id)


def list_requests(call: Call) -> Reply:
    states = call.query.get("state", [])
    unknown = sorted(set(states) - set(REQUEST_STATES))
    if unknown:
        raise Problem(
            422,
            "invalid-input",
            "Unknown state",
            "state is one of " + ", ".join(REQUEST_STATES),
        )
    ks = call.ks
    reqs = [r for r in ks.erasure.requests() if not states or r.state in states]
    views = [
        request_view(r, ks.erasure.steps, r.state == "completed" and "receipt" in r.steps_done)
        for r in reqs
    ]
    return Reply(200, {"requests": views})


OPERATIONS = (
    Operation(
        "POST",
        BASE,
        "erasure.create",
        "Record an erasure request (a worker runs it): 202 with its Location",
        frozenset({"requester", "operator"}),
        create,
        status=202,
        body=ErasureRequestCreate,
        response=ErasureRequestView,
        errors=(403, 409, 422),
    ),
    Operation(
        "GET",
        BASE,
        "erasure.list",
        "Erasure requests, oldest first (filter: state, repeated)",
        frozenset({"operator", "auditor"}),
        list_requests,
        response=ErasureRequestList,
        errors=(422,),
        query=(("state", "Only requests in this state (repeat for several)."),),
    ),
    Operation(
        "GET",
        BASE + "/{request_id}",
        "erasure.get",
        "An erasure request: state, steps done and when, the last error's class",
        frozenset({"requester", "operator", "auditor"}),
        get,
        response=ErasureRequestView,
        errors=(403, 404),
    ),
    Operation(
        "GET",
        BASE + "/{request_id}/receipt",
        "erasure.receipt",
        "The signed receipt as issued (compact JWS) and its payload; 404 until completed",
        frozenset({"requester", "operator", "auditor"}),
        receipt,
        response=ReceiptView,
        errors=(403, 404),
    ),
)
