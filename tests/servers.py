"""Real servers for the tests: the OpenBao dev server, an OpenBao server
with storage on disk
(``OpenBaoFileServer``: killed and restarted by the KEK outage tests) and moto's
standalone server.

Each starts as a subprocess on a free loopback port, is polled until it answers, and
is stopped at the end of the session. A server that cannot start fails the tests that
need it with the reason and the tail of its log; it never skips them.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _tool(name: str) -> str:
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name!r} is not installed; run 'make test' (it installs keyshred[dev])")
    return found


@dataclass(frozen=True)
class Server:
    url: str
    token: str
    log: Path


@contextmanager
def _process(
    argv: list[str], health_url: str, name: str, env: dict[str, str] | None = None
) -> Iterator[Path]:
    log = Path(tempfile.mkstemp(prefix=f"keyshred-{name}-", suffix=".log")[1])
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            argv,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"{name} exited with {proc.returncode} before answering; log:\n"
                    + log.read_text(errors="replace")[-2000:]
                )
            try:
                with urllib.request.urlopen(health_url, timeout=2):  # noqa: S310 - loopback
                    break
            except urllib.error.HTTPError:
                break  # it answers; the status is not our concern here
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"{name} did not answer on {health_url} within 60 s; log:\n"
                    + log.read_text(errors="replace")[-2000:]
                )
            time.sleep(0.1)
        yield log
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        log.unlink(missing_ok=True)


@contextmanager
def openbao_dev_server() -> Iterator[Server]:
    """``bao server -dev`` with a random root token and the transit engine mounted."""
    port = free_port()
    token = secrets.token_hex(16)
    url = f"http://127.0.0.1:{port}"
    argv = [
        _tool("bao"),
        "server",
        "-dev",
        f"-dev-root-token-id={token}",
        f"-dev-listen-address=127.0.0.1:{port}",
        "-dev-no-store-token",
    ]
    with _process(argv, f"{url}/v1/sys/health", "openbao", {"HOME": tempfile.gettempdir()}) as log:
        req = urllib.request.Request(  # noqa: S310 - loopback
            f"{url}/v1/sys/mounts/transit",
            data=b'{"type": "transit"}',
            headers={"X-Vault-Token": token, "Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=10):  # noqa: S310
            pass
        yield Server(url, token, log)


def s3_client(server: Server) -> Any:
    """A boto3 S3 client of moto's server (``moto_server``)."""
    import boto3

    return boto3.client("s3", endpoint_url=server.url, region_name="us-east-1")


def new_bucket(server: Server, *, versioned: bool = True) -> str:
    """A new bucket (``ks-`` and 12 hex digits) on moto's server, versioned unless
    ``versioned=False``; its name."""
    name = f"ks-{uuid.uuid4().hex[:12]}"
    s3 = s3_client(server)
    s3.create_bucket(Bucket=name)
    if versioned:
        s3.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    return name


@contextmanager
def moto_server() -> Iterator[Server]:
    """moto's standalone server (S3, KMS, ...) over HTTP on loopback."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [_tool("moto_server"), "-H", "127.0.0.1", "-p", str(port)]
    with _process(argv, f"{url}/moto-api/", "moto") as log:
        yield Server(url, "", log)


class OpenBaoFileServer:
    """A real (non-dev) OpenBao server with storage on disk: its keys survive a kill
    and a restart, as a production server's do (the dev server keeps them in
    memory). ``kill`` SIGKILLs it; ``start`` starts it again on the same port and
    storage and unseals it; the root token and transit keys are the same."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        cluster = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = ""
        self._unseal_key = ""
        self.log = folder / "openbao.log"
        self._proc: subprocess.Popen[bytes] | None = None
        (folder / "data").mkdir(parents=True, exist_ok=True)
        self._config = folder / "openbao.hcl"
        self._config.write_text(
            # OpenBao keeps only integrated storage (raft) on disk: one node here.
            f'storage "raft" {{\n  path = "{folder / "data"}"\n  node_id = "keyshred-test"\n}}\n'
            f'listener "tcp" {{\n  address = "127.0.0.1:{self.port}"\n  tls_disable = true\n'
            f'  cluster_address = "127.0.0.1:{cluster}"\n}}\n'
            f'api_addr = "{self.url}"\ncluster_addr = "http://127.0.0.1:{cluster}"\n'
            "ui = false\n"
        )

    def _api(self, method: str, path: str, body: dict[str, object] | None = None) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["X-Vault-Token"] = self.token
        req = urllib.request.Request(  # noqa: S310 - loopback
            f"{self.url}/v1/{path}",
            data=None if body is None else json.dumps(body).encode("utf-8"),
            headers=headers,
            method=method,
        )
        with urllib.request.urlopen(req, timeout=120) as resp:  # noqa: S310 - a loaded machine
            raw = resp.read()
        return json.loads(raw) if raw else {}

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start (or restart) the server, initialise it the first time, unseal it
        and, the first time, mount the transit engine."""
        assert not self.running
        with self.log.open("ab") as fh:
            self._proc = subprocess.Popen(
                [_tool("bao"), "server", f"-config={self._config}"],
                stdout=fh,
                stderr=subprocess.STDOUT,
                env={**os.environ, "HOME": str(self.folder)},
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while True:
            if self._proc.poll() is not None:
                pytest.fail(
                    f"openbao exited with {self._proc.returncode}; log:\n"
                    + self.log.read_text(errors="replace")[-2000:]
                )
            try:
                status = self._api("GET", "sys/seal-status")
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(
                        "openbao did not answer within 60 s; log:\n"
                        + self.log.read_text(errors="replace")[-2000:]
                    )
                time.sleep(0.1)
        first = not status.get("initialized")
        if first:
            init = self._api("PUT", "sys/init", {"secret_shares": 1, "secret_threshold": 1})
            self._unseal_key, self.token = init["keys_base64"][0], init["root_token"]
        self._api("PUT", "sys/unseal", {"key": self._unseal_key})
        while True:  # active once unsealed: wait for the health endpoint to say so
            try:
                with urllib.request.urlopen(f"{self.url}/v1/sys/health", timeout=2):  # noqa: S310
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(
                        "openbao did not become active; log:\n"
                        + self.log.read_text(errors="replace")[-2000:]
                    )
                time.sleep(0.1)
        if first:
            self._api("POST", "sys/mounts/transit", {"type": "transit"})

    def kill(self) -> None:
        """SIGKILL the server (no shutdown: as a crash or an OOM kill)."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=30)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGTERM)
                self._proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(timeout=30)


@contextmanager
def openbao_file_server(folder: Path) -> Iterator[OpenBaoFileServer]:
    """A started, unsealed ``OpenBaoFileServer`` in ``folder``, stopped at the end."""
    server = OpenBaoFileServer(folder)
    try:
        server.start()
        yield server
    finally:
        server.stop()
