"""A request's long lists live in ``ks_erasure_items``, not in its document
(``keyshred.erasure.items``): the document every record rewrites stays the same
size whatever the subject holds, and a request an earlier release recorded with
its lists in the document resumes from there."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config as AlembicConfig

from keyshred import Keyshred, PutItem
from keyshred.erasure import items
from keyshred.errors import SubjectSuppressed
from keyshred.migrations import SCRIPT_LOCATION, VERSION_TABLE
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


def _alembic(ks: Keyshred, verb: str, revision: str) -> None:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", SCRIPT_LOCATION)
    with ks.catalog.engine.connect() as conn, conn.begin():
        cfg.attributes["connection"] = conn
        cfg.attributes["version_table"] = VERSION_TABLE
        getattr(command, verb)(cfg, revision)


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


@pytest.fixture
def past_closure(ks: Keyshred) -> Iterator[tuple[Keyshred, dict[str, int], str]]:
    """An erasure stopped right after its catalog step: closure recorded (its lists
    in ks_erasure_items), the derived step not run yet."""
    calls = {"n": 0}

    def rebuild(sources: list[Any]) -> Any:
        calls["n"] += 1
        return "summary without the victim"

    _, _, s_id = victim_summary(ks, rebuild=rebuild)

    def stop(step: str, req: Any) -> None:
        if step == "catalog":
            raise _Stop

    ks.erasure.on_step = stop
    try:
        with pytest.raises(_Stop):
            ks.erase(VICTIM, requested_by="dpo", reason="t", request_id="r-mig")
    finally:
        ks.erasure.on_step = None
    yield ks, calls, s_id


def test_a_schema_downgrade_and_upgrade_does_not_lose_an_in_flight_requests_closure(
    past_closure: tuple[Keyshred, dict[str, int], str],
) -> None:
    """r0014's downgrade dropped ks_erasure_items without putting the lists of the
    requests in flight back into their documents, and ``Extent.lists`` took no rows
    for an empty closure: the resumed request completed and signed a receipt without
    rebuilding Bob's summary, left sealed under the destroyed co-owned key."""
    ks, calls, s_id = past_closure
    assert _items(ks, "r-mig")["closure"] == [s_id]
    _alembic(ks, "downgrade", "0013")
    _alembic(ks, "upgrade", "head")
    req = ks.erasure.resume("r-mig")
    assert req.state == "completed", req.error
    if req.state == "completed":
        receipt = ks.erasure.receipt("r-mig")
        assert receipt is not None
        assert [(d.asset_id, d.action) for d in receipt.derived] == [(s_id, "rebuilt")], (
            "completed and signed without acting on the closure"
        )
        assert calls["n"] == 1
        summary = ks.memories.get("bob", ("s",), "d")
        assert summary is not None and summary.value == "summary without the victim"


def test_the_request_document_stays_small_during_the_derived_step(ks: Keyshred) -> None:
    """The closure's ids are still in the document as ``details.closure.shared[].assets``
    (every closure asset sealed under a co-owned key): a derived step that rewrote
    the document twice per asset wrote a volume quadratic in the number of derived
    assets (4.1 MB for 200). Its per-asset records write rows only."""
    sizes: dict[int, int] = {}
    for n in (3, 150):
        victim = f"v{n}@example.org"
        v = ks.memories.put(victim, ("m",), "k", "victim text")
        b = ks.memories.put(f"bob{n}", ("m",), "b", "bob text")
        for i in range(n):
            ks.derived.register(
                "digest",
                subject=f"bob{n}",
                namespace=("s",),
                key=f"d{i}",
                value="summary",
                produced_from=[v.memory_id, b.memory_id],
                producer="dg",
                producer_version="1",
                rebuild=lambda s: "rebuilt",
            )
        seen: list[int] = []
        coordinator = ks._erasure
        save = coordinator._save

        def spy(
            req: Any,
            receipt: Any = None,
            *,
            also: Any = None,
            doc: bool = True,
            seen: list[int] = seen,
            save: Any = save,
        ) -> None:
            if doc and "catalog" in req.doc["done"] and "derived" not in req.doc["done"]:
                seen.append(len(json.dumps(req.doc, sort_keys=True)))
            save(req, receipt, also=also, doc=doc)

        coordinator._save = spy  # type: ignore[method-assign]
        try:
            req = ks.erase(victim, requested_by="dpo", reason="t", request_id=f"r{n}")
        finally:
            del coordinator._save
        assert req.state == "completed", req.error
        sizes[n] = len(seen)  # documents written while the derived step ran
    assert sizes[150] == sizes[3], sizes


def test_a_stalled_thread_of_the_same_process_records_nothing_after_its_lease_ran_out(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker threads share one coordinator (``keyshred worker --concurrency``), whose
    ``_leases`` is keyed by request id. A thread whose lease ran out (its heartbeat
    could not renew it) while another thread took the request over and finished it
    finds no lease under the id any more: its saves are unconditional. It rewrites
    the completed request's document (steps, state) and writes progress rows into
    ks_erasure_items again. (The root cause predates r0014; the rows are new.)"""
    coordinator = ks._erasure
    coordinator._lease_seconds = 1.0
    gate = threading.Event()
    entered = threading.Event()
    calls = {"n": 0}

    def rebuild(sources: list[Any]) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            entered.set()
            gate.wait(30)
        return "summary without the victim"

    victim_summary(ks, rebuild=rebuild)
    ks.erasure.request(
        ks.subject_ref(VICTIM), None, requested_by="dpo", reason="t", request_id="r-two"
    )
    errors: list[BaseException] = []

    def stalled() -> None:
        try:
            ks.erasure.resume("r-two")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t1 = threading.Thread(target=stalled)
    t1.start()
    assert entered.wait(30)
    (lease,) = coordinator._leases.values()
    lease._stop.set()  # its heartbeat stops renewing (the database unreachable for it)
    time.sleep(1.5)  # its lease runs out
    done = ks.erasure.resume("r-two")  # another thread takes it over and completes it
    assert done.state == "completed", done.error
    before = ks.erasure.status("r-two")
    late: list[str] = []
    put_entry = items.put_entry

    def spy(conn: Any, request_id: str, step: str, item: str, **kw: Any) -> None:
        late.append(f"{step}:{item}:{'action' if 'action' in kw['entry'] else 'intent'}")
        put_entry(conn, request_id, step, item, **kw)

    monkeypatch.setattr(items, "put_entry", spy)
    gate.set()  # the stalled thread wakes up
    t1.join(60)
    after = ks.erasure.status("r-two")
    with ks.catalog.engine.connect() as conn:
        owner = conn.execute(
            sa.select(deletion_requests.c.lease_owner).where(
                deletion_requests.c.request_id == "r-two"
            )
        ).scalar()
    assert owner is None
    assert not late, ("progress rows written after the request completed", late)
    steps: dict[str, int] = {}
    for e in ks.audit.events(request_id="r-two", event="erasure.state"):
        step = e.data.get("step")
        if step is not None:
            steps[step] = steps.get(step, 0) + 1
    assert all(n == 1 for n in steps.values()), ("steps recorded twice", steps)
    assert after.updated_at == before.updated_at, (
        "the stalled thread recorded after losing its lease",
        before.state,
        after.state,
        after.steps_done,
        _items(ks, "r-two"),
    )
    assert not [k for k in _items(ks, "r-two") if k.startswith("progress:")]
    assert not errors, errors


def test_lost_rows_of_a_closure_stop_the_request_instead_of_completing_it(
    past_closure: tuple[Keyshred, dict[str, int], str],
) -> None:
    """Rows gone without a downgrade (a partial restore, a hand-made delete): the
    request fails with ``IntegrityError`` rather than completing on an empty closure."""
    ks, calls, _ = past_closure
    with ks.catalog.engine.begin() as conn:
        conn.execute(erasure_items.delete().where(erasure_items.c.request_id == "r-mig"))
    req = ks.erasure.resume("r-mig")
    assert req.state != "completed"
    assert req.error is not None and "IntegrityError" in req.error
    assert calls["n"] == 0
