"""Helpers the benchmarks share (issue #25 item 5): one process per side driven line
by line, rounds interleaved between the sides and reported as medians, fsyncs per
operation counted with strace between markers, the machine's load.

A script that uses them runs each side as ``python <script> --child NAME ...``: the
child prints one JSON header line (its name and durability, read back from the
engine), then answers each command line on stdin with one JSON line. The parent
sends the same command to every side, in an order reversed every other time, so no
side runs on a systematically cooler or hotter machine.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

SYNC_CALLS = ("fsync", "fdatasync", "sync_file_range", "syncfs")
PG_DSN = os.environ.get("KEYSHRED_BENCH_PG", "host=127.0.0.1 port=5432 dbname=test user=postgres")
MARK_PREFIX = "/ks-bench-mark-"


def uptime() -> str:
    """``uptime``'s line (the load averages), printed at the start and end of a run."""
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def mark(name: str) -> None:
    """A marker in an strace log (``strace_syncs``): a syscall nothing else makes."""
    os.access(f"{MARK_PREFIX}{name}", os.F_OK)


def median_of(runs: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per metric, the median over the rounds that reported it."""
    names: list[str] = []
    for r in runs:
        names += [m for m in r if m not in names]
    return {m: statistics.median(r[m] for r in runs if m in r) for m in names}


def strace_syncs(argv: list[str], env: dict[str, str] | None = None) -> dict[str, float]:
    """Run ``argv`` under ``strace -f`` and count fsync, fdatasync, sync_file_range and
    syncfs calls (every thread and child process) between each ``mark(f"{op}-start")``
    and ``mark(f"{op}-end-{n}")``: the count divided by ``n``, per ``op``."""
    with tempfile.TemporaryDirectory(prefix="ks-bench-strace-") as tmp:
        log = Path(tmp) / "strace.log"
        traced = ",".join((*SYNC_CALLS, "access", "faccessat", "faccessat2"))
        cmd = ["strace", "-f", "-qq", "-o", str(log), "-e", f"trace={traced}", *argv]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"strace of {argv} failed:\n{proc.stderr[-3000:]}")
        counts: dict[str, float] = {}
        current = None
        syncs = 0
        for line in log.read_text().splitlines():
            if MARK_PREFIX in line:
                tag = line.split(MARK_PREFIX, 1)[1].split('"', 1)[0]
                if tag.endswith("-start"):
                    current, syncs = tag[: -len("-start")], 0
                else:
                    op, n = tag.rsplit("-end-", 1)
                    counts[op] = syncs / int(n)
                    current = None
            elif current is not None and any(
                f" {c}(" in line or line.startswith(f"{c}(") for c in SYNC_CALLS
            ):
                syncs += 1
        return counts


def run_json(script: str, argv: list[str]) -> dict[str, Any]:
    """Run ``script`` with ``argv`` in a process of its own and return the JSON
    object its last line of output holds (its error output ends the run if it fails)."""
    done = subprocess.run(
        [sys.executable, script, *argv], check=False, capture_output=True, text=True
    )
    if done.returncode:
        raise SystemExit(done.stderr[-4000:])
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def count_ops(name: str, n: int, op: Any) -> None:
    """Inside a probe process: one warm-up call outside the markers, then ``op(j)``
    for ``j`` in ``range(n)`` between ``name``'s markers (``strace_syncs``)."""
    op(n)
    mark(f"{name}-start")
    for j in range(n):
        op(j)
    mark(f"{name}-end-{n}")


class Child:
    """One side's process, driven line by line (``script --child ...``)."""

    def __init__(self, script: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.err = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in end()
        self.proc = subprocess.Popen(
            [sys.executable, script, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
            env=env,
        )
        self.header = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.err.seek(0)
            raise SystemExit(f"a side failed:\n{self.err.read()[-4000:]}")
        doc: dict[str, Any] = json.loads(line)
        return doc

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def end(self) -> dict[str, Any]:
        doc = self.ask("end")
        self.proc.wait()
        self.err.seek(0)
        for line in self.err.read().splitlines():
            if line.startswith("pyinstrument profile"):
                print(f"  {line}", flush=True)
        self.err.close()
        return doc


def interleaved(children: dict[str, Child], commands: Iterable[str]) -> dict[str, list[Any]]:
    """Each command to every side, the order of the sides reversed every other
    command; every side's answers, in order."""
    names = list(children)
    out: dict[str, list[Any]] = {name: [] for name in names}
    for i, command in enumerate(commands):
        for name in names if i % 2 == 0 else reversed(names):
            out[name].append(children[name].ask(command))
    return out


def serve(handlers: dict[str, Any], header: dict[str, Any]) -> None:
    """The child's loop: print ``header``, then answer ``cmd args...`` lines with
    ``handlers[cmd](*args)`` as one JSON line each, until ``end`` (answered ``{}``)."""
    print(json.dumps(header), flush=True)
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "end":
            print("{}", flush=True)
            break
        print(json.dumps(handlers[cmd](*rest)), flush=True)


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Import ``keyshred`` (and its component packages) from one checkout, by the
    ``package-dir`` map of its pyproject.toml: the folders are not laid out as the
    import package, so a plain ``sys.path`` entry cannot find them."""

    def __init__(self, repo: Path) -> None:
        doc = tomllib.loads((repo / "pyproject.toml").read_text())
        dirs = doc["tool"]["setuptools"]["package-dir"]
        self._dirs = {name: repo / folder for name, folder in dirs.items()}
        for name in doc["tool"]["setuptools"]["packages"]:
            if name not in self._dirs:  # a subpackage inside its parent's folder
                parent, _, leaf = name.rpartition(".")
                self._dirs[name] = self._dirs[parent] / leaf

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        folder = self._dirs.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


class PgSchema:
    """A fresh PostgreSQL schema on ``PG_DSN`` (``prefix`` and ten hex digits), made
    by ``admin`` (an autocommit connection) and dropped with everything in it at
    ``close``, or at the end of a ``with`` block. The schema's addresses, each setting
    ``search_path`` to it: ``url`` for SQLAlchemy (keyshred's ``catalog_url``),
    ``uri`` a libpq URI (``PostgresKeyStore``'s ``store_url``), ``dsn`` a libpq
    ``key=value`` string (psycopg, LangGraph's ``from_conn_string``). A server that
    does not answer raises ``psycopg.OperationalError`` within 3 s."""

    def __init__(self, prefix: str = "ks_bench") -> None:
        import uuid

        import psycopg

        self.name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        self.admin = psycopg.connect(PG_DSN, autocommit=True, connect_timeout=3)
        try:
            self.admin.execute(f"CREATE SCHEMA {self.name}")
        except BaseException:
            self.admin.close()
            raise
        info = self.admin.info
        server = f"{info.user}@{info.host}:{info.port}/{info.dbname}"
        options = f"options=-csearch_path%3D{self.name}"
        self.url = f"postgresql+psycopg://{server}?{options}"
        self.uri = f"postgresql://{server}?{options}"
        self.dsn = f"{PG_DSN} options=-csearch_path={self.name}"

    def close(self) -> None:
        try:
            self.admin.execute(f"DROP SCHEMA {self.name} CASCADE")
        finally:
            self.admin.close()

    def __enter__(self) -> PgSchema:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
