"""The catalog database's Alembic revisions on SQLite and PostgreSQL: a catalog of
the previous release (keyshred main at fae494a, before versioned migrations) is
stamped and upgraded in place with its data intact, and the migrated schema is the
one the models define (autogenerate finds nothing to do)."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from keyshred.errors import ConfigError
from keyshred.migrations import SCRIPT_LOCATION, VERSION_TABLE, migrate_catalog, target_metadata
from keyshred.migrations import baseline as old
from keyshred.storage.catalog import SUPPRESSED, Catalog, sqlite_url
from keyshred.vault.store import TokenStore
from tests import zygote
from tests.conftest import pg_schema, pg_url
from tests.schema_report import schema_report

DATA = Path(__file__).with_name("data")
NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def _head() -> str:
    cfg = Config()
    cfg.set_main_option("script_location", SCRIPT_LOCATION)
    head = ScriptDirectory.from_config(cfg).get_current_head()
    assert head is not None
    return head


def _version(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return [str(v) for (v,) in conn.exec_driver_sql(f"SELECT version_num FROM {VERSION_TABLE}")]


def _diff(engine: sa.Engine) -> list[object]:
    with engine.connect() as conn:
        context = MigrationContext.configure(
            conn, opts={"version_table": VERSION_TABLE, "compare_type": True}
        )
        return list(compare_metadata(context, target_metadata()))


def _previous_release(url: str) -> None:
    """The tables exactly as main@fae494a created them (its DDL, dumped for both
    dialects), with rows in them."""
    engine = sa.create_engine(url)
    ddl = (DATA / f"catalog_fae494a.{engine.dialect.name}.sql").read_text()
    statements = [s.strip() for s in ddl.split(";") if s.strip().removeprefix("--").strip()]
    with engine.begin() as conn:
        for stmt in statements:
            lines = [ln for ln in stmt.splitlines() if not ln.startswith("--")]
            conn.exec_driver_sql("\n".join(lines))
        conn.execute(
            old.assets.insert(),
            [
                {
                    "asset_id": aid,
                    "subject_ref": "ref-a",
                    "scope": "default",
                    "kind": "memory",
                    "storage_system": "parquet",
                    "storage_key": "memories/subject=ref-a",
                    "purpose": "support",
                    "category": "general",
                    "created_at": NOW,
                    "retain_until": NOW + timedelta(days=30),
                    "status": "live",
                }
                for aid in ("m1", "m2")
            ],
        )
        conn.execute(old.asset_sources.insert(), [{"asset_id": "m2", "source_id": "m1"}])
        conn.execute(
            old.asset_mentions.insert(),
            [{"asset_id": "m2", "subject_ref": "ref-c", "how": "detected"}],
        )
        conn.execute(
            old.identifiers.insert(),
            [
                {
                    "hash": "h1",
                    "subject_ref": "ref-c",
                    "kind": "email",
                    "created_at": NOW,
                    "sealed": b"\x00sealed",
                }
            ],
        )
        conn.execute(
            old.subject_guard.insert(),
            [
                {
                    "subject_ref": "ref-b",
                    "status": SUPPRESSED,
                    "deletion_epoch": 3,
                    "suppressed_scopes": "[]",
                    "updated_at": NOW,
                }
            ],
        )
        conn.execute(
            old.consents.insert(),
            [
                {
                    "consent_id": "c1",
                    "subject_ref": "ref-a",
                    "purpose": "support",
                    "category": "general",
                    "actions": '["store", "use"]',
                    "start_at": NOW,
                    "end_at": None,
                    "policy_version": "1",
                    "status": "active",
                    "created_at": NOW,
                    "revoked_at": None,
                }
            ],
        )
        block = conn.execute(
            old.token_blocks.insert().values(taken_at=NOW, group_commit_ms=0.0)
        ).inserted_primary_key
        assert block is not None
        conn.execute(
            old.tokens.insert(),
            [
                {
                    "number": int(block[0]) * 1024,
                    "token": "<PHONE_0000000001>",
                    "subject_ref": "ref-a",
                    "scope": "default",
                    "kind": "PHONE",
                    "purpose": "support",
                    "deterministic": False,
                    "lookup": None,
                    "created_at": 1_764_504_000_000_000,
                    "expires_at": 1_764_507_600_000_000,
                    "value": b"ciphertext",
                }
            ],
        )
        conn.execute(
            old.deletion_requests.insert(),
            [
                {
                    "request_id": "r1",
                    "subject_ref": "ref-b",
                    "scope": None,
                    "state": "done",
                    "requested_by": "dpo",
                    "reason": "art. 17",
                    "created_at": NOW,
                    "updated_at": NOW,
                    "attempts": 1,
                    "doc": "{}",
                    "receipt": None,
                }
            ],
        )
    engine.dispose()


def test_a_catalog_of_the_previous_release_is_upgraded_in_place(catalog_url: str) -> None:
    _previous_release(catalog_url)
    catalog = Catalog(catalog_url, migrate=migrate_catalog)
    try:
        assert _version(catalog.engine) == [_head()]
        m2 = catalog.asset("m2")
        assert m2 is not None
        assert m2.sources == ("m1",) and m2.mentions == ("ref-c",)
        assert m2.created_at == NOW and m2.retain_until == NOW + timedelta(days=30)
        assert catalog.detected_mentions("m2") == frozenset({"ref-c"})
        assert catalog.identifier_subjects(["h1"]) == [("h1", "ref-c")]
        assert catalog.guard("ref-b").status == SUPPRESSED and catalog.guard("ref-b").epoch == 3
        assert [c.consent_id for c in catalog.consents("ref-a")] == ["c1"]
        # The vault lists its tokens as assets (and hands out numbers) once attached.
        store = TokenStore(catalog, lambda token: None, create_tables=False)
        tokens = catalog.assets("ref-a", kind="token")
        assert [t.asset_id for t in tokens] == ["<PHONE_0000000001>"]
        with catalog.engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT state FROM ks_deletion_requests").all() == [
                ("done",)
            ]
        # New writes on the upgraded catalog: a token block after the old one.
        assert store.block() == 2 * 1024
        store.close()
        if catalog.dialect == "sqlite":  # block numbers are never reissued
            with catalog.engine.connect() as conn:
                ddl = conn.exec_driver_sql(
                    "SELECT sql FROM sqlite_master WHERE name = 'ks_token_blocks'"
                ).scalar_one()
            assert "AUTOINCREMENT" in ddl
        assert _diff(catalog.engine) == []
    finally:
        catalog.close()
    again = Catalog(catalog_url, migrate=migrate_catalog)  # at head: nothing to do
    try:
        assert _version(again.engine) == [_head()] and again.count("ref-a") == 2
    finally:
        again.close()


def test_a_new_catalog_is_built_by_the_revisions_as_the_models_define_it(
    catalog_url: str,
) -> None:
    catalog = Catalog(catalog_url, migrate=lambda e: migrate_catalog(e, replay=True))
    try:
        assert _version(catalog.engine) == [_head()]
        assert _diff(catalog.engine) == []
    finally:
        catalog.close()


@pytest.fixture
def second_catalog_url(catalog_url: str, tmp_path: Path) -> Iterator[str]:
    """Another empty catalog database of the same kind as ``catalog_url``."""
    if catalog_url.startswith("sqlite"):
        yield sqlite_url(tmp_path / "second.db")
        return
    with pg_schema() as schema:
        yield pg_url(schema)


def test_a_new_catalog_is_built_from_the_models_as_the_revisions_would_build_it(
    catalog_url: str, second_catalog_url: str
) -> None:
    """A new catalog is built by ``create_all`` and stamped, not by replaying every
    revision; both ways give the same schema as the database reports it, and later
    opens of either find it at the newest revision."""
    built = {}
    for url, replay in ((catalog_url, True), (second_catalog_url, False)):
        engine = sa.create_engine(url)
        migrate_catalog(engine, replay=replay)
        assert _version(engine) == [_head()]
        built[replay] = schema_report(engine)
        engine.dispose()
    assert built[False] == built[True]
    assert any(k.startswith("index") for k in built[True])  # the report is not empty
    for url in (catalog_url, second_catalog_url):
        catalog = Catalog(url, migrate=migrate_catalog)
        try:
            assert _version(catalog.engine) == [_head()] and _diff(catalog.engine) == []
        finally:
            catalog.close()


def test_only_a_database_without_any_catalog_table_is_built_from_the_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The models build a database that has none of the catalog's tables (another
    component's may be there: a key store sharing the database); one with some of
    them and no version table is an older catalog, stamped and upgraded."""
    from alembic import command

    url = sqlite_url(tmp_path / "catalog.db")
    with sqlite3.connect(tmp_path / "catalog.db") as conn:
        conn.execute("CREATE TABLE ks_deks (id INTEGER PRIMARY KEY)")  # not the catalog's
    conn.close()
    upgrades: list[str] = []
    real_upgrade = command.upgrade
    monkeypatch.setattr(
        command, "upgrade", lambda *a, **k: (upgrades.append("up"), real_upgrade(*a, **k))
    )
    engine = sa.create_engine(url)
    migrate_catalog(engine)
    assert upgrades == [] and _version(engine) == [_head()]
    engine.dispose()
    # Storage's tables alone (``Catalog`` without migrations): stamped and upgraded.
    other = sqlite_url(tmp_path / "storage-only.db")
    Catalog(other).close()
    engine = sa.create_engine(other)
    migrate_catalog(engine)
    assert upgrades == ["up"] and _version(engine) == [_head()] and _diff(engine) == []
    engine.dispose()


def test_a_catalog_built_without_the_revisions_is_stamped_when_the_facade_opens_it(
    tmp_path: Path,
) -> None:
    """``Catalog`` alone (tests, tools) creates the storage tables as defined now; the
    migrations later stamp it and add what belongs to the layers above."""
    url = sqlite_url(tmp_path / "catalog.db")
    Catalog(url).close()
    catalog = Catalog(url, migrate=migrate_catalog)
    try:
        assert _version(catalog.engine) == [_head()]
        assert _diff(catalog.engine) == []
    finally:
        catalog.close()


def test_catalogs_from_before_mention_provenance_and_sealed_identifiers(
    catalog_url: str,
) -> None:
    """Development builds before main@fae494a lacked ``ks_asset_mentions.how`` and
    ``ks_identifiers.sealed`` (and some tables): the stamp at 0001 comes after they
    are added, old mentions declared, old identifiers without a sealed value."""
    engine = sa.create_engine(catalog_url)
    with engine.begin() as conn:
        old.assets.create(conn)
        conn.exec_driver_sql(
            "CREATE TABLE ks_asset_mentions (asset_id VARCHAR(64) NOT NULL, "
            "subject_ref VARCHAR(64) NOT NULL, PRIMARY KEY (asset_id, subject_ref))"
        )
        conn.exec_driver_sql("INSERT INTO ks_asset_mentions VALUES ('a1', 'ref1')")
        conn.exec_driver_sql(
            "CREATE TABLE ks_identifiers (hash VARCHAR(64) NOT NULL, subject_ref VARCHAR(64) "
            "NOT NULL, kind VARCHAR(16) NOT NULL, created_at TIMESTAMP NOT NULL, "
            "PRIMARY KEY (hash, subject_ref))"
        )
    engine.dispose()
    catalog = Catalog(catalog_url, migrate=migrate_catalog)
    try:
        assert catalog.mention_counts() == {"declared": 1, "detected": 0}
        assert _version(catalog.engine) == [_head()]
        columns = {c["name"] for c in sa.inspect(catalog.engine).get_columns("ks_identifiers")}
        assert "sealed" in columns
    finally:
        catalog.close()


def test_a_token_table_from_before_token_numbers_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE ks_assets (asset_id VARCHAR(64) PRIMARY KEY)")
        conn.execute("CREATE TABLE ks_tokens (token VARCHAR(64) PRIMARY KEY, value BLOB)")
    conn.close()
    with pytest.raises(ConfigError, match="predates token numbers"):
        Catalog(sqlite_url(path), migrate=migrate_catalog)
    # Refused as a whole: not stamped, nothing added.
    with sqlite3.connect(path) as conn:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    conn.close()
    assert VERSION_TABLE not in names and "ks_consents" not in names


_OPEN_AT_ONCE = """
import sys, time
from keyshred.migrations import migrate_catalog
from keyshred.storage.catalog import Catalog
while time.time() < float(sys.argv[2]):  # start together
    time.sleep(0.001)
Catalog(sys.argv[1], migrate=migrate_catalog).close()
"""


def test_processes_opening_a_new_catalog_at_once_build_it_once(catalog_url: str) -> None:
    """Four processes open one new catalog together: one builds it from the models
    under the migration lock, the others find it at the newest revision; none fails
    and the schema is whole."""
    start = time.time() + 1.5
    procs = [
        zygote.Popen(
            [sys.executable, "-c", _OPEN_AT_ONCE, catalog_url, str(start)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(4)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()
    engine = sa.create_engine(catalog_url)
    try:
        assert _version(engine) == [_head()] and _diff(engine) == []
    finally:
        engine.dispose()


_KILLED_WHILE_BUILDING = """
import os, sys
from alembic import command
from keyshred.migrations import migrate_catalog
from keyshred.storage.catalog import Catalog

def killed(*args, **kwargs):  # every table made, the stamp not yet written
    os._exit(9)

command.stamp = killed
Catalog(sys.argv[1], migrate=migrate_catalog)
"""


def test_a_process_killed_while_building_a_new_catalog_leaves_it_new(catalog_url: str) -> None:
    """The build and its stamp are one transaction: a process killed between the two
    leaves no table behind, and the next open builds the whole catalog."""
    proc = zygote.run([sys.executable, "-c", _KILLED_WHILE_BUILDING, catalog_url], timeout=60)
    assert proc.returncode == 9
    engine = sa.create_engine(catalog_url)
    try:
        assert not set(sa.inspect(engine).get_table_names()) & set(target_metadata().tables)
    finally:
        engine.dispose()
    catalog = Catalog(catalog_url, migrate=migrate_catalog)
    try:
        assert _version(catalog.engine) == [_head()] and _diff(catalog.engine) == []
    finally:
        catalog.close()
