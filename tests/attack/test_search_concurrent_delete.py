"""Attack: semantic search maps ranked ids back to rows without the partition's
lock: ``_semantic`` ranks with ``accept`` (``by_id.get``), then builds
``Memory(by_id[mid], score)`` from the same live dict. A memory another thread
deletes in between (``Partition._forget`` pops it from ``by_id`` in place) makes
the search raise ``KeyError`` (no KeyshredError). The test runs the delete at that
instant, as another thread of the process would."""

from __future__ import annotations

from pathlib import Path

import pytest

from keyshred import Keyshred
from tests.storage.conftest import make_config
from tests.storage.test_vectors import bag_of_words

NS = ("n",)


@pytest.mark.parametrize("catalog_url", ["sqlite"], indirect=True)
def test_a_delete_during_a_search_does_not_crash_it(catalog_url: str, tmp_path: Path) -> None:
    with Keyshred.init(tmp_path / "data", make_config(catalog_url), embeddings=bag_of_words) as ks:
        ks.memories.put("a", NS, "k", {"text": "kayak river paddle"}, index=True)
        ks.memories.put("a", NS, "j", {"text": "kayak lake"}, index=True)
        vectors = ks._memories._vector_store()
        original = vectors.search
        fired = []

        def search(*args, **kwargs):  # type: ignore[no-untyped-def]
            ranked = original(*args, **kwargs)
            if not fired:
                fired.append(1)
                ks.memories.delete("a", NS, "k")  # another thread, right now
            return ranked

        vectors.search = search  # type: ignore[method-assign]
        found = ks.memories.search("a", query="kayak river", limit=2)
        assert [m.key for m in found] in (["j"], ["k", "j"], ["j", "k"])
