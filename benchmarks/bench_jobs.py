"""Jobs (``keyshred.jobs``): what a claim costs, and erasure throughput by workers.

1. Queue: N no-op jobs enqueued, then claimed, run and settled one by one (claim
   transaction + settle transaction + heartbeat thread), against the baseline of
   one bare ``UPDATE`` transaction per job on the same table: the floor of any
   queue that records each job's end. SQLite (the embedded catalog) and PostgreSQL.
2. Erasure throughput: R requests (subjects with M memories each) submitted, then
   drained by W ``keyshred worker --once`` processes at once (W = 1, 2, 4 on
   PostgreSQL; 1 on SQLite, which has one writer): requests per second, wall clock
   from the workers' start to the last one's exit (process start included, so
   small R understates the steady rate).

    .venv/bin/python benchmarks/bench_jobs.py [--quick]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import PgSchema  # noqa: E402

from keyshred import Config, Keyshred  # noqa: E402
from keyshred.jobs import Job, JobOutcome  # noqa: E402
from keyshred.schema import jobs  # noqa: E402
from tests.storage.test_vectors import bag_of_words  # noqa: E402

WORKER = ROOT / "tests" / "jobs_worker.py"


def _config(url: str | None) -> Config:
    return Config.model_validate(
        {
            "storage": {"catalog_url": url},
            "jobs": {"retention_every_seconds": 0, "backup_maintain_every_seconds": 0},
        }
    )


def bench_queue(url: str | None, n: int, tmp: Path) -> tuple[float, float]:
    def noop(job: Job, stop: object) -> JobOutcome:
        return JobOutcome.done()

    with Keyshred.init(
        tmp / f"q-{uuid.uuid4().hex[:6]}", _config(url), embeddings=bag_of_words
    ) as ks:
        ks.jobs.register("bench.noop", noop)
        for i in range(n):
            ks.jobs.queue.enqueue("bench.noop", {"i": str(i)})
        start = time.perf_counter()
        ran = ks.jobs.run_pending(["bench.noop"])
        queue_s = time.perf_counter() - start
        assert ran == n
        ids = [j.job_id for j in ks.jobs.queue.list(kinds=["bench.noop"])]
        start = time.perf_counter()
        for job_id in ids:  # the baseline: one bare UPDATE transaction per job
            with ks._catalog.transaction() as conn:
                conn.execute(jobs.update().where(jobs.c.job_id == job_id).values(attempts=9))
        base_s = time.perf_counter() - start
    return n / queue_s, n / base_s


def bench_erasure(url: str | None, requests: int, memories: int, workers: int, tmp: Path) -> float:
    data = tmp / f"e-{uuid.uuid4().hex[:6]}"
    config = _config(url)
    with Keyshred.init(data, config, embeddings=bag_of_words) as ks:
        for r in range(requests):
            subject = f"subject-{r}"
            for m in range(memories):
                ks.memories.put(subject, ("m",), f"k{m}", f"note {m} of {r}")
            ks.erasure.submit(subject, requested_by="bench", reason="throughput")
    start = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(data), config.model_dump_json(), "drain"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for _ in range(workers)
    ]
    for p in procs:
        _, err = p.communicate(timeout=3600)
        assert p.returncode == 0, err[-2000:]
    seconds = time.perf_counter() - start
    with Keyshred.open(data, config, embeddings=bag_of_words) as ks:
        done = ks.jobs.queue.depth()["succeeded"]
    assert done == requests, done
    return requests / seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n, requests, memories = (200, 12, 5) if args.quick else (1000, 40, 10)
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        with PgSchema() as pg:
            for name, url in (("sqlite", None), ("postgresql", pg.url)):
                rate, base = bench_queue(url, n, tmp)
                print(
                    f"queue {name}: {rate:.0f} jobs/s claimed+run+settled; bare UPDATE "
                    f"transaction {base:.0f}/s; ratio {rate / base:.2f}"
                )
            rate = bench_erasure(None, requests, memories, 1, tmp)
            print(f"erasure sqlite, 1 worker: {rate:.2f} requests/s ({requests} requests)")
            for workers in (1, 2, 4):
                with PgSchema() as schema:
                    rate = bench_erasure(schema.url, requests, memories, workers, tmp)
                print(
                    f"erasure postgresql, {workers} worker(s): {rate:.2f} requests/s "
                    f"({requests} requests)"
                )


if __name__ == "__main__":
    main()
