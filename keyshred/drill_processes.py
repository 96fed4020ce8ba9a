"""The processes of the distributed drill (``keyshred.drill_shared``) and of the
erasure-throughput benchmark: ``keyshred worker`` processes (started, watched, one
SIGKILLed while it holds an erasure's lease inside a step), the *holder* (an
application process that reads every subject and then answers what it still holds
in memory), and the submission of erasures to the job queue.

The holder runs as ``python -m keyshred.drill_processes holder FOLDER``: one JSON
command per line on stdin, one JSON answer per line on stdout (never a subject id in
an answer: counts only).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import sqlalchemy as sa

from keyshred.drill import DrillFailure
from keyshred.drill_servers import find_tool, signals_held, stop_process
from keyshred.errors import KeyshredError
from keyshred.facade import Keyshred
from keyshred.schema import deletion_requests

__all__ = [
    "DONE",
    "Holder",
    "KillWatch",
    "Workers",
    "held_in_memory",
    "refuse_embedding",
    "submit",
    "wait_done",
    "watch_and_kill",
    "worker_command",
]

# States a request stays in until someone acts (or for good).
DONE = ("completed", "rejected", "manual_review", "legal_hold")


# -- worker processes --------------------------------------------------------------


def worker_command(folder: Path) -> list[str]:
    """``keyshred worker`` on ``folder``, one job at a time (the drill wants several
    processes, not several threads of one)."""
    return [find_tool("keyshred"), "worker", "--path", str(folder), "--concurrency", "1"]


def submit(ks: Keyshred, subject: str) -> str:
    """Record an erasure and its job without running it here; its request id."""
    return ks.erasure.submit(subject, requested_by="drill", reason="drill").request_id


@dataclass
class Workers:
    """N worker processes, each in its own process group, logging to its folder."""

    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[IO[bytes]] = field(default_factory=list)

    def start(self, folders: Sequence[Path]) -> None:
        for folder in folders:
            argv = worker_command(folder)
            with signals_held():  # a signal between the fork and the append leaked it
                log = (folder.parent / f"{folder.name}.log").open("wb")
                self.logs.append(log)
                self.procs.append(
                    subprocess.Popen(
                        argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )

    def owner_of(self, pid: int) -> subprocess.Popen[bytes] | None:
        """Our worker whose process group ``pid`` belongs to (a worker may run its
        jobs in a child process)."""
        try:
            group = os.getpgid(pid)
        except ProcessLookupError:
            return None
        return next((p for p in self.procs if p.pid == group), None)

    def stop(self) -> None:
        for p in self.procs:
            stop_process(p)
        for log in self.logs:
            log.close()


def _lease_pid(owner: str | None) -> int | None:
    """The pid in a lease owner (``host:pid:nonce``, keyshred.erasure.lease)."""
    if not owner:
        return None
    parts = owner.split(":")
    return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None


@dataclass
class KillWatch:
    """What the drill saw of the request it killed a worker in."""

    killed_pid: int | None = None
    done_at_kill: list[str] = field(default_factory=list)
    state_at_kill: str = ""
    running_at_kill: str = ""
    owners_after: set[int] = field(default_factory=set)
    killed_after: float = 0.0  # seconds from the start of the watch
    finished_after_kill: float = 0.0
    taken_over_after: float | None = None  # seconds from the kill to a new lease
    final_state: str = ""


def watch_and_kill(ks: Keyshred, request_id: str, workers: Workers, timeout: float) -> KillWatch:
    """Poll the request; SIGKILL the worker holding its lease once its keys are
    destroyed and its receipt not yet signed (inside a propagating step), then
    follow it to the end, noting which processes held it after the kill."""
    seen = KillWatch()
    t = deletion_requests.c
    query = sa.select(t.state, t.doc, t.lease_owner).where(t.request_id == request_id)
    steps = list(ks.erasure.steps)
    dead_owner: str | None = None
    started = time.monotonic()
    deadline = started + timeout
    with ks.catalog.engine.connect() as conn:
        while time.monotonic() < deadline:
            row = conn.execute(query).one()
            conn.rollback()  # a fresh snapshot each poll
            done = list(json.loads(row.doc).get("done", []))
            pid = _lease_pid(row.lease_owner)
            if seen.killed_pid is None:
                if (
                    row.state == "propagating"
                    and "destroy_keys" in done
                    and "receipt" not in done
                    and pid is not None
                    and (worker := workers.owner_of(pid)) is not None
                ):
                    os.kill(pid, signal.SIGKILL)
                    _wait_dead(worker, pid)
                    seen.killed_pid, dead_owner = pid, row.lease_owner
                    seen.killed_after = time.monotonic() - started
                    after = conn.execute(query).one()
                    conn.rollback()
                    seen.done_at_kill = list(json.loads(after.doc).get("done", []))
                    seen.state_at_kill = str(after.state)
                    left = [s for s in steps if s not in seen.done_at_kill]
                    seen.running_at_kill = left[0] if left else ""
            elif pid is not None and row.lease_owner != dead_owner:
                seen.owners_after.add(pid)  # a lease taken after the kill
                if seen.taken_over_after is None:
                    seen.taken_over_after = time.monotonic() - started - seen.killed_after
            if row.state in DONE:
                seen.final_state = str(row.state)
                seen.finished_after_kill = time.monotonic() - started - seen.killed_after
                return seen
            time.sleep(0.003)
    seen.final_state = "timeout"
    return seen


def _wait_dead(worker: subprocess.Popen[bytes], pid: int) -> None:
    if pid == worker.pid:
        worker.wait(timeout=30)
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # a child of the worker: not ours to wait on
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)


def wait_done(ks: Keyshred, request_id: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = ks.erasure.status(request_id).state
        if state in DONE:
            return state
        time.sleep(0.1)
    return "timeout"


# -- the holder process ------------------------------------------------------------


def held_in_memory(ks: Keyshred, refs: Sequence[str], key_ids: Sequence[bytes]) -> dict[str, int]:
    """What this process holds of the subjects ``refs`` in memory: unwrapped keys
    (of ``key_ids``, their own and co-owned), loaded partitions (decrypted rows) and
    decrypted vectors. Private attributes: no public API exposes a cache's content,
    and the drill must look at exactly what an attacker dumping memory would find."""
    memories: Any = ks._memories
    vectors: Any = ks._vectors
    cache = ks.keyring.cache
    return {
        "keys": sum(1 for k in key_ids if k in cache),
        "partitions": sum(1 for r in refs if r in memories._partitions),
        "vectors": sum(1 for r in refs if r in vectors._cache),
    }


class Holder:
    """The application process: one JSON command per line in, one answer out."""

    def __init__(self, folder: Path) -> None:
        log = (folder.parent / f"{folder.name}.log").open("wb")
        self._log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "keyshred.drill_processes", "holder", str(folder)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
        )

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None  # noqa: S101
        self.proc.stdin.write(json.dumps(command).encode() + b"\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise DrillFailure(f"the holder process exited ({self.proc.wait()})")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise DrillFailure(f"holder: {answer['error']}")
        return answer

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        stop_process(self.proc)
        self._log.close()


def _holder_main(folder: Path) -> None:
    with Keyshred.open(folder) as ks:
        for line in sys.stdin:
            cmd = json.loads(line)
            try:
                if cmd["op"] == "warm":
                    n = 0
                    for subject in cmd["subjects"]:
                        n += len(ks.memories.search(subject, (), limit=10_000))
                        n += len(ks.memories.search(subject, (), query=cmd["query"], limit=5))
                    answer: dict[str, Any] = {"read": n}
                elif cmd["op"] == "held":
                    refs = cmd["refs"]
                    keys = [bytes.fromhex(k) for k in cmd["key_ids"]]
                    answer = held_in_memory(ks, refs, keys)
                else:
                    answer = {"error": "unknown command"}
            except KeyshredError as exc:
                answer = {"error": type(exc).__name__}
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()


def refuse_embedding(texts: list[str]) -> list[list[float]]:
    raise KeyshredError("this handle of the drill does not embed")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m keyshred.drill_processes holder FOLDER``: the drill's holder
    process (started by ``Holder``)."""
    role, folder = (argv if argv is not None else sys.argv[1:])[:2]
    if role == "holder":
        _holder_main(Path(folder))
    else:
        raise SystemExit(f"unknown role {role}")


if __name__ == "__main__":
    main()
