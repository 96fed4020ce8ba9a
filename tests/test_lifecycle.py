"""Data lifecycle on both catalogs: the retention scanner (clock-controlled),
consent withdrawal, legal holds, correction vs deletion."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from keyshred import Config, Keyshred
from keyshred.errors import ConsentRequired, NotFound, SubjectSuppressed
from keyshred.schema import audit_events

NS = ("notes",)


def config(catalog_url: str) -> Config:
    return Config.model_validate(
        {
            "storage": {"catalog_url": catalog_url},
            "scopes": {
                "chat": {"purpose": "chat", "basis": "contract", "max_retention_days": 1},
                "marketing": {"purpose": "marketing", "categories": ["preference"]},
            },
        }
    )


@pytest.fixture
def ks(catalog_url: str, tmp_path: Path) -> Iterator[Keyshred]:
    store = Keyshred.init(tmp_path / "data", config(catalog_url))
    yield store
    store.close()


def _at(ks: Keyshred, when: datetime) -> None:
    ks.memories._clock = lambda: when  # type: ignore[method-assign]


def test_retention_scanner_erases_exactly_the_expired(ks: Keyshred) -> None:
    t0 = datetime.now(UTC)
    _at(ks, t0)
    short = [
        ks.memories.put("ana", NS, f"chat{i}", {"text": f"chat {i}"}, scope="chat")
        for i in range(3)
    ]
    long = [ks.memories.put("ana", NS, f"keep{i}", {"text": f"keep {i}"}) for i in range(3)]
    ks.memories.put("bob", NS, "chat", {"text": "bob chat"}, scope="chat")
    ks.memories.put("bob", NS, "keep", {"text": "bob keep"})
    ks.memories.flush("ana")  # some expired rows in Parquet segments, bob's still in the log

    def summarize(sources: list) -> str:  # type: ignore[type-arg]
        return " + ".join(sorted(m.value["text"] for m in sources))

    summary = ks.derived.register(
        "summary",
        subject="ana",
        namespace=("derived",),
        key="summary",
        value=summarize([short[0], long[0]]),
        produced_from=[short[0].memory_id, long[0].memory_id],
        producer="summarizer",
        producer_version="1",
        rebuild=summarize,
    )
    later = t0 + timedelta(days=2)
    _at(ks, later)
    # Suppressed at once: past retain-until, no read returns them, before any scan.
    assert ks.memories.get("ana", NS, "chat0") is None
    assert {m.key for m in ks.memories.search("ana", NS, limit=50)} == {
        f"keep{i}" for i in range(3)
    }
    expired = ks.retention.expired(later)
    assert set(expired[ks.subject_ref("ana")]) == {m.memory_id for m in short}
    assert len(expired[ks.subject_ref("bob")]) == 1  # found through the catalog (in the log)

    report = ks.retention.run(now=later)
    assert report.expired_memories == 4 and report.subjects == 2
    assert all(r["state"] == "completed" for r in report.requests)
    receipt = ks.erasure.receipt(report.requests[0]["request_id"])
    assert receipt is not None and receipt.kind == "retention"
    assert receipt.key_ids == [] and len(receipt.assets) in (1, 3)
    assert all(c.passed for c in receipt.verification)
    # Exactly those are gone (physically), the rest untouched, the summary rebuilt.
    assert ks.memories.rows_by_id(ks.subject_ref("ana"), [m.memory_id for m in short]) == {}
    for i in range(3):
        assert ks.memories.get("ana", NS, f"keep{i}").value == {"text": f"keep {i}"}  # type: ignore[union-attr]
    rebuilt = ks.memories.get("ana", ("derived",), "summary")
    assert rebuilt is not None and rebuilt.value == "keep 0"
    assert rebuilt.sources == (long[0].memory_id,)
    assert summary.memory_id == rebuilt.memory_id
    assert ks.memories.get("bob", NS, "keep") is not None
    # Idempotent: nothing left to do.
    again = ks.retention.run(now=later)
    assert again.expired_memories == 0


def test_retention_respects_legal_hold(ks: Keyshred) -> None:
    t0 = datetime.now(UTC)
    _at(ks, t0)
    ks.memories.put("cid", NS, "c", {"text": "c"}, scope="chat")
    later = t0 + timedelta(days=2)
    _at(ks, later)
    hold = ks.erasure.place_hold("cid", reason="litigation-42", owner="legal")
    report = ks.retention.run(now=later)
    assert report.held == 1 and report.requests[0]["state"] == "legal_hold"
    rid = report.requests[0]["request_id"]
    assert ks.erasure.status(rid).state == "legal_hold"
    assert ks.memories.rows_by_id(
        ks.subject_ref("cid"), ks.retention.expired(later)[ks.subject_ref("cid")]
    )
    ks.erasure.release_hold(hold.hold_id)
    done = ks.erasure.resume(rid)
    assert done.state == "completed"
    receipt = ks.erasure.receipt(rid)
    assert receipt is not None and receipt.legal_hold_history


def test_erasure_under_hold_waits_then_completes(ks: Keyshred) -> None:
    ks.memories.put("dan", NS, "k", {"v": 1})
    hold = ks.erasure.place_hold("dan", reason="audit-2026", owner="legal")
    req = ks.erase("dan", requested_by="dpo", reason="art17")
    assert req.state == "legal_hold"
    assert ks.memories.get("dan", NS, "k") is not None  # nothing happened yet
    ks.erasure.release_hold(hold.hold_id)
    assert ks.erasure.resume(req.request_id).state == "completed"
    events = [e for e in ks.audit.events() if e.event.startswith("hold.")]
    assert [e.event for e in events] == ["hold.placed", "hold.released"]


def test_retention_withdraw_is_a_deprecated_alias_of_consent_withdraw(ks: Keyshred) -> None:
    ks.consent.grant("eve", scope="marketing", category="preference")
    ks.memories.put(
        "eve", NS, "likes", {"text": "likes jazz"}, scope="marketing", category="preference"
    )
    with pytest.warns(DeprecationWarning, match=r"ks\.consent\.withdraw"):
        req = ks.retention.withdraw("eve", scope="marketing", category="preference")
    assert req.state == "completed", req.error
    receipt = ks.erasure.receipt(req.request_id)
    assert receipt is not None and receipt.kind == "consent-withdrawal"
    assert ks.memories.get("eve", NS, "likes") is None
    assert [c.status for c in ks.consent.list("eve")] == ["revoked"]


def test_consent_withdrawal_erases_one_scope_only(ks: Keyshred) -> None:
    ks.consent.grant("eve", scope="marketing", category="preference")
    ks.memories.put(
        "eve", NS, "likes", {"text": "likes jazz"}, scope="marketing", category="preference"
    )
    ks.memories.put("eve", NS, "order", {"text": "order 7"})
    old_keys = {r.key_id for r in ks.keyring.store.for_subject(ks.subject_ref("eve"), "marketing")}
    req = ks.consent.withdraw("eve", "marketing", category="preference")
    assert req.state == "completed", req.error
    receipt = ks.erasure.receipt(req.request_id)
    assert (
        receipt is not None
        and receipt.kind == "consent-withdrawal"
        and receipt.scope == "marketing"
    )
    with pytest.raises(ConsentRequired):  # new writes fail
        ks.memories.put("eve", NS, "x", {"t": 1}, scope="marketing", category="preference")
    assert ks.memories.get("eve", NS, "likes") is None
    assert ks.memories.get("eve", NS, "order").value == {"text": "order 7"}  # type: ignore[union-attr]
    history = ks.consent.list("eve")
    assert [c.status for c in history] == ["revoked"] and history[0].policy_version == "1"
    # Granting again starts a new scope key: nothing old comes back.
    ks.consent.grant("eve", scope="marketing", category="preference", policy_version="2")
    ks.memories.put(
        "eve", NS, "likes2", {"text": "likes blues"}, scope="marketing", category="preference"
    )
    new_keys = {r.key_id for r in ks.keyring.store.for_subject(ks.subject_ref("eve"), "marketing")}
    assert new_keys and not (new_keys & old_keys)
    assert ks.memories.get("eve", NS, "likes") is None
    assert [c.policy_version for c in ks.consent.list("eve")] == ["1", "2"]


def test_correction_keeps_history_deletion_and_erasure_do_not(ks: Keyshred) -> None:
    ks.memories.put("fay", NS, "city", {"city": "Lyon"})
    ks.memories.correct("fay", NS, "city", {"city": "Paris"}, reason="moved")
    ks.memories.correct("fay", NS, "city", {"city": "Nice"}, reason="moved-again")
    history = ks.memories.history("fay", NS, "city")
    assert [h["value"]["city"] for h in history] == ["Lyon", "Paris", "Nice"]
    assert history[0]["reason"] == "moved" and history[-1]["valid_to"] is None
    assert [m.key for m in ks.memories.search("fay", (), limit=10)] == ["city"]  # no history rows
    with pytest.raises(NotFound):
        ks.memories.correct("fay", NS, "nothing", {"x": 1}, reason="typo")
    # Deletion takes the value and every version.
    ks.memories.put("fay", NS, "pet", {"pet": "cat"})
    ks.memories.correct("fay", NS, "pet", {"pet": "dog"}, reason="typo")
    assert ks.memories.delete("fay", NS, "pet")
    assert ks.memories.history("fay", NS, "pet") == []
    events = {e.event for e in ks.audit.events()}
    assert {"memory.corrected", "memory.deleted"} <= events
    # Erasure takes the value and its whole history.
    ref = ks.subject_ref("fay")
    ids = list(
        ks.memories.rows_by_id(
            ref, [r.memory_id for r in ks.memories._partition(ref).rows.values()]
        )
    )
    assert len(ids) == 3  # city + 2 history versions
    assert ks.erase("fay", requested_by="dpo", reason="art17").state == "completed"
    with pytest.raises(SubjectSuppressed):
        ks.memories.history("fay", NS, "city")
    assert not ks.memories.partition_path(ref).exists()


def test_retention_show_lists_every_layer(ks: Keyshred) -> None:
    shown = ks.retention.show()
    assert set(shown) >= {"memories", "vectors", "tokens", "checkpoints", "audit", "backups"}
    assert shown["memories"]["scopes"]["chat"]["max_retention_days"] == 1
    assert audit_events.name == "ks_audit"


def test_idle_threads_expire(catalog_url: str, tmp_path: Path) -> None:
    from langgraph.checkpoint.base import empty_checkpoint

    from keyshred.integrations.langgraph import KeyshredSaver

    cfg = config(catalog_url).model_copy(
        update={
            "retention": config(catalog_url).retention.model_copy(update={"checkpoints_days": 30})
        }
    )
    with Keyshred.init(tmp_path / "d", cfg) as ks:
        saver = KeyshredSaver(ks)
        conf = {"configurable": {"thread_id": "t1", "checkpoint_ns": "", "subject_id": "gus"}}
        saver.put(conf, empty_checkpoint(), {"source": "input", "step": 0}, {})
        assert ks.retention.run(now=datetime.now(UTC) + timedelta(days=29)).threads_deleted == 0
        report = ks.retention.run(now=datetime.now(UTC) + timedelta(days=31))
        assert report.threads_deleted == 1
        assert saver.get_tuple(conf) is None
        ref = ks.checkpoints.thread_ref("t1")
        assert any(t.scope == f"~thread:{ref}" for t in ks.keyring.store.tombstones())


def test_the_cli_withdraws_consent_through_ks_consent(tmp_path: Path) -> None:
    import json
    import warnings

    from typer.testing import CliRunner

    from keyshred.cli import app

    data = tmp_path / "cli"
    with Keyshred.init(data, config(f"sqlite:///{tmp_path / 'cli-catalog.db'}")) as ks:
        ks.consent.grant("eve", scope="marketing", category="preference")
        ks.memories.put(
            "eve", NS, "likes", {"text": "likes jazz"}, scope="marketing", category="preference"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # not the deprecated alias
        result = CliRunner().invoke(
            app,
            ["consent", "withdraw", "eve", "--scope", "marketing", "--path", str(data), "--json"],
        )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["state"] == "completed"
    with Keyshred.open(data) as ks:
        assert ks.memories.get("eve", NS, "likes") is None
        assert [c.status for c in ks.consent.list("eve")] == ["revoked"]


def test_purged_tokens_leave_no_sealed_copy_in_the_catalogs_wal(tmp_path: Path) -> None:
    """The retention run deleted expired tokens (``secure_delete`` zeroed their
    pages in ``catalog.db``), but ``catalog.db-wal`` kept the page images holding
    each token's sealed value, under the subject's live scope key, until SQLite
    happened to overwrite them. The purge now checkpoints and truncates the WAL."""
    from tests.storage.conftest import make_config

    with Keyshred.init(tmp_path / "data", make_config(None)) as ks:
        ks.vault.sanitize("mail alice.smith@example.com", "alice", "support", timedelta(seconds=1))
        ks.vault.flush()  # group commit: the row may not be in the catalog yet
        with ks.catalog.engine.connect() as conn:
            rows = conn.exec_driver_sql("SELECT * FROM ks_tokens").fetchall()
        sealed = [bytes(c) for r in rows for c in r if isinstance(c, bytes) and len(c) > 30]
        assert sealed
        wal = ks.path / "catalog" / "catalog.db-wal"
        assert any(s[-32:] in wal.read_bytes() for s in sealed)  # written through the WAL
        report = ks.retention.run(now=datetime.now(UTC) + timedelta(days=2))
        assert report.tokens_deleted == 1
        for path in ks.path.rglob("*"):
            if path.is_file():
                raw = path.read_bytes()
                assert not any(s[-32:] in raw for s in sealed), f"a purged token in {path.name}"
