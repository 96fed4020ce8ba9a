"""The key store's Alembic revisions: a store made by main@fae494a's DDL (committed
as test data, one file per dialect) with keys, owners and tombstones opens with
today's code, its keys unwrap, its version table is at the head, and the migrated
schema has no difference from ``keyshred.keyring.schema`` on either dialect."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.config import Config as AlembicConfig
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from keyshred import db
from keyshred.keyring import keystore, schema
from keyshred.keyring.envelope import Place
from keyshred.keyring.kek.local import LocalKek
from keyshred.keyring.keyring import Keyring
from keyshred.keyring.keystore import (
    KeyRecord,
    SQLiteKeyStore,
    SqlKeyStore,
    Tombstone,
    owner_tag,
)
from tests.conftest import PG_DSN, pg_schema, pg_url
from tests.schema_report import schema_report

DATA = Path(__file__).resolve().parents[1] / "data" / "keystore"
PG_URL = "postgresql://postgres@127.0.0.1:5432/test"


@pytest.fixture(params=["sqlite", "postgresql"])
def dialect(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def old_url(dialect: str, tmp_path: Path) -> Iterator[str]:
    """An empty database with main@fae494a's key store DDL applied, as its code did."""
    ddl = (DATA / f"fae494a.{dialect}.sql").read_text()
    if dialect == "sqlite":
        path = tmp_path / "keys" / "keystore.db"
        path.parent.mkdir()
        conn = sqlite3.connect(path)
        conn.executescript(ddl)
        conn.close()
        yield f"sqlite:///{path}"
        return
    psycopg = pytest.importorskip("psycopg")
    with pg_schema("ksm") as name:
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(f"SET search_path TO {name}")
            conn.execute(ddl)
        yield f"{PG_URL}?options=-csearch_path%3D{name}"


def _old_rows(url: str, dialect: str, key_id: bytes, wrapped: bytes, created: datetime) -> None:
    """Rows as fae494a wrote them (raw SQL of that release), besides the ones its
    ``Keyring`` wrote through the store: a shared key with its owner and a tombstone."""
    p = schema.prefix_for(dialect)
    shared_tag = owner_tag(("vic",))
    when = created if dialect == "postgresql" else schema.timestamp(created)
    engine = sa.create_engine(keystore.engine_url(url))
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    f"INSERT INTO {p}dek (key_id, tenant, subject_ref, scope, kek_provider, "
                    "kek_epoch, wrapped, created_at, owner_tag) "
                    "VALUES (:k, 't', 'dave', 'default', 'local', 1, :w, :c, :g)"
                ),
                {"k": key_id, "w": wrapped, "c": when, "g": shared_tag},
            )
            conn.execute(
                sa.text(f"INSERT INTO {p}dek_owner VALUES ('vic', :k)"),
                {"k": key_id},
            )
            conn.execute(
                sa.text(f"INSERT INTO {p}tombstone VALUES ('t-old', 'zed', NULL, :c)"),
                {"c": when},
            )
            conn.execute(
                sa.text(f"INSERT INTO {p}tombstone_key VALUES (:k, 't-old')"),
                {"k": b"z" * 16},
            )
    finally:
        engine.dispose()


def _version(store: SqlKeyStore) -> str | None:
    with store.engine.connect() as conn:
        return MigrationContext.configure(
            conn, opts={"version_table": schema.VERSION_TABLE}
        ).get_current_revision()


def _head() -> str:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", schema.MIGRATIONS)
    head = ScriptDirectory.from_config(cfg).get_current_head()
    assert head is not None
    return head


def _diff(store: SqlKeyStore) -> list[object]:
    with store.engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        metadata = schema.tables(schema.prefix_for(store.dialect)).metadata
        return [
            d for d in compare_metadata(context, metadata) if schema.VERSION_TABLE not in repr(d)
        ]


def _index_names(store: SqlKeyStore) -> set[str]:
    inspector = sa.inspect(store.engine)
    p = schema.prefix_for(store.dialect)
    names: set[str] = set()
    for table in schema.tables(p).metadata.tables:
        names |= {str(i["name"]).removeprefix(p) for i in inspector.get_indexes(table)}
    return names


def _seed(url: str, dialect: str, tmp_path: Path) -> tuple[bytes, bytes]:
    """Keys and secrets a keyring wrote (real wrapped bytes), copied row by row into
    the fae494a tables: that release wrote the same columns and values. Returns a
    key id and a ciphertext sealed under it."""
    seed = SQLiteKeyStore(tmp_path / "seed.db")
    ring = Keyring(seed, LocalKek(tmp_path / "kek.json", create=True))
    key = ring.data_key(ring.subject_ref("ann"), "default")
    ct = ring.seal(b"ann's note", _place(ring, "ann"))
    source = schema.tables("")
    with seed.engine.connect() as conn:
        rows = {
            t.name: [dict(r._mapping) for r in conn.execute(sa.select(t))]
            for t in (source.dek, source.secret, source.epoch_key)
        }
    ring.close()
    target = schema.tables(schema.prefix_for(dialect))
    engine = sa.create_engine(keystore.engine_url(url))
    try:
        with engine.begin() as conn:
            for table in (target.dek, target.secret, target.epoch_key):
                conn.execute(table.insert(), rows[table.name.removeprefix("ks_")])
    finally:
        engine.dispose()
    _old_rows(url, dialect, b"d" * 16, b"w" * 60, datetime.now(UTC))
    return key.key_id, ct


def test_a_fae494a_store_opens_migrated_with_its_keys(
    old_url: str, dialect: str, tmp_path: Path
) -> None:
    key_id, ct = _seed(old_url, dialect, tmp_path)
    new = SqlKeyStore(old_url)
    try:
        assert _version(new) == _head()
        assert not _diff(new)
        assert _index_names(new) == INDEXES
        ring = Keyring(new, LocalKek(tmp_path / "kek.json"))
        assert ring.data_key_by_id(key_id).key_id == key_id
        assert ring.open(ct, _place(ring, "ann")) == b"ann's note"
        shared = new.owned_by("vic")
        assert [r.key_id for r in shared] == [b"d" * 16] and shared[0].owners == ("vic",)
        old = new.tombstone_for(b"z" * 16)
        assert old is not None and old.tombstone_id == "t-old" and new.is_tombstoned("zed", "x")
        # The unique key still holds after the rebuild: the first writer wins.
        again = KeyRecord(
            b"e" * 16,
            "t",
            "dave",
            "default",
            "local",
            1,
            b"v" * 60,
            datetime.now(UTC),
            owner_tag(("vic",)),
            ("vic",),
        )
        assert new.insert(again).key_id == b"d" * 16
        new.destroy([key_id], Tombstone("t-new", "x", None, (key_id,), datetime.now(UTC)))
        assert new.get(key_id) is None
    finally:
        new.close()
    reopened = SqlKeyStore(old_url)  # at the head: opens without migrating again
    try:
        assert _version(reopened) == _head() and reopened.tombstone_for(key_id) is not None
    finally:
        reopened.close()


def test_a_new_store_has_the_models_schema(dialect: str, tmp_path: Path) -> None:
    if dialect == "sqlite":
        store: SqlKeyStore = SQLiteKeyStore(tmp_path / "keystore.db")
        try:
            _check_fresh(store)
        finally:
            store.close()
        return
    with pg_schema("ksm") as name:
        store = SqlKeyStore(f"{PG_URL}?options=-csearch_path%3D{name}")
        try:
            _check_fresh(store)
        finally:
            store.close()


def test_a_new_store_is_built_from_its_tables_as_the_revisions_would_build_it(
    dialect: str, tmp_path: Path
) -> None:
    """A new key store is built by ``create_all`` on its tables and stamped, not by
    replaying the revisions (raw SQL among them); both give the same schema as the
    database reports it."""
    with contextlib.ExitStack() as stack:
        if dialect == "sqlite":
            urls = [f"sqlite:///{tmp_path / 'replayed.db'}", f"sqlite:///{tmp_path / 'built.db'}"]
        else:
            urls = [pg_url(stack.enter_context(pg_schema("ksm"))) for _ in range(2)]
        replayed = db.create_engine(keystore.engine_url(urls[0]), what="key store")
        stack.callback(replayed.dispose)
        db.migrate(  # every revision
            replayed, schema.MIGRATIONS, schema.VERSION_TABLE, head=schema.HEAD
        )
        store = SqlKeyStore(urls[1])  # built from the tables
        stack.callback(store.close)
        assert _version(store) == _head()
        assert schema_report(replayed) == schema_report(store.engine)
        assert schema_report(replayed)  # not empty


# The same indexes on both dialects (before revision 0002 the tombstone table had
# one on the time on SQLite and one on the subject on PostgreSQL).
INDEXES = {"dek_owner_set", "dek_epoch", "dek_wrap", "dek_owner_key", "tombstone_time"}
INDEXES |= {"tombstone_subject", "tombstone_key_tombstone"}


def _check_fresh(store: SqlKeyStore) -> None:
    assert _version(store) == _head()
    assert not _diff(store)
    assert _index_names(store) == INDEXES
    # A PostgreSQL store's snapshot is an embedded store at the same head.
    image = store.snapshot()
    conn = sqlite3.connect(":memory:")
    try:
        conn.deserialize(image)
        (version,) = conn.execute(f"SELECT version_num FROM {schema.VERSION_TABLE}").fetchone()
    finally:
        conn.close()
    assert version == _head()


def test_a_snapshot_image_from_fae494a_restores_at_the_head(tmp_path: Path) -> None:
    """A backup generation sealed by fae494a holds an unversioned image: a restore
    applies tombstones to it in memory and opens it, migrated."""
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.executescript((DATA / "fae494a.sqlite.sql").read_text())
    conn.close()
    _old_rows(f"sqlite:///{path}", "sqlite", b"d" * 16, b"w" * 60, datetime.now(UTC))
    image = path.read_bytes()
    assert SQLiteKeyStore.describe_snapshot(image) == (["dave", "vic"], ["t-old"])  # vic co-owns
    tomb = Tombstone("t-2", "dave", None, (b"d" * 16,), datetime.now(UTC))
    image = SQLiteKeyStore.apply_tombstones(image, [tomb])
    restored = SQLiteKeyStore.from_snapshot(tmp_path / "restored.db", image)
    try:
        assert _version(restored) == _head() and not _diff(restored)
        assert restored.get(b"d" * 16) is None and restored.tombstone_for(b"d" * 16) is not None
    finally:
        restored.close()


def _place(ring: Keyring, subject: str) -> Place:
    return Place(ring.subject_ref(subject), "default", "memories", "r1", "value")


def test_a_destroyed_keys_tombstone_is_found_without_a_scan(tmp_path: Path) -> None:
    """``tombstone_for`` (inside every erasure's window to crypto-erased) joins a
    tombstone to its keys by ``tombstone_id``: through revision 0003's index, not a
    scan of every key ever destroyed. The statement is the one the store runs,
    captured, and the plan SQLite's own for it."""
    store = SQLiteKeyStore(tmp_path / "keys.db")
    seen: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        if "tombstone_key" in statement:
            seen.append((statement, params))

    sa.event.listen(store.engine, "before_cursor_execute", capture)
    try:
        assert store.tombstone_for(b"\x01" * 16) is None
        assert len(seen) == 1
        statement, params = seen[0]
        with store.engine.connect() as conn:
            raw = conn.connection.driver_connection
            assert raw is not None
            plan = " | ".join(
                str(r[-1]) for r in raw.execute("EXPLAIN QUERY PLAN " + statement, params)
            )
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", capture)
        store.close()
    assert "tombstone_key_tombstone" in plan, plan
    assert "SCAN tombstone_key" not in plan, plan
