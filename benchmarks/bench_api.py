"""The HTTP API under load (issue #23): requests/s and p50/p99 latency of
``POST /v1/erasure-requests`` (record an erasure: 202) and ``GET
/v1/erasure-requests/{id}`` (its status), with 1 and 4 uvicorn workers
(``keyshred serve --workers N``), against the same calls on the Python API
(``ks.erasure.submit`` and ``ks.erasure.status``) in the same run.

Profiles:
- **shared**: PostgreSQL (the machine's, a fresh schema per round), the OpenBao dev
  server (Transit holds the KEK) and moto's S3 server (a bucket per round), started
  as ``keyshred drill --profile shared`` starts them (``keyshred.drill_servers``);
  1 and 4 workers.
- **embedded**: a data folder with its SQLite catalog and local KEK; 1 worker (the
  only count ``keyshred serve`` allows on SQLite).

Each round: the baseline first, in this process with no server running (R submits of
distinct subjects, then R status reads, then R ``api.call`` audit events: what the
API adds to every call; one thread, then the same with 4 threads);
then the server is started, waited for (``/readyz``) and left to settle until its
processes are idle (each worker loads the bundled embedding model in the background
when it opens); then C concurrent clients (tasks sharing one ``httpx.AsyncClient``
with C connections) make R POSTs of distinct subjects, then R GETs of the ids they
were given; the CPU time of the server's processes and of this one (the clients) is
taken over each phase. Checked after: every
request got an answer (no transport error), none was a 5xx, and every 202 is a
recorded request (counted in the catalog's ``ks_deletion_requests`` by the API
key's actor); the script exits 1 otherwise.

The API key's rate limit is set far above the load (it is per process and would
otherwise answer 429s: that is not what is measured). The access log is on (the
default of ``keyshred serve``), written to a file.

Run: ``.venv/bin/python benchmarks/bench_api.py [--requests 1000] [--clients 200]
[--workers 1,4] [--no-embedded] [--postgres-url URL]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import sqlalchemy as sa

from keyshred import Config, Keyshred
from keyshred.drill_servers import LocalServer, free_port, moto, openbao, scratch_schema
from keyshred.drill_shared import DEFAULT_POSTGRES_URL, make_bucket, shared_config
from keyshred.schema import deletion_requests

ACTOR = "key:bench"
REASON = "gdpr-art17"


@dataclass
class Measure:
    """One phase: per-call latencies (s), wall time (s) and the statuses seen."""

    latencies: list[float] = field(default_factory=list)
    wall: float = 0.0
    statuses: dict[int, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)  # transport errors by class
    server_cpu: float = 0.0  # CPU seconds of the server's processes over the phase
    client_cpu: float = 0.0  # CPU seconds of this process (the clients) over the phase

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.wall if self.wall else 0.0

    def pct(self, q: int) -> float:
        """The q-th percentile in milliseconds."""
        if len(self.latencies) < 2:
            return self.latencies[0] * 1000 if self.latencies else 0.0
        return statistics.quantiles(self.latencies, n=100, method="inclusive")[q - 1] * 1000

    def line(self) -> str:
        text = f"{self.rps:8.1f} req/s  p50 {self.pct(50):7.2f} ms  p99 {self.pct(99):7.2f} ms"
        if self.server_cpu and self.latencies:
            n = len(self.latencies)
            text += (
                f"  CPU per request: server {self.server_cpu / n * 1000:.1f} ms, "
                f"clients {self.client_cpu / n * 1000:.1f} ms"
            )
        return text


# -- the baseline: the same calls on the Python API -------------------------------------


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def python_baseline(
    ks: Keyshred, subjects: Sequence[str], threads: int
) -> tuple[Measure, Measure, Measure]:
    """``ks.erasure.submit`` for each subject, then ``ks.erasure.status`` of each id,
    then an ``api.call`` audit event per id (what the API adds to each call)."""
    ids: list[str] = []

    def submit(subject: str) -> float:
        start = time.perf_counter()
        req = ks.erasure.submit(subject, requested_by="python-baseline", reason=REASON)
        elapsed = time.perf_counter() - start
        ids.append(req.request_id)
        return elapsed

    def status(rid: str) -> float:
        return _timed(lambda: ks.erasure.status(rid))

    def audit(rid: str) -> float:
        # What the API adds to every call: its api.call event, one commit under the
        # audit chain's lock (PostgreSQL: an advisory lock every process waits for).
        return _timed(
            lambda: ks.audit.record(
                "api.call", request_id=rid, actor=ACTOR, action="erasure.get", status=200
            )
        )

    post, get, chain = Measure(), Measure(), Measure()
    with ThreadPoolExecutor(threads) as pool:
        for measure, fn, items in (
            (post, submit, subjects),
            (get, status, ids),
            (chain, audit, ids),
        ):
            start = time.perf_counter()
            measure.latencies = list(pool.map(fn, list(items)))
            measure.wall = time.perf_counter() - start
    return post, get, chain


# -- the server -----------------------------------------------------------------------


def write_api_settings(folder: Path) -> str:
    token = secrets.token_urlsafe(24)
    digest = hashlib.sha256(token.encode()).hexdigest()
    (folder / "api.toml").write_text(
        "[[api_keys]]\n"
        'name = "bench"\n'
        f'sha256 = "{digest}"\n'
        'role = "operator"\n'
        "\n[rate_limit]\nper_second = 1000000.0\nburst = 1000000\n"
    )
    return token


@contextlib.contextmanager
def api_server(folder: Path, data: Path, workers: int, settle: float) -> Iterator[tuple[str, int]]:
    port = free_port()
    argv = [sys.executable, "-m", "keyshred.cli", "serve", "--path", str(data)]
    argv += ["--api-config", str(folder / "api.toml"), "--port", str(port)]
    argv += ["--workers", str(workers)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYSHRED_")}
    log = (folder / f"server-{workers}.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited: {proc.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/readyz", timeout=10).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit("the server was not ready within 120 s")
            time.sleep(0.2)
        time.sleep(settle)
        _until_idle(proc.pid)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _tree_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a process and its descendants (Linux /proc)."""
    total, todo, tick = 0.0, [pid], os.sysconf("SC_CLK_TCK")
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
    return total


def _until_idle(pid: int, timeout: float = 180.0) -> None:
    """Wait until the server's processes are idle (under 5 % of a core for two
    seconds in a row): each worker loads the embedding model in the background
    when it opens, which would otherwise compete with the load for the 2 cores."""
    deadline, quiet, last = time.monotonic() + timeout, 0, _tree_cpu_seconds(pid)
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(1.0)
        now = _tree_cpu_seconds(pid)
        quiet = quiet + 1 if now - last < 0.05 else 0
        last = now


# -- the load -------------------------------------------------------------------------


async def _load(
    url: str, token: str, calls: Sequence[tuple[str, str, dict[str, object] | None]], clients: int
) -> tuple[Measure, list[str]]:
    """``calls`` (method, path, JSON body) made by ``clients`` concurrent clients;
    the ids of the 202 answers."""
    measure, ids = Measure(), []
    queue: asyncio.Queue[tuple[str, str, dict[str, object] | None]] = asyncio.Queue()
    for call in calls:
        queue.put_nowait(call)
    headers = {"Authorization": f"Bearer {token}"}

    async def client(http: httpx.AsyncClient) -> None:
        while True:
            try:
                method, path, body = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            start = time.perf_counter()
            try:
                answer = await http.request(method, path, json=body)
            except httpx.TransportError as exc:
                name = type(exc).__name__
                measure.errors[name] = measure.errors.get(name, 0) + 1
                continue
            measure.latencies.append(time.perf_counter() - start)
            measure.statuses[answer.status_code] = measure.statuses.get(answer.status_code, 0) + 1
            if answer.status_code == 202:
                ids.append(answer.json()["request_id"])

    # One pool of ``clients`` connections (an AsyncClient each would cost its own
    # TLS context, ~20 ms of CPU, even for http://): each client task its own
    # connection while all are busy.
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=300) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        measure.wall = time.perf_counter() - start
    return measure, ids


def _phase(
    url: str,
    token: str,
    calls: Sequence[tuple[str, str, dict[str, object] | None]],
    clients: int,
    pid: int,
) -> tuple[Measure, list[str]]:
    server, client = _tree_cpu_seconds(pid), time.process_time()
    measure, ids = asyncio.run(_load(url, token, calls, clients))
    measure.server_cpu = _tree_cpu_seconds(pid) - server
    measure.client_cpu = time.process_time() - client
    return measure, ids


def http_load(
    url: str, token: str, subjects: Sequence[str], clients: int, pid: int
) -> tuple[Measure, Measure, list[str]]:
    posts = [("POST", "/v1/erasure-requests", {"subject": s, "reason": REASON}) for s in subjects]
    post, ids = _phase(url, token, posts, clients, pid)
    gets = [("GET", f"/v1/erasure-requests/{rid}", None) for rid in ids]
    get, _ = _phase(url, token, gets, clients, pid)
    return post, get, ids


def recorded(ks: Keyshred, actor: str) -> set[str]:
    t = deletion_requests.c
    with ks.catalog.engine.connect() as conn:
        return set(conn.execute(sa.select(t.request_id).where(t.requested_by == actor)).scalars())


# -- a round --------------------------------------------------------------------------


@dataclass
class Round:
    label: str
    base: dict[int, tuple[Measure, Measure, Measure]]  # threads -> (submit, status, audit)
    post: Measure
    get: Measure
    problems: list[str]


def run_round(  # noqa: PLR0917 - one call site
    label: str, folder: Path, config: Config, workers: int, n: int, clients: int, settle: float
) -> Round:
    folder.mkdir(parents=True)
    data = folder / "data"
    token = write_api_settings(folder)
    base: dict[int, tuple[Measure, Measure, Measure]] = {}
    with Keyshred.init(data, config) as ks:
        for threads in (1, 4):
            subjects = [f"base-{threads}-{i}@example.com" for i in range(n)]
            base[threads] = python_baseline(ks, subjects, threads)
    with api_server(folder, data, workers, settle) as (url, pid):
        subjects = [f"http-{i}@example.com" for i in range(n)]
        post, get, ids = http_load(url, token, subjects, clients, pid)
    problems = []
    with Keyshred.open(data) as ks:
        stored = recorded(ks, ACTOR)
    for name, m in (("POST", post), ("GET", get)):
        if m.errors:
            problems.append(f"{name}: transport errors {m.errors}")
        if any(s >= 500 for s in m.statuses):
            problems.append(f"{name}: 5xx answers {m.statuses}")
    if post.statuses.get(202, 0) != n:
        problems.append(f"POST: {post.statuses.get(202, 0)} of {n} were 202 {post.statuses}")
    if get.statuses.get(200, 0) != len(ids):
        problems.append(f"GET: {get.statuses.get(200, 0)} of {len(ids)} were 200")
    if set(ids) != stored or len(ids) != len(set(ids)):
        problems.append(f"{len(ids)} ids answered 202, {len(stored)} recorded in the catalog")
    return Round(label, base, post, get, problems)


def report(r: Round) -> None:
    print(f"\n== {r.label}", flush=True)
    for threads, (submit, status, audit) in r.base.items():
        print(f"  Python API, {threads} thread(s): submit {submit.line()}")
        print(f"  Python API, {threads} thread(s): status {status.line()}")
        print(f"  Python API, {threads} thread(s): audit  {audit.line()}  (an api.call event)")
    print(f"  HTTP POST /v1/erasure-requests:      {r.post.line()}  {r.post.statuses}")
    print(f"  HTTP GET  /v1/erasure-requests/{{id}}: {r.get.line()}  {r.get.statuses}")
    for name, m, (b1, b4) in (
        ("POST/submit", r.post, (r.base[1][0], r.base[4][0])),
        ("GET/status", r.get, (r.base[1][1], r.base[4][1])),
    ):
        print(
            f"  ratio {name}: req/s HTTP / Python 1 thread {m.rps / b1.rps:.2f}, "
            f"/ 4 threads {m.rps / b4.rps:.2f}; p50 HTTP / Python 1 thread "
            f"{m.pct(50) / b1.pct(50):.1f}x"
        )
    print(
        "  check: "
        + (
            "every request answered, no 5xx, every 202 recorded"
            if not r.problems
            else "FAILED: " + "; ".join(r.problems)
        ),
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="POSTs (and GETs) per round")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--workers", default="1,4", help="uvicorn workers, shared profile")
    parser.add_argument("--no-embedded", action="store_true")
    parser.add_argument("--settle", type=float, default=8.0)
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL)
    args = parser.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    print(
        f"cores: {os.cpu_count()}; load average {os.getloadavg()[0]:.2f}; "
        f"{args.requests} POSTs then {args.requests} GETs per round, {args.clients} clients"
    )
    rounds: list[Round] = []
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ks-bench-api-")))
        if not args.no_embedded:
            r = run_round(
                "embedded (SQLite, local KEK), 1 worker",
                tmp / "embedded",
                Config(),
                1,
                args.requests,
                args.clients,
                args.settle,
            )
            report(r)
            rounds.append(r)
        bao: LocalServer = stack.enter_context(openbao(tmp))
        s3: LocalServer = stack.enter_context(moto(tmp))
        os.environ["VAULT_TOKEN"] = bao.token
        for workers in (int(w) for w in args.workers.split(",")):
            with scratch_schema(args.postgres_url) as url:
                config = shared_config(url, bao, s3, make_bucket(s3))
                r = run_round(
                    f"shared (PostgreSQL, OpenBao, S3), {workers} worker(s)",
                    tmp / f"shared-{workers}",
                    config,
                    workers,
                    args.requests,
                    args.clients,
                    args.settle,
                )
            report(r)
            rounds.append(r)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    return 1 if any(r.problems for r in rounds) else 0


if __name__ == "__main__":
    sys.exit(main())
