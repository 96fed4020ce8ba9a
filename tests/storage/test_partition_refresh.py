"""A loaded partition catches up with what another process committed to the same
embedded folder: on SQLite it skips the head statement while nobody committed
anything (``HotTier.change_token``: ``PRAGMA data_version``), and sees the other
process's puts, deletes and compactions as soon as they commit."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from keyshred import Keyshred
from keyshred.storage.hot import HotTier
from tests import zygote
from tests.storage.conftest import make_config

NS = ("notes",)
ROOT = Path(__file__).resolve().parents[2]


def _other_process(data: Path, code: str) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from keyshred import Keyshred
        from tests.storage.conftest import make_config
        with Keyshred.open({str(data)!r}, make_config(None, flush_records=3)) as ks:
        """
    ) + textwrap.indent(textwrap.dedent(code), "    ")
    zygote.run([sys.executable, "-c", script], check=True, timeout=120)


def test_reads_see_another_processes_commits_and_ask_nothing_while_none_happen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    with Keyshred.init(data, make_config(None, flush_records=3)) as ks:
        ks.memories.put("alice", NS, "k0", {"v": 0})
        assert ks.memories.get("alice", NS, "k0") is not None
        heads = [0]
        real = HotTier.head

        def counted(self: HotTier, ref: str) -> object:
            heads[0] += 1
            return real(self, ref)

        monkeypatch.setattr(HotTier, "head", counted)
        for _ in range(20):
            assert ks.memories.get("alice", NS, "k0") is not None
        assert heads[0] == 0  # nothing committed by anyone: no statement to ask

        _other_process(data, 'ks.memories.put("alice", ("notes",), "k1", {"v": 1})')
        got = ks.memories.get("alice", NS, "k1")
        assert got is not None and got.value == {"v": 1}
        assert heads[0] == 1

        # Puts that compact, and a delete, in the other process.
        _other_process(
            data,
            """
            for i in range(2, 8):
                ks.memories.put("alice", ("notes",), f"k{i}", {"v": i})
            ks.memories.delete("alice", ("notes",), "k0")
            """,
        )
        assert ks.memories.get("alice", NS, "k0") is None
        assert sorted(m.key for m in ks.memories.search("alice", NS, limit=100)) == [
            f"k{i}" for i in range(1, 8)
        ]
        # This process's own writes are seen by its reads, and by the other's.
        ks.memories.put("alice", NS, "mine", {"v": "mine"})
        assert ks.memories.get("alice", NS, "mine") is not None
        _other_process(
            data,
            'assert ks.memories.get("alice", ("notes",), "mine").value == {"v": "mine"}',
        )


def test_a_first_load_reads_while_another_connection_holds_the_write_lock(
    tmp_path: Path,
) -> None:
    """Loading a partition (a get of a subject no open partition holds) only reads:
    it takes no write transaction, so on SQLite it never waits behind a writer (it
    took ``BEGIN IMMEDIATE`` to list the subject's segments, and waited up to the
    30 s busy timeout, then failed, while any other process wrote)."""
    import sqlite3

    data = tmp_path / "data"
    with Keyshred.init(data, make_config(None)) as ks:
        ks.memories.put_many("alice", [_item(i) for i in range(5)])
    catalog = data / "catalog" / "catalog.db"
    assert catalog.exists()
    with Keyshred.open(data, make_config(None)) as ks:  # opening migrates: a write
        writer = sqlite3.connect(catalog, isolation_level=None)
        try:
            writer.execute("BEGIN IMMEDIATE")  # another writer, in the middle of its commit
            got = ks.memories.get("alice", NS, "k3")
            assert got is not None and got.value == {"n": 3}
            assert [m.key for m in ks.memories.search("alice", NS, limit=10)] != []
        finally:
            writer.execute("ROLLBACK")
            writer.close()


def _item(i: int) -> object:
    from keyshred.storage.memory_types import PutItem

    return PutItem(NS, f"k{i}", {"n": i})
