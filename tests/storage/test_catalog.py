"""The catalog on SQLite and PostgreSQL: assets, provenance, guard, consent."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from keyshred.errors import StaleEpoch, SubjectSuppressed
from keyshred.storage.catalog import (
    ACTIVE,
    SUPPRESSED,
    TOKEN_BLOCK,
    AssetRow,
    Catalog,
    Micros,
    micros,
    sqlite_url,
)

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def asset(asset_id: str, ref: str = "ref-a", **kw: object) -> AssetRow:
    values: dict[str, object] = {
        "asset_id": asset_id,
        "subject_ref": ref,
        "scope": "default",
        "kind": "memory",
        "storage_system": "parquet",
        "storage_key": f"memories/subject={ref}",
        "purpose": "default",
        "category": "general",
        "created_at": NOW,
        "retain_until": NOW + timedelta(days=30),
    }
    values.update(kw)
    return AssetRow(**values)  # type: ignore[arg-type]


@pytest.fixture
def cat(catalog_url: str) -> Catalog:
    c = Catalog(catalog_url)
    yield c  # type: ignore[misc]
    c.close()


def test_assets_with_provenance_and_mentions(cat: Catalog) -> None:
    cat.register([asset("m1"), asset("m2"), asset("x1", ref="ref-b")])
    cat.register(
        [asset("sum", ref="ref-b", kind="summary", sources=("m1", "x1"), mentions=("ref-c",))]
    )
    got = cat.asset("sum")
    assert got is not None
    assert got.sources == ("m1", "x1") and got.mentions == ("ref-c",)
    assert got.created_at == NOW and got.retain_until == NOW + timedelta(days=30)
    assert [a.asset_id for a in cat.derived_from(["m1"])] == ["sum"]
    assert [a.asset_id for a in cat.mentioning("ref-c")] == ["sum"]
    assert sorted(a.asset_id for a in cat.assets("ref-a")) == ["m1", "m2"]
    assert cat.count("ref-b") == 2 and cat.count(kind="summary") == 1
    # Replacing keeps one row and rewrites its provenance.
    cat.register([asset("sum", ref="ref-b", kind="summary", sources=("m2",))])
    assert cat.asset("sum").sources == ("m2",)  # type: ignore[union-attr]
    assert cat.derived_from(["m1"]) == []
    assert cat.delete(["sum", "m1"]) == 2
    assert cat.asset("sum") is None and cat.mentioning("ref-c") == []


def test_guard_refuses_after_suppression(cat: Catalog) -> None:
    assert cat.guard("ref-a").status == ACTIVE and cat.check_guard("ref-a") == 0
    cat.register([asset("m1")], expected_epoch=0)
    epoch = cat.suppress("ref-a")
    assert epoch == 1 and cat.guard("ref-a").status == SUPPRESSED
    with pytest.raises(SubjectSuppressed):
        cat.check_guard("ref-a")
    with pytest.raises(SubjectSuppressed):
        cat.register([asset("m2")])
    assert cat.asset("m2") is None
    # Re-admitted (a returning subject): the epoch stays, older jobs stay refused.
    cat.set_guard("ref-a", ACTIVE)
    with pytest.raises(StaleEpoch):
        cat.register([asset("m3")], expected_epoch=0)
    cat.register([asset("m3")], expected_epoch=1)
    assert cat.asset("m3") is not None


def test_a_batch_for_two_subjects_is_all_or_nothing(cat: Catalog) -> None:
    cat.suppress("ref-b")
    with pytest.raises(SubjectSuppressed):
        cat.register([asset("a"), asset("b", ref="ref-b")])
    assert cat.asset("a") is None


def test_consent_history_and_windows(cat: Catalog) -> None:
    first = cat.grant_consent(
        "ref-a", "support", "health", start_at=NOW, end_at=NOW + timedelta(days=10)
    )
    assert cat.active_consent("ref-a", "support", "health", "store", NOW + timedelta(days=1))
    assert (
        cat.active_consent("ref-a", "support", "health", "store", NOW - timedelta(days=1)) is None
    )
    assert (
        cat.active_consent("ref-a", "support", "health", "store", NOW + timedelta(days=11)) is None
    )
    assert cat.active_consent("ref-a", "support", "health", "train", NOW) is None
    assert cat.revoke_consent("ref-a", "support", "health") == 1
    assert (
        cat.active_consent("ref-a", "support", "health", "store", NOW + timedelta(days=1)) is None
    )
    cat.grant_consent("ref-a", "support", "health", policy_version="2")
    history = cat.consents("ref-a")
    assert [c.status for c in history] == ["revoked", "active"]
    assert history[0].consent_id == first.consent_id and history[0].revoked_at is not None
    assert [c.policy_version for c in history] == ["1", "2"]


def test_guards_are_cached_until_any_process_changes_one(tmp_path: Path) -> None:
    """Embedded catalogs keep guards in memory; a change from another process (or
    another catalog object) is seen by the next read, never later."""
    url = sqlite_url(tmp_path / "catalog.db")
    cat = Catalog(url)
    other = Catalog(url)
    try:
        ref = "ref-cached"
        assert cat.guard(ref).status == ACTIVE
        real = cat._hot
        cat._hot = lambda write: pytest.fail("a cached guard read reached the database")  # type: ignore[method-assign]
        assert cat.check_guard(ref) == 0  # no statement: the generation has not moved
        assert cat.guard(ref).status == ACTIVE
        cat._hot = real  # type: ignore[method-assign]
        code = (
            "from keyshred.storage.catalog import Catalog\n"
            f"c = Catalog({url!r})\n"
            "c.suppress('ref-cached')\n"
            "c.close()\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
        with pytest.raises(SubjectSuppressed):
            cat.check_guard(ref)
        other.set_guard(ref, ACTIVE)  # another object in this process
        assert cat.check_guard(ref) == 1
        other.suppress(ref, scope="health")
        with pytest.raises(SubjectSuppressed):
            cat.check_guard(ref, scope="health")
        other.release_scope(ref, "health")
        assert cat.check_guard(ref, scope="health") == 2
    finally:
        cat.close()
        other.close()


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
    import sqlite3

    from keyshred.errors import ConfigError
    from keyshred.migrations import migrate_catalog

    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:  # a catalog from before versioned migrations
        conn.execute("CREATE TABLE ks_assets (asset_id VARCHAR(64) PRIMARY KEY)")
        conn.execute(table)
    with pytest.raises(ConfigError, match="predates token numbers"):
        Catalog(sqlite_url(path), migrate=migrate_catalog)


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


def test_token_rows_in_many_row_statements_and_replays_skip_stored_ones(cat: Catalog) -> None:
    """A group commit writes chunks of 256 and 32 rows per statement and the rest one
    by one; a journal replayed after its rows were stored skips them."""
    from sqlalchemy import func, select

    from keyshred.storage.catalog import tokens

    base = cat.token_block()
    cat.insert_tokens(_token_rows(range(base, base + 300)), [("ref-a", "default", 0)])
    replay = _token_rows(range(base + 250, base + 590))  # 50 stored, 290 new
    cat.insert_tokens(replay, [("ref-a", "default", 0)], existing_ok=True)
    with cat.engine.connect() as conn:
        numbers = [r[0] for r in conn.execute(select(tokens.c.number).order_by(tokens.c.number))]
        times = conn.execute(select(tokens.c.created_at, tokens.c.expires_at).limit(1)).one()
        assert conn.execute(select(func.count()).select_from(tokens)).scalar_one() == 590
    assert numbers == list(range(base, base + 590))
    # Times are integer microseconds in the table and aware datetimes through SQLAlchemy.
    assert times == (NOW, NOW + timedelta(hours=1))
    with pytest.raises(Exception, match=r"(?i)unique|duplicate"):
        cat.insert_tokens(_token_rows(range(base, base + 40)), [("ref-a", "default", 0)])
    cat.suppress("ref-a")
    with pytest.raises(SubjectSuppressed):  # nothing of a suppressed subject, replay or not
        cat.insert_tokens(
            _token_rows(range(base + 600, base + 640)), [("ref-a", "default", 1)], existing_ok=True
        )


def test_token_rows_read_back_as_written(cat: Catalog) -> None:
    """Random and deterministic rows, through a many-row statement and one by one:
    every column reads back as it was given (the SQLite path binds the flag as an
    int and the value as a bytearray)."""
    from sqlalchemy import select

    from keyshred.storage.catalog import tokens

    base = cat.token_block()
    rows = _token_rows(range(base, base + 33))
    rows[5] = (*rows[5][:6], True, b"\x01" * 16, *rows[5][8:10], b"\x00sealed\xff")
    for at in (0, 32):  # 32 rows in one statement, then one row on its own
        cat.insert_tokens(rows[at : at + 32], [("ref-a", "default", 0)])
    with cat.engine.connect() as conn:
        stored = conn.execute(select(tokens).order_by(tokens.c.number)).all()
    assert [tuple(r) for r in stored] == [
        (*row[:8], NOW, NOW + timedelta(hours=1), row[10]) for row in rows
    ]
    assert stored[5].deterministic is True and stored[0].deterministic is False
    assert type(stored[5].value) is bytes and stored[0].lookup is None


def test_sqlite_token_rows_skip_the_adapter_registry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sqlite3`` adapts every bound value that is not an int, float, str or
    bytearray (a third of a token row's insert cost): the flag and the sealed value
    are bound so that they never are."""
    import sqlite3

    from sqlalchemy import func, select

    from keyshred.storage.catalog import tokens

    def refuse(value: object) -> object:
        raise AssertionError(f"adapted a {type(value).__name__}")

    cat = Catalog(sqlite_url(tmp_path / "catalog.db"))
    try:
        base = cat.token_block()
        for kind in (bool, bytes):
            monkeypatch.setitem(sqlite3.adapters, (kind, sqlite3.PrepareProtocol), refuse)
        cat.insert_tokens(_token_rows(range(base, base + 289)), [("ref-a", "default", 0)])
        monkeypatch.undo()
        with cat.engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(tokens)).scalar_one() == 289
    finally:
        cat.close()


def test_micros_is_exact() -> None:
    for value in (
        NOW,
        datetime(1999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC),
        NOW.replace(tzinfo=None),
    ):
        us = micros(value)
        assert isinstance(us, int)
        assert Micros().process_result_value(us, None) == value.replace(tzinfo=UTC)


def test_token_blocks_never_repeat_and_a_restore_can_skip_them(cat: Catalog) -> None:
    first = cat.token_block()
    second = cat.token_block(group_commit_ms=20.0)
    assert second == first + TOKEN_BLOCK and first >= TOKEN_BLOCK
    mark = cat.token_block_mark()
    assert mark == second // TOKEN_BLOCK
    cat.skip_token_blocks(mark + 5)
    assert cat.token_block_mark() == mark + 5
    assert cat.token_block() == (mark + 6) * TOKEN_BLOCK
    cat.skip_token_blocks(2)  # below the mark: nothing changes
    assert cat.token_block() == (mark + 7) * TOKEN_BLOCK
    # Only a block taken with group commit, with nothing later stored, may be pending.
    assert cat.token_pending_window(second + 3, 0.5) == pytest.approx(0.52)
    assert cat.token_pending_window(first + 3, 0.5) == 0
    assert cat.token_pending_window((mark + 100) * TOKEN_BLOCK, 0.5) == 0  # never handed out


def test_a_missing_driver_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """PostgreSQL without psycopg installed: the error says what to install."""
    from keyshred.errors import ConfigError, MissingExtraError

    monkeypatch.setitem(sys.modules, "psycopg", None)  # as if not installed
    with pytest.raises(MissingExtraError, match=r"keyshred\[postgres\]"):
        Catalog("postgresql+psycopg://postgres@127.0.0.1:5432/test")
    monkeypatch.setitem(sys.modules, "psycopg2", None)
    with pytest.raises(ConfigError, match=r"psycopg2.*postgresql\+psycopg://") as info:
        Catalog("postgresql+psycopg2://postgres:secret-pw@127.0.0.1:5432/test")
    assert "keyshred[postgres]" in str(info.value) and "secret-pw" not in str(info.value)
