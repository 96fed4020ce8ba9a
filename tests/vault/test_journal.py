"""The token journal: group commit that a dying process does not lose, replayed by
the next process; the format refuses corruption; forks issue their own numbers."""

from __future__ import annotations

import os
import sys
import textwrap
import zlib
from datetime import timedelta
from pathlib import Path

import pytest

from keyshred import Config, Keyshred
from keyshred.errors import IntegrityError, UnknownToken
from keyshred.vault.journal import TokenJournal, encode
from tests import zygote
from tests.vault.unheard import suppress_unheard

HOUR = timedelta(hours=1)
ROOT = Path(__file__).resolve().parents[2]
ROW = (
    4097,
    "<PHONE_0123456789>",
    "refalice",
    "default",
    "PHONE",
    "support",
    False,
    None,
    1_764_532_010_123_456,
    1_764_535_610_123_456,
    b"\x01sealed\x00bytes",
)
DET = (4098, "<EMAIL_9876543210>", "refbob", "s/x", "EMAIL", "a:b", True, b"L" * 16, 1, 2, b"v")
DET2 = (4099, "<IBAN_0000000001>", "refbob", "s/x", "IBAN", "a:b", True, b"M" * 16, 1, 2, b"")


def record(epoch: int, rows: list[tuple[object, ...]]) -> bytes:
    """One call's record (its rows share subject, scope, purpose, mode and times)."""
    return encode(epoch, rows)


MAGIC = b"KSTJ2\n"


def _orphan(tmp_path: Path, records: list[bytes]) -> Path:
    """A segment with these records whose process is gone."""
    journal = TokenJournal(tmp_path / "j")
    for r in records:
        journal.append(r)
    (segment,) = journal.detach()
    assert segment.map is not None
    segment.map.close()
    os.close(segment.fd)  # its process is gone: an orphan
    return segment.path


def _used(raw: bytes) -> int:
    return len(raw.rstrip(b"\0"))


def test_records_round_trip_and_an_unfinished_record_ends_the_segment(tmp_path: Path) -> None:
    path = _orphan(tmp_path, [record(3, [ROW]), record(5, [DET, DET2]), record(4, [ROW])])
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    # Allocated up front (a full disk fails the segment's creation, not a copy into it).
    assert path.stat().st_blocks * 512 >= path.stat().st_size == 1 << 20
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
    (orphan,) = TokenJournal(tmp_path / "j").orphans()
    assert orphan.read() == [(3, ROW), (5, DET), (5, DET2), (4, ROW)]
    os.close(orphan.fd)
    # The last record's frame never written (a frame goes in after its record):
    # the segment ends before it.
    raw = bytearray(path.read_bytes())
    last = len(MAGIC) + 8 * 2 + len(record(3, [ROW])) + len(record(5, [DET, DET2]))
    raw[last : last + 8] = bytes(8)
    path.write_bytes(bytes(raw))
    (orphan,) = TokenJournal(tmp_path / "j").orphans()
    assert orphan.read() == [(3, ROW), (5, DET), (5, DET2)]
    os.close(orphan.fd)
    # A frame that does not match its record, with nothing but zeros after it: the
    # record was being written when its process died.
    raw[last : last + 8] = (5).to_bytes(4, "little") + (7).to_bytes(4, "little")
    raw[last + 8 :] = bytes(len(raw) - last - 8)
    path.write_bytes(bytes(raw))
    (orphan,) = TokenJournal(tmp_path / "j").orphans()
    assert orphan.read() == [(3, ROW), (5, DET), (5, DET2)]


@pytest.mark.parametrize("damage", ["flip", "magic", "parse"])
def test_a_damaged_record_raises(tmp_path: Path, damage: str) -> None:
    path = _orphan(tmp_path, [record(3, [ROW]), record(3, [DET])])
    raw = bytearray(path.read_bytes())
    if damage == "flip":  # in the first record, another one after it
        raw[len(MAGIC) + 20] ^= 1
    elif damage == "magic":
        raw[:4] = b"XXXX"
    else:  # a valid checksum over a payload that is not a row
        payload = b"\x00" * 7
        at = _used(bytes(raw))
        raw[at : at + 8] = len(payload).to_bytes(4, "little") + zlib.crc32(payload).to_bytes(
            4, "little"
        )
        raw[at + 8 : at + 15] = payload
    path.write_bytes(bytes(raw))
    (orphan,) = TokenJournal(tmp_path / "j").orphans()
    with pytest.raises(IntegrityError):
        orphan.read()


def test_a_live_segment_is_never_taken(tmp_path: Path) -> None:
    journal = TokenJournal(tmp_path / "j")
    journal.append(record(1, [ROW]))
    assert list(TokenJournal(tmp_path / "j").orphans()) == []
    assert list(journal.orphans()) == []  # its own neither
    journal.retire(journal.detach())
    assert list((tmp_path / "j").iterdir()) == []


def test_a_segment_fills_up_and_a_large_record_gets_its_own(tmp_path: Path) -> None:
    journal = TokenJournal(tmp_path / "j")
    big = (4100, "<CARD_0000000002>", *ROW[2:4], "CARD", *ROW[5:10], b"v" * 400_000)
    for _ in range(3):  # 1.2 MB: the second segment starts on the third record
        journal.append(record(1, [big]))
    huge = (4101, "<CARD_0000000003>", *ROW[2:4], "CARD", *ROW[5:10], b"w" * 3_000_000)
    journal.append(record(2, [huge]))
    segments = journal.detach()
    assert len(segments) == 3
    for segment in segments:
        assert segment.map is not None
        segment.map.close()
        os.close(segment.fd)
    rows = [r for s in TokenJournal(tmp_path / "j").orphans() for r in s.read()]
    assert sorted(rows) == sorted([(1, big)] * 3 + [(2, huge)])


def _group(path: Path, ms: float = 10_000) -> Keyshred:
    config = Config.model_validate({"tokens": {"group_commit_ms": ms}})
    return Keyshred.open(path, config) if path.exists() else Keyshred.init(path, config)


CHILD = textwrap.dedent(
    """
    import json, os, sys
    from datetime import timedelta
    from pathlib import Path
    from keyshred import Config, Keyshred
    ks = Keyshred.open(
        Path(sys.argv[1]), Config.model_validate({"tokens": {"group_commit_ms": 10_000}})
    )
    out = {}
    for who, text in (("alice", "call 13812345678"), ("bob", "mail bob.probe@example.com")):
        out[who] = ks.vault.sanitize(text, who, "support", timedelta(hours=1)).tokens[0]
    print(json.dumps(out), flush=True)
    os._exit(0)  # dies before any flush: the tokens are only in the journal
    """
)


def _crashed_child(data: Path) -> dict[str, str]:
    import json

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = zygote.run(
        [sys.executable, "-c", CHILD, str(data)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    return dict(json.loads(done.stdout))


def test_tokens_of_a_process_that_died_are_recovered(tmp_path: Path) -> None:
    data = tmp_path / "d"
    Keyshred.init(data).close()
    tokens = _crashed_child(data)
    (segment,) = (data / "tokens").glob("*.journal")
    raw = segment.read_bytes()
    for value in (b"13812345678", b"bob.probe@example.com"):
        assert value not in raw  # sealed values only
    with Keyshred.open(data) as ks:  # the next process to open the folder stores them
        assert list((data / "tokens").glob("*.journal")) == []
        assert ks.vault.detokenize(tokens["alice"], "support", "t") == "13812345678"
        assert ks.vault.detokenize(tokens["bob"], "support", "t") == "bob.probe@example.com"
        assert ks.vault.count(ks.subject_ref("alice")) == 1
        assert ks.vault.recover() == 0  # nothing left, nothing stored twice


def test_a_running_process_recovers_on_a_miss_and_erasure_drops_the_rest(tmp_path: Path) -> None:
    data = tmp_path / "d"
    with _group(data) as ks:
        tokens = _crashed_child(data)  # dies while this process runs
        # A token this process cannot find sends it to the journals first.
        assert ks.vault.detokenize(tokens["bob"], "support", "t") == "bob.probe@example.com"
        assert list((data / "tokens").glob("*.journal")) == []
        # Another crash: alice's token waits in a journal when she is erased. The
        # erasure replays it under her suppression: dropped, and the segment gone.
        tokens = _crashed_child(data)
        req = ks.erase("alice", requested_by="dpo", reason="request")
        assert req.state == "completed", req.error
        assert list((data / "tokens").glob("*.journal")) == []
        assert ks.vault.count(ks.subject_ref("alice")) == 0
        with pytest.raises(UnknownToken):
            ks.vault.detokenize(tokens["alice"], "support", "t")
        assert ks.vault.detokenize(tokens["bob"], "support", "t") == "bob.probe@example.com"


def test_a_corrupt_segment_is_set_aside_and_audited(tmp_path: Path) -> None:
    data = tmp_path / "d"
    Keyshred.init(data).close()
    _crashed_child(data)
    (segment,) = (data / "tokens").glob("*.journal")
    raw = bytearray(segment.read_bytes())
    raw[len(MAGIC) + 30] ^= 0xFF  # in the first of two records
    segment.write_bytes(bytes(raw))
    with Keyshred.open(data) as ks:  # opens all the same
        assert [p.suffix for p in (data / "tokens").iterdir()] == [".corrupt"]
        assert [e.event for e in ks.audit.events()].count("vault.journal_corrupt") == 1


def test_a_flush_empties_its_segments_and_close_deletes_them(tmp_path: Path) -> None:
    folder = tmp_path / "d" / "tokens"
    ks = _group(tmp_path / "d")

    def used() -> list[int]:
        return sorted(_used(p.read_bytes()) for p in folder.glob("*.journal"))

    ks.vault.sanitize("call 13812345678", "alice", "support", HOUR)
    (first,) = used()
    assert first > len(MAGIC)
    assert ks.vault.flush() == 1
    assert used() == [len(MAGIC)]  # zeroed, kept for the next appends
    for n in range(3):  # segments alternate: never more than the current and a spare
        ks.vault.sanitize(f"call 1391234567{n}", "alice", "support", HOUR)
        assert len(used()) == 1
        assert ks.vault.flush() == 1
        assert used() == [len(MAGIC)]
    ks.vault.sanitize("call 13912345678", "alice", "support", HOUR)
    ks.close()
    assert list(folder.iterdir()) == []
    with Keyshred.open(tmp_path / "d") as again:
        assert again.vault.count(again.subject_ref("alice")) == 5


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_issues_its_own_numbers_and_not_the_parents_rows(tmp_path: Path) -> None:
    ks = _group(tmp_path / "d")
    try:
        ks.vault.sanitize("bob@example.com", "bob", "support", HOUR)  # bob's key exists
        ks.vault.flush()
        (held,) = ks.vault.sanitize("call 13812345678", "alice", "support", HOUR).tokens
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            try:
                (mine,) = ks.vault.sanitize("call 13912345678", "bob", "support", HOUR).tokens
                stored = ks.vault.flush()  # its own row only, in its own segment
                os.write(write, f"{mine} {stored}".encode())
            finally:
                os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        mine, stored = os.read(read, 200).decode().split()
        os.close(read)
        assert stored == "1" and mine != held
        assert ks.vault.number_of(mine) != ks.vault.number_of(held)
        assert ks.vault.flush() == 1  # the parent's row, stored once
        assert ks.vault.detokenize(mine, "support", "t") == "13912345678"
        assert ks.vault.detokenize(held, "support", "t") == "13812345678"
    finally:
        ks.close()


def test_an_erasure_leaves_none_of_the_subjects_rows_in_the_journal(tmp_path: Path) -> None:
    with _group(tmp_path / "d") as ks:
        ref = ks.subject_ref("alice").encode()
        ks.vault.sanitize("call 13812345678", "alice", "support", HOUR)
        ks.vault.sanitize("call 13912345678", "bob", "support", HOUR)  # held with hers
        assert any(ref in p.read_bytes() for p in (tmp_path / "d" / "tokens").iterdir())
        req = ks.erase("alice", requested_by="dpo", reason="request")
        assert req.state == "completed", req.error
        for path in (tmp_path / "d" / "tokens").iterdir():
            assert ref not in path.read_bytes()
        assert ks.vault.count(ks.subject_ref("bob")) == 1


def test_rows_held_past_a_suppression_are_dropped_and_zeroed(tmp_path: Path) -> None:
    """Tokens issued after the erasure's own flush, before its suppression: the flush
    refuses them and dropping the subject's tokens zeroes their journal records."""
    with _group(tmp_path / "d") as ks:
        ref = ks.subject_ref("alice")
        ks.vault.sanitize("call 13812345678", "alice", "support", HOUR)
        suppress_unheard(ks, ref)
        assert ks.vault.drop_subject(ref) == 1  # held, never stored
        for path in (tmp_path / "d" / "tokens").iterdir():
            assert ref.encode() not in path.read_bytes()
        assert ks.vault.count(ref) == 0


def test_a_segment_it_may_not_open_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user's segment, a read-only folder: recovery leaves it (and a vault
    still opens) instead of failing."""
    import keyshred.vault.journal as journal_module

    path = _orphan(tmp_path, [record(3, [ROW])])
    real_open = os.open

    def refusing(file: object, flags: int, *args: object) -> int:
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied")
        return real_open(file, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(journal_module.os, "open", refusing)
    assert list(TokenJournal(tmp_path / "j").orphans()) == []
    assert path.exists()
