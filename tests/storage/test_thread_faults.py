"""SIGKILL inside ``delete_thread``, at each of its fault points, on SQLite and on the
real PostgreSQL: the thread's data is unreadable from the kill on (its key goes
first), the other threads of its subject and of others read and write on, and
``delete_thread`` run again finishes the job: no row, no asset row, no residue.
And inside a thread's creation: its row and its asset row are one commit."""

from __future__ import annotations

import signal
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from langgraph.checkpoint.base import empty_checkpoint

from keyshred import Keyshred
from keyshred.errors import KeyshredError
from keyshred.integrations.langgraph import KeyshredSaver
from keyshred.residue import residue_scan
from keyshred.storage.faults import POINTS
from keyshred.storage.schema import assets, checkpoint_writes, checkpoints, threads
from tests import zygote
from tests.storage.conftest import make_config

ROOT = Path(__file__).resolve().parents[2]
DELETE_POINTS = [
    p
    for p in POINTS
    if p.startswith("thread.") and p not in ("thread.in_create", "thread.key_made")
]

_WORKER = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {root!r})
    from pathlib import Path
    from langgraph.checkpoint.base import empty_checkpoint
    from keyshred import Keyshred
    from keyshred.integrations.langgraph import KeyshredSaver
    from keyshred.storage import faults
    from tests.storage.conftest import make_config

    data, point, url = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    ks = Keyshred.open(data, make_config(url))

    def kill(reached):
        if reached == point:
            os.kill(os.getpid(), signal.SIGKILL)

    faults.hook = kill
    saver = KeyshredSaver(ks)
    if point == "thread.in_create":
        cfg = {{"configurable": {{"thread_id": "new", "checkpoint_ns": "", "subject_id": "cy"}}}}
        saver.put(cfg, empty_checkpoint(), {{}}, {{}})
    else:
        saver.delete_thread("victim")
    print("finished without crashing")
    """
)

# thread id -> data subject; "kept" is a bystander thread of the victim's own subject.
THREADS = {"victim": "ana@example.org", "kept": "ana@example.org", "other": "bob@example.org"}


def _killed_at(point: str, data: Path, catalog_url: str) -> None:
    """Run the worker on ``data`` and check that it died at ``point``."""
    script = data.parent / "worker.py"
    script.write_text(_WORKER.format(root=str(ROOT)))
    proc = zygote.run(
        [sys.executable, str(script), str(data), point, catalog_url],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr


def _cfg(thread: str) -> dict[str, Any]:
    return {
        "configurable": {"thread_id": thread, "checkpoint_ns": "", "subject_id": THREADS[thread]}
    }


def _write(saver: KeyshredSaver, thread: str, note: str) -> None:
    """A checkpoint after the thread's latest, with two pending writes."""
    latest = saver.get_tuple(_cfg(thread))
    cp = empty_checkpoint()
    cp["channel_values"] = {"notes": [note]}
    stored = saver.put(_cfg(thread) if latest is None else latest.config, cp, {"step": 1}, {})
    cfg = {"configurable": {**stored["configurable"], "subject_id": THREADS[thread]}}
    saver.put_writes(cfg, [("notes", f"{note} pending"), ("x", 1)], "task", "~a")


def _notes(saver: KeyshredSaver, thread: str) -> set[str]:
    return {t.checkpoint["channel_values"]["notes"][0] for t in saver.list(_cfg(thread))}


def _rows_of(ks: Keyshred, ref: str) -> dict[str, int]:
    with ks.catalog.engine.connect() as conn:
        return {
            t.name: int(
                conn.execute(
                    sa.select(sa.func.count())
                    .select_from(t)
                    .where((t.c.asset_id if t is assets else t.c.thread_ref) == ref)
                ).scalar_one()
            )
            for t in (threads, checkpoints, checkpoint_writes, assets)
        }


@pytest.mark.parametrize("point", DELETE_POINTS)
def test_sigkill_inside_delete_thread(catalog_url: str, tmp_path: Path, point: str) -> None:
    data = tmp_path / "data"
    probe = f"victim-note-{uuid.uuid4().hex[:10]}"
    ks = Keyshred.init(data, make_config(catalog_url))
    try:
        saver = KeyshredSaver(ks)
        for i in range(3):
            for thread in THREADS:
                _write(saver, thread, f"{probe} {i}" if thread == "victim" else f"{thread} {i}")
        ref = str(saver._store.thread_ref("victim"))
        assert _rows_of(ks, ref) == {
            "ks_threads": 1,
            "ks_checkpoints": 3,
            "ks_checkpoint_writes": 6,
            "ks_assets": 1,
        }
    finally:
        ks.close()

    _killed_at(point, data, catalog_url)

    ks = Keyshred.open(data, make_config(catalog_url))
    try:
        saver = KeyshredSaver(ks)
        # Killed before its commit: the thread is still there to delete, its rows
        # whole, but nothing of it reads (the key went first). Killed after: all
        # of it is gone, its asset row too (one commit).
        left = 0 if point == "thread.after_commit" else 1
        assert _rows_of(ks, ref) == {
            "ks_threads": left,
            "ks_checkpoints": 3 * left,
            "ks_checkpoint_writes": 6 * left,
            "ks_assets": left,
        }
        for read in (
            lambda: saver.get_tuple(_cfg("victim")),
            lambda: list(saver.list(_cfg("victim"))),
        ):
            try:
                got = read()
            except KeyshredError:
                continue
            assert not got, "a deleted thread's checkpoint was read after the kill"
        report = residue_scan(ks, [probe], [data])
        assert report.clean, report.as_dict()
        # The bystanders, of the same subject and of another, read and write on.
        for thread in ("kept", "other"):
            assert _notes(saver, thread) == {f"{thread} {i}" for i in range(3)}
            _write(saver, thread, f"{thread} after")
            assert f"{thread} after" in _notes(saver, thread)

        # delete_thread again finishes it: every row and the asset row go at once.
        saver.delete_thread("victim")
        assert _rows_of(ks, ref) == {
            "ks_threads": 0,
            "ks_checkpoints": 0,
            "ks_checkpoint_writes": 0,
            "ks_assets": 0,
        }
        assert saver.get_tuple(_cfg("victim")) is None
        assert residue_scan(ks, [probe], [data]).clean
        # The id can start a new thread, under a new key.
        _write(saver, "victim", "a new start")
        assert _notes(saver, "victim") == {"a new start"}
    finally:
        ks.close()

    # A second handle (another process's view) agrees.
    ks = Keyshred.open(data, make_config(catalog_url))
    try:
        saver = KeyshredSaver(ks)
        assert _notes(saver, "victim") == {"a new start"}
        assert _notes(saver, "kept") == {f"kept {i}" for i in range(3)} | {"kept after"}
    finally:
        ks.close()


def test_sigkill_inside_a_threads_creation(catalog_url: str, tmp_path: Path) -> None:
    data = tmp_path / "data"
    Keyshred.init(data, make_config(catalog_url)).close()
    _killed_at("thread.in_create", data, catalog_url)
    ks = Keyshred.open(data, make_config(catalog_url))
    try:
        saver = KeyshredSaver(ks)
        ref = str(saver._store.thread_ref("new"))
        assert set(_rows_of(ks, ref).values()) == {0}
        cfg = {"configurable": {"thread_id": "new", "checkpoint_ns": "", "subject_id": "cy"}}
        cp = empty_checkpoint()
        cp["channel_values"] = {"notes": ["made again"]}
        saver.put(cfg, cp, {}, {})
        assert _rows_of(ks, ref) == {
            "ks_threads": 1,
            "ks_checkpoints": 1,
            "ks_checkpoint_writes": 0,
            "ks_assets": 1,
        }
        got = saver.get_tuple(cfg)
        assert got is not None and got.checkpoint["channel_values"] == {"notes": ["made again"]}
    finally:
        ks.close()


def test_a_thread_made_by_two_handles_at_once(
    catalog_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Handle B looks the thread up before handle A's creation commits, then tries
    to create it too: its insert loses on the primary key, nothing of its attempt
    is stored (one thread row, one asset row), and it writes into A's thread."""
    a = Keyshred.init(tmp_path / "data", make_config(catalog_url))
    b = Keyshred.open(tmp_path / "data", make_config(catalog_url))
    try:
        sa_, sb = KeyshredSaver(a), KeyshredSaver(b)
        real_find = b.checkpoints._find
        calls = {"n": 0}

        def late_find(thread_ref: str) -> Any:
            calls["n"] += 1
            if calls["n"] == 1:  # A creates the thread after B's first look
                _write(sa_, "kept", "made by a")
            if calls["n"] <= 2:  # and B's second look, under its lock, misses it too
                return None
            return real_find(thread_ref)

        monkeypatch.setattr(b.checkpoints, "_find", late_find)
        cfg = {
            "configurable": {
                "thread_id": "kept",
                "checkpoint_ns": "",
                "subject_id": THREADS["kept"],
            }
        }
        ref = str(sa_._store.thread_ref("kept"))
        cp = empty_checkpoint()
        cp["channel_values"] = {"notes": ["made by b"]}
        sb.put(cfg, cp, {"step": 2}, {})
        assert calls["n"] == 3  # the third: after its insert lost
        assert _rows_of(a, ref) == {
            "ks_threads": 1,
            "ks_checkpoints": 2,
            "ks_checkpoint_writes": 2,
            "ks_assets": 1,
        }
        assert _notes(sa_, "kept") == {"made by a", "made by b"}
    finally:
        b.close()
        a.close()
