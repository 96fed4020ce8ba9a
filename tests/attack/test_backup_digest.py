"""Attack: a backup copies segments by the size and SHA-256 the catalog recorded,
without checking that the object it copies has them. A segment changed on the
partition store (bit rot, a tampered bucket/folder) lands in the target under the
content address of the bytes it no longer has; every later generation reuses that
object (``tgt.exists``), and only a restore finds out."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from keyshred import Keyshred
from keyshred.errors import IntegrityError, KeyshredError
from tests.storage.conftest import parquet_config

NS = ("notes",)


@pytest.mark.parametrize("catalog_url", ["sqlite"], indirect=True)
def test_backup_refuses_a_segment_that_does_not_match_its_catalog_digest(
    catalog_url: str, tmp_path: Path
) -> None:
    with Keyshred.init(tmp_path / "data", parquet_config(catalog_url)) as ks:
        for i in range(3):
            ks.memories.put("alice", NS, f"k{i}", {"text": f"note {i}"})
        ks.memories.flush()
        segs = sorted((tmp_path / "data" / "memories").rglob("seg-*.parquet"))
        assert len(segs) == 1
        raw = bytearray(segs[0].read_bytes())
        raw[len(raw) // 2] ^= 0xFF  # one flipped byte on the partition store
        segs[0].write_bytes(bytes(raw))
        try:
            gen = ks.backup.create()
        except (IntegrityError, KeyshredError):
            return  # refused: what we want
        # Accepted: every object the target holds must be what its name says.
        target = ks.backup.target()
        root = Path(target.root)
        bad = []
        for seg in gen_manifest_segments(ks, gen.generation):
            data = (root / seg.object).read_bytes()
            if hashlib.sha256(data).hexdigest() != seg.sha256 or len(data) != seg.size:
                bad.append(seg.path)
        assert not bad, (
            f"backup {gen.generation} holds objects whose bytes are not their hash: {bad}"
        )


def gen_manifest_segments(ks: Keyshred, generation: str):  # type: ignore[no-untyped-def]
    from keyshred.backup.manifest import Manifest

    target = ks.backup.target()
    data = target.get_bytes(f"generations/{generation}/manifest.json")
    return Manifest.parse(data, generation).segments
