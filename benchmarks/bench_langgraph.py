"""LangGraph backends (issue #25 item 5): ``KeyshredSaver`` / ``KeyshredStore`` against
LangGraph's ``SqliteSaver`` / ``SqliteStore`` at the same durability, within and beyond
keyshred's caches, medians of interleaved rounds; and ``KeyshredSaver`` on PostgreSQL
against ``PostgresSaver``.

Durability: keyshred's default (``storage.durability = "fsync"``: the catalog, which
holds checkpoints, writes and hot memory rows, in SQLite WAL with ``synchronous=FULL``)
against ``SqliteSaver`` and ``SqliteStore`` set to WAL with ``synchronous=FULL`` (each
side's pragmas are read back from its connection and printed). ``--fsyncs`` counts
every side's fsync/fdatasync calls per operation with ``strace -f`` and prints them.
On PostgreSQL both sides commit every write with the server's defaults
(``synchronous_commit``, ``fsync``: read back and printed); the server's fsyncs are
its own process's and not counted.

Workload, per side, in a process of its own (``_common.Child``): ``--threads`` threads
(default 3,500), each of its own subject ``user-<t>``, with 5 checkpoints (a growing
list of 20 ~60-byte messages, two pending writes per step), the first ``HOT`` (20)
with 100; ``--threads`` users with 10 store items each (``("users", id, "notes")``).
Then ``--rounds`` rounds; in each, every operation runs once per side, the sides'
order reversed from one operation to the next, and each figure is the median of the
rounds' rates. Every operation runs twice:

- **hot**: on the 20 hot threads/users (warmed: within every cache of keyshred's);
- **spread**: on random threads/users of all of them: beyond the 256 open partitions
  (``storage.max_open_partitions``) and, at the default 3,500 subjects of 3 keys each
  (counted in the key store), beyond the keyring's 10,000-key cache
  (``keyring.cache_max_entries``).

Operations: checkpoint put + 2 writes (continuing a thread), ``get_tuple`` of a
thread's latest checkpoint and of a specific one, ``list`` of a thread's checkpoints
(up to 100: hot threads have 100+, the others 5+), store put (a new key), store get,
store search (the user's prefix with a ``$gte`` filter, limit 10).

Run: ``.venv/bin/python benchmarks/bench_langgraph.py [--threads 3500] [--rounds 5]
[--fsyncs] [--no-postgres]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import (
    PG_DSN,
    Child,
    PgSchema,
    count_ops,
    interleaved,
    median_of,
    serve,
    strace_syncs,
    uptime,
)

HOT = 20
LOAD_STEPS, HOT_STEPS = 5, 100
ITEMS = 10  # store items per user at the load
LOAD_CHUNKS = 6
# operation -> calls per round (the rate is calls / seconds)
OPS = {
    "checkpoint put+2 writes": 200,
    "get_tuple latest": 500,
    "get_tuple by id": 500,
    "list (<=100 checkpoints)": 20,
    "store put": 200,
    "store get": 500,
    "store search (prefix+filter)": 200,
}
STORE_OPS = {"store put", "store get", "store search (prefix+filter)"}


def checkpoint(t: int, step: int) -> dict[str, Any]:
    from langgraph.checkpoint.base import empty_checkpoint

    cp = empty_checkpoint()
    cp["channel_values"] = {
        "messages": [f"message {i} of thread {t}: " + "x" * 40 for i in range(20)]
    }
    cp["channel_versions"] = {"messages": step + 1}
    return cp


def ns(u: int) -> tuple[str, str, str]:
    return ("users", f"user-{u}", "notes")


# =====================================================================================
# Sides
# =====================================================================================


class Side:
    """A saver and (on SQLite) a store, used the way an application would."""

    name = ""
    durability = ""
    store: Any = None

    def __init__(self) -> None:
        self.saver: Any = None
        self.configs: dict[int, dict[str, Any]] = {}
        self.ids: dict[int, list[dict[str, Any]]] = {}
        self.steps: dict[int, int] = {}
        self.items: dict[int, int] = {}

    def cp_put(self, t: int) -> None:
        step = self.steps.get(t, 0)
        cfg = self.configs.get(t) or {
            "configurable": {
                "thread_id": f"thread-{t}",
                "checkpoint_ns": "",
                "subject_id": f"user-{t}",
            }
        }
        stored = self.saver.put(
            cfg, checkpoint(t, step), {"source": "loop", "step": step}, {"messages": step + 1}
        )
        stored["configurable"]["subject_id"] = f"user-{t}"
        self.saver.put_writes(stored, [("messages", "reply"), ("log", "ok")], f"task-{step}")
        self.configs[t] = stored
        self.ids.setdefault(t, []).append(stored)
        self.steps[t] = step + 1

    def latest(self, t: int) -> Any:
        cfg = {"configurable": {"thread_id": f"thread-{t}", "checkpoint_ns": ""}}
        got = self.saver.get_tuple(cfg)
        assert got is not None
        return got

    def by_id(self, cfg: dict[str, Any]) -> Any:
        got = self.saver.get_tuple(cfg)
        assert got is not None
        return got

    def list(self, t: int) -> list[Any]:
        return list(self.saver.list({"configurable": {"thread_id": f"thread-{t}"}}, limit=100))

    def st_load(self, u: int) -> None:
        from langgraph.store.base import PutOp

        n = self.items.get(u, 0)
        self.store.batch(
            [
                PutOp(ns(u), f"n{i}", {"text": f"note {i} of user {u} about sailing", "i": i})
                for i in range(n, n + ITEMS)
            ]
        )
        self.items[u] = n + ITEMS

    def st_put(self, u: int) -> None:
        i = self.items.get(u, 0)
        self.store.put(ns(u), f"n{i}", {"text": f"note {i} of user {u} about sailing", "i": i})
        self.items[u] = i + 1

    def st_get(self, u: int, i: int) -> Any:
        got = self.store.get(ns(u), f"n{i}")
        assert got is not None
        return got

    def st_search(self, u: int) -> list[Any]:
        return self.store.search(("users", f"user-{u}"), filter={"i": {"$gte": 5}}, limit=10)

    def close(self) -> None: ...


def _sqlite_durability(execute: Callable[[str], Any]) -> str:
    journal = execute("PRAGMA journal_mode").fetchone()[0]
    sync = execute("PRAGMA synchronous").fetchone()[0]
    return f"journal_mode={journal}, synchronous={sync}"


def _pg_durability(conn: Any) -> str:
    sc = conn.execute("SHOW synchronous_commit").fetchone()[0]
    fs = conn.execute("SHOW fsync").fetchone()[0]
    return f"PostgreSQL synchronous_commit={sc}, fsync={fs}"


class KeyshredSide(Side):
    name = "keyshred"

    def __init__(self, root: Path) -> None:
        super().__init__()
        from keyshred import Keyshred
        from keyshred.integrations.langgraph import KeyshredSaver, KeyshredStore

        self.ks = Keyshred.init(root / "ks")
        self.saver = KeyshredSaver(self.ks)
        self.store = KeyshredStore(self.ks, subject_from=1)
        with self.ks.catalog.engine.connect() as conn:
            self.durability = "catalog " + _sqlite_durability(conn.exec_driver_sql)

    def close(self) -> None:
        self.ks.close()


class SqliteSide(Side):
    name = "SqliteSaver+Store WAL+FULL"

    def __init__(self, root: Path) -> None:
        super().__init__()
        from langgraph.checkpoint.sqlite import SqliteSaver
        from langgraph.store.sqlite import SqliteStore

        self.conns = [
            sqlite3.connect(root / "saver.db", check_same_thread=False),
            sqlite3.connect(root / "store.db", check_same_thread=False, isolation_level=None),
        ]
        for conn in self.conns:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
        self.saver = SqliteSaver(self.conns[0])
        self.saver.setup()
        self.store = SqliteStore(self.conns[1])
        self.store.setup()
        self.durability = (
            f"saver {_sqlite_durability(self.conns[0].execute)}; "
            f"store {_sqlite_durability(self.conns[1].execute)}"
        )

    def close(self) -> None:
        for conn in self.conns:
            conn.close()


class KeyshredPgSide(Side):
    name = "keyshred (PostgreSQL)"

    def __init__(self, root: Path) -> None:
        super().__init__()
        from keyshred import Config, Keyshred
        from keyshred.integrations.langgraph import KeyshredSaver

        self.schema = PgSchema()
        url = self.schema.url
        cfg = Config.model_validate(
            {"storage": {"catalog_url": url}, "keyring": {"store_url": url}}
        )
        self.ks = Keyshred.init(root / "ks", cfg)
        self.saver = KeyshredSaver(self.ks)
        self.durability = _pg_durability(self.schema.admin)

    def close(self) -> None:
        try:
            self.ks.close()
        finally:
            self.schema.close()


class PostgresSide(Side):
    name = "PostgresSaver"

    def __init__(self, root: Path) -> None:
        super().__init__()
        from langgraph.checkpoint.postgres import PostgresSaver

        self.schema = PgSchema()
        self.stack = contextlib.ExitStack()
        self.saver = self.stack.enter_context(PostgresSaver.from_conn_string(self.schema.dsn))
        self.saver.setup()
        self.durability = _pg_durability(self.schema.admin)

    def close(self) -> None:
        try:
            self.stack.close()
        finally:
            self.schema.close()


SIDES: dict[str, Callable[[Path], Side]] = {
    "keyshred": KeyshredSide,
    "sqlite": SqliteSide,
    "keyshred-pg": KeyshredPgSide,
    "postgres": PostgresSide,
}


# =====================================================================================
# One side in one process
# =====================================================================================


class Measured:
    def __init__(self, side: Side, n: int) -> None:
        self.side, self.n = side, n

    def load(self, lo: str, hi: str) -> dict[str, float]:
        side = self.side
        start = time.perf_counter()
        for t in range(int(lo), int(hi)):
            for _ in range(HOT_STEPS if t < HOT else LOAD_STEPS):
                side.cp_put(t)
            if side.store is not None:
                side.st_load(t)
        return {"load s": time.perf_counter() - start}

    def op(self, r: str, index: str, where: str) -> dict[str, float]:
        side = self.side
        name = list(OPS)[int(index)]
        rnd = random.Random(f"{r}/{name}/{where}")
        pool = list(range(HOT)) if where == "hot" else list(range(self.n))
        n = OPS[name]
        subjects = [rnd.choice(pool) for _ in range(n)]
        if where == "hot":  # warm: within every cache
            for t in range(HOT):
                side.latest(t)
                if side.store is not None:
                    side.st_get(t, 0)
        calls: list[Callable[[], Any]]
        if name == "checkpoint put+2 writes":
            calls = [lambda t=t: side.cp_put(t) for t in subjects]
        elif name == "get_tuple latest":
            calls = [lambda t=t: side.latest(t) for t in subjects]
        elif name == "get_tuple by id":
            picks = [rnd.choice(side.ids[t]) for t in subjects]
            calls = [lambda c=c: side.by_id(c) for c in picks]
        elif name == "list (<=100 checkpoints)":
            calls = [lambda t=t: side.list(t) for t in subjects]
        elif name == "store put":
            calls = [lambda u=u: side.st_put(u) for u in subjects]
        elif name == "store get":
            keys = [(u, rnd.randrange(side.items[u])) for u in subjects]
            calls = [lambda a=a: side.st_get(*a) for a in keys]
        else:
            calls = [lambda u=u: side.st_search(u) for u in subjects]
        start = time.perf_counter()
        for call in calls:
            call()
        return {"rate": n / (time.perf_counter() - start)}


def fsync_probe(side: Side) -> None:
    """The operations ``--fsyncs`` counts, between markers in strace's log."""
    for t in range(HOT):
        for _ in range(3):
            side.cp_put(t)
        if side.store is not None:
            side.st_load(t)
    ops: list[tuple[str, Callable[[int], Any]]] = [
        ("checkpoint put+2 writes", lambda j: side.cp_put(j % HOT)),
        ("checkpoint put+2 writes, new thread", lambda j: side.cp_put(1000 + j)),
        ("get_tuple latest", lambda j: side.latest(j % HOT)),
        ("list", lambda j: side.list(j % HOT)),
    ]
    if side.store is not None:
        ops += [
            ("store put", lambda j: side.st_put(j % HOT)),
            ("store put, new user", lambda j: side.st_put(2000 + j)),
            ("store get", lambda j: side.st_get(j % HOT, 1)),
            ("store search", lambda j: side.st_search(j % HOT)),
        ]
    for name, op in ops:
        count_ops(name, 20, op)


def child(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="ks-bench-langgraph-") as tmp:
        side = SIDES[args.child](Path(tmp))
        try:
            if args.fsync_probe:
                fsync_probe(side)
                return
            m = Measured(side, args.threads)
            header = {"side": side.name, "durability": side.durability}
            serve({"load": m.load, "op": m.op}, header)
        finally:
            side.close()


# =====================================================================================
# The run
# =====================================================================================


def pg_available() -> bool:
    try:
        import psycopg
        from langgraph.checkpoint.postgres import PostgresSaver  # noqa: F401
    except ImportError:
        return False
    try:
        psycopg.connect(PG_DSN, connect_timeout=3).close()
    except psycopg.OperationalError:
        return False
    return True


def compare(names: list[str], n: int, rounds: int, store: bool) -> None:
    """Load both sides (chunks interleaved), then the rounds; print the medians."""
    started = time.perf_counter()
    children = {
        name: Child(__file__, ["--child", name, "--threads", str(n)], dict(os.environ))
        for name in names
    }
    try:
        bounds = [n * c // LOAD_CHUNKS for c in range(LOAD_CHUNKS + 1)]
        loads = interleaved(
            children, [f"load {bounds[c]} {bounds[c + 1]}" for c in range(LOAD_CHUNKS)]
        )
        label = {name: c.header["side"] for name, c in children.items()}
        for name, c in children.items():
            took = sum(x["load s"] for x in loads[name])
            print(f"  durability {label[name]}: {c.header['durability']}")
            print(f"  load {label[name]}: {took:.1f} s")
        ops = [op for op in OPS if store or op not in STORE_OPS]
        commands = [
            f"op {r} {list(OPS).index(op)} {where}"
            for r in range(rounds)
            for op in ops
            for where in ("hot", "spread")
        ]
        answers = interleaved(children, commands)
    finally:
        for c in children.values():
            c.end()
    per_round: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for name in names:
        for command, doc in zip(commands, answers[name], strict=True):
            _, r, op, where = command.split()
            metric = f"{list(OPS)[int(op)]}, {where} /s"
            while len(per_round[name]) <= int(r):
                per_round[name].append({})
            per_round[name][int(r)][metric] = doc["rate"]
    ours, theirs = names
    a, b = median_of(per_round[ours]), median_of(per_round[theirs])
    took = time.perf_counter() - started
    print(f"\n{n} threads/users; medians of {rounds} interleaved rounds ({took:.0f} s)")
    print(
        f"{'operation':42} {label[ours][:26]:>26} {label[theirs][:26]:>26} "
        f"{'ratio':>6} {'rounds':>11}"
    )
    for metric, value in a.items():
        ratios = [
            x[metric] / y[metric] for x, y in zip(per_round[ours], per_round[theirs], strict=True)
        ]
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
        print(
            f"{metric:42} {value:26,.0f} {b[metric]:26,.0f} {value / b[metric]:6.2f} {spread:>11}"
        )
    print(f"  (ratio: {label[ours]} / {label[theirs]} throughput; rounds: each round's ratio)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=3500, help="threads (and users)")
    parser.add_argument("--pg-threads", type=int, default=300, help="threads on PostgreSQL")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fsyncs", action="store_true", help="only count fsyncs per op")
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--fsync-probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    pg = not args.no_postgres and pg_available()
    print(f"uptime before: {uptime()}", flush=True)
    if args.fsyncs:
        print("fsync/fdatasync calls per operation (strace -f, 20 operations each):")
        for name in ("keyshred", "sqlite"):
            argv = [sys.executable, __file__, "--child", name, "--fsync-probe"]
            print(f"  {name:<10} {json.dumps(strace_syncs(argv, dict(os.environ)))}", flush=True)
        print(f"uptime after: {uptime()}")
        return
    print(f"SQLite: {args.threads} threads/users, {args.rounds} rounds", flush=True)
    compare(["keyshred", "sqlite"], args.threads, args.rounds, store=True)
    print(f"uptime: {uptime()}", flush=True)
    if pg:
        print(f"\nPostgreSQL: {args.pg_threads} threads, {args.rounds} rounds", flush=True)
        compare(["keyshred-pg", "postgres"], args.pg_threads, args.rounds, store=False)
    else:
        print("\nPostgreSQL not reachable: its comparison skipped")
    print("\ntarget (issue #24): ratio >= 0.5 on every operation")
    print(f"uptime after: {uptime()}")


if __name__ == "__main__":
    main()
