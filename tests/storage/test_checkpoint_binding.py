"""What a checkpoint's and a pending write's ciphertext is bound to
(``keyshred.storage.checkpoints.checkpoint_records`` / ``write_records``).

Before 2026-12-07 the AAD named (thread, namespace, checkpoint id[, task id, idx])
only: an edited ``channel``, ``task_path`` or ``parent_checkpoint_id`` column came
back as if written so (a value handed to another channel of the graph, a forged
parent). Now every such edit fails to open (``IntegrityError``), rows sealed at the
earlier record still open, and the subject guard of a read is the thread's, not the
one an edited ``subject_ref`` column names."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from langgraph.checkpoint.base import empty_checkpoint

from keyshred import Keyshred
from keyshred.errors import IntegrityError, SubjectSuppressed
from keyshred.integrations.langgraph import KeyshredSaver
from keyshred.keyring.envelope import Place
from keyshred.storage.checkpoints import checkpoint_records, thread_scope, write_records
from keyshred.storage.schema import checkpoint_writes, checkpoints
from tests.storage.conftest import make_config

# Each edit of a stored row, as (table, SET clause, WHERE clause): test vectors.
EDITS = [
    ("ks_checkpoint_writes", "channel = 'admin'", "channel = 'messages'"),
    ("ks_checkpoint_writes", "task_path = 'other'", "channel = 'messages'"),
    ("ks_checkpoint_writes", "task_id = 'task-x'", "channel = 'messages'"),
    ("ks_checkpoint_writes", "idx = 7", "channel = 'messages'"),
    ("ks_checkpoints", "parent_checkpoint_id = 'forged'", "parent_checkpoint_id IS NOT NULL"),
    ("ks_checkpoints", "parent_checkpoint_id = NULL", "parent_checkpoint_id IS NOT NULL"),
]


@pytest.fixture
def ks(catalog_url: str, tmp_path: Path) -> Iterator[Keyshred]:
    store = Keyshred.init(tmp_path / "data", make_config(catalog_url))
    yield store
    store.close()


def _thread(saver: KeyshredSaver, thread: str = "t1") -> dict[str, Any]:
    """Two checkpoints (the second with a parent) and two pending writes."""
    cfg: dict[str, Any] = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    cfg["configurable"]["subject_id"] = "ana"
    first = saver.put(cfg, empty_checkpoint(), {"step": 1}, {})
    first["configurable"]["subject_id"] = "ana"
    second = saver.put(first, empty_checkpoint(), {"step": 2}, {})
    second["configurable"]["subject_id"] = "ana"
    saver.put_writes(second, [("messages", "hello"), ("notes", "kept")], "task-1", "path")
    return second


def _edit(ks: Keyshred, table: str, set_: str, where: str) -> None:
    with ks.catalog.engine.begin() as conn:
        changed = conn.execute(sa.text(f"UPDATE {table} SET {set_} WHERE {where}")).rowcount
    assert changed >= 1


@pytest.mark.parametrize(("table", "set_", "where"), EDITS)
def test_an_edited_column_fails_to_open(ks: Keyshred, table: str, set_: str, where: str) -> None:
    saver = KeyshredSaver(ks)
    cfg = _thread(saver)
    before = saver.get_tuple(cfg)
    assert before is not None and before.pending_writes
    _edit(ks, table, set_, where)
    with pytest.raises(IntegrityError):
        saver.get_tuple(cfg)
    with pytest.raises(IntegrityError):
        list(saver.list({"configurable": {"thread_id": "t1"}}))
    with pytest.raises(IntegrityError):
        list(saver.list(None))


@pytest.mark.parametrize("table", ["ks_checkpoints", "ks_checkpoint_writes"])
def test_swapped_ciphertexts_fail_to_open(ks: Keyshred, table: str) -> None:
    saver = KeyshredSaver(ks)
    cfg = _thread(saver)
    tab = checkpoints if table == "ks_checkpoints" else checkpoint_writes
    key_cols = list(tab.primary_key.columns)
    with ks.catalog.engine.begin() as conn:
        rows = conn.execute(sa.select(*key_cols, tab.c.data)).all()
        assert len(rows) == 2
        for row, other in ((rows[0], rows[1]), (rows[1], rows[0])):
            conn.execute(
                tab.update()
                .where(*(col == row[i] for i, col in enumerate(key_cols)))
                .values(data=other[-1])
            )
    with pytest.raises(IntegrityError):
        saver.get_tuple(cfg)


def test_rows_sealed_at_the_earlier_record_still_open(ks: Keyshred) -> None:
    saver = KeyshredSaver(ks)
    cfg = _thread(saver)
    before = saver.get_tuple(cfg)
    assert before is not None
    th = ks.checkpoints.thread("t1")
    assert th is not None
    scope = thread_scope(th.thread_ref)
    # Seal every row again as a release before 2026-12-07 did, at the old record.
    with ks.catalog.engine.begin() as conn:
        c, w = checkpoints.c, checkpoint_writes.c
        for ns, cid, parent, data in conn.execute(
            sa.select(c.checkpoint_ns, c.checkpoint_id, c.parent_checkpoint_id, c.data)
        ).all():
            records = checkpoint_records(th.thread_ref, ns, cid, parent)
            place = Place(th.subject_ref, scope, "checkpoints", records[0], "data")
            plain = ks.keyring.open(bytes(data), place)
            old = Place(th.subject_ref, scope, "checkpoints", records[1], "data")
            conn.execute(
                checkpoints.update()
                .where(c.checkpoint_id == cid)
                .values(data=ks.keyring.seal(plain, old))
            )
        for ns, cid, task, idx, channel, path, data in conn.execute(
            sa.select(
                w.checkpoint_ns, w.checkpoint_id, w.task_id, w.idx, w.channel, w.task_path, w.data
            )
        ).all():
            records = write_records(th.thread_ref, ns, cid, task, idx, channel, path)
            place = Place(th.subject_ref, scope, "writes", records[0], "data")
            plain = ks.keyring.open(bytes(data), place)
            old = Place(th.subject_ref, scope, "writes", records[1], "data")
            conn.execute(
                checkpoint_writes.update()
                .where(w.task_id == task, w.idx == idx)
                .values(data=ks.keyring.seal(plain, old))
            )
    after = saver.get_tuple(cfg)
    assert after is not None
    assert after.checkpoint == before.checkpoint
    assert after.metadata == before.metadata
    assert after.parent_config == before.parent_config
    assert after.pending_writes == before.pending_writes
    # The earlier record never bound the channel: an edit of an old row goes
    # unnoticed, as it did then (what the current record fixes for new rows).
    _edit(ks, "ks_checkpoint_writes", "channel = 'admin'", "channel = 'messages'")
    edited = saver.get_tuple(cfg)
    assert edited is not None
    assert ("task-1", "admin", "hello") in edited.pending_writes


def test_a_read_takes_the_threads_guard_not_the_rows_subject_column(ks: Keyshred) -> None:
    saver = KeyshredSaver(ks)
    cfg = _thread(saver)
    bob = ks.subject_ref("bob")
    ks.memories.put("bob", ("m",), "k", {"n": 1})  # an active subject, with a guard
    th = ks.checkpoints.thread("t1")
    assert th is not None
    _edit(ks, "ks_checkpoints", f"subject_ref = '{bob}'", "subject_ref IS NOT NULL")
    ks.catalog.suppress(th.subject_ref)
    plain = {"configurable": {k: v for k, v in cfg["configurable"].items() if k != "subject_id"}}
    with pytest.raises(SubjectSuppressed):
        saver.get_tuple(plain)
