"""Erasure throughput with 1, 2 and 4 worker processes (issue #22) on the shared
profile: PostgreSQL (the machine's, a fresh schema per round), OpenBao's dev server
(Transit holds the KEK) and moto's S3 server (a versioned bucket per round), started
as ``keyshred drill --profile shared`` starts them (``keyshred.drill_servers``).

Each round: seed M subjects with a few memories each (``--memories``, indexed: a
vector dataset per subject on S3; a cheap deterministic embedding, the round measures
erasure, not a model), compacted to a Parquet segment on S3; start W worker
processes (``keyshred worker --concurrency 1``, each with its own data folder) and
let them settle (each loads the bundled embedding model in the background when it
opens); submit M erasure requests to the job queue (``ks.erasure.submit``: recorded
and queued, nothing run by the submitter); wait until every request is completed.

Printed per worker count: requests/s over the active span (the first request
authorized to the last ``erasure.completed``, from the audit events' times), over
the wall time from the first submission to the last completion seen by polling, and
the ratio to 1 worker.

Run: ``.venv/bin/python benchmarks/bench_erasure_workers.py [--subjects 40]
[--memories 5] [--workers 1,2,4] [--postgres-url URL]``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa

from keyshred import Keyshred
from keyshred.drill_processes import Workers, submit, wait_done
from keyshred.drill_servers import moto, openbao, scratch_schema
from keyshred.drill_shared import DEFAULT_POSTGRES_URL, make_bucket, shared_config
from keyshred.schema import audit_events
from keyshred.storage.memories import PutItem

DIMS = 32


def embed(texts: list[str]) -> list[list[float]]:
    """A deterministic bag of hashed words (fast; the benchmark measures erasure)."""
    out = []
    for text in texts:
        v = [0.0] * DIMS
        for word in text.split():
            v[hashlib.blake2s(word.encode(), digest_size=2).digest()[0] % DIMS] += 1.0
        out.append(v)
    return out


def _step_medians(ks: Keyshred) -> str:
    """Where a request's time goes: the median time from one recorded step to the
    next, by step, over every request of the round (audit events' times)."""
    by_request: dict[str, list[tuple[object, str]]] = {}
    for e in ks.audit.events(event="erasure.state"):
        if e.request_id is not None:
            step = str(e.data.get("step") or e.data.get("state"))
            by_request.setdefault(e.request_id, []).append((e.at, step))
    spans: dict[str, list[float]] = {}
    for events in by_request.values():
        for (a, _), (b, step) in itertools.pairwise(events):
            spans.setdefault(step, []).append((b - a).total_seconds() * 1000)  # type: ignore[operator]
    ranked = sorted(((statistics.median(v), k) for k, v in spans.items()), reverse=True)
    return ", ".join(f"{_PHASES.get(k, k)} {ms:.0f}" for ms, k in ranked[:6])


# A state is logged when it changes: the span ending at "tombstone" (propagating ->
# verifying) covers every step from closure to tombstone, the one ending at
# "receipt" (-> completed) backups, verify and receipt.
_PHASES = {
    "suppress": "suppress",
    "destroy_keys": "destroy_keys",
    "tombstone": "closure..tombstone (drops, catalog, derived, external)",
    "receipt": "backups+verify+receipt",
}


def _settle(folders: list[Path], settle: float = 8.0) -> None:
    """Wait until every worker says it runs, then ``settle`` seconds more: a worker
    loads the bundled embedding model on a background thread when it opens, which
    would otherwise compete with the first erasures for the two cores."""
    deadline = time.monotonic() + 120
    logs = [f.parent / f"{f.name}.log" for f in folders]
    while not all(log.exists() and b"worker running" in log.read_bytes() for log in logs):
        if time.monotonic() > deadline:
            raise SystemExit("the workers did not start within 120 s")
        time.sleep(0.2)
    time.sleep(settle)


def _round(  # noqa: PLR0917 - one call site
    tmp: Path, postgres_url: str, bao: object, s3: object, n_workers: int, m: int, memories: int
) -> dict[str, float | str]:
    with scratch_schema(postgres_url) as url:
        bucket = make_bucket(s3)  # type: ignore[arg-type]
        config = shared_config(url, bao, s3, bucket)  # type: ignore[arg-type]
        root = tmp / f"round-{n_workers}"
        ks = Keyshred.init(root / "seed", config, embeddings=embed)
        workers = Workers()
        try:
            subjects = [f"bench-{n_workers}-{i}@example.com" for i in range(m)]
            for i, subject in enumerate(subjects):
                items = [
                    PutItem(
                        ("notes",), f"k{j}", {"text": f"note {j} of {i} about kayaks"}, index=True
                    )
                    for j in range(memories)
                ]
                ks.memories.put_many(subject, items)
            ks.memories.flush()
            folders = [root / f"worker-{w}" for w in range(n_workers)]
            for folder in folders:
                Keyshred.init(folder, config, embeddings=embed).close()
            workers.start(folders)
            _settle(folders)
            start = time.perf_counter()
            ids = [submit(ks, s) for s in subjects]
            states = [wait_done(ks, rid, 600) for rid in ids]
            wall = time.perf_counter() - start
            bad = [s for s in states if s != "completed"]
            if bad:
                raise SystemExit(f"{len(bad)} requests ended {sorted(set(bad))}")
            with ks.catalog.engine.connect() as conn:
                t = audit_events.c
                first = conn.execute(
                    sa.select(sa.func.min(t.at)).where(t.event == "erasure.state")
                ).scalar()
                last = conn.execute(
                    sa.select(sa.func.max(t.at)).where(t.event == "erasure.completed")
                ).scalar()
            span = (last - first).total_seconds()
            steps = _step_medians(ks)
            return {
                "steps": steps,
                "span": span,
                "wall": wall,
                "rps": m / span,
                "wall_rps": m / wall,
            }
        finally:
            workers.stop()
            ks.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subjects", type=int, default=40)
    parser.add_argument("--memories", type=int, default=5)
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL)
    args = parser.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    print(f"cores: {os.cpu_count()}; {args.subjects} subjects x {args.memories} memories per round")
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ks-bench-erasure-")))
        bao = stack.enter_context(openbao(tmp))
        s3 = stack.enter_context(moto(tmp))
        os.environ["VAULT_TOKEN"] = bao.token
        results = {}
        for n in counts:
            results[n] = _round(tmp, args.postgres_url, bao, s3, n, args.subjects, args.memories)
            r = results[n]
            print(
                f"{n} worker(s): {r['rps']:.2f} requests/s over the active span "
                f"({r['span']:.2f} s), {r['wall_rps']:.2f}/s wall from the first submission "
                f"({r['wall']:.2f} s); median ms per step, slowest first: {r['steps']}",
                flush=True,
            )
        base = results[counts[0]]["rps"]
        for n in counts:
            ratio = float(results[n]["rps"]) / float(base)
            print(f"{n} worker(s): {ratio:.2f}x {counts[0]} worker(s)")


if __name__ == "__main__":
    sys.exit(main())
