"""``keyshred.db.migrate`` as both components open their databases (the catalog and
the key store, on SQLite and PostgreSQL): a database at the newest revision is
opened with one read of its version table and no lock or Alembic; one at an older
revision is upgraded to the schema a new one has; one a newer keyshred wrote is
refused with a ``ConfigError`` that changes nothing. On PostgreSQL, a role that may
not create tables is told what the first open needs, and a role that may only read
and write rows runs a store whose tables its owner made."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config as AlembicConfig
from alembic.script import ScriptDirectory

from keyshred import Keyshred, db
from keyshred import migrations as catalog_migrations
from keyshred.config import Config, KeyringSettings, StorageSettings
from keyshred.errors import ConfigError
from keyshred.keyring import schema as keystore_schema
from keyshred.keyring.keystore import SqlKeyStore
from keyshred.migrations import SCRIPT_LOCATION, VERSION_TABLE, migrate_catalog
from keyshred.storage.catalog import Catalog
from tests.conftest import PG_DSN, PG_URL, as_role, pg_role, pg_schema, pg_url
from tests.schema_report import schema_report
from tests.storage.test_vectors import bag_of_words

HOUR = timedelta(hours=1)


@dataclass(frozen=True)
class Component:
    name: str
    script_location: str
    version_table: str
    open: Callable[[str], None]  # opens the component's database at the URL, closes it

    def config(self) -> AlembicConfig:
        cfg = AlembicConfig()
        cfg.set_main_option("script_location", self.script_location)
        return cfg

    def head(self) -> str:
        head = ScriptDirectory.from_config(self.config()).get_current_head()
        assert head is not None
        return head


def _open_catalog(url: str) -> None:
    Catalog(url, migrate=migrate_catalog).close()


def _open_keystore(url: str) -> None:
    SqlKeyStore(url).close()


COMPONENTS = {
    "catalog": Component("catalog", SCRIPT_LOCATION, VERSION_TABLE, _open_catalog),
    "key store": Component(
        "key store", keystore_schema.MIGRATIONS, keystore_schema.VERSION_TABLE, _open_keystore
    ),
}


@pytest.fixture(params=sorted(COMPONENTS))
def component(request: pytest.FixtureRequest) -> Component:
    return COMPONENTS[request.param]


@contextmanager
def _database(kind: str, tmp_path: Path, name: str) -> Iterator[str]:
    if kind == "sqlite":
        yield db.sqlite_url(tmp_path / f"{name}.db")
        return
    with pg_schema() as schema:
        yield pg_url(schema)


def _versions(url: str, component: Component) -> list[str]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.exec_driver_sql(f"SELECT version_num FROM {component.version_table}")
            return [str(v) for (v,) in rows]
    finally:
        engine.dispose()


def _kind(url: str) -> str:
    return "sqlite" if url.startswith("sqlite") else "postgresql"


def test_each_component_names_its_newest_revision() -> None:
    """The constant ``keyshred.db.migrate`` trusts to skip Alembic: a revision added
    without it would leave every database at the revision before."""
    assert COMPONENTS["catalog"].head() == catalog_migrations.HEAD
    assert COMPONENTS["key store"].head() == keystore_schema.HEAD
    for component in COMPONENTS.values():
        assert ScriptDirectory.from_config(component.config()).get_heads() == [component.head()]


def test_a_database_at_the_newest_revision_is_opened_with_one_read(
    component: Component, catalog_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    component.open(catalog_url)  # new: built and stamped
    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the migration's lock or Alembic was used")

    for name in ("upgrade", "stamp"):
        monkeypatch.setattr(command, name, refuse)
    monkeypatch.setattr(db, "_known_revisions", refuse)
    monkeypatch.setattr(db, "advisory_xact_lock", refuse)
    sa.event.listen(sa.Engine, "before_cursor_execute", record)
    try:
        component.open(catalog_url)
    finally:
        sa.event.remove(sa.Engine, "before_cursor_execute", record)
    touching = [" ".join(s.split()) for s in statements if component.version_table in s]
    assert len(touching) == 1, touching  # on PostgreSQL, qualified by the current schema
    assert re.fullmatch(rf"SELECT version_num FROM (\w+\.)?{component.version_table}", touching[0])
    assert not [s for s in statements if s.lstrip().upper().startswith(("CREATE", "ALTER"))]
    assert _versions(catalog_url, component) == [component.head()]


def test_a_process_that_opens_a_store_at_the_newest_revision_never_imports_alembic(
    tmp_path: Path,
) -> None:
    """A fresh interpreter (as a CLI call or a worker starts): Alembic's import alone
    cost the first open about 170 ms."""
    Keyshred.init(tmp_path / "data").close()
    program = (
        "import sys\n"
        "from keyshred import Keyshred\n"
        f"Keyshred.open({str(tmp_path / 'data')!r}).close()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'alembic'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == "[]"


def test_a_database_at_an_older_revision_is_upgraded_on_open(
    component: Component, catalog_url: str, tmp_path: Path
) -> None:
    """The revision before the newest, built by Alembic as a release of it did; the
    open upgrades it to the schema a new database gets."""
    script = ScriptDirectory.from_config(component.config())
    previous = script.get_revision(component.head()).down_revision
    assert isinstance(previous, str)
    cfg = component.config()
    engine = db.create_engine(catalog_url, what="catalog")
    try:
        with engine.connect() as conn, conn.begin():
            cfg.attributes["connection"] = conn
            cfg.attributes["version_table"] = component.version_table
            command.upgrade(cfg, previous)
    finally:
        engine.dispose()
    assert _versions(catalog_url, component) == [previous]
    component.open(catalog_url)
    assert _versions(catalog_url, component) == [component.head()]
    with _database(_kind(catalog_url), tmp_path, "new") as new_url:
        component.open(new_url)
        reports = []
        for url in (catalog_url, new_url):
            engine = sa.create_engine(url)
            reports.append(schema_report(engine))
            engine.dispose()
    assert reports[0] == reports[1]


def test_a_database_a_newer_keyshred_wrote_is_refused_and_left_as_it_is(
    component: Component, catalog_url: str
) -> None:
    component.open(catalog_url)
    engine = sa.create_engine(catalog_url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(
                f"UPDATE {component.version_table} SET version_num = 'probe-from-the-future'"
            )
        before = schema_report(engine)
    finally:
        engine.dispose()
    with pytest.raises(ConfigError, match="newer keyshred") as caught:
        component.open(catalog_url)
    assert "probe-from-the-future" not in str(caught.value)
    assert _versions(catalog_url, component) == ["probe-from-the-future"]
    engine = sa.create_engine(catalog_url)
    try:
        assert schema_report(engine) == before
    finally:
        engine.dispose()


def test_a_store_further_down_the_search_path_is_neither_taken_nor_hidden_by_a_new_one(
    component: Component,
) -> None:
    """PostgreSQL finds a bare table name in any schema of the search path. A store
    in a later schema must not pass for this one's (its tables would be used as
    this store's), and a new store must not be built in front of it either (its
    data would stay, unseen by every later read and erasure): the open is refused,
    naming the schemas, and builds nothing."""
    with pg_schema() as other, pg_schema() as mine:
        component.open(pg_url(other))  # at the newest revision, in the later schema
        with pytest.raises(ConfigError, match="further down") as caught:
            component.open(f"{PG_URL}?options=-csearch_path%3D{mine}%2C{other}")
        assert mine in str(caught.value) and other in str(caught.value)
        with psycopg.connect(PG_DSN) as conn:
            count = conn.execute(
                "SELECT count(*) FROM pg_tables WHERE schemaname = %s", (mine,)
            ).fetchone()
        assert count == (0,)
        component.open(pg_url(mine))  # named alone: a new store there
        assert _versions(pg_url(mine), component) == [component.head()]


def test_a_role_that_may_not_create_tables_is_told_what_the_first_open_needs(
    component: Component,
) -> None:
    with pg_schema() as schema, pg_role(schema) as role:
        with pytest.raises(ConfigError, match="need a role that may create tables") as caught:
            component.open(as_role(role, pg_url(schema)))
        assert "CREATE" not in str(caught.value)  # not the driver's message, which quotes SQL
        with psycopg.connect(PG_DSN) as conn:
            tables = conn.execute(
                "SELECT count(*) FROM pg_tables WHERE schemaname = %s", (schema,)
            ).fetchone()
        assert tables == (0,)


def test_a_role_that_only_reads_and_writes_rows_runs_a_store_its_owner_made(
    tmp_path: Path,
) -> None:
    """The owner's first open makes the tables; a role with row privileges alone then
    opens the store (no schema change is needed) and writes, searches, sanitizes and
    erases through it."""
    with pg_schema() as schema, pg_role(schema) as role:
        url = pg_url(schema)
        folder = tmp_path / "data"
        Keyshred.init(
            folder,
            Config(
                storage=StorageSettings(catalog_url=url), keyring=KeyringSettings(store_url=url)
            ),
        ).close()
        with psycopg.connect(PG_DSN, autocommit=True) as admin:
            admin.execute(
                f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {role}"
            )
            admin.execute(f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {schema} TO {role}")
        rows = as_role(role, url)
        ks = Keyshred.open(
            folder,
            Config(
                storage=StorageSettings(catalog_url=rows), keyring=KeyringSettings(store_url=rows)
            ),
            embeddings=bag_of_words,
        )
        try:
            for who in ("ann", "bob"):
                ks.memories.put(who, ("notes",), "trip", f"{who} goes to Oslo by train", index=True)
            assert ks.memories.get("bob", ("notes",), "trip").value == "bob goes to Oslo by train"
            found = ks.memories.search("ann", ("notes",), query="train to Oslo", limit=1)
            assert [m.key for m in found] == ["trip"]
            s = ks.vault.sanitize("call 555-0100 or ann@example.com", "ann", "support", HOUR)
            assert "ann@example.com" not in s.text
            receipt = ks.erase("ann", requested_by="dpo", reason="role test")
            assert receipt.state == "completed"
            assert ks.memories.get("bob", ("notes",), "trip").value == "bob goes to Oslo by train"
        finally:
            ks.close()
