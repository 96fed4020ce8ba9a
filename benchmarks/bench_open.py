"""Opening an existing store: this checkout against another revision of keyshred
(``--baseline-repo``), same work, same run.

Each open brings the catalog and the key store to the newest schema revision
(``keyshred.db.migrate``); a store that is already there needs nothing, and this
times what it costs to find that out as part of the whole open. A data folder is
made once per round with ``Keyshred.init`` (SQLite, or ``--catalog postgres``: the
catalog and the key store in a fresh PostgreSQL schema) and one memory put; then,
in a process of its own per side, ``Keyshred.open`` + ``close`` is timed: the first
open of the process (what a CLI call or a worker start pays) and the median of
``--opens`` further opens (a process that opens stores again: a service, the tests).
The rounds alternate between the sides, the order reversed every other round.
Printed: per side, the median and minimum over rounds, and the ratio this checkout
÷ baseline (below 1: faster).

Run: ``.venv/bin/python benchmarks/bench_open.py --baseline-repo PATH
[--catalog sqlite|postgres] [--opens 40] [--rounds 6]`` (PATH: a checkout of the
revision to compare with, e.g. ``git worktree add --detach /tmp/base REV``).
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
    import keyshred.storage

    assert Path(keyshred.storage.__file__ or "").resolve().is_relative_to(Path(repo).resolve())
    return keyshred.Keyshred


def measure(repo: str, folder: str, opens: int) -> None:
    keyshred = _import(repo)

    def once() -> float:
        t0 = time.perf_counter()
        keyshred.open(folder).close()
        return (time.perf_counter() - t0) * 1e3

    first = once()
    again = statistics.median(once() for _ in range(opens))
    print(json.dumps({"first open ms": first, "open ms": again}))


def _make(folder: Path, url: str | None) -> None:
    """The data folder both sides open (this checkout's ``init``: the schema at the
    newest revision of both, as long as the baseline has the same revisions)."""
    sys.meta_path.insert(0, CheckoutFinder(HERE))
    from keyshred import Keyshred
    from keyshred.config import Config, KeyringSettings, StorageSettings

    cfg = (
        None
        if url is None
        else Config(
            storage=StorageSettings(catalog_url=url), keyring=KeyringSettings(store_url=url)
        )
    )
    ks = Keyshred.init(folder, cfg) if cfg else Keyshred.init(folder)
    try:
        ks.memories.put("ann", ("notes",), "n1", {"t": "a note"}, index=False)
    finally:
        ks.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline-repo", default=None, help="a checkout of another revision")
    parser.add_argument("--catalog", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--opens", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        measure(args.child[0], args.child[1], args.opens)
        return
    sides = {"this checkout": str(HERE)}
    if args.baseline_repo:
        sides = {"baseline": str(Path(args.baseline_repo).resolve()), **sides}
    print(uptime())
    rows: dict[str, dict[str, list[float]]] = {n: {} for n in sides}
    for r in range(args.rounds):
        with (
            PgSchema() if args.catalog == "postgres" else contextlib.nullcontext() as schema,
            tempfile.TemporaryDirectory(prefix="ks-bench-open-") as tmp,
        ):
            folder = Path(tmp) / "ks"
            done = run_json(__file__, ["--make", str(folder), schema.url if schema else "-"])
            assert done == {"made": str(folder)}
            for name in list(sides) if r % 2 == 0 else list(reversed(sides)):
                got = run_json(
                    __file__, ["--child", sides[name], str(folder), "--opens", str(args.opens)]
                )
                for key, value in got.items():
                    rows[name].setdefault(key, []).append(value)
    print(uptime())
    names = list(sides)
    print(f"\n{args.catalog}, {args.rounds} rounds, {args.opens} opens after the first")
    print(f"{'ms':24}" + "".join(f"{n:>16}" for n in names))
    for key in ("first open ms", "open ms"):
        for label, fn in (("median", statistics.median), ("min", min)):
            values = [fn(rows[n][key]) for n in names]
            line = f"{key + ' ' + label:24}" + "".join(f"{v:16.2f}" for v in values)
            if len(names) == 2 and values[0]:
                line += f"   ratio {values[1] / values[0]:.3f}"
            print(line)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--make":
        _make(Path(sys.argv[2]), None if sys.argv[3] == "-" else sys.argv[3])
        print(json.dumps({"made": sys.argv[2]}))
    else:
        main()
