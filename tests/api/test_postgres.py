"""The shared profile: two uvicorn worker processes over a PostgreSQL catalog (the
machine's server, a fresh schema, reached through a TCP proxy the test can cut).
Idempotency holds across the processes, a worker completes what the API recorded,
and a catalog outage is a 503 naming the component, never a 500."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from joserfc import jws
from joserfc.jwk import KeySet

from tests.api.conftest import run_worker, seed, start_server, stop_server, write_settings
from tests.tcp_proxy import TcpProxy

pytestmark = pytest.mark.postgres


@pytest.fixture
def proxy() -> Iterator[TcpProxy]:
    with TcpProxy("127.0.0.1", 5432) as p:
        yield p


@pytest.mark.parametrize("catalog_url", ["postgres"], indirect=True)
def test_two_workers_on_postgres(catalog_url: str, proxy: TcpProxy, tmp_path: Path) -> None:
    url = catalog_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    data = tmp_path / "data"
    subjects = seed(data, url)
    tokens, _ = write_settings(tmp_path)
    process, base, _, _ = start_server(tmp_path, data, settings=tmp_path / "api.toml", workers=2)
    try:
        auth = {"Authorization": f"Bearer {tokens['operator']}"}
        with httpx.Client(base_url=base, headers=auth, timeout=30) as op:
            key = {"Idempotency-Key": uuid.uuid4().hex}
            body = {"subject": subjects[0], "reason": "gdpr-art17"}
            # New connections: the calls spread over both worker processes.
            answers = [
                httpx.post(base + "/v1/erasure-requests", json=body, headers={**auth, **key})
                for _ in range(4)
            ]
            assert {a.status_code for a in answers} == {202}
            assert len({a.json()["request_id"] for a in answers}) == 1
            other = httpx.post(
                base + "/v1/erasure-requests",
                json={**body, "reason": "other"},
                headers={**auth, **key},
            )
            assert other.status_code == 409
            rid = answers[0].json()["request_id"]
            assert op.get(f"/v1/erasure-requests/{rid}").json()["state"] == "requested"

            run_worker(data)

            assert op.get(f"/v1/erasure-requests/{rid}").json()["state"] == "completed"
            token = op.get(f"/v1/erasure-requests/{rid}/receipt").json()["jws"]
            keys = KeySet.import_key_set(op.get("/v1/jwks").json())
            assert jws.deserialize_compact(token, keys, algorithms=["EdDSA"]).payload

            proxy.cut()
            down = httpx.get(base + "/readyz", timeout=30)
            assert down.status_code == 503
            assert down.json()["components"]["catalog"] != "ok"
            assert down.json()["components"]["kek"] == "ok"
            failed = op.get(f"/v1/erasure-requests/{rid}")
            assert failed.status_code == 503
            assert failed.headers["content-type"] == "application/problem+json"
            proxy.restore()
            for _ in range(100):
                if httpx.get(base + "/readyz", timeout=30).status_code == 200:
                    break
                time.sleep(0.1)
            assert op.get(f"/v1/erasure-requests/{rid}").status_code == 200
    finally:
        stop_server(process)
