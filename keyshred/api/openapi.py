"""The OpenAPI 3.1 document, built from the operations (``keyshred.api.operations``)
and the pydantic models' JSON Schemas (2020-12, which OpenAPI 3.1 uses as is).

Served at ``/openapi.json`` and committed as ``docs/openapi.json`` (a test keeps
the two equal: regenerate with ``python -m keyshred.api.openapi > docs/openapi.json``).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel

from keyshred.api.models import HealthView
from keyshred.api.operations import Operation
from keyshred.api.problems import PROBLEM_JSON

__all__ = ["PUBLIC_PATHS", "openapi_document"]

_REF = "#/components/schemas/{model}"
_PARAM = re.compile(r"\{([a-z_]+)\}")
_STATUS_TEXT = {
    200: "OK",
    201: "Created",
    202: "Accepted: recorded, a worker runs it",
    204: "No Content",
    400: "Malformed request",
    401: "No valid Bearer token",
    403: "The caller's role (or identity verification) does not allow it",
    404: "Not found",
    409: "Conflict (an Idempotency-Key reused with another body, a suppressed subject)",
    410: "Gone (downloaded already, or expired)",
    413: "Too large",
    422: "The body or a parameter is not valid",
    429: "Rate limited (see Retry-After)",
    503: "A backend is unavailable",
}
PUBLIC_PATHS = ("/healthz", "/readyz", "/openapi.json", "/v1/jwks")


def _schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template=_REF)
    for name, sub in schema.pop("$defs", {}).items():
        components[name] = sub
    components[model.__name__] = schema
    return {"$ref": _REF.format(model=model.__name__)}


def _problem(status: int) -> dict[str, Any]:
    return {
        "description": _STATUS_TEXT.get(status, "Error"),
        "content": {PROBLEM_JSON: {"schema": {"$ref": _REF.format(model="Problem")}}},
    }


def _operation(op: Operation, components: dict[str, Any]) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "operationId": op.name,
        "summary": op.summary,
        "tags": [op.tag],
        "description": "Roles: " + ", ".join(sorted(op.roles)) + ".",
        "security": [{"bearer": []}],
    }
    params: list[dict[str, Any]] = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in _PARAM.findall(op.path)
    ]
    for name, text in op.query:
        schema: dict[str, Any] = {"type": "string"}
        if name == "state":
            schema = {"type": "array", "items": {"type": "string"}}
        params.append(
            {"name": name, "in": "query", "required": False, "description": text, "schema": schema}
        )
    if op.method == "POST":
        params.append(
            {
                "name": "Idempotency-Key",
                "in": "header",
                "required": False,
                "description": "A retry with the same key and body gets the first answer; "
                "the same key with another body is a 409.",
                "schema": {"type": "string", "pattern": "^[A-Za-z0-9._:+/=-]{1,128}$"},
            }
        )
    if params:
        doc["parameters"] = params
    if op.body is not None:
        doc["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _schema(op.body, components)}},
        }
    ok: dict[str, Any] = {"description": _STATUS_TEXT.get(op.status, "OK")}
    if op.response is not None:
        ok["content"] = {"application/json": {"schema": _schema(op.response, components)}}
    elif op.media_type != "application/json":
        ok["content"] = {op.media_type: {"schema": {"type": "string", "format": "binary"}}}
    if op.status in (201, 202):
        ok["headers"] = {"Location": {"schema": {"type": "string"}}}
    responses: dict[str, Any] = {str(op.status): ok}
    # What the app answers for every operation of its kind, whatever the handler does:
    # a POST's Idempotency-Key reused with another body (or still running) is a 409;
    # a body over max_body_bytes is a 413.
    common = {400, 401, 403, 429, 503}
    if op.method == "POST":
        common.add(409)
    if op.body is not None:
        common.add(413)
    for status in sorted(common | set(op.errors)):
        responses[str(status)] = _problem(status)
    doc["responses"] = responses
    return doc


def _public(components: dict[str, Any]) -> dict[str, Any]:
    health = {"$ref": _REF.format(model="HealthView")}
    _schema(HealthView, components)
    return {
        "/healthz": {
            "get": {
                "operationId": "healthz",
                "summary": "The process answers",
                "tags": ["health"],
                "security": [],
                "responses": {
                    "200": {
                        "description": "OK",
                        "content": {"application/json": {"schema": health}},
                    }
                },
            }
        },
        "/readyz": {
            "get": {
                "operationId": "readyz",
                "summary": "Catalog, KEK provider and object store reachable",
                "tags": ["health"],
                "security": [],
                "responses": {
                    "200": {
                        "description": "Ready",
                        "content": {"application/json": {"schema": health}},
                    },
                    "503": {
                        "description": "A component is unreachable (named, with its error class)",
                        "content": {"application/json": {"schema": health}},
                    },
                },
            }
        },
        "/openapi.json": {
            "get": {
                "operationId": "openapi",
                "summary": "This document",
                "tags": ["health"],
                "security": [],
                "responses": {
                    "200": {
                        "description": "OK",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    }
                },
            }
        },
        "/v1/jwks": {
            "get": {
                "operationId": "jwks",
                "summary": "The receipt signing keys (JWK Set, RFC 7517)",
                "tags": ["receipts"],
                "security": [],
                "responses": {
                    "200": {
                        "description": "OK",
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "properties": {
                                        "keys": {"type": "array", "items": {"type": "object"}}
                                    },
                                    "required": ["keys"],
                                }
                            }
                        },
                    }
                },
            }
        },
    }


def openapi_document(operations: Iterable[Operation], version: str) -> dict[str, Any]:
    components: dict[str, Any] = {
        "Problem": {
            "type": "object",
            "description": "RFC 9457 problem details",
            "properties": {
                "type": {"type": "string"},
                "title": {"type": "string"},
                "status": {"type": "integer"},
                "detail": {"type": "string"},
                "instance": {"type": "string"},
                "errors": {"type": "array", "items": {"type": "object"}},
            },
            "required": ["type", "title", "status"],
        }
    }
    paths: dict[str, Any] = _public(components)
    for op in operations:
        paths.setdefault(op.path, {})[op.method.lower()] = _operation(op, components)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "keyshred key-destruction API",
            "version": version,
            "description": "Erasure, access and consent requests with verifiable "
            "receipts. Subjects travel only in request bodies; responses name them "
            "by subject_ref.",
        },
        "paths": dict(sorted(paths.items())),
        "components": {
            "schemas": dict(sorted(components.items())),
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "A static API key or an OIDC JWT",
                }
            },
        },
    }


def main() -> None:
    """Print the document (what ``docs/openapi.json`` holds)."""
    from keyshred.api.app import OPERATIONS, VERSION

    sys.stdout.write(json.dumps(openapi_document(OPERATIONS, VERSION), indent=2) + "\n")


if __name__ == "__main__":
    main()
