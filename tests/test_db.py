"""``keyshred.db.cursor``'s parked SQLite connections (``_Parked``): reused between
operations, never parked with a transaction open or after a failed block, bounded
below the pool's size, closed at once by ``dispose``, and never used by a forked
child."""

from __future__ import annotations

import multiprocessing
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

from keyshred import db


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    eng = db.create_engine(db.sqlite_url(tmp_path / "t.db"), pool_size=3, max_overflow=2)
    with db.cursor(eng, write=True) as cur:
        cur.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v TEXT)")
    yield eng
    eng.dispose()


def _driver(eng: Engine) -> sqlite3.Connection:
    with db.cursor(eng, write=False) as cur:
        conn: sqlite3.Connection = cur.connection
        return conn


def test_one_connection_serves_reads_and_writes_in_turn(engine: Engine) -> None:
    first = _driver(engine)
    for i in range(20):
        with db.cursor(engine, write=True) as cur:
            cur.execute("INSERT INTO t VALUES (?, ?)", (i, "v"))
            assert cur.connection is first
        with db.cursor(engine, write=False) as cur:
            assert cur.execute("SELECT count(*) FROM t").fetchone()[0] == i + 1
            assert cur.connection is first
    assert db.parked_connections(engine) == 1
    assert engine.pool.checkedout() == 1  # type: ignore[attr-defined]


def test_a_failed_block_goes_back_to_the_pool_rolled_back(engine: Engine) -> None:
    first = _driver(engine)
    with pytest.raises(RuntimeError), db.cursor(engine, write=True) as cur:
        cur.execute("INSERT INTO t VALUES (1, 'lost')")
        raise RuntimeError("the caller failed")
    assert db.parked_connections(engine) == 0
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    assert not first.in_transaction  # the pool's reset rolled it back
    with db.cursor(engine, write=False) as cur:
        assert cur.execute("SELECT count(*) FROM t").fetchone()[0] == 0


def test_a_connection_left_in_a_transaction_is_not_parked(engine: Engine) -> None:
    with db.cursor(engine, write=False) as cur:
        cur.execute("BEGIN")  # a reader's snapshot that nothing ended
        cur.execute("SELECT count(*) FROM t").fetchone()
        held = cur.connection
    assert db.parked_connections(engine) == 0
    assert not held.in_transaction
    with db.cursor(engine, write=True) as cur:  # a write after it sees no stale snapshot
        cur.execute("INSERT INTO t VALUES (1, 'x')")
    with db.cursor(engine, write=False) as cur:
        assert cur.execute("SELECT count(*) FROM t").fetchone()[0] == 1


def test_a_snapshot_read_is_parked_after_its_rollback(engine: Engine) -> None:
    with db.cursor(engine, write=False, snapshot=True) as cur:
        cur.execute("SELECT count(*) FROM t").fetchone()
        conn = cur.connection
        assert conn.in_transaction
    assert not conn.in_transaction
    assert db.parked_connections(engine) == 1


def test_threads_park_at_most_the_cap_and_leak_nothing(engine: Engine) -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def work(n: int) -> None:
        try:
            start.wait()
            for i in range(50):
                with db.cursor(engine, write=True) as cur:
                    cur.execute("INSERT OR REPLACE INTO t VALUES (?, ?)", (n * 100 + i, "v"))
                with db.cursor(engine, write=False) as cur:
                    cur.execute("SELECT v FROM t WHERE k = ?", (n * 100 + i,)).fetchone()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    parked = db.parked_connections(engine)
    assert 1 <= parked <= 2  # the cap: min(4, pool_size - 1)
    assert engine.pool.checkedout() == parked  # type: ignore[attr-defined]


def test_sqlalchemy_paths_still_get_connections(tmp_path: Path) -> None:
    # Parking leaves two of the pool's connections free: a Core connection inside
    # another, inside a hot block, gets them (a parked one would never come back).
    eng = db.create_engine(
        db.sqlite_url(tmp_path / "s.db"), pool_size=4, max_overflow=0, pool_timeout=2
    )
    try:
        for _ in range(3):
            with db.cursor(eng, write=False) as cur:
                cur.execute("SELECT 1").fetchone()
        assert db.parked_connections(eng) == 1
        with db.cursor(eng, write=False) as cur, db.read(eng) as a, db.read(eng) as b:
            assert a.exec_driver_sql("SELECT 1").scalar() == 1
            assert b.exec_driver_sql("SELECT 1").scalar() == 1
            cur.execute("SELECT 1").fetchone()
        # Held elsewhere for good (the vault's writer): parking stops short of them.
        held = [eng.raw_connection() for _ in range(2)]
        with db.cursor(eng, write=False) as cur:
            cur.execute("SELECT 1").fetchone()
        assert db.parked_connections(eng) == 0
        with db.read(eng) as a, db.read(eng) as b:
            assert a.exec_driver_sql("SELECT 1").scalar() == 1
        for fairy in held:
            fairy.close()
    finally:
        eng.dispose()


@pytest.mark.parametrize("pool_size", [1, 2])
def test_a_pool_of_one_or_two_without_overflow_parks_nothing(
    tmp_path: Path, pool_size: int
) -> None:
    eng = db.create_engine(
        db.sqlite_url(tmp_path / "small.db"), pool_size=pool_size, max_overflow=0
    )
    try:
        with db.cursor(eng, write=False) as cur:
            cur.execute("SELECT 1").fetchone()
        assert db.parked_connections(eng) == 0
        assert eng.pool.checkedout() == 0  # type: ignore[attr-defined]
    finally:
        eng.dispose()


def test_dispose_closes_parked_connections_at_once(engine: Engine) -> None:
    conn = _driver(engine)
    assert db.parked_connections(engine) == 1
    engine.dispose()
    assert db.parked_connections(engine) == 0
    with pytest.raises(sqlite3.ProgrammingError):  # closed, not waiting for the GC
        conn.execute("SELECT 1")
    with db.cursor(engine, write=False) as cur:  # the engine works on, on a new one
        assert cur.execute("SELECT count(*) FROM t").fetchone()[0] == 0
        assert cur.connection is not conn


def test_a_block_that_spans_a_dispose_is_not_parked(engine: Engine) -> None:
    with db.cursor(engine, write=False) as cur:
        cur.execute("SELECT 1").fetchone()
        engine.dispose()  # the catalog closed meanwhile
    assert db.parked_connections(engine) == 0


def _child_reads(path: str, parent_conn_id: int, out: multiprocessing.Queue[object]) -> None:
    try:
        eng = _ENGINES[path]
        with db.cursor(eng, write=True) as cur:
            cur.execute("INSERT INTO t VALUES (7, 'child')")
            mine = id(cur.connection)
        with db.cursor(eng, write=False) as cur:
            n = cur.execute("SELECT count(*) FROM t").fetchone()[0]
        out.put((mine != parent_conn_id, n))
    except BaseException as exc:  # noqa: BLE001 - sent to the parent
        out.put(repr(exc))


_ENGINES: dict[str, Engine] = {}


def test_a_forked_child_leaves_the_parents_parked_connections(
    tmp_path: Path, engine: Engine
) -> None:
    parent = _driver(engine)
    _ENGINES[str(tmp_path)] = engine
    try:
        ctx = multiprocessing.get_context("fork")
        out: multiprocessing.Queue[object] = ctx.Queue()
        child = ctx.Process(target=_child_reads, args=(str(tmp_path), id(parent), out))
        child.start()
        child.join(60)
        assert child.exitcode == 0
        assert out.get(timeout=5) == (True, 1)
    finally:
        _ENGINES.clear()
    # The parent's parked connection is intact and sees the child's commit.
    with db.cursor(engine, write=False) as cur:
        assert cur.connection is parent
        assert cur.execute("SELECT v FROM t WHERE k = 7").fetchone()[0] == "child"


@pytest.mark.parametrize("dialect_name", ["sqlite", "postgresql"])
def test_compiled_text_is_remembered_and_a_constant_is_still_refused(dialect_name: str) -> None:
    """``compile_sql`` remembers a statement's text by its structure: a statement
    built again compiles to the same text without SQLAlchemy, and the same shape
    with a constant bound in it is refused as before."""
    import sqlalchemy as sa
    from sqlalchemy.dialects import postgresql, sqlite

    dialect = sqlite.dialect() if dialect_name == "sqlite" else postgresql.dialect()
    table = sa.Table("ks_compile_probe", sa.MetaData(), sa.Column("a", sa.Integer))

    def shaped(value: object) -> sa.Select[tuple[int]]:
        return sa.select(table.c.a).where(table.c.a == sa.bindparam("a", value=value))

    required = sa.select(table.c.a).where(table.c.a == sa.bindparam("a"))
    first = db.compile_sql(dialect, required)
    again = sa.select(table.c.a).where(table.c.a == sa.bindparam("a"))
    assert db.compile_sql(dialect, again) == first
    assert db.compile_sql(dialect, again, positional=True) != first  # its own style
    with pytest.raises(ValueError, match="constants"):
        db.compile_sql(dialect, shaped(5))
    with pytest.raises(ValueError, match="constants"):
        db.compile_sql(dialect, sa.select(table.c.a).where(table.c.a == 5))


def test_an_interrupted_postgresql_read_raises_the_interrupt_and_the_pool_recovers() -> None:
    """A Ctrl-C that lands inside a read's statement leaves the statement running:
    psycopg then refuses to take the connection out of autocommit, and that refusal
    (a ``ProgrammingError``, printed as a traceback by the command line) used to
    replace the ``KeyboardInterrupt``. The interrupt is raised, the connection is
    dropped, and the next read gets a good one (a SIGINT to a shared drill)."""
    from tests.conftest import PG_DSN

    psycopg = pytest.importorskip("psycopg")
    try:
        psycopg.connect(PG_DSN, connect_timeout=3).close()
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL on 127.0.0.1:5432 is not reachable: {exc}")
    engine = db.create_engine("postgresql+psycopg://postgres@127.0.0.1:5432/test")
    try:
        for _ in range(2):
            with pytest.raises(KeyboardInterrupt), db.cursor(engine, write=False) as cur:
                # As an interrupted statement leaves it: sent, its result not read.
                cur.connection.pgconn.send_query(b"SELECT pg_sleep(0.1)")
                raise KeyboardInterrupt
            with db.cursor(engine, write=False) as cur:
                cur.execute("SELECT 1")
                assert cur.fetchone() == (1,)
    finally:
        engine.dispose()


def test_sqlite_file_names_the_file_of_every_url_form(tmp_path: Path) -> None:
    from sqlalchemy.engine import make_url

    path = tmp_path / "a b" / "catalog.db"
    assert db.sqlite_file(make_url(db.sqlite_url(path))) == str(path)
    quoted = str(path).replace(" ", "%20")
    assert db.sqlite_file(make_url(f"sqlite:///file:{quoted}?mode=ro&uri=true")) == str(path)
    assert db.sqlite_file(make_url(f"sqlite:///file:{quoted}?mode=rw&uri=1")) == str(path)
    for memory in ("sqlite://", "sqlite:///:memory:", "sqlite:///file:x?mode=memory&uri=true"):
        assert db.sqlite_file(make_url(memory)) is None
    assert db.sqlite_file(make_url("postgresql+psycopg://u@h/d")) is None
    # Without uri=true SQLite takes the name literally, and so does keyshred.
    assert db.sqlite_file(make_url("sqlite:///file:x.db")) == "file:x.db"
