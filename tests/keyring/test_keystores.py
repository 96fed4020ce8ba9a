"""One behaviour suite for every key store: the embedded SQLite file and the
distributed profile's PostgreSQL (the machine's server, a fresh schema per test)."""

from __future__ import annotations

import sqlite3
import sys
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from keyshred import Config, Keyshred
from keyshred.errors import BackendUnavailable, SubjectErased, SubjectSuppressed
from keyshred.keyring.kek.local import LocalKek
from keyshred.keyring.keyring import Keyring
from keyshred.keyring.keystore import (
    KeyRecord,
    KeyStore,
    SecretRecord,
    SQLiteKeyStore,
    SqlKeyStore,
    Tombstone,
    owner_tag,
)
from tests.conftest import pg_schema, pg_url


def store_url_of(schema: str) -> str:
    """The key store's ``postgresql://`` URL of a schema made by ``pg_schema``."""
    return f"postgresql://postgres@127.0.0.1:5432/test?options=-csearch_path%3D{schema}"


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str | None]:
    if request.param == "sqlite":
        yield None
        return
    with pg_schema("ksk") as schema:
        yield store_url_of(schema)


def open_store(url: str | None, tmp_path: Path) -> KeyStore:
    if url is None:
        return SQLiteKeyStore(tmp_path / "keystore.db")
    from keyshred.keyring.pgstore import PostgresKeyStore

    return PostgresKeyStore(url)


@pytest.fixture
def store(store_url: str | None, tmp_path: Path) -> Iterator[KeyStore]:
    s = open_store(store_url, tmp_path)
    yield s
    s.close()


def rec(ref: str, scope: str = "default", epoch: int = 1) -> KeyRecord:
    return KeyRecord(
        uuid.uuid4().bytes, "t", ref, scope, "local", epoch, b"w" * 60, datetime.now(UTC)
    )


def test_one_live_key_per_subject_and_scope(
    store: KeyStore, store_url: str | None, tmp_path: Path
) -> None:
    others = [open_store(store_url, tmp_path) for _ in range(4)]
    results: list[KeyRecord] = []
    barrier = threading.Barrier(len(others))

    def race(s: KeyStore) -> None:
        barrier.wait()
        results.append(s.insert(rec("ann")))

    threads = [threading.Thread(target=race, args=(s,)) for s in others]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({r.key_id for r in results}) == 1  # every writer got the same key
    assert store.find("ann", "default") == results[0]
    for s in others:
        s.close()


def test_reads_rotation_destroy_tombstones_and_secrets(store: KeyStore) -> None:
    a, b, c = store.insert(rec("ann")), store.insert(rec("ann", "health")), store.insert(rec("bob"))
    assert store.get(a.key_id) == a and store.get(b"x" * 16) is None
    assert set(store.get_many([a.key_id, c.key_id])) == {a.key_id, c.key_id}
    assert {r.scope for r in store.for_subject("ann")} == {"default", "health"}
    assert store.for_subject("ann", "health") == [b]
    assert len(store.older_than(2, 10)) == 3
    store.update_wrapped([(a.key_id, 2, b"v" * 60)])
    assert store.get(a.key_id).kek_epoch == 2  # type: ignore[union-attr]
    assert len(store.older_than(2, 10)) == 2
    before = datetime.now(UTC) - timedelta(seconds=1)
    tomb = Tombstone("t1", "ann", "health", (b.key_id,), datetime.now(UTC))
    assert store.destroy([b.key_id], tomb) == 1
    assert store.get(b.key_id) is None and store.find("ann", "default") is not None
    got = store.tombstone_for(b.key_id)
    assert got is not None and got.tombstone_id == "t1" and got.key_ids == (b.key_id,)
    assert [t.tombstone_id for t in store.tombstones(since=before)] == ["t1"]
    assert store.is_tombstoned("ann", "health") and not store.is_tombstoned("ann", "default")
    store.destroy([a.key_id], Tombstone("t2", "ann", None, (a.key_id,), datetime.now(UTC)))
    assert store.is_tombstoned("ann", "default")  # a subject-wide tombstone covers every scope
    first = store.put_secret(SecretRecord("sign", "local", 1, b"s1"))
    assert store.put_secret(SecretRecord("sign", "local", 1, b"s2")) == first  # first wins
    assert store.put_secret(SecretRecord("sign", "local", 2, b"s3"), replace=True).wrapped == b"s3"
    assert [s.name for s in store.secrets()] == ["sign"]
    assert store.counts() == {"dek": 1, "shared": 0, "tombstone": 2, "secret": 1}


def test_snapshot_is_an_embedded_key_store(store: KeyStore, tmp_path: Path) -> None:
    a = store.insert(rec("cy"))
    store.put_secret(SecretRecord("ref-key", "local", 1, b"k"))
    store.destroy([a.key_id], Tombstone("t9", "cy", None, (a.key_id,), datetime.now(UTC)))
    b = store.insert(rec("dee"))
    image = store.snapshot()
    subjects, tombs = SQLiteKeyStore.describe_snapshot(image)
    assert subjects == ["dee"] and tombs == ["t9"]
    copy = SQLiteKeyStore.from_snapshot(tmp_path / "copy.db", image)
    try:
        assert copy.get(b.key_id) == b
        assert copy.tombstone_for(a.key_id) is not None
        assert copy.get_secret("ref-key") is not None
    finally:
        copy.close()


def test_keyring_erasure_on_each_store(store: KeyStore, tmp_path: Path) -> None:
    ring = Keyring(store, LocalKek(tmp_path / "kek.json", create=True))
    key = ring.data_key("eve", "default")
    ring.destroy("eve")
    with pytest.raises(SubjectErased):
        ring.data_key_by_id(key.key_id)


def test_distributed_profile_end_to_end(tmp_path: Path) -> None:
    """Catalog and key store on PostgreSQL: two workers share keys and data; erase;
    back up; restore (into an embedded copy) with replay."""
    with pg_schema("ksk") as schema:
        _distributed(pg_url(schema), store_url_of(schema), tmp_path)


def _distributed(catalog_url: str, store_url: str, tmp_path: Path) -> None:
    cfg = Config.model_validate(
        {
            "profile": "distributed",
            "storage": {"catalog_url": catalog_url},
            "keyring": {"store_url": store_url},
        }
    )
    kek = tmp_path / "shared-kek.json"
    cfg = cfg.model_copy(update={"kek": cfg.kek.model_copy(update={"local_path": str(kek)})})
    ks = Keyshred.init(tmp_path / "w1", cfg)
    other = Keyshred.open(tmp_path / "w1", cfg)  # a second worker: same catalog, keys, data
    try:
        assert ks.subject_ref("fay") == other.subject_ref("fay")  # one ref key for all
        ks.memories.put("fay", ("n",), "k", {"v": 1})
        ks.memories.put("gus", ("n",), "k", {"v": 2})
        gen = ks.backup.create()
        req = other.erase("fay", requested_by="dpo", reason="art17")
        assert req.state == "completed", req.error
        with pytest.raises(SubjectSuppressed):
            ks.memories.get("fay", ("n",), "k")
        assert not ks.memories.partition_path(ks.subject_ref("fay")).exists()
        assert ks.keyring.store.for_subject(ks.subject_ref("fay")) == []
        report = ks.backup.restore(gen.generation, tmp_path / "restored")
        assert [r["subject_ref"] for r in report.replayed] == [ks.subject_ref("fay")]
        with Keyshred.open(tmp_path / "restored") as r:
            assert r.memories.get("gus", ("n",), "k").value == {"v": 2}  # type: ignore[union-attr]
    finally:
        other.close()
        ks.close()


def test_a_missing_driver_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """keyring.store_url on PostgreSQL without psycopg: the error names the extra,
    from the facade as from the store."""
    from keyshred.errors import MissingExtraError
    from keyshred.keyring.pgstore import PostgresKeyStore

    monkeypatch.setitem(sys.modules, "psycopg", None)  # as if not installed
    with pytest.raises(MissingExtraError, match=r"keyshred\[postgres\]"):
        PostgresKeyStore("postgresql+psycopg://postgres@127.0.0.1:5432/test")
    config = Config.model_validate(
        {"keyring": {"store_url": "postgresql+psycopg://postgres@127.0.0.1:5432/test"}}
    )
    with pytest.raises(MissingExtraError, match=r"keyshred\[postgres\]"):
        Keyshred.init(tmp_path / "d", config)


def test_a_locked_sqlite_key_store_is_backend_unavailable_until_released(
    tmp_path: Path,
) -> None:
    """Another connection's exclusive lock outlasting the busy timeout is a typed
    ``BackendUnavailable`` (without the driver's text), nothing is written, and the
    same handle works once the lock is released."""
    path = tmp_path / "keystore.db"
    store = SQLiteKeyStore(path, busy_timeout=0.05)
    held = rec("ref-held")
    store.insert(held)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        record = rec("ref-locked")
        writes = [
            lambda: store.insert(record),
            lambda: store.put_secret(SecretRecord("s", "local", 1, b"w" * 40)),
            lambda: store.update_wrapped([(held.key_id, 2, b"x" * 60)]),
            lambda: store.destroy(
                [held.key_id], Tombstone("t1", "ref-held", None, (), held.created_at)
            ),
        ]
        for write in writes:
            with pytest.raises(BackendUnavailable) as info:
                write()
            assert "database is locked" not in str(info.value)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert store.find("ref-locked", "default") is None
    assert store.get(held.key_id) == held
    assert store.insert(record).key_id == record.key_id
    assert store.put_secret(SecretRecord("s", "local", 1, b"w" * 40)).name == "s"
    store.close()


def test_a_forked_child_opens_its_own_postgres_key_store_connection() -> None:
    # Review of #18 item 1: the catalog's pool is disposed in a forked child, the
    # PostgreSQL key store's was not: the child reused the parent's pooled
    # connection (one socket, two processes interleaving one protocol stream).
    import os

    from keyshred.keyring.pgstore import PostgresKeyStore

    with pg_schema("ksk") as schema:
        store = PostgresKeyStore(store_url_of(schema))
        try:
            parent = _backend_pid(store)
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: report its server process, never return
                code = 1
                try:
                    child = _backend_pid(store)
                    os.write(w, str(child).encode())
                    code = 0
                finally:
                    os._exit(code)
            os.close(w)
            with os.fdopen(r, "rb") as out:
                reported = out.read()
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
            assert int(reported) != parent
            assert _backend_pid(store) == parent  # still ours
        finally:
            store.close()


def _backend_pid(store: KeyStore) -> int:
    """The server process of the connection the store's pool hands out."""
    assert isinstance(store, SqlKeyStore)
    with store.engine.connect() as conn:
        return int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())


def shared_rec(ref: str, owners: tuple[str, ...], scope: str = "default") -> KeyRecord:
    others = tuple(sorted(set(owners) - {ref}))
    return KeyRecord(
        uuid.uuid4().bytes,
        "t",
        ref,
        scope,
        "local",
        1,
        b"w" * 60,
        datetime.now(UTC),
        owner_tag(others),
        others,
    )


def test_owner_sets_one_key_each_indexed_by_every_owner(store: KeyStore) -> None:
    own = store.insert(rec("dave"))
    with_vic = store.insert(shared_rec("dave", ("vic",)))
    with_both = store.insert(shared_rec("dave", ("vic", "zoe")))
    zoe_holds = store.insert(shared_rec("zoe", ("vic",)))
    # Same owner set again (any order): the first key wins.
    assert store.insert(shared_rec("dave", ("zoe", "vic"))).key_id == with_both.key_id
    assert len({own.key_id, with_vic.key_id, with_both.key_id}) == 3
    assert store.find("dave", "default") == own
    assert store.find("dave", "default", owner_tag(("vic",))).key_id == with_vic.key_id  # type: ignore[union-attr]
    assert {r.key_id for r in store.for_subject("dave")} == {
        own.key_id,
        with_vic.key_id,
        with_both.key_id,
    }
    owned = {r.key_id: r for r in store.owned_by("vic")}
    assert set(owned) == {with_vic.key_id, with_both.key_id, zoe_holds.key_id}
    assert owned[with_both.key_id].owners == ("vic", "zoe")
    assert store.owners_of([own.key_id, with_both.key_id]) == {with_both.key_id: ("vic", "zoe")}
    assert store.counts()["shared"] == 3
    tomb = Tombstone("tv", "vic", None, tuple(owned), datetime.now(UTC))
    assert store.destroy(list(owned), tomb) == 3
    assert store.owned_by("vic") == [] and store.owners_of(list(owned)) == {}
    assert store.find("dave", "default") == own  # the holder's own key stays
    snap = SQLiteKeyStore.describe_snapshot(store.snapshot())
    assert snap[0] == ["dave"]


def test_a_store_from_before_owner_sets_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript(
        """
        CREATE TABLE dek (key_id BLOB PRIMARY KEY, tenant TEXT NOT NULL,
            subject_ref TEXT NOT NULL, scope TEXT NOT NULL, kek_provider TEXT NOT NULL,
            kek_epoch INTEGER NOT NULL, wrapped BLOB NOT NULL, created_at TEXT NOT NULL,
            UNIQUE (subject_ref, scope));
        CREATE INDEX dek_epoch ON dek (kek_epoch);
        """
    )
    db.execute(
        "INSERT INTO dek VALUES (?,?,?,?,?,?,?,?)",
        (b"k" * 16, "t", "ann", "default", "local", 1, b"w" * 60, datetime.now(UTC).isoformat()),
    )
    db.commit()
    db.close()
    store = SQLiteKeyStore(path)
    try:
        old = store.find("ann", "default")
        assert old is not None and old.key_id == b"k" * 16 and old.owner_tag == ""
        store.insert(shared_rec("ann", ("bob",)))  # the old unique key would refuse this
        assert len(store.for_subject("ann")) == 2 and len(store.owned_by("bob")) == 1
    finally:
        store.close()


def test_owners_through_one_scope_and_as_the_whole_subject(store: KeyStore) -> None:
    """``ref@scope`` co-owns through one scope's data; the subject's erasure reaches
    both forms, a scope's only its own."""
    from keyshred.keyring.keystore import owner_subject, owner_token

    vic = "v" * 26
    mention = store.insert(shared_rec("dave", (vic,)))
    health = store.insert(shared_rec("dave", (owner_token(vic, "health"),)))
    other_scope = store.insert(shared_rec("zoe", (owner_token(vic, "default"),)))
    near = store.insert(shared_rec("zoe", ("v" * 25 + "w",)))  # another subject
    assert {r.key_id for r in store.owned_by(vic)} == {
        mention.key_id,
        health.key_id,
        other_scope.key_id,
    }
    assert [r.key_id for r in store.owned_by(vic, "health")] == [health.key_id]
    assert store.owned_by(vic, "nothing") == []
    assert near.key_id not in {r.key_id for r in store.owned_by(vic)}
    assert owner_subject(owner_token(vic, "health")) == vic == owner_subject(vic)
    snap = SQLiteKeyStore.describe_snapshot(store.snapshot())
    assert vic in snap[0] and f"{vic}@health" not in snap[0]
