"""Vectors are rows of the catalog (``ks_mem_vectors``): a put creates no file and
no LanceDB dataset, a subject costs no file of its own for its vectors, an erasure
leaves no row and none of its ciphertext in the catalog's files, and a process
killed inside a put's vector write leaves every acknowledged vector readable."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from keyshred import Keyshred
from keyshred.storage.memory_types import PutItem
from tests import zygote
from tests.storage import vector_kill_worker as worker
from tests.storage.conftest import make_config, parquet_config
from tests.storage.test_vectors import bag_of_words, vector_rows

NS = ("m",)
WORKER = Path(worker.__file__)


def files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


def test_a_put_writes_no_file_under_vectors_and_no_dataset(
    catalog_url: str, tmp_path: Path
) -> None:
    with Keyshred.init(tmp_path / "data", make_config(catalog_url), embeddings=bag_of_words) as ks:
        before = set(files(ks.path))
        for s in range(5):
            ks.memories.put(f"s{s}", NS, "k", {"text": f"subject {s} gardens"}, index=True)
        ref = ks.subject_ref("s0")
        assert len(vector_rows(ks, ref)) == 1
        assert ks.vectors.count(ref) == 1
        assert not (ks.path / "vectors").exists()
        new = set(files(ks.path)) - before
        assert not [p for p in new if ".lance" in str(p) or "vectors" in p.parts], new
        # No subject's ref names a file: its memories are hot rows of the catalog too.
        assert not [p for p in new if ref in str(p)], new


@pytest.mark.parametrize(("layout", "per_subject"), [("inline", 0), ("parquet", 1)])
def test_files_on_disk_do_not_grow_with_subjects(
    tmp_path: Path, layout: str, per_subject: int
) -> None:
    """After a load (20 indexed memories per subject, compacted), a subject costs
    nothing for its vectors, and no file at all once compacted into the catalog
    (the default at this size) or one Parquet segment (``inline_max_rows = 0``):
    10 and 40 subjects differ by 0 or 30 files."""
    counts = {}
    config = make_config if layout == "inline" else parquet_config
    for n in (10, 40):
        folder = tmp_path / f"data{n}"
        with Keyshred.init(folder, config(None), embeddings=bag_of_words) as ks:
            for s in range(n):
                items = [
                    PutItem(NS, f"k{i}", {"text": f"subject {s} memory {i}"}, index=True)
                    for i in range(20)
                ]
                ks.memories.put_many(f"s{s}", items)
            ks.memories.flush()
        counts[n] = len([p for p in files(folder) if not p.name.endswith(("-wal", "-shm"))])
        assert not (folder / "vectors").exists()
    assert counts[40] - counts[10] == 30 * per_subject, counts


def test_erasure_leaves_no_vector_row_and_no_ciphertext_in_the_catalog_file(
    tmp_path: Path,
) -> None:
    probe = "probe-7fa3c9 zebra violin"
    with Keyshred.init(tmp_path / "data", make_config(None), embeddings=bag_of_words) as ks:
        for i in range(5):
            ks.memories.put("victim", NS, f"k{i}", {"text": f"{probe} {i}"}, index=True)
            ks.memories.put("other", NS, f"k{i}", {"text": f"other memory {i}"}, index=True)
        ref = ks.subject_ref("victim")
        rows = vector_rows(ks, ref)
        assert len(rows) == 5
        sealed = [bytes(r["vec"]) for r in rows]
        floats = [
            # Each whole vector (a window of it would be zeros: a bag of words is
            # sparse).
            np.asarray(v, dtype=np.float32).tobytes()
            for v in bag_of_words([f"{probe} {i}" for i in range(5)])
        ]
        ks.vectors.search(ref, np.asarray(bag_of_words([probe])[0], np.float32), 3)
        req = ks.erase("victim", requested_by="dpo", reason="test", probes=[probe])
        assert req.state == "completed", req.error
        assert vector_rows(ks, ref) == [] and not ks.vectors.exists(ref)
        assert ks.vectors.held(ref) == 0
        assert len(vector_rows(ks, ks.subject_ref("other"))) == 5
        catalog_files = files(ks.path / "catalog")
        assert catalog_files
        for path in catalog_files:
            blob = path.read_bytes()
            for needle in [*sealed, *(c[20:52] for c in sealed), *floats, probe.encode()]:
                assert needle not in blob, path.name
        checks = {c.name: c for c in ks.vectors.verify(_target(ref))}
        assert checks["vector rows removed"].passed


def _target(ref: str) -> Any:
    from keyshred.storage.erasable import ErasureTarget

    return ErasureTarget(ref)


@pytest.mark.parametrize("point", ["put.after_vectors", "put.after_log"])
def test_a_kill_inside_the_vector_write_keeps_every_acknowledged_vector(
    catalog_url: str, tmp_path: Path, point: str
) -> None:
    data = tmp_path / "data"
    url = "-" if catalog_url.startswith("sqlite") else catalog_url
    Keyshred.init(data, make_config(None if url == "-" else url), embeddings=bag_of_words).close()
    proc = zygote.run(
        [sys.executable, str(WORKER), str(data), url, point],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr[-2000:]
    acked = [tuple(line.split()[1:]) for line in proc.stdout.splitlines() if line.startswith("ACK")]
    assert len(acked) == 6
    with Keyshred.open(
        data, make_config(None if url == "-" else url), embeddings=bag_of_words
    ) as ks:
        for subject, key in acked:
            i = int(key[1:])
            hits = ks.memories.search(subject, NS, query=worker.value(subject, i)["text"], limit=1)
            assert [h.key for h in hits] == [key], (subject, key)
            assert ks.vectors.count(ks.subject_ref(subject)) == 3
        # The killed put committed nothing: no memory, no vector row.
        killed = ks.subject_ref(worker.KILLED)
        assert ks.memories.get(worker.KILLED, NS, "k0") is None
        assert vector_rows(ks, killed) == []
        assert all(r.clean for r in ks.memories.repair_all())
