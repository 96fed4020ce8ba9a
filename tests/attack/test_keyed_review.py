"""Review of 28b841f (a get of a subject whose partition is not loaded reads the
catalog's hot records alone): each test compares a cold get with what the full
load (``search`` loads) answers for the same state. The first three found that
version deciding from the records it opened while the load raised for tampering
elsewhere in the partition (an older record flipped, one cut beyond the records it
read, the newest cut with the head moved back); the fixed path reads a partition
only whole, with the load's checks (``partition.newest_row``). The others are
checks that held."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from keyshred import Keyshred
from keyshred.errors import IntegrityError, SubjectSuppressed
from keyshred.storage.hot import HotTier
from keyshred.storage.memory_types import PutItem
from keyshred.storage.schema import memory_hot, memory_partitions
from tests.storage.conftest import make_config
from tests.storage.test_keyed_get import _cold, _hot, _set_record, _view, loads  # noqa: F401

NS = ("notes",)


def _cut(ks: Keyshred, ref: str, seqs: list[int], *, rollback_head: bool) -> None:
    """Delete hot rows (an attacker with write access to the catalog, no key);
    ``rollback_head``: also move the head's next_seq back over them."""
    with ks.catalog.engine.begin() as conn:
        conn.execute(
            memory_hot.delete().where(memory_hot.c.subject_ref == ref, memory_hot.c.seq.in_(seqs))
        )
        if rollback_head:
            conn.execute(
                memory_partitions.update()
                .where(memory_partitions.c.subject_ref == ref)
                .values(next_seq=memory_partitions.c.next_seq - len(seqs))
            )


def _loaded_answer(ks: Keyshred, subject: str, key: str) -> Any:
    """What a loaded partition answers (search loads it), then cold again."""
    ref = _cold(ks, subject)
    ks.memories.search(subject, NS, limit=1)
    out = _view(ks.memories.get(subject, NS, key))
    ks.memories.evict(ref)
    return out


# -- tampering the load catches, a cold get catches too ------------------------------


def test_a_tampered_older_record_raises(ks: Keyshred) -> None:
    """README: "A tampered, swapped or cut hot record still raises IntegrityError".
    A flipped byte in a hot record *older* than the one a cold get decides on (both
    inside the newest 32) is never opened: the cold get returns the value where the
    old path's load (and a search now) raise IntegrityError in the same call."""
    for i in range(3):
        ks.memories.put("alice", NS, f"k{i}", i)
    ref = _cold(ks, "alice")
    oldest = _hot(ks, ref)[0]
    broken = bytearray(oldest.record)
    broken[len(broken) // 2] ^= 0x01
    _set_record(ks, ref, oldest.seq, bytes(broken))
    with pytest.raises(IntegrityError):  # the load (old path) sees it
        ks.memories.search("alice", NS)
    ks.memories.evict(ref)
    with pytest.raises(IntegrityError):  # (28b841f returned 2)
        ks.memories.get("alice", NS, "k2")


def test_a_record_cut_beyond_the_newest_raises(ks: Keyshred) -> None:
    """A hot record older than the newest 32 deleted from the catalog (head left as
    it is): the load raises (a gap in the sequence, and a memory the catalog holds
    is missing); a cold get of a newer key returns its value."""
    for i in range(40):
        ks.memories.put("alice", NS, f"n{i}", i)
    ref = _cold(ks, "alice")
    first = _hot(ks, ref)[0]
    _cut(ks, ref, [first.seq], rollback_head=False)
    with pytest.raises(IntegrityError):
        ks.memories.search("alice", NS)
    ks.memories.evict(ref)
    with pytest.raises(IntegrityError):  # (28b841f returned 39)
        ks.memories.get("alice", NS, "n39")


def test_a_rolled_back_tail_raises(ks: Keyshred) -> None:
    """The newest hot records removed and the head's next_seq moved back with them
    (a catalog rolled back in part: no key needed). The old path's load compares
    with the catalog's assets, finds the memory the cut record added missing and
    raises IntegrityError; the cold get decides from the older records that are
    left and returns the superseded value of ``k``, silently."""
    ks.memories.put("alice", NS, "k", "v1")
    ks.memories.put("alice", NS, "k", "v2")  # supersedes v1
    ks.memories.put("alice", NS, "z", "new")  # a new memory (a catalog asset)
    ref = _cold(ks, "alice")
    rows = _hot(ks, ref)
    _cut(ks, ref, [rows[-2].seq, rows[-1].seq], rollback_head=True)
    with pytest.raises(IntegrityError):
        ks.memories.search("alice", NS)
    ks.memories.evict(ref)
    got = None
    with pytest.raises(IntegrityError):  # (28b841f returned "v1")
        got = ks.memories.get("alice", NS, "k")
    assert got is None or got.value != "v1"


# -- checks that held -------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["erase", "suppress"])
def test_co_owned_row_after_the_co_owner_goes(ks: Keyshred, mode: str) -> None:
    ks.memories.put("alice", NS, "about-bob", "met bob", mentions=["bob"])
    ks.memories.put("alice", NS, "mine", "x")
    ks.memories.put("bob", NS, "k", "his")
    if mode == "erase":
        req = ks.erase("bob", requested_by="dpo", reason="test")
        assert req.state == "completed", req.error
    else:
        ks.catalog.suppress(ks.subject_ref("bob"))
    _cold(ks, "alice")
    assert ks.memories.get("alice", NS, "about-bob") is None
    assert ks.memories.get("alice", NS, "mine").value == "x"  # type: ignore[union-attr]
    assert _loaded_answer(ks, "alice", "about-bob") is None


def test_delete_many_and_delete_read_nothing_cold(
    ks: Keyshred,
    loads: list[str],  # noqa: F811 - the fixture
) -> None:
    for i in range(5):
        ks.memories.put("alice", NS, f"k{i}", i)
    assert ks.memories.delete_many("alice", [(NS, "k1"), (NS, "k3")]) == 2
    ks.memories.delete("alice", NS, "k4")
    ks.memories.put("alice", NS, "k5", 5)
    for k in ("k0", "k1", "k2", "k3", "k4", "k5"):
        want = _loaded_answer(ks, "alice", k)
        ks.memories.evict(ks.subject_ref("alice"))
        assert _view(ks.memories.get("alice", NS, k)) == want, k
    assert _view(ks.memories.get("alice", NS, "k1")) is None


def test_scope_erasure_and_moves(ks: Keyshred) -> None:
    mem = ks.memories
    mem.put("alice", NS, "m", "promo", scope="marketing")
    mem.put("alice", NS, "m2", "d1")
    mem.put("alice", NS, "m2", "promo2", scope="marketing")  # moved into marketing
    mem.put("alice", NS, "m3", "p3", scope="marketing")
    mem.put("alice", NS, "m3", "d3")  # moved out of marketing
    req = ks.erase("alice", "marketing", requested_by="dpo", reason="test")
    assert req.state == "completed", req.error
    for k in ("m", "m2", "m3"):
        want = _loaded_answer(ks, "alice", k)
        _cold(ks, "alice")
        try:
            got = _view(mem.get("alice", NS, k))
        except SubjectSuppressed as exc:
            got = type(exc)
        assert got == want, k
    assert _view(mem.get("alice", NS, "m2")) is None


def test_scope_erasure_stopped_after_its_key_went(ks: Keyshred) -> None:
    """A scope erasure stopped after it compacted and destroyed the scope's key (the
    order README states), then a write of another scope: a cold get of a memory
    moved into the erased scope does not bring its older version back."""
    mem = ks.memories
    mem.put("alice", NS, "m", "old-default")
    mem.put("alice", NS, "m", "secret", scope="marketing")
    ref = ks.subject_ref("alice")
    ks.catalog.suppress(ref, scope="marketing")
    part = ks._memories._partition(ref)  # type: ignore[attr-defined]
    with part.flocked():
        part.flush()
    ks._memories._keyring.destroy(ref, "marketing")  # type: ignore[attr-defined]
    mem.put("alice", NS, "other", "x")
    want = _loaded_answer(ks, "alice", "m")
    _cold(ks, "alice")
    assert _view(mem.get("alice", NS, "m")) == want
    assert want is None


def test_ttl_and_touch(ks: Keyshred) -> None:
    mem = ks.memories
    mem.put_many("alice", [PutItem(NS, "k", "short", ttl=timedelta(days=1))])
    mem.touch("alice", [(NS, "k")], timedelta(days=5))
    store: Any = ks._memories
    store._clock = lambda: datetime.now(UTC) + timedelta(days=2)
    _cold(ks, "alice")
    assert mem.get("alice", NS, "k").value == "short"  # type: ignore[union-attr]
    store._clock = lambda: datetime.now(UTC) + timedelta(days=6)
    _cold(ks, "alice")
    assert mem.get("alice", NS, "k") is None


def test_head_without_hot_rows(
    ks: Keyshred,
    loads: list[str],  # noqa: F811 - the fixture
) -> None:
    ks.memories.put("alice", NS, "k", 1)
    for i in range(40):  # more than a compaction keeps in the catalog: a segment
        ks.memories.put("alice", NS, f"n{i}", i)
    ks.memories.flush("alice")
    ref = _cold(ks, "alice")
    assert not _hot(ks, ref)
    loads.clear()
    assert ks.memories.get("alice", NS, "k").value == 1  # type: ignore[union-attr]
    assert loads == [ref]


def test_eviction_by_suppression_overlapping_the_cold_read(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An erasure's suppression and eviction land between the guard read and the
    catalog read: the read goes again and is refused."""
    ks.memories.put("alice", NS, "k", "v")
    ref = _cold(ks, "alice")
    real = HotTier.newest
    fired: list[bool] = []

    def racing(self: HotTier, r: str, *args: Any) -> Any:
        if not fired:
            fired.append(True)
            ks.catalog.suppress(ref)
            ks.memories.evict(ref)
        return real(self, r, *args)

    monkeypatch.setattr(HotTier, "newest", racing)
    with pytest.raises(SubjectSuppressed):
        ks.memories.get("alice", NS, "k")


def test_other_subject_rows_never_read(ks: Keyshred) -> None:
    """Bob's newest hot record put under alice's subject_ref at alice's next seq."""
    ks.memories.put("alice", NS, "k", "alice's")
    ks.memories.put("bob", NS, "k", "bob's")
    a, b = _cold(ks, "alice"), _cold(ks, "bob")
    theirs = _hot(ks, b)[-1]
    mine = _hot(ks, a)[-1]
    _set_record(ks, a, mine.seq, bytes(theirs.record))
    with pytest.raises(IntegrityError):
        ks.memories.get("alice", NS, "k")


def test_concurrent_writer_in_another_handle(ks: Keyshred, catalog_url: str) -> None:
    other = Keyshred.open(ks.path, make_config(catalog_url))
    try:
        for i in range(35):
            other.memories.put("alice", NS, f"k{i}", i)
        other.memories.put("alice", NS, "k0", "new", scope="marketing")
        other.memories.delete("alice", NS, "k1")
        for k in ("k0", "k1", "k2", "k34"):
            want = _loaded_answer(ks, "alice", k)
            _cold(ks, "alice")
            assert _view(ks.memories.get("alice", NS, k)) == want, k
    finally:
        other.close()


def test_langgraph_store_get_with_ttl_refresh(ks: Keyshred) -> None:
    pytest.importorskip("langgraph")
    from keyshred.integrations.langgraph import KeyshredStore

    store = KeyshredStore(ks, ttl={"default_ttl": 60, "refresh_on_read": True})
    store.put(("alice", "notes"), "k", {"v": 1})
    store.put(("alice", "notes"), "k", {"v": 2})
    _cold(ks, "alice")
    got = store.get(("alice", "notes"), "k", refresh_ttl=True)
    assert got is not None and got.value == {"v": 2}
    store.delete(("alice", "notes"), "k")
    _cold(ks, "alice")
    assert store.get(("alice", "notes"), "k") is None


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_seeded_mix_of_operations_cold_equals_loaded(ks: Keyshred, seed: int) -> None:
    """A short seeded mix of puts (two scopes, mentions), deletes, delete_many,
    touches, flushes and scope suppression: after each step every key reads the
    same cold as through a loaded partition (or both refuse)."""
    import random

    rnd = random.Random(seed)
    mem = ks.memories
    keys = ["a", "b", "c", "d"]
    ks.memories.put("bob", NS, "x", "bob")
    ref = ks.subject_ref("alice")

    def answer(k: str) -> Any:
        try:
            return _view(mem.get("alice", NS, k))
        except SubjectSuppressed:
            return "suppressed"

    for step in range(30):
        op = rnd.choice(
            ["put", "put", "put", "scope", "mention", "delete", "many", "touch", "flush"]
        )
        k = rnd.choice(keys)
        if op == "put":
            mem.put("alice", NS, k, f"{k}{step}")
        elif op == "scope" and step <= 20:
            mem.put("alice", NS, k, f"{k}{step}m", scope="marketing")
        elif op == "scope":
            continue
        elif op == "mention":
            mem.put("alice", NS, k, f"{k}{step}b", mentions=["bob"])
        elif op == "delete":
            mem.delete("alice", NS, k)
        elif op == "many":
            mem.delete_many("alice", [(NS, k), (NS, rnd.choice(keys))])
        elif op == "touch":
            try:
                mem.touch("alice", [(NS, k)], timedelta(days=3))
            except SubjectSuppressed:
                continue
        else:
            mem.flush("alice")
        if step == 20:
            ks.catalog.suppress(ref, scope="marketing")
        for key in keys:
            mem.evict(ref)
            mem.search("alice", NS, limit=1)  # loaded
            warm = answer(key)
            mem.evict(ref)
            assert answer(key) == warm, (step, op, key)
