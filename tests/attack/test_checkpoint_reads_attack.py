"""Attack on the checkpoint reads and writes of the parked-connections change
(``CheckpointStore._rows`` with ``_keys_for`` and ``open_encoded``, pending writes
sorted in Python, ``ensure_thread(check=False)`` on the saver's write path).

Tampering with the catalog's checkpoint rows (swapped, moved, truncated or
re-keyed ciphertext; edited key columns) must make every read raise
``IntegrityError``; state about a suppressed subject stays unreadable; a write
racing a suppression stores nothing and makes no key; a writer killed with SIGKILL
while other handles hold parked SQLite connections leaves a store that reads and
writes.

Defects (these tests failed on 5d1802e; fixed: the current record ids bind the
channel and task path, ``_rows`` refuses a column of the wrong type before sorting,
and a write checks in its transaction that its thread still exists, while
``delete_thread`` deletes the thread's row first, in one transaction with its
rows):

- ``channel`` and ``task_path`` of a pending write are not in its ciphertext's
  associated data (the record id is thread/ns/checkpoint/task_id/idx): swapping
  the channels of two writes, or the task paths of two tasks (the first key of
  ``_write_order``), is read back undetected (predates b3a9a90);
- a write's ``task_id`` or ``task_path`` stored as a BLOB on SQLite makes
  ``_write_order``'s sort raise ``TypeError``, not ``IntegrityError`` (new in the
  change for ``task_id``: b3a9a90 sorted in SQL and the AAD check raised
  ``IntegrityError``; b3a9a90 returned ``"b'~a'"`` as the task path, and both
  return ``"b'ch1'"`` as a channel);
- after another handle's ``delete_thread``, a handle that still caches the
  thread and its key stores the next ``put`` under the destroyed key for a thread
  row that no longer exists (predates b3a9a90).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from langgraph.checkpoint.base import empty_checkpoint

from keyshred import Keyshred, db
from keyshred.errors import IntegrityError, KeyshredError, NotFound, SubjectSuppressed
from keyshred.integrations.langgraph import KeyshredSaver
from keyshred.keyring import schema as key_schema
from keyshred.storage.schema import checkpoint_writes, checkpoints
from tests import zygote
from tests.storage.conftest import make_config

PHONE = "+49 30 1234567"
ROOT = Path(__file__).resolve().parents[2]


def _cfg(thread: str, subject: str, cid: str | None = None) -> dict[str, Any]:
    conf: dict[str, Any] = {"thread_id": thread, "checkpoint_ns": "", "subject_id": subject}
    if cid is not None:
        conf["checkpoint_id"] = cid
    return {"configurable": conf}


def _checkpoint(note: str) -> Any:
    cp = empty_checkpoint()
    cp["channel_values"] = {"notes": [note]}
    return cp


def _put(saver: KeyshredSaver, thread: str, subject: str, note: str) -> dict[str, Any]:
    """A checkpoint of ``thread`` after the thread's latest, with three pending
    writes of two tasks (task paths "~a" and "~b")."""
    latest = saver.get_tuple(_cfg(thread, subject))
    parent = _cfg(thread, subject) if latest is None else latest.config
    stored = saver.put(parent, _checkpoint(note), {"step": 1}, {})
    cfg = dict(stored)
    cfg["configurable"] = {**stored["configurable"], "subject_id": subject}
    saver.put_writes(cfg, [("ch1", f"{note}-a1"), ("ch2", f"{note}-a2")], "task-a", "~a")
    saver.put_writes(cfg, [("ch1", f"{note}-b1")], "task-b", "~b")
    return cfg


def _thread_ref(saver: KeyshredSaver, thread: str) -> str:
    return str(saver._store.thread_ref(thread))


def _setup(ks: Keyshred) -> tuple[KeyshredSaver, dict[str, dict[str, Any]]]:
    saver = KeyshredSaver(ks)
    cfgs = {
        "t1c1": _put(saver, "t1", "ana", "t1-one"),
        "t1c2": _put(saver, "t1", "ana", "t1-two"),
        "t2c1": _put(saver, "t2", "ana", "t2-one"),
        "u1c1": _put(saver, "u1", "bob", "u1-one"),
    }
    return saver, cfgs


def _row(
    ks: Keyshred, saver: KeyshredSaver, cfg: dict[str, Any], task: str | None = None, idx: int = 0
) -> Any:
    conf = cfg["configurable"]
    ref = _thread_ref(saver, conf["thread_id"])
    if task is None:
        c = checkpoints.c
        where = sa.and_(c.thread_ref == ref, c.checkpoint_id == conf["checkpoint_id"])
        table = checkpoints
    else:
        w = checkpoint_writes.c
        where = sa.and_(
            w.thread_ref == ref,
            w.checkpoint_id == conf["checkpoint_id"],
            w.task_id == task,
            w.idx == idx,
        )
        table = checkpoint_writes
    return table, where


def _swap_data(ks: Keyshred, a: tuple[Any, Any], b: tuple[Any, Any]) -> None:
    with ks.catalog.engine.begin() as conn:
        da = conn.execute(sa.select(a[0].c.data).where(a[1])).scalar_one()
        dbb = conn.execute(sa.select(b[0].c.data).where(b[1])).scalar_one()
        conn.execute(a[0].update().where(a[1]).values(data=dbb))
        conn.execute(b[0].update().where(b[1]).values(data=da))


def _set(ks: Keyshred, target: tuple[Any, Any], **values: Any) -> None:
    with ks.catalog.engine.begin() as conn:
        assert conn.execute(target[0].update().where(target[1]).values(**values)).rowcount == 1


def _data(ks: Keyshred, target: tuple[Any, Any]) -> bytes:
    with ks.catalog.engine.connect() as conn:
        return bytes(conn.execute(sa.select(target[0].c.data).where(target[1])).scalar_one())


def _all_reads_refuse(saver: KeyshredSaver, cfg: dict[str, Any]) -> None:
    """``get_tuple`` of the tampered checkpoint, ``list`` of its thread and
    ``list(None)`` all raise ``IntegrityError``."""
    conf = cfg["configurable"]
    with pytest.raises(IntegrityError):
        saver.get_tuple(cfg)
    with pytest.raises(IntegrityError):
        list(saver.list(_cfg(conf["thread_id"], conf["subject_id"])))
    with pytest.raises(IntegrityError):
        list(saver.list(None))


TAMPERINGS = [
    "writes_one_checkpoint",
    "writes_two_checkpoints",
    "writes_two_threads",
    "writes_two_subjects",
    "checkpoints_two_threads",
    "checkpoints_two_subjects",
    "checkpoints_one_thread",
    "write_task_id",
    "write_idx",
    "write_truncated",
    "write_short",
    "checkpoint_truncated",
    "write_forged_key_id",
    "write_key_id_of_other_subject",
    "write_checkpoint_id",
]


@pytest.mark.parametrize("how", TAMPERINGS)
def test_tampered_checkpoint_rows_raise_integrity_error(ks: Keyshred, how: str) -> None:
    saver, cfgs = _setup(ks)
    t1c2, t1c1, t2, u1 = cfgs["t1c2"], cfgs["t1c1"], cfgs["t2c1"], cfgs["u1c1"]
    target = t1c2
    if how == "writes_one_checkpoint":
        _swap_data(ks, _row(ks, saver, t1c2, "task-a", 0), _row(ks, saver, t1c2, "task-a", 1))
    elif how == "writes_two_checkpoints":
        _swap_data(ks, _row(ks, saver, t1c2, "task-a", 0), _row(ks, saver, t1c1, "task-a", 0))
    elif how == "writes_two_threads":
        _swap_data(ks, _row(ks, saver, t1c2, "task-b", 0), _row(ks, saver, t2, "task-b", 0))
    elif how == "writes_two_subjects":
        _swap_data(ks, _row(ks, saver, t1c2, "task-a", 1), _row(ks, saver, u1, "task-a", 1))
    elif how == "checkpoints_two_threads":
        _swap_data(ks, _row(ks, saver, t1c2), _row(ks, saver, t2))
    elif how == "checkpoints_two_subjects":
        _swap_data(ks, _row(ks, saver, t1c2), _row(ks, saver, u1))
    elif how == "checkpoints_one_thread":
        _swap_data(ks, _row(ks, saver, t1c2), _row(ks, saver, t1c1))
    elif how == "write_task_id":
        _set(ks, _row(ks, saver, t1c2, "task-b", 0), task_id="task-c")
    elif how == "write_idx":
        _set(ks, _row(ks, saver, t1c2, "task-b", 0), idx=7)
    elif how == "write_truncated":
        target_row = _row(ks, saver, t1c2, "task-a", 0)
        _set(ks, target_row, data=_data(ks, target_row)[:-1])
    elif how == "write_short":
        target_row = _row(ks, saver, t1c2, "task-a", 0)
        _set(ks, target_row, data=_data(ks, target_row)[:12])
    elif how == "checkpoint_truncated":
        target_row = _row(ks, saver, t1c2)
        _set(ks, target_row, data=_data(ks, target_row)[:-3])
    elif how == "write_forged_key_id":
        target_row = _row(ks, saver, t1c2, "task-b", 0)
        raw = _data(ks, target_row)
        _set(ks, target_row, data=raw[:4] + os.urandom(16) + raw[20:])
    elif how == "write_key_id_of_other_subject":
        # The header names bob's key (a key that exists, of another subject).
        target_row = _row(ks, saver, t1c2, "task-b", 0)
        raw, other = _data(ks, target_row), _data(ks, _row(ks, saver, u1, "task-b", 0))
        _set(ks, target_row, data=raw[:4] + other[4:20] + raw[20:])
    elif how == "write_checkpoint_id":
        # A write of the older checkpoint moved to the newer one (a free task id).
        _set(
            ks,
            _row(ks, saver, t1c1, "task-a", 1),
            checkpoint_id=t1c2["configurable"]["checkpoint_id"],
            task_id="task-z",
        )
    else:  # pragma: no cover
        raise AssertionError(how)
    _all_reads_refuse(saver, target)


def _values(saver: KeyshredSaver, cfg: dict[str, Any]) -> list[tuple[str, str, Any]]:
    tup = saver.get_tuple(cfg)
    assert tup is not None
    return [(task, channel, value) for task, channel, value in tup.pending_writes or []]


def test_swapped_channels_of_two_writes_are_detected(ks: Keyshred) -> None:
    """The channel a pending write goes to is not in the ciphertext's associated
    data (the record id is thread/ns/checkpoint/task_id/idx): swapping the
    ``channel`` column of two writes of one task makes ``get_tuple`` hand each value
    to the other channel, undetected."""
    saver, cfgs = _setup(ks)
    cfg = cfgs["t1c2"]
    before = _values(saver, cfg)
    assert ("task-a", "ch1", "t1-two-a1") in before
    with ks.catalog.engine.begin() as conn:
        a = _row(ks, saver, cfg, "task-a", 0)
        b = _row(ks, saver, cfg, "task-a", 1)
        conn.execute(a[0].update().where(a[1]).values(channel="ch2"))
        conn.execute(b[0].update().where(b[1]).values(channel="ch1"))
    with pytest.raises(IntegrityError):
        after = _values(saver, cfg)
        # Reached on HEAD: the values now sit on each other's channels.
        assert ("task-a", "ch2", "t1-two-a1") in after


def test_edited_task_paths_reordering_writes_are_detected(ks: Keyshred) -> None:
    """``task_path`` is not in the associated data either, and it is the first
    key of the order of pending writes (``_write_order``): swapping the task paths
    of two tasks reorders the writes LangGraph applies, undetected."""
    saver, cfgs = _setup(ks)
    cfg = cfgs["t1c2"]
    assert [t for t, _, _ in _values(saver, cfg)] == ["task-a", "task-a", "task-b"]
    with ks.catalog.engine.begin() as conn:
        w = checkpoint_writes.c
        ref = _thread_ref(saver, "t1")
        cid = cfg["configurable"]["checkpoint_id"]
        mine = sa.and_(w.thread_ref == ref, w.checkpoint_id == cid)
        conn.execute(
            checkpoint_writes.update()
            .where(mine)
            .values(task_path=sa.case((w.task_id == "task-a", "~b"), else_="~a"))
        )
    with pytest.raises(IntegrityError):
        order = [t for t, _, _ in _values(saver, cfg)]
        assert order == ["task-b", "task-a", "task-a"]  # reached on HEAD


@pytest.mark.parametrize("column", ["task_id", "task_path", "channel"])
def test_a_text_column_stored_as_a_blob_raises_integrity_error(tmp_path: Path, column: str) -> None:
    """SQLite stores what it is given: a write's ``task_id`` (or ``task_path``,
    ``channel``) rewritten as a BLOB of the same bytes. The read must raise
    ``IntegrityError`` (the tamper alarm), not ``TypeError`` from sorting a
    ``bytes`` against a ``str`` in ``_write_order`` (b3a9a90 sorted in SQL and
    raised ``IntegrityError`` for the task id, whose text is in the AAD), and not
    hand back ``"b'~a'"`` as a task path or a channel."""
    ks = Keyshred.init(tmp_path / "data", make_config(None))
    try:
        saver, cfgs = _setup(ks)
        cfg = cfgs["t1c2"]
        ref = _thread_ref(saver, "t1")
        cid = cfg["configurable"]["checkpoint_id"]
        with ks.catalog.engine.begin() as conn:
            conn.exec_driver_sql(
                f"UPDATE ks_checkpoint_writes SET {column} = CAST({column} AS BLOB) "
                "WHERE thread_ref = ? AND checkpoint_id = ? AND task_id = 'task-a' AND idx = 0",
                (ref, cid),
            )
        try:
            tup = saver.get_tuple(cfg)
        except KeyshredError:
            return
        except TypeError as exc:
            pytest.fail(f"a tampered column raised {exc!r}, not IntegrityError")
        pytest.fail(f"a tampered {column} was read: {tup.pending_writes if tup else None}")
    finally:
        ks.close()


# -- shared keys (mentions) -----------------------------------------------------------


def _bob_thread_beside_a_victim(ks: Keyshred, victim: str) -> tuple[KeyshredSaver, dict[str, Any]]:
    """A registered victim with a memory of their own, and bob's thread with one
    checkpoint and one plain pending write; the config to write to it."""
    ks.subjects.register_identifiers(victim, phones=[PHONE])
    ks.memories.put(victim, ("notes",), "own", "the victim's own note")
    saver = KeyshredSaver(ks)
    stored = saver.put(_cfg("bob-1", "bob"), _checkpoint("plain"), {"step": 1}, {})
    cfg = {"configurable": {**stored["configurable"], "subject_id": "bob"}}
    saver.put_writes(cfg, [("notes", "fine")], "task-a", "~a")
    return saver, cfg


def test_a_write_under_a_shared_key_of_a_suppressed_subject_is_refused(ks: Keyshred) -> None:
    """The checkpoint itself is sealed under the thread's key; one pending write
    names the victim (a key shared with them). From the victim's suppression on,
    ``get_tuple`` refuses the checkpoint and listings skip it (``_keys_for`` looks
    at every write's key, not only the checkpoint's)."""
    victim = "victim@example.org"
    saver, cfg = _bob_thread_beside_a_victim(ks, victim)
    saver.put_writes(cfg, [("notes", f"call {PHONE}")], "task-b", "~b")
    kids = {
        _data(ks, _row(ks, saver, cfg))[4:20],
        _data(ks, _row(ks, saver, cfg, "task-a", 0))[4:20],
    }
    assert _data(ks, _row(ks, saver, cfg, "task-b", 0))[4:20] not in kids  # shared key
    assert saver.get_tuple(cfg) is not None
    ks.catalog.suppress(ks.subject_ref(victim))
    with pytest.raises(SubjectSuppressed):
        saver.get_tuple(cfg)
    for listing in (saver.list(_cfg("bob-1", "bob")), saver.list(None)):
        assert all(PHONE not in str(t.pending_writes) for t in listing)


def test_a_thread_listing_keeps_older_checkpoints_after_a_mentioned_subject_is_erased(
    ks: Keyshred,
) -> None:
    """Bob's thread: two checkpoints about bob only, then one naming the victim
    (sealed under a key shared with them). After the victim's erasure the thread's
    listing and ``list(None)`` agree: bob's two older checkpoints, nothing of the
    one about the victim (the thread listing's ``except SubjectErased: return``
    does not cut bob's own history short)."""
    victim = "victim@example.org"
    ks.subjects.register_identifiers(victim, phones=[PHONE])
    ks.memories.put(victim, ("notes",), "own", "the victim's own note")
    saver = KeyshredSaver(ks)
    cfg = _cfg("bob-1", "bob")
    for note in ("one", "two", f"call {PHONE}"):
        cfg = saver.put(cfg, _checkpoint(note), {"step": 1}, {})
        cfg = {"configurable": {**cfg["configurable"], "subject_id": "bob"}}
    req = ks.erase(victim, requested_by="dpo", reason="gdpr-art17")
    assert req.state == "completed", req.error
    everywhere = [t.checkpoint["channel_values"]["notes"] for t in saver.list(None)]
    assert everywhere == [["two"], ["one"]]
    in_thread = [t.checkpoint["channel_values"]["notes"] for t in saver.list(_cfg("bob-1", "bob"))]
    assert in_thread == everywhere


# -- writes racing suppression (check=False) ---------------------------------------------


def _dek_count(ks: Keyshred) -> int:
    store = ks.keyring.store
    t = key_schema.tables(key_schema.prefix_for(store.dialect)).dek
    with store.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one())


def _counts(ks: Keyshred) -> tuple[int, int, int]:
    with ks.catalog.engine.connect() as conn:
        c = conn.execute(sa.select(sa.func.count()).select_from(checkpoints)).scalar_one()
        w = conn.execute(sa.select(sa.func.count()).select_from(checkpoint_writes)).scalar_one()
    return int(c), int(w), _dek_count(ks)


@pytest.mark.parametrize("mention", [False, True])
def test_a_write_to_a_known_thread_after_suppression_stores_nothing(
    catalog_url: str, tmp_path: Path, mention: bool
) -> None:
    """The thread is known to this process (its guard cached as active); another
    handle suppresses bob. ``put`` and ``put_writes`` raise ``SubjectSuppressed``,
    store no row and make no key (with a mention of another registered subject:
    no key shared with them for the suppressed holder)."""
    ks = Keyshred.init(tmp_path / "data", make_config(catalog_url))
    try:
        victim = "victim@example.org"
        saver, cfg = _bob_thread_beside_a_victim(ks, victim)
        before = _counts(ks)
        if catalog_url.startswith("sqlite"):
            other = Keyshred.open(tmp_path / "data", make_config(catalog_url))
            try:
                other.catalog.suppress(other.subject_ref("bob"))
            finally:
                other.close()
        else:
            ks.catalog.suppress(ks.subject_ref("bob"))
        note = f"call {PHONE}" if mention else "plain again"
        with pytest.raises(SubjectSuppressed):
            saver.put(cfg, _checkpoint(note), {"step": 2}, {})
        with pytest.raises(SubjectSuppressed):
            saver.put_writes(cfg, [("notes", note)], "task-b", "~b")
        # Without the subject named in the config (the thread's subject is used).
        bare = {"configurable": {k: v for k, v in cfg["configurable"].items() if k != "subject_id"}}
        with pytest.raises(SubjectSuppressed):
            saver.put_writes(bare, [("notes", note)], "task-c", "~c")
        assert _counts(ks) == before
    finally:
        ks.close()


def test_a_write_after_delete_thread_in_another_handle_is_not_orphaned(tmp_path: Path) -> None:
    """Another handle on the folder deletes the thread (its key destroyed, its rows
    and its ``ks_threads`` row deleted). This handle still has the thread and its
    key cached: its next ``put`` neither fails (``_key``'s "never brings the thread
    back") nor makes the thread afresh. It stores a checkpoint row under the
    destroyed key for a thread that no longer exists: readable in this process
    only, invisible to every other (no thread row, key gone), and left behind by a
    later ``delete_thread`` there (``drop_thread`` finds no thread)."""
    ks = Keyshred.init(tmp_path / "data", make_config(None))
    try:
        saver = KeyshredSaver(ks)
        stored = saver.put(_cfg("bob-1", "bob"), _checkpoint("plain"), {"step": 1}, {})
        cfg = {"configurable": {**stored["configurable"], "subject_id": "bob"}}
        other = Keyshred.open(tmp_path / "data", make_config(None))
        try:
            KeyshredSaver(other).delete_thread("bob-1")
            try:
                saver.put(cfg, _checkpoint("again"), {"step": 2}, {})
            except NotFound:
                assert _counts(ks)[:2] == (0, 0)
                return
            # Accepted: then as a thread made afresh, which every handle reads.
            got = KeyshredSaver(other).get_tuple(_cfg("bob-1", "bob"))
            assert got is not None, f"an orphan row was stored: {_counts(ks)}"
            assert got.checkpoint["channel_values"]["notes"] == ["again"]
        finally:
            other.close()
    finally:
        ks.close()


def test_copy_thread_to_a_suppressed_subject_thread_stores_nothing(ks: Keyshred) -> None:
    """``copy_thread`` of a thread whose subject was suppressed after this process
    cached it: nothing is copied."""
    saver = KeyshredSaver(ks)
    _put(saver, "bob-1", "bob", "one")
    ks.catalog.suppress(ks.subject_ref("bob"))
    before = _counts(ks)
    with pytest.raises(SubjectSuppressed):
        saver.copy_thread("bob-1", "bob-2")
    assert _counts(ks) == before


# -- SIGKILL inside a write, parked connections elsewhere ---------------------------------

_WORKER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {root!r})
    from pathlib import Path
    from langgraph.checkpoint.base import empty_checkpoint
    from keyshred import Keyshred
    from keyshred.integrations.langgraph import KeyshredSaver
    from tests.storage.conftest import make_config

    ks = Keyshred.open(Path(sys.argv[1]), make_config(None))
    saver = KeyshredSaver(ks)
    name = sys.argv[2]
    cfg = {{"configurable": {{"thread_id": name, "checkpoint_ns": "", "subject_id": name}}}}
    i = 0
    while True:
        cp = empty_checkpoint()
        cp["channel_values"] = {{"notes": [f"{{name}}-{{i}}"]}}
        cfg = saver.put(cfg, cp, {{"step": i}}, {{}})
        cfg = {{"configurable": {{**cfg["configurable"], "subject_id": name}}}}
        saver.put_writes(cfg, [("notes", f"{{name}}-w{{i}}"), ("x", i)], f"t{{i}}", "~p")
        sys.stdout.write(f"ACK {{i}}\\n")
        sys.stdout.flush()
        i += 1
    """
)


def test_sigkill_inside_checkpoint_writes_with_parked_connections_elsewhere(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    ks = Keyshred.init(data, make_config(None))
    try:
        saver = KeyshredSaver(ks)
        mine = _put(saver, "mine", "ana", "mine-0")
        assert db.parked_connections(ks.catalog.engine) >= 1
        script = tmp_path / "worker.py"
        script.write_text(_WORKER.format(root=str(ROOT)))
        acked: dict[str, int] = {}
        for name in ("w1", "w2"):
            proc = zygote.Popen(
                [sys.executable, str(script), str(data), name],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                assert proc.stdout is not None
                last = -1
                deadline = time.monotonic() + 20
                while last < 15 and time.monotonic() < deadline:
                    line = proc.stdout.readline()
                    if not line:
                        break
                    last = int(line.split()[1])
                    # Reads here meanwhile, on parked connections.
                    assert saver.get_tuple(mine) is not None
                assert last >= 15, proc.stderr.read() if proc.stderr else ""
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
                acked[name] = last
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        # The survivor reads every acknowledged write and writes on.
        for name, last in acked.items():
            listed = list(saver.list(_cfg(name, name)))
            notes = {t.checkpoint["channel_values"]["notes"][0] for t in listed}
            assert {f"{name}-{i}" for i in range(last + 1)} <= notes
        _put(saver, "mine", "ana", "mine-1")
        assert saver.get_tuple(_cfg("mine", "ana")) is not None
        fresh = Keyshred.open(data, make_config(None))
        try:
            other = KeyshredSaver(fresh)
            for name, last in acked.items():
                assert len(list(other.list(_cfg(name, name)))) >= last + 1
            _put(other, "w1", "w1", "after")
            _put(other, f"new-{uuid.uuid4().hex[:6]}", "carl", "fresh")
        finally:
            fresh.close()
        _put(saver, "mine", "ana", "mine-2")
        # A scrub (WAL checkpoint) is not held up by a reader stuck in a snapshot.
        with ks.catalog.engine.connect() as conn:
            busy, _, _ = conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)").one()
        assert busy == 0
    finally:
        ks.close()
