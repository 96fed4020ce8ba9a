"""Erasure benchmark: how fast a subject is suppressed, crypto-erased and completed,
and how long two baselines keep the bytes on disk.

keyshred: a subject with 10,000 memories and 10,000 vectors, in a store with 100 and
with 10,000 subjects; times from the request to ``suppressed``, to keys destroyed
(crypto-erased: every copy unreadable from here) and to ``completed`` (partitions
dropped, catalog cleaned, verified, receipt signed).

Baselines, same data, time until the probe bytes are gone from every file:
a shared LanceDB table (``delete`` + ``optimize`` + ``cleanup_old_versions``) and
LangGraph's ``SqliteStore`` (per-key deletes; SQLite keeps deleted bytes in free
pages until ``VACUUM``, so that is timed too).

Run: ``.venv/bin/python benchmarks/bench_erasure.py`` (takes a few minutes: it
builds a 10,000-subject store).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lancedb
from langgraph.store.base import PutOp
from langgraph.store.sqlite import SqliteStore

from keyshred import Keyshred
from keyshred.storage.memories import PutItem

N = 10_000
DIMS = 384
PROBE = "zqprobe-41d7"
STEP_TIMES: dict[str, float] = {}


def random_embeddings(texts: list[str]) -> Any:
    rng = np.random.default_rng(len(texts))
    return rng.standard_normal((len(texts), DIMS)).astype(np.float32)


def bytes_present(root: Path, needle: bytes) -> bool:
    return any(needle in p.read_bytes() for p in root.rglob("*") if p.is_file())


def keyshred_run(others: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        ks = Keyshred.init(Path(tmp) / "data", embeddings=random_embeddings)
        for start in range(0, others, 500):
            for s in range(start, min(others, start + 500)):
                ks.memories.put(f"other-{s}", ("m",), "k", {"text": "hello"})
        victim = "victim@example.org"
        for start in range(0, N, 1000):
            ks.memories.put_many(
                victim,
                [
                    PutItem(("m",), f"k{i}", {"text": f"{PROBE} {i}"}, index=True)
                    for i in range(start, start + 1000)
                ],
            )
        ks.memories.flush()
        ks.close()
        ks = Keyshred.open(Path(tmp) / "data", embeddings=random_embeddings)
        marks: dict[str, float] = {}
        STEP_TIMES.clear()
        start = time.perf_counter()
        ks.erasure.on_step = lambda step, _req: marks.setdefault(step, time.perf_counter())
        req = ks.erase(victim, requested_by="bench", reason="benchmark")
        end = time.perf_counter()
        assert req.state == "completed", req.error
        gone = not bytes_present(Path(tmp) / "data", PROBE.encode())
        ks.close()
        prev = start
        for step, at in sorted(marks.items(), key=lambda kv: kv[1]):
            STEP_TIMES[step] = (at - prev) * 1e3
            prev = at
        return {
            "suppressed ms": (marks["suppress"] - start) * 1e3,
            "crypto-erased ms": (marks["destroy_keys"] - start) * 1e3,
            "completed ms": (end - start) * 1e3,
            "probe bytes gone": float(gone),
        }


def lancedb_baseline() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        db = lancedb.connect(tmp)
        # A binary column with random padding: Lance compresses string columns, which
        # would hide the probe from a byte scan before any deletion.
        rows = {
            "subject": ["victim"] * N + [f"other-{i}" for i in range(N)],
            "payload": [f"{PROBE} {i}".encode() + os.urandom(32) for i in range(N)]
            + [b"hello" + os.urandom(32)] * N,
            "vector": pa.FixedSizeListArray.from_arrays(
                pa.array(random_embeddings(["x"] * (2 * N)).reshape(-1)), DIMS
            ),
        }
        table = db.create_table("memories", pa.table(rows))
        visible = bytes_present(Path(tmp), PROBE.encode())
        start = time.perf_counter()
        table.delete("subject = 'victim'")
        deleted = time.perf_counter()
        still_after_delete = bytes_present(Path(tmp), PROBE.encode())
        table.optimize(cleanup_older_than=timedelta(0), delete_unverified=True)
        end = time.perf_counter()
        return {
            "probe visible before delete": float(visible),
            "delete ms": (deleted - start) * 1e3,
            "bytes on disk after delete": float(still_after_delete),
            "gone after optimize+cleanup ms": (end - start) * 1e3,
            "probe bytes gone": float(not bytes_present(Path(tmp), PROBE.encode())),
        }


def sqlite_baseline() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "store.db")
        with SqliteStore.from_conn_string(path) as store:
            store.setup()
            for start in range(0, N, 1000):
                store.batch(
                    [
                        PutOp(("m", "victim"), f"k{i}", {"text": f"{PROBE} {i}"})
                        for i in range(start, start + 1000)
                    ]
                )
                store.batch(
                    [
                        PutOp(("m", f"other-{i}"), "k", {"text": "hello"})
                        for i in range(start, start + 1000)
                    ]
                )
            visible = bytes_present(Path(tmp), PROBE.encode())
            start = time.perf_counter()
            for i in range(N):
                store.delete(("m", "victim"), f"k{i}")
            deleted = time.perf_counter()
        still = bytes_present(Path(tmp), PROBE.encode())
        import sqlite3

        vstart = time.perf_counter()
        conn = sqlite3.connect(path)
        conn.execute("VACUUM")
        conn.close()
        vend = time.perf_counter()
        return {
            "probe visible before delete": float(visible),
            "per-key deletes ms": (deleted - start) * 1e3,
            "bytes on disk after deletes": float(still),
            "gone after VACUUM ms": (deleted - start + vend - vstart) * 1e3,
            "probe bytes gone": float(not bytes_present(Path(tmp), PROBE.encode())),
        }


def main() -> None:
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores; victim: {N} memories")
    small = keyshred_run(100)
    large = keyshred_run(10_000)
    print(
        "steps (10,000 subjects, ms): " + ", ".join(f"{k} {v:.0f}" for k, v in STEP_TIMES.items())
    )
    print(f"\n{'keyshred':<22}{'100 subjects':>16}{'10,000 subjects':>18}{'ratio':>8}")
    for key in ("suppressed ms", "crypto-erased ms", "completed ms"):
        print(f"{key:<22}{small[key]:>16.1f}{large[key]:>18.1f}{large[key] / small[key]:>8.2f}")
    gone = (small["probe bytes gone"], large["probe bytes gone"])
    print(f"{'probe bytes gone':<22}{gone[0]:>16.0f}{gone[1]:>18.0f}")
    for name, result in (
        ("shared LanceDB table", lancedb_baseline()),
        ("LangGraph SqliteStore", sqlite_baseline()),
    ):
        print(f"\n{name}")
        for key, value in result.items():
            print(f"  {key:<32}{value:>12.1f}")


if __name__ == "__main__":
    main()
