"""An erasure that drops many derived assets of one holder: this checkout against
another revision of keyshred (``--baseline-repo``), same work, same run.

Workload, per round and side, in a fresh data folder and a process of its own: a
victim with one memory; a holder ("bob") with ``--holder-memories`` memories of his
own and ``--drops`` digests registered as derived from the victim's memory alone
(producer "dg", no rebuild function anywhere: the erasure drops each), flushed into
a segment as after any restart. Timed: ``ks.erase(victim)`` to ``completed``; also
counted: how many times bob's partition was compacted (``Partition.flush``).

The rounds alternate between the sides (the order reversed every other round) and
the medians are printed with their ratio. Both sides run at the default durability
(``storage.durability = "fsync"``); their fsyncs per operation are the same code's
except for the compactions counted.

Run: ``.venv/bin/python benchmarks/bench_derived_drops.py --baseline-repo PATH
[--drops 50] [--holder-memories 1000] [--rounds 5]`` (PATH: a checkout of the
revision to compare with, e.g. ``git worktree add --detach /tmp/base REV``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import CheckoutFinder, uptime

HERE = Path(__file__).resolve().parents[1]


def child(repo: str, drops: int, own: int) -> None:
    # The checkout's own packages (keyshred.storage etc. live in folders of their
    # own, which a sys.path entry would not map).
    sys.meta_path.insert(0, CheckoutFinder(Path(repo)))
    import keyshred
    from keyshred import Keyshred
    from keyshred.storage import PutItem
    from keyshred.storage.partition import Partition

    assert Path(keyshred.storage.__file__ or "").resolve().is_relative_to(Path(repo).resolve())
    with tempfile.TemporaryDirectory(prefix="ks-bench-drops-") as tmp:
        ks = Keyshred.init(Path(tmp) / "ks")
        v = ks.memories.put("victim", ("m",), "k", "victim text").memory_id
        ks.memories.put_many(
            "bob", [PutItem(("own",), f"o{i}", f"bob memory {i}") for i in range(own)]
        )
        for i in range(drops):
            ks.derived.register(
                "digest",
                subject="bob",
                namespace=("s",),
                key=f"d{i}",
                value=f"digest {i}",
                produced_from=[v],
                producer="dg",
                producer_version="1",
            )
        ks.memories.flush()
        bob = ks.subject_ref("bob")
        flushes = 0
        flush = Partition.flush

        def counting(self: Partition, **kw: object) -> None:
            nonlocal flushes
            if self.subject_ref == bob:
                flushes += 1
            flush(self, **kw)  # type: ignore[arg-type]

        Partition.flush = counting  # type: ignore[method-assign]
        t0 = time.perf_counter()
        req = ks.erase("victim", requested_by="bench", reason="bench")
        ms = (time.perf_counter() - t0) * 1000
        assert req.state == "completed", req.state
        ks.close()
    print(json.dumps({"ms": ms, "compactions": flushes}))


def run(repo: str, args: argparse.Namespace) -> dict[str, float]:
    argv = [sys.executable, __file__, "--child", repo]
    argv += ["--drops", str(args.drops), "--holder-memories", str(args.holder_memories)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline-repo", default=None, help="a checkout of another revision")
    parser.add_argument("--drops", type=int, default=50)
    parser.add_argument("--holder-memories", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.drops, args.holder_memories)
        return
    sides = {"this checkout": str(HERE)}
    if args.baseline_repo:
        sides = {"baseline": str(Path(args.baseline_repo).resolve()), **sides}
    print(uptime())
    print(f"{args.drops} drops in a holder of {args.holder_memories} memories")
    results: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            results[name].append(run(sides[name], args))
    medians = {}
    for name, rows in results.items():
        ms = [row["ms"] for row in rows]
        medians[name] = statistics.median(ms)
        print(
            f"{name}: completed ms median {medians[name]:.0f} "
            f"(rounds {' / '.join(f'{x:.0f}' for x in ms)}), "
            f"holder compactions {int(statistics.median(row['compactions'] for row in rows))}"
        )
    if "baseline" in medians:
        print(f"this checkout / baseline: {medians['this checkout'] / medians['baseline']:.2f}")
    print(uptime())


if __name__ == "__main__":
    main()
