"""Review of dacc97c (small partitions compacted into the catalog,
``Partition._flush_inline``): attacks hunting residue (a deleted or superseded value
left decryptable in the catalog), data loss on layout switches and mixed
processes, crashes inside the compaction, and catalog tampering of an inline
partition. ``# Failed on dacc97c`` marks the two tests that showed bugs, fixed in
the next commit (the load and the cold get refuse readable rows the catalog does
not file; a deletion finished at a load purges at once)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from keyshred import Keyshred
from keyshred.errors import IntegrityError, SubjectErased
from keyshred.storage.memory_types import PutItem
from keyshred.storage.partition import hot_place
from keyshred.storage.rowcodec import decode_record, row_key_id, row_place
from keyshred.storage.schema import memory_hot, memory_partitions, memory_segments
from tests import zygote
from tests.storage.conftest import make_config, parquet_config
from tests.storage.test_inline_compaction import refused
from tests.storage.test_keyed_get import _cold, _hot

NS = ("notes",)
ROOT = Path(__file__).resolve().parents[2]


def _counts(ks: Keyshred, subject: str) -> tuple[int, int, int]:
    return ks.memories.partition_rows(ks.subject_ref(subject))


def _objects(ks: Keyshred, subject: str) -> list[str]:
    folder = ks.memories.partition_path(ks.subject_ref(subject))
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def _readable(ks: Keyshred, subject: str) -> list[bytes]:
    """Every value a hot record of the subject yields to the live keyring (rows
    sealed under owner-set keys opened too; those under destroyed keys skipped)."""
    ref = ks.subject_ref(subject)
    ks.keyring.cache.clear()
    out: list[bytes] = []
    for r in _hot(ks, ref):
        try:
            payload = ks.keyring.open(bytes(r.record), hot_place(ref, r.scope, int(r.seq)))
        except SubjectErased:
            continue
        op, rows = decode_record(payload)
        if op != "put":
            continue
        for row in rows:
            if row.sealed is None:
                out.append(row.value)
                continue
            try:
                key = ks.keyring.data_key_by_id(row_key_id(row))  # type: ignore[arg-type]
            except SubjectErased:
                continue
            out.append(key.open(row.sealed, row_place(ref, row)))
    return out


def _holds(ks: Keyshred, subject: str, needle: str) -> bool:
    return any(needle.encode() in v for v in _readable(ks, subject))


def _everything(ks: Keyshred, subject: str) -> dict[str, Any]:
    return {m.key: m.value for m in ks.memories.search(subject, NS, limit=1000)}


def _rows(ks: Keyshred, table: sa.Table, ref: str) -> list[dict[str, Any]]:
    with ks.catalog.engine.connect() as conn:
        return [
            dict(r._mapping)
            for r in conn.execute(sa.select(table).where(table.c.subject_ref == ref))
        ]


def _replace(ks: Keyshred, ref: str, head: list[dict[str, Any]], hot: list[dict[str, Any]]) -> None:
    """Put back a partition's catalog rows (an attacker with the catalog, no key)."""
    with ks.catalog.engine.begin() as conn:
        conn.execute(memory_hot.delete().where(memory_hot.c.subject_ref == ref))
        conn.execute(memory_partitions.delete().where(memory_partitions.c.subject_ref == ref))
        if head:
            conn.execute(memory_partitions.insert(), head)
        if hot:
            conn.execute(memory_hot.insert(), hot)


# -- 1. residue ---------------------------------------------------------------------


def test_purge_superseded_after_a_cold_load_removes_the_old_value(ks: Keyshred) -> None:
    mem = ks.memories
    mem.put("alice", NS, "k", "old-secret-1")
    mem.put("alice", NS, "o", "other")
    mem.flush("alice")
    assert _counts(ks, "alice") == (1, 1, 0)
    ref = _cold(ks, "alice")
    mem.put("alice", NS, "k", "new-value")
    mem.evict(ref)  # the next purge loads: snapshot + an update record
    assert _holds(ks, "alice", "old-secret-1")
    mem.purge_superseded(ref)
    assert not _holds(ks, "alice", "old-secret-1")
    assert _everything(ks, "alice") == {"k": "new-value", "o": "other"}


def test_a_folded_cache_catches_up_before_purging(ks: Keyshred, tmp_path: Path) -> None:
    """Handle A holds the partition loaded and folded; handle B (segments only)
    updates it; A's purge must fold B's record, not skip as 'folded'."""
    mem = ks.memories
    mem.put("alice", NS, "k", "old-secret-2")
    mem.put("alice", NS, "o", "other")
    mem.flush("alice")
    ref = _cold(ks, "alice")
    assert len(_everything(ks, "alice")) == 2  # loaded: folded
    mem.flush("alice")
    with Keyshred.open(ks.path, parquet_config(ks.config.storage.catalog_url)) as b:
        b.memories.put("alice", NS, "k", "new-value")
    mem.purge_superseded(ref)
    assert not _holds(ks, "alice", "old-secret-2")
    assert _everything(ks, "alice") == {"k": "new-value", "o": "other"}


def test_a_delete_in_a_folded_cache_after_another_handles_compaction(
    ks: Keyshred,
) -> None:
    mem = ks.memories
    for i in range(4):
        mem.put("alice", NS, f"k{i}", f"v{i}")
    mem.put("alice", NS, "gone", "deleted-secret")
    mem.flush("alice")
    _cold(ks, "alice")
    assert len(_everything(ks, "alice")) == 5  # folded cache in ks
    with Keyshred.open(ks.path, make_config(ks.config.storage.catalog_url)) as b:
        b.memories.put("alice", NS, "k9", "v9")
        b.memories.flush("alice")  # another inline compaction: a new generation
    assert mem.delete("alice", NS, "gone")
    assert not _holds(ks, "alice", "deleted-secret")
    assert "gone" not in _everything(ks, "alice")
    assert _everything(ks, "alice")["k9"] == "v9"


def test_a_memory_moved_into_a_scope_then_erased_leaves_no_version(ks: Keyshred) -> None:
    mem = ks.memories
    mem.put("alice", NS, "a", "default-version-secret")
    mem.put("alice", NS, "keep", "kept")
    mem.flush("alice")
    mem.put("alice", NS, "a", "marketing-version", scope="marketing", category="preference")
    mem.flush("alice")
    _cold(ks, "alice")
    req = ks.erase("alice", scope="marketing", requested_by="dpo", reason="x")
    assert req.state == "completed", req.error
    assert not _holds(ks, "alice", "default-version-secret")
    assert not _holds(ks, "alice", "marketing-version")
    _cold(ks, "alice")
    assert mem.get("alice", NS, "a") is None
    assert _everything(ks, "alice") == {"keep": "kept"}


def test_a_memory_moved_out_of_a_scope_survives_its_erasure(ks: Keyshred) -> None:
    mem = ks.memories
    mem.put("alice", NS, "a", "mk-secret", scope="marketing", category="preference")
    mem.put("alice", NS, "m2", "mk2", scope="marketing", category="preference")
    mem.flush("alice")
    mem.put("alice", NS, "a", "now-default")  # moved out, not flushed
    _cold(ks, "alice")
    req = ks.erase("alice", scope="marketing", requested_by="dpo", reason="x")
    assert req.state == "completed", req.error
    assert not _holds(ks, "alice", "mk-secret")
    assert not _holds(ks, "alice", "mk2")
    _cold(ks, "alice")
    assert _everything(ks, "alice") == {"a": "now-default"}
    assert [r["scope"] for r in _rows(ks, memory_hot, ks.subject_ref("alice"))] == ["default"]


def test_an_opaque_row_rides_every_layout_byte_for_byte(tmp_path: Path) -> None:
    """A row whose owner-set key was destroyed is carried through inline ->
    segments -> inline compactions unchanged, and the partition keeps loading."""
    cfg = make_config(None, inline_max_rows=4)
    with Keyshred.init(tmp_path / "data", cfg) as ks:
        mem = ks.memories
        victim = "victim@example.org"
        mem.put(victim, NS, "own", "x")
        shared = mem.put("dave", NS, "m", "victim sails", mentions=[victim])
        mem.put("dave", NS, "d0", "d0")
        mem.flush()
        dave = ks.subject_ref("dave")
        ks.keyring.destroy(ks.subject_ref(victim))
        ks.keyring.cache.clear()
        mem.evict(dave)

        def sealed() -> bytes:
            ks.keyring.cache.clear()
            for r in _hot(ks, dave):
                op, rows = decode_record(
                    ks.keyring.open(bytes(r.record), hot_place(dave, r.scope, int(r.seq)))
                )
                for row in rows if op == "put" else []:
                    if row.memory_id == shared.memory_id:
                        return bytes(row.sealed)  # type: ignore[arg-type]
            raise AssertionError("the opaque row is not in the records")

        before = sealed()
        for i in range(1, 5):  # past the bound: segments
            mem.put("dave", NS, f"d{i}", f"d{i}")
        mem.flush("dave")
        assert _counts(ks, "dave")[2] >= 1
        mem.evict(dave)
        for i in range(1, 5):  # back under: inline (each delete compacts)
            assert mem.delete("dave", NS, f"d{i}")
        assert _counts(ks, "dave")[1:] == (1, 0) or _counts(ks, "dave")[2] == 0
        assert sealed() == before
        mem.evict(dave)
        assert _everything(ks, "dave") == {"d0": "d0"}
        assert mem.repair(dave).clean
        assert mem.delete_by_id(dave, shared.memory_id)
        with pytest.raises(AssertionError):
            sealed()


# -- 4. tampering -------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["inline", "segments"])
def test_a_catalog_rollback_after_a_delete_does_not_bring_the_memory_back(
    tmp_path: Path, layout: str
) -> None:
    """An attacker with write access to the catalog (no key) saves the subject's
    head and hot rows, lets a delete run, then puts the saved rows back. With
    segments, the delete purged the object the old rows name: the load raises.
    Inline, the saved rows are the whole partition: the catalog no longer files
    the deleted memory, which the load and the cold get now check."""
    cfg = make_config(None) if layout == "inline" else parquet_config(None)
    with Keyshred.init(tmp_path / "data", cfg) as ks:
        mem = ks.memories
        mem.put("alice", NS, "keep", "kept")
        mem.put("alice", NS, "gone", "deleted-secret")
        mem.flush("alice")
        ref = ks.subject_ref("alice")
        head, hot = _rows(ks, memory_partitions, ref), _rows(ks, memory_hot, ref)
        segs = _rows(ks, memory_segments, ref)
        assert mem.delete("alice", NS, "gone")
        _replace(ks, ref, head, hot)
        if segs:
            with ks.catalog.engine.begin() as conn:
                conn.execute(memory_segments.delete().where(memory_segments.c.subject_ref == ref))
                conn.execute(memory_segments.insert(), segs)
        # Failed on dacc97c (inline only): the deleted memory read again.
        refused(ks, "alice", ["gone"])


def test_the_base_moved_past_one_scopes_snapshot_record_raises(ks: Keyshred) -> None:
    mem = ks.memories
    mem.put("alice", NS, "a", 1)
    mem.put("alice", NS, "h", "x", scope="marketing", category="preference")
    mem.flush("alice")
    ref = ks.subject_ref("alice")
    first = _hot(ks, ref)[0]
    with ks.catalog.engine.begin() as conn:
        conn.execute(
            memory_hot.delete().where(
                memory_hot.c.subject_ref == ref, memory_hot.c.seq == first.seq
            )
        )
        conn.execute(
            memory_partitions.update()
            .where(memory_partitions.c.subject_ref == ref)
            .values(base_seq=first.seq + 1)
        )
    refused(ks, "alice", ["a", "h"])


def test_the_newest_snapshot_record_cut_with_the_head_moved_back_raises(ks: Keyshred) -> None:
    mem = ks.memories
    mem.put("alice", NS, "a", 1)
    mem.put("alice", NS, "h", "x", scope="marketing", category="preference")
    mem.flush("alice")
    ref = ks.subject_ref("alice")
    last = _hot(ks, ref)[-1]
    with ks.catalog.engine.begin() as conn:
        conn.execute(
            memory_hot.delete().where(memory_hot.c.subject_ref == ref, memory_hot.c.seq == last.seq)
        )
        conn.execute(
            memory_partitions.update()
            .where(memory_partitions.c.subject_ref == ref)
            .values(next_seq=last.seq)
        )
    refused(ks, "alice", ["a", "h"], search=False)


def test_snapshot_records_swapped_between_subjects_raise(ks: Keyshred) -> None:
    mem = ks.memories
    mem.put("alice", NS, "k", "alice's")
    mem.put("bob", NS, "k", "bob's")
    mem.flush()
    a, b = ks.subject_ref("alice"), ks.subject_ref("bob")
    ha, hb = _rows(ks, memory_partitions, a), _rows(ks, memory_partitions, b)
    ra, rb = _rows(ks, memory_hot, a), _rows(ks, memory_hot, b)
    # Bob's partition rows (head and record) put under alice's ref.
    _replace(ks, a, [{**hb[0], "subject_ref": a}], [{**rb[0], "subject_ref": a}])
    refused(ks, "alice", ["k"])
    del ha, ra


def test_two_scopes_records_swapped_in_sequence_raise(ks: Keyshred) -> None:
    mem = ks.memories
    mem.put("alice", NS, "a", 1)
    mem.put("alice", NS, "h", "x", scope="marketing", category="preference")
    mem.flush("alice")
    ref = ks.subject_ref("alice")
    r0, r1 = _rows(ks, memory_hot, ref)
    head = _rows(ks, memory_partitions, ref)
    _replace(ks, ref, head, [{**r0, "seq": r1["seq"]}, {**r1, "seq": r0["seq"]}])
    mem.evict(ref)
    with pytest.raises(IntegrityError):
        mem.get("alice", NS, "a")
    # Only the scope column relabelled (same seqs): opened under the wrong place.
    _replace(ks, ref, head, [{**r0, "scope": r1["scope"]}, {**r1, "scope": r0["scope"]}])
    refused(ks, "alice", ["a"])


def test_a_record_relabelled_to_an_erased_scope_raises(ks: Keyshred) -> None:
    """The default snapshot relabelled as the erased marketing scope: opening by
    the key id in its header finds the live default key, the place does not match."""
    mem = ks.memories
    mem.put("alice", NS, "a", 1)
    mem.put("alice", NS, "h", "x", scope="marketing", category="preference")
    mem.flush("alice")
    req = ks.erase("alice", scope="marketing", requested_by="dpo", reason="x")
    assert req.state == "completed", req.error
    ref = ks.subject_ref("alice")
    (rec,) = _rows(ks, memory_hot, ref)
    _replace(ks, ref, _rows(ks, memory_partitions, ref), [{**rec, "scope": "marketing"}])
    mem.evict(ref)
    with pytest.raises((IntegrityError, Exception)) as info:
        mem.get("alice", NS, "a")
    assert isinstance(info.value, IntegrityError), repr(info.value)


# -- 3. crashes inside the compaction into the catalog ------------------------------

WORKER = r"""
import os, sys
sys.path.insert(0, os.getcwd())
from keyshred import Keyshred
from keyshred.storage import faults
from tests.storage.conftest import make_config

data, rows, op, point = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
ks = Keyshred.open(data, make_config(None, inline_max_rows=rows))
def kill(reached, *_):
    if reached == point:
        os.kill(os.getpid(), 9)
faults.hook = kill
if op == "delete":
    ks.memories.delete("alice", ("notes",), "k0")
elif op == "update":
    ks.memories.put("alice", ("notes",), "k1", "updated")
    print("ACK", flush=True)
    ks.memories.purge_superseded(ks.subject_ref("alice"))
elif op == "close":
    ks.memories.put("alice", ("notes",), "late", "late")
    print("ACK", flush=True)
    ks.close()
"""


def _kill(data: Path, rows: int, op: str, point: str) -> subprocess.CompletedProcess[str]:
    proc = zygote.run(
        [sys.executable, "-c", WORKER, str(data), str(rows), op, point],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    return proc


@pytest.mark.parametrize(
    ("rows", "point"),
    [
        (4, "flush.after_records"),
        (4, "flush.after_manifest"),
        (0, "flush.after_segment"),  # the same kills on the segment layout
        (0, "flush.after_manifest"),
    ],
)
def test_a_kill_in_a_delete_that_moves_segments_into_the_catalog(
    tmp_path: Path, rows: int, point: str
) -> None:
    """Five memories in segments (bound 4); the delete of one compacts the other
    four into the catalog and is killed inside that compaction. The store opens
    and reads right; the deleted value's old segment must go when the reopened
    store finishes the delete (a delete does not wait for the grace period)."""
    data = tmp_path / "data"
    cfg = make_config(None, inline_max_rows=rows)
    with Keyshred.init(data, cfg) as ks:
        for i in range(4):
            ks.memories.put("alice", NS, f"k{i}", f"value-{i}")
        ks.memories.put("alice", NS, "h", "mk", scope="marketing", category="preference")
        ks.memories.flush("alice")
        assert _counts(ks, "alice") == (1, 0, 2)
        ref = ks.subject_ref("alice")
        default_seg = next(
            r["name"] for r in _rows(ks, memory_segments, ref) if r["scope"] == "default"
        )
    _kill(data, rows, "delete", point)
    with Keyshred.open(data, cfg) as ks:
        want = {f"k{i}": f"value-{i}" for i in (1, 2, 3)} | {"h": "mk"}
        for key, value in want.items():
            got = ks.memories.get("alice", NS, key)
            assert got is not None and got.value == value, key
        assert ks.memories.get("alice", NS, "k0") is None
        assert _everything(ks, "alice") == want
        assert not _holds(ks, "alice", "value-0")
        # Failed on dacc97c (all four, so older than it): the segment that held k0
        # was retired but its object stayed for retired_grace_seconds after the
        # reopened store finished the delete (``_finish_deletes`` flushed without
        # purge).
        assert default_seg not in _objects(ks, "alice")
        assert all(r.ok for r in ks.memories.repair_all())


@pytest.mark.parametrize("point", ["flush.after_records", "flush.after_manifest"])
def test_a_kill_in_a_purge_after_an_update(tmp_path: Path, point: str) -> None:
    data = tmp_path / "data"
    cfg = make_config(None)
    with Keyshred.init(data, cfg) as ks:
        for i in range(3):
            ks.memories.put("alice", NS, f"k{i}", f"value-{i}")
        ks.memories.flush("alice")
    proc = _kill(data, 32, "update", point)
    assert "ACK" in proc.stdout
    with Keyshred.open(data, cfg) as ks:
        assert ks.memories.get("alice", NS, "k1").value == "updated"  # type: ignore[union-attr]
        assert _everything(ks, "alice") == {"k0": "value-0", "k1": "updated", "k2": "value-2"}
        ks.memories.purge_superseded(ks.subject_ref("alice"))
        assert not _holds(ks, "alice", "value-1")
        assert all(r.ok for r in ks.memories.repair_all())


@pytest.mark.parametrize("point", ["flush.after_records", "flush.after_manifest"])
def test_a_kill_in_the_close_compaction(tmp_path: Path, point: str) -> None:
    data = tmp_path / "data"
    cfg = make_config(None)
    with Keyshred.init(data, cfg) as ks:
        for i in range(3):
            ks.memories.put("alice", NS, f"k{i}", f"value-{i}")
    proc = _kill(data, 32, "close", point)
    assert "ACK" in proc.stdout
    with Keyshred.open(data, cfg) as ks:
        want = {f"k{i}": f"value-{i}" for i in range(3)} | {"late": "late"}
        assert _everything(ks, "alice") == want
        ks.memories.evict(ks.subject_ref("alice"))
        assert ks.memories.get("alice", NS, "late").value == "late"  # type: ignore[union-attr]
        assert all(r.ok for r in ks.memories.repair_all())


# -- 2. layouts, mixed processes, backup --------------------------------------------

RACER = r"""
import os, sys, json
sys.path.insert(0, os.getcwd())
from keyshred import Keyshred
from tests.storage.conftest import make_config

data, rows, tag, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
ks = Keyshred.open(data, make_config(None, inline_max_rows=rows))
model = {}
for i in range(n):
    key = f"{tag}{i % 12}"
    if i % 5 == 4:
        ks.memories.delete("alice", ("notes",), key)
        model.pop(key, None)
    else:
        scope = "marketing" if i % 3 == 0 else "default"
        kw = {"scope": scope, "category": "preference"} if scope == "marketing" else {}
        ks.memories.put("alice", ("notes",), key, f"{tag}-{i}", **kw)
        model[key] = f"{tag}-{i}"
    if i % 4 == 3:
        ks.memories.flush("alice")
    got = ks.memories.get("alice", ("notes",), key)
    assert (None if got is None else got.value) == model.get(key), (key, got, model.get(key))
print(json.dumps(model), flush=True)
ks.close()
"""


def test_two_processes_of_either_layout_write_one_subject_at_once(tmp_path: Path) -> None:
    import json

    data = tmp_path / "data"
    with Keyshred.init(data, make_config(None)) as ks:
        ks.memories.put("alice", NS, "base", "base")
    procs = [
        zygote.Popen(
            [sys.executable, "-c", RACER, str(data), rows, tag, "60"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rows, tag in (("0", "p"), ("32", "q"))
    ]
    model: dict[str, Any] = {"base": "base"}
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        model.update(json.loads(out.strip().splitlines()[-1]))
    for cfg in (make_config(None), parquet_config(None)):
        with Keyshred.open(data, cfg) as ks:
            assert _everything(ks, "alice") == model
            ks.memories.evict(ks.subject_ref("alice"))
            for key, value in model.items():
                assert ks.memories.get("alice", NS, key).value == value  # type: ignore[union-attr]
            assert all(r.ok and r.clean for r in ks.memories.repair_all())


def test_layout_ping_pong_between_two_handles(tmp_path: Path) -> None:
    """Handles of both settings take turns on one subject whose size crosses the
    bound both ways; each reads the other's compaction (cold and cached)."""
    data = tmp_path / "data"
    a = Keyshred.init(data, make_config(None, inline_max_rows=3))
    b = Keyshred.open(data, parquet_config(None))
    try:
        model: dict[str, Any] = {}
        for step in range(12):
            h = a if step % 2 == 0 else b
            key = f"k{step % 5}"
            if step % 3 == 2 and model:
                gone = sorted(model)[0]
                assert h.memories.delete("alice", NS, gone)
                del model[gone]
            else:
                h.memories.put("alice", NS, key, step)
                model[key] = step
            h.memories.flush("alice")
            for other in (a, b):
                assert _everything(other, "alice") == model, step
                other.memories.evict(other.subject_ref("alice"))
                for k, v in model.items():
                    assert other.memories.get("alice", NS, k).value == v  # type: ignore[union-attr]
        assert all(r.clean for r in a.memories.repair_all())
    finally:
        b.close()
        a.close()


def test_repair_apply_on_an_inline_partition_changes_nothing(ks: Keyshred) -> None:
    mem = ks.memories
    mem.put("alice", NS, "a", 1)
    mem.put("alice", NS, "h", "x", scope="marketing", category="preference")
    mem.flush("alice")
    ref = ks.subject_ref("alice")
    before = _rows(ks, memory_hot, ref)
    report = mem.repair(ref, apply=True)
    assert report.clean
    assert _rows(ks, memory_hot, ref) == before
    assert _everything(ks, "alice") == {"a": 1, "h": "x"}


def test_backup_scope_erasure_restore_of_an_inline_partition(ks: Keyshred, tmp_path: Path) -> None:
    mem = ks.memories
    mem.put("alice", NS, "a", "kept")
    mem.put("alice", NS, "h", "mk-secret", scope="marketing", category="preference")
    mem.put("bob", NS, "b", "bob")
    mem.flush()
    gen = ks.backup.create()
    req = ks.erase("alice", scope="marketing", requested_by="dpo", reason="x")
    assert req.state == "completed", req.error
    mem.put("alice", NS, "after", "after")
    into = tmp_path / "restored"
    report = ks.backup.restore(gen.generation, into)
    assert report.subjects_verified == 2
    with Keyshred.open(into) as r:
        assert _everything(r, "alice") == {"a": "kept"}
        assert _everything(r, "bob") == {"b": "bob"}
        assert not _holds(r, "alice", "mk-secret")
        r.memories.evict(r.subject_ref("alice"))
        assert r.memories.get("alice", NS, "a").value == "kept"  # type: ignore[union-attr]
        assert [x["scope"] for x in _rows(r, memory_hot, r.subject_ref("alice"))] == ["default"]


def test_erasing_a_big_scope_moves_the_rest_into_the_catalog(tmp_path: Path) -> None:
    with Keyshred.init(tmp_path / "data", make_config(None, inline_max_rows=4)) as ks:
        mem = ks.memories
        mem.put_many(
            "alice",
            [
                PutItem(NS, f"m{i}", f"mk-secret-{i}", "marketing", None, "preference")
                for i in range(6)
            ],
        )
        mem.put("alice", NS, "a", "kept")
        mem.flush("alice")
        assert _counts(ks, "alice")[2] == 2
        req = ks.erase("alice", scope="marketing", requested_by="dpo", reason="x")
        assert req.state == "completed", req.error
        assert _counts(ks, "alice") == (1, 1, 0)
        assert _objects(ks, "alice") == []
        assert not any(b"mk-secret" in v for v in _readable(ks, "alice"))
        _cold(ks, "alice")
        assert _everything(ks, "alice") == {"a": "kept"}


def test_a_value_shrinking_under_the_byte_bound_purges_its_segment(ks: Keyshred) -> None:
    from keyshred.storage.partition import INLINE_MAX_BYTES

    mem = ks.memories
    big = "big-secret" + "x" * (INLINE_MAX_BYTES // 2)
    mem.put("alice", NS, "a", big)
    mem.put("alice", NS, "b", big)
    mem.flush("alice")
    assert _counts(ks, "alice") == (1, 0, 1)
    mem.put("alice", NS, "a", "small")
    assert mem.delete("alice", NS, "b")  # a purge: back in the catalog
    assert _counts(ks, "alice") == (1, 1, 0)
    assert _objects(ks, "alice") == []
    assert not _holds(ks, "alice", "big-secret")
    _cold(ks, "alice")
    assert _everything(ks, "alice") == {"a": "small"}


def test_a_whole_subject_erasure_of_an_inline_partition_verifies(ks: Keyshred) -> None:
    mem = ks.memories
    mem.put("vic", NS, "a", "vic-secret")
    mem.put("vic", NS, "h", "x", scope="marketing", category="preference")
    mem.put("bob", NS, "b", "met vic", mentions=["vic"])
    mem.put("bob", NS, "c", "bob's own")
    mem.flush()
    req = ks.erase("vic", requested_by="dpo", reason="x")
    assert req.state == "completed", req.error
    assert _counts(ks, "vic") == (0, 0, 0)
    _cold(ks, "bob")
    assert _everything(ks, "bob") == {"c": "bob's own"}
    assert not _holds(ks, "bob", "met vic")
    assert all(r.ok for r in ks.memories.repair_all())
