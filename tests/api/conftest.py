"""The real API server for the tests: ``keyshred serve`` in a subprocess on a loopback
port, over a data folder on the embedded profile (one per session), with API keys
for every role and an OIDC identity provider whose JWKS is a file of a fresh Ed25519
key. Its stdout and stderr (uvicorn's access log included) go to files the log
scan reads."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from joserfc import jwt
from joserfc.jwk import OKPKey

from keyshred import Config, Keyshred
from keyshred.config import ScopeSettings, StorageSettings
from tests import zygote

ROLES = ("operator", "auditor", "requester")
ISSUER = "https://idp.test"
AUDIENCE = "keyshred-tests"
# Subjects and values whose ids and text must never appear in a URL, a log line or
# an audit event (tests/api/test_zz_log_scan.py looks for each).
PROBE_SUBJECTS = (
    "probe-subject-anna-7kq2@example.com",
    "probe-subject-bert-m41x@example.com",
    "probe-subject-cleo-9zt5@example.com",
    "probe-subject-dirk-3vw8@example.com",
)
PROBE_VALUES = ("probe-value-zebra-quartz-8817", "probe-value-violet-anchor-2290")


@dataclass
class ApiServer:
    url: str
    data: Path
    stdout: Path
    stderr: Path
    tokens: dict[str, str]
    process: subprocess.Popen[bytes]
    oidc_key: OKPKey
    subjects: list[str] = field(default_factory=list)

    def client(self, role: str | None = None, token: str | None = None) -> httpx.Client:
        headers = {}
        bearer = token if token is not None else (self.tokens[role] if role else None)
        if bearer is not None:
            headers["Authorization"] = f"Bearer {bearer}"
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def jwt(
        self, role: str | list[str], *, sub: str = "person-1", verified: bool = True, **claims: Any
    ) -> str:
        now = int(time.time())
        payload = {
            "iss": ISSUER,
            "aud": AUDIENCE,
            "sub": sub,
            "iat": now,
            "exp": now + 300,
            "keyshred_roles": role if isinstance(role, list) else [role],
            "identity_verified": verified,
            **claims,
        }
        header = {"alg": "EdDSA", "kid": self.oidc_key.kid}
        return jwt.encode(header, payload, self.oidc_key, algorithms=["EdDSA"])

    def logs(self) -> str:
        return self.stdout.read_text(errors="replace") + self.stderr.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def seed(data: Path, catalog_url: str | None = None) -> list[str]:
    """A data folder with memories of the probe subjects; returns the subjects."""
    config = Config(
        scopes={"marketing/email": ScopeSettings(purpose="marketing", categories=["email"])},
        storage=StorageSettings(catalog_url=catalog_url),
    )
    with Keyshred.init(data, config) as ks:
        for i, subject in enumerate(PROBE_SUBJECTS):
            ks.memories.put(subject, ("notes",), "fact", {"text": PROBE_VALUES[i % 2]})
    return list(PROBE_SUBJECTS)


def write_settings(folder: Path) -> tuple[dict[str, str], OKPKey]:
    tokens = {role: secrets.token_urlsafe(24) for role in ROLES}
    tokens["requester-unverified"] = secrets.token_urlsafe(24)
    tokens["requester-2"] = secrets.token_urlsafe(24)
    key = OKPKey.generate_key("Ed25519", parameters={"use": "sig"})
    key.ensure_kid()
    jwks = folder / "idp-jwks.json"
    jwks.write_text(json.dumps({"keys": [key.as_dict(private=False)]}))
    lines = []
    for name, token in tokens.items():
        role = name.split("-")[0]
        verified = "false" if name == "requester-unverified" else "true"
        lines += [
            "[[api_keys]]",
            f'name = "{name}"',
            f'sha256 = "{hashlib.sha256(token.encode()).hexdigest()}"',
            f'role = "{role}"',
            f"verified = {verified}",
            "",
        ]
    lines += [
        "[rate_limit]",
        "per_second = 200.0",
        "burst = 400",
        "",
        "[oidc]",
        f'issuer = "{ISSUER}"',
        f'audience = "{AUDIENCE}"',
        f'jwks_file = "{jwks}"',
    ]
    (folder / "api.toml").write_text("\n".join(lines) + "\n")
    return tokens, key


def start_server(
    folder: Path, data: Path, *, settings: Path | None = None, workers: int = 1
) -> tuple[subprocess.Popen[bytes], str, Path, Path]:
    port = free_port()
    stdout, stderr = folder / "server.out", folder / "server.err"
    command = [
        sys.executable,
        "-m",
        "keyshred.cli",
        "serve",
        "--path",
        str(data),
        "--port",
        str(port),
    ]
    if settings is not None:
        command += ["--api-config", str(settings)]
    if workers > 1:
        command += ["--workers", str(workers)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYSHRED_")}
    with stdout.open("wb") as out, stderr.open("wb") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {stderr.read_text()[-2000:]}")
        try:
            # Ready, not only up: with several workers each opens the store first.
            if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                return process, url, stdout, stderr
        except httpx.TransportError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("the server did not start within 60 s")


def stop_server(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def run_worker(data: Path) -> None:
    """A worker process that runs the jobs due now, then exits."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYSHRED_")}
    zygote.run(
        [sys.executable, "-m", "keyshred.cli", "worker", "--once", "--path", str(data)],
        check=True,
        env=env,
        capture_output=True,
        timeout=120,
    )


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    folder = tmp_path_factory.mktemp("api")
    data = folder / "data"
    subjects = seed(data)
    tokens, key = write_settings(folder)
    process, url, out, err = start_server(folder, data, settings=folder / "api.toml")
    try:
        yield ApiServer(url, data, out, err, tokens, process, key, subjects)
    finally:
        stop_server(process)
