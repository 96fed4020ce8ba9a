"""Memory store benchmark (issue #21's engine): the embedded profile against the same
engine unencrypted and LangGraph's SqliteStore, and the shared profile across worker
processes, each on one workload in one run with ratios printed.

**Embedded** (SQLite catalog, segments in a folder; issue #25 item 5's method).
Three engines, each in a process of its own driven line by line
(``benchmarks/_common.py``), at the same durability, read back from SQLite and printed:

- keyshred, ``storage.durability = "fsync"`` (the default): WAL, ``synchronous=FULL``,
  one fsync'd commit per put;
- the same engine with its sealing and PME replaced by plaintext (benchmark-only);
- LangGraph ``SqliteStore`` set to WAL and ``synchronous=FULL``.

``--fsyncs`` counts each engine's fsync/fdatasync calls per operation with strace.
Load: ``--subjects`` subjects (5,500) x 10 memories, one batch each, in 6 chunks
interleaved between the engines, and one subject with 10,000 memories. Then
``--rounds`` (5) rounds; in each, every operation runs once per engine, the engines'
order reversed from one operation to the next; figures are medians of the rounds.
Operations, each **hot** (the first 20 subjects, warmed: within every cache) and
**spread** (random subjects of all: beyond the 256 open partitions and, at 2 keys per
subject, beyond the keyring's 10,000-key cache): single puts of new keys, batched puts
(100 per call), gets, searches (namespace prefix, newest 10); and searches of the
10,000-memory subject, a cold open (the store reopened, its first search).

**Shared** (``--shared``; PostgreSQL on 127.0.0.1:5432 database ``test``, moto's S3
server over HTTP, a shared local key file or OpenBao's Transit as the KEK; the
plumbing of ``tests/test_shared_workers.py``): every worker is a process with its
own data folder.

- puts/s and gets/s with 1, 2 and 4 workers at once on one subject set (warm: the
  subjects and their keys exist, each worker has loaded them);
- per warm put and per warm get: database round trips, statements and commits,
  counted on the wire by a PostgreSQL protocol proxy in the worker (every Query and
  Sync message is a round trip; COMMITs are split into those of transactions that
  wrote and read-only ones);
- KEK calls per new subject, counted at the KEK provider object (for OpenBao also
  its HTTP requests);
- a cold read of a 10,000-memory subject (a fresh process and folder, the segment on
  S3) against pyarrow reading the same rows, decrypted and written as plain Parquet
  with the same options, from the same bucket.

Run: ``.venv/bin/python benchmarks/bench_memories.py`` (both profiles, full size) or
with ``--quick`` (a smaller workload, one round: a few minutes); ``--embedded
[--fsyncs] [--subjects N] [--rounds R]`` or
``--shared`` for one profile; ``--kek openbao`` for Transit; ``--profile`` writes
cProfile output of the measured sections to stderr files it names.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import (
    Child,
    PgSchema,
    count_ops,
    interleaved,
    median_of,
    serve,
    strace_syncs,
    uptime,
)
from langgraph.store.base import PutOp
from langgraph.store.sqlite import SqliteStore

from keyshred import Config, Keyshred
from keyshred.storage.memories import MemoryStore, PutItem
from keyshred.storage.sealer import PlaintextSealer
from tests.storage.test_vectors import bag_of_words

ROOT = Path(__file__).resolve().parents[1]

# moto and boto3 need credentials and a region: moto's documented dummies (as in
# tests/conftest.py); every client gets an explicit loopback endpoint.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

NS = ("notes",)
HOT = 20  # subjects of the "within the caches" workload
BATCH = 100
LOAD_CHUNKS = 6
SAMPLES = {"put": 200, "batch": 10, "get": 1000, "search": 200}
SIZES = {
    # embedded: subjects x memories, the big subject; shared: subject set, puts and
    # gets per worker, rounds, counted puts, new subjects, cold subject, cold rounds
    "full": {
        "subjects": 5_500,
        "per_subject": 10,
        "big": 10_000,
        "rounds": 5,
        "s_subjects": 20,
        "s_puts": 600,
        "s_gets": 3000,
        "s_rounds": 3,
        "s_counted": 200,
        "s_new": 20,
        "s_big": 10_000,
        "s_cold_rounds": 5,
    },
    "quick": {
        "subjects": 300,
        "per_subject": 10,
        "big": 10_000,
        "rounds": 1,
        "s_subjects": 10,
        "s_puts": 150,
        "s_gets": 600,
        "s_rounds": 1,
        "s_counted": 50,
        "s_new": 10,
        "s_big": 10_000,
        "s_cold_rounds": 2,
    },
}


def value(s: int | str, i: int) -> dict[str, Any]:
    return {"text": f"subject {s} memory {i}: prefers tea over coffee", "i": i, "tags": ["a", "b"]}


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def pct(samples: list[float], q: float) -> float:
    samples = sorted(samples)
    return samples[min(len(samples) - 1, int(len(samples) * q))]


@contextlib.contextmanager
def profiled(enabled: bool, title: str) -> Iterator[None]:
    """cProfile of the block, top functions by own time, on stderr."""
    if not enabled:
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(22)
        stats.sort_stats("cumulative").print_stats(30)
        print(f"=== profile: {title}\n{out.getvalue()}", file=sys.stderr, flush=True)


# =====================================================================================
# Embedded profile
# =====================================================================================


class Engine:
    name = ""
    durability = ""

    def put(self, s: int, i: int) -> None: ...
    def put_batch(self, s: int, items: list[int]) -> None: ...
    def get(self, s: int, i: int) -> Any: ...
    def search(self, s: int) -> list[Any]: ...
    def reopen(self) -> None: ...
    def close(self) -> None: ...


class PlaintextMemoryStore(MemoryStore):
    """The baseline: the memory store's own code with its sealing and Parquet
    encryption replaced by plaintext. The store itself has no plaintext mode; this
    benchmark-only subclass measures what encryption costs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sealer = PlaintextSealer()
        self._pme = None  # type: ignore[assignment]  # partitions write plain Parquet


def _sqlite_durability(execute: Callable[[str], Any]) -> str:
    journal = execute("PRAGMA journal_mode")
    sync = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}[int(execute("PRAGMA synchronous"))]
    return f"journal_mode={journal}, synchronous={sync}"


class KeyshredEngine(Engine):
    def __init__(self, root: Path, *, encrypt: bool, durability: str = "fsync") -> None:
        self.name = "keyshred" if encrypt else "keyshred, encryption off"
        if durability != "fsync":
            self.name = f"keyshred, durability={durability}"
        self.root, self.encrypt = root, encrypt
        self.config = Config.model_validate({"storage": {"durability": durability}})
        # No model load in the background: nothing here is indexed.
        self.ks = Keyshred.init(root, self.config, embeddings=bag_of_words)
        self.store = self._store()
        with self.ks.catalog.engine.connect() as conn:
            self.durability = _sqlite_durability(lambda sql: conn.exec_driver_sql(sql).scalar()) + (
                ", one commit per put" if durability == "fsync" else ", no fsync at commit"
            )

    def _store(self) -> MemoryStore:
        if self.encrypt:
            return self.ks.memories
        # The same engine with the keyring's sealing and PME switched off.
        return PlaintextMemoryStore(
            self.ks.path,
            self.ks.catalog,
            self.ks.keyring,
            self.ks.policy,
            self.ks.subject_ref,
        )

    def put(self, s: int, i: int) -> None:
        self.store.put(f"user-{s}", ("memories", f"user-{s}"), f"k{i}", value(s, i))

    def put_batch(self, s: int, items: list[int]) -> None:
        self.store.put_many(
            f"user-{s}", [PutItem(("memories", f"user-{s}"), f"k{i}", value(s, i)) for i in items]
        )

    def get(self, s: int, i: int) -> Any:
        return self.store.get(f"user-{s}", ("memories", f"user-{s}"), f"k{i}")

    def search(self, s: int) -> list[Any]:
        return self.store.search(f"user-{s}", ("memories",), limit=10)

    def reopen(self) -> None:
        self.store.close()
        if self.store is not self.ks.memories:
            self.ks.memories.close()
        self.ks.close()
        self.ks = Keyshred.open(self.root, embeddings=bag_of_words)
        self.store = self._store()

    def close(self) -> None:
        self.store.close()
        self.ks.close()


class SqliteEngine(Engine):
    def __init__(self, root: Path, *, wal: bool = False) -> None:
        self.name = "SqliteStore, WAL+FULL" if wal else "LangGraph SqliteStore"
        self.wal = wal
        self.path = str(root / "store.db")
        self._open()
        self.store.setup()
        self.durability = (
            _sqlite_durability(lambda sql: self.store.conn.execute(sql).fetchone()[0])
            + ", one commit per put"
        )

    def _open(self) -> None:
        self._cm = SqliteStore.from_conn_string(self.path)
        self.store = self._cm.__enter__()
        if self.wal:  # keyshred's default durability: WAL, fsync at every commit
            self.store.conn.execute("PRAGMA journal_mode=WAL")
            self.store.conn.execute("PRAGMA synchronous=FULL")

    def put(self, s: int, i: int) -> None:
        self.store.put(("memories", f"user-{s}"), f"k{i}", value(s, i))

    def put_batch(self, s: int, items: list[int]) -> None:
        self.store.batch([PutOp(("memories", f"user-{s}"), f"k{i}", value(s, i)) for i in items])

    def get(self, s: int, i: int) -> Any:
        return self.store.get(("memories", f"user-{s}"), f"k{i}")

    def search(self, s: int) -> list[Any]:
        return self.store.search(("memories", f"user-{s}"), limit=10)

    def reopen(self) -> None:
        self._cm.__exit__(None, None, None)
        self._open()

    def close(self) -> None:
        self._cm.__exit__(None, None, None)


ENGINES: dict[str, Callable[[Path], Engine]] = {
    "keyshred": lambda p: KeyshredEngine(p, encrypt=True),
    "plain": lambda p: KeyshredEngine(p, encrypt=False),
    "sqlite-wal": lambda p: SqliteEngine(p, wal=True),
}


class Measured:
    """One engine in its process (``_common.Child``): loads in chunks, then one
    operation per command, so the engines' operations interleave."""

    def __init__(self, engine: Engine, size: dict[str, int]) -> None:
        self.engine, self.size = engine, size
        self.n = size["subjects"]
        self.big = self.n  # the 10,000-memory subject
        self.next_key: dict[int, int] = {}

    def load(self, lo: str, hi: str) -> dict[str, float]:
        start = time.perf_counter()
        per = self.size["per_subject"]
        for s in range(int(lo), int(hi)):
            self.engine.put_batch(s, list(range(per)))
            self.next_key[s] = per
        return {"load s": time.perf_counter() - start}

    def load_big(self) -> dict[str, float]:
        start = time.perf_counter()
        for lo in range(0, self.size["big"], 1000):
            self.engine.put_batch(self.big, list(range(lo, lo + 1000)))
        self.engine.search(self.big)
        return {"load s": time.perf_counter() - start}

    def _fresh(self, s: int, count: int) -> list[int]:
        i = self.next_key.get(s, 0)
        self.next_key[s] = i + count
        return list(range(i, i + count))

    def op(self, r: str, name: str, where: str) -> dict[str, float]:
        engine, per = self.engine, self.size["per_subject"]
        name = name.replace("_", " ")
        rnd = random.Random(f"{r}/{name}/{where}")
        pool = range(HOT) if where == "hot" else range(self.n)
        if where == "hot":  # warm: within every cache
            for s in range(HOT):
                engine.get(s, 0)
        if name == "single put":
            subjects = [rnd.choice(pool) for _ in range(SAMPLES["put"])]
            calls = [lambda s=s: engine.put(s, self._fresh(s, 1)[0]) for s in subjects]
            return {"single put/s": len(calls) / timed(lambda: [c() for c in calls])}
        if name == "batched put":
            subjects = [rnd.choice(pool) for _ in range(SAMPLES["batch"])]
            calls = [lambda s=s: engine.put_batch(s, self._fresh(s, BATCH)) for s in subjects]
            took = timed(lambda: [c() for c in calls])
            return {f"batched put ({BATCH} per call)/s": len(calls) * BATCH / took}
        if name == "get":
            keys = [(rnd.choice(pool), rnd.randrange(per)) for _ in range(SAMPLES["get"])]
            lat = []
            for s, i in keys:
                start = time.perf_counter()
                got = engine.get(s, i)
                lat.append(time.perf_counter() - start)
                assert got is not None
            return {"get p50 ms": pct(lat, 0.5) * 1e3, "get p99 ms": pct(lat, 0.99) * 1e3}
        if name == "search":
            subjects = [rnd.choice(pool) for _ in range(SAMPLES["search"])]
            lat = [timed(lambda s=s: engine.search(s)) for s in subjects]
            return {"search p50 ms": pct(lat, 0.5) * 1e3, "search p99 ms": pct(lat, 0.99) * 1e3}
        if name == "search big":
            engine.search(self.big)
            lat = [timed(lambda: engine.search(self.big)) for _ in range(20)]
            return {"search 10k subject p50 ms": pct(lat, 0.5) * 1e3}
        # cold open: the store reopened, then its first search of the big subject
        engine.reopen()
        return {"cold open 10k subject ms": timed(lambda: engine.search(self.big)) * 1e3}


def embedded_probe(engine: Engine) -> None:
    """The operations ``--fsyncs`` counts, between markers in strace's log."""
    for s in range(HOT):
        engine.put_batch(s, list(range(10)))
    ops: list[tuple[str, Callable[[int], Any]]] = [
        ("single put", lambda j: engine.put(j % HOT, 100 + j)),
        (f"batched put of {BATCH}", lambda j: engine.put_batch(j % HOT, list(range(BATCH)))),
        ("batched put, new subject", lambda j: engine.put_batch(1000 + j, list(range(BATCH)))),
        ("get", lambda j: engine.get(j % HOT, 1)),
        ("search", lambda j: engine.search(j % HOT)),
    ]
    for name, op in ops:
        count_ops(name, 20, op)


def embedded_child(name: str, size: dict[str, int], probe: bool) -> None:
    """One engine in this process, on command (``_common.serve``)."""
    with tempfile.TemporaryDirectory(prefix="ks-bench-memories-") as tmp:
        engine = ENGINES[name](Path(tmp))
        try:
            if probe:
                embedded_probe(engine)
                return
            m = Measured(engine, size)
            header = {"side": engine.name, "durability": engine.durability}
            serve({"load": m.load, "load_big": m.load_big, "op": m.op}, header)
        finally:
            engine.close()


EMBEDDED_OPS = ("single put", "batched put", "get", "search")


def embedded_main(args: argparse.Namespace, size: dict[str, int]) -> None:
    n, rounds = size["subjects"], size["rounds"]
    print(
        f"\n## embedded profile: {n} subjects x {size['per_subject']} memories (hot: the "
        f"first {HOT}, warmed; spread: all {n}), plus one {size['big']}-memory subject; "
        f"medians of {rounds} interleaved rounds"
    )
    env = dict(os.environ)
    if args.fsyncs:
        print("fsync/fdatasync calls per operation (strace -f, 20 operations each):")
        for name in ENGINES:
            argv = [sys.executable, __file__, "--engine", name, "--fsync-probe"]
            print(f"  {name:<10} {json.dumps(strace_syncs(argv, env))}", flush=True)
        return
    started = time.perf_counter()
    argv = ["--quick"] if args.quick else []
    argv += ["--subjects", str(n)]
    children = {name: Child(__file__, ["--engine", name, *argv], env) for name in ENGINES}
    label = {name: c.header["side"] for name, c in children.items()}
    try:
        bounds = [n * c // LOAD_CHUNKS for c in range(LOAD_CHUNKS + 1)]
        loads = interleaved(
            children, [f"load {bounds[c]} {bounds[c + 1]}" for c in range(LOAD_CHUNKS)]
        )
        bigs = interleaved(children, ["load_big"])
        for name, c in children.items():
            took = sum(x["load s"] for x in loads[name])
            print(f"  durability {label[name]}: {c.header['durability']}")
            print(
                f"  load {label[name]}: {n * size['per_subject'] / took:,.0f} memories/s "
                f"({n} subjects, one batch each); the big subject {bigs[name][0]['load s']:.1f} s"
            )
        commands = []
        for r in range(rounds):
            commands += [
                f"op {r} {op.replace(' ', '_')} {w}"
                for op in EMBEDDED_OPS
                for w in ("hot", "spread")
            ]
            commands += [f"op {r} search_big hot", f"op {r} cold hot"]
        answers = interleaved(children, commands)
    finally:
        for c in children.values():
            c.end()
    med: dict[str, dict[str, float]] = {}
    per_round: dict[str, list[dict[str, float]]] = {}
    for name in ENGINES:
        rows: list[dict[str, float]] = [{} for _ in range(rounds)]
        for command, doc in zip(commands, answers[name], strict=True):
            _, r, op, where = command.split()
            suffix = f", {where}" if op.replace("_", " ") in EMBEDDED_OPS else ""
            for metric, v in doc.items():
                unit = " /s" if metric.endswith("/s") else ""
                key = metric.removesuffix("/s").removesuffix(" ms") + suffix
                rows[int(r)][key + (unit or " ms")] = v
        per_round[label[name]] = rows
        med[label[name]] = median_of(rows)
    took = time.perf_counter() - started
    names = list(med)
    print(f"\nmedians of {rounds} interleaved rounds ({took:.0f} s)")
    print(f"{'metric':<40}" + "".join(f"{x[:26]:>28}" for x in names))
    for m in med[names[0]]:
        print(f"{m:<40}" + "".join(f"{med[x][m]:>28,.3f}" for x in names))
    ks = label["keyshred"]
    print(
        "\nratios, keyshred / other (throughput: >= 1 keyshred faster; latency: other / keyshred)"
    )
    for other in names[1:]:
        print(f"  vs {other}:")
        for m in med[ks]:

            def ratio(a: dict[str, float], b: dict[str, float], m: str = m) -> float:
                return a[m] / b[m] if m.endswith("/s") else b[m] / a[m]

            rs = [ratio(x, y) for x, y in zip(per_round[ks], per_round[other], strict=True)]
            print(
                f"    {m:<40} {ratio(med[ks], med[other]):6.2f}"
                f"   (rounds {min(rs):.2f}-{max(rs):.2f})"
            )


def _target(text: str, met: bool, figure: str) -> None:
    print(f"  {'MET ' if met else 'MISS'} {text}: {figure}")


# =====================================================================================
# Shared profile: the PostgreSQL wire counter
# =====================================================================================


class WireCounter:
    """A PostgreSQL protocol proxy on loopback that counts what clients send: round
    trips (every simple Query and every Sync wait for the server's ReadyForQuery),
    statements, and transaction ends, split into COMMITs of transactions that wrote
    (an INSERT, UPDATE or DELETE since BEGIN, or an autocommit write) and the rest.
    Runs on its own thread; clients connect to ``port`` with ``sslmode=disable``."""

    def __init__(self, upstream: tuple[str, int] = ("127.0.0.1", 5432)) -> None:
        self.upstream = upstream
        self.counts: Counter[str] = Counter()
        self.texts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self.port = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def snapshot(self) -> tuple[Counter[str], Counter[str]]:
        time.sleep(0.05)  # let the proxy thread finish parsing what was sent
        with self._lock:
            return Counter(self.counts), Counter(self.texts)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()

        async def start() -> None:
            server = await asyncio.start_server(self._client, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()

        loop.run_until_complete(start())
        loop.run_forever()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(*self.upstream)

        async def back() -> None:
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                while data := await up_r.read(65536):
                    writer.write(data)
                    await writer.drain()
            writer.close()

        task = asyncio.ensure_future(back())
        try:
            await self._forward(reader, up_w)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            up_w.close()
            await task

    def _count(self, key: str, text: str | None = None) -> None:
        with self._lock:
            self.counts[key] += 1
            if text is not None:
                self.texts[" ".join(text.split())[:90]] += 1

    async def _forward(self, reader: asyncio.StreamReader, up: asyncio.StreamWriter) -> None:
        # Untyped startup messages first (SSL/GSS requests are refused by the server
        # with one byte, as sslmode=disable never sends them), then typed messages.
        while True:
            head = await reader.readexactly(8)
            length, code = struct.unpack("!ii", head)
            body = await reader.readexactly(length - 8)
            up.write(head + body)
            await up.drain()
            if code not in (80877103, 80877104):  # SSLRequest, GSSENCRequest
                self._count("connections")
                break
        prepared: dict[bytes, str] = {}
        bound = ""
        in_tx, wrote = False, False
        while True:
            head = await reader.readexactly(5)
            kind, length = head[:1], struct.unpack("!i", head[1:])[0]
            body = await reader.readexactly(length - 4)
            up.write(head + body)
            await up.drain()
            texts: list[str] = []
            if kind == b"Q":
                self._count("round trips")
                texts.append(body[:-1].decode(errors="replace"))
            elif kind == b"P":
                name, _, rest = body.partition(b"\0")
                prepared[name] = rest.partition(b"\0")[0].decode(errors="replace")
            elif kind == b"B":
                _, _, rest = body.partition(b"\0")
                bound = prepared.get(rest.partition(b"\0")[0], "?")
            elif kind == b"E":
                texts.append(bound)
            elif kind == b"S":
                self._count("round trips")
            elif kind == b"X":
                return
            for text in texts:
                verb = text.lstrip().split(None, 1)[0].upper() if text.strip() else ""
                if verb in ("BEGIN", "START"):
                    in_tx, wrote = True, False
                    self._count("BEGIN")
                elif verb in ("COMMIT", "END"):
                    self._count("COMMIT, wrote" if wrote else "COMMIT, read only")
                    in_tx = False
                elif verb in ("ROLLBACK", "ABORT"):
                    self._count("ROLLBACK")
                    in_tx = False
                else:
                    self._count("statements", text)
                    writes = verb in ("INSERT", "UPDATE", "DELETE")
                    if writes and not in_tx:
                        self._count("autocommit writes")
                    wrote = wrote or writes


# =====================================================================================
# Shared profile: workers
# =====================================================================================


def _open_worker(folder: Path, config: Config) -> Keyshred:
    if (folder / "keyshred.toml").exists():
        return Keyshred.open(folder, config, embeddings=bag_of_words)
    return Keyshred.init(folder, config, embeddings=bag_of_words)


class KekCounter:
    """Counts calls on the KEK provider classes (installed before the store opens,
    so the open's own calls count too): every public operation, nested ones once
    (the base class's ``wrap_many`` calls ``wrap``), and for Vault/OpenBao every
    HTTP request it makes."""

    OPS = ("wrap", "unwrap", "wrap_many", "unwrap_many", "rewrap_many", "rotate")

    def __init__(self) -> None:
        from keyshred.keyring.kek.local import LocalKek
        from keyshred.keyring.kek.vault import VaultKek

        self.calls: Counter[str] = Counter()
        self._depth = 0
        for cls in (LocalKek, VaultKek):
            for op in self.OPS:
                self._wrap(cls, op, op, outermost=True)
        self._wrap(VaultKek, "_request", "http requests", outermost=False)

    def _wrap(self, cls: type, attr: str, label: str, *, outermost: bool) -> None:
        real = getattr(cls, attr)

        def counted(obj: Any, *a: Any, **k: Any) -> Any:
            if outermost and self._depth:
                return real(obj, *a, **k)
            self.calls[label] += 1
            self._depth += outermost
            try:
                return real(obj, *a, **k)
            finally:
                self._depth -= outermost

        setattr(cls, attr, counted)

    def total(self) -> int:
        return sum(v for k, v in self.calls.items() if k != "http requests")


def worker_throughput(ks: Keyshred, args: list[str]) -> None:
    """READY after warming up; on each GO line one phase (puts, then gets), its
    wall-clock span printed as JSON."""
    wid, rnd, n_puts, n_gets, n_subjects = args[0], args[1], *map(int, args[2:5])
    subjects = [f"s{i}" for i in range(n_subjects)]
    m = ks.memories
    for s in subjects:  # this worker's first touch of each subject: not measured
        m.put(s, NS, f"warm-{wid}-{rnd}", value(s, -1))
    print("READY", flush=True)
    sys.stdin.readline()
    keys = []
    t0 = time.time()
    for i in range(n_puts):
        s = subjects[i % n_subjects]
        key = f"w{wid}-r{rnd}-{i}"
        m.put(s, NS, key, value(s, i))
        keys.append((s, key))
    t1 = time.time()
    print("PUTS " + json.dumps({"t0": t0, "t1": t1, "n": n_puts}), flush=True)
    sys.stdin.readline()
    rng = random.Random(f"{wid}-{rnd}")
    picks = [rng.choice(keys) for _ in range(n_gets)]
    t0 = time.time()
    for s, key in picks:
        got = m.get(s, NS, key)
        assert got is not None
    t1 = time.time()
    print("GETS " + json.dumps({"t0": t0, "t1": t1, "n": n_gets}), flush=True)


def _through(url: str, port: int) -> str:
    url = url.replace("@127.0.0.1:5432/", f"@127.0.0.1:{port}/")
    return url + ("&" if "?" in url else "?") + "sslmode=disable&gssencmode=disable"


def worker_count(folder: Path, config: Config, args: list[str]) -> dict[str, Any]:
    """Round trips, statements and commits per warm put and get (on the wire), and
    KEK calls per new subject (at the provider), in one fresh worker."""
    n_subjects, n_counted, n_new = map(int, args[:3])
    wire = WireCounter()
    doc = config.model_dump()
    doc["storage"]["catalog_url"] = _through(doc["storage"]["catalog_url"], wire.port)
    doc["keyring"]["store_url"] = _through(doc["keyring"]["store_url"], wire.port)
    config = Config.model_validate(doc)
    out: dict[str, Any] = {}
    open_start = wire.snapshot()[0]
    kek = KekCounter()
    ks = _open_worker(folder, config)
    out["open KEK calls"] = dict(kek.calls)
    try:
        m = ks.memories
        subjects = [f"s{i}" for i in range(n_subjects)]
        for s in subjects:  # load each subject, unwrap its keys: then warm
            m.put(s, NS, "warm-count", value(s, -1))
            m.get(s, NS, "warm-count")
        out["open + warm-up KEK calls"] = dict(kek.calls)
        out["open + warm-up connections"] = (wire.snapshot()[0] - open_start)["connections"]

        def per_op(label: str, n: int, fn: Callable[[int], Any]) -> None:
            before, texts0 = wire.snapshot()
            k0, http0 = kek.total(), kek.calls["http requests"]
            for i in range(n):
                fn(i)
            after, texts1 = wire.snapshot()
            counts = after - before
            out[label] = {k: round(v / n, 3) for k, v in sorted(counts.items())}
            out[label]["KEK calls"] = round((kek.total() - k0) / n, 3)
            if http0:
                out[label]["KEK http requests"] = round((kek.calls["http requests"] - http0) / n, 3)
            out[label + ": statements by text (per op)"] = {
                t: round(v / n, 3) for t, v in (texts1 - texts0).most_common(12)
            }

        per_op(
            "warm put",
            n_counted,
            lambda i: m.put(subjects[i % n_subjects], NS, f"c{i}", value("c", i)),
        )
        per_op("warm get", n_counted, lambda i: m.get(subjects[i % n_subjects], NS, f"c{i}"))
        tag = uuid.uuid4().hex[:6]
        k_before = kek.calls.copy()
        per_op("first put of a new subject", n_new, lambda i: m.put(f"new-{tag}-{i}", NS, "k", {}))
        out["KEK calls per new subject, by operation"] = {
            k: round(v / n_new, 3) for k, v in (kek.calls - k_before).items()
        }
    finally:
        ks.close()
    return out


def worker_big_setup(ks: Keyshred, args: list[str]) -> dict[str, Any]:
    """Write a 10,000-memory subject, compact it into its segment on S3, and write a
    plaintext copy of that segment (same rows, same writer options, no PME) beside
    it for pyarrow's baseline."""
    import pyarrow.parquet as pq

    subject, n, plain_key = args[0], int(args[1]), args[2]
    m = ks.memories
    for start in range(0, n, 1000):
        m.put_many(
            subject, [PutItem(NS, f"k{i}", value(subject, i)) for i in range(start, start + 1000)]
        )
    m.flush()
    ref = ks.subject_ref(subject)
    part = m._partition(ref)
    with part.flocked():
        part.flush()
        (seg,) = part._segments.values()
        objects = m._objects
        source = objects.open_parquet(
            f"subject={ref}/{seg.name}", decryption_properties=m._pme.decryption()
        )
        table = source.read()
        meta = source.metadata
    objects.write_table(plain_key, table, write_page_checksum=True)
    fs = objects.fs
    sizes = {
        "keyshred segment bytes": fs.get_file_info(objects.path(f"subject={ref}/{seg.name}")).size,
        "plain copy bytes": fs.get_file_info(objects.path(plain_key)).size,
    }
    with objects.fs.open_input_file(objects.path(plain_key)) as fh:
        plain_meta = pq.ParquetFile(fh).metadata
    return {
        "rows": table.num_rows,
        "row groups": [meta.num_row_groups, plain_meta.num_row_groups],
        "compression": meta.row_group(0).column(0).compression,
        "plain path": objects.path(plain_key),
        "hot rows left": m._hot.counts(ref)[1],
        **sizes,
    }


def worker_cold_keyshred(folder: Path, config: Config, args: list[str], profile: bool) -> Any:
    """A fresh process and folder: open, then the first read of the big subject
    (the whole partition from S3: catalog state, segment, PME, unsealing), then a
    warm get and a count."""
    subject, n = args[0], int(args[1])
    kek = KekCounter()
    t = time.perf_counter()
    ks = Keyshred.init(folder, config, embeddings=bag_of_words)
    opened = time.perf_counter() - t
    at_open = dict(kek.calls)
    try:
        with profiled(profile, "keyshred cold read"):
            t = time.perf_counter()
            got = ks.memories.get(subject, NS, "k0")
            cold = time.perf_counter() - t
        assert got is not None
        t = time.perf_counter()
        ks.memories.get(subject, NS, f"k{n - 1}")
        warm = time.perf_counter() - t
        count = ks.memories.count(subject)
        assert count == n, count
    finally:
        ks.close()
    return {
        "open s": opened,
        "cold read s": cold,
        "warm get s": warm,
        "KEK calls at open": at_open,
        "KEK calls in all": dict(kek.calls),
    }


def worker_cold_pyarrow(config: Config, args: list[str], profile: bool) -> Any:
    """A fresh process: pyarrow reads the plaintext copy from the same bucket; then
    the same table's columns as Python values (what a store then indexes)."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    path = args[0]
    t = time.perf_counter()
    endpoint = config.s3.endpoint_url or ""
    fs = pafs.S3FileSystem(
        endpoint_override=endpoint.split("://", 1)[-1],
        scheme=endpoint.split("://", 1)[0],
        region=config.s3.region or "us-east-1",
    )
    made = time.perf_counter() - t
    with profiled(profile, "pyarrow cold read"):
        t = time.perf_counter()
        table = pq.read_table(path, filesystem=fs)
        read = time.perf_counter() - t
    t = time.perf_counter()
    columns = {name: table.column(name).to_pylist() for name in table.column_names}
    pylist = time.perf_counter() - t
    assert len(columns["memory_id"]) == table.num_rows
    return {"filesystem s": made, "read_table s": read, "to_pylist s": pylist}


def worker_main(argv: list[str], profile: bool) -> None:
    role, folder, raw, *args = argv
    if os.environ.get("KS_BENCH_READS_IN_TRANSACTIONS") == "1":
        # The engine before 502a09b: every PostgreSQL read in a transaction of its
        # own (BEGIN, SELECT, COMMIT), for a same-run comparison.
        from keyshred import db

        db._autocommit = lambda conn: False
    config = Config.model_validate_json(raw)
    if role == "count":
        print("RESULT " + json.dumps(worker_count(Path(folder), config, args)))
        return
    if role == "cold-keyshred":
        print("RESULT " + json.dumps(worker_cold_keyshred(Path(folder), config, args, profile)))
        return
    if role == "cold-pyarrow":
        print("RESULT " + json.dumps(worker_cold_pyarrow(config, args, profile)))
        return
    ks = _open_worker(Path(folder), config)
    try:
        if role == "setup":
            for i in range(int(args[0])):
                ks.memories.put(f"s{i}", NS, "setup", value(i, 0))
        elif role == "throughput":
            with profiled(profile, f"throughput worker {args[0]}"):
                worker_throughput(ks, args)
        elif role == "big-setup":
            print("RESULT " + json.dumps(worker_big_setup(ks, args)))
        else:
            raise SystemExit(f"unknown worker role {role}")
    finally:
        ks.close()


# =====================================================================================
# Shared profile: the orchestrator
# =====================================================================================


@contextlib.contextmanager
def shared_stores(
    kek: str, tmp: Path, reads_in_transactions: bool = False
) -> Iterator[tuple[Config, dict[str, str]]]:
    """PostgreSQL (a fresh schema), moto's S3 server (a versioned bucket) and the
    KEK, configured as tests/test_shared_workers.py does; yields the workers'
    config and their environment."""
    import boto3

    from tests.servers import moto_server, openbao_dev_server

    subprocess.run(["bash", str(ROOT / "scripts" / "ensure-postgres.sh")], check=True)
    with contextlib.ExitStack() as stack:
        moto = stack.enter_context(moto_server())
        env = dict(os.environ)
        if reads_in_transactions:
            env["KS_BENCH_READS_IN_TRANSACTIONS"] = "1"
        if kek == "openbao":
            bao = stack.enter_context(openbao_dev_server())
            env["VAULT_TOKEN"] = bao.token
            kek_doc: dict[str, Any] = {
                "provider": "vault",
                "vault": {"url": bao.url, "key": f"ks-bench-{uuid.uuid4().hex[:10]}"},
            }
        else:
            kek_doc = {
                "local_path": str(tmp / "shared-kek.json"),
                "archive_local_path": str(tmp / "shared-archive-kek.json"),
            }
        schema = stack.enter_context(PgSchema())
        bucket = f"ks-bench-{uuid.uuid4().hex[:10]}"
        s3 = boto3.client("s3", endpoint_url=moto.url, region_name="us-east-1")
        s3.create_bucket(Bucket=bucket)
        s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
        config = Config.model_validate(
            {
                "profile": "distributed",
                "storage": {
                    "catalog_url": schema.url,
                    "uri": f"s3://{bucket}/parts",
                },
                "keyring": {"store_url": schema.uri},
                "kek": kek_doc,
                "vectors": {"uri": f"s3://{bucket}/vectors"},
                "s3": {"endpoint_url": moto.url, "region": "us-east-1"},
            }
        )
        yield config, env


class Workers:
    def __init__(self, config: Config, env: dict[str, str], tmp: Path, profile: bool) -> None:
        self.raw = config.model_dump_json()
        self.env, self.tmp, self.profile = env, tmp, profile

    def argv(self, role: str, folder: str, *args: str) -> list[str]:
        flag = ["--profile"] if self.profile else []
        return [
            sys.executable,
            __file__,
            *flag,
            "--worker",
            role,
            str(self.tmp / folder),
            self.raw,
            *args,
        ]

    def run(self, role: str, folder: str, *args: str) -> Any:
        proc = subprocess.run(
            self.argv(role, folder, *args),
            capture_output=True,
            text=True,
            env=self.env,
            check=False,
        )
        if proc.returncode != 0:
            raise SystemExit(f"worker {role} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        self._keep_profile(role, proc.stderr)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        return json.loads(lines[-1].removeprefix("RESULT ")) if lines else None

    def _keep_profile(self, label: str, stderr: str) -> None:
        if self.profile and "=== profile" in stderr:
            fd, path = tempfile.mkstemp(prefix=f"bench-memories-{label}-", suffix=".prof.txt")
            with os.fdopen(fd, "w") as fh:
                fh.write(stderr)
            print(f"  (profile of {label}: {path})")

    def throughput(self, n: int, rnd: int, size: dict[str, int]) -> dict[str, float]:
        """``n`` workers at once: puts/s and gets/s over the span from the first
        worker's start to the last one's end."""
        procs = [
            subprocess.Popen(
                self.argv(
                    "throughput",
                    f"w{w}",
                    str(w),
                    str(rnd),
                    str(size["s_puts"]),
                    str(size["s_gets"]),
                    str(size["s_subjects"]),
                ),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=self.env,
            )
            for w in range(n)
        ]
        try:
            out: dict[str, float] = {}
            for p in procs:
                self._expect(p, "READY")
            for phase in ("PUTS", "GETS"):
                for p in procs:
                    assert p.stdin is not None
                    p.stdin.write("GO\n")
                    p.stdin.flush()
                spans = [json.loads(self._expect(p, phase)) for p in procs]
                total = sum(s["n"] for s in spans)
                wall = max(s["t1"] for s in spans) - min(s["t0"] for s in spans)
                out[f"{phase.lower()}/s"] = total / wall
                out[f"{phase.lower()}/s per worker"] = statistics.mean(
                    s["n"] / (s["t1"] - s["t0"]) for s in spans
                )
            for p in procs:
                _, err = p.communicate(timeout=600)
                if p.returncode != 0:
                    raise SystemExit(f"throughput worker failed:\n{err[-4000:]}")
                self._keep_profile(f"throughput-{n}w", err)
            return out
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()

    @staticmethod
    def _expect(proc: subprocess.Popen[str], word: str) -> str:
        assert proc.stdout is not None
        while True:
            line = proc.stdout.readline()
            if not line:
                err = proc.stderr.read() if proc.stderr else ""
                raise SystemExit(f"a worker exited before {word}:\n{err[-4000:]}")
            if line.startswith(word):
                return line[len(word) :].strip()


def shared_main(args: argparse.Namespace, size: dict[str, int]) -> None:
    before = "; reads in transactions (before 502a09b)" if args.reads_in_transactions else ""
    print(
        f"\n## shared profile: PostgreSQL 127.0.0.1:5432/test, moto S3 over HTTP, "
        f"KEK {args.kek}{before}; subject set of {size['s_subjects']}, per worker "
        f"{size['s_puts']} puts then {size['s_gets']} gets, {size['s_rounds']} round(s)"
    )
    with tempfile.TemporaryDirectory() as raw_tmp:
        tmp = Path(raw_tmp)
        with shared_stores(args.kek, tmp, args.reads_in_transactions) as (config, env):
            workers = Workers(config, env, tmp, args.profile)
            workers.run("setup", "setup", str(size["s_subjects"]))

            print("\n### throughput (warm), workers at once")
            runs: dict[int, list[dict[str, float]]] = {}
            for rnd in range(size["s_rounds"]):
                order = (1, 2, 4) if rnd % 2 == 0 else (4, 2, 1)
                for n in order:
                    got = workers.throughput(n, rnd, size)
                    runs.setdefault(n, []).append(got)
                    print(
                        f"  round {rnd + 1}, {n} worker(s): " + json.dumps(_rounded(got)),
                        flush=True,
                    )
            print(
                f"\n  {'workers':<8}{'puts/s median [best]':>26}{'gets/s median [best]':>26}"
                f"{'puts/s per worker':>20}{'gets/s per worker':>20}"
            )
            for n in (1, 2, 4):
                rs = runs[n]
                cells = [
                    f"{statistics.median(r[m] for r in rs):,.0f} [{max(r[m] for r in rs):,.0f}]"
                    for m in ("puts/s", "gets/s")
                ] + [
                    f"{statistics.median(r[m] for r in rs):,.0f}"
                    for m in ("puts/s per worker", "gets/s per worker")
                ]
                print(f"  {n:<8}{cells[0]:>26}{cells[1]:>26}{cells[2]:>20}{cells[3]:>20}")

            print("\n### database round trips, commits and KEK calls (one fresh worker)")
            counted = workers.run(
                "count",
                "counter",
                str(size["s_subjects"]),
                str(size["s_counted"]),
                str(size["s_new"]),
            )
            for label, figures in counted.items():
                print(f"  {label}: {json.dumps(figures)}")

            print("\n### cold read of a 10,000-memory subject from S3 (fresh processes)")
            big = workers.run(
                "big-setup", "big", "big-subject", str(size["s_big"]), "plain/seg.parquet"
            )
            print(f"  setup: {json.dumps(big)}")
            ks_runs, pa_runs = [], []
            for rnd in range(size["s_cold_rounds"]):
                pair = [("keyshred", ks_runs), ("pyarrow", pa_runs)]
                for name, sink in pair if rnd % 2 == 0 else reversed(pair):
                    if name == "keyshred":
                        got = workers.run(
                            "cold-keyshred", f"cold{rnd}", "big-subject", str(size["s_big"])
                        )
                    else:
                        got = workers.run("cold-pyarrow", f"cold{rnd}", big["plain path"])
                    sink.append(got)
                    print(f"  round {rnd + 1} {name}: {json.dumps(_rounded(got))}", flush=True)
    ks_cold = [r["cold read s"] for r in ks_runs]
    pa_read = [r["read_table s"] for r in pa_runs]
    pa_py = [r["read_table s"] + r["to_pylist s"] for r in pa_runs]
    for label, xs in (
        ("keyshred cold read", ks_cold),
        ("pyarrow read_table", pa_read),
        ("pyarrow read_table + to_pylist", pa_py),
    ):
        print(f"  {label}: median {statistics.median(xs) * 1e3:.1f} ms [best {min(xs) * 1e3:.1f}]")
    ratio_best = min(ks_cold) / min(pa_read)
    ratio_med = statistics.median(ks_cold) / statistics.median(pa_read)
    ratio_py = statistics.median(ks_cold) / statistics.median(pa_py)

    print("\ntargets (issue #21, shared):")
    wp = counted["warm put"]
    _target(
        "one commit per warm put (transactions that wrote)",
        wp.get("COMMIT, wrote", 0) == 1,
        f"{wp.get('COMMIT, wrote', 0)} written + {wp.get('COMMIT, read only', 0)} "
        f"read-only COMMITs, {wp.get('round trips', 0)} round trips",
    )
    new = counted["first put of a new subject"]["KEK calls"]
    _target("KEK calls per new subject <= 1", new <= 1, f"{new}")
    _target(
        "cold read <= 1.5x pyarrow read_table (medians of the rounds)",
        ratio_med <= 1.5,
        f"{ratio_med:.2f}x (best rounds {ratio_best:.2f}x; vs read_table + to_pylist "
        f"{ratio_py:.2f}x)",
    )


def _rounded(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in doc.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="smaller workload, one round")
    parser.add_argument("--embedded", action="store_true", help="only the embedded profile")
    parser.add_argument("--shared", action="store_true", help="only the shared profile")
    parser.add_argument("--kek", choices=("local", "openbao"), default="local")
    parser.add_argument("--profile", action="store_true", help="cProfile the measured parts")
    parser.add_argument(
        "--reads-in-transactions",
        action="store_true",
        help="shared workers run PostgreSQL reads each in a transaction (before 502a09b)",
    )
    parser.add_argument("--fsyncs", action="store_true", help="embedded: count fsyncs per op")
    parser.add_argument("--subjects", type=int, default=None, help="embedded: subjects (5,500)")
    parser.add_argument("--rounds", type=int, default=None, help="embedded: rounds (5)")
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--fsync-probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = dict(SIZES["quick" if args.quick else "full"])
    if args.subjects:
        size["subjects"] = args.subjects
    if args.rounds:
        size["rounds"] = args.rounds
    if args.engine:
        embedded_child(args.engine, size, args.fsync_probe)
        return
    if args.worker:
        worker_main(args.worker, args.profile)
        return
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} cores; "
        f"mode {'quick' if args.quick else 'full'}\nuptime at the start: {uptime()}"
    )
    if not args.shared:
        embedded_main(args, size)
    if not args.embedded:
        shared_main(args, size)
    print(f"\nuptime at the end: {uptime()}")


if __name__ == "__main__":
    main()
