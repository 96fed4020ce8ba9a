"""SIGKILL inside a backup (issue 22 follow-up): killed after its first object
reached the target, or with every object there and the manifest (its commit) not
yet, a backup leaves no generation, nothing in its staging folder, and a target the
next backup completes and a restore verifies: objects are written under their
content address atomically, so a killed copy leaves none half written."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from keyshred import Keyshred
from tests import zygote
from tests.backup.test_backup import NS, config, contents, write_subject
from tests.storage.test_vectors import bag_of_words

WORKER = Path(__file__).with_name("backup_worker.py")


@pytest.mark.parametrize("point", ["backup.after_first_object", "backup.before_manifest"])
def test_a_backup_killed_inside_leaves_no_generation_and_the_next_one_restores(
    point: str, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    with Keyshred.init(data, config(segments=True), embeddings=bag_of_words) as ks:
        written = {s: write_subject(ks, s, s) for s in ("ana", "bob", "cai")}
        for s in written:
            ks.memories.flush(s)  # segments to copy, one per subject
    proc = zygote.run(
        [sys.executable, str(WORKER), str(data), point],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr[-2000:]
    with Keyshred.open(data, embeddings=bag_of_words) as ks:
        assert ks.backup.generations() == []  # no manifest: no generation
        gen = ks.backup.create()
        assert [g.generation for g in ks.backup.generations()] == [gen.generation]
        staging = data / ".backup-staging"
        assert not staging.exists() or not [p for p in staging.iterdir() if p.is_dir()]
        into = tmp_path / "restored"
        ks.backup.restore(gen.generation, into)
    with Keyshred.open(into, embeddings=bag_of_words) as restored:
        for subject, values in written.items():
            assert contents(restored, subject) == values, subject
            assert restored.memories.get(subject, NS, "k0") is not None
