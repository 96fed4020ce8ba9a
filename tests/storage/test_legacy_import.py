"""A data folder written by the release before issue #21 (MANIFEST + PME segments +
append logs per subject, catalog at revision 0003) opens in this one: the catalog
is upgraded, each partition is imported on its first use (or by ``keyshred
migrate``) into catalog-listed segments, nothing of the old layout is left, and a
kill at any instant of the import loses and duplicates nothing.

The folder is ``tests/data/legacy_70c7cef.tar.gz``, made by the old code with
``tests/data/make_legacy_partitions.py`` (what it holds is listed there)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import sqlite3
import sys
import tarfile
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from keyshred import Config, Keyshred
from keyshred.cli import app
from keyshred.config import load_config
from keyshred.errors import IntegrityError, SubjectErased, SubjectSuppressed
from keyshred.migrations import VERSION_TABLE
from keyshred.storage.legacy import is_legacy_name
from tests import zygote
from tests.conftest import PG_DSN
from tests.storage.conftest import stored_rows

DATA = Path(__file__).resolve().parents[1] / "data"
ARCHIVE = DATA / "legacy_70c7cef.tar.gz"
WORKER = Path(__file__).with_name("legacy_import_worker.py")


def _fixture_module() -> Any:
    spec = importlib.util.spec_from_file_location("make_legacy", DATA / "make_legacy_partitions.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MK = _fixture_module()
NS, SUBJECTS, OPAQUE = MK.NS, MK.SUBJECTS, MK.OPAQUE


def unpack(tmp_path: Path) -> Path:
    """The folder of the embedded profile (its catalog in ``catalog/catalog.db``)."""
    with tarfile.open(ARCHIVE) as tar:
        tar.extractall(tmp_path, filter="data")
    shutil.rmtree(tmp_path / "data-pg")
    return tmp_path / "data"


def unpack_for(catalog_url: str, tmp_path: Path) -> tuple[Path, Config]:
    """The folder the old release wrote with ``catalog_url``'s database: on
    PostgreSQL its catalog's dump is loaded into the test's schema (the partitions
    stayed in the folder: that release had no object store)."""
    if not catalog_url.startswith("postgresql"):
        data = unpack(tmp_path)
        return data, load_config(data)
    with tarfile.open(ARCHIVE) as tar:
        tar.extractall(tmp_path, filter="data")
    data = tmp_path / "data-pg"
    match = re.search(r"search_path%3D(\w+)", catalog_url)
    assert match is not None
    dump = (data / MK.PG_DUMP).read_text()
    dump = re.sub(rf"^CREATE SCHEMA {MK.PG_SCHEMA};$", "", dump, flags=re.M)
    dump = dump.replace(f"{MK.PG_SCHEMA}.", f"{match.group(1)}.")
    (data / MK.PG_DUMP).unlink()
    import psycopg

    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(dump.encode())  # type: ignore[call-overload]
    config = load_config(data)
    storage = config.storage.model_copy(update={"catalog_url": catalog_url})
    return data, config.model_copy(update={"storage": storage})


def legacy_files(data: Path) -> list[str]:
    mem = data / "memories"
    return sorted(
        str(p.relative_to(mem)) for p in mem.rglob("*") if p.is_file() and is_legacy_name(p.name)
    )


def readable(ks: Keyshred, subject: str) -> dict[str, Any]:
    return {m.key: m.value for m in ks.memories.search(subject, NS, limit=1000)}


def stored(ks: Keyshred, subject: str) -> list[tuple[str, bytes]]:
    """Every row the subject's partition stores, opaque rows included (a partition
    the import compacted into the catalog is its hot records alone)."""
    return stored_rows(ks, ks.subject_ref(subject))


def segment_ids(ks: Keyshred, subject: str) -> list[str]:
    """Every memory id the subject's partition stores (``stored``)."""
    return [mid for mid, _ in stored(ks, subject)]


def check_imported(ks: Keyshred, data: Path) -> None:
    """Every readable memory back with its value, opaque rows carried over (their
    assets still match), no row twice, nothing of the old layout left."""
    for subject, expected in SUBJECTS.items():
        assert readable(ks, subject) == expected, subject
        assert ks.memories.count(subject) == len(expected)
        ref = ks.subject_ref(subject)
        ids = segment_ids(ks, subject)
        assert len(ids) == len(set(ids)), "a row imported twice"
        assert len(ids) == len(expected) + len(OPAQUE.get(subject, []))
        report = ks.memories.repair(ref)
        assert report.clean, report.as_dict()
    assert legacy_files(data) == []


def test_the_folder_opens_migrated_and_every_partition_imports_on_first_use(
    catalog_url: str, tmp_path: Path
) -> None:
    data, config = unpack_for(catalog_url, tmp_path)
    before = legacy_files(data)
    assert any(f.endswith("MANIFEST") for f in before)
    assert any(f.endswith(".ksl") for f in before)
    assert _revision(catalog_url, data) == "0003"
    with Keyshred.open(data, config, embeddings=MK.embed) as ks:
        # The catalog of revision 0003 was upgraded (0004 on) when the folder opened.
        assert _revision(catalog_url, data) == _head()
        assert legacy_files(data) == before  # nothing read or removed yet
        check_imported(ks, data)
        # Scopes, the derived row's provenance, the log's update and the indexed row.
        health = ks.memories.get("alice", NS, "h1")
        assert health is not None and health.scope == "support/health"
        bob = ks.memories.get("bob", NS, "b3")
        alice = ks.memories.get("alice", NS, "a1")
        assert bob is not None and alice is not None and bob.sources == (alice.memory_id,)
        hits = ks.memories.search("carol", NS, query="carol-probe-kayaks", limit=1)
        assert [h.key for h in hits] == ["c1"]
        # The killed delete was finished: its asset went with the row.
        assert len(ks.catalog.assets(ks.subject_ref("carol"))) == 3  # c1, its vector, c2
        # Writes go on in the new engine; the victim erased by the old release stays so.
        ks.memories.put("alice", NS, "a5", "after the import")
        ks.memories.flush()
        with pytest.raises((SubjectErased, SubjectSuppressed)):
            ks.memories.get("victim", NS, "v1")
    with Keyshred.open(data, config, embeddings=MK.embed) as ks:
        assert readable(ks, "alice") == {**SUBJECTS["alice"], "a5": "after the import"}


def _head() -> str:
    from alembic.config import Config as AlembicConfig
    from alembic.script import ScriptDirectory

    from keyshred.migrations import SCRIPT_LOCATION

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", SCRIPT_LOCATION)
    head = ScriptDirectory.from_config(cfg).get_current_head()
    assert head is not None and head >= "0004"
    return head


def _revision(catalog_url: str, data: Path) -> str:
    if catalog_url.startswith("postgresql"):
        import sqlalchemy as sa

        engine = sa.create_engine(catalog_url)
        try:
            with engine.connect() as conn:
                return str(
                    conn.exec_driver_sql(f"SELECT version_num FROM {VERSION_TABLE}").scalar()
                )
        finally:
            engine.dispose()
    with sqlite3.connect(data / "catalog" / "catalog.db") as conn:
        return str(conn.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchone()[0])


def test_an_opaque_row_is_carried_over_byte_for_byte(tmp_path: Path) -> None:
    data = unpack(tmp_path)
    with Keyshred.open(data, embeddings=MK.embed) as ks:
        ref = ks.subject_ref("bob")
        old_seg = next((data / "memories" / f"subject={ref}").glob("seg-g*.parquet"))
        pme = ks.memories._pme
        table = pq.ParquetFile(old_seg, decryption_properties=pme.decryption()).read()
        ids, values = table.column("memory_id").to_pylist(), table.column("value").to_pylist()
        old = dict(zip(ids, values, strict=True))
        assert readable(ks, "bob") == SUBJECTS["bob"]
        new = dict(stored(ks, "bob"))
        live = {m.memory_id for m in ks.memories.search("bob", NS, limit=10)}
        shared = [mid for mid in old if mid not in live]
        assert len(shared) == 1  # b2, the segment's opaque row
        assert new[shared[0]] == old[shared[0]]


def test_keyshred_migrate_imports_every_partition_at_once(tmp_path: Path) -> None:
    data = unpack(tmp_path)
    result = CliRunner().invoke(app, ["migrate", "--path", str(data), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert len(out["imported"]) == 4 and out["left_to_erasure"] == []
    assert legacy_files(data) == []
    again = CliRunner().invoke(app, ["migrate", "--path", str(data), "--json"])
    assert json.loads(again.output)["imported"] == []
    with Keyshred.open(data, embeddings=MK.embed) as ks:
        check_imported(ks, data)


def test_an_erasure_of_a_subject_never_imported_removes_its_old_files_unread(
    catalog_url: str, tmp_path: Path
) -> None:
    """Erin is suppressed before anything read her folder: no import runs (no
    row decrypted, no key created), the erasure drops the folder and verifies it."""
    data, config = unpack_for(catalog_url, tmp_path)
    with Keyshred.open(data, config, embeddings=MK.embed) as ks:
        ref = ks.subject_ref("erin")
        folder = data / "memories" / f"subject={ref}"
        ks.catalog.suppress(ref)  # an erasure killed after its suppression
        ks.memories.evict(ref)
        part = ks.memories._partition(ref)
        with part.flocked():
            assert not part.rows and not part.opaque
        assert sorted(p.name for p in folder.iterdir()) != []  # left to the erasure
        assert ks.memories._legacy_folder(ref).files()
        req = ks.erase("erin", requested_by="dpo", reason="test", probes=["erin-probe-logged"])
        assert req.state == "completed", req.state
        receipt = ks.erasure.receipt(req.request_id)
        assert receipt is not None
        assert not folder.exists()
        assert ks.memories._hot.counts(ref) == (0, 0, 0)
        residue = ks.erasure.residue_scan(["erin-probe-logged", "erin-probe-compacted"], [data])
        assert residue.clean


def test_an_erased_subjects_old_folder_is_removed_unread(tmp_path: Path) -> None:
    """A folder of a subject whose erasure completed (restored from a file copy,
    say) is residue: removed at its first load, nothing imported, no key made."""
    data = unpack(tmp_path)
    with Keyshred.open(data, embeddings=MK.embed) as ks:
        victim = ks.subject_ref("victim")
        erin = data / "memories" / f"subject={ks.subject_ref('erin')}"
        # Victim's folder as the old release had it, before its erasure.
        shutil.copytree(erin, data / "memories" / f"subject={victim}")
        assert ks.catalog.guard(victim).status == "erased"
        done, left = ks.memories.import_legacy()
        assert victim in done and left == []
        assert ks.memories._legacy_folder(victim).files() == []
        assert ks.memories._hot.counts(victim) == (0, 0, 0)
        assert ks.keyring.store.find(victim, "default", "") is None  # no key made


@pytest.mark.parametrize(
    "damage",
    ["manifest", "segment-byte", "log-byte", "log-sequence", "missing-segment", "foreign-key"],
)
def test_a_tampered_old_folder_raises_integrity_error_and_stays(
    damage: str, tmp_path: Path
) -> None:
    data = unpack(tmp_path)
    with Keyshred.open(data, embeddings=MK.embed) as ks:
        ref = ks.subject_ref("alice")
        folder = data / "memories" / f"subject={ref}"
        manifest = folder / "MANIFEST"
        log = next(folder.glob("log-*.ksl"))
        seg = sorted(folder.glob("seg-g*.parquet"))[-1]
        if damage == "manifest":
            manifest.write_bytes(manifest.read_bytes()[:-3])
        elif damage == "segment-byte":
            raw = bytearray(seg.read_bytes())
            raw[len(raw) // 2] ^= 0x01
            seg.write_bytes(bytes(raw))
        elif damage == "log-byte":
            raw = bytearray(log.read_bytes())
            raw[-5] ^= 0x01
            log.write_bytes(bytes(raw))
        elif damage == "log-sequence":
            raw = bytearray(log.read_bytes())
            n = int.from_bytes(raw[:4], "big")
            slen = int.from_bytes(raw[4:6], "big")
            raw[6 + slen : 14 + slen] = (5).to_bytes(8, "big")
            assert n > 0
            log.write_bytes(bytes(raw))
        elif damage == "missing-segment":
            seg.unlink()
        else:  # bob's segment named in alice's manifest, under bob's key
            bob = data / "memories" / f"subject={ks.subject_ref('bob')}"
            doc = json.loads(manifest.read_text())
            bob_doc = json.loads((bob / "MANIFEST").read_text())
            doc["segments"]["default"]["key_id"] = bob_doc["segments"]["default"]["key_id"]
            manifest.write_text(json.dumps(doc))
        before = {p.name: p.read_bytes() for p in folder.iterdir()}
        with pytest.raises(IntegrityError):
            ks.memories.get("alice", NS, "a1")
        # Nothing imported, nothing removed: the folder is there for an operator.
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
        assert ks.memories._hot.counts(ref) == (0, 0, 0)
        # The other subjects are not concerned.
        assert readable(ks, "carol") == SUBJECTS["carol"]


KILL_POINTS = [
    ("inline", "import.after_read"),
    ("inline", "flush.after_records"),
    ("parquet", "flush.after_segment"),
    ("inline", "flush.after_manifest"),
    ("parquet", "flush.after_manifest"),
    ("inline", "import.after_commit"),
    ("inline", "import.after_first_file"),
]


@pytest.mark.parametrize(("layout", "point"), KILL_POINTS)
def test_sigkill_inside_the_import_loses_and_duplicates_nothing(
    layout: str, point: str, catalog_url: str, tmp_path: Path
) -> None:
    """Killed at each instant of the import (its compaction's points too, into the
    catalog as these small partitions are by default and into segments), then
    opened again: the import runs again or finishes, every row once."""
    data, config = unpack_for(catalog_url, tmp_path)
    if layout == "parquet":
        storage = config.storage.model_copy(update={"inline_max_rows": 0})
        config = config.model_copy(update={"storage": storage})
    (data / "config.json").write_text(config.model_dump_json())
    proc = zygote.run(
        [sys.executable, str(WORKER), str(data), point],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr[-2000:]
    with Keyshred.open(data, config, embeddings=MK.embed) as ks:
        check_imported(ks, data)


def test_a_backup_of_a_folder_not_yet_imported_covers_its_old_partitions(
    tmp_path: Path,
) -> None:
    # A backup copies the segments the catalog lists; the old layout's partitions are
    # listed only once imported, so the backup imports them first.
    data = unpack(tmp_path)
    with Keyshred.open(data, embeddings=MK.embed) as ks:
        gen = ks.backup.create()
        assert legacy_files(data) == []
        ks.backup.restore(gen.generation, tmp_path / "restored")
    with Keyshred.open(tmp_path / "restored", embeddings=MK.embed) as copy:
        for subject, expected in SUBJECTS.items():
            assert readable(copy, subject) == expected, subject
