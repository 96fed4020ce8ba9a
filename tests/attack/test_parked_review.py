"""Review of ``keyshred.db._Parked`` (SQLite connections parked between the hot
path's operations) and of the checkpoint reads that now sort pending writes in
Python (commit 6a5e3f7).

Defects (these tests failed on a3db346; fixed in the commit that added this file:
parking leaves two of the pool's connections free, and an at-fork handler resets
every ``_Parked`` in the child, lock included):

- the vault's kept writer plus the parked connections can take every connection of
  a pool without overflow: SQLAlchemy's paths (``Catalog.assets``, a new subject's
  put) then time out, where the same pool served them before;
- ``_Parked.lock`` crosses ``fork``: a child forked while another thread holds it
  hangs in the catalog's own at-fork hook (``engine.dispose(close=False)`` now
  takes that lock; SQLAlchemy's recipe replaced every lock it had);
- on a PostgreSQL database with a non-C collation, ``get_tuple`` returns pending
  writes in LangGraph's code-point order but ``list`` still in the collation's.
  (The editable install imports ``storage/`` from the main checkout: there,
  8ebebe1 sorts every listing in ``_rows`` too, and this test passes.)

The rest confirms what the parking must keep true: no transaction, lock or snapshot
carried into the next operation (a failed COMMIT, a half-read statement), the WAL
checkpoint of a scrub not held up, no descriptor left after ``close``, erased data
unreadable, and the order of writes on SQLite the same in ``get_tuple`` and
``list``."""

from __future__ import annotations

import os
import signal
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from langgraph.checkpoint.base import empty_checkpoint, writes_sort_key
from sqlalchemy.engine import Engine

from keyshred import Keyshred, db
from keyshred.config import TokenSettings
from keyshred.errors import SubjectErased, SubjectSuppressed
from keyshred.integrations.langgraph import KeyshredSaver
from keyshred.storage.schema import checkpoint_writes, checkpoints
from tests.conftest import PG_DSN, descriptors_under
from tests.storage.conftest import make_config

HOUR = timedelta(hours=1)
NS = ("m",)


@pytest.fixture
def ks(tmp_path: Path) -> Iterator[Keyshred]:
    """The embedded default (SQLite catalog), as tests/conftest.py's ``ks``: not the
    both-catalogs ``ks`` of tests/attack/conftest.py (the parked connections are
    SQLite's)."""
    store = Keyshred.init(tmp_path / "data", make_config(None))
    yield store
    store.close()


def _no_overflow(tmp_path: Path, pool_size: int) -> Keyshred:
    """An embedded store whose catalog pool has no overflow and a short wait, the
    vault committing every call (its kept writer is taken at the first sanitize)."""
    cfg = make_config(
        None, pool_size=pool_size, pool_max_overflow=0, pool_timeout_seconds=1
    ).model_copy(update={"tokens": TokenSettings(group_commit_ms=0)})
    return Keyshred.init(tmp_path / "data", cfg)


# -- defects -----------------------------------------------------------------------


def test_vault_writer_and_a_parked_connection_starve_a_pool_of_two(tmp_path: Path) -> None:
    # storage.pool_size=2, pool_max_overflow=0 is a valid configuration, and before
    # the change every call below ran on it: the vault keeps one connection, the
    # other served each operation in turn. Now that other one stays parked after
    # the first hot read, and every SQLAlchemy path waits for the pool and fails.
    ks = _no_overflow(tmp_path, pool_size=2)
    try:
        ks.memories.put("ana", NS, "k0", {"n": 0})
        ks.vault.sanitize("mail ana.probe@example.com", "ana", "support", HOUR)
        assert ks.memories.get("ana", NS, "k0") is not None  # a hot read: parks one
        ref = ks.subject_ref("ana")
        assert {a.kind for a in ks.catalog.assets(ref)} >= {"token"}  # TimeoutError
        ks.memories.put("bob", NS, "k0", {"n": 1})  # a new subject: TimeoutError too
    finally:
        ks.close()


def test_four_parked_and_the_vault_writer_fill_the_default_pool_size(tmp_path: Path) -> None:
    # The default pool_size (5) without overflow: four threads reading at once park
    # four connections (the cap), the vault keeps the fifth, and the docstring's
    # promise ("one of its own connections stays free for SQLAlchemy's paths") no
    # longer holds.
    ks = _no_overflow(tmp_path, pool_size=5)
    try:
        ks.memories.put("ana", NS, "k0", {"n": 0})
        ks.vault.sanitize("mail ana.probe@example.com", "ana", "support", HOUR)
        together = threading.Barrier(4)
        errors: list[BaseException] = []

        def read() -> None:
            try:
                with ks.catalog.hot(write=False) as cur:
                    cur.execute("SELECT count(*) FROM ks_tokens").fetchone()
                    together.wait(10)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=read) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert ks.catalog.assets(ks.subject_ref("ana"))  # TimeoutError on a3db346
    finally:
        ks.close()


def _wait_or_kill(pid: int, seconds: float) -> int | None:
    """The child's wait status, or None if it did not exit in time (then killed)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_fork_while_a_thread_parks_does_not_hang_the_child(ks: Keyshred) -> None:
    # Another thread is inside ``_Parked.take``/``give`` (a pop under the lock) at
    # the instant of the fork: the child's copy of the lock stays held for good, and
    # the catalog's at-fork hook (``Catalog._forked`` -> ``engine.dispose(close=
    # False)`` -> ``_Parked.dispose``) blocks on it before ``fork`` even returns.
    # Holding the lock from a thread makes that instant certain; a free-running
    # reader thread hit it in about 1 of 200 forks.
    engine = ks.catalog.engine
    with ks.catalog.hot(write=False) as cur:
        cur.execute("SELECT 1").fetchone()
    assert db.parked_connections(engine) == 1
    parked = engine.__dict__["_ks_parked"]
    inside, leave = threading.Event(), threading.Event()

    def in_take() -> None:
        with parked.lock:
            inside.set()
            leave.wait(10)

    holder = threading.Thread(target=in_take)
    holder.start()
    inside.wait(10)
    try:
        pid = os.fork()
        if pid == 0:  # the child: exits as soon as fork returns
            os._exit(0)
    finally:
        leave.set()
        holder.join()
    status = _wait_or_kill(pid, 5)
    assert status is not None, "the forked child hung in the catalog's at-fork hook"
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.fixture
def icu_catalog_url() -> Iterator[str]:
    """A catalog on a PostgreSQL database created with an ICU ``en-US`` collation,
    as a database made by ``initdb`` in an en_US locale orders text."""
    name = f"ks_rv_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_DSN, autocommit=True) as admin:
        try:
            admin.execute(
                f"CREATE DATABASE {name} TEMPLATE template0 LOCALE_PROVIDER icu "
                "ICU_LOCALE 'en-US' LOCALE 'C.UTF-8'"
            )
        except psycopg.Error as exc:  # a server built without ICU
            pytest.skip(f"no ICU collation on this PostgreSQL: {type(exc).__name__}")
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(PG_DSN, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


# task paths whose code-point order ("", "B", "a", "~b") is not en-US's ("", "~b", "a", "B")
_PATHS = [("~b", "t2", 2), ("a", "t9", 1), ("B", "t1", 1), ("", "t5", 1)]


def _writes_and_orders(saver: KeyshredSaver) -> tuple[list[Any], list[Any], list[str]]:
    """(get_tuple's pending writes, list's, the task ids in LangGraph's order)."""
    stored = saver.put(
        {"configurable": {"thread_id": "ordered", "checkpoint_ns": "", "subject_id": "ana"}},
        empty_checkpoint(),
        {},
        {},
    )
    stored["configurable"]["subject_id"] = "ana"
    for path, task, n in _PATHS:
        saver.put_writes(stored, [(f"c{i}", f"{task}-{i}") for i in range(n)], task, path)
    got = saver.get_tuple(stored)
    assert got is not None
    listed = [t for t in saver.list(stored) if t.config == got.config]
    assert len(listed) == 1
    expected = sorted(
        (writes_sort_key(path, task, i), task) for path, task, n in _PATHS for i in range(n)
    )
    return (
        list(got.pending_writes or []),
        list(listed[0].pending_writes or []),
        [task for _, task in expected],
    )


def test_list_and_get_tuple_order_pending_writes_alike_on_a_collated_postgres(
    icu_catalog_url: str, tmp_path: Path
) -> None:
    # get_tuple now sorts in Python by writes_sort_key (code points); the listing
    # paths (``CheckpointStore.checkpoints``, its ``thread_writes`` statement) still
    # ORDER BY task_path in SQL, i.e. in the database's collation. On such a database
    # the two calls return one checkpoint's writes in two orders, and ``list``'s is
    # not LangGraph's (order-sensitive reducers replay writes in that order).
    with Keyshred.init(tmp_path / "data", make_config(icu_catalog_url)) as ks:
        by_get, by_list, langgraph_order = _writes_and_orders(KeyshredSaver(ks))
    assert [w[0] for w in by_get] == langgraph_order
    assert [w[0] for w in by_list] == langgraph_order  # en-US order on a3db346
    assert by_list == by_get


# -- confirmed fine ----------------------------------------------------------------


def test_list_and_get_tuple_order_pending_writes_alike_on_sqlite(ks: Keyshred) -> None:
    by_get, by_list, langgraph_order = _writes_and_orders(KeyshredSaver(ks))
    assert [w[0] for w in by_get] == langgraph_order
    assert by_list == by_get


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    eng = db.create_engine(db.sqlite_url(tmp_path / "t.db"), pool_size=3, max_overflow=2)
    with db.cursor(eng, write=True) as cur:
        cur.execute("CREATE TABLE p (id INTEGER PRIMARY KEY)")
        cur.execute(
            "CREATE TABLE c (id INTEGER PRIMARY KEY, "
            "p INTEGER REFERENCES p(id) DEFERRABLE INITIALLY DEFERRED)"
        )
        cur.executemany("INSERT INTO p VALUES (?)", [(i,) for i in range(50)])
    yield eng
    eng.dispose()


def _other_writer(path: Path) -> sqlite3.Connection:
    """A connection of its own that refuses to wait for a lock."""
    return sqlite3.connect(path, timeout=0, isolation_level=None)


def test_a_failed_commit_leaves_no_transaction_on_the_next_operation(
    engine: Engine, tmp_path: Path
) -> None:
    # A COMMIT that fails and leaves the transaction open (as "disk full" can): here
    # a deferred foreign key, checked at COMMIT. The connection goes back to the pool
    # (rolled back), not to the parked ones; the next operation sees no half-write
    # and holds no lock.
    with db.cursor(engine, write=False) as cur:
        cur.execute("PRAGMA foreign_keys=ON")  # a caller's PRAGMA, outside a transaction
        conn = cur.connection
    assert db.parked_connections(engine) == 1
    with pytest.raises(sqlite3.IntegrityError), db.cursor(engine, write=True) as cur:
        assert cur.connection is conn
        cur.execute("INSERT INTO c VALUES (1, 999)")  # no parent: COMMIT fails
    assert db.parked_connections(engine) == 0
    assert not conn.in_transaction
    other = _other_writer(tmp_path / "t.db")
    try:
        other.execute("BEGIN IMMEDIATE")  # no write lock left behind
        other.execute("ROLLBACK")
    finally:
        other.close()
    with db.cursor(engine, write=False) as cur:
        assert cur.execute("SELECT count(*) FROM c").fetchone()[0] == 0
        assert not cur.connection.in_transaction


def test_a_half_read_statement_holds_no_snapshot_nor_the_wal(
    engine: Engine, tmp_path: Path
) -> None:
    # Several parked connections, each left after a SELECT read only in part: none
    # keeps a read snapshot (a commit elsewhere is seen at once) and none holds the
    # WAL against the scrub's TRUNCATE checkpoint.
    blocks = [db.cursor(engine, write=False) for _ in range(2)]
    curs = [b.__enter__() for b in blocks]
    for cur in curs:
        cur.execute("SELECT id FROM p ORDER BY id")
        assert cur.fetchone() is not None  # 49 rows left unread
    for b in reversed(blocks):
        b.__exit__(None, None, None)
    assert db.parked_connections(engine) == 2
    other = _other_writer(tmp_path / "t.db")
    try:
        other.execute("INSERT INTO p VALUES (1000)")
    finally:
        other.close()
    for _ in range(2):
        with db.cursor(engine, write=False) as cur:
            assert cur.execute("SELECT max(id) FROM p").fetchone()[0] == 1000
    with db.cursor(engine, write=False) as cur:
        busy, _, _ = cur.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    assert busy == 0
    assert (tmp_path / "t.db-wal").stat().st_size == 0


def _descriptors_on(folder: Path) -> list[str]:
    return [t for t in descriptors_under(folder) if ".db" in t]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_close_leaves_no_descriptor_and_the_folder_reopens(tmp_path: Path) -> None:
    data = tmp_path / "data"
    ks = Keyshred.init(data, make_config(None))
    try:
        for i in range(5):
            ks.memories.put(f"s{i}", NS, "k", {"n": i})
            assert ks.memories.get(f"s{i}", NS, "k") is not None
        ks.vault.sanitize("mail ana.probe@example.com", "ana", "support", HOUR)
        assert db.parked_connections(ks.catalog.engine) >= 1
    finally:
        ks.close()
    assert _descriptors_on(data) == []
    with Keyshred.open(data, make_config(None)) as again:
        got = again.memories.get("s3", NS, "k")
        assert got is not None and got.value == {"n": 3}
    assert _descriptors_on(data) == []


def test_an_erased_subject_stays_unreadable_through_parked_connections(ks: Keyshred) -> None:
    saver = KeyshredSaver(ks)
    probe = f"zq{uuid.uuid4().hex[:10]}"
    cfg = {"configurable": {"thread_id": "t-erase", "checkpoint_ns": "", "subject_id": "ana"}}
    stored = saver.put(cfg, empty_checkpoint(), {"probe": probe}, {})  # type: ignore[arg-type,typeddict-item]
    stored["configurable"]["subject_id"] = "ana"
    saver.put_writes(stored, [("c", probe)], "task", "")
    ks.memories.put("ana", NS, "k", {"probe": probe})
    for _ in range(3):  # the hot reads run on parked connections
        assert ks.memories.get("ana", NS, "k") is not None
        assert saver.get_tuple(stored) is not None
    assert db.parked_connections(ks.catalog.engine) >= 1
    with ks.catalog.engine.connect() as conn:
        blobs = [
            bytes(r[0])
            for table in (checkpoints, checkpoint_writes)
            for r in conn.execute(sa.select(table.c.data))
        ]
    assert blobs
    req = ks.erase("ana", requested_by="dpo", reason="art17", probes=[probe])
    assert req.state == "completed", req.error
    with pytest.raises((SubjectErased, SubjectSuppressed)):
        ks.memories.get("ana", NS, "k")
    with pytest.raises((SubjectErased, SubjectSuppressed)):
        saver.get_tuple(stored)
    assert list(saver.list(None)) == []
    # The scrub's WAL checkpoint was not held up by the parked connections: no
    # ciphertext of the thread is left in any file.
    for path in (p for p in ks.path.rglob("*") if p.is_file()):
        data = path.read_bytes()
        assert probe.encode() not in data
        for blob in blobs:
            assert blob[-32:] not in data, path
