"""``keyshred.db.migrate`` as both components open their databases (the catalog and
the key store, on SQLite and PostgreSQL): a database at the newest revision is
opened with one read of its version table and no lock or Alembic; one at an older
revision is upgraded to the schema a new one has; one a newer keyshred wrote is
refused with a ``ConfigError`` that changes nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

from keyshred import db
from keyshred.errors import ConfigError
from keyshred.keyring import schema as keystore_schema
from keyshred.keyring.keystore import SqlKeyStore
from keyshred.migrations import SCRIPT_LOCATION, VERSION_TABLE, migrate_catalog
from keyshred.storage.catalog import Catalog
from tests.conftest import pg_schema, pg_url
from tests.schema_report import schema_report


@dataclass(frozen=True)
class Component:
    name: str
    script_location: str
    version_table: str
    open: Callable[[str], None]  # opens the component's database at the URL, closes it

    def config(self) -> Config:
        cfg = Config()
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
    monkeypatch.setattr(db, "advisory_xact_lock", refuse)
    sa.event.listen(sa.Engine, "before_cursor_execute", record)
    try:
        component.open(catalog_url)
    finally:
        sa.event.remove(sa.Engine, "before_cursor_execute", record)
    touching = [" ".join(s.split()) for s in statements if component.version_table in s]
    assert touching == [f"SELECT version_num FROM {component.version_table}"]
    assert not [s for s in statements if s.lstrip().upper().startswith(("CREATE", "ALTER"))]
    assert _versions(catalog_url, component) == [component.head()]


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
