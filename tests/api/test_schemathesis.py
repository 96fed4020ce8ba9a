"""Schemathesis (property-based, from the served ``/openapi.json``) against the real
server process on the embedded profile: every operation, with an operator's token and
a requester's, valid and invalid inputs (bounded examples, a fixed seed so a failure
reproduces), and every answer checked: never a 5xx, a documented status, the
documented content type, a body that matches the documented schema.

The document is ``docs/openapi.json``, which the module's fixture first checks is
the JSON the server serves (so the run is against the served document;
``schemathesis.pytest.from_fixture``, which would fetch it at run time, fails on
pytest 9.2: it reads ``Function._nodeid``, which pytest 9.2 removed).

The server is this module's own (``keyshred serve`` over a fresh data folder, the
helpers of ``tests/api/conftest.py``): the ~2,000 requests, holds and consents
the fuzzer makes would otherwise become jobs for the session server's later tests.
Its output is scanned at the end as ``test_zz_log_scan.py`` scans the session's.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.api.conftest import (
    ApiServer,
    seed,
    start_server,
    stop_server,
    write_settings,
)

DOC = Path(__file__).parents[2] / "docs" / "openapi.json"
_KEY = re.compile(r"[A-Za-z0-9._:+/=-]{1,128}")
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
# Bounded: a few dozen fuzzed examples per operation, plus schemathesis's examples and
# coverage phases (boundary values of every constraint, positive and negative).
CONFIG = schemathesis.Config.from_dict(
    {
        "seed": 23,
        "generation": {"mode": "all", "max-examples": 25},
        "phases": {
            "examples": {"enabled": True},
            "coverage": {"enabled": True},
            "fuzzing": {"enabled": True},
            "stateful": {"enabled": False},
        },
    }
)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    folder = tmp_path_factory.mktemp("api-fuzz")
    data = folder / "data"
    subjects = seed(data)
    tokens, key = write_settings(folder)
    settings = folder / "api.toml"
    # The fuzzer calls as fast as it can: the rate limit is not what it tests.
    text = settings.read_text().replace("per_second = 200.0", "per_second = 100000.0")
    settings.write_text(text.replace("burst = 400", "burst = 100000"))
    process, url, out, err = start_server(folder, data, settings=settings)
    try:
        served = httpx.get(url + "/openapi.json", timeout=30).json()
        assert served == json.loads(DOC.read_text()), (
            "docs/openapi.json is stale: python -m keyshred.api.openapi > docs/openapi.json"
        )
        yield ApiServer(url, data, out, err, tokens, process, key, subjects)
    finally:
        stop_server(process)


schema = schemathesis.openapi.from_path(DOC, config=CONFIG)


def _bearer(server: ApiServer, role: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.tokens[role]}"}


@schema.parametrize()
def test_every_operation_as_an_operator(case: schemathesis.Case, fuzzed: ApiServer) -> None:
    # Generated cases reuse short keys ("0") with other bodies: each is a 409 (right,
    # and documented), which would keep most POSTs from their handlers. A valid key
    # is made unique here; the requester's run below keeps the generated ones.
    key = (case.headers or {}).get("Idempotency-Key")
    if isinstance(key, str) and _KEY.fullmatch(key):
        case.headers["Idempotency-Key"] = f"{key[:64]}.{uuid.uuid4().hex}"
    case.call_and_validate(
        base_url=fuzzed.url, headers=_bearer(fuzzed, "operator"), checks=CHECKS, timeout=30
    )


@schema.parametrize()
def test_every_operation_as_a_requester(case: schemathesis.Case, fuzzed: ApiServer) -> None:
    case.call_and_validate(
        base_url=fuzzed.url, headers=_bearer(fuzzed, "requester"), checks=CHECKS, timeout=30
    )


def test_the_fuzzed_server_logged_no_5xx_and_no_traceback(fuzzed: ApiServer) -> None:
    logs = fuzzed.logs()
    assert '"POST /v1/erasure-requests HTTP/1.1" 202' in logs  # the fuzzer got through
    assert not re.search(r'HTTP/1\.1" 5\d\d', logs), "a 5xx in the access log"
    assert "Traceback" not in logs
