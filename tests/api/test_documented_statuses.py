"""Regression tests for what schemathesis (``test_schemathesis.py``) found: answers
the app gives for every operation of a kind, whatever its handler does, must be in
the OpenAPI document for each such operation (a client generated from it would
treat an undocumented status as a protocol error)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from keyshred.api.app import OPERATIONS
from tests.api.conftest import ApiServer

DOC = Path(__file__).parents[2] / "docs" / "openapi.json"


def _documented(path: str, method: str) -> set[str]:
    doc = json.loads(DOC.read_text())
    return set(doc["paths"][path][method]["responses"])


def test_an_idempotency_key_reused_is_a_documented_409_on_every_post(server: ApiServer) -> None:
    # Found on POST /v1/holds, /v1/holds/search and /v1/holds/{id}/release: the key is
    # honoured on every POST, but only some documented its 409.
    key = {"Idempotency-Key": uuid.uuid4().hex}
    with server.client("operator") as op:
        first = op.post("/v1/holds/search", json={"subject": "nobody-1"}, headers=key)
        again = op.post("/v1/holds/search", json={"subject": "nobody-2"}, headers=key)
    assert first.status_code == 200
    assert again.status_code == 409
    assert again.headers["content-type"] == "application/problem+json"
    for op_ in OPERATIONS:
        if op_.method == "POST":
            assert "409" in _documented(op_.path, "post"), op_.name


def test_a_body_over_the_limit_is_a_documented_413_on_every_operation_with_a_body(
    server: ApiServer,
) -> None:
    with server.client("operator") as op:
        big = op.post("/v1/holds/search", json={"subject": "x" * (65 * 1024)})
    assert big.status_code == 413
    for op_ in OPERATIONS:
        if op_.body is not None:
            assert "413" in _documented(op_.path, op_.method.lower()), op_.name
