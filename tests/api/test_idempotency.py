"""``Idempotency-Key`` against the real server: a retry gets the first answer (one
request recorded), another body with the same key is a 409, keys are per caller."""

from __future__ import annotations

import uuid

import sqlalchemy as sa

from keyshred.schema import api_idempotency
from tests.api.conftest import ApiServer

BODY = {"subject": "idem-subject-r2d2", "reason": "gdpr-art17"}


def test_a_retry_with_the_same_key_gets_the_first_answer(server: ApiServer) -> None:
    key = uuid.uuid4().hex
    with server.client("operator") as op:
        first = op.post("/v1/erasure-requests", json=BODY, headers={"Idempotency-Key": key})
        again = op.post("/v1/erasure-requests", json=BODY, headers={"Idempotency-Key": key})
        fresh = op.post(
            "/v1/erasure-requests", json=BODY, headers={"Idempotency-Key": uuid.uuid4().hex}
        )
        listed = op.get("/v1/erasure-requests").json()["requests"]
    assert first.status_code == again.status_code == 202
    assert again.json() == first.json()
    assert again.headers["location"] == first.headers["location"]
    assert again.headers["idempotent-replayed"] == "true"
    rid = first.json()["request_id"]
    assert fresh.json()["request_id"] != rid  # a new key is a new request
    assert [r["request_id"] for r in listed].count(rid) == 1


def test_the_same_key_with_another_body_is_409(server: ApiServer) -> None:
    key = uuid.uuid4().hex
    with server.client("operator") as op:
        first = op.post("/v1/erasure-requests", json=BODY, headers={"Idempotency-Key": key})
        other = op.post(
            "/v1/erasure-requests",
            json={**BODY, "reason": "another-reason"},
            headers={"Idempotency-Key": key},
        )
        same = op.post("/v1/erasure-requests", json=BODY, headers={"Idempotency-Key": key})
        bad = op.post("/v1/erasure-requests", json=BODY, headers={"Idempotency-Key": "no spaces"})
    assert first.status_code == 202
    assert other.status_code == 409
    assert other.headers["content-type"] == "application/problem+json"
    assert other.json()["type"].endswith("idempotency-key-reused")
    assert same.status_code == 202 and same.json() == first.json()
    assert bad.status_code == 400


def test_keys_are_per_caller_and_stored_as_a_keyed_hash(server: ApiServer) -> None:
    key = uuid.uuid4().hex
    with server.client("operator") as op:
        a = op.post("/v1/erasure-requests", json=BODY, headers={"Idempotency-Key": key})
    with server.client("requester") as rq:
        b = rq.post("/v1/erasure-requests", json=BODY, headers={"Idempotency-Key": key})
    assert a.status_code == b.status_code == 202
    assert a.json()["request_id"] != b.json()["request_id"]
    engine = sa.create_engine(f"sqlite:///{server.data / 'catalog' / 'catalog.db'}")
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.select(api_idempotency).where(api_idempotency.c.idem_key == key)
            ).all()
    finally:
        engine.dispose()
    assert sorted(r.actor for r in rows) == ["key:operator", "key:requester"]
    for row in rows:
        assert BODY["subject"] not in (row.response or "") + row.body_hash
        assert len(row.body_hash) == 26  # the HMAC reference form, not the body


def test_a_replayed_error_is_the_first_error(server: ApiServer) -> None:
    key = uuid.uuid4().hex
    body = {**BODY, "scope": "undeclared-scope"}
    with server.client("operator") as op:
        first = op.post("/v1/erasure-requests", json=body, headers={"Idempotency-Key": key})
        again = op.post("/v1/erasure-requests", json=body, headers={"Idempotency-Key": key})
    assert first.status_code == again.status_code == 422
    assert again.json() == first.json()


def test_racing_retries_record_one_request_and_never_fail(server: ApiServer) -> None:
    """Eight clients send the same key at once: each gets the first answer or a 409
    'still running', one request is recorded, none is a 500."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    key = {"Idempotency-Key": uuid.uuid4().hex}
    auth = {"Authorization": f"Bearer {server.tokens['operator']}"}

    def post(_: int) -> httpx.Response:
        return httpx.post(
            server.url + "/v1/erasure-requests", json=BODY, headers={**auth, **key}, timeout=30
        )

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(post, range(8)))
    assert {a.status_code for a in answers} <= {202, 409}
    accepted = {a.json()["request_id"] for a in answers if a.status_code == 202}
    assert len(accepted) == 1
    for a in answers:
        if a.status_code == 409:
            assert a.json()["type"].endswith("idempotency-key-in-use")
            assert a.headers["retry-after"] == "1"
    with server.client("operator") as op:
        again = op.post("/v1/erasure-requests", json=BODY, headers=key)
    assert again.status_code == 202 and again.json()["request_id"] in accepted
