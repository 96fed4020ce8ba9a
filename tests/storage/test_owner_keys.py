"""Rows sealed under owner-set keys (issue 19, items 1, 2 and 5's asset list), on
both catalogs: a memory that mentions another subject, or a derived asset built from
other subjects' memories, carries its values under the key of every subject it is
about, in the segment, the hot rows, the vectors and every backup generation; erasing any
owner makes exactly those rows unreadable everywhere. Provenance survives every
write path (update, correct, flush, restore, export)."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa

from keyshred import Keyshred
from keyshred.errors import IntegrityError, SubjectErased
from keyshred.keyring.envelope import Place
from keyshred.receipts import load_receipt, verify_receipt
from keyshred.storage.partition import decode_record, hot_place
from keyshred.storage.schema import memory_hot
from keyshred.storage.sealer import KeyringSealer
from tests.storage.conftest import make_config, parquet_config, stored_rows
from tests.storage.test_vectors import bag_of_words

NS = ("notes",)
_MAGIC = b"KS\x01"  # an envelope ciphertext (a JSON value never starts with "K")


@pytest.fixture
def ks(catalog_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Keyshred]:
    config = parquet_config if getattr(request, "param", "") == "segments" else make_config
    store = Keyshred.init(tmp_path / "data", config(catalog_url), embeddings=bag_of_words)
    yield store
    store.close()


# The test reads a backup's copy of segment objects (a partition this small is
# otherwise compacted into the catalog, a row of the backup's catalog snapshot).
SEGMENTS = pytest.mark.parametrize("ks", ["segments"], indirect=True)


def summarize(sources: list[Any]) -> str:
    return " | ".join(sorted(json.dumps(m.value, sort_keys=True) for m in sources))


def _row_plaintext(ks: Keyshred, ref: str, scope: str, memory_id: str, value: bytes) -> bytes:
    """A stored value as the live keyring yields it: plaintext JSON as it is, a
    sealed row opened (``SubjectErased`` if its key was destroyed)."""
    if value[: len(_MAGIC)] != _MAGIC:
        return value
    return ks.keyring.open(value, Place(ref, scope, "memories", memory_id, "row"))


def decrypt_partition_files(ks: Keyshred, folder: Path, ref: str) -> tuple[list[bytes], int]:
    """Every value every file of a partition folder (its segments, old versions
    included) and, for the live folder, every hot row of the catalog yields to the
    live keyring: (plaintexts, values whose key is destroyed). Hot rows are read
    record by record, so a superseded version counts too."""
    plain: list[bytes] = []
    erased = 0

    def take(scope: str, memory_id: str, value: bytes) -> None:
        nonlocal erased
        try:
            plain.append(_row_plaintext(ks, ref, scope, memory_id, value))
        except SubjectErased:
            erased += 1

    pme = ks.memories._pme
    assert pme is not None
    for path in sorted(folder.glob("seg-*.parquet")):
        table = pq.ParquetFile(path, decryption_properties=pme.decryption()).read()
        for mid, scope, value in zip(
            table.column("memory_id").to_pylist(),
            table.column("scope").to_pylist(),
            table.column("value").to_pylist(),
            strict=True,
        ):
            take(scope, mid, value)
    if folder != ks.memories.partition_path(ref):
        return plain, erased
    sealer = KeyringSealer(ks.keyring)
    with ks.catalog.engine.connect() as conn:
        hot = conn.execute(sa.select(memory_hot).where(memory_hot.c.subject_ref == ref)).all()
    for r in hot:
        try:
            payload = sealer.open(bytes(r.record), hot_place(ref, r.scope, int(r.seq)))
        except SubjectErased:
            erased += 1
            continue
        op, rows = decode_record(payload)
        if op == "put":
            for row in rows:
                take(r.scope, row.memory_id, row.value)
    return plain, erased


def _found(probe: str, values: list[bytes]) -> int:
    return sum(1 for v in values if probe.encode() in v)


def _scenario(ks: Keyshred, probe: str) -> dict[str, Any]:
    """The issue's subjects: the victim's memories, bob's summary of the victim's
    and bob's memories, carol's fact that mentions the victim, everything flushed."""
    victim = f"victim-{probe}@example.org"
    mine = ks.memories.put(victim, NS, "phone", {"text": f"{probe} phone kayak"}, index=["text"])
    bobs = ks.memories.put("bob", NS, "b", {"text": "bob likes chess"}, index=["text"])
    summary = ks.derived.register(
        "summary",
        subject="bob",
        namespace=("shared",),
        key="summary",
        value=f"{probe} kayak and chess",
        produced_from=[mine.memory_id, bobs.memory_id],
        producer="summarizer",
        producer_version="1",
        rebuild=summarize,
        index=True,
    )
    edge = ks.memories.put("carol", ("facts",), "edge", f"carol met {probe}", mentions=[victim])
    own = ks.memories.put("carol", ("facts",), "own", "carol likes tea")
    ks.memories.flush()
    return {"victim": victim, "summary": summary, "edge": edge, "own": own, "bobs": bobs}


# -- the findings ------------------------------------------------------------------


@pytest.mark.parametrize("how", ["update", "correct"])
def test_an_updated_mention_is_still_erased_with_the_mentioned_subject(
    ks: Keyshred, how: str
) -> None:
    """Finding 1: ``update`` (and ``correct``) re-put the memory without its
    mentions, so the victim's erasure missed dave's fact and the phone stayed."""
    victim, phone = "victim@example.org", "+44 7700 900123"
    ks.memories.put(victim, NS, "own", "the victim's own note")
    ks.memories.put("dave", ("facts",), "contact", {"phone": phone}, mentions=[victim])
    if how == "update":
        m = ks.memories.update("dave", ("facts",), "contact", {"phone": phone, "seen": 2})
    else:
        m = ks.memories.correct("dave", ("facts",), "contact", {"phone": phone}, reason="typo")
    req = ks.erase(victim, requested_by="dpo", reason="gdpr-art17")
    assert req.state == "completed", req.error
    assert ks.memories.get("dave", ("facts",), "contact") is None  # the phone is gone
    assert m.mentions == (ks.subject_ref(victim),)
    # The superseded version of a correction mentions the victim as well: gone too.
    assert ks.memories.history("dave", ("facts",), "contact") == []
    receipt = ks.erasure.receipt(req.request_id)
    assert receipt is not None and m.memory_id in {d.asset_id for d in receipt.derived}


def test_the_rebuilt_summary_and_the_dropped_fact_are_unreadable_in_live_files(
    ks: Keyshred,
) -> None:
    """Finding 2, live: after the erasure rebuilt bob's summary, the old version stayed
    in bob's segment and log under bob's key; carol's dropped fact likewise."""
    probe = f"zq{uuid.uuid4().hex[:10]}"
    s = _scenario(ks, probe)
    # Both are flushed under the shared key; a second write leaves a log record too.
    req = ks.erase(s["victim"], requested_by="dpo", reason="gdpr-art17")
    assert req.state == "completed", req.error
    for subject in ("bob", "carol"):
        ref = ks.subject_ref(subject)
        plain, _ = decrypt_partition_files(ks, ks.memories.partition_path(ref), ref)
        assert _found(probe, plain) == 0, subject
        assert plain  # their own rows still decrypt
    rebuilt = ks.memories.get("bob", ("shared",), "summary")
    assert rebuilt is not None and "bob likes chess" in rebuilt.value and probe not in rebuilt.value


@SEGMENTS
def test_the_pre_erasure_backup_yields_nothing_of_the_victim_to_the_live_keyring(
    ks: Keyshred, tmp_path: Path
) -> None:
    """Finding 2, backups: bob's summary (and its vector) and carol's fact, taken into
    a backup before the erasure, decrypted with the live keyring afterwards."""
    probe = f"zq{uuid.uuid4().hex[:10]}"
    s = _scenario(ks, probe)
    ks.memories.put("bob", NS, "later", "a log record too", mentions=[s["victim"]])
    gen = ks.backup.create()
    req = ks.erase(s["victim"], requested_by="dpo", reason="gdpr-art17")
    assert req.state == "completed", req.error
    # As in the finding: the live KEK rotated and every older epoch destroyed.
    rotated = ks.keyring.rotate_kek()
    ks.keyring.destroy_kek_epochs_before(rotated.new_epoch, force=True)

    target = ks.backup.target()
    copy = tmp_path / "copy"
    for seg in ks.backup.manifest(gen.generation).segments:
        if seg.subject_ref == ks.subject_ref(s["victim"]):
            continue  # deleted from the target by the erasure
        dst = copy / seg.path
        dst.parent.mkdir(parents=True, exist_ok=True)
        target.get_file(seg.object, dst)
    for subject, own in (("bob", 1), ("carol", 1)):
        ref = ks.subject_ref(subject)
        plain, erased = decrypt_partition_files(ks, copy / "memories" / f"subject={ref}", ref)
        assert _found(probe, plain) == 0, subject
        assert erased >= 1, subject  # the shared-key rows: SubjectErased
        assert len([v for v in plain if probe.encode() not in v]) >= own  # bob's own
    # bob's vectors (rows of the generation's catalog snapshot): the summary's under
    # the destroyed shared key, bob's own live.
    import sqlite3

    bob = ks.subject_ref("bob")
    snapshot = copy / "catalog.db"
    target.get_file(ks.backup.manifest(gen.generation).catalog.object, snapshot)
    with contextlib.closing(sqlite3.connect(snapshot)) as db:
        rows = db.execute(
            "SELECT vec_id, scope, vec FROM ks_mem_vectors WHERE subject_ref = ? ORDER BY vec_id",
            (bob,),
        ).fetchall()
    dead, live = [], []
    for vec_id, scope, vec in rows:
        try:
            ks.keyring.open(vec, Place(bob, scope, "vectors", vec_id, "embedding"))
            live.append(vec_id)
        except SubjectErased:
            dead.append(vec_id)
    assert dead == [f"{s['summary'].memory_id}/0"]
    assert live == [f"{s['bobs'].memory_id}/0"]


# -- opaque rows -------------------------------------------------------------------


def test_a_row_whose_shared_key_is_destroyed_is_opaque_not_corrupt(ks: Keyshred) -> None:
    """The key of dave's row that mentions the victim is destroyed (the victim's
    keys, as the erasure's first step does): dave's partition still loads; the row is
    in no read, search, count or export, stays in the files byte for byte through a
    flush, and deleting it by id works without its key."""
    victim = "victim@example.org"
    ks.memories.put(victim, NS, "own", "x")
    shared = ks.memories.put(
        "dave", NS, "m", {"text": "victim sails kayaks"}, mentions=[victim], index=["text"]
    )
    ks.memories.put("dave", NS, "own", {"text": "dave sails kayaks"}, index=["text"])
    ks.memories.flush()
    dave = ks.subject_ref("dave")
    ks.keyring.destroy(ks.subject_ref(victim))
    ks.memories.evict(dave)
    ks.vectors.evict(dave)
    ks.keyring.cache.clear()

    assert ks.memories.get("dave", NS, "m") is None
    assert ks.memories.count("dave") == 1
    assert [m.key for m in ks.memories.search("dave", NS)] == ["own"]
    hits = ks.memories.search("dave", NS, query="kayaks", limit=5)
    assert [h.key for h in hits] == ["own"]
    assert ks.vectors.count(dave) == 1
    # The bytes of the opaque row are carried over by a flush, never re-sealed.
    ks.memories.put("dave", NS, "another", "forces a rewrite")
    before = _sealed_values(ks, dave)
    ks.memories.flush()
    after = _sealed_values(ks, dave)
    assert before[shared.memory_id] == after[shared.memory_id]
    # Reopening (the catalog check) still holds: the asset is in the files, and
    # repair finds nothing to reconcile.
    ks.memories.evict(dave)
    assert ks.memories.count("dave") == 2
    assert ks.memories.repair(dave).clean
    assert ks.memories.delete_by_id(dave, shared.memory_id)
    assert shared.memory_id not in _sealed_values(ks, dave)
    assert ks.catalog.asset(shared.memory_id) is None
    ks.memories.evict(dave)
    assert ks.memories.count("dave") == 2


def _sealed_values(ks: Keyshred, ref: str) -> dict[str, bytes]:
    """Each memory's value as stored (a sealed row: its ciphertext), the latest
    version of each: from the partition's segments, then its hot records."""
    return dict(stored_rows(ks, ref))


def test_rows_of_one_owner_set_share_one_key_and_own_rows_use_the_scope_key(
    ks: Keyshred,
) -> None:
    victim = "victim@example.org"
    a = ks.memories.put("dave", NS, "a", "one", mentions=[victim])
    b = ks.memories.put("dave", NS, "b", "two", mentions=[victim])
    c = ks.memories.put("dave", NS, "c", "three")
    d = ks.memories.put("dave", NS, "d", "four", mentions=[victim, "eve"])
    ks.memories.flush()
    values = _sealed_values(ks, ks.subject_ref("dave"))
    key_a, key_b, key_d = (values[m.memory_id][4:20] for m in (a, b, d))
    assert values[a.memory_id][:3] == _MAGIC
    assert key_a == key_b != key_d
    assert values[c.memory_id] == b'"three"'  # the holder's own row: PME only
    # Keys grow with distinct owner sets, not with rows: two shared keys here.
    assert ks.keyring.store.counts()["shared"] == 2
    owners = ks.keyring.owners_of([key_a, key_d])
    assert owners[key_a] == (ks.subject_ref(victim),)
    assert set(owners[key_d]) == {ks.subject_ref(victim), ks.subject_ref("eve")}


def test_a_derived_asset_is_owned_by_the_owners_of_its_sources_transitively(
    ks: Keyshred,
) -> None:
    """bob's summary built from carol's fact that mentions the victim, and a second
    summary built from the first: both sealed under keys the victim owns."""
    victim = "victim@example.org"
    fact = ks.memories.put("carol", NS, "f", "carol met the victim", mentions=[victim])
    first = ks.derived.register(
        "summary",
        subject="bob",
        namespace=("s",),
        key="one",
        value="s1",
        produced_from=[fact.memory_id],
        producer="p",
        producer_version="1",
    )
    second = ks.derived.register(
        "summary",
        subject="dave",
        namespace=("s",),
        key="two",
        value="s2",
        produced_from=[first.memory_id],
        producer="p",
        producer_version="1",
    )
    ks.memories.flush()
    ref = ks.subject_ref
    # A mention owns as the person (ref); a source's holder through its scope's data
    # (ref@scope), so withdrawing that scope destroys what was derived from it.
    for subject, m, expect in (
        ("bob", first, {ref(victim), f"{ref('carol')}@default"}),
        ("dave", second, {ref(victim), f"{ref('carol')}@default", f"{ref('bob')}@default"}),
    ):
        value = _sealed_values(ks, ks.subject_ref(subject))[m.memory_id]
        owners = ks.keyring.owners_of([value[4:20]])[value[4:20]]
        assert set(owners) == expect


# -- provenance through every write path -------------------------------------------


def test_update_keeps_provenance_unless_replaced(ks: Keyshred) -> None:
    src = ks.memories.put("bob", NS, "src", "s")
    ks.memories.put("dave", NS, "k", "v", sources=[src.memory_id], mentions=["eve"])
    kept = ks.memories.update("dave", NS, "k", "v2")
    assert kept.sources == (src.memory_id,) and kept.mentions == (ks.subject_ref("eve"),)
    replaced = ks.memories.update("dave", NS, "k", "v3", mentions=["frank"])
    assert replaced.mentions == (ks.subject_ref("frank"),)
    assert replaced.sources == (src.memory_id,)
    assert [a.asset_id for a in ks.catalog.mentioning(ks.subject_ref("frank"))] == [
        replaced.memory_id
    ]
    assert ks.catalog.mentioning(ks.subject_ref("eve")) == []


def test_correct_keeps_provenance_on_the_value_and_its_history(ks: Keyshred) -> None:
    src = ks.memories.put("bob", NS, "src", "s")
    ks.memories.put("dave", NS, "k", "v", sources=[src.memory_id], mentions=["eve"])
    current = ks.memories.correct("dave", NS, "k", "v2", reason="typo")
    assert current.sources == (src.memory_id,)
    assert current.mentions == (ks.subject_ref("eve"),)
    mentioning = {a.asset_id: a for a in ks.catalog.mentioning(ks.subject_ref("eve"))}
    assert len(mentioning) == 2 and current.memory_id in mentioning
    (history_id,) = set(mentioning) - {current.memory_id}
    assert mentioning[history_id].sources == (src.memory_id,)


def test_flush_keeps_provenance(ks: Keyshred, tmp_path: Path) -> None:
    src = ks.memories.put("bob", NS, "src", "s")
    m = ks.memories.put("dave", NS, "k", "v", sources=[src.memory_id], mentions=["eve"])
    ks.memories.flush()
    dave = ks.subject_ref("dave")
    value = _sealed_values(ks, dave)[m.memory_id]
    assert value[:3] == _MAGIC  # sealed in the segment, not only in the log
    ks.memories.evict(dave)
    got = ks.memories.get("dave", NS, "k")
    assert got is not None and got.value == "v"
    assert got.sources == (src.memory_id,) and got.mentions == (ks.subject_ref("eve"),)


def test_restore_keeps_provenance_and_the_shared_keys(ks: Keyshred, tmp_path: Path) -> None:
    victim = "victim@example.org"
    src = ks.memories.put(victim, NS, "src", "s")
    m = ks.memories.put("dave", NS, "k", "v", sources=[src.memory_id], mentions=["eve"])
    gen = ks.backup.create()
    ks.backup.restore(gen.generation, tmp_path / "restored")
    r = Keyshred.open(tmp_path / "restored", embeddings=bag_of_words)
    try:
        got = r.memories.get("dave", NS, "k")
        assert got is not None and got.value == "v"
        assert got.sources == (src.memory_id,) and got.mentions == (r.subject_ref("eve"),)
        assert [a.asset_id for a in r.catalog.mentioning(r.subject_ref("eve"))] == [m.memory_id]
        # Erasing the victim in the restored copy reaches dave's derived row.
        req = r.erase(victim, requested_by="dpo", reason="gdpr-art17")
        assert req.state == "completed", req.error
        assert r.memories.get("dave", NS, "k") is None
    finally:
        r.close()


def test_export_keeps_provenance_and_leaves_out_opaque_rows(ks: Keyshred, tmp_path: Path) -> None:
    from keyshred.export import open_export

    src = ks.memories.put("bob", NS, "src", "s")
    m = ks.memories.put("dave", NS, "k", "v", sources=[src.memory_id], mentions=["eve"])
    ks.memories.put("dave", NS, "gone", "about victim", mentions=["victim"])
    ks.keyring.destroy(ks.subject_ref("victim"))
    ks.memories.evict(ks.subject_ref("dave"))
    result = ks.export("dave", tmp_path / "dave.ksx", passphrase="correct horse battery")
    files = open_export(
        ks, (tmp_path / "dave.ksx").read_bytes(), passphrase="correct horse battery"
    )
    assert result.counts["memories"] == 1
    (row,) = files["memories.json"]
    assert row["memory_id"] == m.memory_id
    assert row["sources"] == [src.memory_id]
    assert row["mentions"] == [ks.subject_ref("eve")]


# -- the receipt -------------------------------------------------------------------


def test_the_receipt_lists_the_shared_keys_and_the_assets_they_made_unreadable(
    ks: Keyshred,
) -> None:
    probe = f"zq{uuid.uuid4().hex[:10]}"
    s = _scenario(ks, probe)
    req = ks.erase(s["victim"], requested_by="dpo", reason="gdpr-art17")
    assert req.state == "completed", req.error
    receipt = ks.erasure.receipt(req.request_id)
    assert receipt is not None
    verify_receipt(receipt, ks.keyring.signer().public_key)
    by_holder = {k.holder_subject_ref: k for k in receipt.shared_keys}
    assert set(by_holder) == {ks.subject_ref("bob"), ks.subject_ref("carol")}
    assert by_holder[ks.subject_ref("bob")].assets == [s["summary"].memory_id]
    assert by_holder[ks.subject_ref("carol")].assets == [s["edge"].memory_id]
    assert all(k.key_id in receipt.key_ids for k in receipt.shared_keys)
    actions = {d.asset_id: d.action for d in receipt.derived}
    assert actions == {s["summary"].memory_id: "rebuilt", s["edge"].memory_id: "dropped"}
    again = load_receipt(receipt.serialize())
    verify_receipt(again, ks.keyring.signer().public_key)
    assert probe not in receipt.to_json()


def test_a_receipt_from_before_shared_keys_still_verifies(ks: Keyshred) -> None:
    from tests.receipt_forms import sign_json_form

    ks.memories.put("dave", NS, "k", "v")
    req = ks.erase("dave", requested_by="dpo", reason="gdpr-art17")
    receipt = ks.erasure.receipt(req.request_id)
    assert receipt is not None and receipt.shared_keys == []
    old = receipt.model_copy(update={"shared_keys": None, "signature": None})
    doc = json.loads(sign_json_form(old, ks.keyring.signer()).to_json())
    del doc["shared_keys"]  # as a receipt signed before the field existed
    verify_receipt(load_receipt(json.dumps(doc)), ks.keyring.signer().public_key)
    doc["key_ids"] = []
    with pytest.raises(IntegrityError):
        verify_receipt(load_receipt(json.dumps(doc)), ks.keyring.signer().public_key)


def test_backup_coverage_counts_a_subject_that_only_co_owns_keys(ks: Keyshred) -> None:
    """A subject that never stored anything itself but is mentioned by dave: the
    generation holds a key it co-owns, so the receipt's backup dates cover it."""
    ks.memories.put("dave", NS, "m", "about the victim", mentions=["victim@example.org"])
    gen = ks.backup.create()
    req = ks.erase("victim@example.org", requested_by="dpo", reason="gdpr-art17")
    assert req.state == "completed", req.error
    receipt = ks.erasure.receipt(req.request_id)
    assert receipt is not None
    assert receipt.backups.generations == [gen.generation]
    assert receipt.backups.epoch_destroyed_by is not None


def test_an_export_is_unreadable_once_a_subject_it_is_about_is_erased(
    ks: Keyshred, tmp_path: Path
) -> None:
    """dave's export holds his fact about the victim: the package's key is co-owned
    by the victim, so the victim's erasure makes every copy of it unreadable."""
    from keyshred.export import open_export

    ks.memories.put("victim@example.org", NS, "own", "x")
    ks.memories.put("dave", NS, "m", "the victim's phone", mentions=["victim@example.org"])
    ks.memories.put("eve", NS, "own", "eve's own")
    for who in ("dave", "eve"):
        ks.export(who, tmp_path / f"{who}.ksx", passphrase="correct horse battery")
    req = ks.erase("victim@example.org", requested_by="dpo", reason="gdpr-art17")
    assert req.state == "completed", req.error
    with pytest.raises(SubjectErased):
        open_export(ks, (tmp_path / "dave.ksx").read_bytes(), passphrase="correct horse battery")
    files = open_export(ks, (tmp_path / "eve.ksx").read_bytes(), passphrase="correct horse battery")
    assert [m["key"] for m in files["memories.json"]] == ["own"]


def test_an_opaque_row_is_deleted_by_its_name_without_its_key(ks: Keyshred) -> None:
    ks.memories.put("victim@example.org", NS, "own", "x")
    m = ks.memories.put("dave", NS, "m", "about the victim", mentions=["victim@example.org"])
    ks.keyring.destroy(ks.subject_ref("victim@example.org"))
    dave = ks.subject_ref("dave")
    ks.memories.evict(dave)
    ks.keyring.cache.clear()
    assert ks.memories.get("dave", NS, "m") is None
    assert ks.memories.delete("dave", NS, "m")
    assert ks.catalog.asset(m.memory_id) is None
    ks.memories.evict(dave)
    assert ks.memories.rows_by_id(dave, [m.memory_id], opaque=True) == {}


def test_a_sealed_row_moved_or_under_another_holders_key_raises(ks: Keyshred) -> None:
    """Tampering raises: a sealed row's ciphertext is bound to its holder, scope and
    memory id, and its key must be the holder's own for that scope."""
    from dataclasses import replace

    from keyshred.storage.partition import seal_row

    a = ks.memories.put("dave", NS, "a", "one", mentions=["eve"])
    b = ks.memories.put("dave", NS, "b", "two", mentions=["eve"])
    dave = ks.subject_ref("dave")
    part = ks.memories._partition(dave)
    rows = ks.memories.rows_by_id(dave, [a.memory_id, b.memory_id])
    moved = replace(rows[b.memory_id], sealed=rows[a.memory_id].sealed)
    with pytest.raises(IntegrityError):
        part._unseal([moved])
    frank = ks.keyring.data_key(ks.subject_ref("frank"), "default", owners=[ks.subject_ref("eve")])
    foreign = seal_row(frank, ks.subject_ref("frank"), rows[a.memory_id])
    with pytest.raises(IntegrityError):
        part._unseal([replace(rows[a.memory_id], sealed=foreign.sealed)])
    assert [r.value for r in part._unseal([rows[a.memory_id]])] == [b'"one"']


@SEGMENTS
def test_a_scope_erasure_destroys_the_keys_of_what_was_derived_from_that_scope(
    ks: Keyshred, tmp_path: Path
) -> None:
    """A summary built from the victim's health scope is co-owned by the victim's
    data *in that scope* (``ref@scope``): withdrawing the scope destroys its key, so
    its old version is unreadable live and in a pre-erasure backup, while a mention
    of the victim (about the person, not a scope) and the victim's other scopes stay."""
    probe = f"zq{uuid.uuid4().hex[:10]}"
    victim = "victim@example.org"
    ks.consent.grant(victim, scope="support/health", category="health")
    health = ks.memories.put(
        victim, NS, "h", f"{probe} asthma", scope="support/health", category="health"
    )
    other = ks.memories.put(victim, NS, "o", "likes chess")
    summary = ks.derived.register(
        "summary",
        subject="bob",
        namespace=("s",),
        key="sum",
        value=f"{probe} and chess",
        produced_from=[health.memory_id, other.memory_id],
        producer="summarizer",
        producer_version="1",
        rebuild=summarize,
    )
    ks.memories.put("carol", NS, "met", "carol met the victim", mentions=[victim])
    ks.memories.flush()
    gen = ks.backup.create()
    summary_key = _sealed_values(ks, ks.subject_ref("bob"))[summary.memory_id][4:20]
    req = ks.erase(victim, scope="support/health", requested_by="dpo", reason="withdrawn")
    assert req.state == "completed", req.error
    with pytest.raises(SubjectErased):
        ks.keyring.data_key_by_id(summary_key)
    receipt = ks.erasure.receipt(req.request_id)
    assert receipt is not None and receipt.shared_keys
    assert {k.key_id for k in receipt.shared_keys} == {summary_key.hex()}
    bob = ks.subject_ref("bob")
    plain, _ = decrypt_partition_files(ks, ks.memories.partition_path(bob), bob)
    assert _found(probe, plain) == 0
    rebuilt = ks.memories.get("bob", ("s",), "sum")
    assert rebuilt is not None and rebuilt.value == '"likes chess"'
    # The victim's other scope and carol's mention of the victim are untouched.
    assert ks.memories.get(victim, NS, "o") is not None
    assert ks.memories.get("carol", NS, "met") is not None
    # The pre-erasure backup's copy of bob's partition: the old summary is dead.
    target = ks.backup.target()
    copy = tmp_path / "copy"
    for seg in ks.backup.manifest(gen.generation).segments:
        if seg.subject_ref == bob:
            dst = copy / seg.path
            dst.parent.mkdir(parents=True, exist_ok=True)
            target.get_file(seg.object, dst)
    plain, erased = decrypt_partition_files(ks, copy / "memories" / f"subject={bob}", bob)
    assert _found(probe, plain) == 0 and erased >= 1


# -- writes about a subject being erased ------------------------------------------


def test_a_write_about_a_suppressed_or_erased_subject_is_refused(ks: Keyshred) -> None:
    """Data about a subject whose erasure is under way (or done) gets no new key: a
    key made after the erasure destroyed the subject's keys would outlive it."""
    from keyshred.errors import SubjectSuppressed

    victim = "victim@example.org"
    ks.memories.put(victim, NS, "own", "the victim's own note")
    vref = ks.subject_ref(victim)
    ks.catalog.suppress(vref)
    with pytest.raises(SubjectSuppressed) as err:
        ks.memories.put("dave", ("facts",), "met", "dave met v", mentions=[victim])
    assert victim not in str(err.value)
    assert ks.keyring.store.counts()["shared"] == 0  # no key was made about the victim
    assert ks.memories.get("dave", ("facts",), "met") is None
    ks.memories.put("dave", ("facts",), "other", "dave's own note")  # dave still writes
    ks.catalog.set_guard(vref, "erased")
    with pytest.raises(SubjectSuppressed):
        ks.memories.put("dave", ("facts",), "met", "dave met v", mentions=[victim])


def test_the_catalog_refuses_a_mention_recorded_after_the_suppression(ks: Keyshred) -> None:
    """The race the seal-time check cannot close: a writer past that check whose
    catalog transaction comes after the suppression is refused there, and the put
    is undone."""
    from keyshred.errors import SubjectSuppressed

    victim = "victim@example.org"
    vref = ks.subject_ref(victim)
    real = ks.catalog.check_guard
    calls = {"n": 0}

    def late(ref: str, *args: Any, **kwargs: Any) -> int:
        epoch = real(ref, *args, **kwargs)
        if ref == vref and calls["n"] == 0:
            calls["n"] += 1
            ks.catalog.suppress(vref)  # lands between the check and the commit
        return epoch

    ks.catalog.check_guard = late  # type: ignore[method-assign]
    try:
        with pytest.raises(SubjectSuppressed):
            ks.memories.put("dave", ("facts",), "met", "dave met v", mentions=[victim])
    finally:
        ks.catalog.check_guard = real  # type: ignore[method-assign]
    assert calls["n"] == 1
    assert ks.memories.get("dave", ("facts",), "met") is None
    assert not ks.catalog.mentioning(vref)


def test_the_erasure_sweeps_a_key_made_about_the_subject_after_destroy(ks: Keyshred) -> None:
    """A shared key created after ``destroy_keys`` (a writer that passed every guard
    check before the suppression) is destroyed by the verify step, and the check
    says so."""
    victim = "victim@example.org"
    ks.memories.put(victim, NS, "own", "the victim's own note")
    vref, dref = ks.subject_ref(victim), ks.subject_ref("dave")
    made: dict[str, bytes] = {}

    def after(step: str, req: Any) -> None:
        if step == "destroy_keys":
            made["key"] = ks.keyring.data_key(dref, "default", owners=[vref]).key_id

    ks.erasure.on_step = after
    try:
        req = ks.erase(victim, requested_by="dpo", reason="gdpr-art17")
    finally:
        ks.erasure.on_step = None
    assert req.state == "completed", req.error
    assert made["key"].hex() in req.doc["swept_keys"]
    with pytest.raises(SubjectErased):
        ks.keyring.data_key_by_id(made["key"])
    receipt = ks.erasure.receipt(req.request_id)
    assert receipt is not None
    check = next(c for c in receipt.verification if c.name.startswith("no key held"))
    assert check.passed and "1 made during the erasure" in check.detail


def _erase(ks: Keyshred, subject: str, scope: str | None = None) -> None:
    req = ks.erase(subject, scope, requested_by="dpo", reason="art17")
    assert req.state == "completed", req.error


def test_a_memory_moved_to_another_scope_survives_the_erasure_of_its_old_owners(
    catalog_url: str, tmp_path: Path
) -> None:
    # k4 is written in "marketing" under a key erin and frank co-own, compacted, then
    # rewritten in "default" about nobody. frank's erasure reloads dave's partition
    # and compacts: the old scope must be rewritten too, or its segment keeps the old
    # version (opaque now), which a later load read over the new one; hal's erasure
    # then dropped k4, and the scope erasure failed with IntegrityError.
    cfg = parquet_config(catalog_url, flush_records=5)
    with Keyshred.init(tmp_path / "data", cfg, embeddings=bag_of_words) as ks:
        m = ks.memories
        m.put("dave", NS, "k3", "about gus and hal", mentions=["gus", "hal"])
        m.put("dave", NS, "k4", "old", mentions=["erin", "frank"], scope="marketing",
              category="preference")  # fmt: skip
        m.flush("dave")
        m.put("dave", NS, "k4", "moved")
        m.put("dave", NS, "k0", "about gus and frank", mentions=["gus", "frank"])
        for subject in ("frank", "hal"):
            _erase(ks, subject)
            assert m.get("dave", NS, "k4").value == "moved"  # type: ignore[union-attr]
        _erase(ks, "dave", "marketing")
        ref = ks.subject_ref("dave")
        m._partition(ref).close()
        assert m.get("dave", NS, "k4").value == "moved"  # type: ignore[union-attr]
        assert m.get("dave", NS, "k3") is None and m.get("dave", NS, "k0") is None
        assert {s.scope for s in m._hot.state(ref, since=None)[1] or []} == {"default"}


def test_a_store_holding_a_moved_memory_in_two_segments_reads_the_newer_one(
    catalog_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A store written before the fix: the move left the old version in the old
    # scope's segment beside the new one. The newer version is read whatever the
    # order of the segments, and the next compaction rewrites the old scope.
    from keyshred.storage.partition import Partition

    real = Partition._keep

    def keep_as_before(self: Partition, row: Any) -> None:
        dirty = set(self._dirty)
        real(self, row)
        self._dirty = dirty  # a move left the old scope clean

    with Keyshred.init(tmp_path / "data", parquet_config(catalog_url)) as ks:
        m, ref = ks.memories, ks.subject_ref("dave")
        with monkeypatch.context() as patched:
            patched.setattr(Partition, "_keep", keep_as_before)
            patched.setattr(Partition, "_keep_stored", keep_as_before)
            m.put("dave", NS, "k4", "old", scope="marketing", category="preference")
            m.flush("dave")
            m.put("dave", NS, "k4", "moved")
            m.flush("dave")
        assert {s.scope for s in m._hot.state(ref, since=None)[1] or []} == {
            "default",
            "marketing",
        }
        m._partition(ref).close()
        assert m.get("dave", NS, "k4").value == "moved"  # type: ignore[union-attr]
        m.flush("dave")
        assert {s.scope for s in m._hot.state(ref, since=None)[1] or []} == {"default"}
        m._partition(ref).close()
        assert m.get("dave", NS, "k4").value == "moved"  # type: ignore[union-attr]
