"""Attack: ``delete``/``delete_many``/``drop_scope`` purge retired segments "at
once" by comparing their ``retired_at`` with this process's clock
(``Partition._leftovers``: ``cutoff = to_us_now() - 0``). A segment retired by a
worker whose clock runs ahead of this one's (the shared profile: many machines)
has ``retired_at`` in this worker's future, so the purge keeps it: the deleted
memory's bytes survive in it for the other clock's lead plus the grace period
after ``delete`` returned."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from keyshred import Keyshred
from keyshred.storage.schema import memory_segments
from tests.storage.conftest import parquet_config

NS = ("notes",)


@pytest.mark.parametrize("catalog_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("how", ["delete", "delete_many"])
def test_delete_purges_a_segment_retired_by_a_worker_with_a_clock_ahead(
    catalog_url: str, tmp_path: Path, how: str
) -> None:
    root = tmp_path / "data" / "memories"
    with Keyshred.init(tmp_path / "data", parquet_config(catalog_url)) as ks:
        ks.memories.put("alice", NS, "secret", {"text": "the secret"})
        ks.memories.flush()
        (first,) = sorted(root.rglob("seg-*.parquet"))  # holds "secret"
        ks.memories.put("alice", NS, "other", {"text": "other"})
        ks.memories.flush()  # retires ``first`` (grace: 300 s)
        # As if the second compaction had run on a machine whose clock is 2 s ahead.
        with ks._catalog.transaction() as conn:
            conn.execute(
                memory_segments.update()
                .where(memory_segments.c.name == first.name)
                .values(retired_at=memory_segments.c.retired_at + 2_000_000)
            )
        if how == "delete":
            assert ks.memories.delete("alice", NS, "secret")
        else:
            assert ks.memories.delete_many("alice", [(NS, "secret")]) == 1
        # "deleted" means the bytes are gone when this returns.
        assert not first.exists(), "a retired segment holding the deleted memory survived"
        with ks._catalog.transaction() as conn:
            left = conn.execute(
                sa.select(memory_segments.c.name).where(memory_segments.c.name == first.name)
            ).all()
        assert not left
