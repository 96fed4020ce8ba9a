"""Cross-subject ``KeyshredStore`` calls on many subjects: this checkout against
another revision of keyshred (``--baseline-repo``), same work, same run.

Workload: ``--subjects`` users, each a subject of its own (``subject_from=1``) with
two namespaces (``("users", id, "notes")`` and ``("users", id, "prefs")``) holding
one unindexed ~30-byte memory each, written through ``KeyshredStore.batch``. Each
side loads its own data folder once (a folder written by one revision is not opened
by the other), in a process of its own. Then, per round and side, a fresh process
opens the folder and times each call once cold (the first call after the open) and
as the median of three warm calls, and reports its RSS high-water mark after the
open and after the calls. The rounds alternate between the sides (the order
reversed every other round); medians of rounds are printed with their ratio.

Calls: ``list_namespaces(limit=100)`` and ``list_namespaces(prefix=("users",),
max_depth=2, limit=100)`` (every subject's namespace rows are read and decrypted:
LangGraph orders namespaces by their labels), ``search(("users",), limit=10)`` and
``search((), limit=10)`` (first-time order: only the first page's subjects).
Nothing is written during the calls; both sides run at the default durability.

Run: ``.venv/bin/python benchmarks/bench_cross_pages.py --baseline-repo PATH
[--subjects 20000] [--rounds 3]`` (PATH: a checkout of the revision to compare
with, e.g. ``git worktree add --detach /tmp/base REV``).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import CheckoutFinder, run_json, uptime

HERE = Path(__file__).resolve().parents[1]

CALLS: dict[str, Callable[[Any], Any]] = {
    "list all (limit 100)": lambda s: s.list_namespaces(limit=100),
    "list users depth 2 (limit 100)": lambda s: s.list_namespaces(
        prefix=("users",), max_depth=2, limit=100
    ),
    "search users (limit 10)": lambda s: s.search(("users",), limit=10),
    "search all (limit 10)": lambda s: s.search((), limit=10),
}


def _import(repo: str) -> Any:
    # The checkout's own packages (keyshred.storage etc. live in folders of their
    # own, which a sys.path entry would not map).
    sys.meta_path.insert(0, CheckoutFinder(Path(repo)))
    import keyshred
    from keyshred.integrations.langgraph import KeyshredStore

    assert Path(keyshred.storage.__file__ or "").resolve().is_relative_to(Path(repo).resolve())
    return keyshred.Keyshred, KeyshredStore


def load(repo: str, folder: str, subjects: int) -> None:
    from langgraph.store.base import PutOp

    keyshred, store_class = _import(repo)
    t0 = time.perf_counter()
    with keyshred.init(Path(folder)) as ks:
        store = store_class(ks, subject_from=1)
        for u in range(subjects):
            store.batch(
                [
                    PutOp(("users", f"user-{u:07d}", leaf), "m", {"text": f"{leaf} of {u}"}, False)
                    for leaf in ("notes", "prefs")
                ]
            )
    print(json.dumps({"load s": time.perf_counter() - t0}))


def measure(repo: str, folder: str) -> None:
    keyshred, store_class = _import(repo)
    out: dict[str, float] = {}
    with keyshred.open(Path(folder)) as ks:
        store = store_class(ks, subject_from=1)
        out["RSS after open MiB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        answers = {}
        for name, call in CALLS.items():
            t0 = time.perf_counter()
            answers[name] = call(store)
            out[f"{name} cold ms"] = (time.perf_counter() - t0) * 1e3
            warm = []
            for _ in range(3):
                t0 = time.perf_counter()
                assert call(store) == answers[name]
                warm.append((time.perf_counter() - t0) * 1e3)
            out[f"{name} warm ms"] = statistics.median(warm)
        out["RSS after the calls MiB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # What each call found (not when: each side loaded its own folder).
    found = {
        k: repr([(tuple(i.namespace), i.key, i.value) if hasattr(i, "key") else i for i in v])
        for k, v in answers.items()
    }
    print(json.dumps({"result": out, "answers": found}))


def child(argv: list[str]) -> dict[str, Any]:
    return run_json(__file__, argv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline-repo", default=None, help="a checkout of another revision")
    parser.add_argument("--subjects", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, repo, folder = args.child
        if mode == "load":
            load(repo, folder, args.subjects)
        else:
            measure(repo, folder)
        return
    sides = {"this checkout": str(HERE)}
    if args.baseline_repo:
        sides = {"baseline": str(Path(args.baseline_repo).resolve()), **sides}
    print(uptime())
    with tempfile.TemporaryDirectory(prefix="ks-bench-pages-") as tmp:
        folders = {name: str(Path(tmp) / f"side{i}") for i, name in enumerate(sides)}
        for name, repo in sides.items():
            loaded = child(
                ["--child", "load", repo, folders[name], "--subjects", str(args.subjects)]
            )
            print(f"{name}: {args.subjects:,} subjects loaded in {loaded['load s']:.0f} s")
        rows: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
        answers: dict[str, Any] = {}
        for r in range(args.rounds):
            for name in list(sides) if r % 2 == 0 else list(reversed(sides)):
                got = child(["--child", "measure", sides[name], folders[name]])
                rows[name].append(got["result"])
                answers[name] = got["answers"]
    if len(answers) == 2:
        assert answers["baseline"] == answers["this checkout"], "the sides answered differently"
    print(uptime())
    names = list(sides)
    print(f"\n{args.subjects:,} subjects, medians of {args.rounds} rounds")
    print(f"{'':40}" + "".join(f"{n:>16}" for n in names) + ("   ratio" if len(names) == 2 else ""))
    for metric in rows[names[0]][0]:
        medians = [statistics.median(row[metric] for row in rows[n]) for n in names]
        line = f"{metric:40}" + "".join(f"{m:16.1f}" for m in medians)
        if len(names) == 2 and medians[0]:
            line += f"   {medians[1] / medians[0]:.3f}"
        print(line)


if __name__ == "__main__":
    main()
