"""Byte scans for planted probes, and tampering with every kind of file."""

from __future__ import annotations

import random
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from keyshred import Keyshred
from keyshred.errors import IntegrityError
from keyshred.storage import faults
from keyshred.storage.schema import memory_hot
from tests.storage.conftest import make_config, parquet_config


def all_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("layout", ["catalog", "segments"])
def test_no_probe_in_any_file_ever(tmp_path: Path, catalog_url: str, layout: str) -> None:
    """Subject ids, namespaces, keys and values of several subjects: none of them in
    any file under the data folder (catalog and key store included), neither while
    they sit in the catalog's hot rows nor after they were compacted (into the
    catalog, as partitions this small are by default, or into Parquet)."""
    tag = uuid.uuid4().hex[:10]
    probes: list[str] = []
    config = make_config if layout == "catalog" else parquet_config
    cfg = config(catalog_url if "postgres" in catalog_url else None, flush_records=25)
    data = tmp_path / "data"
    with Keyshred.init(data, cfg) as ks:
        ks.consent.grant(f"subj-{tag}-0@example.org", scope="support/health", category="health")
        for s in range(4):
            subject = f"subj-{tag}-{s}@example.org"
            probes.append(subject)
            for i in range(30):
                ns = ("memories", f"ns-{tag}-{s}-{i % 3}")
                key = f"key-{tag}-{s}-{i}"
                value = {"text": f"value-{tag}-{s}-{i} has a peanut allergy", "i": i}
                probes += [ns[1], key, value["text"]]
                scope = "support/health" if s == 0 and i % 2 else "default"
                cat = "health" if scope != "default" else None
                ks.memories.put(subject, ns, key, value, scope=scope, category=cat)
            ks.memories.put(
                subject, ("memories",), f"mention-{tag}-{s}", 1, mentions=[f"other-{tag}"]
            )
            probes += [f"mention-{tag}-{s}", f"other-{tag}"]
            for check_point in ("log", "segments"):
                files = all_files(data)
                assert layout == "catalog" or any("memories" in f for f in files)
                for name, blob in files.items():
                    for probe in probes:
                        assert probe.encode() not in blob, (check_point, name, probe)
                ks.memories.flush()


def _reopen_all(data: Path, cfg: object) -> dict[str, object]:
    """Open, read everything of alice, close without rewriting any file."""
    ks = Keyshred.open(data, cfg)  # type: ignore[arg-type]
    try:
        return {m.key: m.value for m in ks.memories.search("alice", (), limit=1000)}
    finally:
        ks.close(flush=False)


@pytest.fixture
def populated(tmp_path: Path) -> tuple[Path, object, dict[str, object]]:
    # A segment and five hot rows after it (``parquet_config``: these 20 rows would
    # otherwise compact into the catalog).
    cfg = parquet_config(None, flush_records=10_000)
    data = tmp_path / "data"
    ks = Keyshred.init(data, cfg)  # type: ignore[arg-type]
    for i in range(20):
        ks.memories.put("alice", ("m",), f"k{i}", {"i": i, "pad": "p" * 50})
    ks.memories.flush()
    for i in range(20, 25):  # these stay hot rows in the catalog: no flush
        ks.memories.put("alice", ("m",), f"k{i}", {"i": i})
    ks.close(flush=False)
    truth = {f"k{i}": {"i": i, "pad": "p" * 50} if i < 20 else {"i": i} for i in range(25)}
    return data, cfg, truth


def _partition(data: Path) -> Path:
    (part,) = (data / "memories").iterdir()
    return part


def test_tampered_parquet_raises_never_garbage(
    populated: tuple[Path, object, dict[str, object]], tmp_path: Path
) -> None:
    data, cfg, truth = populated
    (seg,) = _partition(data).glob("seg-*.parquet")
    original = seg.read_bytes()
    rng = random.Random(7)
    positions = sorted(
        {0, 3, len(original) - 1, len(original) - 6}
        | {rng.randrange(len(original)) for _ in range(150)}
    )
    raised = 0
    for pos in positions:
        broken = bytearray(original)
        broken[pos] ^= 0x5A
        seg.write_bytes(bytes(broken))
        try:
            got = _reopen_all(data, cfg)
        except IntegrityError:
            raised += 1
            continue
        assert got == truth, f"flip at byte {pos} returned different data"
    seg.write_bytes(original)
    assert _reopen_all(data, cfg) == truth
    # Some bytes are never read (the leading magic, padding): a flip there changes
    # nothing and the data comes back identical, which the loop asserted. Most
    # flips must raise.
    assert raised >= len(positions) * 0.7


def _catalog(data: Path) -> sa.Engine:
    return sa.create_engine(f"sqlite:///{data / 'catalog' / 'catalog.db'}")


def _hot_rows(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(memory_hot).order_by(memory_hot.c.seq)))


def _set_record(engine: sa.Engine, seq: int, record: bytes) -> None:
    with engine.begin() as conn:
        conn.execute(memory_hot.update().where(memory_hot.c.seq == seq).values(record=record))


def test_tampered_hot_row_raises(populated: tuple[Path, object, dict[str, object]]) -> None:
    """The writes not yet compacted are sealed rows in the catalog: a flipped byte
    anywhere in one raises, never returns garbage."""
    data, cfg, truth = populated
    engine = _catalog(data)
    try:
        rows = _hot_rows(engine)
        assert len(rows) == 5  # the five puts after the flush
        target = rows[2]
        original = bytes(target.record)
        for pos in range(0, len(original), max(1, len(original) // 40)):
            broken = bytearray(original)
            broken[pos] ^= 0x01
            _set_record(engine, target.seq, bytes(broken))
            with pytest.raises(IntegrityError):
                _reopen_all(data, cfg)
        _set_record(engine, target.seq, original)
    finally:
        engine.dispose()
    assert _reopen_all(data, cfg) == truth


def test_truncated_or_swapped_files_are_detected(
    populated: tuple[Path, object, dict[str, object]], tmp_path: Path
) -> None:
    data, cfg, truth = populated
    part = _partition(data)
    engine = _catalog(data)
    try:
        rows = _hot_rows(engine)
        # Acknowledged writes cut away (the last hot row, or one in the middle).
        for victim in (rows[-1], rows[1]):
            with engine.begin() as conn:
                conn.execute(memory_hot.delete().where(memory_hot.c.seq == victim.seq))
            with pytest.raises(IntegrityError):
                _reopen_all(data, cfg)
            with engine.begin() as conn:
                conn.execute(memory_hot.insert().values(**victim._mapping))
        # Two sealed records swapped: each is bound to its sequence number.
        first, second = rows[0], rows[1]
        _set_record(engine, first.seq, bytes(second.record))
        _set_record(engine, second.seq, bytes(first.record))
        with pytest.raises(IntegrityError):
            _reopen_all(data, cfg)
        _set_record(engine, first.seq, bytes(first.record))
        _set_record(engine, second.seq, bytes(second.record))
    finally:
        engine.dispose()
    assert _reopen_all(data, cfg) == truth
    # Another subject's segment dropped into this partition.
    ks = Keyshred.open(data, cfg)  # type: ignore[arg-type]
    ks.memories.put("bob", ("m",), "b", 1)
    ks.memories.flush("bob")
    bob_seg = next(ks.memories.partition_path(ks.subject_ref("bob")).glob("seg-*.parquet"))
    ks.close(flush=False)
    (alice_seg,) = part.glob("seg-*.parquet")
    saved = alice_seg.read_bytes()
    shutil.copy(bob_seg, alice_seg)
    with pytest.raises(IntegrityError):
        _reopen_all(data, cfg)
    alice_seg.write_bytes(saved)
    assert _reopen_all(data, cfg) == truth


def test_a_write_that_fails_before_its_commit_leaves_nothing(
    populated: tuple[Path, object, dict[str, object]],
) -> None:
    """A put whose transaction never commits (it fails after its rows were staged
    and its vectors written) was never acknowledged: nothing of it is read, in
    this process or the next, and the next write goes on from there."""
    data, cfg, truth = populated

    def fail(point: str) -> None:
        if point == "put.after_log":
            raise RuntimeError("stop")

    ks = Keyshred.open(data, cfg)  # type: ignore[arg-type]
    try:
        faults.hook = fail
        with pytest.raises(RuntimeError):
            ks.memories.put("alice", ("m",), "lost", 1)
        faults.hook = None
        assert ks.memories.get("alice", ("m",), "lost") is None
        ks.memories.put("alice", ("m",), "after", 1)
    finally:
        faults.hook = None
        ks.close(flush=False)
    assert _reopen_all(data, cfg) == {**truth, "after": 1}
