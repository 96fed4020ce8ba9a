"""LangGraph backends: ``KeyshredSaver`` / ``KeyshredStore`` against LangGraph's
``SqliteSaver`` / ``SqliteStore`` (plaintext) on the same workload, in one run.

Saver: ``THREADS`` threads x ``STEPS`` checkpoints (a growing message list, ~1 KiB of
channel values, plus two pending writes per step), then ``get_tuple`` of the latest
checkpoint of random threads and of specific checkpoints, then ``list`` of a thread.
Store: ``ITEMS`` items over ``USERS`` users (``("users", id, "notes")``), then gets,
then prefix searches with a filter. keyshred encrypts every checkpoint, write and
item under the subject's keys and checks the subject guard on every call; both use
SQLite files with their default durability (keyshred's store fsyncs each put).

When PostgreSQL answers on 127.0.0.1:5432 (database ``test``, or ``KEYSHRED_BENCH_PG``)
the saver workload also runs on it: ``KeyshredSaver`` with its catalog and key store
in one schema against LangGraph's ``PostgresSaver`` in another schema of the same
database (both commit every put: synchronous commit, the server's fsync).

Run: ``.venv/bin/python benchmarks/bench_langgraph.py``
"""

from __future__ import annotations

import os
import random
import sqlite3
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.store.sqlite import SqliteStore

from keyshred import Config, Keyshred
from keyshred.integrations.langgraph import KeyshredSaver, KeyshredStore

PG_DSN = os.environ.get("KEYSHRED_BENCH_PG", "host=127.0.0.1 port=5432 dbname=test user=postgres")

THREADS, STEPS = 20, 100
USERS, ITEMS = 20, 2000
GETS = 2000
SEARCHES = 200
ROUNDS = 2
REPEAT = 3


def rate(n: int, fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return n / (time.perf_counter() - t)


# A workload: its puts timed at once (a rate), its reads as (count, callable) to be
# timed alternately with the other engine's, so that both see the same machine.
Workload = dict[str, Any]


def interleave(ours: Workload, theirs: Workload) -> tuple[dict[str, float], dict[str, float]]:
    a: dict[str, float] = {}
    b: dict[str, float] = {}
    for name, value in ours.items():
        if isinstance(value, float):
            a[name], b[name] = value, theirs[name]
            continue
        (n1, f1), (n2, f2) = value, theirs[name]
        a[name] = b[name] = 0.0
        for _ in range(REPEAT):
            b[name] = max(b[name], rate(n2, f2))
            a[name] = max(a[name], rate(n1, f1))
    return a, b


def saver_workload(saver: Any) -> Workload:
    configs: dict[int, dict[str, Any]] = {}
    ids: list[dict[str, Any]] = []

    def puts() -> None:
        for step in range(STEPS):
            for t in range(THREADS):
                cfg = configs.get(t) or {
                    "configurable": {
                        "thread_id": f"thread-{t}",
                        "checkpoint_ns": "",
                        "subject_id": f"user-{t}",
                    }
                }
                cp = empty_checkpoint()
                cp["channel_values"] = {
                    "messages": [f"message {i} of thread {t}: " + "x" * 40 for i in range(20)]
                }
                cp["channel_versions"] = {"messages": step + 1}
                stored = saver.put(
                    cfg, cp, {"source": "loop", "step": step}, {"messages": step + 1}
                )
                stored["configurable"]["subject_id"] = f"user-{t}"
                saver.put_writes(stored, [("messages", "reply"), ("log", "ok")], f"task-{step}")
                configs[t] = stored
                ids.append(stored)

    out: Workload = {"checkpoint put+writes /s": rate(THREADS * STEPS, puts)}
    rng = random.Random(7)
    latest = [
        {"configurable": {"thread_id": f"thread-{rng.randrange(THREADS)}", "checkpoint_ns": ""}}
        for _ in range(GETS)
    ]
    out["get_tuple latest /s"] = (GETS, lambda: [saver.get_tuple(c) for c in latest])
    picks = [rng.choice(ids) for _ in range(GETS)]
    out["get_tuple by id /s"] = (GETS, lambda: [saver.get_tuple(c) for c in picks])
    cfg = {"configurable": {"thread_id": "thread-3"}}
    out["list 100 checkpoints /s"] = (20, lambda: [list(saver.list(cfg)) for _ in range(20)])
    return out


def store_workload(store: Any) -> Workload:
    def puts() -> None:
        for i in range(ITEMS):
            u = i % USERS
            store.put(
                ("users", f"user-{u}", "notes"),
                f"n{i}",
                {"text": f"note {i} of user {u} about sailing", "i": i},
                index=False,
            )

    out: Workload = {"store put /s": rate(ITEMS, puts)}
    rng = random.Random(11)
    keys = [rng.randrange(ITEMS) for _ in range(GETS)]
    out["store get /s"] = (
        GETS,
        lambda: [store.get(("users", f"user-{i % USERS}", "notes"), f"n{i}") for i in keys],
    )
    users = [rng.randrange(USERS) for _ in range(SEARCHES)]
    out["store search (prefix+filter) /s"] = (
        SEARCHES,
        lambda: [
            store.search(("users", f"user-{u}"), filter={"i": {"$gte": 1000}}, limit=10)
            for u in users
        ],
    )
    return out


def best(runs: list[dict[str, float]]) -> dict[str, float]:
    return {name: max(r[name] for r in runs) for name in runs[0]}


def one_round(base: Path, n: int) -> tuple[dict[str, float], ...]:
    conn = sqlite3.connect(base / f"lg-saver{n}.db", check_same_thread=False)
    sconn = sqlite3.connect(base / f"lg-store{n}.db", check_same_thread=False, isolation_level=None)
    sqlite_store_obj = SqliteStore(sconn)
    sqlite_store_obj.setup()
    ks = Keyshred.init(base / f"ks{n}")
    try:
        ks_saver, sqlite_saver = interleave(
            saver_workload(KeyshredSaver(ks)), saver_workload(SqliteSaver(conn))
        )
        ks_store, sqlite_store = interleave(
            store_workload(KeyshredStore(ks, subject_from=1)), store_workload(sqlite_store_obj)
        )
    finally:
        ks.close()
        conn.close()
        sconn.close()
    return ks_saver, sqlite_saver, ks_store, sqlite_store


def _schema(conn: Any) -> tuple[str, str]:
    """A fresh schema: (its name, a libpq DSN whose search_path is that schema)."""
    name = f"ks_bench_{uuid.uuid4().hex[:8]}"
    conn.execute(f"CREATE SCHEMA {name}")
    return name, f"{PG_DSN} options=-csearch_path={name}"


def postgres_round(base: Path, n: int) -> tuple[dict[str, float], dict[str, float]] | None:
    """The saver workload on PostgreSQL: keyshred and ``PostgresSaver`` alternately."""
    try:
        import psycopg
        from langgraph.checkpoint.postgres import PostgresSaver
    except ImportError:
        return None
    try:
        admin = psycopg.connect(PG_DSN, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError:
        return None
    ours, ours_dsn = _schema(admin)
    theirs, theirs_dsn = _schema(admin)
    info = admin.info
    url = (
        f"postgresql+psycopg://{info.user}@{info.host}:{info.port}/{info.dbname}"
        f"?options=-csearch_path%3D{ours}"
    )
    del ours_dsn
    cfg = Config.model_validate({"storage": {"catalog_url": url}, "keyring": {"store_url": url}})
    ks = Keyshred.init(base / f"pg{n}", cfg)
    try:
        with PostgresSaver.from_conn_string(theirs_dsn) as pg_saver:
            pg_saver.setup()
            return interleave(saver_workload(KeyshredSaver(ks)), saver_workload(pg_saver))
    finally:
        ks.close()
        for schema in (ours, theirs):
            admin.execute(f"DROP SCHEMA {schema} CASCADE")
        admin.close()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rounds = [one_round(Path(tmp), n) for n in range(ROUNDS)]
        on_pg = [r for r in (postgres_round(Path(tmp), n) for n in range(ROUNDS)) if r]
    ks_saver, sqlite_saver, ks_store, sqlite_store = (
        best([r[i] for r in rounds]) for i in range(4)
    )
    print(
        f"best of {ROUNDS} rounds; reads timed {REPEAT}x alternately with SQLite "
        "(the machine is shared and noisy)"
    )
    print(f"{'operation':34} {'keyshred':>10} {'SQLite':>10} {'ratio':>7}")
    for ours, theirs in ((ks_saver, sqlite_saver), (ks_store, sqlite_store)):
        for name, value in ours.items():
            print(f"{name:34} {value:10.0f} {theirs[name]:10.0f} {value / theirs[name]:7.2f}")
    if on_pg:
        ks_pg, pg = best([r[0] for r in on_pg]), best([r[1] for r in on_pg])
        print(f"\n{'on PostgreSQL':34} {'keyshred':>10} {'Postgres':>10} {'ratio':>7}")
        for name, value in ks_pg.items():
            print(f"{name:34} {value:10.0f} {pg[name]:10.0f} {value / pg[name]:7.2f}")
    print("\ntarget: within 2x of SQLite (ratio >= 0.5) while encrypting")


if __name__ == "__main__":
    main()
