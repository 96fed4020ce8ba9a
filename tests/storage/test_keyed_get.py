"""A get of a subject whose partition is not loaded reads a small partition (hot
rows alone, no segment) from the catalog (``ReadMixin._keyed``,
``partition.newest_row``): it answers as a loaded partition would, with the load's
checks, loads nothing when that decides, and loads (which decides) whenever it
cannot: a segment, more rows, a row under an owner-set key, a suppressed scope, a
tampered or missing record, an unfinished deletion. Both catalogs (``ks`` runs on
SQLite and PostgreSQL); the review's cases are in tests/attack/test_keyed_review.py."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from keyshred import Keyshred
from keyshred.errors import IntegrityError, SubjectSuppressed
from keyshred.storage.memory_types import DELETING, PutItem
from keyshred.storage.partition import Partition
from keyshred.storage.schema import memory_hot
from tests.storage.conftest import make_config

NS = ("notes",)


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The subjects whose partitions were loaded, in order."""
    seen: list[str] = []
    real = Partition._load

    def spy(self: Partition) -> None:
        seen.append(self.subject_ref)
        real(self)

    monkeypatch.setattr(Partition, "_load", spy)
    yield seen


def _cold(ks: Keyshred, subject: str) -> str:
    ref = ks.subject_ref(subject)
    ks.memories.evict(ref)
    return ref


def _engine(ks: Keyshred) -> sa.Engine:
    return ks.catalog.engine


def _hot(ks: Keyshred, ref: str) -> list[Any]:
    with _engine(ks).connect() as conn:
        return list(
            conn.execute(
                sa.select(memory_hot)
                .where(memory_hot.c.subject_ref == ref)
                .order_by(memory_hot.c.seq)
            )
        )


def _set_record(ks: Keyshred, ref: str, seq: int, record: bytes) -> None:
    with _engine(ks).begin() as conn:
        conn.execute(
            memory_hot.update()
            .where(memory_hot.c.subject_ref == ref, memory_hot.c.seq == seq)
            .values(record=record)
        )


def _view(m: Any) -> Any:
    return None if m is None else (m.value, m.scope, m.memory_id, m.updated_at, m.mentions)


def test_a_cold_get_answers_from_the_catalog_without_a_load(ks: Keyshred, loads: list[str]) -> None:
    ks.memories.put_many("alice", [PutItem(NS, f"k{i}", {"i": i}) for i in range(10)])
    ks.memories.put("alice", NS, "k3", {"i": 33})  # a newer record over the batch's
    ks.memories.put("alice", NS, "solo", "x")
    warm = {k: _view(ks.memories.get("alice", NS, k)) for k in ("k0", "k3", "k9", "solo")}
    _cold(ks, "alice")
    loads.clear()
    for key, want in warm.items():
        assert _view(ks.memories.get("alice", NS, key)) == want
    assert ks.memories.get("alice", NS, "k3").value == {"i": 33}  # type: ignore[union-attr]
    # A key never written: the partition is all there, so it is nowhere.
    assert ks.memories.get("alice", NS, "missing") is None
    assert loads == []


def test_answers_match_a_loaded_partition(ks: Keyshred, loads: list[str]) -> None:
    """Updates, moves between scopes, a row about another person (sealed under the
    owners' key), then more rows than a cold get reads, then segments: every key
    reads the same cold as loaded, and only the small hot-only partition is read
    without a load."""
    mem = ks.memories
    mem.put("alice", NS, "a", 1)
    mem.put("alice", NS, "b", 2)
    mem.put("alice", NS, "b", 22)
    mem.put("alice", NS, "c", 3, scope="marketing")
    mem.put("alice", NS, "c", 33)  # moved to the default scope
    mem.put("alice", NS, "about-bob", "met bob", mentions=["bob"])
    keys = ["a", "b", "c", "about-bob", "never", "n0", "n39"]
    ref = ks.subject_ref("alice")

    def check(decided: set[str]) -> None:
        warm = {k: _view(mem.get("alice", NS, k)) for k in keys}
        for k in keys:
            mem.evict(ref)
            loads.clear()
            assert _view(mem.get("alice", NS, k)) == warm[k], k
            assert loads == ([] if k in decided else [ref]), k

    check({"a", "b", "c", "never", "n0", "n39"})  # the row about bob: its owners decide
    for i in range(40):  # more hot rows than a cold get reads whole (32)
        mem.put("alice", NS, f"n{i}", i)
    check(set())
    mem.flush("alice")  # everything in segments
    mem.put("alice", NS, "fresh", "new")
    keys.append("fresh")
    check(set())  # a live segment: the load reads it


def test_a_logged_delete_not_yet_purged_reads_nothing(ks: Keyshred, loads: list[str]) -> None:
    """A deletion whose rewrite waits (the erasure's derived step purges each holder
    once, at its end: ``purge=False``) leaves its delete record in the hot rows and
    nothing in the catalog: the replay ends with the memory gone."""
    ks.memories.put("alice", NS, "gone", "bye")
    ks.memories.put("alice", NS, "kept", "hi")
    ref = ks.subject_ref("alice")
    store: Any = ks._memories
    part = store._partition(ref)
    with part.flocked():
        row = part.rows[part.lookup(NS, "gone")]
        store._delete_rows(ref, part, [row], purge=False)
    _cold(ks, "alice")
    loads.clear()
    assert ks.memories.get("alice", NS, "gone") is None
    assert ks.memories.get("alice", NS, "kept").value == "hi"  # type: ignore[union-attr]
    assert loads == []


def test_a_suppressed_subject_or_scope_is_refused_before_decrypting(
    ks: Keyshred, loads: list[str]
) -> None:
    ks.memories.put("alice", NS, "mk", "promo", scope="marketing")
    ks.memories.put("alice", NS, "k", "mine")
    ref = _cold(ks, "alice")
    ks.catalog.suppress(ref, scope="marketing")
    # The newest record is of the default scope: it decides, unopened marketing
    # records aside; the marketing one is refused (the load's answer).
    assert ks.memories.get("alice", NS, "k").value == "mine"  # type: ignore[union-attr]
    with pytest.raises(SubjectSuppressed):
        ks.memories.get("alice", NS, "mk")
    ks.catalog.set_guard(ref, "active")
    ks.catalog.suppress(ref)
    ks.memories.evict(ref)
    loads.clear()
    with pytest.raises(SubjectSuppressed):
        ks.memories.get("alice", NS, "k")
    assert loads == []


def test_an_erased_subject_reads_nothing(ks: Keyshred) -> None:
    ks.memories.put("alice", NS, "k", "mine")
    ks.memories.put("bob", NS, "k", "his")
    req = ks.erase("alice", requested_by="dpo", reason="test")
    assert req.state == "completed", req.error
    _cold(ks, "alice")
    _cold(ks, "bob")
    with pytest.raises(SubjectSuppressed):
        ks.memories.get("alice", NS, "k")
    assert ks.memories.get("bob", NS, "k").value == "his"  # type: ignore[union-attr]


def test_past_its_retention_a_cold_get_finds_nothing(ks: Keyshred, loads: list[str]) -> None:
    ks.memories.put_many("alice", [PutItem(NS, "k", "short", ttl=timedelta(days=1))])
    _cold(ks, "alice")
    loads.clear()
    store: Any = ks._memories  # the clock the reads compare retention with
    store._clock = lambda: datetime.now(UTC) + timedelta(days=2)
    assert ks.memories.get("alice", NS, "k") is None
    assert loads == []


def test_a_tampered_record_raises(ks: Keyshred) -> None:
    """A flipped byte in the record a cold get opens, two records swapped, the
    newest record cut away: ``IntegrityError``, never another answer."""
    for i in range(3):
        ks.memories.put("alice", NS, f"k{i}", i)
    ref = _cold(ks, "alice")
    rows = _hot(ks, ref)
    newest = rows[-1]
    broken = bytearray(newest.record)
    broken[len(broken) // 2] ^= 0x01
    _set_record(ks, ref, newest.seq, bytes(broken))
    with pytest.raises(IntegrityError):
        ks.memories.get("alice", NS, "k2")
    _set_record(ks, ref, newest.seq, bytes(newest.record))
    ks.memories.evict(ref)
    # Swapped: each record is bound to its sequence number.
    _set_record(ks, ref, rows[1].seq, bytes(rows[2].record))
    _set_record(ks, ref, rows[2].seq, bytes(rows[1].record))
    with pytest.raises(IntegrityError):
        ks.memories.get("alice", NS, "k2")
    _set_record(ks, ref, rows[1].seq, bytes(rows[1].record))
    _set_record(ks, ref, rows[2].seq, bytes(rows[2].record))
    ks.memories.evict(ref)
    # Cut: the head still counts it, so the older records cannot decide.
    with _engine(ks).begin() as conn:
        conn.execute(
            memory_hot.delete().where(
                memory_hot.c.subject_ref == ref, memory_hot.c.seq == newest.seq
            )
        )
    for key in ("k2", "k1"):
        ks.memories.evict(ref)
        with pytest.raises(IntegrityError):
            ks.memories.get("alice", NS, key)


def test_an_unfinished_deletion_is_finished_by_the_load(ks: Keyshred, loads: list[str]) -> None:
    """A deletion a crash stopped after marking its assets: a cold get loads the
    partition (which finishes what it can), whatever key it asks for."""
    ks.memories.put("alice", NS, "k", 1)
    doomed = ks.memories.put("alice", NS, "doomed", 2)
    ks.catalog.update_assets([doomed.memory_id], status=DELETING)
    ref = _cold(ks, "alice")
    loads.clear()
    assert ks.memories.get("alice", NS, "k").value == 1  # type: ignore[union-attr]
    assert loads == [ref]


def test_another_handle_reads_each_committed_write(ks: Keyshred, catalog_url: str) -> None:
    """A handle that never loads the partition still reads every write another
    handle committed, the newest first."""
    other = Keyshred.open(ks.path, make_config(catalog_url))
    try:
        ks.memories.put("alice", NS, "k", "v1")
        assert other.memories.get("alice", NS, "k").value == "v1"  # type: ignore[union-attr]
        ks.memories.put("alice", NS, "k", "v2")
        assert other.memories.get("alice", NS, "k").value == "v2"  # type: ignore[union-attr]
        ks.memories.delete("alice", NS, "k")
        assert other.memories.get("alice", NS, "k") is None
        ks.memories.put("alice", NS, "k", "v3")
        assert other.memories.get("alice", NS, "k").value == "v3"  # type: ignore[union-attr]
    finally:
        other.close()
