"""Issue 24, item 1: moving a LangGraph app to keyshred is an import and a class name.
The default subject resolver reads what apps already carry (``subject_id``, then
``user_id``, then LangGraph auth's user); a thread that names no user is its own
subject, erased with a receipt; ``from_conn_string``/``setup`` and the ``Async…``
names work as LangGraph's PostgreSQL classes do."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, TypedDict

import pytest

from keyshred import Keyshred
from keyshred.errors import InvalidInput, SubjectErased, SubjectSuppressed
from keyshred.integrations.langgraph import (
    AsyncKeyshredSaver,
    AsyncKeyshredStore,
    KeyshredSaver,
    KeyshredStore,
    default_subject,
    thread_subject,
)
from keyshred.receipts import verify_receipt
from tests.storage.conftest import make_config


class State(TypedDict):
    notes: list[str]


def _graph(saver: Any) -> Any:
    from langgraph.graph import END, START, StateGraph

    def remember(state: State) -> dict[str, Any]:
        return {"notes": [*state["notes"], "remembered"]}

    g = StateGraph(State)
    g.add_node("remember", remember)
    g.add_edge(START, "remember")
    g.add_edge("remember", END)
    return g.compile(checkpointer=saver)


class _User:
    """LangGraph auth's user as an object (``identity`` attribute)."""

    def __init__(self, identity: str) -> None:
        self.identity = identity


def _conf(**values: Any) -> dict[str, Any]:
    return {"configurable": {"thread_id": "t", **values}}


def test_the_default_resolver_reads_what_apps_carry() -> None:
    assert default_subject(_conf(subject_id="s", user_id="u")) == "s"
    assert default_subject(_conf(user_id="ann@example.com")) == "ann@example.com"
    assert default_subject(_conf(user_id=42)) == "42"
    assert default_subject(_conf(langgraph_auth_user={"identity": "auth-1"})) == "auth-1"
    assert default_subject(_conf(langgraph_auth_user=_User("auth-2"))) == "auth-2"
    assert default_subject(_conf(langgraph_auth_user_id="auth-3")) == "auth-3"
    assert default_subject(_conf(user_id="u", langgraph_auth_user={"identity": "a"})) == "u"
    assert default_subject(_conf()) is None
    assert default_subject(_conf(user_id="")) is None
    with pytest.raises(InvalidInput):
        default_subject(_conf(user_id=["not", "an", "id"]))
    with pytest.raises(InvalidInput):
        default_subject({"configurable": "nope"})


def test_a_thread_under_user_id_keeps_its_user_and_is_erased_with_them(
    catalog_url: str, tmp_path: Path
) -> None:
    with Keyshred.init(tmp_path / "d", make_config(catalog_url)) as ks:
        graph = _graph(KeyshredSaver(ks))
        graph.invoke({"notes": ["a"]}, {"configurable": {"thread_id": "t1", "user_id": "ann"}})
        # Later calls that name nobody go to the thread's recorded user.
        graph.invoke({"notes": ["b"]}, {"configurable": {"thread_id": "t1"}})
        th = ks.checkpoints.thread("t1")
        assert th is not None and th.subject_ref == ks.subject_ref("ann")
        with pytest.raises(InvalidInput):  # a thread never changes subject
            graph.invoke({"notes": []}, {"configurable": {"thread_id": "t1", "user_id": "bob"}})
        req = ks.erase("ann", requested_by="dpo", reason="art17")
        assert req.state == "completed", req.error
        with pytest.raises((SubjectErased, SubjectSuppressed)):
            graph.get_state({"configurable": {"thread_id": "t1", "user_id": "ann"}})


def test_a_thread_that_names_no_user_is_its_own_subject(catalog_url: str, tmp_path: Path) -> None:
    with Keyshred.init(tmp_path / "d", make_config(catalog_url)) as ks:
        saver = KeyshredSaver(ks)
        graph = _graph(saver)
        lone = {"configurable": {"thread_id": "lone-1"}}
        kept = {"configurable": {"thread_id": "kept-1", "user_id": "cy"}}
        assert graph.invoke({"notes": ["x"]}, lone)["notes"] == ["x", "remembered"]
        graph.invoke({"notes": ["y"]}, kept)
        th = ks.checkpoints.thread("lone-1")
        assert th is not None and th.subject_ref == ks.subject_ref(thread_subject("lone-1"))
        # Its erasure is the thread's deletion, with a signed receipt.
        req = ks.erase(thread_subject("lone-1"), requested_by="dpo", reason="thread deletion")
        assert req.state == "completed", req.error
        receipt = ks.erasure.receipt(req.request_id)
        assert receipt is not None
        verify_receipt(receipt, ks.keyring.signer().public_key)  # raises if it fails
        assert ks.checkpoints.thread("lone-1") is None
        assert saver.get_tuple(kept) is not None  # the other thread is intact
        assert graph.get_state(kept).values["notes"] == ["y", "remembered"]


def test_from_conn_string_and_setup_on_a_folder(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    with KeyshredSaver.from_conn_string(folder) as saver:
        saver.setup()
        _graph(saver).invoke({"notes": ["n"]}, {"configurable": {"thread_id": "f-1"}})
    # The folder is a keyshred folder now, and the thread is there on reopening.
    with KeyshredSaver.from_conn_string(os.fspath(folder)) as again:
        got = again.get_tuple({"configurable": {"thread_id": "f-1"}})
        assert got is not None and got.checkpoint["channel_values"]["notes"] == ["n", "remembered"]
    with KeyshredStore.from_conn_string(folder) as store:
        store.setup()
        store.put(("ann", "prefs"), "lang", {"value": "Lisp"})
        item = store.get(("ann", "prefs"), "lang")
        assert item is not None and item.value == {"value": "Lisp"}
    with pytest.raises(InvalidInput), KeyshredSaver.from_conn_string(folder, path=tmp_path):
        pass
    with pytest.raises(InvalidInput), KeyshredSaver.from_conn_string("   "):
        pass


def test_from_conn_string_on_postgresql(tmp_path: Path, catalog_url: str) -> None:
    if not catalog_url.startswith("postgresql"):
        pytest.skip("the PostgreSQL URL form")
    local = tmp_path / "local"
    with KeyshredSaver.from_conn_string(catalog_url, path=local) as saver:
        saver.setup()
        _graph(saver).invoke({"notes": ["p"]}, {"configurable": {"thread_id": "p-1"}})
        ks = saver._ks
        assert ks.catalog.dialect == "postgresql"
        assert ks.config.keyring.store_url == ks.config.storage.catalog_url
    # "postgresql://" is taken as psycopg's URL, and $KEYSHRED_PATH names the folder.
    plain = catalog_url.replace("postgresql+psycopg://", "postgresql://")
    env = {**os.environ, "KEYSHRED_PATH": str(local)}
    old = os.environ.copy()
    try:
        os.environ.clear()
        os.environ.update(env)
        with KeyshredSaver.from_conn_string(plain) as again:
            got = again.get_tuple({"configurable": {"thread_id": "p-1"}})
            assert got is not None
    finally:
        os.environ.clear()
        os.environ.update(old)


def test_async_names_and_async_from_conn_string(tmp_path: Path) -> None:
    async def run() -> tuple[list[str], Any]:
        async with AsyncKeyshredSaver.from_conn_string(tmp_path / "a") as saver:
            await saver.asetup()
            out = await _graph(saver).ainvoke(
                {"notes": ["z"]}, {"configurable": {"thread_id": "a-1", "user_id": "dee"}}
            )
        async with AsyncKeyshredStore.from_conn_string(tmp_path / "a") as store:
            await store.asetup()
            await store.aput(("dee", "facts"), "k", {"v": 1})
            item = await store.aget(("dee", "facts"), "k")
        return list(out["notes"]), item

    notes, item = asyncio.run(run())
    assert notes == ["z", "remembered"] and item is not None and item.value == {"v": 1}
    assert issubclass(AsyncKeyshredSaver, KeyshredSaver)
    assert issubclass(AsyncKeyshredStore, KeyshredStore)


def test_the_receipt_counts_threads_as_threads(catalog_url: str, tmp_path: Path) -> None:
    """Issue 24 item 4: ``threads-deleted`` said 45 for 6 threads (it counted
    checkpoints)."""
    with Keyshred.init(tmp_path / "d", make_config(catalog_url)) as ks:
        graph = _graph(KeyshredSaver(ks))
        for n in range(3):
            config = {"configurable": {"thread_id": f"c-{n}", "user_id": "cora"}}
            for _ in range(2):
                graph.invoke({"notes": ["q"]}, config)
        req = ks.erase("cora", requested_by="dpo", reason="art17")
        receipt = ks.erasure.receipt(req.request_id)
        assert receipt is not None
        (line,) = [s for s in receipt.stores if s.store == "checkpoints"]
        assert (line.action, line.count) == ("threads-deleted", 3)


def test_namespaces_that_belong_to_nobody(catalog_url: str, tmp_path: Path) -> None:
    """Issue 24 item 3: ``("global",)`` and ``("faq", "shared", "x")`` are shared
    knowledge (their own subject and keys), untouched by a person's erasure, and
    refused when the detector finds personal data unless an override is audited."""
    from keyshred.ids import OwnSubject
    from keyshred.integrations.langgraph.store import SHARED_SUBJECT

    with Keyshred.init(tmp_path / "d", make_config(catalog_url)) as ks:
        store = KeyshredStore(ks, subject_from=1, shared=[("faq",), ("global",)])
        store.put(("global",), "hours", {"text": "open 9 to 5"})
        store.put(("faq", "shared", "x"), "returns", {"text": "30 days"})
        store.put(("memories", "shared"), "k", {"text": "the user called shared"})
        shared = store.subject_of(("faq", "shared", "x"))
        assert isinstance(shared, OwnSubject) and shared.id == SHARED_SUBJECT
        assert store.subject_of(("memories", "shared")) == "shared"  # a person
        with pytest.raises(InvalidInput, match="personal"):
            store.put(("faq",), "contact", {"text": "mail jo.probe@example.com"})
        with pytest.raises(InvalidInput, match="personal"):
            store.put(("global",), "call 13812345678", {"text": "x"})  # in the key too
        store.put_shared(
            ("faq",), "support", {"text": "mail help@example.com"}, allowed_by="ops", reason="r1"
        )
        allowed = [e.data for e in ks.audit.events() if e.event == "store.shared_personal_allowed"]
        faq = ks.memories.namespace_hash(("faq",))
        assert allowed == [{"allowed_by": "ops", "reason": "r1", "namespace": faq}]
        with pytest.raises(InvalidInput):
            store.put_shared(("memories", "ann"), "k", {"v": 1}, allowed_by="ops", reason="r")
        # A person's erasure leaves shared knowledge alone.
        req = ks.erase("shared", requested_by="dpo", reason="art17")
        assert req.state == "completed"
        with pytest.raises(SubjectSuppressed):  # the person named "shared" is erased
            store.get(("memories", "shared"), "k")
        item = store.get(("global",), "hours")
        assert item is not None and item.value == {"text": "open 9 to 5"}
        keys = {i.key for i in store.search(("faq",))}
        assert keys == {"returns", "support"}
        with pytest.raises(InvalidInput):
            KeyshredStore(ks, shared="faq")  # type: ignore[arg-type]
