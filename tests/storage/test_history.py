"""``history()`` and the numbering of versions (``correct``): what every read hides
(suppressed scopes, values past their retain-until), keys that hold the version
separator, and version numbers held by unreadable versions."""

from __future__ import annotations

import pytest

from keyshred import Keyshred
from tests.scenarios import VICTIM, victim_summary


class Stop(Exception):
    pass


def stop_after_suppress(step: str, req: object) -> None:
    if step == "suppress":
        raise Stop


def test_history_hides_the_versions_of_a_suppressed_scope(ks: Keyshred) -> None:
    # A scope erasure stopped once suppressed (a crash, or before destroy_keys ran):
    # search() hid the suppressed version, history() decrypted and returned it.
    ks.memories.put("bob", ("m",), "k", "default-scope value")
    ks.memories.correct("bob", ("m",), "k", "default v1", reason="r")
    ks.memories.put("bob", ("m",), "k", "now marketing", scope="marketing", category="preference")
    ks.erasure.on_step = stop_after_suppress
    with pytest.raises(Stop):
        ks.erase("bob", "default", requested_by="dpo", reason="consent", request_id="s1")
    ks.erasure.on_step = None
    assert ks.erasure.status("s1").state == "suppressed"
    assert [h["value"] for h in ks.memories.history("bob", ("m",), "k")] == ["now marketing"]
    assert ks.erasure.resume("s1").state == "completed"
    assert [h["value"] for h in ks.memories.history("bob", ("m",), "k")] == ["now marketing"]


def test_history_and_delete_keep_to_their_own_key(ks: Keyshred) -> None:
    # Keys may hold "\x1f" (the version separator): the versions of key "a" were
    # found by the prefix "a\x1f", which also matches those of key "a\x1fb".
    m = ks.memories
    m.put("bob", ("m",), "a", "a0")
    m.correct("bob", ("m",), "a", "a1", reason="r")
    m.put("bob", ("m",), "a\x1fb", "ab0")
    m.correct("bob", ("m",), "a\x1fb", "ab1", reason="r")
    assert [h["value"] for h in m.history("bob", ("m",), "a")] == ["a0", "a1"]
    m.correct("bob", ("m",), "a", "a2", reason="r")  # numbered after a's own versions
    assert [h["version"] for h in m.history("bob", ("m",), "a")] == [1, 2, 3]
    m.delete("bob", ("m",), "a")
    assert [h["value"] for h in m.history("bob", ("m",), "a\x1fb")] == ["ab0", "ab1"]


def test_delete_many_removes_the_versions_of_a_key_with_the_separator(ks: Keyshred) -> None:
    m = ks.memories
    m.put("bob", ("m",), "a\x1fb", "old value")
    m.correct("bob", ("m",), "a\x1fb", "new value", reason="r")
    m.put("bob", ("m",), "a", "kept")
    m.correct("bob", ("m",), "a", "kept v1", reason="r")
    assert m.delete_many("bob", [(("m",), "a\x1fb")]) == 1
    assert [x.value["value"] for x in m.search("bob", ("~history",))] == ["kept"]


def test_a_correction_never_takes_the_number_of_an_unreadable_version(ks: Keyshred) -> None:
    # Bob's summary of the victim's memory, corrected: its first version is sealed
    # under a key the victim co-owns. The erasure destroys that key and waits (its
    # producer unknown), the version is unreadable until the erasure resumes and
    # drops it. A correction numbered by the readable versions alone took version 1
    # again: written at that name it replaced the unreadable row under its asset
    # id, which the resumed erasure then deleted with Bob's correction in it.
    victim_summary(ks, producer="later")
    ks.memories.correct("bob", ("s",), "d", "summary, corrected", reason="typo")
    assert ks.erase(VICTIM, requested_by="dpo", reason="art17", request_id="r1").state == (
        "manual_review"
    )
    ks.memories.put("bob", ("s",), "d", "bob's own note")
    ks.memories.correct("bob", ("s",), "d", "bob's own note, corrected", reason="r")
    ks.derived.register_producer("later", "1", lambda sources: None)
    assert ks.erasure.resume("r1").state == "completed"
    values = [h["value"] for h in ks.memories.history("bob", ("s",), "d")]
    # (Whether the old version is still unreadable when Bob corrects depends on the
    # order the step met the two assets in: dropped first, its number is free.)
    assert values == ["bob's own note", "bob's own note, corrected"], values


@pytest.mark.parametrize("op", ["put", "put_many", "update"])
def test_an_epoch_that_is_no_int_is_invalid_input(ks: Keyshred, op: str) -> None:
    # Compared with the guard's epoch: "1" < 0 raised TypeError.
    from keyshred.errors import InvalidInput
    from keyshred.storage.memories import PutItem

    ks.memories.put("bob", ("m",), "k", "v")
    with pytest.raises(InvalidInput):
        if op == "put":
            ks.memories.put("bob", ("m",), "k2", "v", epoch="1")  # type: ignore[arg-type]
        elif op == "put_many":
            ks.memories.put_many("bob", [PutItem(("m",), "k2", "v")], epoch=1.0)  # type: ignore[arg-type]
        else:
            ks.memories.update("bob", ("m",), "k", "v2", epoch="1")  # type: ignore[arg-type]
    assert ks.memories.get("bob", ("m",), "k2") is None
