"""Legal holds: place, release, list (operators; auditors list). A held subject's
erasure waits in ``legal_hold`` until its hold is released."""

from __future__ import annotations

from typing import Any

from keyshred.api.common import subject_of
from keyshred.api.models import HoldCreate, HoldList, HoldQuery, HoldView
from keyshred.api.operations import Call, Operation, Reply
from keyshred.erasure import Hold

__all__ = ["OPERATIONS"]

BASE = "/v1/holds"


def hold_view(hold: Hold) -> dict[str, Any]:
    return {
        "hold_id": hold.hold_id,
        "subject_ref": hold.subject_ref,
        "scope": hold.scope,
        "reason": hold.reason,
        "owner": hold.owner,
        "placed_at": hold.placed_at.isoformat(),
        "released_at": None if hold.released_at is None else hold.released_at.isoformat(),
    }


def place(call: Call) -> Reply:
    body: HoldCreate = call.body
    hold = call.ks.erasure.place_hold(
        subject_of(call), reason=body.reason, owner=call.principal.actor, scope=body.scope
    )
    headers = {"Location": f"{BASE}/{hold.hold_id}"}
    return Reply(201, hold_view(hold), headers, request_id=hold.hold_id)


def release(call: Call) -> Reply:
    hold_id = call.params["hold_id"]
    call.ks.erasure.release_hold(hold_id)
    return Reply(204, request_id=hold_id)


def search(call: Call) -> Reply:
    body: HoldQuery = call.body
    holds = call.ks.erasure.holds(subject_of(call), scope=body.scope)
    return Reply(200, {"holds": [hold_view(h) for h in holds]})


OPERATIONS = (
    Operation(
        "POST",
        BASE,
        "hold.place",
        "Place a legal hold on a subject (or one scope)",
        frozenset({"operator"}),
        place,
        status=201,
        body=HoldCreate,
        response=HoldView,
        errors=(422,),
        tag="holds",
    ),
    Operation(
        "POST",
        BASE + "/search",
        "hold.list",
        "The active holds covering a subject (named in the body)",
        frozenset({"operator", "auditor"}),
        search,
        body=HoldQuery,
        response=HoldList,
        errors=(422,),
        tag="holds",
    ),
    Operation(
        "POST",
        BASE + "/{hold_id}/release",
        "hold.release",
        "Release a hold; the requests it held go back to the workers",
        frozenset({"operator"}),
        release,
        status=204,
        errors=(404,),
        tag="holds",
    ),
)
