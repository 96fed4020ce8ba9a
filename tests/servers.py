"""Real servers for the tests: the OpenBao dev server and moto's standalone server.

Each starts as a subprocess on a free loopback port, is polled until it answers, and
is stopped at the end of the session. A server that cannot start fails the tests that
need it with the reason and the tail of its log; it never skips them.
"""

from __future__ import annotations

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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

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


@contextmanager
def moto_server() -> Iterator[Server]:
    """moto's standalone server (S3, KMS, ...) over HTTP on loopback."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [_tool("moto_server"), "-H", "127.0.0.1", "-p", str(port)]
    with _process(argv, f"{url}/moto-api/", "moto") as log:
        yield Server(url, "", log)
