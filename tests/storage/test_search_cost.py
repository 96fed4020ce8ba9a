"""Semantic search costs what the ranking reaches, not a pass over the subject (#25).

The filter of a search (namespace prefix, scope, value filter) is asked about the
memories the ranking brings up, and the vector staleness check looks only at the
memories changed since the last check: both used to run over every memory of the
subject on every query (1,461 ms at 10,000 memories in the issue).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from keyshred import Keyshred
from keyshred.storage import memory_index, memory_read
from keyshred.storage.memories import PutItem

N = 1_500
DIMS = 32


def _vector(text: str) -> np.ndarray[Any, Any]:
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
    v = np.random.default_rng(seed).standard_normal(DIMS).astype(np.float32)
    return v / np.linalg.norm(v)


def _embed(texts: list[str]) -> list[np.ndarray[Any, Any]]:
    return [_vector(t) for t in texts]


@pytest.fixture
def ks(tmp_path: Path) -> Iterator[Keyshred]:
    store = Keyshred.init(tmp_path / "data", embeddings=_embed)
    items = [
        PutItem(("notes", f"g{i % 3}"), f"k{i}", {"text": f"memory {i}", "n": i}, index=["text"])
        for i in range(N)
    ]
    for start in range(0, N, 500):
        store.memories.put_many("alice", items[start : start + 500])
    yield store
    store.close()


def _counting_filter(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = memory_read.compile_filter

    def compile_counted(spec: Any) -> Callable[[Any], bool]:
        test = real(spec)

        def counted(value: Any) -> bool:
            calls[0] += 1
            return test(value)

        return counted

    monkeypatch.setattr(memory_read, "compile_filter", compile_counted)
    return calls


def _repair_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    real = memory_index.IndexMixin._repair

    def spy(self: Any, ref: str, part: Any, indexed: dict[str, Any], *a: Any, **kw: Any) -> None:
        sizes.append(len(indexed))
        real(self, ref, part, indexed, *a, **kw)

    monkeypatch.setattr(memory_index.IndexMixin, "_repair", spy)
    return sizes


def test_a_filtered_search_asks_the_filter_about_ranked_memories_only(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _counting_filter(monkeypatch)
    hits = ks.memories.search("alice", ("notes",), query="memory 7", filter={"n": {"$gte": 0}})
    assert [h.key for h in hits][:1] == ["k7"] and len(hits) == 10
    assert 0 < calls[0] < N // 10  # the old path asked it about all 1,500
    # A selective filter walks further down the ranking, and still finds its rows.
    calls[0] = 0
    hits = ks.memories.search("alice", ("notes",), query="memory 7", filter={"n": {"$lt": 5}})
    assert sorted(h.key for h in hits) == [f"k{i}" for i in range(5)]
    assert calls[0] <= N  # at most once per memory


def test_the_staleness_check_looks_at_what_changed_since_the_last_one(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes = _repair_sizes(monkeypatch)
    ks.memories.search("alice", query="memory 1")
    ks.memories.search("alice", query="memory 2")
    ks.memories.put("alice", ("notes", "g0"), "k0", {"text": "memory 9999"}, index=["text"])
    hits = ks.memories.search("alice", query="memory 9999")
    assert hits[0].key == "k0"  # the rewritten memory ranks by its new text
    # First search after loading: every memory once; then nothing; then the one put.
    assert sizes == [N, 1]


def test_a_memory_left_stale_is_re_embedded_by_the_next_search(
    ks: Keyshred, tmp_path: Path
) -> None:
    # Vectors removed behind the partition's back (a kill between a write's log
    # append and its vectors leaves the same state): a reopened store repairs them.
    ref = ks.subject_ref("alice")
    row = next(r for r in ks.memories._partition(ref).rows.values() if r.key == "k3")
    ks.vectors.delete(ref, [row.memory_id])
    ks.close()
    again = Keyshred.open(tmp_path / "data", embeddings=_embed)
    try:
        assert again.memories.search("alice", query="memory 3")[0].key == "k3"
    finally:
        again.close()


def test_a_batch_s_vectors_are_current_at_the_first_search_after_a_reopen(
    ks: Keyshred, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A batch's vectors carry each row's own version: a search after a reopen (every
    # memory checked once) re-embeds and rewrites none of them. They carried the
    # batch's clock, one microsecond off every row but the first, so the first
    # search of every subject written by put_many was a write of all its vectors.
    from keyshred.storage.vectors import VectorIndex

    ks.close()
    rewritten: list[int] = []
    real = VectorIndex.upsert

    def spy(self: Any, ref: str, items: Any, *a: Any, **kw: Any) -> Any:
        rewritten.append(len(items))
        return real(self, ref, items, *a, **kw)

    monkeypatch.setattr(VectorIndex, "upsert", spy)
    again = Keyshred.open(tmp_path / "data", embeddings=_embed)
    try:
        assert again.memories.search("alice", query="memory 3")[0].key == "k3"
        assert rewritten == []
    finally:
        again.close()
