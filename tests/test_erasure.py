"""Erasure end to end on both catalogs: the probe drill, scopes, holds, processors,
receipts, the audit chain and metrics."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from keyshred import Keyshred
from keyshred.erasure import ExternalAnswer
from keyshred.errors import (
    IntegrityError,
    InvalidInput,
    NotFound,
    StaleEpoch,
    SubjectErased,
    SubjectSuppressed,
)
from keyshred.jose import b64url_decode, b64url_encode
from keyshred.keyring.envelope import Place
from keyshred.receipts import load_receipt, verify_receipt
from keyshred.storage.erasable import ErasureTarget
from tests.receipt_forms import sign_json_form
from tests.storage.conftest import make_config
from tests.storage.test_vectors import bag_of_words

NS = ("memories",)


@pytest.fixture
def ks(catalog_url: str, tmp_path: Path) -> Iterator[Keyshred]:
    store = Keyshred.init(tmp_path / "data", make_config(catalog_url), embeddings=bag_of_words)
    yield store
    store.close()


def summarize(sources: list) -> str:  # type: ignore[type-arg]
    return " | ".join(sorted(str(m.value) for m in sources))


def files_of(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def test_probe_drill(ks: Keyshred, tmp_path: Path) -> None:
    """A synthetic subject with probes in memories, vectors, a summary shared with
    another subject and a fact that mentions them; after erasure a byte scan, a key
    search and a semantic search find nothing, the summary was rebuilt without
    them, and the other subjects' data is intact."""
    probe = f"zq{uuid.uuid4().hex[:10]}"
    victim = f"victim-{probe}@example.org"
    ks.consent.grant(victim, scope="support/health", category="health")
    mine = [
        ks.memories.put(victim, NS, f"k{i}", {"text": f"{probe} fact {i} kayak"}, index=["text"])
        for i in range(5)
    ]
    ks.memories.put(
        victim, NS, "health", f"{probe} asthma", scope="support/health", category="health"
    )
    other = ks.memories.put("bob", NS, "b", {"text": "bob likes chess"}, index=["text"])
    summary = ks.derived.register(
        "summary",
        subject="bob",
        namespace=("shared",),
        key="summary",
        value=summarize([ks.memories.memory(r) for r in []]) + f"{probe} and chess",
        produced_from=[mine[0].memory_id, other.memory_id],
        producer="summarizer",
        producer_version="1",
        rebuild=summarize,
        index=True,
    )
    ks.memories.put("carol", ("facts",), "edge", f"carol met {probe}", mentions=[victim])
    ks.memories.put("carol", ("facts",), "own", "carol likes tea")
    ks.memories.flush()

    req = ks.erase(victim, requested_by="dpo@example.com", reason="gdpr-art17", probes=[probe])
    assert req.state == "completed", req.error
    receipt = ks.erasure.receipt(req.request_id)
    assert receipt is not None
    verify_receipt(receipt, ks.keyring.signer().public_key)
    assert receipt.subject_ref == ks.subject_ref(victim)
    assert all(c.passed for c in receipt.verification)
    # default, support/health and the index key, and the two keys the victim co-owned:
    # bob's summary's and carol's edge's (each listed with its holder's asset).
    assert len(receipt.key_ids) == 5
    assert sorted(len(k.assets) for k in receipt.shared_keys) == [1, 1]
    actions = {d.asset_id: d.action for d in receipt.derived}
    assert actions[summary.memory_id] == "rebuilt"
    assert list(actions.values()).count("dropped") == 1  # carol's edge
    text = receipt.to_json()
    assert probe not in text and victim not in text

    rebuilt = ks.memories.get("bob", ("shared",), "summary")
    assert rebuilt is not None and rebuilt.value == "{'text': 'bob likes chess'}"
    assert rebuilt.sources == (other.memory_id,)
    assert ks.memories.get("carol", ("facts",), "edge") is None
    assert ks.memories.get("carol", ("facts",), "own") is not None
    assert ks.memories.get("bob", NS, "b").value == {"text": "bob likes chess"}  # type: ignore[union-attr]
    for subject in ("bob", "carol"):
        for hit in ks.memories.search(subject, (), query=f"{probe} kayak", limit=20):
            assert probe not in json.dumps(hit.value)
    with pytest.raises(SubjectSuppressed):
        ks.memories.get(victim, NS, "k0")
    ks.close()
    for path in files_of(tmp_path / "data"):
        data = path.read_bytes()
        assert probe.encode() not in data, path
        assert victim.encode() not in data, path


def test_idempotent_and_old_ciphertexts_stay_dead(ks: Keyshred) -> None:
    ref = ks.subject_ref("dave")
    ct = ks.keyring.seal(b"x", Place(ref, "default", "t", "r", "c"))
    ks.memories.put("dave", NS, "k", 1)
    first = ks.erase("dave", requested_by="dpo", reason="request", request_id="req-1")
    again = ks.erase("dave", requested_by="dpo", reason="request", request_id="req-1")
    assert first.state == again.state == "completed"
    assert len(ks.erasure.requests(subject_ref=ref)) == 1
    with pytest.raises(SubjectErased):
        ks.keyring.open(ct, Place(ref, "default", "t", "r", "c"))
    with pytest.raises(SubjectSuppressed):
        ks.memories.put("dave", NS, "k", 2)
    ks.erasure.readmit(subject_ref=ref)  # a returning subject starts fresh, with new keys
    ks.memories.put("dave", NS, "k", 3)
    assert ks.memories.get("dave", NS, "k").value == 3  # type: ignore[union-attr]
    with pytest.raises(SubjectErased):
        ks.keyring.open(ct, Place(ref, "default", "t", "r", "c"))
    with pytest.raises(NotFound):
        ks.erasure.status("no-such-request")


def test_scope_erasure_leaves_other_scopes(ks: Keyshred) -> None:
    ks.consent.grant("erin", scope="support/health", category="health")
    ks.memories.put("erin", NS, "keep", {"text": "likes hiking"}, index=["text"])
    ks.memories.put(
        "erin",
        NS,
        "gone",
        {"text": "migraine"},
        scope="support/health",
        category="health",
        index=["text"],
    )
    ks.memories.flush()
    ks.memories.put("erin", NS, "gone-log", "in the log", scope="support/health", category="health")
    req = ks.erase("erin", "support/health", requested_by="dpo", reason="consent-withdrawn")
    assert req.state == "completed", req.error
    assert ks.memories.get("erin", NS, "keep").value == {"text": "likes hiking"}  # type: ignore[union-attr]
    assert ks.memories.get("erin", NS, "gone") is None
    assert ks.memories.get("erin", NS, "gone-log") is None
    assert [h.key for h in ks.memories.search("erin", (), query="migraine hiking")] == ["keep"]
    ks.memories.evict(ks.subject_ref("erin"))
    assert ks.memories.count("erin") == 1
    # Consent granted again later: a new scope key; nothing old comes back.
    ks.memories.put("erin", NS, "new", "new", scope="support/health", category="health")
    assert {m.key for m in ks.memories.search("erin", (), limit=10)} == {"keep", "new"}


def test_legal_hold_blocks_until_released(ks: Keyshred) -> None:
    ks.memories.put("fay", NS, "k", 1)
    ref = ks.subject_ref("fay")
    hold = ks.erasure.place_hold(subject_ref=ref, reason="litigation-42", owner="legal@example.com")
    req = ks.erase("fay", requested_by="dpo", reason="request")
    assert req.state == "legal_hold"
    assert ks.memories.get("fay", NS, "k") is not None  # nothing was touched
    assert ks.erasure.resume(req.request_id).state == "legal_hold"
    ks.erasure.release_hold(hold.hold_id)
    done = ks.erasure.resume(req.request_id)
    assert done.state == "completed"
    assert ks.erasure.receipt(req.request_id).legal_hold_history is True  # type: ignore[union-attr]


class Vendor:
    def __init__(self, name: str, verified: bool) -> None:
        self.name, self.verified, self.calls = name, verified, 0

    def delete(self, subject_ref: str, scope: str | None) -> ExternalAnswer:
        self.calls += 1
        return ExternalAnswer(self.verified, "ok" if self.verified else "no deletion API")


class Flaky(Vendor):
    def delete(self, subject_ref: str, scope: str | None) -> ExternalAnswer:
        self.calls += 1
        if self.calls == 1:
            raise OSError("vendor timeout")
        return ExternalAnswer(True, "ok")


def test_external_processors_and_retry(ks: Keyshred) -> None:
    good, blind, flaky = (
        Vendor("hosted-memory", True),
        Vendor("llm-logs", False),
        Flaky("crm", False),
    )
    for p in (good, blind, flaky):
        ks.erasure.register_processor(p)
    ks.memories.put("gus", NS, "k", 1)
    req = ks.erase("gus", requested_by="dpo", reason="request")
    assert req.state == "retryable_failure" and "external" in (req.error or "")
    assert ks.memories.get("bob", NS, "x") is None
    with pytest.raises(SubjectSuppressed):  # a failed step never re-opens the data
        ks.memories.get("gus", NS, "k")
    done = ks.erasure.resume(req.request_id)
    assert done.state == "completed"
    receipt = ks.erasure.receipt(req.request_id)
    statuses = {c.processor: c.status for c in receipt.external}  # type: ignore[union-attr]
    assert statuses == {
        "hosted-memory": "acknowledged",
        "llm-logs": "deletion_not_verifiable",
        "crm": "acknowledged",
    }
    assert good.calls == 1 and blind.calls == 1  # not asked twice


def test_receipt_tampering_and_cli_verification(ks: Keyshred, tmp_path: Path) -> None:
    ks.memories.put("hal", NS, "k", 1)
    req = ks.erase("hal", requested_by="dpo", reason="request")
    receipt = ks.erasure.receipt(req.request_id)
    assert receipt is not None
    text = receipt.serialize()  # the JWS
    head, payload, signature = text.split(".")
    doc = json.loads(b64url_decode(payload))
    doc["completed_at"] = "2020-01-01T00:00:00Z"
    edited = f"{head}.{b64url_encode(json.dumps(doc).encode())}.{signature}"
    trusted = ks.keyring.signer().public_key
    with pytest.raises(IntegrityError):
        verify_receipt(load_receipt(edited), trusted)
    with pytest.raises(IntegrityError):
        verify_receipt(receipt, public_key=b"\x00" * 32)
    verify_receipt(load_receipt(text), trusted)


def test_receipt_verification_needs_the_trusted_key(ks: Keyshred) -> None:
    """An edited receipt re-signed with a fresh key carries a valid signature by its
    own embedded key: only the trusted key catches it, so the API demands one."""
    from keyshred.keyring import _primitives as prim
    from keyshred.keyring.keyring import Signer
    from keyshred.receipts import sign_receipt

    ks.memories.put("ida", NS, "k", 1)
    req = ks.erase("ida", requested_by="dpo", reason="request")
    receipt = ks.erasure.receipt(req.request_id)
    assert receipt is not None
    edited = receipt.model_copy(update={"reason": "nothing-happened"})
    forged = sign_receipt(edited, Signer(prim.ed25519_private_bytes(prim.ed25519_generate())))
    with pytest.raises(TypeError):
        verify_receipt(forged)  # type: ignore[call-arg]
    with pytest.raises(IntegrityError, match="another key"):
        verify_receipt(forged, ks.keyring.signer().public_key)
    with pytest.raises(InvalidInput):
        verify_receipt(receipt, b"")


def test_audit_chain_detects_edits(ks: Keyshred) -> None:
    from keyshred.schema import audit_events

    ks.memories.put("ivy", NS, "k", 1)
    ks.erase("ivy", requested_by="dpo", reason="request")
    n = ks.audit.verify()
    assert n >= 6
    events = ks.audit.events(subject_ref=ks.subject_ref("ivy"))
    assert events[0].event == "erasure.requested"
    assert all("ivy" not in json.dumps(e.data) for e in events)
    with ks.catalog.transaction() as conn:
        conn.execute(
            audit_events.update().where(audit_events.c.seq == 3).values(data='{"state":"x"}')
        )
    with pytest.raises(IntegrityError, match="event 3 was edited"):
        ks.audit.verify()
    with ks.catalog.transaction() as conn:
        conn.execute(audit_events.delete().where(audit_events.c.seq == 3))
    with pytest.raises(IntegrityError, match="broken at event 4"):
        ks.audit.verify()


def test_audit_retention_keeps_the_chain_verifiable(ks: Keyshred) -> None:
    from datetime import UTC, datetime

    for i in range(5):
        ks.audit.record("test.event", n=i)
    cut = datetime.now(UTC)
    for i in range(3):
        ks.audit.record("test.event", n=10 + i)
    assert ks.audit.prune(before=cut) == 5
    assert ks.audit.verify() == 3
    assert ks.audit.apply_retention() == 0  # nothing is six years old
    with pytest.raises(Exception, match="non-metadata"):
        ks.audit.record("test.event", blob=b"raw bytes")  # type: ignore[arg-type]


def test_metrics_carry_no_identifiers(ks: Keyshred) -> None:
    ks.memories.put("jim", NS, "k", 1)
    ks.erase("jim", requested_by="dpo", reason="request")
    text = ks.metrics.render()
    assert 'keyshred_erasure_requests_total{state="completed"} 1.0' in text
    assert "keyshred_erasure_online_seconds_count 1.0" in text
    assert "keyshred_erasure_completion_seconds_count 1.0" in text
    assert ks.subject_ref("jim") not in text and "jim" not in text
    epoch = ks.deletion_epoch("kat")
    ks.catalog.suppress(ks.subject_ref("kat"))
    ks.catalog.set_guard(ks.subject_ref("kat"), "active")
    with pytest.raises(StaleEpoch):
        ks.memories.put("kat", NS, "k", 1, epoch=epoch)
    assert "keyshred_stale_jobs_skipped_total 1.0" in ks.metrics.render()


def test_bad_requests_are_rejected(ks: Keyshred) -> None:
    req = ks.erase("kim", requested_by="", reason="x")
    assert req.state == "rejected"
    with pytest.raises(Exception, match="scope"):
        ks.erase("kim", "no-such-scope", requested_by="dpo", reason="x")


def test_memory_verification_lists_the_partition_store_and_the_catalog(
    ks: Keyshred,
) -> None:
    """Verification lists the partition store and the catalog, not what one process
    holds: an object left under the subject's prefix (a copy another worker wrote,
    say) fails it, and so does a hot row left in the catalog."""
    import shutil

    import sqlalchemy as sa

    from keyshred.storage.schema import memory_hot

    ks.memories.put("alice", ("n",), "k", 1)
    req = ks.erase("alice", requested_by="dpo", reason="test")
    assert req.state == "completed", req.error
    ref = ks.subject_ref("alice")
    path = ks.memories.partition_path(ref)
    target = ErasureTarget(ref)

    def verify() -> dict[str, bool]:
        return {c.name: c.passed for c in ks.memories.verify(target)}

    assert verify()["memory partition removed"]
    path.mkdir(parents=True)
    (path / f"seg-{'0' * 32}.parquet").write_bytes(b"PAR1")
    assert not verify()["memory partition removed"]
    shutil.rmtree(path)
    assert verify()["memory partition removed"]
    with ks.catalog.engine.begin() as conn:
        conn.execute(
            memory_hot.insert().values(subject_ref=ref, seq=0, scope="default", record=b"x")
        )
    assert not verify()["memory partition removed"]
    with ks.catalog.engine.begin() as conn:
        conn.execute(sa.delete(memory_hot).where(memory_hot.c.subject_ref == ref))
    assert verify()["memory partition removed"]


def test_erasing_an_id_never_stored_says_no_data_found(ks: Keyshred) -> None:
    """The request completes, and the request and the signed receipt say nothing was
    found; the id is not blocked (issue 24: an erasure that found nothing does not
    make the id unusable) unless the request asked to ``block`` it; a subject with
    data says it was found and stays erased."""
    ks.memories.put("jo", NS, "k", 1)
    nobody = ks.erase("never-stored-id", requested_by="dpo", reason="request")
    assert nobody.state == "completed" and nobody.found_data is False
    assert ks.erasure.status(nobody.request_id).found_data is False
    receipt = ks.erasure.receipt(nobody.request_id)
    assert receipt is not None and receipt.found_data is False
    verify_receipt(receipt, ks.keyring.signer().public_key)
    assert ks.catalog.guard(ks.subject_ref("never-stored-id")).status == "active"
    ks.memories.put("never-stored-id", NS, "k", 1)  # the id is free
    assert ks.memories.get("never-stored-id", NS, "k").value == 1
    completed = [e.data for e in ks.audit.events() if e.event == "erasure.completed"]
    assert completed[-1]["found_data"] is False

    blocked = ks.erase("blocked-id", requested_by="dpo", reason="request", block=True)
    assert blocked.state == "completed" and blocked.found_data is False
    with pytest.raises(SubjectSuppressed):
        ks.memories.put("blocked-id", NS, "k", 1)

    jo = ks.erase("jo", requested_by="dpo", reason="request")
    assert jo.found_data is True
    jo_receipt = ks.erasure.receipt(jo.request_id)
    assert jo_receipt is not None and jo_receipt.found_data is True
    verify_receipt(jo_receipt, ks.keyring.signer().public_key)


def test_a_receipt_from_before_found_data_still_verifies(ks: Keyshred) -> None:
    """Receipts signed before the field existed lack it: they load and verify."""

    ks.memories.put("kai", NS, "k", 1)
    receipt = ks.erasure.receipt(ks.erase("kai", requested_by="dpo", reason="r").request_id)
    assert receipt is not None
    assert receipt.live_residue_until is not None
    old = receipt.model_copy(
        update={"found_data": None, "live_residue_until": None, "signature": None}
    )
    doc = json.loads(sign_json_form(old, ks.keyring.signer()).to_json())
    del doc["found_data"]
    del doc["live_residue_until"]
    verify_receipt(load_receipt(json.dumps(doc)), ks.keyring.signer().public_key)


def test_receipt_dates_are_the_ones_the_schedules_enforce(ks: Keyshred) -> None:
    """``live_residue_until``: the live epoch current at key destruction is destroyed
    one live period after its creation. ``backup_final_date``: a monthly generation
    then a daily one hold the subject; the daily one's archive epoch can only go
    with the monthly one's (oldest first), so the date is the monthly expiry. Both
    are signed, and maintenance destroys exactly those epochs on those dates."""
    ks.memories.put("lee", NS, "k", {"text": "lee"})
    ks.memories.put("mia", NS, "k", {"text": "mia"})
    monthly = ks.backup.create(retention_class="monthly")
    daily = ks.backup.create(retention_class="daily")
    live = ks.keyring.live_epoch()
    receipt = ks.erasure.receipt(ks.erase("lee", requested_by="dpo", reason="r").request_id)
    assert receipt is not None
    verify_receipt(receipt, ks.keyring.signer().public_key)
    assert receipt.live_residue_until == live.created_at + timedelta(minutes=60)
    assert receipt.backups.backup_final_date == monthly.expires_at > daily.expires_at
    assert set(receipt.backups.generations) == {monthly.generation, daily.generation}

    # The job runs every keyring.maintain_every_minutes (5): the first run within
    # that interval of the epoch's end rotates it, so it is gone by the date.
    lead = timedelta(minutes=5)
    early = ks.backup.maintain(now=receipt.live_residue_until - lead - timedelta(seconds=1))
    assert early.destroyed == [] and early.rotated_to is None
    on_time = ks.backup.maintain(now=receipt.live_residue_until - lead)
    assert live.epoch in [d.epoch for d in on_time.destroyed]
    archive = ks.keyring.archive_kek
    assert archive is not None
    before = ks.backup.maintain(now=receipt.backups.backup_final_date - timedelta(seconds=1))
    assert {monthly.kek_epoch, daily.kek_epoch} <= {e.epoch for e in archive.epochs()}
    assert not {monthly.kek_epoch, daily.kek_epoch} & {d.epoch for d in before.archive_destroyed}
    final = ks.backup.maintain(now=receipt.backups.backup_final_date)
    assert {monthly.kek_epoch, daily.kek_epoch} <= {d.epoch for d in final.archive_destroyed}
