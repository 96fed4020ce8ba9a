"""Erasure requests over HTTP against the real server: recorded while no worker
runs (202, Location), completed once a worker runs, the receipt verified with
joserfc (a JOSE library keyshred does not use) against the served JWKS."""

from __future__ import annotations

import json

from joserfc import jws
from joserfc.jwk import KeySet

from keyshred.api.models import ErasureRequestView, ReceiptView
from keyshred.receipts import verify_receipt_text
from tests.api.conftest import ApiServer, run_worker


def test_a_request_recorded_without_workers_completes_when_one_runs(server: ApiServer) -> None:
    subject = server.subjects[0]
    with server.client("operator") as op:
        created = op.post("/v1/erasure-requests", json={"subject": subject, "reason": "gdpr-art17"})
        assert created.status_code == 202, created.text
        view = created.json()
        rid = view["request_id"]
        assert created.headers["location"] == f"/v1/erasure-requests/{rid}"
        assert view["state"] == "requested"
        assert view["requested_by"] == "key:operator"
        assert view["identity"] == {
            "decision": "allowed",
            "method": "operator-attested",
            "detail": "none",
            "decided_for": "key:operator",
        }
        assert subject not in created.text
        # No worker runs: the request waits, and its receipt is not there yet.
        again = op.get(created.headers["location"])
        assert again.status_code == 200
        assert again.json()["state"] == "requested"
        assert again.json()["step"] == "suppress"
        missing = op.get(f"/v1/erasure-requests/{rid}/receipt")
        assert missing.status_code == 404
        assert missing.headers["content-type"] == "application/problem+json"

        run_worker(server.data)

        done = op.get(f"/v1/erasure-requests/{rid}").json()
        assert done["state"] == "completed", done
        # The answers are what the OpenAPI document says they are.
        ErasureRequestView.model_validate(view)
        ErasureRequestView.model_validate(done)
        assert done["found_data"] is True
        assert "receipt" in done["steps_done"]
        assert set(done["step_times"]) >= {"suppress", "destroy_keys", "receipt"}
        assert done["receipt_available"] is True
        receipt = op.get(f"/v1/erasure-requests/{rid}/receipt")
        assert receipt.status_code == 200
        body = receipt.json()
        ReceiptView.model_validate(body)
        jwks = op.get("/v1/jwks").json()

    # joserfc verifies the JWS against the published keys, and its payload is the
    # receipt the API states, identity decision included.
    token = body["jws"]
    assert body["form"] == "jws"
    verified = jws.deserialize_compact(token, KeySet.import_key_set(jwks), algorithms=["EdDSA"])
    payload = json.loads(verified.payload)
    assert payload == body["receipt"]
    assert payload["request_id"] == rid
    assert payload["subject_ref"] == done["subject_ref"]
    assert payload["identity"]["method"] == "operator-attested"
    assert subject not in token and subject not in json.dumps(payload)
    # keyshred's own verifier agrees.
    assert verify_receipt_text(token, jwks).request_id == rid


def test_a_tampered_receipt_fails_joserfc_verification(server: ApiServer) -> None:
    subject = server.subjects[1]
    with server.client("operator") as op:
        rid = op.post(
            "/v1/erasure-requests", json={"subject": subject, "reason": "gdpr-art17"}
        ).json()["request_id"]
        run_worker(server.data)
        token = op.get(f"/v1/erasure-requests/{rid}/receipt").json()["jws"]
        keys = KeySet.import_key_set(op.get("/v1/jwks").json())
    head, payload, signature = token.split(".")
    flipped = payload[:-2] + ("A" if payload[-2] != "A" else "B") + payload[-1]
    try:
        jws.deserialize_compact(f"{head}.{flipped}.{signature}", keys, algorithms=["EdDSA"])
    except Exception as exc:  # noqa: BLE001 - joserfc's BadSignatureError (or a decode error)
        assert "signature" in type(exc).__name__.lower() or "decode" in str(exc).lower()
    else:
        raise AssertionError("an altered receipt verified")


def test_listing_by_state_for_operators(server: ApiServer) -> None:
    with server.client("operator") as op:
        rid = op.post(
            "/v1/erasure-requests",
            json={"subject": "list-only-subject-q1", "reason": "gdpr-art17"},
        ).json()["request_id"]
        waiting = op.get("/v1/erasure-requests", params={"state": "requested"})
        assert waiting.status_code == 200
        assert rid in [r["request_id"] for r in waiting.json()["requests"]]
        assert all(r["state"] == "requested" for r in waiting.json()["requests"])
        completed = op.get("/v1/erasure-requests", params=[("state", "completed")]).json()
        assert rid not in [r["request_id"] for r in completed["requests"]]
        scoped = op.post(
            "/v1/erasure-requests",
            json={"subject": "scope-only-subject", "reason": "r", "scope": "marketing/email"},
        )
        assert scoped.status_code == 202 and scoped.json()["scope"] == "marketing/email"
        bad = op.get("/v1/erasure-requests", params={"state": "finished"})
        assert bad.status_code == 422
        assert bad.headers["content-type"] == "application/problem+json"


def test_bad_input_is_a_problem_never_a_500(server: ApiServer) -> None:
    with server.client("operator") as op:
        cases = [
            op.post("/v1/erasure-requests", content=b"{not json"),
            op.post("/v1/erasure-requests", json={"reason": "x"}),
            op.post("/v1/erasure-requests", json={"subject": "s", "reason": "no\nnewlines"}),
            op.post("/v1/erasure-requests", json={"subject": "s", "reason": "r", "extra": 1}),
            op.post("/v1/erasure-requests", json={"subject": "s", "reason": "r", "scope": "nope"}),
            op.post("/v1/erasure-requests", json=["a list"]),
            op.post("/v1/erasure-requests", json={"subject": "", "reason": "r"}),
            op.get("/v1/erasure-requests/no-such-request"),
            op.get("/v1/erasure-requests/bad%20id%20with%20spaces"),
            op.get("/v1/erasure-requests/no-such-request/receipt"),
            op.post("/v1/erasure-requests", content=b"[" * 60_000),
            op.post("/v1/erasure-requests", content=b'{"subject": "' + b"x" * 70_000 + b'"}'),
            op.post(
                "/v1/erasure-requests",
                content=b'{"subject": "lone \ud800 surrogate", "reason": "r"}',
            ),
            op.post("/v1/erasure-requests", json={"subject": "s", "reason": "r", "block": "x"}),
            op.post("/v1/erasure-requests", content=b'{"subject": "s", "reason": "\u0000"}'),
            op.post("/v1/erasure-requests", json={"subject": "s", "reason": "r", "scope": "~x"}),
        ]
    statuses = [r.status_code for r in cases]
    expected = [400, 422, 422, 422, 422, 422, 422, 404, 404, 404]
    expected += [400, 413, 422, 422, 422, 422]
    assert statuses == expected
    for r in cases:
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json()["status"] == r.status_code
