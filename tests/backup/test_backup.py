"""Backups end to end: generations, restore with tombstone replay, a returning
subject, the key-store backup attack and the date that ends it, tampering,
interruptions, consistency under writers, retention."""

from __future__ import annotations

import base64
import json
import shutil
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from keyshred import Keyshred
from keyshred.backup import LocalTarget, Manifest
from keyshred.backup.manager import BackupManager
from keyshred.config import BackupSettings, Config, save_config
from keyshred.errors import (
    EpochInUse,
    IntegrityError,
    KekEpochDestroyed,
    SubjectErased,
    SubjectSuppressed,
    UnknownToken,
)
from keyshred.keyring.kek import WrappedKey
from keyshred.keyring.keystore import SQLiteKeyStore
from tests.conftest import pg_schema
from tests.storage.conftest import make_config, parquet_config
from tests.storage.test_vectors import bag_of_words

NS = ("notes",)


def config(catalog_url: str | None = None, *, segments: bool = False, **backup: Any) -> Config:
    """``segments``: compactions always write Parquet segments (a partition this
    small otherwise stays in the catalog): for tests of a generation's objects."""
    base = (parquet_config if segments else make_config)(catalog_url)
    return base.model_copy(update={"backup": BackupSettings(**backup)})


@pytest.fixture
def ks(catalog_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Keyshred]:
    segments = getattr(request, "param", "") == "segments"
    store = Keyshred.init(
        tmp_path / "data", config(catalog_url, segments=segments), embeddings=bag_of_words
    )
    yield store
    store.close()


# The test copies, tampers with or prunes a generation's segment objects.
SEGMENTS = pytest.mark.parametrize("ks", ["segments"], indirect=True)


def files_of(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def write_subject(ks: Keyshred, subject: str, probe: str, n: int = 4) -> dict[str, Any]:
    values = {}
    for i in range(n):
        value = {"text": f"{probe} note {i} about sailing"}
        ks.memories.put(subject, NS, f"k{i}", value, index=["text"])
        values[f"k{i}"] = value
    return values


def contents(ks: Keyshred, subject: str) -> dict[str, Any]:
    return {m.key: m.value for m in ks.memories.search(subject, NS, limit=1000)}


@pytest.mark.parametrize("ks", ["segments", "catalog"], indirect=True)
def test_backup_erase_backup_restore_both(ks: Keyshred, tmp_path: Path) -> None:
    """write → back up → erase one → back up again → restore each generation:
    the erased subject is unreadable and absent after replay in both, the others
    equal what was written, derived data is rebuilt the way the live erasure did."""
    probe = f"zq{uuid.uuid4().hex[:10]}"
    victim = f"victim-{probe}"
    written = {
        s: write_subject(ks, s, probe if s == victim else s) for s in (victim, "bob", "carol")
    }
    token = ks.vault.sanitize(f"mail {probe}@example.org", victim, "support", timedelta(days=1))
    bob_token = ks.vault.sanitize("mail bob@example.org", "bob", "support", timedelta(days=1))
    own = ks.memories.put(victim, NS, "src", {"text": f"{probe} likes tea"})
    bobs = ks.memories.put("bob", NS, "src", {"text": "bob likes chess"})
    ks.derived.register(
        "summary",
        subject="bob",
        namespace=("shared",),
        key="summary",
        value=f"{probe} likes tea; bob likes chess",
        produced_from=[own.memory_id, bobs.memory_id],
        producer="summarizer",
        producer_version="1",
        rebuild=lambda sources: "; ".join(sorted(m.value["text"] for m in sources)),
    )
    written["bob"]["src"] = {"text": "bob likes chess"}
    # Segments are the generation's objects; hot rows, vectors and partitions
    # compacted into the catalog are rows of its catalog snapshot.
    ks.memories.flush()
    g1 = ks.backup.create()
    in_segments = ks.config.storage.inline_max_rows == 0
    assert g1.subjects == 3 and (g1.objects_uploaded > 0) == in_segments

    req = ks.erase(victim, requested_by="dpo", reason="art17", probes=[probe])
    assert req.state == "completed", req.error
    receipt = ks.erasure.receipt(req.request_id)
    assert receipt is not None
    cov = receipt.backups
    assert cov.covered and cov.generations == [g1.generation]
    # The victim's segment objects are deleted from the target; rows of the catalog
    # snapshot stay, sealed under keys the erasure destroyed (the snapshot's
    # tombstone replay at restore deletes them).
    assert (cov.objects_deleted > 0) == in_segments
    assert any(s.store == "backups" for s in receipt.stores)
    # The victim's objects are gone from the target already.
    target = ks.backup.target()
    assert not [k for k in target.keys("objects") if ks.subject_ref(victim) in k]

    g2 = ks.backup.create()
    # Incremental: only what the erasure changed is copied (bob's rebuilt summary is
    # a hot row of the catalog: maybe nothing).
    assert g2.subjects == 2 and g2.objects_uploaded <= 3
    assert g2.objects_reused == g2.segments - g2.objects_uploaded

    for gen in (g1, g2):
        into = tmp_path / f"restore-{gen.generation}"
        report = ks.backup.restore(gen.generation, into)
        assert json.loads((into / "RESTORE.json").read_text())["generation"] == gen.generation
        assert report.subjects_verified == 2
        if gen is g1:
            assert [r["subject_ref"] for r in report.replayed] == [ks.subject_ref(victim)]
        else:
            assert report.replayed == []
        r = Keyshred.open(into, embeddings=bag_of_words)
        try:
            with pytest.raises(SubjectSuppressed):
                r.memories.get(victim, NS, "k0")
            ref = ks.subject_ref(victim)
            assert not r.memories.partition_path(ref).exists()
            assert not r.vectors.exists(ref)
            assert r.catalog.count(ref) == 0
            assert r.vault.count(ref) == 0
            for key_hex in receipt.key_ids:
                with pytest.raises(SubjectErased):
                    r.keyring.data_key_by_id(bytes.fromhex(key_hex))
            for subject in ("bob", "carol"):
                assert contents(r, subject) == written[subject]
            summary = r.memories.get("bob", ("shared",), "summary")
            assert summary is not None and summary.value == "bob likes chess"
            assert r.vault.restore(bob_token.text, "support", caller="t") == "mail bob@example.org"
            hits = r.memories.search("bob", NS, query="sailing", limit=3)
            assert hits and all("bob" in h.value["text"] for h in hits)
        finally:
            r.close()
        for path in files_of(into):
            data = path.read_bytes()
            assert probe.encode() not in data, path
            assert victim.encode() not in data, path
    assert len(token.tokens) == 1
    # The backups hold no plaintext either, of anyone.
    for path in files_of(Path(target.url)):
        data = path.read_bytes()
        assert probe.encode() not in data and b"bob likes" not in data, path


def test_returning_subject_keeps_new_data(ks: Keyshred, tmp_path: Path) -> None:
    """A tombstone names key ids: restoring a generation taken after the subject
    came back keeps the new data; one taken before the erasure drops the old."""
    ks.memories.put("dana", NS, "old", {"text": "old life"})
    before = ks.backup.create()
    ks.erase("dana", requested_by="dpo", reason="art17")
    ks.erasure.readmit("dana")
    ks.memories.put("dana", NS, "new", {"text": "new life"})
    after = ks.backup.create()

    ks.backup.restore(before.generation, tmp_path / "before")
    ks.backup.restore(after.generation, tmp_path / "after")
    with Keyshred.open(tmp_path / "after", embeddings=bag_of_words) as r:
        assert contents(r, "dana") == {"new": {"text": "new life"}}
    with Keyshred.open(tmp_path / "before", embeddings=bag_of_words) as r:
        assert not r.memories.partition_path(r.subject_ref("dana")).exists()


def materialize_without_replay(ks: Keyshred, target_root: Path, gen: str, into: Path) -> None:
    """What an attacker with an old backup copy and the archive KEK (while the
    generation's archive epoch lives) can do: unseal the key store and put the
    files back, skipping tombstone replay."""
    raw = (target_root / "generations" / gen / "manifest.json").read_bytes()
    m = Manifest.parse(raw, gen)
    sealed = (target_root / m.keystore.object).read_bytes()
    wrapped = WrappedKey(m.keystore.kek_epoch, base64.b64decode(m.keystore.wrapped))
    keystore = ks.keyring.open_archive(m.kek_epoch, wrapped, sealed, f"backup:{gen}")
    SQLiteKeyStore.from_snapshot(into / "keys" / "keystore.db", keystore).close()
    for seg in m.segments:
        dst = into / seg.path
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(target_root / seg.object, dst)
    (into / "catalog").mkdir()
    shutil.copyfile(target_root / m.catalog.object, into / "catalog" / "catalog.db")
    kek = ks.config.kek.model_copy(
        update={
            "local_path": str((ks.path / "keys" / "kek.local.json").resolve()),
            "archive_local_path": str((ks.path / "keys" / "kek.archive.json").resolve()),
        }
    )
    cfg = Config.model_validate({**m.config, "kek": kek.model_dump()})
    save_config(
        into,
        cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"catalog_url": None})}),
    )


def test_key_store_backup_attack_ends_on_backup_final_date(tmp_path: Path) -> None:
    """An old key-store backup restored *without* replay yields the erased subject
    while its archive KEK epoch lives; the scheduled archive epoch destruction ends
    that exactly on the receipt's ``backup_final_date`` (the generation's expiry:
    no earlier generation expires later). The live lineage rotating and destroying
    its epochs meanwhile changes nothing for the backup."""
    cfg = config(retention={"daily": 7, "monthly": 90})
    ks = Keyshred.init(tmp_path / "data", cfg, embeddings=bag_of_words)
    try:
        ks.memories.put("erin", NS, "secret", {"text": "erin's secret"})
        ks.memories.put("finn", NS, "note", {"text": "finn's note"})
        gen = ks.backup.create(retention_class="monthly")
        offsite = tmp_path / "offsite-copy"  # a copy made outside keyshred
        shutil.copytree(ks.backup.target().url, offsite)

        req = ks.erase("erin", requested_by="dpo", reason="art17")
        receipt = ks.erasure.receipt(req.request_id)
        assert receipt is not None
        final = receipt.backups.backup_final_date
        assert final is not None
        assert gen.kek_lineage == "archive"
        assert final == gen.expires_at == receipt.backups.expire_by

        # The risk, documented: before the date the old key store still unseals,
        # although the live epoch it was made under is destroyed by now.
        early = ks.backup.maintain(now=final - timedelta(days=1))
        assert early.rotated_to is not None and early.destroyed
        assert gen.kek_epoch not in [d.epoch for d in early.archive_destroyed]
        attack = tmp_path / "attack"
        materialize_without_replay(ks, offsite, gen.generation, attack)
        with Keyshred.open(attack, embeddings=bag_of_words) as stolen:
            assert stolen.memories.get("erin", NS, "secret").value == {"text": "erin's secret"}  # type: ignore[union-attr]

        # On the date the scheduled maintenance destroys the epoch: nothing yields.
        report = ks.backup.maintain(now=final)
        assert gen.kek_epoch in [d.epoch for d in report.archive_destroyed]
        # The stolen copy no longer even opens: its system secrets and every DEK
        # in it are wrapped by the destroyed archive epoch.
        with pytest.raises(KekEpochDestroyed):
            Keyshred.open(attack, embeddings=bag_of_words)
        with pytest.raises(KekEpochDestroyed):
            materialize_without_replay(ks, offsite, gen.generation, tmp_path / "attack2")
        # The live store is unharmed: it never depended on the archive lineage.
        assert ks.memories.get("finn", NS, "note").value == {"text": "finn's note"}  # type: ignore[union-attr]
        with pytest.raises(KekEpochDestroyed):
            ks.backup.restore(gen.generation, tmp_path / "r", target=str(offsite))
        assert not (tmp_path / "r").exists()
    finally:
        ks.close()


def _flip(path: Path, at: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[min(at, len(data) - 1)] ^= 0x01
    path.write_bytes(bytes(data))


@SEGMENTS
def test_tampering_is_refused_and_named(ks: Keyshred, tmp_path: Path) -> None:
    write_subject(ks, "gus", "gus")
    ks.memories.flush()  # a segment: an object of the generation to tamper with
    gen = ks.backup.create()
    root = Path(ks.backup.target().url)
    m = ks.backup.manifest(gen.generation)
    seg = max(m.segments, key=lambda s: s.size)
    original = (root / seg.object).read_bytes()
    _flip(root / seg.object)
    with pytest.raises(IntegrityError, match=seg.path.replace(".", r"\.")):
        ks.backup.restore(gen.generation, tmp_path / "r1")
    assert not (tmp_path / "r1").exists()
    assert not [p for p in tmp_path.iterdir() if ".restoring-" in p.name]
    (root / seg.object).write_bytes(original)

    manifest_path = root / "generations" / gen.generation / "manifest.json"
    raw = manifest_path.read_bytes()
    doc = json.loads(raw)
    doc["expires_at"] = "2099-01-01T00:00:00Z"
    manifest_path.write_text(json.dumps(doc))
    with pytest.raises(IntegrityError, match="tampered"):
        ks.backup.restore(gen.generation, tmp_path / "r2")
    manifest_path.write_bytes(raw)

    sealed = root / m.keystore.object
    _flip(sealed)
    with pytest.raises(IntegrityError, match="key store"):
        ks.backup.restore(gen.generation, tmp_path / "r3")
    _flip(sealed)
    report = ks.backup.restore(gen.generation, tmp_path / "r4")  # intact again
    assert report.subjects_verified == 1


@SEGMENTS
def test_interrupted_backup_and_restore_leave_nothing_usable(
    ks: Keyshred, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_subject(ks, "hal", "hal")
    ks.memories.flush()  # a segment: the generation has objects to copy
    target = ks.backup.target()
    assert isinstance(target, LocalTarget)
    calls = {"n": 0}
    real = LocalTarget.put_file

    def failing(self: LocalTarget, key: str, path: Path, progress: Any = None) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # one object in the target, the others and the manifest not
            raise OSError("disk full")
        real(self, key, path, progress)

    monkeypatch.setattr(LocalTarget, "put_file", failing)
    with pytest.raises(OSError):
        ks.backup.create()
    monkeypatch.setattr(LocalTarget, "put_file", real)
    assert ks.backup.generations() == []  # no manifest: no generation
    staging = ks.path / ".backup-staging"
    assert not [p for p in staging.iterdir() if p.is_dir()]  # no half-staged generation
    gen = ks.backup.create()
    assert [g.generation for g in ks.backup.generations()] == [gen.generation]

    def boom(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("killed")

    monkeypatch.setattr(BackupManager, "_verify_restored", boom)
    with pytest.raises(RuntimeError):
        ks.backup.restore(gen.generation, tmp_path / "r")
    assert not (tmp_path / "r").exists()
    assert not [p for p in tmp_path.iterdir() if ".restoring-" in p.name]


def test_snapshot_is_one_point_in_time_under_writers(ks: Keyshred, tmp_path: Path) -> None:
    """A writer alternates between two subjects (a_i, then b_i). Any instant has
    count(b) in {count(a), count(a) - 1}; a snapshot taken while it runs must too."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        i = 0
        try:
            while not stop.is_set():
                ks.memories.put("ann", NS, f"k{i}", {"i": i}, index=False)
                ks.memories.put("ben", NS, f"k{i}", {"i": i}, index=False)
                i += 1
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    gens = []
    try:
        while len(gens) < 3 and thread.is_alive():
            if ks.memories.count("ben") > 5 * (len(gens) + 1):
                gens.append(ks.backup.create())
            stop.wait(0.005)
    finally:
        stop.set()
        thread.join()
    assert not errors
    assert len(gens) == 3
    for gen in gens:
        into = tmp_path / gen.generation
        ks.backup.restore(gen.generation, into)
        with Keyshred.open(into) as r:
            a, b = r.memories.count("ann"), r.memories.count("ben")
            assert b in (a, a - 1), (a, b)
            assert r.catalog.count(r.subject_ref("ann")) == a


@SEGMENTS
def test_retention_classes_and_prune(ks: Keyshred) -> None:
    write_subject(ks, "ivy", "ivy")
    ks.memories.flush()  # a segment object the next compaction replaces
    daily = ks.backup.create(retention_class="daily")
    ks.memories.put("ivy", NS, "later", {"text": "later"}, index=False)
    ks.memories.flush()
    monthly = ks.backup.create(retention_class="monthly")
    target = ks.backup.target()
    before = set(target.keys("objects"))
    pruned = ks.backup.prune(now=daily.created_at + timedelta(days=8))
    assert pruned == [daily.generation]
    assert [g.generation for g in ks.backup.generations()] == [monthly.generation]
    after = set(target.keys("objects"))
    assert after == {s.object for s in ks.backup.manifest(monthly.generation).segments}
    assert after < before  # objects only the daily generation used are gone
    assert ks.backup.prune(now=monthly.created_at + timedelta(days=91)) == [monthly.generation]
    assert target.keys("objects") == []


def test_a_restore_never_reissues_the_id_of_a_token_issued_after_its_snapshot(
    ks: Keyshred, tmp_path: Path
) -> None:
    """Tokens issued after the snapshot are gone with the restore but may sit in logs:
    the restored catalog hands out numbers above every block the live one took."""
    hour = timedelta(hours=1)
    kept = ks.vault.sanitize("call 13812345678", "ivy", "support", hour).tokens[0]
    gen = ks.backup.create()
    # Another process takes its block of numbers after the snapshot.
    with Keyshred.open(ks.path, embeddings=bag_of_words) as other:
        later = [
            t
            for s in other.vault.sanitize_many(
                [f"call 139{n:08d}" for n in range(50)], "jon", "support", hour
            )
            for t in s.tokens
        ]
    restored_path = tmp_path / "restored"
    ks.backup.restore(gen.generation, restored_path)
    with Keyshred.open(restored_path, embeddings=bag_of_words) as restored:
        assert restored.vault.detokenize(kept, "support", "t") == "13812345678"
        for t in later:  # gone with the restore: refused, never someone else's value
            with pytest.raises(UnknownToken):
                restored.vault.detokenize(t, "support", "t")
        fresh = [
            t
            for s in restored.vault.sanitize_many(
                [f"call 137{n:08d}" for n in range(200)], "kim", "support", hour
            )
            for t in s.tokens
        ]
        assert not set(fresh) & set(later)
        live_mark = ks.vault.block_mark()
        assert min(restored.vault.number_of(t) or 0 for t in fresh) >= (live_mark + 1) * 1024


def make_legacy(ks: Keyshred, generation: str, target: str | None = None) -> Any:
    """Turn a generation into one made before the archive lineage: its key store
    copy with every key wrapped by the live provider directly, sealed under the
    live provider's current epoch, the manifest saying so (and signed again)."""
    from keyshred.keyring.epochs import epoch_key_context
    from keyshred.keyring.keyring import _record_context, _secret_context

    ring = ks.keyring
    tgt = ks.backup.target(target)
    m = ks.backup.manifest(generation, tgt)
    label = f"backup:{generation}"
    wrapped = WrappedKey(m.keystore.kek_epoch, base64.b64decode(m.keystore.wrapped))
    image = ring.open_archive(m.kek_epoch, wrapped, tgt.get_bytes(m.keystore.object), label)
    archive = ring.archive
    assert archive is not None and ring.archive_kek is not None
    archive.remember(
        m.kek_epoch, ring.archive_kek.unwrap(wrapped, epoch_key_context("archive", m.kek_epoch))
    )

    def keys(records: Any) -> Any:
        raws = ring._unwrap_records(records)
        out = ring.kek.wrap_many(
            [(k, _record_context(r)) for r, k in zip(records, raws, strict=True)]
        )
        return [(ring.kek.name, w.epoch, w.blob) for w in out]

    def secrets(records: Any) -> Any:
        out = []
        for s in records:
            raw = ring._unwrap_one(s.kek_provider, s.kek_epoch, s.wrapped, _secret_context(s.name))
            w = ring.kek.wrap(raw, _secret_context(s.name))
            out.append((ring.kek.name, w.epoch, w.blob))
        return out

    image = SQLiteKeyStore.rewrap_image(image, keys, secrets, None)
    archive.forget([m.kek_epoch])
    sealed_key, sealed = ring.seal_blob(image, label)
    tgt.put_bytes(m.keystore.object, sealed)
    keystore = m.keystore.model_copy(
        update={
            "wrapped": base64.b64encode(sealed_key.blob).decode("ascii"),
            "kek_epoch": sealed_key.epoch,
            "size": len(sealed),
            "sha256": __import__("hashlib").sha256(sealed).hexdigest(),
        }
    )
    legacy = m.model_copy(
        update={
            "kek_lineage": "live",
            "kek_epoch": sealed_key.epoch,
            "kek_provider": ring.kek.name,
            "keystore": keystore,
            "signature": None,
        }
    ).signed(ring.signer())
    tgt.put_bytes(f"generations/{generation}/manifest.json", legacy.to_bytes())
    return ks.backup.generations(tgt)[
        [g.generation for g in ks.backup.generations(tgt)].index(generation)
    ]


def test_destroying_an_epoch_that_retained_backups_need_is_refused(
    ks: Keyshred, tmp_path: Path
) -> None:
    """A generation made before the archive lineage is sealed under live epoch 1:
    destroying it is refused (keyring and facade alike), lists the generation and
    changes nothing; ``force`` destroys it and is audited; once the generation
    expired no force is needed."""
    ks.memories.put("gus", NS, "k", {"text": "gus"})
    gen = make_legacy(ks, ks.backup.create().generation)
    assert gen.kek_lineage == "live"
    ks.keyring.rotate_kek()
    for destroy in (ks.keyring.destroy_kek_epochs_before, ks.destroy_kek_epochs_before):
        with pytest.raises(EpochInUse, match=gen.generation) as refused:
            destroy(gen.kek_epoch + 1)
        assert [g.split()[0] for g in refused.value.generations] == [gen.generation]
    assert gen.kek_epoch in [e.epoch for e in ks.keyring.kek.epochs()]
    report = ks.backup.restore(gen.generation, tmp_path / "restored")  # still restorable
    assert report.memories_verified == 1

    gone = ks.destroy_kek_epochs_before(gen.kek_epoch + 1, force=True)
    assert [d.epoch for d in gone] == [gen.kek_epoch]
    (event,) = [e for e in ks.audit.events() if e.event == "kek.epoch_destroyed"]
    assert event.data == {"epoch": gen.kek_epoch, "forced": True, "broke": [gen.generation]}
    with pytest.raises(KekEpochDestroyed):
        ks.backup.restore(gen.generation, tmp_path / "again")

    # The next epoch seals nothing retained once the second generation has expired.
    second = make_legacy(ks, ks.backup.create().generation)
    ks.keyring.rotate_kek()
    with pytest.raises(EpochInUse):
        ks.destroy_kek_epochs_before(second.kek_epoch + 1)
    ks.backup.clock = lambda: second.expires_at + timedelta(seconds=1)
    assert [d.epoch for d in ks.destroy_kek_epochs_before(second.kek_epoch + 1)] == [
        second.kek_epoch
    ]


def test_a_restored_copy_outlives_the_destruction_of_its_generations_epoch(
    ks: Keyshred, tmp_path: Path
) -> None:
    """A restore re-wraps the copy's keys from the generation's archive epoch to
    the copy's live lineage and drops the archive epoch key from it: destroying the
    generation's archive epoch afterwards breaks the generation, never the copy."""
    ks.memories.put("hana", NS, "k", {"text": "hana's note"})
    gen = ks.backup.create()
    report = ks.backup.restore(gen.generation, tmp_path / "restored")
    assert report.keys_rewrapped >= 1
    archive = ks.keyring.archive_kek
    assert archive is not None
    archive.destroy_epochs_before(archive.rotate())
    copy = Keyshred.open(tmp_path / "restored")
    try:
        assert copy.keyring.store.epoch_keys("archive") == []
        assert {
            r.kek_provider for r in copy.keyring.store.for_subject(copy.subject_ref("hana"))
        } == {"local@live"}
        assert copy.memories.get("hana", NS, "k").value == {"text": "hana's note"}
    finally:
        copy.close()
    with pytest.raises(KekEpochDestroyed, match="can never be restored"):
        ks.backup.restore(gen.generation, tmp_path / "again")


def test_a_generation_restores_after_the_live_epoch_it_was_made_under_is_destroyed(
    ks: Keyshred, tmp_path: Path
) -> None:
    """Backups never depend on live epochs: the generation's key store copy holds no
    live-epoch row and no key wrapped by one (nor their bytes, after VACUUM), and
    it restores after the live lineage rotated and destroyed that epoch."""
    ks.memories.put("lea", NS, "k", {"text": "lea's note"})
    live_before = ks.keyring.live_epoch()
    live_rows = {r.key_id: r.wrapped for r in ks.keyring.store.for_subject(ks.subject_ref("lea"))}
    gen = ks.backup.create()
    m = ks.backup.manifest(gen.generation)
    wrapped = WrappedKey(m.keystore.kek_epoch, base64.b64decode(m.keystore.wrapped))
    sealed = ks.backup.target().get_bytes(m.keystore.object)
    image = ks.keyring.open_archive(m.kek_epoch, wrapped, sealed, f"backup:{gen.generation}")
    import sqlite3

    db = sqlite3.connect(":memory:")
    db.deserialize(image)
    assert db.execute("SELECT lineage, epoch FROM epoch_key").fetchall() == [
        ("archive", gen.kek_epoch)
    ]
    assert {p for (p,) in db.execute("SELECT kek_provider FROM dek")} == {"local@archive"}
    assert {p for (p,) in db.execute("SELECT kek_provider FROM secret")} == {"local@archive"}
    db.close()
    assert live_before.wrapped not in image
    assert not any(w in image for w in live_rows.values())

    run = ks.backup.maintain(now=live_before.created_at + timedelta(hours=2))
    assert live_before.epoch in [d.epoch for d in run.destroyed]
    assert live_before.epoch not in [e.epoch for e in ks.keyring.kek.epochs()]
    report = ks.backup.restore(gen.generation, tmp_path / "restored")
    assert report.memories_verified == 1
    with Keyshred.open(tmp_path / "restored") as copy:
        assert copy.memories.get("lea", NS, "k").value == {"text": "lea's note"}  # type: ignore[union-attr]


def test_archive_epochs_are_destroyed_oldest_first_at_the_latest_earlier_expiry(
    ks: Keyshred,
) -> None:
    """A monthly generation followed by a daily one: the daily one's archive epoch
    cannot go before the monthly one's (providers destroy every epoch below a
    bound), so both are destroyed at the monthly expiry; receipts say so."""
    ks.memories.put("mo", NS, "k", {"text": "mo"})
    monthly = ks.backup.create(retention_class="monthly")
    daily = ks.backup.create(retention_class="daily")
    assert daily.kek_epoch > monthly.kek_epoch
    manifests = [ks.backup.manifest(g.generation) for g in (monthly, daily)]
    dates = ks.backup.archive_schedule(manifests)
    assert dates == {monthly.generation: monthly.expires_at, daily.generation: monthly.expires_at}
    req = ks.erase("mo", requested_by="dpo", reason="art17")
    receipt = ks.erasure.receipt(req.request_id)
    assert receipt is not None and receipt.backups.backup_final_date == monthly.expires_at
    archive = ks.keyring.archive_kek
    assert archive is not None
    after_daily = ks.backup.maintain(now=daily.expires_at + timedelta(seconds=1))
    assert daily.kek_epoch not in [d.epoch for d in after_daily.archive_destroyed]
    assert {monthly.kek_epoch, daily.kek_epoch} <= {e.epoch for e in archive.epochs()}
    final = ks.backup.maintain(now=monthly.expires_at)
    gone = {d.epoch for d in final.archive_destroyed}
    assert {monthly.kek_epoch, daily.kek_epoch} <= gone


def test_destroying_an_epoch_a_backup_on_another_target_needs_is_refused(
    ks: Keyshred, tmp_path: Path
) -> None:
    """A generation written with ``--target`` elsewhere (not ``backup.target``) is as
    much a retained backup: destroying the epoch that seals it is refused too.
    (Review finding: only the default target was consulted.)"""
    ks.memories.put("ida", NS, "k", {"text": "ida"})
    ks.backup.create()
    assert not (ks.path / "backup-targets").exists()  # the default needs no record
    other = str(tmp_path / "offsite")
    gen = make_legacy(ks, ks.backup.create(other).generation, other)
    ks.keyring.rotate_kek()
    with pytest.raises(EpochInUse, match=gen.generation):
        ks.destroy_kek_epochs_before(gen.kek_epoch + 1)
    report = ks.backup.restore(gen.generation, tmp_path / "restored", target=other)
    assert report.memories_verified == 1


def test_restoring_onto_a_file_is_refused_as_bad_input(ks: Keyshred, tmp_path: Path) -> None:
    """``into`` naming an existing file is the caller's mistake: ``InvalidInput``
    (the CLI's one-line error), and the file is left as it was."""
    from keyshred.errors import InvalidInput

    ks.memories.put("jo", NS, "k", {"text": "jo"})
    gen = ks.backup.create()
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    with pytest.raises(InvalidInput):
        ks.backup.restore(gen.generation, target)
    assert target.read_text() == "mine"


def test_a_forced_epoch_destruction_is_not_blocked_by_an_unreadable_manifest(
    ks: Keyshred, tmp_path: Path
) -> None:
    """Without force an unreadable manifest refuses (it may be a generation the
    epoch seals); ``force`` is the operator's override and still destroys, audited
    with what could not be listed."""
    ks.memories.put("kim", NS, "k", {"text": "kim"})
    gen = make_legacy(ks, ks.backup.create().generation)
    ks.keyring.rotate_kek()
    manifest = Path(ks.backup.target().url) / "generations" / gen.generation / "manifest.json"
    manifest.write_bytes(b"{ tampered")
    with pytest.raises(IntegrityError):
        ks.destroy_kek_epochs_before(gen.kek_epoch + 1)
    assert gen.kek_epoch in [e.epoch for e in ks.keyring.kek.epochs()]
    gone = ks.destroy_kek_epochs_before(gen.kek_epoch + 1, force=True)
    assert [d.epoch for d in gone] == [gen.kek_epoch]
    (event,) = [e for e in ks.audit.events() if e.event == "kek.epoch_destroyed"]
    assert event.data["forced"] is True and event.data["broke"] == ["unknown: IntegrityError"]


def test_a_subject_erased_while_a_restore_runs_is_erased_in_the_copy(
    ks: Keyshred, tmp_path: Path
) -> None:
    """An erasure that completes while a restore is downloading (after the restore
    read the tombstones) must reach the copy too: the copy never exposes a subject
    the live store has erased. (Review finding.)"""
    ks.memories.put("lea", NS, "k", {"text": "lea's secret"})
    ks.memories.put("max", NS, "k", {"text": "max's note"})
    gen = ks.backup.create()
    done: list[str] = []

    def erase_once(point: str) -> None:
        if point == "catalog" and not done:
            req = ks.erase("lea", requested_by="dpo", reason="art17")
            done.append(req.state)

    ks.backup.on_restore_step = erase_once
    ks.backup.restore(gen.generation, tmp_path / "restored")
    assert done == ["completed"]
    copy = Keyshred.open(tmp_path / "restored")
    try:
        with pytest.raises((SubjectErased, SubjectSuppressed)):
            copy.memories.get("lea", NS, "k")
        assert copy.memories.get("max", NS, "k").value == {"text": "max's note"}
    finally:
        copy.close()


def test_a_subject_suppressed_live_is_suppressed_in_a_restored_copy(
    ks: Keyshred, tmp_path: Path
) -> None:
    """An erasure killed after its first step (suppress) and before its keys were
    destroyed has no tombstone: a restore made meanwhile must not expose the
    subject; the copy decides before decrypting, as the live store does.
    (Review finding.)"""
    ks.memories.put("ola", NS, "k", {"text": "ola's secret"})
    ks.memories.put("pia", NS, "k", {"text": "pia's note"})
    gen = ks.backup.create()
    ks.catalog.suppress(ks.subject_ref("ola"))  # what the erasure's first step does
    with pytest.raises(SubjectSuppressed):
        ks.memories.get("ola", NS, "k")

    ks.backup.restore(gen.generation, tmp_path / "restored")
    copy = Keyshred.open(tmp_path / "restored")
    try:
        with pytest.raises((SubjectErased, SubjectSuppressed)):
            copy.memories.get("ola", NS, "k")
        assert copy.memories.get("pia", NS, "k").value == {"text": "pia's note"}
    finally:
        copy.close()


def test_the_live_schedule_rotates_but_defers_destruction_while_a_manifest_is_unreadable(
    ks: Keyshred,
) -> None:
    """An unreadable manifest may be a generation sealed under a live epoch (made
    before the archive lineage): the live schedule still rotates but destroys no
    live epoch, and audits why; once it reads again, the old epochs go."""
    ks.memories.put("ola", NS, "k", {"text": "ola"})
    gen = ks.backup.create()
    manifest = Path(ks.backup.target().url) / "generations" / gen.generation / "manifest.json"
    good = manifest.read_bytes()
    manifest.write_bytes(b"{ tampered")
    first = ks.keyring.live_epoch()
    run = ks.backup.maintain_live(now=first.created_at + timedelta(hours=1))
    assert run.rotated_to == first.epoch + 1 and run.destroyed == []
    assert first.epoch in [e.epoch for e in ks.keyring.kek.epochs()]
    (event,) = [e for e in ks.audit.events() if e.event == "kek.live_destroy_deferred"]
    assert event.data == {"error": "IntegrityError"}
    manifest.write_bytes(good)
    # The next run, well within the new epoch's period: no rotation, the old goes.
    later = ks.backup.maintain_live(now=first.created_at + timedelta(minutes=30))
    assert later.rotated_to is None and first.epoch in [d.epoch for d in later.destroyed]


@pytest.mark.postgres
def test_a_backup_never_holds_the_catalog_password(tmp_path: Path) -> None:
    """The manifest records the configuration (a restore rebuilds the copy's
    settings from it); a password in a database URL must not travel with it. The
    machine's PostgreSQL trusts loopback, so the URL's password is accepted and
    ignored."""
    secret = f"pw{uuid.uuid4().hex}"
    with pg_schema() as schema:
        url = (
            f"postgresql+psycopg://postgres:{secret}@127.0.0.1:5432/test"
            f"?options=-csearch_path%3D{schema}"
        )
        with Keyshred.init(tmp_path / "data", config(url), embeddings=bag_of_words) as ks:
            write_subject(ks, "ana", "probe-ana")
            ks.backup.create()
        # keyshred.toml keeps the URL as the operator wrote it (0600); the backups not.
        files = files_of(tmp_path / "data" / "backups")
        assert files
        for f in files:
            assert secret.encode() not in f.read_bytes(), f.name
