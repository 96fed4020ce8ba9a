"""The one database layer: SQLAlchemy engines for the catalog and the key store.

Every table of every component is reached through an engine built here, on SQLite
(embedded profile) or PostgreSQL (shared profile):

- one bounded pool per engine (``pool_size + max_overflow`` connections, each checked
  out for one operation or transaction); a PostgreSQL connection whose server hung up
  is replaced at checkout (``keyshred._pooling``), ``pre_ping`` adds a round trip;
- driver errors that mean "the database cannot be reached" are raised as
  ``BackendUnavailable`` without the driver's message (it can quote a statement and
  its parameters);
- SQLite runs in WAL mode with ``secure_delete`` and a busy timeout; a connection
  marked ``ks_write`` begins with ``BEGIN IMMEDIATE``, so a read of the guard and the
  write that depends on it see the same database state;
- hot paths (the guard check and the asset insert of every put and get) run
  statements built with SQLAlchemy Core, compiled once by SQLAlchemy's compiler in
  the driver's own parameter style (``compile_sql``), on a DBAPI cursor of a pooled
  connection (``cursor``): SQLAlchemy's execution machinery cost more per statement
  than the rest of a put. On SQLite a few of those connections stay parked between
  operations (``_Parked``): the pool's own checkout cost as much as a statement.

This module sits at the bottom of the layers (beside ``errors``): the keyring, the
storage and the services all build on it, none of them on each other's engines.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import urllib.parse
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Dialect, Engine
from sqlalchemy.pool import QueuePool
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler

from keyshred._pooling import replace_hung_up, unreachable
from keyshred.errors import (
    BackendUnavailable,
    ConfigError,
    IntegrityError,
    KeyshredError,
    MissingExtraError,
)

__all__ = [
    "Micros",
    "blob",
    "compile_sql",
    "create_engine",
    "cursor",
    "micros",
    "migrate",
    "parked_connections",
    "read",
    "sqlite_file",
    "sqlite_url",
    "utc",
    "write",
]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
SQLITE_PRAGMAS = ("journal_mode=WAL", "synchronous=NORMAL", "secure_delete=ON")


def sqlite_url(path: str | os.PathLike[str]) -> str:
    return f"sqlite:///{Path(path)}"


def sqlite_file(url: sa.engine.URL) -> str | None:
    """The file of a SQLite URL; None for an in-memory database or another dialect.
    A URI-form URL (``sqlite:///file:/path/x.db?mode=ro&uri=true``) names its file
    after ``file:``: taken literally, side files (the guard generation, the subject
    locks, the events bus) went to a ``file:`` folder under the working directory."""
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    database = str(url.database)
    if str(url.query.get("uri", "")).lower() in ("true", "1") and database.startswith("file:"):
        if url.query.get("mode") == "memory":
            return None
        path = urllib.parse.unquote(urllib.parse.urlsplit(database).path)
        return path or None
    return database


def blob(value: object) -> bytes:
    """A BLOB/BYTEA column's value as bytes; ``IntegrityError`` for anything else.
    SQLite keeps any type in any column: a sealed value rewritten as text by hand
    (``UPDATE ... SET record = hex(record)``) reads back as ``str``, which
    ``bytes()`` refuses with a TypeError, not as the altered record it is."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise IntegrityError("a stored binary value is not binary: the database was altered")


def micros(value: datetime) -> int:
    """A datetime as integer microseconds since 1970 UTC (naive means UTC)."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return (value - _EPOCH) // _MICROSECOND


class Micros(sa.types.TypeDecorator[datetime]):
    """A UTC datetime stored as integer microseconds since 1970: hot paths bind
    integers, because formatting datetimes cost more than the rest of a row.
    SQLAlchemy statements still bind and return aware datetimes."""

    impl = sa.BigInteger
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> int | None:
        if value is None or isinstance(value, int):
            return value
        return micros(value)

    def process_result_value(self, value: Any, dialect: Any) -> datetime | None:
        return None if value is None else _EPOCH + timedelta(microseconds=int(value))


def utc(value: datetime | str | None) -> datetime | None:
    """Aware UTC from whatever the driver returned (SQLite gives naive UTC text)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _pool_options(
    url: sa.engine.URL, pool_size: int, max_overflow: int, pool_timeout: float, pre_ping: bool
) -> dict[str, Any]:
    if url.get_backend_name() == "sqlite" and sqlite_file(url) is None:
        return {}  # in memory: SQLAlchemy's one-connection pool, nothing to bound
    options: dict[str, Any] = {
        "poolclass": QueuePool,
        "pool_size": pool_size,
        "max_overflow": max_overflow,
        "pool_timeout": pool_timeout,
    }
    if url.get_backend_name() != "sqlite":
        options["pool_pre_ping"] = pre_ping
    return options


def missing_driver(exc: ImportError, what: str = "catalog") -> KeyshredError:
    """The URL names a database driver that is not installed: say which package and
    extra (the URL itself may hold a password, so it is not repeated)."""
    if exc.name == "psycopg":
        return MissingExtraError("postgres", "psycopg")
    return ConfigError(
        f"the {what} URL's database driver is not installed ({exc.name or 'unknown'}); "
        "for PostgreSQL write postgresql+psycopg://... and pip install 'keyshred[postgres]'"
    )


def unavailable(exc: BaseException, what: str = "catalog") -> BackendUnavailable:
    # The driver's message is left out: it can quote a statement and its parameters.
    return BackendUnavailable(f"the {what} database cannot be reached ({type(exc).__name__})")


def create_engine(
    url: str | sa.engine.URL,
    *,
    what: str = "catalog",
    pool_size: int = 5,
    max_overflow: int = 10,
    pool_timeout: float = 30.0,
    pre_ping: bool = False,
    busy_timeout_ms: int = 30000,
    durable: bool = False,
) -> Engine:
    """An engine on SQLite or PostgreSQL with keyshred's pool, error mapping and
    SQLite settings; ``ConfigError`` for any other database or a malformed URL,
    ``MissingExtraError`` when the driver is not installed. ``what`` names the
    database in error messages ("catalog", "key store"). ``durable``: on SQLite
    every commit is fsync'd (``synchronous=FULL``), so a commit survives power loss
    and not only a killed process (the catalog holds the hot tier of memories)."""
    try:
        parsed = sa.engine.make_url(url)
        engine = sa.create_engine(
            parsed,
            # A statement error must not quote its parameters (wrapped keys,
            # subject_refs, sealed values) into a message or a log.
            hide_parameters=True,
            **_pool_options(parsed, pool_size, max_overflow, pool_timeout, pre_ping),
        )
    except ImportError as exc:
        raise missing_driver(exc, what) from None
    except (sa.exc.ArgumentError, TypeError) as exc:
        raise ConfigError(f"cannot use the {what} URL: {type(exc).__name__}") from None
    dialect = engine.dialect.name
    if dialect == "postgresql":
        replace_hung_up(engine)
    elif dialect == "sqlite":
        _sqlite_setup(engine, busy_timeout_ms, durable)
        if sqlite_file(engine.url) is not None and pool_size > 1:
            parked = _Parked(min(4, pool_size - 1), pool_size + max_overflow)
            engine.__dict__["_ks_parked"] = parked
            event.listen(engine, "engine_disposed", lambda _: parked.dispose())
    else:
        engine.dispose()
        raise ConfigError(f"the {what} runs on SQLite or PostgreSQL, not {dialect}")
    _watch_errors(engine, what)
    return engine


def _watch_errors(engine: Engine, what: str) -> None:
    """Statements raise ``BackendUnavailable`` instead of the driver's error when the
    database cannot be reached."""
    dialect, dbapi = engine.dialect.name, engine.dialect.dbapi

    @event.listens_for(engine, "handle_error")
    def _handle_error(context: sa.engine.ExceptionContext) -> BaseException | None:
        if context.is_pre_ping:  # the pool reconnects by itself
            return None
        if context.is_disconnect or unreachable(dialect, dbapi, context.original_exception):
            return unavailable(context.original_exception, what)
        return None


def _sqlite_setup(engine: Engine, busy_timeout_ms: int, durable: bool = False) -> None:
    path = sqlite_file(engine.url)
    if path is not None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        if not p.exists():  # owner-only from the first byte
            os.close(os.open(p, os.O_WRONLY | os.O_CREAT, 0o600))

    @event.listens_for(engine, "connect")
    def _connect(dbapi: Any, _: Any) -> None:
        dbapi.isolation_level = None  # we issue BEGIN ourselves, below
        cur = dbapi.cursor()
        extra = ("synchronous=FULL",) if durable else ()
        for pragma in (*SQLITE_PRAGMAS, *extra, f"busy_timeout={int(busy_timeout_ms)}"):
            cur.execute(f"PRAGMA {pragma}")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        # Writes take the write lock up front: the guard check and the insert that
        # depends on it then see the same database state.
        immediate = conn.get_execution_options().get("ks_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


@contextmanager
def write(engine: Engine) -> Iterator[Connection]:
    """A write transaction (``BEGIN IMMEDIATE`` on SQLite, committed on success)."""
    with engine.connect().execution_options(ks_write=True) as conn, conn.begin():
        yield conn


@contextmanager
def read(engine: Engine) -> Iterator[Connection]:
    """A read transaction."""
    with engine.connect() as conn, conn.begin():
        yield conn


# -- hot paths: statements compiled once, run on a pooled DBAPI connection ----------
#
# Going through SQLAlchemy's execution machinery costs ~180 us per statement, more
# than the rest of a put; the statements of the paths every put and get take are
# built with SQLAlchemy Core, compiled once here and run on the driver's cursor.

# The driver's parameter styles, by dialect: named (a dict of values) and positional.
_PARAMSTYLES = {"sqlite": ("named", "qmark"), "postgresql": ("pyformat", "format")}


def compile_sql(dialect: Dialect, statement: ClauseElement, *, positional: bool = False) -> str:
    """``statement`` as SQL text for the driver of ``dialect``, compiled by SQLAlchemy
    in one of the driver's own parameter styles: named (``:name`` for sqlite3,
    ``%(name)s`` for psycopg, bound with a dict) or, with ``positional``, positional
    (``?``/``%s``, bound with a sequence in the order of the statement's
    parameters). Every parameter is a ``bindparam`` the caller binds: a constant in
    the statement (``column == "active"``) is refused, because its value would not
    be in the text."""
    named, by_position = _PARAMSTYLES[dialect.name]
    style = by_position if positional else named
    # Every open of a store compiles the same few hundred statements, built afresh
    # from the same tables: their text is remembered by SQLAlchemy's cache key of
    # the statement (its structure, not its bound values: a statement here has none),
    # which costs a tenth of a compilation. A statement without a key is compiled.
    # (A statement with a constant is compiled, to be refused below.)
    cache_key = statement._generate_cache_key()
    key = (
        (type(dialect), style, cache_key.key)
        if cache_key is not None and all(b.required for b in cache_key.bindparams)
        else None
    )
    if key is not None:
        with _TEXTS_LOCK:
            text = _TEXTS.get(key)
        if text is not None:
            return text
    if dialect.paramstyle != style:
        dialect = _restyled(dialect, style)
    compiled = cast(SQLCompiler, statement.compile(dialect=dialect))
    constants = sorted(k for k, b in compiled.binds.items() if not b.required)
    if constants:
        raise ValueError(f"bind these parameters by name, not as constants: {constants}")
    if key is not None:
        with _TEXTS_LOCK:
            if len(_TEXTS) >= _TEXTS_MAX:  # statements built with a varying shape
                _TEXTS.clear()
            _TEXTS[key] = compiled.string
    return compiled.string


_TEXTS: dict[tuple[Any, ...], str] = {}
_TEXTS_LOCK = threading.Lock()
_TEXTS_MAX = 4096


_RESTYLED: dict[tuple[type[Dialect], str], Dialect] = {}


def _restyled(dialect: Dialect, style: str) -> Dialect:
    """The same dialect class in another of its driver's parameter styles (sqlite3
    and psycopg take both); the engine's own dialect is left as it is."""
    key = (type(dialect), style)
    restyled = _RESTYLED.get(key)
    if restyled is None:
        restyled = _RESTYLED[key] = type(dialect)(paramstyle=style, dbapi=dialect.dbapi)  # type: ignore[call-arg]
    return restyled


@contextmanager
def cursor(
    engine: Engine, *, write: bool, what: str = "catalog", snapshot: bool = False
) -> Iterator[Any]:
    """A DBAPI cursor on a connection checked out of ``engine``'s pool for one
    operation, in a transaction for writes (``BEGIN IMMEDIATE`` on SQLite, committed
    when the block ends, rolled back on an error). A read runs in autocommit on both
    databases (one SELECT is atomic by itself, and under PostgreSQL's READ COMMITTED
    every statement of a transaction takes its own snapshot anyway): on PostgreSQL a
    transaction around it would cost a BEGIN and a COMMIT, two round trips, for
    nothing, and a session lock taken on such a cursor would sit idle in a
    transaction. The connection goes back to the pool however the block ends (out of
    autocommit again); one the driver found broken is dropped, and "cannot be
    reached" is ``BackendUnavailable`` as for every other statement.

    ``snapshot`` (reads only): the block's statements see one instant, in a read
    transaction (SQLite's deferred ``BEGIN``, which takes no write lock;
    PostgreSQL's ``REPEATABLE READ, READ ONLY``), for a reader that must not see
    half of a commit between two of its statements.

    On a SQLite file the connection comes from, and goes back to, the engine's few
    parked ones when it can (``_Parked``)."""
    dialect, dbapi = engine.dialect.name, engine.dialect.dbapi
    parked: _Parked | None = engine.__dict__.get("_ks_parked")
    fairy, generation = parked.take() if parked is not None else (None, 0)
    if fairy is None:
        try:
            fairy = engine.raw_connection()
        except Exception as exc:
            if unreachable(dialect, dbapi, exc):
                raise unavailable(exc, what) from None
            raise
    clean = False
    try:
        conn: Any = fairy.driver_connection
        cur = conn.cursor()
        try:
            if snapshot and not write:
                yield from _in_snapshot(dialect, conn, cur)
            elif dialect == "sqlite" and not write:
                yield cur
            elif not write and _autocommit(conn):
                ended = False
                try:
                    yield cur
                    ended = True
                finally:
                    try:
                        conn.autocommit = False  # as the pool's other users expect it
                    except Exception:
                        fairy.invalidate()  # never back into the pool in autocommit
                        # After the block raised (a Ctrl-C inside a statement leaves
                        # it running: psycopg refuses the switch), its error is the
                        # one to raise, not this one.
                        if ended:
                            raise
            else:
                yield from _in_transaction(dialect, conn, cur)
        finally:
            with contextlib.suppress(Exception):  # a dead connection's cursor
                cur.close()
        clean = True
    except Exception as exc:
        if not unreachable(dialect, dbapi, exc):
            raise
        if getattr(fairy.driver_connection, "closed", False):
            fairy.invalidate()  # not back into the pool
        raise unavailable(exc, what) from None
    finally:
        if not (clean and parked is not None and parked.give(fairy, generation, engine)):
            fairy.close()


class _Parked:
    """A few SQLite connections kept checked out of the engine's pool between the
    hot path's operations (``cursor``). SQLAlchemy's checkout and check-in (the
    fairy, its events, the reset) cost 10-40 us, as much as the statement they
    wrap; taking a parked connection is a pop under a lock.

    Only a connection whose block ended cleanly and that holds no transaction is
    parked (a read ends with its cursor; a write commits or rolls back); anything
    else goes back to the pool, which rolls it back. At most ``cap`` are parked
    (at most the pool's size less one), and only while two of the pool's
    ``capacity`` (size + overflow) stay free besides: connections held for good
    elsewhere (the vault's writer) and SQLAlchemy's own paths, one inside another,
    never wait on a parked one. The engine's ``dispose`` closes the parked ones at
    once, and one handed in after that is not parked. After a fork they belong to
    the parent: the child neither uses nor closes them (``_after_fork_in_child``
    resets every instance, lock included: a thread of the parent may have held
    it)."""

    __slots__ = ("__weakref__", "cap", "capacity", "free", "generation", "lock")

    def __init__(self, cap: int, capacity: int) -> None:
        self.cap = cap
        self.capacity = capacity
        self.free: list[Any] = []
        self.generation = 0
        self.lock = threading.Lock()
        _ALL_PARKED.add(self)

    def take(self) -> tuple[Any, int]:
        """A parked connection (or None) and the generation to hand it back in."""
        with self.lock:
            return (self.free.pop() if self.free else None), self.generation

    def give(self, fairy: Any, generation: int, engine: Engine) -> bool:
        """Park ``fairy`` if there is room and nothing was disposed since it was
        taken; False: the caller returns it to the pool."""
        if fairy.driver_connection.in_transaction:
            return False
        # Checked out now, this one included: parked, in use, held for good.
        held: int = engine.pool.checkedout()  # type: ignore[attr-defined]
        if self.capacity - held < 2:
            return False
        with self.lock:
            if generation != self.generation or len(self.free) >= self.cap:
                return False
            self.free.append(fairy)
            return True

    def forked(self) -> None:
        """In a forked child: the parked connections are the parent's. Dropping them
        would let the garbage collector check them in to this copy of the pool,
        which would hand them out here; they are kept, unused, instead."""
        _PARENTS.extend(self.free)
        self.free = []
        self.lock = threading.Lock()
        self.generation += 1

    def dispose(self) -> None:
        with self.lock:
            free, self.free = self.free, []
            self.generation += 1
        for fairy in free:
            # Closed now, not when the pool they came from is collected: ``dispose``
            # has already replaced that pool.
            with contextlib.suppress(Exception):
                fairy.invalidate()


_PARENTS: list[Any] = []  # in a forked child: the parent's parked connections, unused
_ALL_PARKED: weakref.WeakSet[_Parked] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for parked in list(_ALL_PARKED):
        parked.forked()


# Registered when this module is imported, before the catalog's and the key store's
# own handlers (they dispose their engines in the child): those run after this one.
os.register_at_fork(after_in_child=_after_fork_in_child)


def parked_connections(engine: Engine) -> int:
    """How many of ``engine``'s connections ``cursor`` holds parked (for tests and
    the pool's accounting: the rest of ``pool.checkedout()`` is in use)."""
    parked: _Parked | None = engine.__dict__.get("_ks_parked")
    return 0 if parked is None else len(parked.free)


_IDLE = 0  # psycopg.pq.TransactionStatus.IDLE: no transaction open on the connection


def _autocommit(conn: Any) -> bool:
    """Put an idle pooled psycopg connection in autocommit for a read (no round
    trip: the driver sends nothing until the next statement); False if it is not
    idle, and the read then runs in a transaction as a write does."""
    if conn.info.transaction_status != _IDLE:
        return False
    conn.autocommit = True
    return True


def _in_snapshot(dialect: str, conn: Any, cur: Any) -> Iterator[Any]:
    """``cursor``'s read transaction around the caller's block (ended by a rollback:
    it wrote nothing)."""
    if dialect == "sqlite":
        cur.execute("BEGIN")  # deferred: the first SELECT takes the read snapshot
    else:
        # psycopg opens the transaction with this statement (the pooled connection
        # is not in autocommit here), so it is the transaction's first.
        cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
    try:
        yield cur
    finally:
        with contextlib.suppress(Exception):  # a dead connection: the server ends it
            cur.execute("ROLLBACK") if dialect == "sqlite" else conn.rollback()


def _in_transaction(dialect: str, conn: Any, cur: Any) -> Iterator[Any]:
    """``cursor``'s transaction around the caller's block."""
    sqlite = dialect == "sqlite"
    if sqlite:
        cur.execute("BEGIN IMMEDIATE")
    try:
        yield cur
    except BaseException:
        # A connection that died mid-transaction cannot roll back; the server drops
        # its transaction by itself, and the caller's error says more.
        with contextlib.suppress(Exception):
            cur.execute("ROLLBACK") if sqlite else conn.rollback()
        raise
    if sqlite:
        cur.execute("COMMIT")
    else:
        conn.commit()


# Every component's schema changes are Alembic revisions in its own script folder
# with its own version table (the key store and the catalog may share one PostgreSQL
# database, or live in two SQLite files). ``env.py`` in each folder reads the
# connection and the version table from ``config.attributes``.
_MIGRATION_LOCK = 0x6B73_6D69  # "ksmi": PostgreSQL advisory lock held while migrating
AUDIT_LOCK = 7741207360620623204  # "ks-audit": the audit chain's writers, one at a time


def lock_key(base: int, schema: str | None) -> int:
    """The advisory lock ``base`` of one schema. Advisory locks belong to the whole
    database while keyshred's tables live in a schema (``search_path``): stores in
    two schemas of one database must not wait on each other's locks (nor hang
    behind one left held). The ``public`` schema keeps ``base`` itself, so a
    deployment there shares its locks with processes of earlier releases."""
    if schema in (None, "public"):
        return base
    digest = hashlib.sha256(f"keyshred-lock\x00{schema}\x00{base}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # a signed bigint


_SCHEMAS: dict[str, str | None] = {}


def current_schema(conn: Any) -> str | None:
    """The schema a PostgreSQL connection's tables live in (its search_path's first
    existing one), remembered per engine URL (the URL carries the search_path);
    ``conn`` is a SQLAlchemy ``Connection`` or a DB-API cursor of that engine."""
    if isinstance(conn, Connection):
        key = conn.engine.url.render_as_string(hide_password=True)
        if key not in _SCHEMAS:
            value = conn.exec_driver_sql("SELECT current_schema()").scalar()
            if value is not None:  # not created yet: ask again next time
                _SCHEMAS[key] = str(value)
            return None if value is None else str(value)
        return _SCHEMAS[key]
    conn.execute("SELECT current_schema()")
    row = conn.fetchone()
    return None if row is None or row[0] is None else str(row[0])


def advisory_xact_lock(conn: Connection, base: int) -> None:
    """Take the transaction-scoped advisory lock ``base`` of the connection's schema."""
    key = lock_key(base, current_schema(conn))
    conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({key})")


def _known_revisions(cfg: Any) -> frozenset[str]:
    from alembic.script import ScriptDirectory

    return frozenset(r.revision for r in ScriptDirectory.from_config(cfg).walk_revisions())


def _stores_on_path(conn: Connection, version_table: str, schema: str) -> list[str]:
    """The other schemas of the connection's search path with a ``version_table``."""
    rows = conn.execute(
        sa.text(
            "SELECT n.nspname FROM pg_catalog.pg_class c "
            "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
            "WHERE c.relname = :table AND n.nspname <> :schema "
            "AND n.nspname = ANY (current_schemas(false)) ORDER BY n.nspname"
        ),
        {"table": version_table, "schema": schema},
    )
    return [str(name) for name in rows.scalars()]


def _versions(engine: Engine, version_table: str) -> frozenset[str] | None:
    """The revisions the version table names, ``None`` if there is none (a new or
    unversioned database). Read without the migration lock: whatever is not the
    newest revision is decided again under it."""
    try:
        with engine.connect() as conn:
            # On PostgreSQL the current schema's table, where Alembic keeps it: a bare
            # name would also find one further down the search path.
            schema = current_schema(conn) if conn.dialect.name == "postgresql" else None
            version: sa.ColumnClause[str] = sa.column("version_num")
            query = sa.select(version).select_from(sa.table(version_table, schema=schema))
            rows = conn.execute(query).scalars()
            return frozenset(str(r) for r in rows)
    except sa.exc.DBAPIError:  # no such table (one that cannot be reached raises
        return None  # BackendUnavailable, not caught here)


def migrate(
    engine: Engine,
    script_location: str,
    version_table: str,
    *,
    legacy_table: str | None = None,
    legacy_revision: str | None = None,
    prepare_legacy: Callable[[Connection], None] | None = None,
    head: str,
    models: sa.MetaData | None = None,
    what: str = "database",
) -> None:
    """Bring ``engine``'s tables of one component (``what``: "catalog", "key store")
    to the newest revision in
    ``script_location`` (``"keyshred.keyring:migrations"``).

    A database written before versioned migrations (it has ``legacy_table`` but no
    version table) is first stamped at ``legacy_revision``, the revision whose schema
    it has; ``prepare_legacy`` runs on it just before, in the same transaction: it
    brings an older unversioned layout to that revision's schema, or refuses it with
    a ``KeyshredError``. Processes that open one database at once migrate one after
    another (PostgreSQL: an advisory lock; SQLite: the write lock of ``BEGIN
    IMMEDIATE``), each in one transaction.

    A database that holds none of ``models``' tables and no version table is built
    from ``models`` (``create_all``) and stamped at the newest revision, as Alembic's
    documentation advises for a new database. Replaying every revision builds the
    same tables with more statements (SQLite copies a table for each batch
    alteration): a new catalog took 2.5-3.5 times as long that way
    (``benchmarks/bench_new_database.py``). The callers' tests compare the two
    schemas as the database reports them (``tests/storage/test_migrations.py``,
    ``tests/keyring/test_keystore_migrations.py``).

    A database already at ``head``, the newest revision (every open after the
    first), is told by one read of its version table, without the lock and without
    importing Alembic: its import and the compiling of every revision file to learn
    the head cost a process's first open about 180 ms. Each caller names its head
    as a constant that a test compares with Alembic's (``tests/test_db_migrate.py``).
    One whose version table names a revision this code does not have (a newer
    keyshred wrote it) is refused with ``ConfigError``; Alembic's own error is not a
    ``KeyshredError``. So is a schema change the database refuses (a PostgreSQL role
    that may not create tables in the schema: a role that may only read and write
    rows opens a database already at the newest revision), and, on PostgreSQL, a new
    store in front of another one further down the search path."""
    current = _versions(engine, version_table)
    if current == frozenset((head,)):
        return  # every open after the first: no lock, no Alembic
    try:
        from alembic import command
        from alembic.config import Config as AlembicConfig
        from alembic.util import CommandError
    except ImportError:  # a core dependency: only a broken install lacks it
        raise MissingExtraError("core", "alembic") from None
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", script_location)
    if current is not None and not current <= _known_revisions(cfg):
        raise ConfigError(  # the unknown value is not quoted: it is the database's text
            f"{version_table} names a revision this keyshred does not have: a newer "
            "keyshred wrote this database; open it with that version"
        )
    try:
        with engine.connect().execution_options(ks_write=True) as conn, conn.begin():
            if conn.dialect.name == "postgresql":
                advisory_xact_lock(conn, _MIGRATION_LOCK)
            # On PostgreSQL the current schema alone: SQLAlchemy's table names,
            # Alembic's version table check, the revisions and the legacy steps all
            # use bare names, which find a table anywhere on the search path (another
            # store's further down would pass for this one's, or be altered). For
            # this transaction the search path is that schema alone.
            schema = current_schema(conn) if conn.dialect.name == "postgresql" else None
            elsewhere = [] if schema is None else _stores_on_path(conn, version_table, schema)
            if schema is not None:
                conn.execute(
                    sa.text("SELECT set_config('search_path', :path, true)"),
                    {"path": '"' + schema.replace('"', '""') + '"'},
                )
            cfg.attributes["connection"] = conn
            cfg.attributes["version_table"] = version_table
            names = set(sa.inspect(conn).get_table_names(schema=schema))
            ours = {version_table, legacy_table, *(models.tables if models else ())}
            new = not names & ours
            if new and elsewhere:
                # A new store here would leave that one's data in place, unseen: an
                # erasure here would not reach it (a schema named after the role,
                # created later, comes first in PostgreSQL's default search path).
                raise ConfigError(
                    f"schema {schema!r}, the first of the search_path, has no {what}, and "
                    f"{', '.join(repr(e) for e in elsewhere)} further down it has one: set "
                    "the search_path to the one schema to use (options=-csearch_path=NAME)"
                )
            if new and models is not None:
                models.create_all(conn, checkfirst=False)
                command.stamp(cfg, "head")
                return
            if (
                legacy_table is not None
                and legacy_revision is not None
                and legacy_table in names
                and version_table not in names
            ):
                if prepare_legacy is not None:
                    prepare_legacy(conn)
                command.stamp(cfg, legacy_revision)
            command.upgrade(cfg, "head")
    except CommandError:  # its message quotes the version table's rows
        raise ConfigError(
            f"{version_table} names revisions this keyshred cannot upgrade from "
            "together: it holds one row, the revision the tables are at; restore it"
        ) from None
    except sa.exc.DBAPIError as exc:  # the driver's message quotes the statement
        denied = getattr(exc.orig, "sqlstate", None) == "42501"  # insufficient_privilege
        raise ConfigError(
            f"the {what} database could not be checked or brought to the newest schema "
            f"({type(exc.orig).__name__})"
            + (
                ": the role lacks a privilege; the first open and each upgrade need a "
                "role that may create tables in the schema (its owner), after that "
                "reading and writing rows is enough"
                if denied
                else ""
            )
        ) from None
