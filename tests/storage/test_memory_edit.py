"""``update``, ``correct`` and ``touch`` (storage/memory_edit.py) under attack: a
rewrite keeps the owners of what it rewrites, a history version keeps its
retention, concurrent corrections lose no version, keyshred's own namespaces are
not the caller's to rewrite, and bad arguments are ``InvalidInput``."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest

from keyshred import Keyshred
from keyshred.errors import InvalidInput, KeyshredError
from keyshred.storage import PutItem
from tests.scenarios import VICTIM, victim_summary


def _summary_of_a_deleted_source(ks: Keyshred) -> None:
    """Bob's digest of the victim's memory and his own; the victim then deletes
    the memory (a delete, not an erasure): the digest still holds its text."""
    victim_summary(ks, rebuild=lambda sources: f"rebuilt from {len(sources)}")
    ks.memories.delete(VICTIM, ("m",), "k")


@pytest.mark.parametrize("op", ["update", "correct"])
def test_a_rewrite_of_a_summary_keeps_the_owners_of_a_deleted_source(ks: Keyshred, op: str) -> None:
    # The rewrite keeps the provenance (the deleted source among it), so its value is
    # still derived from the victim's text. Sealed under Bob's key alone (the deleted
    # source gives no owner any more), it outlived the victim's erasure.
    _summary_of_a_deleted_source(ks)
    if op == "update":
        ks.memories.update("bob", ("s",), "d", "digest v2: victim text")
    else:
        ks.memories.correct("bob", ("s",), "d", "digest v2: victim text", reason="typo")
    assert ks.erase(VICTIM, requested_by="dpo", reason="art17").state == "completed"
    got = ks.memories.get("bob", ("s",), "d")
    assert got is None or got.value == "rebuilt from 1", "the rewrite outlived the erasure"
    for version in ks.memories.search("bob", ("~history",)):
        assert "victim" not in str(version.value), "the old version outlived the erasure"


def test_a_rewrite_that_drops_a_mention_drops_its_owner(ks: Keyshred) -> None:
    # Dropping a mention on purpose (``mentions=[]``) takes the memory out of that
    # subject's erasure: the kept owners are not a way to keep it in.
    ks.memories.put("bob", ("m",), "k", "note", mentions=["carol"])
    ks.memories.update("bob", ("m",), "k", "note without carol", mentions=[])
    ks.erase("carol", requested_by="dpo", reason="art17")
    got = ks.memories.get("bob", ("m",), "k")
    assert got is not None and got.value == "note without carol"


def test_a_history_version_keeps_the_retention_of_the_value_it_was(ks: Keyshred) -> None:
    # The old value had one hour left; as a history version it got the policy's full
    # retention, living on (readable through history()) long after it should be gone.
    item = PutItem(("m",), "k", "short-lived", ttl=timedelta(hours=1))
    [old] = ks.memories.put_many("bob", [item])
    ks.memories.correct("bob", ("m",), "k", "corrected", reason="r")
    [version] = ks.memories.search("bob", ("~history",))
    assert version.retain_until <= old.retain_until


def test_concurrent_corrections_lose_no_version(ks: Keyshred) -> None:
    # Each correction read the current value and the next version number before the
    # partition lock: two at once numbered the same version, one overwrote the other.
    ks.memories.put("bob", ("m",), "k", "v0")
    threads, per = 4, 5
    start = threading.Barrier(threads)
    errors: list[BaseException] = []

    def work(n: int) -> None:
        start.wait()
        try:
            for i in range(per):
                ks.memories.correct("bob", ("m",), "k", f"t{n}-{i}", reason="r")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(n,)) for n in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors
    history = ks.memories.history("bob", ("m",), "k")
    assert [h["version"] for h in history] == list(range(1, threads * per + 2))
    # Every value written is there once: as a superseded version or the current one.
    values = sorted(str(h["value"]) for h in history)
    assert values == sorted(["v0", *(f"t{n}-{i}" for n in range(threads) for i in range(per))])


@pytest.mark.parametrize("op", ["update", "correct", "touch"])
def test_keyshreds_own_namespaces_are_not_rewritten_by_callers(ks: Keyshred, op: str) -> None:
    ks.memories.put("bob", ("m",), "k", "v0")
    ks.memories.correct("bob", ("m",), "k", "v1", reason="r")
    [version] = ks.memories.search("bob", ("~history",))
    ns, key = version.namespace, version.key
    with pytest.raises(InvalidInput):
        if op == "update":
            ks.memories.update("bob", ns, key, {"value": "forged"})
        elif op == "correct":
            ks.memories.correct("bob", ns, key, {"value": "forged"}, reason="r")
        else:
            ks.memories.touch("bob", [(ns, key)], timedelta(days=3650))
    [after] = ks.memories.search("bob", ("~history",))
    assert after.value == version.value and after.retain_until == version.retain_until


@pytest.mark.parametrize(
    ("keys", "ttl"),
    [
        ([(("m",), "k")], 5),
        ([(("m",), "k")], None),
        ([(("m",), "k")], timedelta(0)),
        ([(("m",), "k")], timedelta(days=-1)),
        ("mk", timedelta(hours=1)),
        ([("m", "k", "x")], timedelta(hours=1)),
        ([None], timedelta(hours=1)),
        (None, timedelta(hours=1)),
        ([((), "k")], timedelta(hours=1)),
    ],
)
def test_touch_refuses_bad_arguments_with_invalid_input(ks: Keyshred, keys: Any, ttl: Any) -> None:
    before = ks.memories.put("bob", ("m",), "k", "v")
    with pytest.raises(KeyshredError):
        ks.memories.touch("bob", keys, ttl)
    after = ks.memories.get("bob", ("m",), "k")
    assert after is not None and after.retain_until == before.retain_until


def test_touch_counts_a_key_listed_twice_once(ks: Keyshred) -> None:
    ks.memories.put("bob", ("m",), "k", "v")
    assert ks.memories.touch("bob", [(("m",), "k"), (("m",), "k")], timedelta(hours=1)) == 1
