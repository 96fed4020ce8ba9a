"""``/readyz`` while a dependency is down: the KEK provider (OpenBao Transit) and the
object store (moto's S3), each reached by the server through a TCP proxy the test
cuts (every connection dropped, new ones refused, as a network partition or a
restarting server looks). Each outage is a 503 that names the component that is
down, and only it, by an error class (never a URL, a bucket, a token or a message);
once the proxy forwards again the same server process answers 200, with no restart.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import boto3
import httpx
import pytest

from keyshred import Config, Keyshred
from tests.api.conftest import start_server, stop_server, write_settings
from tests.servers import Server
from tests.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.vault, pytest.mark.aws]

COMPONENTS = ("catalog", "kek", "objects")


@dataclass
class Deployment:
    url: str
    kek: TcpProxy
    s3: TcpProxy
    secrets: list[str]  # what no readiness answer may hold


@pytest.fixture(scope="module")
def deployment(
    openbao: Server, moto: Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    folder = tmp_path_factory.mktemp("readyz")
    bucket = f"ks-readyz-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=moto.url, region_name="us-east-1").create_bucket(Bucket=bucket)
    bao_port = int(openbao.url.rsplit(":", 1)[1])
    moto_port = int(moto.url.rsplit(":", 1)[1])
    with (
        TcpProxy("127.0.0.1", bao_port) as kek,
        TcpProxy("127.0.0.1", moto_port) as s3,
        pytest.MonkeyPatch.context() as env,
    ):
        env.setenv("VAULT_TOKEN", openbao.token)  # the server process inherits it
        transit_key = f"ks-readyz-{uuid.uuid4().hex[:8]}"
        config = Config.model_validate(
            {
                "kek": {
                    "provider": "vault",
                    "vault": {
                        "url": f"http://127.0.0.1:{kek.port}",
                        "key": transit_key,
                        "timeout_seconds": 2,
                    },
                },
                # Small numbers: an outage is seen within a second or two, and the
                # circuit lets a trial call through soon after the service is back.
                "keyring": {
                    "kek_retries": 1,
                    "kek_retry_max_seconds": 0.5,
                    "kek_circuit_failures": 2,
                    "kek_circuit_reset_seconds": 0.5,
                },
                "storage": {"uri": f"s3://{bucket}/parts"},
                "vectors": {"uri": f"s3://{bucket}/vectors"},
                "s3": {"endpoint_url": f"http://127.0.0.1:{s3.port}", "region": "us-east-1"},
            }
        )
        data = folder / "data"
        Keyshred.init(data, config).close()
        write_settings(folder)
        process, url, _, _ = start_server(folder, data, settings=folder / "api.toml")
        try:
            hidden = [
                openbao.token,
                bucket,
                transit_key,
                str(kek.port),
                str(s3.port),
                "testing",  # the AWS credentials moto is given
            ]
            yield Deployment(url, kek, s3, hidden)
        finally:
            stop_server(process)


def _ready(d: Deployment) -> httpx.Response:
    return httpx.get(d.url + "/readyz", timeout=60)


def _until_ready(d: Deployment, timeout: float = 60.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        answer = _ready(d)
        if answer.status_code == 200 or time.monotonic() > deadline:
            return answer
        time.sleep(0.2)


def _check_down(d: Deployment, answer: httpx.Response, down: set[str]) -> None:
    assert answer.status_code == 503
    body = answer.json()
    assert body["status"] == "unavailable"
    components = body["components"]
    assert set(components) == set(COMPONENTS)
    for name in COMPONENTS:
        if name in down:
            # An error class: an identifier, nothing of the error's message.
            assert components[name] != "ok" and re.fullmatch(r"[A-Za-z_]\w*", components[name])
        else:
            assert components[name] == "ok", name
    for secret in d.secrets:
        assert secret not in answer.text
    assert "http" not in answer.text and "127.0.0.1" not in answer.text


def test_ready_with_every_dependency_up(deployment: Deployment) -> None:
    answer = _ready(deployment)
    assert answer.status_code == 200
    assert answer.json() == {"status": "ok", "components": dict.fromkeys(COMPONENTS, "ok")}


def test_a_kek_outage_is_a_503_naming_the_kek_then_200_when_it_is_back(
    deployment: Deployment,
) -> None:
    deployment.kek.cut()
    try:
        _check_down(deployment, _ready(deployment), {"kek"})
        # Still down on the next probe (the circuit open: it fails fast, still named).
        _check_down(deployment, _ready(deployment), {"kek"})
    finally:
        deployment.kek.restore()
    assert _until_ready(deployment).status_code == 200


def test_an_object_store_outage_is_a_503_naming_the_objects_then_200_when_it_is_back(
    deployment: Deployment,
) -> None:
    deployment.s3.cut()
    try:
        _check_down(deployment, _ready(deployment), {"objects"})
    finally:
        deployment.s3.restore()
    assert _until_ready(deployment).status_code == 200


def test_both_down_are_both_named(deployment: Deployment) -> None:
    deployment.kek.cut()
    deployment.s3.cut()
    try:
        _check_down(deployment, _ready(deployment), {"kek", "objects"})
    finally:
        deployment.kek.restore()
        deployment.s3.restore()
    assert _until_ready(deployment).status_code == 200
