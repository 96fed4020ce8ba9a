"""Memory store benchmark: keyshred vs the same engine unencrypted vs LangGraph's
SqliteStore (plaintext), on one workload in one run.

Workload: 10,000 memories over 100 subjects (100 each, ~150-byte JSON values) written
one put at a time, then again in batches (one ``put_many`` per subject; LangGraph:
one ``batch`` of PutOps per namespace), warm gets of every memory, and a subject with
10,000 memories for search (namespace prefix, newest 10) and cold open (a fresh
process state: open, first search). Durability: keyshred fsyncs its append log on
every write; SqliteStore runs SQLite's default rollback journal with
synchronous=FULL, also one durable commit per put.

Run: ``.venv/bin/python benchmarks/bench_memories.py``
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from langgraph.store.base import PutOp
from langgraph.store.sqlite import SqliteStore

from keyshred import Keyshred
from keyshred.storage.memories import MemoryStore, PutItem
from keyshred.storage.sealer import PlaintextSealer

SUBJECTS = 100
PER_SUBJECT = 100
BIG = 10_000


def value(s: int, i: int) -> dict[str, Any]:
    return {"text": f"subject {s} memory {i}: prefers tea over coffee", "i": i, "tags": ["a", "b"]}


class Engine:
    name = ""

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


class KeyshredEngine(Engine):
    def __init__(self, root: Path, *, encrypt: bool) -> None:
        self.name = "keyshred" if encrypt else "keyshred, encryption off"
        self.root, self.encrypt = root, encrypt
        self.ks = Keyshred.init(root)
        self.store = self._store()

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
            f"user-{s}", [PutItem(("memories", f"user-{s}"), f"b{i}", value(s, i)) for i in items]
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
        self.ks = Keyshred.open(self.root)
        self.store = self._store()

    def close(self) -> None:
        self.store.close()
        self.ks.close()


class SqliteEngine(Engine):
    name = "LangGraph SqliteStore"

    def __init__(self, root: Path) -> None:
        self.path = str(root / "store.db")
        self._open()
        self.store.setup()

    def _open(self) -> None:
        self._cm = SqliteStore.from_conn_string(self.path)
        self.store = self._cm.__enter__()

    def put(self, s: int, i: int) -> None:
        self.store.put(("memories", f"user-{s}"), f"k{i}", value(s, i))

    def put_batch(self, s: int, items: list[int]) -> None:
        self.store.batch([PutOp(("memories", f"user-{s}"), f"b{i}", value(s, i)) for i in items])

    def get(self, s: int, i: int) -> Any:
        return self.store.get(("memories", f"user-{s}"), f"k{i}")

    def search(self, s: int) -> list[Any]:
        return self.store.search(("memories", f"user-{s}"), limit=10)

    def reopen(self) -> None:
        self._cm.__exit__(None, None, None)
        self._open()

    def close(self) -> None:
        self._cm.__exit__(None, None, None)


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def pct(samples: list[float], q: float) -> float:
    samples = sorted(samples)
    return samples[min(len(samples) - 1, int(len(samples) * q))]


def run(engine: Engine) -> dict[str, float]:
    out: dict[str, float] = {}
    n = SUBJECTS * PER_SUBJECT
    out["single put/s"] = n / timed(
        lambda: [engine.put(s, i) for s in range(SUBJECTS) for i in range(PER_SUBJECT)]
    )
    out["batched put/s"] = n / timed(
        lambda: [engine.put_batch(s, list(range(PER_SUBJECT))) for s in range(SUBJECTS)]
    )
    for s in range(SUBJECTS):  # warm every partition / page cache
        engine.get(s, 0)
    lat = []
    for s in range(SUBJECTS):
        for i in range(PER_SUBJECT):
            start = time.perf_counter()
            got = engine.get(s, i)
            lat.append(time.perf_counter() - start)
            assert got is not None
    out["get p50 ms"] = pct(lat, 0.5) * 1e3
    out["get p99 ms"] = pct(lat, 0.99) * 1e3
    big = SUBJECTS + 1
    for start in range(0, BIG, 1000):
        engine.put_batch(big, list(range(start, start + 1000)))
    engine.search(big)
    out["search 10k subject ms"] = (
        statistics.median(timed(lambda: engine.search(big)) for _ in range(20)) * 1e3
    )
    colds = []
    for _ in range(3):
        engine.reopen()
        colds.append(timed(lambda: engine.search(big)))
    out["cold open 10k subject ms"] = statistics.median(colds) * 1e3
    return out


ENGINES: dict[str, Callable[[Path], Engine]] = {
    "keyshred": lambda p: KeyshredEngine(p, encrypt=True),
    "plain": lambda p: KeyshredEngine(p, encrypt=False),
    "sqlite": SqliteEngine,
}


def one(name: str) -> None:
    """Run one engine in this (fresh) process and print its results as JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        engine = ENGINES[name](Path(tmp))
        result = run(engine)
        engine.close()
    print(json.dumps({"engine": engine.name, "result": result}))


def main() -> None:
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} cores; workload: "
        f"{SUBJECTS} subjects x {PER_SUBJECT} memories, plus one {BIG}-memory subject"
    )
    # Each engine runs in a fresh process (no heap or page cache carried over from
    # another engine), twice, in alternating order; the better of the two runs is
    # kept for each metric, which filters out this shared machine's noise.
    runs: dict[str, list[dict[str, float]]] = {}
    for order in (list(ENGINES), list(reversed(ENGINES))):
        for name in order:
            proc = subprocess.run(
                [sys.executable, __file__, "--engine", name],
                capture_output=True,
                text=True,
                check=True,
            )
            doc = json.loads(proc.stdout.strip().splitlines()[-1])
            runs.setdefault(doc["engine"], []).append(doc["result"])
    results = {
        name: {m: (max if m.endswith("/s") else min)(r[m] for r in rs) for m in rs[0]}
        for name, rs in runs.items()
    }
    names = list(results)
    metrics = list(results[names[0]])
    print(f"\n{'metric':<26}" + "".join(f"{n:>28}" for n in names))
    for m in metrics:
        print(f"{m:<26}" + "".join(f"{results[n][m]:>28,.2f}" for n in names))
    ks, plain, lg = (results[n] for n in names)
    print("\nratios: cost of keyshred relative to the other (>1 means keyshred is slower)")
    for m in metrics:
        flip = m.endswith("/s")
        r_plain = plain[m] / ks[m] if flip else ks[m] / plain[m]
        r_lg = lg[m] / ks[m] if flip else ks[m] / lg[m]
        print(f"  {m:<26} vs encryption off {r_plain:6.2f}x   vs SqliteStore {r_lg:6.2f}x")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--engine":
        one(sys.argv[2])
    else:
        main()
