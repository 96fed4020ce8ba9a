"""A damaged or hand-altered catalog or key store (a table dropped) fails public calls
with ``DatabaseError``, never the driver's own exception, on SQLite and PostgreSQL;
its message names the driver's error class and nothing of the statement
(``keyshred._handle.typed``). Other subjects' calls that do not need the missing
table keep working."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from keyshred import DatabaseError, Keyshred, KeyshredError, StorageFull
from keyshred._handle import typed
from keyshred.config import KeyringSettings
from tests.conftest import PG_DSN, pg_schema, pg_url
from tests.storage.conftest import make_config

HOUR = timedelta(hours=1)


@pytest.fixture
def store(catalog_url: str, tmp_path: Path) -> Iterator[tuple[Path, Any, str]]:
    """A folder with one memory of ann, closed; yields (folder, config, how to drop
    a table of the catalog)."""
    cfg = make_config(catalog_url)
    with Keyshred.init(tmp_path / "data", cfg) as ks:
        ks.memories.put("ann", ("notes",), "trip", "ann goes to Oslo", index=False)
    yield tmp_path / "data", cfg, catalog_url


def _drop(catalog_url: str, table: str) -> None:
    if catalog_url.startswith("sqlite"):
        with sqlite3.connect(catalog_url.removeprefix("sqlite:///")) as conn:
            conn.execute(f"DROP TABLE {table}")
        conn.close()
        return
    engine = sa.create_engine(catalog_url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE {table} CASCADE")
    finally:
        engine.dispose()


CALLS: dict[str, Callable[[Keyshred], object]] = {
    "get": lambda ks: ks.memories.get("ann", ("notes",), "trip"),
    "put": lambda ks: ks.memories.put("bob", ("notes",), "k", "v", index=False),
    "sanitize": lambda ks: ks.vault.sanitize("mail bob@example.com", "bob", "support", HOUR),
    "deletion_epoch": lambda ks: ks.deletion_epoch("bob"),
}


def _checked(exc: BaseException, table: str) -> None:
    assert isinstance(exc, DatabaseError)
    text = str(exc)
    assert table not in text and "SELECT" not in text.upper().split("(")[0]
    assert "ann" not in text and exc.__cause__ is None and exc.__suppress_context__


@pytest.mark.parametrize(
    ("table", "calls"),
    [
        ("ks_subject_guard", ("get", "put", "sanitize", "deletion_epoch")),
        ("ks_assets", ("get", "put")),
        ("ks_mem_hot", ("get", "put")),
    ],
)
def test_a_dropped_catalog_table_fails_public_calls_with_database_error(
    store: tuple[Path, Any, str], table: str, calls: tuple[str, ...]
) -> None:
    folder, cfg, url = store
    _drop(url, table)
    ks = Keyshred.open(folder, cfg)
    try:
        for name in calls:
            with pytest.raises(KeyshredError) as caught:
                CALLS[name](ks)
            _checked(caught.value, table)
    finally:
        try:
            ks.close()
        except DatabaseError as exc:  # a close that flushes into the missing table
            _checked(exc, table)


def test_a_close_that_cannot_write_held_tokens_raises_database_error(
    tmp_path: Path,
) -> None:
    """Group commit holds the tokens of ``sanitize`` (the embedded default); the
    close writes them into a token table that is gone."""
    with Keyshred.init(tmp_path / "data") as ks:
        ks.memories.put("ann", ("notes",), "trip", "ann goes to Oslo", index=False)
    (path,) = (tmp_path / "data" / "catalog").glob("*.db")
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE ks_tokens")
    conn.close()
    ks = Keyshred.open(tmp_path / "data")
    ks.vault.sanitize("mail ann@example.com", "ann", "support", HOUR)
    with pytest.raises(DatabaseError) as caught:
        ks.close()
    _checked(caught.value, "ks_tokens")
    assert "ann@example.com" not in str(caught.value)


def test_a_dropped_key_table_fails_a_new_subjects_put_with_database_error(
    tmp_path: Path,
) -> None:
    """The key store on PostgreSQL: its key table dropped."""
    with pg_schema() as schema:
        url = pg_url(schema)
        cfg = make_config(url).model_copy(update={"keyring": KeyringSettings(store_url=url)})
        with Keyshred.init(tmp_path / "data", cfg) as ks:
            ks.memories.put("ann", ("notes",), "trip", "ann goes to Oslo", index=False)
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(f"DROP TABLE {schema}.ks_dek CASCADE")
        ks = Keyshred.open(tmp_path / "data", cfg)
        try:
            with pytest.raises(DatabaseError) as caught:
                ks.memories.put("carl", ("notes",), "k", "v", index=False)
            _checked(caught.value, "ks_dek")
            assert "carl" not in str(caught.value)
        finally:
            ks.close()


def test_typed_maps_driver_errors_and_passes_others() -> None:
    assert isinstance(typed(sqlite3.OperationalError("no such table: ks_x")), DatabaseError)
    wrapped = sa.exc.OperationalError("SELECT 1", {}, sqlite3.OperationalError("x"))
    assert isinstance(typed(wrapped), DatabaseError)
    assert isinstance(typed(psycopg.errors.UndefinedTable("relation ks_x")), DatabaseError)
    full = sqlite3.OperationalError("database or disk is full")
    full.sqlite_errorcode = 13  # type: ignore[attr-defined]
    assert isinstance(typed(full), StorageFull)
    other = ValueError("not a database's")
    assert typed(other) is other
    assert "ks_x" not in str(typed(sqlite3.OperationalError("no such table: ks_x")))
