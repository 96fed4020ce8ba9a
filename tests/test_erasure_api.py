"""The erasure's public API (issue 20, item 5): holds, request lists and
re-admission take a subject, as ``ks.erase`` does (``subject_ref=`` by keyword for a
caller that holds nothing else); rebuild functions registered by name: after a restart, a
derived asset whose producer no longer has a rebuild function is not silently
dropped: the erasure waits in ``manual_review`` naming the producer and version,
and completes once the application registers it again (on the handle, or in the
start-up registry ``keyshred.erasure.register_rebuilder``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from keyshred import Keyshred
from keyshred.erasure import derived as derived_module
from keyshred.erasure import register_rebuilder
from keyshred.errors import InvalidInput, SubjectSuppressed
from keyshred.storage.memories import Memory
from tests.storage.conftest import make_config

NS = ("m",)


def left(sources: list[Memory]) -> Any:
    return f"{len(sources)} sources left"


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict[tuple[str, str], Any]:
    fresh: dict[tuple[str, str], Any] = {}
    monkeypatch.setattr(derived_module, "_registry", fresh)
    return fresh


def populate(data: Path) -> str:
    with Keyshred.init(data, make_config(None)) as ks:
        src = ks.memories.put("ann", NS, "a", "ann likes jazz")
        own = ks.memories.put("ben", NS, "b", "ben likes chess")
        summary = ks.derived.register(
            "summary",
            subject="ben",
            namespace=("s",),
            key="sum",
            value="jazz and chess",
            produced_from=[src.memory_id, own.memory_id],
            producer="summarizer",
            producer_version="2",
            rebuild=left,  # known to this process only
        )
        return summary.memory_id


@pytest.mark.parametrize("where", ["handle", "registry"])
def test_unknown_producer_waits_in_manual_review_until_registered(
    where: str, tmp_path: Path, registry: dict[tuple[str, str], Any]
) -> None:
    data = tmp_path / "data"
    summary_id = populate(data)
    with Keyshred.open(data, make_config(None)) as ks:  # restarted: no rebuild function
        req = ks.erase("ann", requested_by="dpo", reason="test", request_id="r1")
        assert req.state == "manual_review"
        assert req.error is not None
        assert "producer summarizer version 2" in req.error and summary_id in req.error
        assert ks.erasure.receipt("r1") is None
        # Not dropped: the asset waits for its rebuild.
        assert ks.catalog.asset(summary_id) is not None
        assert ks.erasure.resume("r1").state == "manual_review"  # still unknown
    with Keyshred.open(data, make_config(None)) as ks:
        if where == "handle":
            ks.derived.register_producer("summarizer", "2", left)
        else:
            register_rebuilder("summarizer", "2", left)  # the application's start-up
        done = ks.erasure.resume("r1")
        assert done.state == "completed", done.error
        receipt = ks.erasure.receipt("r1")
        assert receipt is not None and all(c.passed for c in receipt.verification)
        assert [(d.asset_id, d.action) for d in receipt.derived] == [(summary_id, "rebuilt")]
        rebuilt = ks.memories.get("ben", ("s",), "sum")
        assert rebuilt is not None and rebuilt.value == "1 sources left"
    assert (("summarizer", "2") in registry) == (where == "registry")


def test_a_producer_that_returns_none_drops_its_asset(
    tmp_path: Path, registry: dict[tuple[str, str], Any]
) -> None:
    data = tmp_path / "data"
    summary_id = populate(data)
    register_rebuilder("summarizer", "2", lambda _sources: None)
    with Keyshred.open(data, make_config(None)) as ks:
        req = ks.erase("ann", requested_by="dpo", reason="test")
        assert req.state == "completed", req.error
        receipt = ks.erasure.receipt(req.request_id)
        assert receipt is not None
        assert [(d.asset_id, d.action) for d in receipt.derived] == [(summary_id, "dropped")]
        assert ks.memories.get("ben", ("s",), "sum") is None


def test_holds_requests_and_readmission_take_a_subject_or_a_named_ref(tmp_path: Path) -> None:
    with Keyshred.init(tmp_path / "data", make_config(None)) as ks:
        ref = ks.subject_ref("cy@example.org")
        hold = ks.erasure.place_hold("cy@example.org", reason="case-7", owner="legal")
        assert hold.subject_ref == ref
        assert ks.erasure.holds("cy@example.org") == ks.erasure.holds(subject_ref=ref) == [hold]
        assert ks.erasure.holds("someone-else") == []
        with pytest.raises(InvalidInput):
            ks.erasure.holds("cy@example.org", subject_ref=ref)  # one or the other
        with pytest.raises(InvalidInput):
            ks.erasure.place_hold(reason="case-7", owner="legal")  # neither
        req = ks.erase("cy@example.org", requested_by="dpo", reason="test")
        assert req.state == "legal_hold"
        ks.erasure.release_hold(hold.hold_id)
        assert ks.erasure.resume(req.request_id).state == "completed"
        assert ks.erasure.requests("cy@example.org") == ks.erasure.requests(subject_ref=ref)
        assert [r.request_id for r in ks.erasure.requests("cy@example.org")] == [req.request_id]
        assert ks.erasure.requests("someone-else") == []
        with pytest.raises(SubjectSuppressed):
            ks.memories.put("cy@example.org", NS, "k", 1)
        ks.erasure.readmit("cy@example.org")
        ks.memories.put("cy@example.org", NS, "k", 1)
