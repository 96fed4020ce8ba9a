"""The catalog on SQLite and PostgreSQL: assets, provenance, guard, consent."""

from __future__ import annotations

import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from keyshred.errors import StaleEpoch, SubjectSuppressed
from keyshred.storage.catalog import (
    ACTIVE,
    SUPPRESSED,
    AssetRow,
    Catalog,
    Micros,
    micros,
    sqlite_url,
)
from tests import zygote

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
        cat._hot = lambda write, snapshot=False: pytest.fail(
            "a cached guard read reached the database"
        )  # type: ignore[method-assign]
        assert cat.check_guard(ref) == 0  # no statement: the generation has not moved
        assert cat.guard(ref).status == ACTIVE
        cat._hot = real  # type: ignore[method-assign]
        code = (
            "from keyshred.storage.catalog import Catalog\n"
            f"c = Catalog({url!r})\n"
            "c.suppress('ref-cached')\n"
            "c.close()\n"
        )
        zygote.run([sys.executable, "-c", code], check=True, timeout=60)
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


def test_micros_is_exact() -> None:
    for value in (
        NOW,
        datetime(1999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC),
        NOW.replace(tzinfo=None),
    ):
        us = micros(value)
        assert isinstance(us, int)
        assert Micros().process_result_value(us, None) == value.replace(tzinfo=UTC)


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
