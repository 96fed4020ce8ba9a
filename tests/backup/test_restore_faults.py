"""A restore killed (SIGKILL) at any point inside it leaves nothing of an erased
subject behind, in the destination's parent or in its staging folder, and the next
open or restore cleans up and succeeds."""

from __future__ import annotations

import fcntl
import os
import shutil
import sqlite3
import sys
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest

from keyshred import Keyshred
from keyshred.backup.manager import RESTORE_POINTS
from keyshred.backup.staging import RESTORING
from keyshred.errors import SubjectErased, SubjectSuppressed
from tests import zygote
from tests.storage.conftest import parquet_config
from tests.storage.test_vectors import bag_of_words

WORKER = Path(__file__).with_name("restore_worker.py")
NS = ("notes",)


def _setup(data: Path, victims: list[str], probe: str) -> tuple[str, list[bytes], list[bytes]]:
    """A generation holding the victims, then each victim erased (two tombstones to
    replay, so a kill after the first is inside the replay). Returns the generation,
    the victims' wrapped DEKs (as the generation holds them) and their key ids."""
    with Keyshred.init(data, parquet_config(None), embeddings=bag_of_words) as ks:
        for i in range(3):
            for victim in victims:
                text = {"text": f"{probe} {victim} note {i}"}
                ks.memories.put(victim, NS, f"k{i}", text, index=["text"])
            ks.memories.put("bob", NS, f"k{i}", {"text": f"bob note {i}"}, index=["text"])
        ks.memories.put("bob", ("facts",), "met", {"text": f"{probe} met bob"}, mentions=victims)
        ks.vault.sanitize(f"mail {probe}@example.org", victims[0], "support", timedelta(days=1))
        refs = [ks.subject_ref(s) for s in (*victims, "bob")]
        wrapped = {r.key_id: r.wrapped for ref in refs for r in ks.keyring.store.for_subject(ref)}
        ks.memories.flush()  # segments: objects of the generation (a restore copies them)
        gen = ks.backup.create().generation
        for victim in victims:
            req = ks.erase(victim, requested_by="dpo", reason="art17", probes=[probe])
            assert req.state == "completed", req.error
        tombs = ks.keyring.store.tombstones()
        assert [t.subject_ref for t in tombs] == refs[:-1]
    key_ids = [k for t in tombs for k in t.key_ids]
    assert len(key_ids) >= 3  # the victims' own keys and the mention's owner-set key
    return gen, [wrapped[k] for k in key_ids], key_ids


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def _dek_rows(path: Path, key_ids: list[bytes], scratch: Path) -> int:
    """Rows of ``key_ids`` in the key store at ``path`` (read from a copy, WAL and all)."""
    copy = scratch / uuid.uuid4().hex
    copy.mkdir()
    for f in path.parent.glob(path.name + "*"):
        shutil.copy(f, copy / f.name)
    db = sqlite3.connect(copy / path.name)
    try:
        marks = ",".join("?" * len(key_ids))
        return int(
            db.execute(f"SELECT COUNT(*) FROM dek WHERE key_id IN ({marks})", key_ids).fetchone()[0]
        )
    finally:
        db.close()


def _assert_nothing_erased(
    parent: Path, wrapped: list[bytes], key_ids: list[bytes], needles: list[bytes], scratch: Path
) -> None:
    for path in _files(parent):
        data = path.read_bytes()
        for blob in wrapped:
            assert blob not in data, f"{path} holds an erased subject's wrapped DEK"
        for needle in needles:
            assert needle not in data, f"{path} holds plaintext of the erased subject"
        if path.name == "keystore.db":
            assert _dek_rows(path, key_ids, scratch) == 0, path


@dataclass(frozen=True)
class Erased:
    """A data folder with one generation, taken before the victim was erased."""

    data: Path
    generation: str
    victims: list[str]
    probe: str
    wrapped: list[bytes]
    key_ids: list[bytes]

    def copy(self, into: Path) -> Path:
        shutil.copytree(self.data, into, symlinks=True)
        return into


@pytest.fixture(scope="module")
def erased(tmp_path_factory: pytest.TempPathFactory) -> Erased:
    probe = f"zq{uuid.uuid4().hex[:10]}"
    victims = [f"victim-{probe}", f"cy-{probe}"]
    data = tmp_path_factory.mktemp("template") / "data"
    gen, wrapped, key_ids = _setup(data, victims, probe)
    return Erased(data, gen, victims, probe, wrapped, key_ids)


@pytest.mark.parametrize(
    ("point", "nth"),
    [
        ("keystore", 1),
        ("segment", 1),
        ("catalog", 1),
        ("opened", 1),
        ("replayed", 1),
        ("verified", 1),
        ("renamed", 1),
    ],
)
def test_restore_killed_inside_leaves_no_erased_key_and_is_swept(
    point: str, nth: int, erased: Erased, tmp_path: Path
) -> None:
    assert point in RESTORE_POINTS
    data = erased.copy(tmp_path / "data")
    gen, wrapped, key_ids = erased.generation, erased.wrapped, erased.key_ids
    probe, victims = erased.probe, erased.victims
    parent = tmp_path / "restores"
    into = parent / "r1"
    proc = zygote.run(
        [sys.executable, str(WORKER), str(data), gen, str(into), point, str(nth)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr[-3000:]
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    needles = [probe.encode(), *(v.encode() for v in victims)]
    left = [p for p in parent.iterdir() if RESTORING in p.name]
    assert left, "the kill left no staging (lock) behind: the point was not inside the restore"
    _assert_nothing_erased(parent, wrapped, key_ids, needles, scratch)

    # The next open of the data folder sweeps what the killed restore left.
    with Keyshred.open(data, embeddings=bag_of_words) as ks:
        assert not [p for p in parent.iterdir() if RESTORING in p.name]
        dest = into if not into.exists() else parent / "r2"
        report = ks.backup.restore(gen, dest)
        assert [r["subject_ref"] for r in report.replayed] == [ks.subject_ref(v) for v in victims]
    assert not [p for p in parent.iterdir() if RESTORING in p.name]
    _assert_nothing_erased(parent, wrapped, key_ids, needles, scratch)
    with Keyshred.open(dest, embeddings=bag_of_words) as r:
        for victim in victims:
            with pytest.raises((SubjectErased, SubjectSuppressed)):
                r.memories.get(victim, NS, "k0")
        bob = r.memories.get("bob", NS, "k1")
        assert bob is not None and bob.value == {"text": "bob note 1"}


def test_a_restore_sweeps_abandoned_staging_in_its_parent(erased: Erased, tmp_path: Path) -> None:
    """A staging folder whose process is gone (no lock held; also one from before
    the lock files) is removed by the next restore into the same parent; one whose
    restore is alive (lock held) is left alone."""
    data = erased.copy(tmp_path / "data")
    gen = erased.generation
    parent = tmp_path / "restores"
    parent.mkdir()
    dead = parent / f".x{RESTORING}deadbeef"
    (dead / "keys").mkdir(parents=True)
    (dead / "keys" / "keystore.db").write_bytes(b"stale")
    (parent / f".x{RESTORING}deadbeef.lock").touch()
    legacy = parent / f".y{RESTORING}0badf00d"
    legacy.mkdir()
    alive = parent / f".z{RESTORING}a11fe000"
    alive.mkdir()
    fd = os.open(parent / f".z{RESTORING}a11fe000.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with Keyshred.open(data, embeddings=bag_of_words) as ks:
            ks.backup.restore(gen, parent / "r")
        assert not dead.exists() and not legacy.exists()
        assert not (parent / f".x{RESTORING}deadbeef.lock").exists()
        assert alive.exists()
    finally:
        os.close(fd)
