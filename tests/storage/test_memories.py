"""The memory store on both catalogs: API behaviour, typed errors, persistence."""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa

from keyshred import Keyshred
from keyshred.errors import (
    ConsentRequired,
    InvalidInput,
    NotFound,
    StaleEpoch,
    SubjectSuppressed,
    UnknownScope,
    ValueTooLarge,
)
from keyshred.storage.memories import PutItem
from keyshred.storage.schema import memory_hot, memory_segments
from tests.storage.conftest import SEGMENTS, make_config

NS = ("memories", "prefs")


def files_of(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_put_get_update_roundtrip(ks: Keyshred) -> None:
    m = ks.memories.put("alice", NS, "tea", {"likes": "green tea", "n": [1, 2.5, None]})
    got = ks.memories.get("alice", NS, "tea")
    assert got is not None and got.value == {"likes": "green tea", "n": [1, 2.5, None]}
    assert got.memory_id == m.memory_id and got.scope == "default"
    assert "green" not in repr(got) and "tea" not in repr(got)
    again = ks.memories.put("alice", NS, "tea", "oolong")  # upsert keeps identity
    assert again.memory_id == m.memory_id and again.created_at == m.created_at
    assert again.updated_at >= m.updated_at
    upd = ks.memories.update("alice", NS, "tea", {"likes": "matcha"})
    assert upd.memory_id == m.memory_id
    assert ks.memories.get("alice", NS, "tea").value == {"likes": "matcha"}  # type: ignore[union-attr]
    with pytest.raises(NotFound):
        ks.memories.update("alice", NS, "coffee", 1)
    assert ks.memories.get("bob", NS, "tea") is None
    assert ks.memories.get("alice", ("other",), "tea") is None


def test_search_prefix_filters_and_paging(ks: Keyshred) -> None:
    ks.consent.grant("alice", scope="support/health", category="health")
    for i in range(12):
        ks.memories.put(
            "alice", ("memories", "prefs", f"g{i % 3}"), f"k{i}", {"i": i, "even": i % 2 == 0}
        )
    ks.memories.put("alice", ("notes",), "n", {"i": 100})
    ks.memories.put(
        "alice", ("memories", "med"), "m", {"i": 7}, scope="support/health", category="health"
    )
    assert len(ks.memories.search("alice", ("memories",), limit=100)) == 13
    assert len(ks.memories.search("alice", ("memories", "prefs", "g1"), limit=100)) == 4
    assert len(ks.memories.search("alice", (), limit=100)) == 14
    page = ks.memories.search("alice", ("memories", "prefs"), limit=5, offset=0)
    rest = ks.memories.search("alice", ("memories", "prefs"), limit=100, offset=5)
    assert len(page) == 5 and len(rest) == 7
    assert not {m.memory_id for m in page} & {m.memory_id for m in rest}
    assert [m.updated_at for m in page] == sorted((m.updated_at for m in page), reverse=True)
    evens = ks.memories.search("alice", ("memories",), filter={"even": True}, limit=100)
    assert sorted(m.value["i"] for m in evens) == [0, 2, 4, 6, 8, 10]
    big = ks.memories.search("alice", ("memories",), filter={"i": {"$gte": 9}}, limit=100)
    assert sorted(m.value["i"] for m in big) == [9, 10, 11]
    health = ks.memories.search("alice", (), scope="support/health", limit=100)
    assert [m.key for m in health] == ["m"] and health[0].purpose == "support"
    assert ks.memories.search("bob", (), limit=100) == []
    with pytest.raises(InvalidInput):
        ks.memories.search("alice", (), filter={"i": {"$regex": "x"}})


@pytest.mark.parametrize("ks", ["segments", "catalog"], indirect=True)
def test_delete_is_physical(ks: Keyshred) -> None:
    ks.memories.put("alice", NS, "keep", {"v": 1})
    m = ks.memories.put("alice", NS, "gone", {"v": 2})
    ks.memories.flush()
    with ks.catalog.engine.connect() as conn:
        held = set(conn.execute(sa.select(memory_hot.c.record)).scalars())
    assert ks.memories.delete("alice", NS, "gone") is True
    assert ks.memories.delete("alice", NS, "gone") is False
    assert ks.memories.get("alice", NS, "gone") is None
    assert ks.catalog.asset(m.memory_id) is None
    assert ks.memories.get("alice", NS, "keep") is not None
    ref = ks.subject_ref("alice")
    part = ks.memories.partition_path(ref)
    # Only the current segment remains: the old segment and the hot rows that held
    # the deleted row's ciphertext are gone. Compacted into the catalog: no object,
    # one hot record (the compaction's), none of those that held the row.
    in_segments = ks.config.storage.inline_max_rows == 0
    names = sorted(p.name for p in files_of(part)) if part.exists() else []
    assert len([n for n in names if n.startswith("seg-")]) == int(in_segments)
    with ks.catalog.engine.connect() as conn:
        hot = conn.execute(sa.select(memory_hot.c.record).where(memory_hot.c.subject_ref == ref))
        records = set(hot.scalars())
    assert len(records) == int(not in_segments) and not records & held


def test_every_memory_is_an_asset_with_provenance(ks: Keyshred) -> None:
    src = ks.memories.put("bob", NS, "fact", "bob likes tea")
    m = ks.memories.put(
        "alice", NS, "summary", "x", sources=[src.memory_id], mentions=["bob", "carol"]
    )
    row = ks.catalog.asset(m.memory_id)
    assert row is not None
    assert row.subject_ref == ks.subject_ref("alice") and row.kind == "memory"
    assert row.sources == (src.memory_id,)
    assert set(row.mentions) == {ks.subject_ref("bob"), ks.subject_ref("carol")}
    assert row.retain_until == m.retain_until
    assert [a.asset_id for a in ks.catalog.derived_from([src.memory_id])] == [m.memory_id]
    assert [a.asset_id for a in ks.catalog.mentioning(ks.subject_ref("carol"))] == [m.memory_id]


def test_consent_is_checked_in_the_storage_layer(ks: Keyshred) -> None:
    with pytest.raises(ConsentRequired):
        ks.memories.put("alice", NS, "k", 1, scope="support/health", category="health")
    ks.consent.grant("alice", scope="support/health", category="contact")
    with pytest.raises(ConsentRequired):  # consent for another category does not count
        ks.memories.put("alice", NS, "k", 1, scope="support/health", category="health")
    end = datetime.now(UTC) + timedelta(days=5)
    ks.consent.grant("alice", scope="support/health", category="health", end_at=end)
    m = ks.memories.put("alice", NS, "k", 1, scope="support/health", category="health")
    assert abs((m.retain_until - end).total_seconds()) < 1e-3  # consent end < 90 days
    ks.consent.revoke("alice", scope="support/health", category="health")
    with pytest.raises(ConsentRequired):
        ks.memories.put("alice", NS, "k2", 1, scope="support/health", category="health")


def test_retain_until_is_policy_not_caller(tmp_path: Path, catalog_url: str) -> None:
    soon = datetime.now(UTC) + timedelta(days=3)
    with Keyshred.init(tmp_path / "d", make_config(catalog_url, purpose_end=soon)) as ks:
        m = ks.memories.put("alice", NS, "k", 1, scope="marketing")
        assert m.retain_until == soon  # purpose end < legal 30 d < policy 365 d
        d = ks.memories.put("alice", NS, "d", 1)
        assert timedelta(days=3649) < d.retain_until - d.created_at <= timedelta(days=3650)
    with Keyshred.init(
        tmp_path / "e", make_config(catalog_url.replace("catalog.db", "e.db"))
    ) as ks:
        m = ks.memories.put("alice", NS, "k", 1, scope="marketing")
        assert m.retain_until - m.created_at == timedelta(days=30)  # legal max wins


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"scope": "nope"}, UnknownScope),
        ({"scope": "marketing", "category": "health"}, InvalidInput),
        ({"scope": "marketing", "purpose": "support"}, InvalidInput),
        ({"value": {1, 2}}, InvalidInput),
        ({"value": float("nan")}, InvalidInput),
        ({"value": "x" * (1024 * 1024)}, ValueTooLarge),
        ({"namespace": ()}, InvalidInput),
        ({"namespace": ("a", "")}, InvalidInput),
        ({"namespace": ("a", 3)}, InvalidInput),
        ({"key": ""}, InvalidInput),
        ({"sources": [""]}, InvalidInput),
    ],
)
def test_bad_input_is_typed_and_changes_nothing(
    ks: Keyshred, kwargs: dict[str, object], error: type[Exception]
) -> None:
    ks.memories.put("alice", NS, "existing", {"v": 1})
    args: dict[str, object] = {"namespace": NS, "key": "k", "value": {"ok": True}}
    args.update(kwargs)
    ns, key, value = args.pop("namespace"), args.pop("key"), args.pop("value")
    with pytest.raises(error):
        ks.memories.put("alice", ns, key, value, **args)  # type: ignore[arg-type]
    assert ks.memories.count("alice") == 1
    assert len(ks.catalog.assets(ks.subject_ref("alice"))) == 1


def test_batch_is_all_or_nothing(ks: Keyshred) -> None:
    items = [PutItem(NS, f"k{i}", i) for i in range(5)] + [PutItem(NS, "bad", {1})]
    with pytest.raises(InvalidInput):
        ks.memories.put_many("alice", items)
    assert ks.memories.count("alice") == 0
    got = ks.memories.put_many("alice", items[:5])
    assert len(got) == 5 and ks.memories.count("alice") == 5


def test_suppressed_subject_fails_reads_and_writes(ks: Keyshred) -> None:
    ks.memories.put("alice", NS, "k", 1)
    epoch = ks.deletion_epoch("alice")
    ks.catalog.suppress(ks.subject_ref("alice"))
    for call in (
        lambda: ks.memories.get("alice", NS, "k"),
        lambda: ks.memories.search("alice", NS),
        lambda: ks.memories.put("alice", NS, "k2", 2),
        lambda: ks.memories.delete("alice", NS, "k"),
    ):
        with pytest.raises(SubjectSuppressed):
            call()
    ks.catalog.set_guard(ks.subject_ref("alice"), "active")
    with pytest.raises(StaleEpoch):  # a job planned before the suppression
        ks.memories.put("alice", NS, "k3", 3, epoch=epoch)
    ks.memories.put("alice", NS, "k3", 3, epoch=ks.deletion_epoch("alice"))
    assert ks.memories.get("bob", NS, "k") is None  # others unaffected


def test_a_writer_that_finds_the_subject_erased_leaves_no_folder(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer past its first guard read when an erasure suppresses the subject and
    drops the partition: its check under the partition lock refuses, and the folder
    its lock re-made is gone again (the erasure's check finds no file left)."""
    from keyshred.storage.catalog import ACTIVE, GuardState

    ks.memories.put("alice", NS, "k", 1)
    ref = ks.subject_ref("alice")
    ks.erase("alice", requested_by="dpo", reason="test")
    path = ks.memories.partition_path(ref)
    assert not path.exists()
    # The catalog itself, not the handle's guarded view of it: undoing the patch on
    # the view would set the view's wrapper (which refuses once the handle closes) on
    # the catalog, and the fixture's close reads the guard through it.
    catalog = object.__getattribute__(ks.catalog, "_target")
    real = catalog.guard
    reads: list[str] = []

    def first_read_stale(subject_ref: str) -> GuardState:
        reads.append(subject_ref)
        return GuardState(ACTIVE, 0) if len(reads) == 1 else real(subject_ref)

    monkeypatch.setattr(catalog, "guard", first_read_stale)
    with pytest.raises(SubjectSuppressed):
        ks.memories.put("alice", NS, "k2", 2)
    assert len(reads) >= 2  # the second read, under the lock, refused
    assert not path.exists(), list(path.rglob("*"))
    # The same for the first key of a subject being erased (the vault's first token).
    with pytest.raises(SubjectSuppressed):
        ks.memories.first_key(ref, "default")
    assert not path.exists()


def test_persistence_across_reopen_and_compaction(tmp_path: Path, catalog_url: str) -> None:
    cfg = make_config(catalog_url, flush_records=7)
    with Keyshred.init(tmp_path / "d", cfg) as ks:
        ks.consent.grant("alice", scope="support/health", category="health")
        for i in range(40):
            scope = "support/health" if i % 4 == 0 else "default"
            cat = "health" if scope != "default" else None
            ks.memories.put("alice", NS, f"k{i}", {"i": i}, scope=scope, category=cat)
        ks.memories.delete("alice", NS, "k3")
        ref = ks.subject_ref("alice")
        part = ks.memories.partition_path(ref)
        with ks.catalog.engine.connect() as conn:
            listed = conn.execute(
                sa.select(memory_segments.c.name).where(memory_segments.c.subject_ref == ref)
            ).all()
    names = [p.name for p in files_of(part)]
    assert len([n for n in names if n.endswith(".parquet")]) == 2  # one per scope
    assert sorted(n for (n,) in listed) == sorted(names)  # the catalog names each one
    with Keyshred.open(tmp_path / "d", cfg) as ks:
        assert ks.memories.count("alice") == 39
        assert ks.memories.get("alice", NS, "k3") is None
        assert ks.memories.get("alice", NS, "k8").value == {"i": 8}  # type: ignore[union-attr]


def test_log_only_writes_survive_reopen(tmp_path: Path, catalog_url: str) -> None:
    cfg = make_config(catalog_url, flush_records=1000)
    ks = Keyshred.init(tmp_path / "d", cfg)
    for i in range(5):
        ks.memories.put("alice", NS, f"k{i}", i)
    part = ks.memories.partition_path(ks.subject_ref("alice"))
    assert not [p for p in files_of(part) if p.suffix == ".parquet"]
    ks.catalog.close()  # simulate a crash: no flush on close
    ks.keyring.close()
    with Keyshred.open(tmp_path / "d", cfg) as again:
        assert [again.memories.get("alice", NS, f"k{i}").value for i in range(5)] == list(range(5))  # type: ignore[union-attr]


@SEGMENTS
def test_plaintext_metadata_is_readable_without_keys(ks: Keyshred) -> None:
    for s in ("alice", "bob"):
        for i in range(3):
            ks.memories.put(s, NS, f"k{i}", {"secret": f"{s}-{i}"})
    ks.memories.flush()
    files = sorted(str(p) for p in (ks.path / "memories").rglob("*.parquet"))
    assert len(files) == 2
    table = pq.read_table(files[0], columns=["memory_id", "subject_ref", "retain_until", "status"])
    assert table.num_rows == 3
    with pytest.raises(OSError):
        pq.read_table(files[0], columns=["value"])  # encrypted: needs the subject's key
    rows = duckdb.sql(
        "SELECT subject_ref, count(*) AS n, min(retain_until) AS first_expiry "
        f"FROM read_parquet({files!r}) GROUP BY subject_ref ORDER BY subject_ref"
    ).fetchall()
    assert sorted(r[0] for r in rows) == sorted(ks.subject_ref(s) for s in ("alice", "bob"))
    assert all(r[1] == 3 for r in rows)


def test_values_are_json_text_in_namespace_order(ks: Keyshred) -> None:
    value = {"b": 1, "a": [True, False, None], "ü": "ß"}
    ks.memories.put("alice", NS, "k", value)
    assert json.dumps(ks.memories.get("alice", NS, "k").value) == json.dumps(value)  # type: ignore[union-attr]


def test_reads_create_no_keys_and_destroyed_keys_are_never_replaced(ks: Keyshred) -> None:
    ref = ks.subject_ref("nobody")
    assert ks.memories.get("nobody", NS, "k") is None
    assert ks.memories.search("nobody", NS) == []
    assert ks.keyring.store.for_subject(ref) == []
    # Crypto-erase a subject whose partition is loaded with unflushed rows: closing
    # must not write those rows out under a fresh key.
    ks.memories.put("alice", NS, "k", {"secret": "x"})
    alice = ks.subject_ref("alice")
    ks.keyring.destroy(alice)
    ks.memories.close()
    assert [r.scope for r in ks.keyring.store.for_subject(alice)] == []
    part = ks.memories.partition_path(alice)
    assert not list(part.glob("seg-*.parquet"))


@SEGMENTS
def test_a_dry_run_repair_writes_nothing(ks: Keyshred) -> None:
    """``repair`` without ``apply`` reports and changes nothing on disk: a subject
    with no partition folder (never stored, or its folder lost) gets none."""
    ks.memories.put("nia", NS, "k", {"text": "nia"})
    ks.memories.flush("nia")  # into a segment object
    ref = ks.subject_ref("nia")
    shutil.rmtree(ks.memories.partition_path(ref))  # the folder is lost
    never = ks.subject_ref("never-stored")
    before = sorted(p.name for p in ks.memories.partition_path(ref).parent.iterdir())

    lost = ks.memories.repair(ref)
    clean = ks.memories.repair(never)

    assert len(lost.lost) == 1 and not lost.applied
    assert clean.clean
    after = sorted(p.name for p in ks.memories.partition_path(ref).parent.iterdir())
    assert after == before
    forgot = ks.memories.repair(ref, apply=True, forget_lost=True)  # applying may write
    assert forgot.ok and forgot.forgot_lost


def test_old_layout_files_beside_an_imported_partition_are_removed_not_read(
    ks: Keyshred,
) -> None:
    """Files of the layout before issue #21 left beside a partition the catalog
    already holds (an import killed after its commit) are what is left of that
    import: removed at the next load under the subject lock, never read, and the
    catalog's rows stay as they are (tests/storage/test_legacy_import.py imports
    real folders of that release). A get that the catalog's hot rows answer loads
    nothing and leaves them to that load."""
    ks.memories.put("olga", NS, "k", 1)
    ref = ks.subject_ref("olga")
    ks.memories.evict(ref)
    folder = ks.memories.partition_path(ref)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "MANIFEST").write_text('{"gen": 1, "segments": {}}')
    (folder / "LOCK").write_bytes(b"")
    got = ks.memories.get("olga", NS, "k")
    assert got is not None and got.value == 1
    assert (folder / "MANIFEST").exists()  # the get read the catalog alone
    assert [m.value for m in ks.memories.search("olga", NS)] == [1]  # a load
    assert not (folder / "MANIFEST").exists() and not (folder / "LOCK").exists()
