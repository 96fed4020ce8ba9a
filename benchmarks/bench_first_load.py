"""A partition's first load: this checkout against another revision of keyshred
(``--baseline-repo``), same work, same run.

A read or write of a subject whose partition is not open (beyond
``storage.max_open_partitions``) loads it from the catalog (and its segments). This
times that load alone: ``--subjects`` users, each a subject of its own with 10 items
of ~40 bytes written through ``KeyshredStore.batch`` (so their rows are hot rows of
the catalog), then ``--passes`` passes in which every subject's partition is
invalidated and loaded again (``Partition.invalidate`` then ``ensure_loaded``, which
takes the subject lock as a first touch does). Each side runs in a process of its
own per round, on a fresh data folder (SQLite) or a fresh PostgreSQL schema
(``--catalog postgres``); the rounds alternate between the sides, the order reversed
every other round. Printed: per side, the median and minimum over rounds of each
round's median µs per load, and the ratio this checkout ÷ baseline.

Run: ``.venv/bin/python benchmarks/bench_first_load.py --baseline-repo PATH
[--catalog sqlite|postgres] [--subjects 600] [--passes 15] [--rounds 3]`` (PATH: a
checkout of the revision to compare with, e.g. ``git worktree add --detach /tmp/base
REV``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import CheckoutFinder, PgSchema, run_json, uptime

HERE = Path(__file__).resolve().parents[1]


def _import(repo: str) -> Any:
    sys.meta_path.insert(0, CheckoutFinder(Path(repo)))
    import keyshred
    from keyshred.config import Config, StorageSettings
    from keyshred.integrations.langgraph import KeyshredStore

    assert Path(keyshred.storage.__file__ or "").resolve().is_relative_to(Path(repo).resolve())
    return keyshred.Keyshred, KeyshredStore, Config, StorageSettings


def measure(repo: str, catalog: str, subjects: int, passes: int) -> None:
    from langgraph.store.base import PutOp

    keyshred, store_class, config, storage = _import(repo)
    with PgSchema() if catalog == "postgres" else contextlib.nullcontext() as schema:
        cfg = None if schema is None else config(storage=storage(catalog_url=schema.url))
        with tempfile.TemporaryDirectory(prefix="ks-bench-load-") as tmp:
            ks = keyshred.init(Path(tmp) / "ks", cfg) if cfg else keyshred.init(Path(tmp) / "ks")
            try:
                store = store_class(ks, subject_from=1)
                for u in range(subjects):
                    store.batch(
                        [
                            PutOp(("users", f"user-{u}", "notes"), f"n{i}", {"t": f"note {i}"})
                            for i in range(10)
                        ]
                    )
                memories = ks._memories
                refs = [ks.subject_ref(f"user-{u}") for u in range(subjects)]

                def one_pass() -> float:
                    t0 = time.perf_counter()
                    for ref in refs:
                        part = memories._partition(ref)
                        part.invalidate()
                        part.ensure_loaded()
                    return (time.perf_counter() - t0) / len(refs) * 1e6

                one_pass()  # warm: keys in the cache, statements compiled
                per_load = statistics.median(one_pass() for _ in range(passes))
            finally:
                ks.close()
    print(json.dumps({"us per first load": per_load}))


def child(argv: list[str]) -> dict[str, Any]:
    return run_json(__file__, argv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline-repo", default=None, help="a checkout of another revision")
    parser.add_argument("--catalog", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--subjects", type=int, default=600)
    parser.add_argument("--passes", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        measure(args.child, args.catalog, args.subjects, args.passes)
        return
    sides = {"this checkout": str(HERE)}
    if args.baseline_repo:
        sides = {"baseline": str(Path(args.baseline_repo).resolve()), **sides}
    print(uptime())
    rows: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name in list(sides) if r % 2 == 0 else list(reversed(sides)):
            got = child(
                [
                    "--child",
                    sides[name],
                    "--catalog",
                    args.catalog,
                    "--subjects",
                    str(args.subjects),
                    "--passes",
                    str(args.passes),
                ]
            )
            rows[name].append(got["us per first load"])
    print(uptime())
    names = list(sides)
    print(f"\n{args.catalog}, {args.subjects:,} subjects, {args.rounds} rounds")
    print(f"{'µs per first load':24}" + "".join(f"{n:>16}" for n in names))
    for label, fn in (("median", statistics.median), ("min", min)):
        values = [fn(rows[n]) for n in names]
        line = f"{label:24}" + "".join(f"{v:16.1f}" for v in values)
        if len(names) == 2 and values[0]:
            line += f"   ratio {values[1] / values[0]:.3f}"
        print(line)


if __name__ == "__main__":
    main()
