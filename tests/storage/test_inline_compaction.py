"""A small partition's compaction writes its rows back into the catalog (one sealed
hot record per scope, ``Partition._flush_inline``) instead of a Parquet segment: the
rows read the same, the bytes a compaction must remove go, the layout follows the
partition's size both ways, and a compacted partition is not rewritten until it
changes. Both catalogs (``ks`` runs on SQLite and PostgreSQL)."""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from keyshred import Keyshred
from keyshred.errors import IntegrityError
from keyshred.storage.memory_types import PutItem
from keyshred.storage.partition import INLINE_MAX_BYTES
from keyshred.storage.schema import memory_partitions
from tests import zygote
from tests.storage.conftest import make_config
from tests.storage.test_keyed_get import _cold, _hot, _set_record, _view, loads  # noqa: F401 - a fixture

NS = ("notes",)


def _counts(ks: Keyshred, subject: str) -> tuple[int, int, int]:
    """(heads, hot rows, live or retired segment rows) of the subject."""
    return ks._memories._hot.counts(ks.subject_ref(subject))  # type: ignore[attr-defined,no-any-return]


def _objects(ks: Keyshred, subject: str) -> list[str]:
    folder = ks.memories.partition_path(ks.subject_ref(subject))
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def _gen(ks: Keyshred, subject: str) -> int:
    with ks.catalog.engine.connect() as conn:
        return int(
            conn.execute(
                sa.select(memory_partitions.c.gen).where(
                    memory_partitions.c.subject_ref == ks.subject_ref(subject)
                )
            ).scalar_one()
        )


def refused(ks: Keyshred, subject: str, keys: Sequence[str], *, search: bool = True) -> None:
    """Each get of ``keys`` (and, with ``search``, a search) of a subject whose
    partition is read afresh raises ``IntegrityError``: cold, and loaded."""
    for key in keys:
        _cold(ks, subject)
        with pytest.raises(IntegrityError):
            ks.memories.get(subject, NS, key)
    if search:
        _cold(ks, subject)
        with pytest.raises(IntegrityError):
            ks.memories.search(subject, NS)


def _everything(ks: Keyshred, subject: str) -> dict[str, Any]:
    return {m.key: _view(m) for m in ks.memories.search(subject, NS, limit=1000)}


def test_a_small_partition_compacts_into_the_catalog(
    ks: Keyshred,
    loads: list[str],  # noqa: F811 - the fixture
) -> None:
    mem = ks.memories
    mem.put_many("alice", [PutItem(NS, f"k{i}", {"i": i}) for i in range(6)])
    mem.put("alice", NS, "k2", {"i": 22})  # an update: its old value is folded away
    mem.put("alice", NS, "h", {"t": "flu"}, scope="marketing", category="preference")
    mem.put("alice", NS, "bob", "met bob", mentions=["bob"])  # sealed under a shared key
    before = _everything(ks, "alice")
    assert _counts(ks, "alice")[1] == 4
    mem.flush("alice")
    # One record per scope, no segment, no object.
    assert _counts(ks, "alice") == (1, 2, 0)
    assert _objects(ks, "alice") == []
    assert sorted(r.scope for r in _hot(ks, ks.subject_ref("alice"))) == [
        "default",
        "marketing",
    ]
    assert _everything(ks, "alice") == before
    # Read cold: the get answers from the catalog alone (the row about bob: its
    # owners decide, through a load), and a reload reads the same.
    ref = _cold(ks, "alice")
    loads.clear()
    for key in ("k0", "k2", "k5", "h"):
        assert _view(mem.get("alice", NS, key)) == before[key]
    assert loads == []
    assert _view(mem.get("alice", NS, "bob")) == before["bob"]
    mem.evict(ref)
    assert _everything(ks, "alice") == before


def test_a_compacted_partition_is_rewritten_only_when_it_changed(ks: Keyshred) -> None:
    mem = ks.memories
    mem.put_many("alice", [PutItem(NS, f"k{i}", i) for i in range(5)])
    mem.flush("alice")
    gen = _gen(ks, "alice")
    # Loaded again (as after a restart) and flushed: nothing to fold.
    _cold(ks, "alice")
    assert len(_everything(ks, "alice")) == 5
    mem.flush("alice")
    assert _gen(ks, "alice") == gen
    mem.put("alice", NS, "k9", 9)
    mem.flush("alice")
    assert _gen(ks, "alice") == gen + 1
    assert _counts(ks, "alice") == (1, 1, 0)
    mem.flush("alice")
    assert _gen(ks, "alice") == gen + 1


def test_a_delete_leaves_no_record_that_held_the_value(ks: Keyshred) -> None:
    """Every delete is a compaction: the records that held the deleted memory go
    in its transaction, replaced by one that does not hold it."""
    mem = ks.memories
    mem.put("alice", NS, "keep", "kept")
    mem.put("alice", NS, "gone", "a secret")
    ref = ks.subject_ref("alice")
    held = {bytes(r.record) for r in _hot(ks, ref)}
    assert mem.delete("alice", NS, "gone")
    rows = _hot(ks, ref)
    assert len(rows) == 1 and not held & {bytes(r.record) for r in rows}
    assert _counts(ks, "alice") == (1, 1, 0)
    _cold(ks, "alice")
    assert mem.get("alice", NS, "gone") is None
    assert mem.get("alice", NS, "keep").value == "kept"  # type: ignore[union-attr]


def test_the_layout_follows_the_partition_size_both_ways(catalog_url: str, tmp_path: Path) -> None:
    """Past ``inline_max_rows`` a compaction writes segments (the records it folds
    included); back under it, a compaction retires every segment and (a delete:
    at once) deletes its object."""
    cfg = make_config(catalog_url, inline_max_rows=4)
    with Keyshred.init(tmp_path / "data", cfg) as ks:
        mem = ks.memories
        for i in range(3):
            mem.put("alice", NS, f"k{i}", i)
        mem.put("alice", NS, "h", "x", scope="marketing", category="preference")
        mem.flush("alice")
        assert _counts(ks, "alice") == (1, 2, 0)
        mem.put("alice", NS, "k3", 3)  # five rows: over the limit
        mem.flush("alice")
        heads, hot, segments = _counts(ks, "alice")
        assert (heads, hot, segments) == (1, 0, 2)
        assert len(_objects(ks, "alice")) == 2
        want = _everything(ks, "alice")
        _cold(ks, "alice")
        assert _everything(ks, "alice") == want
        assert mem.delete("alice", NS, "k0")  # four rows: back in the catalog
        assert _counts(ks, "alice") == (1, 2, 0)
        assert _objects(ks, "alice") == []
        del want["k0"]
        _cold(ks, "alice")
        assert _everything(ks, "alice") == want


def test_values_over_the_byte_bound_go_to_a_segment(ks: Keyshred) -> None:
    big = "x" * (INLINE_MAX_BYTES // 2)
    ks.memories.put("alice", NS, "a", big)
    ks.memories.put("alice", NS, "b", big)
    ks.memories.put("alice", NS, "c", "small")
    ks.memories.flush("alice")
    assert _counts(ks, "alice") == (1, 0, 1)
    _cold(ks, "alice")
    assert ks.memories.get("alice", NS, "a").value == big  # type: ignore[union-attr]


def test_a_store_of_segments_moves_into_the_catalog(catalog_url: str, tmp_path: Path) -> None:
    """A data folder whose small partitions are segments (written with
    ``inline_max_rows = 0``, or before it existed) keeps reading them, and its next
    compaction moves them into the catalog."""
    data = tmp_path / "data"
    with Keyshred.init(data, make_config(catalog_url, inline_max_rows=0)) as ks:
        for i in range(5):
            ks.memories.put("alice", NS, f"k{i}", i)
        ks.memories.flush("alice")
        assert _counts(ks, "alice") == (1, 0, 1)
        want = _everything(ks, "alice")
    with Keyshred.open(data, make_config(catalog_url)) as ks:
        assert _everything(ks, "alice") == want
        assert ks.memories.delete("alice", NS, "k4")
        assert _counts(ks, "alice") == (1, 1, 0)
        assert _objects(ks, "alice") == []
        del want["k4"]
    with Keyshred.open(data, make_config(catalog_url, inline_max_rows=0)) as ks:
        assert _everything(ks, "alice") == want  # and back: either setting reads both


def test_an_older_compaction_put_back_is_refused(ks: Keyshred) -> None:
    """The records a compaction wrote are bound to their sequence numbers: an older
    compaction's record put back over a newer one (a rollback of the catalog row)
    fails to open."""
    mem = ks.memories
    mem.put("alice", NS, "k", "old")
    mem.flush("alice")
    ref = ks.subject_ref("alice")
    (old,) = _hot(ks, ref)
    mem.put("alice", NS, "k", "new")
    mem.flush("alice")
    (new,) = _hot(ks, ref)
    assert new.seq > old.seq
    _set_record(ks, ref, new.seq, bytes(old.record))
    refused(ks, "alice", ["k"])


def test_a_scope_erasure_leaves_no_record_of_the_scope(ks: Keyshred) -> None:
    mem = ks.memories
    mem.put("alice", NS, "a", 1)
    mem.put("alice", NS, "h", "flu", scope="marketing", category="preference")
    mem.flush("alice")
    assert _counts(ks, "alice") == (1, 2, 0)
    req = ks.erase("alice", scope="marketing", requested_by="dpo", reason="withdrawn")
    assert req.state == "completed", req.error
    rows = _hot(ks, ks.subject_ref("alice"))
    assert [r.scope for r in rows] == ["default"]
    _cold(ks, "alice")
    assert mem.get("alice", NS, "a").value == 1  # type: ignore[union-attr]
    assert [m.key for m in mem.search("alice", NS)] == ["a"]


WORKER = r"""
import os, sys
from keyshred import Keyshred
from keyshred.storage import faults
from tests.storage.conftest import make_config

data, point = sys.argv[1], sys.argv[2]
ks = Keyshred.open(data, make_config(None))
def kill(reached, *_):
    if reached == point:
        os.kill(os.getpid(), 9)
faults.hook = kill
ks.memories.delete("alice", ("notes",), "k1")
"""


@pytest.mark.parametrize("point", ["flush.after_records", "flush.after_manifest"])
def test_a_kill_inside_a_compaction_into_the_catalog(tmp_path: Path, point: str) -> None:
    """SIGKILL with the records sealed but not committed, and after the commit: the
    store opens, every row but the one being deleted reads, and the deletion is
    either finished by the next open or never happened."""
    data = tmp_path / "data"
    with Keyshred.init(data, make_config(None)) as ks:
        for i in range(4):
            ks.memories.put("alice", NS, f"k{i}", i)
    proc = zygote.run(
        [sys.executable, "-c", WORKER, str(data), point],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    with Keyshred.open(data, make_config(None)) as ks:
        for i in (0, 2, 3):
            assert ks.memories.get("alice", NS, f"k{i}").value == i  # type: ignore[union-attr]
        assert ks.memories.get("alice", NS, "k1") is None  # marked first: finished now
        assert all(r.ok for r in ks.memories.repair_all())


def test_a_compacted_partition_in_a_backup_copy_is_unreadable_after_erasure(
    tmp_path: Path,
) -> None:
    """The records a compaction wrote into the catalog are rows of every backup's
    catalog snapshot: found decrypted (never raw) before the erasure, live and in a
    copy of the backup kept beyond its reach; after it, ciphertext under destroyed
    keys everywhere, and the bystander's records still open."""
    import shutil

    phone = "13812345678"
    with Keyshred.init(tmp_path / "data", make_config(None)) as ks:
        ks.memories.put("vic", NS, "own", {"phone": phone})
        ks.memories.put("vic", NS, "more", "x")
        ks.memories.put("bob", NS, "b", "bob's note")
        ks.memories.flush()
        assert _counts(ks, "vic") == (1, 1, 0) and _objects(ks, "vic") == []
        ks.backup.create(str(tmp_path / "b"))
        shutil.copytree(tmp_path / "b", tmp_path / "copy")
        roots = [tmp_path / "data", tmp_path / "copy"]
        before = ks.erasure.residue_scan([phone], roots)
        assert [h for h in before.hits if h.layer == "raw"] == []
        assert {(h.root, h.kind) for h in before.hits} == {
            (0, "memory_log_record"),
            (1, "memory_log_record"),
        }
        req = ks.erase("vic", requested_by="dpo", reason="art17")
        assert req.state == "completed", req.error
        after = ks.erasure.residue_scan([phone], roots)
        assert after.hits == [], after.as_dict()
        assert after.undecryptable["memory_log_record"] >= 1  # the copy's record
        assert after.decrypted["memory_log_record"] >= 2  # bob's, live and in the copy
        assert ks.memories.get("bob", NS, "b").value == "bob's note"  # type: ignore[union-attr]
