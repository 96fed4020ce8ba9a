"""Attack on issue 19's item 3 (mentions found, not only declared) through the
LangGraph checkpointer: a registered identifier of one subject inside another
subject's agent thread."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from keyshred import Keyshred
from keyshred.errors import SubjectErased
from keyshred.integrations.langgraph import KeyshredSaver
from tests.integrations.test_langgraph_saver import _config, _graph
from tests.storage.conftest import make_config

PHONE = "+49 30 1234567"


@pytest.fixture
def ks(catalog_url: str, tmp_path: Path) -> Any:
    store = Keyshred.init(tmp_path / "data", make_config(catalog_url))
    yield store
    store.close()


def test_a_registered_phone_in_another_subjects_thread_goes_with_the_subject(
    ks: Keyshred,
) -> None:
    """The victim registered a phone number; bob's agent thread holds it. The same
    value written as a memory of bob is found and erased with the victim; in bob's
    checkpoints it stays readable after the victim's erasure."""
    victim = "victim@example.org"
    ks.subjects.register_identifiers(victim, phones=[PHONE])
    ks.memories.put(victim, ("notes",), "own", "the victim's own note")
    graph = _graph(KeyshredSaver(ks), interrupt=False)
    cfg, other = _config("bob-1", "bob"), _config("bob-2", "bob")
    graph.invoke({"notes": [f"call the victim on {PHONE}"]}, cfg)
    graph.invoke({"notes": ["bob's own plans"]}, other)
    # The memory path finds it (the control): erased with the victim.
    ks.memories.put("bob", ("facts",), "call", f"call the victim on {PHONE}")
    req = ks.erase(victim, requested_by="dpo", reason="gdpr-art17")
    assert req.state == "completed", req.error
    assert ks.memories.get("bob", ("facts",), "call") is None
    # Crypto-erased: the thread's state that holds the phone no longer opens.
    with pytest.raises(SubjectErased):
        graph.get_state(cfg)
    # Bob's thread that is only about bob is untouched, and the erased thread can
    # go on afresh under a new key.
    assert graph.get_state(other).values["notes"][0] == "bob's own plans"
    saver = KeyshredSaver(ks)
    saver.delete_thread("bob-1")
    graph.invoke({"notes": ["again"]}, cfg)
    assert graph.get_state(cfg).values["notes"] == ["again", "remembered", "answered"]


def test_a_thread_about_a_subject_being_erased_is_unreadable_from_its_suppression(
    ks: Keyshred,
) -> None:
    """Between the victim's suppression and the destruction of its keys (a crash,
    a KEK outage, an erasure waiting), bob's thread state holding the victim's
    phone still opened: "stop every read at once" held for the victim's own data
    only. It is refused from the suppression on (listings skip it), as it is once
    the key is destroyed."""
    from keyshred.errors import SubjectSuppressed

    victim = "victim@example.org"
    ks.subjects.register_identifiers(victim, phones=[PHONE])
    ks.memories.put(victim, ("notes",), "own", "the victim's own note")
    saver = KeyshredSaver(ks)
    graph = _graph(saver, interrupt=False)
    cfg, other = _config("bob-1", "bob"), _config("bob-2", "bob")
    graph.invoke({"notes": [f"call the victim on {PHONE}"]}, cfg)
    graph.invoke({"notes": ["bob's own plans"]}, other)

    def stop(step: str, req: object) -> None:
        if step == "suppress":
            raise RuntimeError("stopped after the suppression")

    ks.erasure.on_step = stop
    with pytest.raises(RuntimeError):
        ks.erase(victim, requested_by="dpo", reason="gdpr-art17", request_id="r1")
    ks.erasure.on_step = None
    with pytest.raises(SubjectSuppressed):
        graph.get_state(cfg)
    listed = [t.checkpoint["channel_values"] for t in saver.list(_config("bob-1", "bob"))]
    assert all(PHONE not in str(values) for values in listed)
    assert graph.get_state(other).values["notes"][0] == "bob's own plans"
    assert ks.erasure.resume("r1").state == "completed"
    with pytest.raises(SubjectErased):
        graph.get_state(cfg)
    assert graph.get_state(other).values["notes"][0] == "bob's own plans"
