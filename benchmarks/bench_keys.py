"""Key-count benchmark (issue 19): keys owned by every subject the data is about.

Workload: ``--subjects`` subjects (default 10,000) with ``--per-subject`` memories
each (default 5), of which ``--mention-rate`` (default 5 %) mention another random
subject, plus ``--derived`` derived summaries (default 200), each built from three
memories of three subjects. Then ``--erasures`` (default 10) mentioned subjects are
erased one by one.

Printed: keys per subject, scope keys vs shared (owner-set) keys, distinct owner
sets; put time per memory and erasure time per subject of this checkout and of a
baseline checkout (``--baseline-repo PATH``, e.g. a worktree of the previous main),
both measured in this run, each in its own subprocess that imports that checkout's
code (side by side, one core each; ``--sequential`` for one after the other), and
their ratio. Without ``--baseline-repo`` only this checkout runs.

Run: ``.venv/bin/python benchmarks/bench_keys.py --baseline-repo /path/to/old-main``
(about three minutes at the default size on two cores; stores use
``durability="flush"`` unless ``--durability fsync``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import CheckoutFinder

HERE = Path(__file__).resolve().parents[1]


def _worker(repo: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Build the workload with ``repo``'s keyshred; return what was measured."""
    sys.meta_path.insert(0, CheckoutFinder(repo))
    import keyshred
    from keyshred import Config, Keyshred
    from keyshred.config import StorageSettings
    from keyshred.storage.memories import PutItem

    assert Path(keyshred.__file__).resolve().is_relative_to(repo.resolve()), keyshred.__file__
    rng = random.Random(19)  # the same workload in both checkouts
    n = args.subjects
    with tempfile.TemporaryDirectory() as tmp:
        config = Config(storage=StorageSettings(durability=args.durability))
        ks = Keyshred.init(Path(tmp) / "data", config)
        ids: list[list[str]] = []
        mentioned: list[int] = []
        put_s = 0.0
        n_puts = 0
        for s in range(n):
            items = []
            for i in range(args.per_subject):
                mentions: list[str] = []
                if rng.random() < args.mention_rate:
                    other = rng.randrange(n - 1)
                    other += other >= s
                    mentions = [f"subject-{other}"]
                    mentioned.append(other)
                items.append(
                    PutItem(("notes",), f"k{i}", {"text": f"note {i} of {s}"}, mentions=mentions)
                )
            start = time.perf_counter()
            out = ks.memories.put_many(f"subject-{s}", items)
            put_s += time.perf_counter() - start
            n_puts += len(items)
            ids.append([m.memory_id for m in out])
        derived_s = 0.0
        for d in range(args.derived):
            owners = rng.sample(range(n), 3)
            start = time.perf_counter()
            ks.derived.register(
                "summary",
                subject=f"subject-{owners[0]}",
                namespace=("summaries",),
                key=f"d{d}",
                value={"text": f"summary {d}"},
                produced_from=[ids[o][0] for o in owners],
                producer="bench",
                producer_version="1",
                rebuild=lambda sources: {"text": f"rebuilt from {len(sources)}"},
            )
            derived_s += time.perf_counter() - start
        ks.memories.flush()
        # Every DEK record (older than any epoch there will be): the holder and, in
        # a checkout with owner-set keys, the other owners of each.
        records = ks.keyring.store.older_than(2**62, 2**31)
        shared = [r.key_id for r in records if getattr(r, "owner_tag", "")]
        others = ks.keyring.owners_of(shared) if shared else {}
        owner_sets = {frozenset((r.subject_ref, *others.get(r.key_id, ()))) for r in records}
        counts = {"dek": len(records), "dek_shared": len(shared)}
        erase_s = 0.0
        victims = list(dict.fromkeys(mentioned))[: args.erasures]
        for v in victims:
            start = time.perf_counter()
            req = ks.erase(f"subject-{v}", requested_by="bench", reason="benchmark")
            erase_s += time.perf_counter() - start
            assert req.state == "completed", req.error
        ks.close()
    return {
        "subjects": n,
        "memories": n_puts,
        "mentions": len(mentioned),
        "derived": args.derived,
        "counts": counts,
        "owner_sets": len(owner_sets),
        "put_us_per_memory": put_s / n_puts * 1e6,
        "derived_ms_each": derived_s / max(1, args.derived) * 1e3,
        "erase_ms_each": erase_s / max(1, len(victims)) * 1e3,
        "erasures": len(victims),
    }


def _start(repo: Path, argv: list[str]) -> subprocess.Popen[str]:
    """``_worker`` in a fresh interpreter, so each checkout imports its own code."""
    return subprocess.Popen(
        [sys.executable, __file__, "--worker", str(repo), *argv],
        stdout=subprocess.PIPE,
        text=True,
    )


def _result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"a benchmark worker failed (exit {proc.returncode})")
    return dict(json.loads(out.strip().splitlines()[-1]))


def _keys(result: dict[str, Any]) -> tuple[int, int, int]:
    """(all DEKs, scope keys, shared keys): a checkout without owner-set keys
    reports every DEK as a scope key."""
    counts = result["counts"]
    total = int(counts.get("dek", 0))
    shared = int(counts.get("dek_shared", 0))
    return total, total - shared, shared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subjects", type=int, default=10_000)
    parser.add_argument("--per-subject", type=int, default=5)
    parser.add_argument("--mention-rate", type=float, default=0.05)
    parser.add_argument("--derived", type=int, default=200)
    parser.add_argument("--erasures", type=int, default=10)
    parser.add_argument("--baseline-repo", type=Path, default=None)
    # "flush" (page cache, not fsync) keeps the default size within minutes on a
    # slow disk; both checkouts run with the same setting.
    parser.add_argument("--durability", choices=["fsync", "flush"], default="flush")
    parser.add_argument(
        "--sequential", action="store_true", help="run the checkouts one after the other"
    )
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(_worker(args.worker, args)))
        return
    argv = [
        f"--subjects={args.subjects}",
        f"--per-subject={args.per_subject}",
        f"--mention-rate={args.mention_rate}",
        f"--derived={args.derived}",
        f"--erasures={args.erasures}",
        f"--durability={args.durability}",
    ]
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores")
    repos = {"this checkout": HERE}
    if args.baseline_repo is not None:
        repos["baseline"] = args.baseline_repo.resolve()
    if args.sequential:
        runs = {name: _result(_start(repo, argv)) for name, repo in repos.items()}
    else:
        # Side by side (one core each): the same machine load on both, half the time.
        procs = {name: _start(repo, argv) for name, repo in repos.items()}
        runs = {name: _result(proc) for name, proc in procs.items()}
    mine = runs["this checkout"]
    print(
        f"workload: {mine['subjects']:,} subjects, {mine['memories']:,} memories, "
        f"{mine['mentions']:,} mentioning another subject "
        f"({mine['mentions'] / mine['memories']:.1%}), {mine['derived']} derived assets "
        f"of 3 subjects each, {mine['erasures']} erasures of mentioned subjects"
    )
    names = list(runs)
    print("\n" + f"{'':<28}" + "".join(f"{name:>16}" for name in names))
    keys = {name: _keys(r) for name, r in runs.items()}

    def show(label: str, values: list[float], fmt: str, ratio: bool = False) -> None:
        line = f"{label:<28}" + "".join(f"{fmt.format(v):>16}" for v in values)
        if ratio and len(values) == 2 and values[1]:
            line += f"   ratio {values[0] / values[1]:.2f}"
        print(line)

    show("DEKs", [float(keys[n][0]) for n in names], "{:,.0f}")
    show("  scope keys", [float(keys[n][1]) for n in names], "{:,.0f}")
    show("  shared (owner-set) keys", [float(keys[n][2]) for n in names], "{:,.0f}")
    show("keys per subject", [keys[n][0] / runs[n]["subjects"] for n in names], "{:.3f}")
    for label, field, fmt in (
        ("put, us per memory", "put_us_per_memory", "{:.1f}"),
        ("derived register, ms each", "derived_ms_each", "{:.2f}"),
        ("erasure, ms per subject", "erase_ms_each", "{:.1f}"),
    ):
        show(label, [float(runs[n][field]) for n in names], fmt, ratio=True)
    owner_sets = mine.get("owner_sets")
    if owner_sets is not None:
        print(
            f"\ndistinct owner sets (this checkout): {owner_sets:,} "
            f"({mine['subjects']:,} holders on their own, the rest shared)"
        )


if __name__ == "__main__":
    main()
