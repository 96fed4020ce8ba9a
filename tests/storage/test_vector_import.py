"""A data folder whose vectors are one LanceDB dataset per subject (written by the
release before revision 0013, keyshred main at c4f07aa) opens in this one: each
subject's dataset is imported into the catalog's ``ks_mem_vectors`` on its first
touch, under its subject lock, then removed; an erasure of a subject never touched
removes its dataset unread; an import that dies after its commit is finished by the
next touch, with no row twice.

The folder is ``tests/data/vectors_c4f07aa.tar.gz``, made by the old code with
``tests/data/make_legacy_vectors.py`` (what it holds is listed there)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from keyshred import Config, Keyshred
from keyshred.config import S3Settings, VectorSettings
from keyshred.errors import IntegrityError
from keyshred.storage import faults
from keyshred.storage.embeddings import Embedder
from keyshred.storage.schema import memory_vectors
from keyshred.storage.vectors import space_tag
from tests.servers import Server, new_bucket, s3_client

DATA = Path(__file__).resolve().parents[1] / "data"
ARCHIVE = DATA / "vectors_c4f07aa.tar.gz"


def _fixture_module() -> Any:
    spec = importlib.util.spec_from_file_location("make_vectors", DATA / "make_legacy_vectors.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MK = _fixture_module()
NS = MK.NS


def unpack(tmp_path: Path) -> Path:
    with tarfile.open(ARCHIVE) as tar:
        tar.extractall(tmp_path, filter="data")
    return tmp_path / "data"


def datasets(data: Path) -> set[str]:
    folder = data / "vectors"
    return (
        {p.name.removesuffix(".lance") for p in folder.glob("*.lance")}
        if folder.exists()
        else set()
    )


def rows_of(ks: Keyshred, ref: str) -> list[str]:
    t = memory_vectors
    with ks.catalog.engine.connect() as conn:
        return [r[0] for r in conn.execute(sa.select(t.c.vec_id).where(t.c.subject_ref == ref))]


def test_each_subjects_dataset_is_imported_on_first_touch_then_removed(tmp_path: Path) -> None:
    data = unpack(tmp_path)
    with Keyshred.open(data, embeddings=MK.embed) as ks:
        refs = {s: ks.subject_ref(s) for s in MK.SUBJECTS}
        assert datasets(data) == set(refs.values())  # the victim's went with its erasure
        alice, bob, carol = refs["alice"], refs["bob"], refs["carol"]
        # A search of alice: her dataset's vectors, found by the query of each value.
        for key, value in MK.SUBJECTS["alice"].items():
            top = ks.memories.search("alice", NS, query=value, limit=1)
            assert [h.key for h in top] == [key]
        assert datasets(data) == {bob, carol}
        # Four imported (three of the handle's space, one of another); the search in
        # the handle's space then embedded the fourth memory in it too (as it would
        # have before: a space re-embeds what it lacks).
        assert len(rows_of(ks, alice)) == 5
        assert rows_of(ks, bob) == [] and rows_of(ks, carol) == []
        # The other space's vector came over too, its tag (in its associated data) intact.
        other = Embedder(MK.embed_other, dims=MK.DIM, space=MK.OTHER)
        assert ks.vectors.count(alice, space_tag(MK.OTHER, MK.DIM)) == 1
        top = ks.memories.search(
            "alice", NS, query=MK.SPACE_OTHER["alice"]["a3"], embedder=other, limit=1
        )
        assert [h.key for h in top] == ["a3"]
        # bob's vector under the owner-set key shared with carol opens as before.
        for key, value in MK.SUBJECTS["bob"].items():
            top = ks.memories.search("bob", NS, query=value, limit=1)
            assert [h.key for h in top] == [key]
        assert datasets(data) == {carol}
        # A write is the first touch of carol: imported first, then written.
        ks.memories.put("carol", NS, "c2", "carol-probe second", index=True)
        assert datasets(data) == set()
        assert len(rows_of(ks, carol)) == 2
        assert ks.memories.repair(carol).clean
    # Reopened: nothing of the old layout, everything readable.
    with Keyshred.open(data, embeddings=MK.embed) as ks:
        for key, value in MK.SUBJECTS["carol"].items():
            assert [h.key for h in ks.memories.search("carol", NS, query=value, limit=1)] == [key]
        assert not (data / "vectors").exists() or not any((data / "vectors").iterdir())


def test_an_erasure_of_a_subject_never_touched_removes_its_dataset_unread(
    tmp_path: Path,
) -> None:
    data = unpack(tmp_path)
    with Keyshred.open(data, embeddings=MK.embed) as ks:
        carol = ks.subject_ref("carol")
        assert carol in datasets(data)
        req = ks.erase("carol", requested_by="dpo", reason="test", probes=["carol-probe"])
        assert req.state == "completed", req.error
        assert carol not in datasets(data) and rows_of(ks, carol) == []
        assert not ks.vectors.exists(carol)
        # bob's vector under the key he shared with carol is unreadable now; his own
        # is still found.
        assert ks.vectors.count(ks.subject_ref("bob")) == 1


def test_an_import_that_dies_after_its_commit_is_finished_by_the_next_touch(
    tmp_path: Path,
) -> None:
    data = unpack(tmp_path)

    class Killed(Exception):
        pass

    def die(point: str) -> None:
        if point == "vectors.after_import":
            raise Killed

    with Keyshred.open(data, embeddings=MK.embed) as ks:
        alice = ks.subject_ref("alice")
        faults.hook = die
        try:
            with pytest.raises(Killed):
                ks.vectors.count(alice)
        finally:
            faults.hook = None
        assert alice in datasets(data) and len(rows_of(ks, alice)) == 4
    with Keyshred.open(data, embeddings=MK.embed) as ks:
        assert ks.vectors.count(alice) == 4 and ks.vectors.count(alice, "") == 3
        assert len(rows_of(ks, alice)) == 4  # no row twice
        assert alice not in datasets(data)


def test_a_tampered_dataset_raises_integrity_error_and_stays(tmp_path: Path) -> None:
    data = unpack(tmp_path)
    with Keyshred.open(data, embeddings=MK.embed) as ks:
        carol = ks.subject_ref("carol")
        for path in (data / "vectors" / f"{carol}.lance" / "data").glob("*.lance"):
            blob = bytearray(path.read_bytes())
            mid = len(blob) // 2
            blob[mid - 64 : mid + 64] = bytes(b ^ 0xFF for b in blob[mid - 64 : mid + 64])
            path.write_bytes(bytes(blob))
        with pytest.raises(IntegrityError) as info:
            ks.memories.search("carol", NS, query="violin")
        assert "lance error" not in str(info.value).lower()
        assert carol in datasets(data) and rows_of(ks, carol) == []


def test_keyshred_migrate_imports_every_dataset_at_once(tmp_path: Path) -> None:
    data = unpack(tmp_path)
    with Keyshred.open(data, embeddings=MK.embed) as ks:
        refs = sorted(ks.subject_ref(s) for s in MK.SUBJECTS)
        done, left = ks.memories.import_legacy()
        assert done == refs and left == []
        assert datasets(data) == set()
        assert all(rows_of(ks, ref) for ref in refs)
        assert ks.memories.import_legacy() == ([], [])


def test_on_a_bucket_datasets_are_listed_without_lancedb_then_imported(
    tmp_path: Path, moto: Server
) -> None:
    """The old layout on S3 (``vectors.uri`` a bucket prefix): the datasets are found
    by listing the bucket (a process that touches vectors no longer imports LanceDB
    to learn there are none), imported on first touch, and every object version of
    an imported dataset is deleted."""
    data = unpack(tmp_path)
    bucket = new_bucket(moto)
    s3 = s3_client(moto)
    local = data / "vectors"
    for path in local.rglob("*"):
        if path.is_file():
            s3.upload_file(str(path), bucket, f"vectors/{path.relative_to(local).as_posix()}")
    shutil.rmtree(local)
    config = Config(
        vectors=VectorSettings(uri=f"s3://{bucket}/vectors"),
        s3=S3Settings(endpoint_url=moto.url, region="us-east-1"),
    )

    def on_bucket() -> set[str]:
        listed = s3.list_object_versions(Bucket=bucket, Prefix="vectors/")
        keys = [v["Key"] for v in [*listed.get("Versions", []), *listed.get("DeleteMarkers", [])]]
        return {k.split("/")[1].removesuffix(".lance") for k in keys}

    with Keyshred.open(data, config, embeddings=MK.embed) as ks:
        refs = {s: ks.subject_ref(s) for s in MK.SUBJECTS}
        assert ks.vectors.legacy_refs() == sorted(refs.values())
        for key, value in MK.SUBJECTS["alice"].items():
            top = ks.memories.search("alice", NS, query=value, limit=1)
            assert [h.key for h in top] == [key]
        assert on_bucket() == {refs["bob"], refs["carol"]}  # no version of alice's left
        done, left = ks.memories.import_legacy()
        assert sorted(done) == sorted([refs["bob"], refs["carol"]]) and left == []
        assert on_bucket() == set()
    # A fresh process on a bucket with no dataset left: a search never imports LanceDB.
    script = (
        "import sys\n"
        "from keyshred import Config, Keyshred\n"
        "from tests.storage.test_vector_import import MK, NS\n"
        f"config = Config.model_validate_json({config.model_dump_json()!r})\n"
        f"with Keyshred.open({str(data)!r}, config, embeddings=MK.embed) as ks:\n"
        "    assert ks.vectors.legacy_refs() == []\n"
        "    assert ks.memories.search('carol', NS, query='violin', limit=1)\n"
        "assert 'lancedb' not in sys.modules, 'lancedb was imported'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
