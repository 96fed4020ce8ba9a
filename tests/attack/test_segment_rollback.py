"""Attack: the catalog now records each segment's size and SHA-256, but a read
never checks them (``Partition._read_segment`` checks the footer MAC, which an
older segment of the same subject and scope also passes, and ``_load_checked``
only looks for memories *missing*, never for extra ones). Whoever can write the
partition store (a bucket, the folder) puts back a copy of a segment taken before
a delete under the live segment's name: the deleted memory is readable again."""

from __future__ import annotations

from pathlib import Path

import pytest

from keyshred import Keyshred
from keyshred.errors import IntegrityError
from tests.storage.conftest import parquet_config

NS = ("notes",)


@pytest.mark.parametrize("catalog_url", ["sqlite"], indirect=True)
def test_a_rolled_back_segment_does_not_bring_a_deleted_memory_back(
    catalog_url: str, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    config = parquet_config(catalog_url)
    with Keyshred.init(data, config) as ks:
        ks.memories.put("alice", NS, "gone", "deleted on request")
        ks.memories.put("alice", NS, "kept", "still here")
        ks.memories.flush()
        (old,) = sorted((data / "memories").rglob("seg-*.parquet"))
        saved = old.read_bytes()  # a copy taken before the delete
        assert ks.memories.delete("alice", NS, "gone")
        (live,) = sorted((data / "memories").rglob("seg-*.parquet"))
        assert live != old and not old.exists()
    live.write_bytes(saved)  # the copy put back under the live segment's name
    with Keyshred.open(data, config) as ks:
        try:
            back = ks.memories.get("alice", NS, "gone")
        except IntegrityError:
            return  # refused: what we want
        assert back is None, "a deleted memory came back from a rolled-back segment"
