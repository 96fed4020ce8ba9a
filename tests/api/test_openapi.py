"""The OpenAPI 3.1 document: the committed ``docs/openapi.json`` is what the server
serves, it names every route the server answers, and no subject travels in a URL."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from keyshred.api.app import OPERATIONS
from tests.api.conftest import ApiServer

DOC = Path(__file__).parents[2] / "docs" / "openapi.json"


def test_the_committed_document_is_the_served_one(server: ApiServer) -> None:
    served = httpx.get(server.url + "/openapi.json")
    assert served.status_code == 200
    committed = json.loads(DOC.read_text())
    assert served.json() == committed, (
        "docs/openapi.json is stale: python -m keyshred.api.openapi > docs/openapi.json"
    )
    assert committed["openapi"].startswith("3.1")


def test_every_operation_is_documented_with_its_roles_and_errors() -> None:
    doc = json.loads(DOC.read_text())
    for op in OPERATIONS:
        entry = doc["paths"][op.path][op.method.lower()]
        assert entry["operationId"] == op.name
        for role in op.roles:
            assert role in entry["description"]
        assert {"401", "403", str(op.status)} <= set(entry["responses"])
    for path in ("/healthz", "/readyz", "/v1/jwks", "/v1/erasure-requests/{request_id}/receipt"):
        assert path in doc["paths"]
    for name, schema in doc["components"]["schemas"].items():
        assert "$defs" not in schema, name


def test_no_subject_travels_in_a_path_or_query() -> None:
    doc = json.loads(DOC.read_text())
    for path, methods in doc["paths"].items():
        assert "subject" not in path
        for entry in methods.values():
            for param in entry.get("parameters", []):
                if param["in"] in ("path", "query"):
                    assert "subject" not in param["name"] and "tenant" not in param["name"]
    bodies = [
        entry["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        for methods in doc["paths"].values()
        for entry in methods.values()
        if "requestBody" in entry
    ]
    schemas = doc["components"]["schemas"]
    with_subject = [
        ref for ref in bodies if "subject" in schemas[ref.rsplit("/", 1)[1]]["properties"]
    ]
    assert len(with_subject) == 6  # erasure, hold, hold search, consent x2, access


def test_health_and_readiness(server: ApiServer) -> None:
    health = httpx.get(server.url + "/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    ready = httpx.get(server.url + "/readyz")
    assert ready.status_code == 200
    assert ready.json() == {
        "status": "ok",
        "components": {"catalog": "ok", "kek": "ok", "objects": "ok"},
    }
    unknown = httpx.get(server.url + "/v1/nothing-here")
    assert unknown.status_code == 404
    assert unknown.headers["content-type"] == "application/problem+json"
