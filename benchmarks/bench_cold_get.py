"""A get of a subject whose partition is not loaded: this checkout, another revision
of keyshred (``--baseline-repo``) and LangGraph's own store on the same catalog
database, same work, same run.

``--subjects`` users, each a subject of its own with 10 items of ~40 bytes written
through ``KeyshredStore.batch`` in one call (one hot record of the catalog, as an
agent's first turn writes them; with ``--compacted`` every partition is then
compacted, as a close, a delete or the flush threshold would: a Parquet segment each
before small partitions stayed in the catalog); ``storage.max_open_partitions`` is 16, so a get of a
random user finds its partition not loaded (the keyring keeps its keys: every user's
keys fit its cache, as in ``bench_langgraph.py``'s spread gets of the first 3,300
users). Then ``--passes`` passes of ``--gets`` gets of random users' random items;
the figure is the median pass's µs per get. LangGraph's store is ``SqliteStore`` (WAL,
``synchronous=FULL``) on SQLite and ``PostgresStore`` on PostgreSQL, the same items
written the same way. Each side runs in a process of its own per round, on a fresh
data folder (SQLite) or a fresh PostgreSQL schema (``--catalog postgres``); the
rounds alternate between the sides, the order reversed every other round. Printed:
per side, the median and minimum over rounds, and each keyshred side ÷ LangGraph's.

Run: ``.venv/bin/python benchmarks/bench_cold_get.py [--baseline-repo PATH] [--compacted]
[--catalog sqlite|postgres] [--subjects 2000] [--passes 7] [--rounds 3]`` (PATH: a
checkout of the revision to compare with, e.g. ``git worktree add --detach /tmp/base
REV``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import CheckoutFinder, PgSchema, run_json, uptime

HERE = Path(__file__).resolve().parents[1]
LANGGRAPH = "langgraph"


def ns(u: int) -> tuple[str, str, str]:
    return ("users", f"user-{u}", "notes")


def _schema(catalog: str) -> contextlib.AbstractContextManager[PgSchema | None]:
    """A fresh PostgreSQL schema, dropped after; None on SQLite."""
    return PgSchema() if catalog == "postgres" else contextlib.nullcontext()


@contextlib.contextmanager
def _keyshred_store(repo: str, catalog: str, tmp: Path) -> Iterator[tuple[Any, Any]]:
    sys.meta_path.insert(0, CheckoutFinder(Path(repo)))
    import keyshred
    from keyshred.config import Config, StorageSettings
    from keyshred.integrations.langgraph import KeyshredStore

    assert Path(keyshred.storage.__file__ or "").resolve().is_relative_to(Path(repo).resolve())
    with _schema(catalog) as schema:
        url = None if schema is None else schema.url
        cfg = Config(storage=StorageSettings(catalog_url=url, max_open_partitions=16))
        ks = keyshred.Keyshred.init(tmp / "ks", cfg)
        try:
            yield KeyshredStore(ks, subject_from=1), ks
        finally:
            ks.close()


@contextlib.contextmanager
def _langgraph_store(catalog: str, tmp: Path) -> Iterator[tuple[Any, Any]]:
    if catalog == "postgres":
        from langgraph.store.postgres import PostgresStore

        with PgSchema() as schema, PostgresStore.from_conn_string(schema.dsn) as store:
            store.setup()
            yield store, None
        return
    from langgraph.store.sqlite import SqliteStore

    conn = sqlite3.connect(tmp / "lg.db", check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    lite = SqliteStore(conn)
    lite.setup()
    try:
        yield lite, None
    finally:
        conn.close()


def measure(  # noqa: PLR0917 - the child's arguments, as parsed
    side: str, catalog: str, subjects: int, passes: int, gets: int, compacted: bool
) -> None:
    from langgraph.store.base import PutOp

    with tempfile.TemporaryDirectory(prefix="ks-bench-cold-") as tmp:
        opened = (
            _langgraph_store(catalog, Path(tmp))
            if side == LANGGRAPH
            else _keyshred_store(side, catalog, Path(tmp))
        )
        with opened as (store, ks):
            for u in range(subjects):
                store.batch(
                    [PutOp(ns(u), f"n{i}", {"t": f"note {i} of user {u}"}) for i in range(10)]
                )
            size = None
            if compacted and ks is not None:
                # As a close, a delete or the flush threshold would: every partition
                # compacted (a segment each before the small ones stayed in the catalog).
                for u in range(subjects):
                    ks.memories.flush(f"user-{u}")
                size = _folder_bytes(ks, Path(tmp) / "ks") / subjects
            rnd = random.Random(7)

            def one_pass() -> float:
                picks = [(rnd.randrange(subjects), rnd.randrange(10)) for _ in range(gets)]
                t0 = time.perf_counter()
                for u, i in picks:
                    if store.get(ns(u), f"n{i}") is None:
                        raise AssertionError("an item written was not read back")
                return (time.perf_counter() - t0) / gets * 1e6

            one_pass()  # warm: keys in the cache, statements compiled
            per_get = statistics.median(one_pass() for _ in range(passes))
    print(json.dumps({"us per get": per_get, "bytes per subject": size}))


def _folder_bytes(ks: Any, folder: Path) -> int:
    """Bytes of every file of the data folder (catalog, key store, segments) with
    SQLite's write-ahead logs checkpointed into their databases first."""
    for engine in (ks.catalog.engine,):
        if engine.dialect.name == "sqlite":
            with engine.connect() as conn:
                conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline-repo", default=None, help="a checkout of another revision")
    parser.add_argument("--catalog", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--subjects", type=int, default=2000)
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--gets", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--compacted", action="store_true", help="compact every partition after the load"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        measure(args.child, args.catalog, args.subjects, args.passes, args.gets, args.compacted)
        return
    sides = {LANGGRAPH: LANGGRAPH, "this checkout": str(HERE)}
    if args.baseline_repo:
        sides["baseline"] = str(Path(args.baseline_repo).resolve())
    print(uptime())
    rows: dict[str, list[float]] = {name: [] for name in sides}
    sizes: dict[str, float] = {}
    for r in range(args.rounds):
        for name in list(sides) if r % 2 == 0 else list(reversed(sides)):
            argv = ["--child", sides[name], "--catalog", args.catalog]
            argv += ["--subjects", str(args.subjects), "--passes", str(args.passes)]
            argv += ["--gets", str(args.gets)] + (["--compacted"] if args.compacted else [])
            got = run_json(__file__, argv)
            rows[name].append(got["us per get"])
            if got.get("bytes per subject") is not None:
                sizes[name] = got["bytes per subject"]
    print(uptime())
    compacted = ", every partition compacted" if args.compacted else ""
    print(f"\n{args.catalog}, {args.subjects:,} subjects{compacted}, {args.rounds} rounds")
    print(f"{'µs per get':16}" + "".join(f"{n:>16}" for n in sides))
    for label, fn in (("median", statistics.median), ("min", min)):
        values = {n: fn(rows[n]) for n in sides}
        line = f"{label:16}" + "".join(f"{values[n]:16.1f}" for n in sides)
        ratios = [f"{n} {values[LANGGRAPH] / values[n]:.2f}" for n in sides if n != LANGGRAPH]
        print(line + "   LangGraph ÷ keyshred: " + ", ".join(ratios))
    for name, size in sizes.items():
        where = "catalog, key store and segments" if args.catalog == "sqlite" else "folder"
        print(f"{name}: {size:,.0f} bytes per subject on disk ({where}, after compaction)")


if __name__ == "__main__":
    main()
