"""``KeyshredSaver`` against LangGraph's own conformance suite (every base and
extended capability, a fresh saver per capability suite), on SQLite and PostgreSQL;
plus what the suite does not check: after ``delete_thread`` and after subject erasure
no byte of the thread is left, and a real graph runs, is interrupted and resumed."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypedDict

import pytest
import sqlalchemy as sa
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.report import ProgressCallbacks

from keyshred import Keyshred
from keyshred.errors import InvalidInput, SubjectErased, SubjectSuppressed
from keyshred.integrations.langgraph import KeyshredSaver
from keyshred.storage.schema import checkpoint_writes, checkpoints
from tests.storage.conftest import make_config


def files_of(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


@pytest.mark.parametrize("construction", ["default", "from_conn_string", "resolver"])
def test_conformance_full(catalog_url: str, tmp_path: Path, construction: str) -> None:
    """FULL as a user first writes it (issue 24): ``KeyshredSaver(ks)`` and
    ``from_conn_string`` (conformance threads name no user: each thread is its own
    subject), and with a resolver that puts every thread under one user."""
    counter = iter(range(1000))

    @checkpointer_test(name="KeyshredSaver")
    async def keyshred_saver() -> AsyncIterator[KeyshredSaver]:
        folder = tmp_path / f"d{next(counter)}"
        if construction == "from_conn_string":
            if catalog_url.startswith("postgresql"):
                # One local folder (its local KEK wraps the key store in PostgreSQL;
                # another folder's KEK could not unwrap it): as a restarted worker.
                local = tmp_path / "local"
                with KeyshredSaver.from_conn_string(catalog_url, path=local) as saver:
                    yield saver
            else:
                with KeyshredSaver.from_conn_string(folder) as saver:
                    yield saver
            return
        ks = Keyshred.init(folder, make_config(catalog_url))
        if construction == "default":
            yield KeyshredSaver(ks)
        else:
            yield KeyshredSaver(ks, subject=lambda config: "conformance-user")
        ks.close()

    report = asyncio.run(validate(keyshred_saver, progress=ProgressCallbacks.quiet()))
    report.print_report()
    failures = {name: result.failures for name, result in report.results.items() if result.failures}
    assert report.conformance_level() == "FULL", failures
    assert report.passed_all(), failures


@pytest.fixture
def ks(catalog_url: str, tmp_path: Path) -> Any:
    store = Keyshred.init(tmp_path / "data", make_config(catalog_url))
    yield store
    store.close()


def _config(thread: str, subject: str | None = "ana") -> dict[str, Any]:
    conf: dict[str, Any] = {"thread_id": thread, "checkpoint_ns": ""}
    if subject:
        conf["subject_id"] = subject
    return {"configurable": conf}


class State(TypedDict):
    notes: list[str]


def _graph(saver: KeyshredSaver, interrupt: bool) -> Any:
    from langgraph.graph import END, START, StateGraph

    def remember(state: State) -> dict[str, Any]:
        return {"notes": [*state["notes"], "remembered"]}

    def answer(state: State) -> dict[str, Any]:
        return {"notes": [*state["notes"], "answered"]}

    g = StateGraph(State)
    g.add_node("remember", remember)
    g.add_node("answer", answer)
    g.add_edge(START, "remember")
    g.add_edge("remember", "answer")
    g.add_edge("answer", END)
    return g.compile(checkpointer=saver, interrupt_before=["answer"] if interrupt else None)


def _ciphertexts(ks: Keyshred, thread_ref: str) -> list[bytes]:
    with ks.catalog.engine.connect() as conn:
        rows = [
            bytes(r[0])
            for r in conn.execute(
                sa.select(checkpoints.c.data).where(checkpoints.c.thread_ref == thread_ref)
            )
        ]
        rows += [
            bytes(r[0])
            for r in conn.execute(
                sa.select(checkpoint_writes.c.data).where(
                    checkpoint_writes.c.thread_ref == thread_ref
                )
            )
        ]
    return rows


def test_graph_interrupt_resume_and_delete_thread(ks: Keyshred, tmp_path: Path) -> None:
    probe = f"zq{uuid.uuid4().hex[:10]}"
    saver = KeyshredSaver(ks)
    graph = _graph(saver, interrupt=True)
    cfg = _config("t-1")
    graph.invoke({"notes": [f"{probe} secret"]}, cfg)  # stops before "answer"
    state = graph.get_state(cfg)
    assert state.next == ("answer",)
    assert state.values["notes"] == [f"{probe} secret", "remembered"]
    # A new saver (another process, say) resumes from the stored checkpoint.
    resumed = _graph(KeyshredSaver(ks), interrupt=True)
    out = resumed.invoke(None, cfg)
    assert out["notes"] == [f"{probe} secret", "remembered", "answered"]
    assert len(list(saver.list(cfg))) >= 4
    with pytest.raises(InvalidInput):  # a thread never changes subject
        graph.invoke({"notes": []}, _config("t-1", subject="bob"))

    # The suite's question plus ours: after delete_thread, no byte is left.
    ref = ks.checkpoints.thread_ref("t-1")
    blobs = _ciphertexts(ks, ref)
    assert blobs
    for path in files_of(ks.path):
        assert probe.encode() not in path.read_bytes(), path  # never plaintext
    saver.delete_thread("t-1")
    assert saver.get_tuple(cfg) is None and list(saver.list(cfg)) == []
    if ks.catalog.dialect == "sqlite":
        for path in files_of(ks.path):
            data = path.read_bytes()
            for blob in blobs:
                assert blob[-32:] not in data, path  # not in the database, WAL or journal
    # And the key is gone: any surviving copy (a backup, a dead tuple) is noise.
    tomb = [t for t in ks.keyring.store.tombstones() if t.scope == f"~thread:{ref}"]
    assert len(tomb) == 1
    with pytest.raises(SubjectErased):
        ks.keyring.data_key_by_id(tomb[0].key_ids[0])
    # The thread id can start a new conversation (new key).
    graph.invoke({"notes": ["again"]}, cfg)
    assert graph.get_state(cfg).values["notes"] == ["again", "remembered"]


def test_subject_erasure_takes_every_thread(ks: Keyshred) -> None:
    probe = f"zq{uuid.uuid4().hex[:10]}"
    saver = KeyshredSaver(ks)
    graph = _graph(saver, interrupt=False)
    for t in ("a-1", "a-2"):
        graph.invoke({"notes": [f"{probe} {t}"]}, _config(t, "ana"))
    graph.invoke({"notes": ["bob's"]}, _config("b-1", "bob"))
    refs = [ks.checkpoints.thread_ref(t) for t in ("a-1", "a-2")]
    blobs = [b for r in refs for b in _ciphertexts(ks, r)]
    req = ks.erase("ana", requested_by="dpo", reason="art17", probes=[probe])
    assert req.state == "completed", req.error
    receipt = ks.erasure.receipt(req.request_id)
    assert receipt is not None
    assert any(s.store == "checkpoints" and s.count > 0 for s in receipt.stores)
    assert any(c.name == "no thread or checkpoint left" and c.passed for c in receipt.verification)
    with pytest.raises(SubjectSuppressed):
        saver.get_tuple(_config("a-1"))
    listed = list(saver.list(None))
    assert {t.config["configurable"]["thread_id"] for t in listed} == {"b-1"}
    assert graph.get_state(_config("b-1", "bob")).values["notes"] == [
        "bob's",
        "remembered",
        "answered",
    ]
    if ks.catalog.dialect == "sqlite":
        for path in files_of(ks.path):
            data = path.read_bytes()
            assert probe.encode() not in data
            for blob in blobs:
                assert blob[-32:] not in data, path


def test_async_twins_and_missing_subject(ks: Keyshred) -> None:
    saver = KeyshredSaver(ks)
    graph = _graph(saver, interrupt=False)

    async def run() -> list[str]:
        out = await graph.ainvoke({"notes": ["x"]}, _config("async-1"))
        tuples = [t async for t in saver.alist(_config("async-1"))]
        assert tuples
        return list(out["notes"])

    assert asyncio.run(run()) == ["x", "remembered", "answered"]
    # A thread that names no user is its own subject (issue 24): it runs.
    assert graph.invoke({"notes": []}, _config("nobody", subject=None))["notes"] == [
        "remembered",
        "answered",
    ]


def test_a_write_racing_delete_thread_fails_and_brings_nothing_back(ks: Keyshred) -> None:
    """A graph step that looked its thread up before ``delete_thread`` and writes
    after it: the write fails (the thread's key is gone and never made anew), and
    no row or key of the thread exists afterwards."""
    from keyshred.errors import NotFound
    from keyshred.storage.checkpoints import CheckpointRow, WriteRow, thread_scope

    store = ks.checkpoints
    th = store.ensure_thread("race-1", ks.subject_ref("ana"), "default")
    store.put_checkpoint(th, CheckpointRow("race-1", "", "c1", None, b"probe-race-1"), None)
    store.drop_thread("race-1")
    with pytest.raises(NotFound):
        store.put_checkpoint(th, CheckpointRow("race-1", "", "c2", "c1", b"probe-race-2"), None)
    with pytest.raises(NotFound):
        store.put_writes(th, "", "c2", [WriteRow("t", 0, "ch", "", b"probe-race-3")], replace=False)
    assert ks.keyring.store.find(th.subject_ref, thread_scope(th.thread_ref)) is None
    with ks.catalog.engine.connect() as conn:
        for table in (checkpoints, checkpoint_writes):
            n = conn.execute(
                sa.select(sa.func.count())
                .select_from(table)
                .where(table.c.thread_ref == th.thread_ref)
            ).scalar_one()
            assert n == 0
    # The same thread id starts afresh, under a new key.
    again = store.ensure_thread("race-1", ks.subject_ref("ana"), "default")
    store.put_checkpoint(again, CheckpointRow("race-1", "", "c3", None, b"fresh"), None)
    assert store.get(again, "", None) is not None


def test_the_thread_caches_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that touches more threads than the caches keep starts them over (its
    memory does not grow with the store), and every thread still reads and lists."""
    from langgraph.checkpoint.base import empty_checkpoint

    import keyshred.integrations.langgraph.saver as saver_module
    import keyshred.storage.checkpoints as checkpoints_module

    monkeypatch.setattr(checkpoints_module, "_THREADS_KEPT", 3)
    monkeypatch.setattr(saver_module, "_THREAD_IDS_KEPT", 3)
    with Keyshred.init(tmp_path / "data") as ks:
        saver = KeyshredSaver(ks)
        for i in range(8):
            config = {"configurable": {"thread_id": f"t{i}", "checkpoint_ns": "", "user_id": "u"}}
            saver.put(config, empty_checkpoint(), {"step": i}, {})
        for i in range(8):
            got = saver.get_tuple({"configurable": {"thread_id": f"t{i}", "user_id": "u"}})
            assert got is not None and got.metadata["step"] == i
            assert len(ks.checkpoints._threads) <= 3
        listed = {t.config["configurable"]["thread_id"] for t in saver.list(None)}
        assert listed == {f"t{i}" for i in range(8)}
        assert len(saver._thread_ids) <= 3


def test_pending_writes_come_in_task_path_task_id_idx_order(ks: Keyshred) -> None:
    # PostgresSaver's order (task_path, task_id, idx), compared by code point on both
    # databases (a PostgreSQL collation would put "~" and capitals elsewhere). A
    # (task_id, idx) is stored once per checkpoint, as in LangGraph's savers.
    saver = KeyshredSaver(ks)
    from langgraph.checkpoint.base import empty_checkpoint

    stored = saver.put(_config("ordered"), empty_checkpoint(), {}, {})
    stored["configurable"]["subject_id"] = "ana"
    writes = [
        ("~__pregel_pull, b", "t2", [("c", 1), ("d", 2)]),
        ("a", "t9", [("e", 3)]),
        ("B", "t1", [("f", 4)]),
        ("~__pregel_pull, b", "t0", [("g", 5)]),
        ("", "t5", [("h", 6)]),
    ]
    for path, task, values in writes:
        saver.put_writes(stored, values, task, path)
    got = saver.get_tuple(stored)
    assert got is not None
    expected = sorted(
        (path, task, idx, ch, v) for path, task, vals in writes for idx, (ch, v) in enumerate(vals)
    )
    assert got.pending_writes == [(task, ch, v) for _, task, _, ch, v in expected]
    assert [w[0] for w in got.pending_writes] == ["t5", "t1", "t9", "t0", "t2", "t2"]
    # The listings (one thread, and across threads) agree with get_tuple.
    listed = list(saver.list(_config("ordered", subject=None)))
    assert [t.pending_writes for t in listed] == [got.pending_writes]
    across = [t for t in saver.list(None) if t.config["configurable"]["thread_id"] == "ordered"]
    assert [t.pending_writes for t in across] == [got.pending_writes]


def test_writes_to_a_known_thread_of_a_suppressed_or_erased_subject_are_refused(
    ks: Keyshred,
) -> None:
    # The saver's writes leave the thread's guard to their own transaction (one round
    # trip less on PostgreSQL): still refused, with the guard's error, and nothing
    # stored or keyed anew.
    from langgraph.checkpoint.base import empty_checkpoint

    saver = KeyshredSaver(ks)
    stored = saver.put(_config("known"), empty_checkpoint(), {}, {})
    stored["configurable"]["subject_id"] = "ana"
    store = ks.checkpoints
    th = store.thread("known")
    assert th is not None
    keys_before = ks.keyring.store.find(th.subject_ref, f"~thread:{th.thread_ref}")
    ks.catalog.suppress(th.subject_ref)
    with pytest.raises(SubjectSuppressed):
        saver.put(stored, empty_checkpoint(), {}, {})
    with pytest.raises(SubjectSuppressed):
        saver.put_writes(stored, [("ch", "v")], "task")
    with ks.catalog.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(checkpoints)).scalar_one() == 1
        assert (
            conn.execute(sa.select(sa.func.count()).select_from(checkpoint_writes)).scalar_one()
            == 0
        )
    assert ks.keyring.store.find(th.subject_ref, f"~thread:{th.thread_ref}") == keys_before


def test_a_write_through_a_thread_record_kept_after_its_subjects_erasure_says_so(
    ks: Keyshred,
) -> None:
    # Another process erased the subject; this one still holds the thread's record.
    from langgraph.checkpoint.base import empty_checkpoint

    saver = KeyshredSaver(ks)
    stored = saver.put(_config("kept"), empty_checkpoint(), {}, {})
    stored["configurable"].pop("subject_id", None)
    store = ks.checkpoints
    th = store.thread("kept")
    assert th is not None
    req = ks.erase("ana", requested_by="dpo", reason="art17")
    assert req.state == "completed", req.error
    store._remember(th)  # type: ignore[attr-defined]  # as the other process's cache would
    with pytest.raises(SubjectSuppressed):
        saver.put(stored, empty_checkpoint(), {}, {})
    assert ks.keyring.store.find(th.subject_ref, f"~thread:{th.thread_ref}") is None
