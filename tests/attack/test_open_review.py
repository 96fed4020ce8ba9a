"""A fresh-eyes review of ``keyshred.db.migrate`` as every open runs it (7788ee5..398e0dc):
the unlocked read of the version table, the refusal of unknown revisions, the locked
path confined to the current PostgreSQL schema, and what escapes ``Keyshred.open``.

Two bugs were found and fixed (``keyshred/db.py``):

- On PostgreSQL the locked path inspected the current schema, but the Alembic
  revisions (``get_table_names()`` guards in r0004, r0007, r0010-r0014) and the
  legacy step (``_prepare_legacy``: ``get_table_names``, ``ALTER TABLE``,
  ``create_all(checkfirst=True)``) still inspected bare names, which PostgreSQL
  resolves along the whole search path. A store at an older revision, or from
  before versioned migrations, whose search path goes on to a schema with another
  store at the newest revision, was stamped at the newest revision without the
  tables the other one has: its statements then read and wrote the other store's
  tables (its jobs, vectors, tokens, audit chain...). The migration's transaction
  now sets its search path to the current schema alone (``SET LOCAL``).
- A version table with two rows (a revision and its ancestor) made Alembic raise
  its own ``CommandError`` out of ``Keyshred.open``; it is a ``ConfigError`` now.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config as AlembicConfig

from keyshred import Keyshred, db
from keyshred.config import Config, KeyringSettings, StorageSettings
from keyshred.errors import BackendUnavailable, ConfigError, KeyshredError
from keyshred.keyring import schema as keystore_schema
from keyshred.keyring.keystore import SqlKeyStore
from keyshred.migrations import SCRIPT_LOCATION, VERSION_TABLE, migrate_catalog
from keyshred.migrations import baseline as old
from keyshred.storage.catalog import Catalog
from tests import zygote
from tests.conftest import PG_DSN, PG_URL, as_role, pg_role, pg_schema, pg_url
from tests.schema_report import schema_report

CATALOG_HEAD = "0016"
KEYSTORE_HEAD = "0003"
# Words a driver's message or a statement would carry: none may reach an error of
# the public API.
LEAKS = ("SELECT", "CREATE", "ALTER", "INSERT", "sqlite3", "psycopg", "[SQL", "Background")


def _no_leak(exc: BaseException, *extra: str) -> None:
    text = str(exc)
    for word in (*LEAKS, *extra):
        assert word not in text, text
    # A ConfigError is raised from None; BackendUnavailable keeps the driver's error as
    # its cause (SQLAlchemy's handle_error chains it: older than this change).
    if isinstance(exc, ConfigError):
        assert exc.__cause__ is None or isinstance(exc.__cause__, KeyshredError)


def _config(url: str | None) -> Config:
    return Config(storage=StorageSettings(catalog_url=url), keyring=KeyringSettings(store_url=url))


def _urls(folder: Path, url: str | None) -> tuple[str, str]:
    """The catalog's and the key store's URLs of a store made with ``_config(url)``."""
    if url is not None:
        return url, url
    return db.sqlite_url(folder / "catalog" / "catalog.db"), db.sqlite_url(
        folder / "keys" / "keystore.db"
    )


def _rows(url: str, sql: str) -> list[tuple[object, ...]]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.exec_driver_sql(sql)]
    finally:
        engine.dispose()


def _run(url: str, *sql: str) -> None:
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            for statement in sql:
                conn.exec_driver_sql(statement)
    finally:
        engine.dispose()


def _alembic(url: str, action: str, revision: str) -> None:
    """Alembic's ``upgrade`` or ``downgrade`` of the catalog at ``url`` to ``revision``
    (an upgrade of a new database builds it as that release did)."""
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", SCRIPT_LOCATION)
    engine = db.create_engine(url, what="catalog")
    try:
        with engine.connect() as conn, conn.begin():
            cfg.attributes["connection"] = conn
            cfg.attributes["version_table"] = VERSION_TABLE
            getattr(command, action)(cfg, revision)
    finally:
        engine.dispose()


def _downgrade_keystore(url: str) -> None:
    """The key store back at 0002 (it has no downgrades: 0003 only adds an index)."""
    p = "" if url.startswith("sqlite") else "ks_"
    _run(
        url,
        f"DROP INDEX {p}tombstone_key_tombstone",
        f"UPDATE {keystore_schema.VERSION_TABLE} SET version_num = '0002'",
    )


def _tables(schema: str) -> set[str]:
    with psycopg.connect(PG_DSN) as conn:
        rows = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = %s", (schema,))
        return {str(r[0]) for r in rows}


def _resolved(url: str, names: set[str]) -> dict[str, str]:
    """Where each bare table name resolves on ``url``'s search path (what the store's
    own statements reach)."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            sql = (
                "SELECT relnamespace::regnamespace::text FROM pg_class "
                "WHERE oid = to_regclass('{}')"
            )
            return {
                name: f"{conn.exec_driver_sql(sql.format(name)).scalar()}.{name}"
                for name in sorted(names)
            }
    finally:
        engine.dispose()


# -- PostgreSQL: another store further down the search path ---------------------------


def test_an_older_catalog_upgraded_beside_a_newer_store_later_on_the_path_gets_its_own_tables() -> (
    None
):
    """BUG (fixed): revisions 0013 and 0014 skip their CREATE TABLE when
    ``get_table_names()`` (every table on the search path) names the table. Schema
    ``mine`` at 0012, ``other`` at the newest revision after it on the path: the
    upgrade stamped ``mine`` at the newest revision without ``ks_mem_vectors`` and
    ``ks_erasure_items``, and the store's vectors went to ``other``'s table."""
    with pg_schema() as other, pg_schema() as mine:
        Catalog(pg_url(other), migrate=migrate_catalog).close()
        _alembic(pg_url(mine), "upgrade", "0012")
        before = _tables(other)
        url = f"{PG_URL}?options=-csearch_path%3D{mine}%2C{other}"
        Catalog(url, migrate=migrate_catalog).close()
        assert _rows(pg_url(mine), f"SELECT version_num FROM {VERSION_TABLE}") == [(CATALOG_HEAD,)]
        assert before - _tables(mine) == set()
        assert set(_resolved(url, before).values()) == {f"{mine}.{t}" for t in before}


def test_a_legacy_catalog_beside_a_newer_store_later_on_the_path_gets_its_own_tables() -> None:
    """BUG (fixed): a catalog from before versioned migrations (its ``ks_assets``
    alone, as ``test_catalogs_from_before_mention_provenance_and_sealed_identifiers``
    builds one) in ``mine``, another store at the newest revision in ``other`` after
    it on the path. ``_prepare_legacy`` saw ``other``'s tables as this one's (its
    ``create_all(checkfirst=True)`` made none) and the revisions' guards did too: the
    catalog was stamped at the newest revision with ``ks_assets`` as its only table,
    every other statement reaching ``other``'s. ``other`` must stay as it was."""
    with pg_schema() as other, pg_schema() as mine:
        Catalog(pg_url(other), migrate=migrate_catalog).close()
        engine = sa.create_engine(pg_url(other))
        try:
            other_before = schema_report(engine)
        finally:
            engine.dispose()
        engine = sa.create_engine(pg_url(mine))
        try:
            with engine.begin() as conn:
                old.assets.create(conn)
        finally:
            engine.dispose()
        url = f"{PG_URL}?options=-csearch_path%3D{mine}%2C{other}"
        Catalog(url, migrate=migrate_catalog).close()
        theirs = _tables(other)
        assert theirs - _tables(mine) == set()
        assert set(_resolved(url, theirs).values()) == {f"{mine}.{t}" for t in theirs}
        engine = sa.create_engine(pg_url(other))
        try:
            assert schema_report(engine) == other_before
        finally:
            engine.dispose()
        # ``mine`` is the schema a new catalog has.
        with pg_schema() as fresh:
            Catalog(pg_url(fresh), migrate=migrate_catalog).close()
            reports = []
            for schema in (mine, fresh):
                engine = sa.create_engine(pg_url(schema))
                reports.append(schema_report(engine))
                engine.dispose()
        assert reports[0] == reports[1]


def test_a_legacy_key_store_beside_a_newer_one_later_on_the_path_gets_its_own_tables() -> None:
    """The key store's legacy step (``unversioned_to_0001``) inspects bare names too;
    its DDL is ``CREATE ... IF NOT EXISTS`` in the current schema, so it did no harm:
    the legacy key store ends with all of its own tables, the other untouched."""
    ddl = (Path(__file__).parents[1] / "data" / "keystore" / "fae494a.postgresql.sql").read_text()
    with pg_schema() as other, pg_schema() as mine:
        SqlKeyStore(pg_url(other)).close()
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(f"SET search_path TO {mine}")
            conn.execute(ddl)
            conn.execute("ALTER TABLE ks_dek DROP COLUMN owner_tag")  # from before #19
            conn.execute("DROP TABLE ks_epoch_key")
        theirs = _tables(other)
        SqlKeyStore(f"{PG_URL}?options=-csearch_path%3D{mine}%2C{other}").close()
        assert theirs - _tables(mine) == set()
        assert _tables(other) == theirs
        assert _rows(pg_url(mine), f"SELECT version_num FROM {keystore_schema.VERSION_TABLE}") == [
            (KEYSTORE_HEAD,)
        ]


def test_a_user_search_path_opens_the_roles_schema_when_it_exists_and_the_next_one_if_not() -> None:
    """``search_path = "$user", other`` (PostgreSQL's default form): without a schema
    named after the role the open uses ``other``'s store (at the newest revision:
    one read); once one is created, the open is refused rather than building a new
    store in front of ``other``'s (whose data it would hide), and builds nothing."""
    with pg_schema() as other, pg_role() as role:
        with psycopg.connect(PG_DSN, autocommit=True) as admin:
            admin.execute(f"GRANT ALL ON SCHEMA {other} TO {role}")
        url = f"postgresql+psycopg://{role}@127.0.0.1:5432/test?options=-csearch_path%3D%24user%2C{other}"
        Catalog(url, migrate=migrate_catalog).close()  # no schema "role": builds other's
        theirs = _tables(other)
        assert VERSION_TABLE in theirs
        Catalog(url, migrate=migrate_catalog).close()
        with psycopg.connect(PG_DSN, autocommit=True) as admin:
            admin.execute(f"CREATE SCHEMA {role} AUTHORIZATION {role}")
        db._SCHEMAS.clear()  # the schema was created after this process asked
        with pytest.raises(ConfigError, match="further down"):
            Catalog(url, migrate=migrate_catalog).close()
        assert _tables(role) == set()
        assert _tables(other) == theirs


def test_a_search_path_naming_a_missing_schema_first_uses_the_next_one() -> None:
    with pg_schema() as mine:
        url = f"{PG_URL}?options=-csearch_path%3Dks_nosuch_{uuid.uuid4().hex[:8]}%2C{mine}"
        Catalog(url, migrate=migrate_catalog).close()
        SqlKeyStore(url).close()
        names = _tables(mine)
        assert {VERSION_TABLE, keystore_schema.VERSION_TABLE} <= names


def test_a_search_path_naming_no_existing_schema_is_a_config_error() -> None:
    url = f"{PG_URL}?options=-csearch_path%3Dks_nosuch_{uuid.uuid4().hex[:8]}"
    for open_ in (lambda: Catalog(url, migrate=migrate_catalog).close(), lambda: SqlKeyStore(url)):
        with pytest.raises(ConfigError) as caught:
            open_()
        _no_leak(caught.value)


# -- PostgreSQL roles -----------------------------------------------------------------


def test_a_role_that_may_not_read_the_version_table_is_refused_with_a_config_error() -> None:
    """A role given row privileges on every table but the version table: the unlocked
    read fails, the locked path's Alembic read fails too, and the open is a
    ``ConfigError`` that quotes no SQL. (Its hint speaks of creating tables, which
    is not what this role lacks: a wording nit, not a bug.)"""
    with pg_schema() as schema, pg_role() as role:
        Catalog(pg_url(schema), migrate=migrate_catalog).close()
        with psycopg.connect(PG_DSN, autocommit=True) as admin:
            admin.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
            admin.execute(
                f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {role}"
            )
            admin.execute(f"REVOKE ALL ON {schema}.{VERSION_TABLE} FROM {role}")
        url = as_role(role, pg_url(schema))
        with pytest.raises(ConfigError) as caught:
            Catalog(url, migrate=migrate_catalog)
        _no_leak(caught.value, VERSION_TABLE + " ")


def test_a_rows_only_role_opening_a_store_that_needs_an_upgrade_is_told_and_changes_nothing() -> (
    None
):
    with pg_schema() as schema, pg_role() as role:
        url = pg_url(schema)
        Catalog(url, migrate=migrate_catalog).close()
        _alembic(url, "downgrade", "0015")
        engine = sa.create_engine(url)
        try:
            before = schema_report(engine)
        finally:
            engine.dispose()
        with psycopg.connect(PG_DSN, autocommit=True) as admin:
            admin.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
            admin.execute(
                f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {role}"
            )
        with pytest.raises(ConfigError, match="need a role that may create tables") as caught:
            Catalog(as_role(role, url), migrate=migrate_catalog)
        _no_leak(caught.value)
        engine = sa.create_engine(url)
        try:
            assert schema_report(engine) == before
        finally:
            engine.dispose()


# -- version table states, through the public API -------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    ks = Keyshred.init(folder, _config(None))
    try:
        ks.memories.put("ann", ("notes",), "k0", "kept")
    finally:
        ks.close()
    return folder


def _open_and_read(folder: Path) -> str:
    ks = Keyshred.open(folder, _config(None))
    try:
        return str(ks.memories.get("ann", ("notes",), "k0").value)
    finally:
        ks.close()


@pytest.mark.parametrize("component", ["catalog", "key store"])
def test_a_version_table_with_a_revision_and_its_ancestor_is_a_config_error(
    store: Path, component: str
) -> None:
    """BUG (fixed): Alembic's ``CommandError`` ("Requested revision 0016 overlaps
    with other requested revisions 0015") escaped ``Keyshred.open``."""
    catalog, keys = _urls(store, None)
    url, table, previous = (
        (catalog, VERSION_TABLE, "0015")
        if component == "catalog"
        else (keys, keystore_schema.VERSION_TABLE, "0002")
    )
    _run(url, f"INSERT INTO {table} VALUES ('{previous}')")
    with pytest.raises(ConfigError, match="cannot upgrade from") as caught:
        _open_and_read(store)
    _no_leak(caught.value, "overlaps")
    _run(url, f"DELETE FROM {table} WHERE version_num = '{previous}'")
    assert _open_and_read(store) == "kept"


PROBES = [
    "probe-" + "\u00fc\u202e<script>" + "x" * 20,  # fits Alembic's VARCHAR(32)
    "0016\n' OR 1=1 --",
    "",
]


@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.parametrize("component", ["catalog", "key store"])
def test_a_probe_in_the_version_table_is_refused_without_being_quoted(
    store: Path, component: str, probe: str, caplog: pytest.LogCaptureFixture
) -> None:
    catalog, keys = _urls(store, None)
    url, table = (
        (catalog, VERSION_TABLE)
        if component == "catalog"
        else (keys, keystore_schema.VERSION_TABLE)
    )
    conn = sqlite3.connect(url.removeprefix("sqlite:///"))
    conn.execute(f"UPDATE {table} SET version_num = ?", (probe,))
    conn.commit()
    conn.close()
    with pytest.raises(ConfigError, match="newer keyshred") as caught:
        _open_and_read(store)
    _no_leak(caught.value)
    if probe:
        assert probe not in str(caught.value)
        assert probe not in caplog.text
    assert _rows(url, f"SELECT version_num FROM {table}") == [(probe,)]


def test_an_empty_version_table_is_a_config_error_that_changes_nothing(store: Path) -> None:
    """Alembic reads an empty version table as a new database and replays revision
    0001 over existing tables; that fails and rolls back. The message ("refused its
    schema change") is not what happened, but nothing leaks and nothing changes."""
    catalog, _ = _urls(store, None)
    _run(catalog, f"DELETE FROM {VERSION_TABLE}")
    engine = sa.create_engine(catalog)
    try:
        before = schema_report(engine)
    finally:
        engine.dispose()
    with pytest.raises(ConfigError) as caught:
        _open_and_read(store)
    _no_leak(caught.value, "already exists")
    engine = sa.create_engine(catalog)
    try:
        assert schema_report(engine) == before
    finally:
        engine.dispose()


@pytest.mark.parametrize("which", ["catalog/catalog.db", "keys/keystore.db"])
def test_a_file_that_is_not_sqlite_is_a_config_error(store: Path, which: str) -> None:
    path = store / which
    for extra in path.parent.glob(path.name + "-*"):
        extra.unlink()
    path.write_bytes(b"not a database, " * 256)
    with pytest.raises(ConfigError) as caught:
        _open_and_read(store)
    _no_leak(caught.value, "file is not a database")


def test_a_read_only_sqlite_catalog_opens_at_the_newest_revision_and_is_refused_below_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(The tests run as root: a read-only file is SQLite's ``mode=ro``.) The URI
    form names the same file: its side files are the file's (they went to a
    ``file:`` folder under the working directory before ``db.sqlite_file``)."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "catalog.db"
    Catalog(db.sqlite_url(path), migrate=migrate_catalog).close()
    ro = f"sqlite:///file:{path}?mode=ro&uri=true"
    assert db.sqlite_file(sa.engine.make_url(ro)) == str(path)
    Catalog(ro, migrate=migrate_catalog).close()  # one read: no write needed
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("file:")]
    assert (tmp_path / "catalog.db.guardgen").exists()
    _run(db.sqlite_url(path), f"UPDATE {VERSION_TABLE} SET version_num = '0015'")
    with pytest.raises(ConfigError) as caught:
        Catalog(ro, migrate=migrate_catalog)
    _no_leak(caught.value, "readonly")


def test_an_upgrade_waiting_on_a_sqlite_writer_too_long_is_backend_unavailable(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transient wait is not reported as a refused schema change."""
    catalog, _ = _urls(store, None)
    _run(catalog, f"UPDATE {VERSION_TABLE} SET version_num = '0015'")
    real = db.create_engine

    def short(*args: object, **kwargs: object) -> sa.Engine:
        kwargs["busy_timeout_ms"] = 200
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr("keyshred.storage.catalog.create_engine", short)
    holder = sqlite3.connect(catalog.removeprefix("sqlite:///"))
    try:
        holder.execute("BEGIN IMMEDIATE")
        with pytest.raises(BackendUnavailable) as caught:
            _open_and_read(store)
        _no_leak(caught.value)
    finally:
        holder.rollback()
        holder.close()
    monkeypatch.undo()
    assert _open_and_read(store) == "kept"


def test_the_version_table_dropped_while_a_store_is_open(store: Path) -> None:
    """An operator drops the catalog's version table while a handle is open: the next
    open takes it for a catalog from before versioned migrations, stamps it 0001 and
    replays the revisions over the newest tables (their guards skip what exists).
    It ends at the newest revision with its data; the open handle goes on."""
    catalog, _ = _urls(store, None)
    ks = Keyshred.open(store, _config(None))
    try:
        _run(catalog, f"DROP TABLE {VERSION_TABLE}")
        assert _open_and_read(store) == "kept"
        ks.memories.put("ann", ("notes",), "k1", "after")
        assert ks.memories.get("ann", ("notes",), "k1").value == "after"
    finally:
        ks.close()
    assert _rows(catalog, f"SELECT version_num FROM {VERSION_TABLE}") == [(CATALOG_HEAD,)]
    fresh = store.parent / "fresh"
    Keyshred.init(fresh, _config(None)).close()
    reports = []
    for folder in (store, fresh):
        engine = sa.create_engine(_urls(folder, None)[0])
        reports.append(schema_report(engine))
        engine.dispose()
    assert reports[0] == reports[1]


# -- processes racing an upgrade ------------------------------------------------------

_OPEN_AND_PUT = """
import sys, time
from pathlib import Path
from keyshred import Keyshred
from keyshred.config import Config, KeyringSettings, StorageSettings
folder, url, key, start = Path(sys.argv[1]), sys.argv[2] or None, sys.argv[3], float(sys.argv[4])
config = Config(storage=StorageSettings(catalog_url=url), keyring=KeyringSettings(store_url=url))
while time.time() < start:
    time.sleep(0.001)
ks = Keyshred.open(folder, config)
try:
    ks.memories.put("ann", ("notes",), key, "value " + key)
finally:
    ks.close()
"""


@contextmanager
def _older_store(kind: str, tmp_path: Path) -> Iterator[tuple[Path, str | None]]:
    """A store with a memory, its catalog brought down to 0012 and its key store to
    0002 (older releases' schemas)."""
    folder = tmp_path / "data"
    with pg_schema() if kind == "postgresql" else _nothing() as schema:
        url = pg_url(schema) if schema else None
        ks = Keyshred.init(folder, _config(url))
        try:
            ks.memories.put("ann", ("notes",), "k0", "kept")
        finally:
            ks.close()
        catalog, keys = _urls(folder, url)
        _alembic(catalog, "downgrade", "0012")
        _downgrade_keystore(keys)
        yield folder, url


@contextmanager
def _nothing() -> Iterator[None]:
    yield None


def _check_store(folder: Path, url: str | None, keys: list[str]) -> None:
    catalog, keystore = _urls(folder, url)
    assert _rows(catalog, f"SELECT version_num FROM {VERSION_TABLE}") == [(CATALOG_HEAD,)]
    assert _rows(keystore, f"SELECT version_num FROM {keystore_schema.VERSION_TABLE}") == [
        (KEYSTORE_HEAD,)
    ]
    ks = Keyshred.open(folder, _config(url))
    try:
        assert ks.memories.get("ann", ("notes",), "k0").value == "kept"
        for key in keys:
            assert ks.memories.get("ann", ("notes",), key).value == "value " + key
    finally:
        ks.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_processes_opening_an_older_store_at_once_all_upgrade_and_write(
    kind: str, tmp_path: Path
) -> None:
    with _older_store(kind, tmp_path) as (folder, url):
        start = time.time() + 2.0
        keys = [f"p{i}" for i in range(4)]
        procs = [
            zygote.Popen(
                [sys.executable, "-c", _OPEN_AND_PUT, str(folder), url or "", key, str(start)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            for key in keys
        ]
        for proc in procs:
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err.decode()
        _check_store(folder, url, keys)


_KILLED_INSIDE_THE_UPGRADE = """
import sys, time
from pathlib import Path
from alembic import command
from keyshred import Keyshred
from keyshred.config import Config, KeyringSettings, StorageSettings
folder, url, marker = Path(sys.argv[1]), sys.argv[2] or None, Path(sys.argv[3])
real = command.upgrade

def upgrade(*args, **kwargs):  # every revision run, the transaction not committed
    real(*args, **kwargs)
    marker.write_text("in")
    time.sleep(600)

command.upgrade = upgrade
config = Config(storage=StorageSettings(catalog_url=url), keyring=KeyringSettings(store_url=url))
Keyshred.open(folder, config)
"""


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_process_killed_inside_the_upgrade_leaves_the_store_for_the_next_open(
    kind: str, tmp_path: Path
) -> None:
    """SIGKILL after the revisions ran, before the commit, while another process
    waits on the migration's lock: the waiter upgrades the store and writes."""
    with _older_store(kind, tmp_path) as (folder, url):
        marker = tmp_path / "marker"
        victim = zygote.Popen(
            [sys.executable, "-c", _KILLED_INSIDE_THE_UPGRADE, str(folder), url or "", str(marker)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            deadline = time.time() + 90
            while not marker.exists():
                assert victim.poll() is None, victim.communicate()[1].decode()
                assert time.time() < deadline
                time.sleep(0.05)
            waiter = zygote.Popen(
                [sys.executable, "-c", _OPEN_AND_PUT, str(folder), url or "", "w", "0"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            time.sleep(1.0)
            assert waiter.poll() is None  # it waits on the lock the victim holds
        finally:
            os.kill(victim.pid, signal.SIGKILL)
            victim.communicate(timeout=30)
        _, err = waiter.communicate(timeout=120)
        assert waiter.returncode == 0, err.decode()
        _check_store(folder, url, ["w"])
