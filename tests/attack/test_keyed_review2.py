"""Second review of the cold get (28b841f, 8ab6774: ``partition.newest_row``).

Each test compares a cold get with what the full load answers in the same state
(``ReadMixin._row`` without ``keyed`` loads the partition). The load compares the
*set* of memory ids the catalog files in the partition with the replayed rows
(``Partition._load_checked``: any id the catalog holds that the replay lacks is an
``IntegrityError``). 8ab6774's cold get compared only their *numbers*: a replay
holding a memory the catalog no longer files (a deleted one whose delete record was
cut away, or one whose asset row was removed) made up for a memory cut away, and
the cold get answered (None for a live memory, a superseded value) where the load
raised. The statement now returns the asset ids of a small partition and the cold
get compares the sets, as the load does.
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from keyshred import Keyshred
from keyshred.errors import IntegrityError, KeyshredError
from keyshred.storage import faults
from keyshred.storage.memory_types import PutItem
from keyshred.storage.schema import assets, memory_hot, memory_partitions
from tests.storage.test_keyed_get import _cold

NS = ("notes",)


def _derived_drop_killed_before_its_purge(ks: Keyshred) -> None:
    """Alice's a, d (derived from bob's fact), z; bob's erasure killed in its derived
    step after it dropped d with ``purge=False`` (a delete record left in alice's
    hot rows, her partition not yet rewritten)."""
    mem = ks.memories
    b = mem.put("bob", NS, "src", "bob's fact")
    mem.put("alice", NS, "a", "A")
    mem.put_many("alice", [PutItem(NS, "d", "derived from bob", sources=[b.memory_id])])
    mem.put("alice", NS, "z", "Z")

    def kill(point: str) -> None:
        if point == "erase.derived":
            raise _Kill

    faults.hook = kill
    try:
        with pytest.raises(_Kill):
            ks.erase("bob", requested_by="dpo", reason="test")
    finally:
        faults.hook = None


def _hot_seqs(ks: Keyshred, ref: str) -> list[int]:
    with ks.catalog.engine.connect() as conn:
        return [
            int(s)
            for (s,) in conn.execute(
                sa.select(memory_hot.c.seq)
                .where(memory_hot.c.subject_ref == ref)
                .order_by(memory_hot.c.seq)
            )
        ]


def _cut_tail(ks: Keyshred, ref: str, n: int) -> None:
    """An attacker with write access to the catalog and no key: the newest ``n`` hot
    rows deleted and the head's next_seq moved back over them (a catalog rolled
    back in part)."""
    seqs = _hot_seqs(ks, ref)[-n:]
    with ks.catalog.engine.begin() as conn:
        conn.execute(
            memory_hot.delete().where(memory_hot.c.subject_ref == ref, memory_hot.c.seq.in_(seqs))
        )
        conn.execute(
            memory_partitions.update()
            .where(memory_partitions.c.subject_ref == ref)
            .values(next_seq=memory_partitions.c.next_seq - len(seqs))
        )


def _answer(read: Any) -> Any:
    try:
        m = read()
    except KeyshredError as exc:
        return type(exc)
    if m is None:
        return None
    value = m.value
    if isinstance(value, bytes | bytearray):  # a MemoryRow (the internal read)
        import json

        value = json.loads(value)
    return (value, m.scope, m.memory_id)


def _loaded(ks: Keyshred, subject: str, key: str) -> Any:
    """What the full load answers (``_row`` without ``keyed``), then cold again."""
    ref = _cold(ks, subject)
    out = _answer(lambda: ks._memories._row(subject, NS, key))  # type: ignore[attr-defined]
    ks.memories.evict(ref)
    return out


def _cold_get(ks: Keyshred, subject: str, key: str) -> Any:
    _cold(ks, subject)
    return _answer(lambda: ks.memories.get(subject, NS, key))


class _Kill(BaseException):
    """Stops the process at a fault point as SIGKILL would: nothing after it runs
    (not an ``Exception``: no cleanup handler of the step catches it)."""


# -- defects: the count adds up while the set does not --------------------------------


@pytest.mark.parametrize("key", ["k", "z", "a"])
def test_tail_cut_with_one_asset_row_deleted_raises(ks: Keyshred, key: str) -> None:
    """The review's third case (the newest records cut, the head moved back) plus one
    more catalog write: the asset row of a memory the replay still holds (``a``) is
    deleted. The replay holds {a, k}, the catalog files {k, z}: two and two. The
    load finds ``z`` missing and raises ``IntegrityError``; the cold get answers:
    ``k`` -> its *superseded* value "v1", ``z`` -> None, ``a`` -> "A"."""
    mem = ks.memories
    mem.put("alice", NS, "a", "A")
    mem.put("alice", NS, "k", "v1")
    mem.put("alice", NS, "k", "v2")  # supersedes v1
    mem.put("alice", NS, "z", "Z")  # a new memory (a catalog asset)
    ref = _cold(ks, "alice")
    a_id = mem.get("alice", NS, "a").memory_id  # type: ignore[union-attr]
    _cut_tail(ks, ref, 2)  # k=v2 and z gone, the head moved back
    with ks.catalog.engine.begin() as conn:
        conn.execute(assets.delete().where(assets.c.asset_id == a_id))
    assert _loaded(ks, "alice", key) is IntegrityError
    got = _cold_get(ks, "alice", key)
    # (fails: k -> ("v1", ...), z -> None, a -> ("A", ...))
    assert got is IntegrityError, got


@pytest.mark.parametrize("key", ["z", "a"])
def test_tail_cut_over_a_derived_drop_killed_before_its_purge_raises(
    ks: Keyshred, key: str
) -> None:
    """No asset row touched. Bob's erasure drops alice's asset derived from bob's
    memory with ``purge=False`` (its row is opaque once the owner-set key is
    destroyed): a delete record in alice's hot tier, the asset row gone, the purge
    at the step's end. Killed after that drop (``erase.derived``), alice's hot tier
    is [put a, put d, put z, del d]. The attacker cuts the two newest rows (``z``'s
    put and ``d``'s delete) and moves the head back: the replay holds {a, d}, the
    catalog files {a, z}. The load raises (``z`` missing); the cold get answers
    None for ``z`` (a live memory, silently gone) and "A" for ``a``."""
    _derived_drop_killed_before_its_purge(ks)
    ref = ks.subject_ref("alice")
    _cold(ks, "alice")
    assert len(_hot_seqs(ks, ref)) == 4  # [put a, put d, put z, del d]: not purged
    _cut_tail(ks, ref, 2)
    assert _loaded(ks, "alice", key) is IntegrityError
    got = _cold_get(ks, "alice", key)
    assert got is IntegrityError, got  # (fails: z -> None, a -> ("A", ...))


# -- checks that held ----------------------------------------------------------------


def test_derived_drop_killed_before_its_purge_reads_the_same(ks: Keyshred) -> None:
    """The killed derived step above without tampering: cold and loaded agree."""
    _derived_drop_killed_before_its_purge(ks)
    for key in ("a", "d", "z"):
        assert _cold_get(ks, "alice", key) == _loaded(ks, "alice", key), key
    assert _cold_get(ks, "alice", "d") is None


def test_corrections_history_and_duplicate_batch_keys(ks: Keyshred) -> None:
    """``correct`` (history versions are memories of the partition, counted as
    assets), ``~history`` keys read through ``get``, a batch writing a key twice,
    a move between scopes and back, ``update`` of a co-owned row."""
    mem = ks.memories
    mem.put("alice", NS, "k", "v1")
    mem.correct("alice", NS, "k", "v2", reason="fix")
    mem.correct("alice", NS, "k", "v3", reason="fix again")
    mem.put_many("alice", [PutItem(NS, "d", "one"), PutItem(NS, "d", "two")])
    mem.put("alice", NS, "j", "J", scope="marketing")
    mem.put("alice", NS, "j", "J2")
    mem.put("alice", NS, "x", "X", mentions=["bob"])
    mem.update("alice", NS, "x", "X2")
    for key in ("k", "d", "j", "x", "none"):
        assert _cold_get(ks, "alice", key) == _loaded(ks, "alice", key), key
    hist = ("~history", *NS)
    _cold(ks, "alice")
    cold = _answer(lambda: ks.memories.get("alice", hist, "k\x1f00000001"))
    _cold(ks, "alice")
    loaded = _answer(lambda: ks._memories._row("alice", hist, "k\x1f00000001"))  # type: ignore[attr-defined]
    assert cold == loaded and cold is not None and cold[0]["value"] == "v1"
