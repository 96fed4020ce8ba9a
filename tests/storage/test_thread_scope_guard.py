"""A thread belongs to its subject *and* to its policy scope (``KeyshredSaver(ks,
scope=…)``). While that scope is suppressed (an erasure of the subject's scope is
under way, or stopped in manual review), the thread neither reads nor writes, as
the subject's memories of that scope do not; its subject's threads of other scopes
go on. Before, only a whole-subject suppression stopped a thread: a scope's
erasure left its threads readable until the erasure dropped them."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from langgraph.checkpoint.base import empty_checkpoint

from keyshred import Keyshred
from keyshred.errors import SubjectSuppressed
from keyshred.integrations.langgraph import KeyshredSaver
from keyshred.storage.schema import checkpoint_writes, checkpoints, threads
from tests.storage.conftest import make_config

ANA = "ana@example.org"


def _cfg(thread: str, cid: str | None = None, **extra: Any) -> dict[str, Any]:
    conf: dict[str, Any] = {"thread_id": thread, "checkpoint_ns": "", "subject_id": ANA, **extra}
    if cid is not None:
        conf["checkpoint_id"] = cid
    return {"configurable": conf}


def _put(saver: KeyshredSaver, thread: str, note: str) -> dict[str, Any]:
    latest = saver.get_tuple(_cfg(thread))
    cp = empty_checkpoint()
    cp["channel_values"] = {"notes": [note]}
    stored = saver.put(_cfg(thread) if latest is None else latest.config, cp, {"step": 1}, {})
    cfg = {"configurable": {**stored["configurable"], "subject_id": ANA}}
    saver.put_writes(cfg, [("notes", f"{note} pending")], "task", "~a")
    return cfg


def _rows(ks: Keyshred) -> tuple[int, int, int]:
    with ks.catalog.engine.connect() as conn:
        return tuple(  # type: ignore[return-value]
            int(conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one())
            for t in (threads, checkpoints, checkpoint_writes)
        )


def test_a_suppressed_scope_stops_its_threads_and_only_them(ks: Keyshred) -> None:
    marketing = KeyshredSaver(ks, scope="marketing")
    default = KeyshredSaver(ks)
    stored = _put(marketing, "campaign", "likes hiking")
    _put(default, "support", "asked about billing")
    cid = stored["configurable"]["checkpoint_id"]

    ks.catalog.suppress(ks.subject_ref(ANA), scope="marketing")
    before = _rows(ks)
    reads = [
        lambda: marketing.get_tuple(_cfg("campaign")),
        lambda: marketing.get_tuple(_cfg("campaign", cid)),
        lambda: list(marketing.list(_cfg("campaign"))),
    ]
    writes = [
        lambda: _put(marketing, "campaign", "more"),
        lambda: marketing.put_writes(stored, [("notes", "late")], "task-2", "~b"),
        lambda: _put(marketing, "a-new-campaign", "new"),  # a new thread in the scope
    ]
    for call in reads + writes:
        with pytest.raises(SubjectSuppressed):
            call()
    assert _rows(ks) == before
    # A listing across threads skips it, as it skips a suppressed subject.
    listed = {t.config["configurable"]["thread_id"] for t in default.list(None)}
    assert listed == {"support"}
    # The subject's thread of another scope reads and writes on.
    _put(default, "support", "second question")
    got = default.get_tuple(_cfg("support"))
    assert got is not None and got.checkpoint["channel_values"] == {"notes": ["second question"]}


def test_a_scope_erasure_takes_its_threads_and_reopens_the_scope(ks: Keyshred) -> None:
    marketing = KeyshredSaver(ks, scope="marketing")
    default = KeyshredSaver(ks)
    _put(marketing, "campaign", "likes hiking")
    _put(default, "support", "asked about billing")
    seen: dict[str, str] = {}

    def during(step: str, *_: object) -> None:
        # Inside the erasure, after each step: the scope's thread is shut, then gone.
        try:
            got = marketing.get_tuple(_cfg("campaign"))
        except SubjectSuppressed:
            seen[step] = "refused"
        else:
            assert got is None, f"read inside the erasure, after {step}"
            seen[step] = "gone"

    ks.erasure.on_step = during
    req = ks.erase(ANA, "marketing", requested_by="dpo", reason="consent withdrawn")
    ks.erasure.on_step = None
    assert req.state == "completed"
    assert seen and next(iter(seen.values())) == "refused", seen
    assert marketing.get_tuple(_cfg("campaign")) is None
    got = default.get_tuple(_cfg("support"))
    assert got is not None and got.checkpoint["channel_values"] == {
        "notes": ["asked about billing"]
    }
    # Completed: the scope takes new threads again (as it takes new memories).
    _put(marketing, "campaign", "a fresh start")
    got = marketing.get_tuple(_cfg("campaign"))
    assert got is not None and got.checkpoint["channel_values"] == {"notes": ["a fresh start"]}


def test_another_handles_suppression_stops_a_listing_under_way(
    catalog_url: str, tmp_path: Path
) -> None:
    """The listing's process hears of the suppression through the eviction event
    (PostgreSQL ``LISTEN``, SQLite's in-process bus) and reads the guard again before
    its next row: nothing more of the scope's thread is returned."""
    a = Keyshred.init(tmp_path / "data", make_config(catalog_url))
    b = Keyshred.open(tmp_path / "data", make_config(catalog_url))
    try:
        marketing = KeyshredSaver(a, scope="marketing")
        for i in range(3):
            _put(marketing, "campaign", f"note {i}")
        for listing in (marketing.list(_cfg("campaign")), marketing.list(None)):
            assert next(listing).checkpoint["channel_values"] == {"notes": ["note 2"]}
            heard = a._eviction.evicted
            b.catalog.suppress(b.subject_ref(ANA), scope="marketing")
            deadline = time.monotonic() + 10
            while a._eviction.evicted == heard and time.monotonic() < deadline:
                time.sleep(0.01)
            assert a._eviction.evicted > heard, "the event never arrived"
            rest: list[Any] = []
            with contextlib.suppress(SubjectSuppressed):
                rest.extend(listing)
            assert rest == []
            b.catalog.release_scope(b.subject_ref(ANA), "marketing")
    finally:
        b.close()
        a.close()
