"""The vault's token rows on the catalog's engine (``keyshred.vault.store``): many
rows per statement, the guard re-read in the insert's transaction, columns read back
as written, blocks of numbers that never repeat, and old tables refused clearly."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select

from keyshred.errors import ConfigError, SubjectSuppressed
from keyshred.storage.catalog import Catalog, micros, sqlite_url
from keyshred.vault.schema import TOKEN_BLOCK, tokens
from keyshred.vault.store import TokenStore

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def _no_number(token: str) -> int | None:
    return None


@pytest.fixture
def store(catalog_url: str) -> Iterator[TokenStore]:
    catalog = Catalog(catalog_url)
    yield TokenStore(catalog, _no_number, create_tables=True)
    catalog.close()


def _token_rows(numbers: range, ref: str = "ref-a") -> list[tuple[object, ...]]:
    created = micros(NOW)
    return [
        (
            n,
            f"<PHONE_{n:010x}>",
            ref,
            "default",
            "PHONE",
            "support",
            False,
            None,
            created,
            created + 3_600_000_000,
            b"sealed",
        )
        for n in numbers
    ]


def test_token_rows_in_many_row_statements_under_the_guard(store: TokenStore) -> None:
    """A batch goes in chunks of 256 and 32 rows per statement and the rest one by
    one; a number is stored once; nothing of a suppressed subject is stored."""
    base = store.block()
    store.insert(_token_rows(range(base, base + 300)), [("ref-a", "default", 0)])
    with store.catalog.engine.connect() as conn:
        numbers = [r[0] for r in conn.execute(select(tokens.c.number).order_by(tokens.c.number))]
        times = conn.execute(select(tokens.c.created_at, tokens.c.expires_at).limit(1)).one()
    assert numbers == list(range(base, base + 300))
    # Times are integer microseconds in the table and aware datetimes through SQLAlchemy.
    assert times == (NOW, NOW + timedelta(hours=1))
    with pytest.raises(Exception, match=r"(?i)unique|duplicate"):
        store.insert(_token_rows(range(base, base + 40)), [("ref-a", "default", 0)])
    store.catalog.suppress("ref-a")
    with pytest.raises(SubjectSuppressed):
        store.insert(_token_rows(range(base + 600, base + 640)), [("ref-a", "default", 1)])
    assert store.count("ref-a") == 300


def test_token_rows_read_back_as_written(store: TokenStore) -> None:
    """Random and deterministic rows, through a many-row statement and one by one:
    every column reads back as it was given (the SQLite path binds the flag as an
    int and the value as a bytearray)."""
    base = store.block()
    rows = _token_rows(range(base, base + 33))
    rows[5] = (*rows[5][:6], True, b"\x01" * 16, *rows[5][8:10], b"\x00sealed\xff")
    for at in (0, 32):  # 32 rows in one statement, then one row on its own
        store.insert(rows[at : at + 32], [("ref-a", "default", 0)])
    with store.catalog.engine.connect() as conn:
        stored = conn.execute(select(tokens).order_by(tokens.c.number)).all()
    assert [tuple(r) for r in stored] == [
        (*row[:8], NOW, NOW + timedelta(hours=1), row[10]) for row in rows
    ]
    assert stored[5].deterministic is True and stored[0].deterministic is False
    assert type(stored[5].value) is bytes and stored[0].lookup is None
    assert store.lookups("ref-a", "default", "support", [b"\x01" * 16, b"\x02" * 16]) == {
        b"\x01" * 16: rows[5][1]
    }


def test_sqlite_token_rows_skip_the_adapter_registry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sqlite3`` adapts every bound value that is not an int, float, str or
    bytearray (a third of a token row's insert cost): the flag and the sealed value
    are bound so that they never are."""

    def refuse(value: object) -> object:
        raise AssertionError(f"adapted a {type(value).__name__}")

    cat = Catalog(sqlite_url(tmp_path / "catalog.db"))
    try:
        store = TokenStore(cat, _no_number, create_tables=True)
        base = store.block()
        for kind in (bool, bytes):
            monkeypatch.setitem(sqlite3.adapters, (kind, sqlite3.PrepareProtocol), refuse)
        store.insert(_token_rows(range(base, base + 289)), [("ref-a", "default", 0)])
        monkeypatch.undo()
        with cat.engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(tokens)).scalar_one() == 289
    finally:
        cat.close()


def test_token_blocks_never_repeat_and_a_restore_can_skip_them(store: TokenStore) -> None:
    first = store.block()
    second = store.block()
    assert second == first + TOKEN_BLOCK and first >= TOKEN_BLOCK
    mark = store.block_mark()
    assert mark == second // TOKEN_BLOCK
    store.skip_blocks(mark + 5)
    assert store.block_mark() == mark + 5
    assert store.block() == (mark + 6) * TOKEN_BLOCK
    store.skip_blocks(2)  # below the mark: nothing changes
    assert store.block() == (mark + 7) * TOKEN_BLOCK


def test_tokens_are_listed_as_assets_by_the_catalog(store: TokenStore) -> None:
    base = store.block()
    rows = _token_rows(range(base, base + 3))
    store.insert(rows, [("ref-a", "default", 0)])
    catalog = store.catalog
    listed = catalog.assets("ref-a")
    assert [(a.asset_id, a.kind, a.retain_until) for a in listed] == [
        (row[1], "token", NOW + timedelta(hours=1)) for row in rows
    ]
    assert catalog.asset_kinds("ref-a", "default") == {row[1]: "token" for row in rows}
    assert catalog.assets("ref-a", kind="memory") == []
    assert catalog.asset(str(rows[0][1])) is None  # this store reads no numbers (_no_number)


@pytest.mark.parametrize(
    "table",
    [
        "CREATE TABLE ks_tokens (token VARCHAR(64) PRIMARY KEY, value BLOB)",
        # token numbers, but times as text (a development build of the same day)
        "CREATE TABLE ks_tokens (number INTEGER PRIMARY KEY, token VARCHAR(64), "
        "created_at DATETIME, expires_at DATETIME, value BLOB)",
    ],
)
def test_a_catalog_from_before_token_numbers_is_refused_clearly(tmp_path: Path, table: str) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:
        conn.execute(table)
    catalog = Catalog(sqlite_url(path))
    try:
        with pytest.raises(ConfigError, match="predates token numbers"):
            TokenStore(catalog, _no_number, create_tables=True)
    finally:
        catalog.close()
