"""A request's long lists live in ``ks_erasure_items``, not in its document
(``keyshred.erasure.items``): the document every record rewrites stays the same
size whatever the subject holds, and a request an earlier release recorded with
its lists in the document resumes from there."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from keyshred import Keyshred, PutItem
from keyshred.errors import SubjectSuppressed
from keyshred.schema import deletion_requests, erasure_items
from keyshred.storage import faults
from tests.scenarios import VICTIM, victim_summary


class _Stop(Exception):
    pass


def _doc(ks: Keyshred, request_id: str) -> str:
    with ks.catalog.engine.connect() as conn:
        return str(
            conn.execute(
                sa.select(deletion_requests.c.doc).where(
                    deletion_requests.c.request_id == request_id
                )
            ).scalar_one()
        )


def _items(ks: Keyshred, request_id: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    with ks.catalog.engine.connect() as conn:
        rows = conn.execute(
            sa.select(erasure_items.c.list, erasure_items.c.item)
            .where(erasure_items.c.request_id == request_id)
            .order_by(erasure_items.c.list, erasure_items.c.pos)
        )
        for name, item in rows:
            out.setdefault(name, []).append(item)
    return out


def test_the_request_document_does_not_grow_with_the_subject(ks: Keyshred) -> None:
    """Before, the closure step wrote every asset id into the document, which each
    later record rewrote whole: 161 KB for a 2,000-memory subject."""
    sizes = {}
    for subject, n in (("small@example.org", 5), ("large@example.org", 400)):
        ks.memories.put_many(
            subject, [PutItem(("m",), f"k{i}", {"t": i}, index=False) for i in range(n)]
        )
        req = ks.erase(subject, requested_by="dpo", reason="t", request_id=subject[:5])
        assert req.state == "completed", req.error
        sizes[n] = len(_doc(ks, req.request_id))
        lists = _items(ks, req.request_id)
        assert len(lists["own"]) == n
        assert "closure" not in lists  # nobody else's asset came from them
        assert not [k for k in lists if k.startswith("progress:")]
        receipt = ks.erasure.receipt(req.request_id)
        assert receipt is not None
        counted = {a.action: a.count for a in receipt.stores if a.store == "catalog"}
        assert counted["memory-assets"] == n
    assert abs(sizes[400] - sizes[5]) < 200, sizes


@pytest.fixture
def stopped(ks: Keyshred) -> Iterator[tuple[Keyshred, dict[str, int], str]]:
    """An erasure stopped inside its derived step, its action recorded."""
    calls = {"n": 0}

    def rebuild(sources: list[Any]) -> Any:
        calls["n"] += 1
        return "summary without the victim"

    _, _, s_id = victim_summary(ks, rebuild=rebuild)

    def stop(point: str) -> None:
        if point == "erase.derived":
            raise _Stop

    faults.hook = stop
    try:
        with pytest.raises(_Stop):
            ks.erase(VICTIM, requested_by="dpo", reason="t", request_id="r-old")
    finally:
        faults.hook = None
    yield ks, calls, s_id


def test_derived_progress_is_a_row_per_asset_until_the_step_is_done(
    stopped: tuple[Keyshred, dict[str, int], str],
) -> None:
    ks, calls, s_id = stopped
    lists = _items(ks, "r-old")
    assert lists["progress:derived"] == [s_id]  # the action, recorded as one row
    assert lists["closure"] == [s_id]
    assert "derived" not in json.loads(_doc(ks, "r-old")).get("progress", {})
    req = ks.erasure.resume("r-old")
    assert req.state == "completed", req.error
    assert calls["n"] == 1, "the resumed step rebuilt the summary again"
    assert "progress:derived" not in _items(ks, "r-old")
    receipt = ks.erasure.receipt("r-old")
    assert receipt is not None
    assert [(d.asset_id, d.action) for d in receipt.derived] == [(s_id, "rebuilt")]


def test_a_request_recorded_with_its_lists_in_the_document_resumes(
    stopped: tuple[Keyshred, dict[str, int], str],
) -> None:
    """As an earlier release recorded it: the closure's lists and the derived
    step's progress in the document, no rows."""
    ks, calls, s_id = stopped
    lists = _items(ks, "r-old")
    with ks.catalog.engine.begin() as conn:
        entries = [
            json.loads(e)
            for (e,) in conn.execute(
                sa.select(erasure_items.c.entry).where(
                    erasure_items.c.request_id == "r-old",
                    erasure_items.c.list == "progress:derived",
                )
            )
        ]
        doc = json.loads(_doc(ks, "r-old"))
        closure = doc["details"]["closure"]
        closure["own"], closure["closure"] = lists["own"], lists["closure"]
        del closure["own_n"], closure["closure_n"]
        doc["progress"] = {"derived": entries}
        conn.execute(
            deletion_requests.update()
            .where(deletion_requests.c.request_id == "r-old")
            .values(doc=json.dumps(doc))
        )
        conn.execute(erasure_items.delete().where(erasure_items.c.request_id == "r-old"))
    req = ks.erasure.resume("r-old")
    assert req.state == "completed", req.error
    assert calls["n"] == 1, "the progress in the document was not read"
    assert "derived" not in json.loads(_doc(ks, "r-old")).get("progress", {})
    assert not _items(ks, "r-old")  # the lists stay in the document; progress moved, then settled
    receipt = ks.erasure.receipt("r-old")
    assert receipt is not None
    assert [(d.asset_id, d.action) for d in receipt.derived] == [(s_id, "rebuilt")]
    with pytest.raises(SubjectSuppressed):
        ks.memories.get(VICTIM, ("m",), "k")
    summary = ks.memories.get("bob", ("s",), "d")
    assert summary is not None
    assert summary.value == "summary without the victim"
