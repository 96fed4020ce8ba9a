"""Eviction latency (issue 22 item 2): the time from a suppression's commit to the
LAST process having evicted the subject, with 4 worker processes on the machine's
PostgreSQL.

Set-up: a fresh schema on 127.0.0.1:5432 (catalog and key store), a local KEK file
and a shared partition folder; one erasing process (this one) writes N subjects
(one indexed memory each); 4 worker processes (``tests/eviction_worker.py``) read
every subject, so each holds its unwrapped DEK, decrypted rows and decrypted
vectors (key and cache TTLs of an hour: only the event evicts). Then this process
erases the N subjects one after another (``ks.erase``, the whole request).

Measured: each receipt's ``metrics.eviction_max_latency_ms`` — the largest
``evicted_at - published_at`` over the processes that acknowledged, both read from
PostgreSQL's ``clock_timestamp()`` (``published_at`` inside the suppressing
transaction just before its commit, ``evicted_at`` in the ack's INSERT after the
process evicted), so no clocks need to agree. Five processes acknowledge each
event: the four workers and the erasing one's own listener. Printed: p50/p95/max
over the N erasures, and how many receipts counted all five.

Run: ``.venv/bin/python benchmarks/bench_eviction.py [N]`` (default 50).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import PgSchema

from keyshred import Config, Keyshred
from tests.storage.test_vectors import bag_of_words
from tests.test_eviction import NS, Worker

WORKERS = 4
TARGET_MS = 100.0


def _config(schema: PgSchema, tmp: Path) -> Config:
    return Config.model_validate(
        {
            "profile": "distributed",
            "storage": {
                "catalog_url": schema.url,
                "uri": str(tmp / "parts"),
                "cache_ttl_seconds": 3600,
                "cache_sweep_seconds": 5,
            },
            "keyring": {
                "store_url": schema.uri,
                "cache_ttl_seconds": 3600,
            },
            "vectors": {"uri": str(tmp / "vectors")},
            "kek": {
                "local_path": str(tmp / "kek.json"),
                "archive_local_path": str(tmp / "archive-kek.json"),
            },
        }
    )


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    schema = PgSchema()
    workers: list[Worker] = []
    try:
        with tempfile.TemporaryDirectory() as raw:
            tmp = Path(raw)
            config = _config(schema, tmp)
            ks = Keyshred.init(tmp / "eraser", config, embeddings=bag_of_words)
            try:
                subjects = [f"subject-{i}" for i in range(n)]
                for s in subjects:
                    ks.memories.put(s, NS, "k0", {"text": f"{s} paddles kayaks"}, index=True)
                workers.extend(Worker(tmp / f"w{w}", config, *subjects) for w in range(WORKERS))
                for worker in workers:
                    worker.ready()
                latencies: list[float] = []
                complete = 0
                started = time.perf_counter()
                for s in subjects:
                    req = ks.erase(s, requested_by="bench", reason="bench")
                    receipt = ks.erasure.receipt(req.request_id)
                    assert receipt is not None and receipt.metrics is not None
                    m = receipt.metrics
                    if m.eviction_max_latency_ms is not None:
                        latencies.append(m.eviction_max_latency_ms)
                    complete += m.eviction_processes == WORKERS + 1
                elapsed = time.perf_counter() - started
                left = [w.held(*subjects[-3:]) for w in workers]
                for w in workers:
                    w.quit()
            finally:
                ks.close()
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
        schema.close()
    print(f"eviction latency, suppression commit -> last of {WORKERS + 1} processes evicted")
    print(f"  erasures: {n} ({elapsed:.1f} s in all, whole requests)")
    print(f"  receipts counting all {WORKERS + 1} processes: {complete}/{n}")
    print(
        f"  p50 {statistics.median(latencies):.1f} ms  p95 {_pct(latencies, 0.95):.1f} ms  "
        f"max {max(latencies):.1f} ms  (target <= {TARGET_MS:.0f} ms)"
    )
    print(f"  workers' caches of the last subjects afterwards: {left}")


if __name__ == "__main__":
    main()
