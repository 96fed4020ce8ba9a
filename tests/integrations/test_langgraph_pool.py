"""A real LangGraph graph with ``KeyshredSaver`` and ``KeyshredStore``, invoked 300
times through the sync API (which runs nodes on short-lived threads): the process's
open files, and on PostgreSQL its server connections, stay under a fixed bound,
because every connection is checked out of one bounded pool per store and returned
after the operation, whichever thread used it."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypedDict

import psycopg
import pytest

from keyshred import Config, Keyshred, db
from keyshred.config import KeyringSettings, StorageSettings
from keyshred.integrations.langgraph import KeyshredSaver, KeyshredStore
from tests.conftest import PG_DSN
from tests.conftest import pg_schema as fresh_pg_schema
from tests.storage.conftest import make_config

INVOKES = 300
# Descriptors the pools may add after warm-up: the catalog's connections (a SQLite
# connection holds the database, its WAL and shared memory) and the key store's.
FD_SLACK = 48


class State(TypedDict):
    notes: list[str]


def _graph(ks: Keyshred) -> Any:
    from langgraph.config import get_store
    from langgraph.graph import END, START, StateGraph

    def remember(state: State) -> dict[str, Any]:
        n = len(state["notes"])
        get_store().put(("ana", "notes"), f"n{n}", {"text": f"note {n}"})
        return {"notes": [*state["notes"], "remembered"]}

    def answer(state: State) -> dict[str, Any]:
        item = get_store().get(("ana", "notes"), "n0")
        return {"notes": [*state["notes"], "answered" if item else "forgot"]}

    g = StateGraph(State)
    g.add_node("remember", remember)
    g.add_node("answer", answer)
    g.add_edge(START, "remember")
    g.add_edge("remember", "answer")
    g.add_edge("answer", END)
    saver = KeyshredSaver(ks, subject=lambda config: "ana")
    return g.compile(checkpointer=saver, store=KeyshredStore(ks))


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def _invoke(graph: Any, i: int) -> None:
    out = graph.invoke({"notes": []}, {"configurable": {"thread_id": f"t{i % 20}"}})
    assert out["notes"][-1] == "answered"


def test_sqlite_open_files_stay_bounded(tmp_path: Path) -> None:
    ks = Keyshred.init(tmp_path / "data", make_config(None))
    try:
        graph = _graph(ks)
        for i in range(10):  # warm-up: pools, caches, partitions opened once
            _invoke(graph, i)
        bound = _open_files() + FD_SLACK
        for i in range(10, INVOKES):
            _invoke(graph, i)
            assert _open_files() <= bound, f"open files grew past {bound} at invoke {i}"
        # Nothing is held but the few connections parked for the next operation.
        engine = ks.catalog.engine
        assert engine.pool.checkedout() == db.parked_connections(engine) <= 4  # type: ignore[attr-defined]
    finally:
        ks.close()


@pytest.fixture
def pg_schema() -> Iterator[str]:
    with fresh_pg_schema() as schema:
        yield schema


def test_postgres_connections_stay_bounded(tmp_path: Path, pg_schema: str) -> None:
    app = f"ks-pool-{uuid.uuid4().hex[:8]}"
    url = (
        f"postgresql+psycopg://postgres@127.0.0.1:5432/test"
        f"?options=-csearch_path%3D{pg_schema}&application_name={app}"
    )
    base = make_config(None)
    storage = StorageSettings(catalog_url=url, pool_size=3, pool_max_overflow=4)
    keyring = KeyringSettings(store_url=url, pool_size=2, pool_max_overflow=2)
    cfg = Config(storage=storage, keyring=keyring, scopes=base.scopes)
    most = (3 + 4) + (2 + 2)  # both pools full
    ks = Keyshred.init(tmp_path / "data", cfg)
    try:
        with psycopg.connect(PG_DSN, autocommit=True) as admin:

            def server_connections() -> int:
                row = admin.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (app,)
                ).fetchone()
                assert row is not None
                return int(row[0])

            graph = _graph(ks)
            for i in range(10):
                _invoke(graph, i)
            bound = _open_files() + FD_SLACK
            for i in range(10, INVOKES):
                _invoke(graph, i)
                # Checked after every invoke: a leak stops the test long before the
                # shared server runs out of connections.
                assert server_connections() <= most, f"invoke {i}"
                assert _open_files() <= bound, f"open files grew past {bound} at invoke {i}"
            assert server_connections() >= 1  # the count does see this process
    finally:
        ks.close()
