"""``KeyshredStore`` against LangGraph's reference ``InMemoryStore``: the same
operations on both must give equal results (LangGraph ships no store conformance
suite and points at ``InMemoryStore`` as the reference). Then what it lacks: TTL
mapped on retention, ``delete_prefix``, ``erase_subject``, and no plaintext on disk."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from langgraph.store.memory import InMemoryStore

from keyshred import Keyshred
from keyshred.errors import InvalidInput, SubjectSuppressed
from keyshred.integrations.langgraph import KeyshredStore
from tests.storage.conftest import make_config
from tests.storage.test_vectors import DIMS, bag_of_words

INDEX = {"dims": DIMS, "embed": bag_of_words, "fields": ["text"]}


@pytest.fixture
def ks(catalog_url: str, tmp_path: Path) -> Iterator[Keyshred]:
    store = Keyshred.init(tmp_path / "data", make_config(catalog_url), embeddings=bag_of_words)
    yield store
    store.close()


def norm(result: Any) -> Any:
    """Results as comparable data (timestamps differ by nature, scores by rounding)."""
    if result is None:
        return None
    if isinstance(result, list):
        return [norm(r) for r in result]
    if isinstance(result, tuple):
        return result
    score = getattr(result, "score", None)
    return (
        tuple(result.namespace),
        result.key,
        result.value,
        None if score is None else round(float(score), 5),
    )


SUBJECTS = ("alice", "bob")


def workload(store: Any) -> list[Any]:
    """Puts, updates, deletes, gets, searches (prefix, filters, limit/offset,
    semantic), namespace listing; returns every read's result."""
    out: list[Any] = []
    for s in SUBJECTS:
        for i in range(6):
            store.put(
                ("users", s, "notes"),
                f"n{i}",
                {"text": f"{s} note {i} about {'sailing' if i % 2 else 'cooking'}", "i": i},
            )
        store.put(("users", s, "prefs"), "lang", {"text": f"{s} prefers tea", "i": 99})
        store.put(("users", s, "prefs", "deep"), "x", {"text": "deep value", "i": -1})
    store.put(("users", "alice", "notes"), "n1", {"text": "alice updated sailing", "i": 1})
    store.delete(("users", "bob", "notes"), "n2")
    for s in SUBJECTS:
        out.append(store.get(("users", s, "notes"), "n1"))
        out.append(store.get(("users", s, "notes"), "n2"))
        out.append(store.search(("users", s), limit=20))
        out.append(store.search(("users", s, "notes"), limit=2, offset=1))
        out.append(store.search(("users", s), filter={"i": {"$gte": 3}}, limit=20))
        out.append(store.search(("users", s), filter={"i": 4}))
        out.append(store.search(("users", s), query="sailing trip", limit=3))
        out.append(store.search(("users", s, "notes"), query="cooking", limit=2, offset=1))
        out.append(store.list_namespaces(prefix=("users", s)))
        out.append(store.list_namespaces(prefix=("users", s), max_depth=3))
        out.append(store.list_namespaces(prefix=("users", s), suffix=("deep",)))
        out.append(store.list_namespaces(prefix=("users", s), limit=1, offset=1))
    out.append(store.list_namespaces(prefix=("users",)))
    out.append(store.list_namespaces(prefix=("users", "*", "prefs")))
    out.append(store.search(("users",), filter={"i": 99}, limit=10))
    return out


def test_same_results_as_inmemorystore(ks: Keyshred) -> None:
    ours = KeyshredStore(ks, subject_from=1, index=INDEX)  # type: ignore[arg-type]
    reference = InMemoryStore(index=INDEX)  # type: ignore[arg-type]
    got, want = workload(ours), workload(reference)
    assert len(got) == len(want)
    for n, (a, b) in enumerate(zip(got, want, strict=True)):
        assert norm(a) == norm(b), f"operation {n}: {norm(a)} != {norm(b)}"


def test_missing_namespace(ks: Keyshred) -> None:
    # (InMemoryStore then lists the empty namespace its lookup created; we do not.)
    assert KeyshredStore(ks, subject_from=1).get(("users", "zed", "nothing"), "k") is None
    assert InMemoryStore().get(("users", "zed", "nothing"), "k") is None


def test_batch_reads_see_state_before_its_writes(ks: Keyshred) -> None:
    from langgraph.store.base import GetOp, PutOp

    for store in (KeyshredStore(ks, subject_from=1), InMemoryStore()):
        store.put(("u", "carl"), "k", {"v": 1})
        res = store.batch(
            [
                PutOp(("u", "carl"), "k", {"v": 2}),
                GetOp(("u", "carl"), "k"),
                GetOp(("u", "carl"), "k"),
            ]
        )
        assert res[0] is None and res[1].value == {"v": 1}  # type: ignore[union-attr]
        assert store.get(("u", "carl"), "k").value == {"v": 2}  # type: ignore[union-attr]


def test_async_twin(ks: Keyshred) -> None:
    store = KeyshredStore(ks, subject_from=1, index=INDEX)  # type: ignore[arg-type]

    async def run() -> Any:
        await store.aput(("u", "dora"), "k", {"text": "hello there"})
        return await store.asearch(("u", "dora"), query="hello")

    (hit,) = asyncio.run(run())
    assert hit.key == "k" and hit.score is not None and hit.score > 0.5


def test_ttl_maps_onto_retention_and_sweeps(ks: Keyshred) -> None:
    store = KeyshredStore(ks, subject_from=1, ttl={"default_ttl": 60, "refresh_on_read": True})
    store.put(("u", "eve"), "short", {"v": 1}, ttl=1)
    store.put(("u", "eve"), "long", {"v": 2})  # default_ttl: 60 minutes
    store.put(("u", "eve"), "forever", {"v": 3}, ttl=None)
    m = ks.memories.get("eve", ("u", "eve"), "short")
    assert m is not None and m.retain_until - m.updated_at <= timedelta(minutes=1, seconds=1)
    # Time passes: move the memories' clock 2 minutes on.
    real = ks.memories._clock
    ks.memories._clock = lambda: real() + timedelta(minutes=2)  # type: ignore[method-assign]
    store._now = lambda: real() + timedelta(minutes=2)  # type: ignore[method-assign]
    try:
        assert store.get(("u", "eve"), "short") is None  # expired: invisible at once
        assert store.get(("u", "eve"), "long") is not None  # refreshed on read
        from keyshred.storage.schema import assets

        with ks.catalog.engine.begin() as conn:  # the sweep reads retention from the catalog
            conn.execute(
                assets.update()
                .where(assets.c.asset_id == m.memory_id)
                .values(retain_until=real() - timedelta(seconds=1))
            )
        assert store.sweep_ttl() == 1
        assert ks.memories.get("eve", ("u", "eve"), "short") is None  # physically gone
        assert {i.key for i in store.search(("u", "eve"))} == {"long", "forever"}
    finally:
        ks.memories._clock = real  # type: ignore[method-assign]


def test_delete_prefix_and_erase_subject(ks: Keyshred, tmp_path: Path) -> None:
    probe = f"zq{uuid.uuid4().hex[:10]}"
    store = KeyshredStore(ks, subject_from=1, index=INDEX)  # type: ignore[arg-type]
    for i in range(4):
        store.put(("u", "finn", "a"), f"k{i}", {"text": f"{probe} {i}"})
        store.put(("u", "finn", "b"), f"k{i}", {"text": f"b {i}"})
    store.put(("u", "gail"), "k", {"text": "gail"})
    assert store.delete_prefix(("u", "finn", "a")) == 4
    assert store.search(("u", "finn", "a")) == []
    assert len(store.search(("u", "finn"))) == 4
    assert store.search(("u", "finn"), query=probe, limit=10)[0].namespace == ("u", "finn", "b")
    req = store.erase_subject("finn", requested_by="dpo", reason="art17", request_id="r1")
    assert req.state == "completed", req.error
    assert ks.erasure.receipt("r1") is not None
    with pytest.raises(SubjectSuppressed):
        store.get(("u", "finn", "b"), "k0")
    assert store.list_namespaces(prefix=("u",)) == [("u", "gail")]  # others unaffected
    ks.close()
    for path in (tmp_path / "data").rglob("*"):
        if path.is_file():
            assert probe.encode() not in path.read_bytes(), path


def test_namespace_without_subject_is_refused(ks: Keyshred) -> None:
    store = KeyshredStore(ks, subject_from=1)
    with pytest.raises(InvalidInput):
        store.put(("only-one-label",), "k", {"v": 1})


def test_deleting_a_users_items_in_one_batch_is_one_rewrite(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A batch of deletions was one compaction per item (quadratic: 3,000 items 71 s);
    # now one compaction, one hot transaction and one audit transaction per batch.
    from langgraph.store.base import PutOp

    from keyshred.storage.partition import Partition

    store = KeyshredStore(ks)
    ns = ("users", "dora", "notes")
    store.batch([PutOp(ns, f"k{i}", {"t": f"note {i}"}, index=False) for i in range(300)])
    store.put(ns, "k0", {"t": "corrected"})  # k0 has an earlier version too
    other = ("users", "dora", "keep")
    store.put(other, "k1", {"t": "stays"})
    flushes = [0]
    real = Partition.flush

    def counted(self: Partition, *, purge: bool = False) -> None:
        flushes[0] += 1
        real(self, purge=purge)

    monkeypatch.setattr(Partition, "flush", counted)
    before = len(ks.audit.events(event="memory.deleted"))
    store.batch([PutOp(ns, f"k{i}", None) for i in range(300)] + [PutOp(ns, "nope", None)])
    assert flushes[0] == 1
    assert store.search(ns, limit=1000) == []
    assert store.get(other, "k1") is not None and store.get(other, "k1").value == {"t": "stays"}  # type: ignore[union-attr]
    events = ks.audit.events(event="memory.deleted")[before:]
    assert len(events) == 300  # one per memory, chained (verify below), none for "nope"
    assert ks.audit.verify() >= 300
    assert ks.memories.count(store.subject_of(other)) == 1  # the item of the other namespace


def test_one_subjects_namespaces_leave_out_expired_memories(ks: Keyshred) -> None:
    """A prefix naming one subject lists from its partition (its namespace counts
    while no memory is past retention, its rows once one is): a namespace whose
    only memory expired is not listed, before and after the sweep, and a namespace
    listed again once a live memory is put there."""
    store = KeyshredStore(ks, subject_from=1)
    store.put(("u", "ann", "keep"), "a", {"v": 1}, ttl=None)
    store.put(("u", "ann", "short"), "b", {"v": 2}, ttl=1)
    store.put(("u", "ann", "deep", "x"), "c", {"v": 3}, ttl=None)
    assert store.list_namespaces(prefix=("u", "ann")) == [
        ("u", "ann", "deep", "x"),
        ("u", "ann", "keep"),
        ("u", "ann", "short"),
    ]
    real = ks.memories._clock
    ks.memories._clock = lambda: real() + timedelta(minutes=2)  # type: ignore[method-assign]
    try:
        listed = store.list_namespaces(prefix=("u", "ann"))
        assert listed == [("u", "ann", "deep", "x"), ("u", "ann", "keep")]
        assert store.list_namespaces(prefix=("u", "ann"), max_depth=3) == [
            ("u", "ann", "deep"),
            ("u", "ann", "keep"),
        ]
        store.put(("u", "ann", "short"), "b2", {"v": 4}, ttl=None)
        assert ("u", "ann", "short") in store.list_namespaces(prefix=("u", "ann"))
    finally:
        ks.memories._clock = real  # type: ignore[method-assign]
    # The fast path and the row scan agree on an ordinary subject.
    ref = ks.subject_ref("ann")
    part = ks.memories._partition(ref)
    fast = ks.memories.namespaces_ref(ref, ("u",))
    part.earliest_retain_us = 0  # as if a memory had expired: the rows are read
    assert ks.memories.namespaces_ref(ref, ("u",)) == fast


def test_a_batch_refused_for_a_later_users_consent_writes_nothing(ks: Keyshred) -> None:
    # check_put asked what put_many refuses of an item on its own, not what it
    # refuses for its subject: a later user's missing consent (ConsentRequired) was
    # raised after the earlier user's items were written.
    from langgraph.store.base import PutOp

    from keyshred.errors import ConsentRequired

    ks.consent.grant("alice", scope="support/health", category="health")
    store = KeyshredStore(ks, scope="support/health")
    with pytest.raises(ConsentRequired):
        store.batch(
            [
                PutOp(("alice", "notes"), "a", {"t": "alice note"}),
                PutOp(("bob", "notes"), "b", {"t": "bob note"}),  # bob gave no consent
            ]
        )
    assert store.get(("alice", "notes"), "a") is None


def test_a_batch_naming_a_subject_being_erased_writes_nothing(ks: Keyshred) -> None:
    # The same for a value that names (by a registered identifier) a subject whose
    # erasure has started: refused after alice's item was written.
    from langgraph.store.base import PutOp

    victim = "victim@example.org"
    ks.subjects.register_identifiers(victim, emails=["vic@example.org"])
    ks.memories.put(victim, ("m",), "k", "x")

    def stop(step: str, req: object) -> None:
        if step == "suppress":
            raise RuntimeError("stopped after the suppression")

    ks.erasure.on_step = stop
    with pytest.raises(RuntimeError):
        ks.erase(victim, requested_by="dpo", reason="art17")
    ks.erasure.on_step = None
    store = KeyshredStore(ks)
    with pytest.raises(SubjectSuppressed):
        store.batch(
            [
                PutOp(("alice", "notes"), "a", {"t": "alice note"}),
                PutOp(("bob", "notes"), "b", {"t": "wrote to vic@example.org"}),
            ]
        )
    assert store.get(("alice", "notes"), "a") is None
