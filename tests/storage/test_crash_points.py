"""SIGKILL inside a delete, an update and a compaction, at every fault point: the
store opens, every acknowledged write stays readable, and ``repair`` reconciles
what the kill left half done. Both layouts of a compaction: into the catalog (the
default for partitions this small) and into Parquet segments
(``storage.inline_max_rows = 0``)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from keyshred import Keyshred
from keyshred.storage.faults import POINTS
from keyshred.storage.memories import text_at
from tests import zygote
from tests.erasure_worker import BYSTANDER, OWNER, TARGET, UPDATED
from tests.storage.conftest import make_config, parquet_config, stored_rows
from tests.storage.test_vectors import bag_of_words

WORKER = Path(__file__).resolve().parents[1] / "erasure_worker.py"
CAROL = "carol@example.org"
OPS = {
    "delete": [p for p in POINTS if p.startswith(("delete.", "flush."))],
    "delete_many": [p for p in POINTS if p.startswith(("delete.", "flush."))],
    "update": [p for p in POINTS if p.startswith(("put.", "flush."))],
    "compact": [p for p in POINTS if p.startswith("flush.")],
}
# The point only the other layout passes is left out of each.
SKIP = {"inline": "flush.after_segment", "parquet": "flush.after_records"}
CASES = [
    (layout, op, point)
    for layout in SKIP
    for op, points in OPS.items()
    for point in points
    if point != SKIP[layout]
]
CONFIGS = {"inline": make_config, "parquet": parquet_config}

Written = dict[tuple[str, tuple[str, ...], str], Any]


def populate(data: Path, layout: str = "inline") -> tuple[Written, str]:
    """Three subjects' memories, some indexed, one corrected (a history row); the
    target mentions carol, so it (and its history version) is sealed under the key
    the owner shares with her. Left in the logs (no flush on close) so that a
    compaction has work to do."""
    written: Written = {}
    ks = Keyshred.init(data, CONFIGS[layout](None), embeddings=bag_of_words)
    for subject in (OWNER, BYSTANDER, CAROL):
        for i in range(4):
            value = {"text": f"{subject} memory {i}"}
            about = [CAROL] if (subject, ("m",), f"k{i}") == (OWNER, *TARGET) else []
            ks.memories.put(subject, ("m",), f"k{i}", value, index=i % 2 == 1, mentions=about)
            written[(subject, ("m",), f"k{i}")] = value
    ks.memories.correct(OWNER, *TARGET, {"text": "corrected"}, reason="typo")
    written[(OWNER, *TARGET)] = {"text": "corrected"}
    target = ks.memories.get(OWNER, *TARGET)
    assert target is not None
    ks.close(flush=False)
    return written, target.memory_id


Template = tuple[Path, Written, str]


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Template]:
    out = {}
    for layout in SKIP:
        data = tmp_path_factory.mktemp(f"crash-points-{layout}") / "data"
        out[layout] = (data, *populate(data, layout))
    return out


@pytest.fixture
def template(templates: dict[str, Template]) -> Template:
    return templates["inline"]


def partition_bytes(ks: Keyshred, subject: str) -> bytes:
    """Every partition object of the subject, then every memory id and value its
    partition stores (segments and hot records, opened: they are sealed)."""
    ref = ks.subject_ref(subject)
    folder = ks.memories.partition_path(ref)
    files = sorted(folder.iterdir()) if folder.exists() else []
    out = [p.read_bytes() for p in files if p.is_file()]
    out += [mid.encode() + value for mid, value in stored_rows(ks, ref)]
    return b"".join(out)


def _run(layout: str, *args: str) -> subprocess.CompletedProcess[str]:
    return zygote.run(
        [sys.executable, str(WORKER), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "KS_TEST_LAYOUT": layout},
    )


@pytest.mark.parametrize(("layout", "op", "point"), CASES)
def test_sigkill_inside_a_write_leaves_a_store_that_opens(
    layout: str, op: str, point: str, templates: dict[str, Template], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    template = templates[layout]
    shutil.copytree(template[0], data)
    written, target_id = dict(template[1]), template[2]
    proc = _run(layout, "store", str(data), op, point)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr[-2000:]
    acked = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("ACK")]
    assert acked == [OWNER, BYSTANDER]
    for subject in acked:
        written[(subject, ("late",), "late")] = {"text": f"late {subject}"}
    target_was = written.pop((OWNER, *TARGET))  # neither its delete nor update was acked
    with Keyshred.open(data, CONFIGS[layout](None), embeddings=bag_of_words) as ks:
        for (subject, ns, key), value in written.items():
            got = ks.memories.get(subject, ns, key)
            assert got is not None and got.value == value, (subject, key)
        target = ks.memories.get(OWNER, *TARGET)
        allowed = {
            "delete": [None, target_was],
            "delete_many": [None, target_was],
            "update": [target_was, UPDATED],
        }
        assert (target.value if target else None) in allowed.get(op, [target_was])
        # Opening finished a deletion whose rows were gone; what is left is at most a
        # deletion the kill stopped before its first log record.
        reports = {r.subject_ref: r for r in ks.memories.repair_all()}
        assert set(reports) == {ks.subject_ref(s) for s in (OWNER, BYSTANDER, CAROL)}
        for r in reports.values():
            assert not (r.lost or r.unfinished_deletes or r.unregistered or r.leftover_files), r
            if r.pending_deletes:
                assert op in ("delete", "delete_many")
                assert (point, r.subject_ref) == ("delete.after_mark", ks.subject_ref(OWNER))
                assert target_id in r.pending_deletes
        assert all(r.ok for r in ks.memories.repair_all(apply=True))
        assert all(r.clean for r in ks.memories.repair_all())
        if op in ("delete", "delete_many"):  # every deletion started is finished now
            assert ks.memories.get(OWNER, *TARGET) is None
            assert ks.memories.history(OWNER, *TARGET) == []
            assert ks.catalog.asset(target_id) is None
            assert ks.catalog.asset(f"{target_id}/0") is None
            ks.memories.flush(OWNER)
            stored = partition_bytes(ks, OWNER)
            assert target_id.encode() not in stored
            if layout == "inline":  # the scan sees the records (Parquet compresses ids)
                kept = ks.memories.get(OWNER, ("m",), "k2")
                assert kept is not None and kept.memory_id.encode() in stored
        for (subject, ns, key), value in written.items():  # repair lost nothing
            got = ks.memories.get(subject, ns, key)
            assert got is not None and got.value == value, (subject, key)
        # The store keeps working for the subject: a write, a delete, a search.
        ks.memories.put(OWNER, ("m",), "after", {"text": "after the crash"}, index=True)
        assert ks.memories.delete(OWNER, ("m",), "k0")
        hits = ks.memories.search(OWNER, ("m",), query="after the crash", limit=1)
        assert hits and hits[0].key == "after"
        # Carol's erasure reaches the owner's row about her, whatever the kill left:
        # gone with its history, the owner's and the bystander's own data intact.
        req = ks.erase(CAROL, requested_by="dpo", reason="r")
        assert req.state == "completed", req.error
        assert ks.memories.get(OWNER, *TARGET) is None
        assert ks.memories.history(OWNER, *TARGET) == []
        for (subject, ns, key), value in written.items():
            if subject != CAROL and key != "k0":
                got = ks.memories.get(subject, ns, key)
                assert got is not None and got.value == value, (subject, key)


@pytest.mark.parametrize("point", [p for p in POINTS if p.startswith("put.")])
def test_sigkill_inside_an_update_never_ranks_the_memory_by_its_old_value(
    point: str, template: Template, tmp_path: Path
) -> None:
    """A kill after an update's log write (before its vector write) leaves the old
    value's vectors; the next search embeds the value the memory holds now, so its
    score is the new value's, whatever the query."""
    data = tmp_path / "data"
    shutil.copytree(template[0], data)
    target_id = template[2]
    proc = zygote.run(
        [sys.executable, str(WORKER), "store", str(data), "update", point],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr[-2000:]
    with Keyshred.open(data, make_config(None), embeddings=bag_of_words) as ks:
        target = ks.memories.get(OWNER, *TARGET)
        assert target is not None
        ref = ks.subject_ref(OWNER)
        fields = ks.vectors.fields_of(ref, target_id)
        assert fields
        embedder = ks.memories.embedder
        now = embedder.embed([text_at(target.value, f) for f in fields])
        for query in ("updated value", "corrected"):
            hits = ks.memories.search(OWNER, ("m",), query=query, limit=10)
            scores = {h.key: h.score for h in hits}
            expected = float(np.max(now @ embedder.embed_query(query)))
            assert scores.get(TARGET[1]) == pytest.approx(expected, abs=1e-5), (query, point)
