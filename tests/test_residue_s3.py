"""The residue check on object storage (issue 21): memory partitions, vector datasets
and backup targets on S3 (moto's server, a versioned bucket) are scanned object by
object *and version by version*, as an attacker holding the bucket would read them.

A memory deleted while its subject lives leaves nothing in the partitions: the
segment it was in goes with every version of it. A copy of a segment that someone
else made and deleted stays as a noncurrent version (a versioned bucket keeps what a
delete only hides): its key is alive, so the scan decrypts it there and says which
version. An erased subject leaves nothing: its keys are destroyed and every version
of its objects deleted.
Objects a test uploads with a probe in plaintext are found raw, current or not; a
scan leaves no temporary file behind, and neither its report nor the CLI's output
holds a probe.
"""

from __future__ import annotations

import json
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keyshred import Config, Keyshred
from keyshred.backup.generations import TARGETS_FILE
from keyshred.config import BackupSettings, S3Settings, StorageSettings, VectorSettings
from keyshred.errors import InvalidInput
from keyshred.residue import ResidueHit, ResidueReport
from tests.e2e.test_cli import run
from tests.servers import Server, new_bucket, s3_client
from tests.storage.test_vectors import bag_of_words
from tests.test_residue import assert_no_probe

NS = ("profile",)


def _config(catalog_url: str | None, bucket: str, moto: Server) -> Config:
    # Compactions write segments (objects and their versions are what is scanned),
    # however small the partition.
    return Config(
        storage=StorageSettings(
            catalog_url=catalog_url, uri=f"s3://{bucket}/parts", inline_max_rows=0
        ),
        vectors=VectorSettings(uri=f"s3://{bucket}/vectors"),
        backup=BackupSettings(target=f"s3://{bucket}/backups"),
        s3=S3Settings(endpoint_url=moto.url, region="us-east-1"),
    )


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Path]]:
    """Every temporary folder the scan makes goes under one folder; yields the
    folders made (each checked to be the owner's alone when made)."""
    root = tmp_path / "scratch-tmp"
    root.mkdir()
    made: list[Path] = []
    real = tempfile.mkdtemp

    def mkdtemp(*args: Any, **kwargs: Any) -> str:
        path = str(real(*args, **kwargs))
        assert Path(path).stat().st_mode & 0o777 == 0o700
        made.append(Path(path))
        return path

    monkeypatch.setattr(tempfile, "tempdir", str(root))
    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    yield made
    assert list(root.iterdir()) == []


def _by_root(report: ResidueReport, url: str) -> list[ResidueHit]:
    index = report.roots.index(url)
    return [h for h in report.hits if h.root == index]


def _versions(moto: Server, bucket: str, key: str) -> dict[str, bool]:
    """version id -> is the current one, of one object."""
    page = s3_client(moto).list_object_versions(Bucket=bucket, Prefix=key)
    return {
        v["VersionId"]: bool(v["IsLatest"]) for v in page.get("Versions", []) if v["Key"] == key
    }


def test_objects_and_noncurrent_versions_are_scanned_and_an_erased_subject_left_none(
    catalog_url: str, moto: Server, tmp_path: Path, scratch: list[Path]
) -> None:
    run_id = uuid.uuid4().hex[:8]
    phone = "13812345678"  # the keeper's, in a memory deleted later
    email = f"v.{run_id}@example.org"  # the victim's
    name = f"Zoë Ørsted-Ñúñez {run_id}"  # the victim's
    planted = f"planted.{run_id}@example.net"  # only in objects the test uploads
    probes = [phone, email, name, planted]
    bucket = new_bucket(moto)
    parts, vectors, backups = (f"s3://{bucket}/{p}" for p in ("parts", "vectors", "backups"))
    with Keyshred.init(
        tmp_path / "data", _config(catalog_url, bucket, moto), embeddings=bag_of_words
    ) as ks:
        keeper, victim = ks.subject_ref("keeper"), ks.subject_ref("victim")
        ks.memories.put("keeper", NS, "gone", {"phone": phone})
        ks.memories.put("keeper", NS, "stays", {"text": "keeper rows kayaks"}, index=["text"])
        ks.memories.put("victim", NS, "bio", {"text": f"{name} mails {email}"}, index=["text"])
        ks.memories.flush()  # segments in the bucket
        ks.backup.create()  # to the S3 target: segment copies, catalog, key store

        before = ks.erasure.residue_scan(probes, [tmp_path / "data"])
        assert before.roots[1:] == [parts, vectors, backups]
        assert [h for h in before.hits if h.layer == "raw"] == []
        assert {h.probe for h in _by_root(before, parts) if h.kind == "memory_segment"} == {0, 1, 2}
        assert {h.probe for h in _by_root(before, backups) if h.kind == "memory_segment"} == {
            0,
            1,
            2,
        }
        assert before.decrypted["vector"] >= 2  # every version of both datasets, from S3
        assert {s["role"] for s in before.object_stores} == {
            "storage.uri",
            "vectors.uri",
            "backup target",
        }
        assert before.files_scanned > 0 and before.objects_scanned > 5

        # Someone copies the keeper's segment inside the bucket and deletes the copy:
        # the versioned bucket keeps it as a noncurrent version.
        s3 = s3_client(moto)
        live = next(
            o["Key"]
            for o in s3.list_objects_v2(Bucket=bucket, Prefix=f"parts/subject={keeper}/")[
                "Contents"
            ]
            if o["Key"].endswith(".parquet")
        )
        copy = f"parts/subject={keeper}/seg-copy-{run_id}.parquet"
        s3.copy_object(Bucket=bucket, Key=copy, CopySource={"Bucket": bucket, "Key": live})
        s3.delete_object(Bucket=bucket, Key=copy)
        # A deletion rewrites the keeper's segment and deletes the old object with
        # every version of it. The victim is erased.
        assert ks.memories.delete("keeper", NS, "gone")
        assert ks.erase("victim", requested_by="dpo", reason="gdpr-art17").state == "completed"
        s3.put_object(Bucket=bucket, Key="parts/stray/dump.txt", Body=f"x {planted} y".encode())
        s3.put_object(Bucket=bucket, Key="parts/stray/old.txt", Body=planted.encode("utf-16-le"))
        s3.delete_object(Bucket=bucket, Key="parts/stray/old.txt")  # noncurrent only

        after = ks.erasure.residue_scan(probes, [tmp_path / "data"])

    # The deleted memory: not in the segment its deletion replaced (gone with every
    # version), only in the noncurrent version of the copy, decrypted.
    found = [h for h in _by_root(after, parts) if h.probe == 0 and h.layer == "decrypted"]
    assert [(h.kind, h.path) for h in found] == [("memory_segment", copy.removeprefix("parts/"))]
    assert _versions(moto, bucket, copy) == {found[0].version: False}
    assert _versions(moto, bucket, live) == {}
    # ... and in the backup taken before the deletion (until its generation expires).
    assert {h.probe for h in _by_root(after, backups) if h.layer == "decrypted"} == {0}
    # Nothing of the erased subject, in any layer, anywhere.
    assert [h for h in after.hits if h.probe in (1, 2)] == []
    for store in after.object_stores:
        assert store["listed"] is True
        assert not any(victim in v["key"] for v in store["versions"]), store["url"]
    # Planted plaintext, current and noncurrent, found raw with its version.
    raw = {(h.path, h.encoding, h.probe) for h in _by_root(after, parts) if h.layer == "raw"}
    assert raw == {("stray/dump.txt", "utf-8", 3), ("stray/old.txt", "utf-16-le", 3)}
    old = next(h for h in after.hits if h.path == "stray/old.txt")
    assert _versions(moto, bucket, "parts/stray/old.txt") == {old.version: False}
    # Every version listed was read, and counted.
    listed = sum(s["objects"] + s["noncurrent"] for s in after.object_stores)
    assert after.objects_scanned == listed
    assert sum(s["delete_markers"] for s in after.object_stores) >= 2
    assert after.decrypted["vector"] >= 1  # the keeper's
    assert_no_probe(json.dumps(after.as_dict(), ensure_ascii=False) + repr(after), probes)
    assert scratch  # the objects went through private folders (removed: the fixture)


def test_an_s3_prefix_given_as_a_path(moto: Server, tmp_path: Path, scratch: list[Path]) -> None:
    """``s3://bucket/prefix`` is a path like a folder (reached through [s3]): every
    version of every object under it is searched, whatever its key."""
    probe = f"leak.{uuid.uuid4().hex[:8]}@example.org"
    bucket = new_bucket(moto)
    s3 = s3_client(moto)
    first = s3.put_object(Bucket=bucket, Key="dump/a.bin", Body=f"<{probe}>".encode())
    s3.put_object(Bucket=bucket, Key="dump/a.bin", Body=b"overwritten")
    # A key that is a file and a folder at once, and one beside the prefix.
    s3.put_object(Bucket=bucket, Key="dump/x", Body=probe.encode().hex().encode())
    s3.put_object(Bucket=bucket, Key="dump/x/y", Body=probe.encode("utf-16-be"))
    s3.put_object(Bucket=bucket, Key="dumpster/z", Body=probe.encode())
    plain = new_bucket(moto, versioned=False)
    s3.put_object(Bucket=plain, Key="k/v.txt", Body=probe.encode())
    cfg = Config(s3=S3Settings(endpoint_url=moto.url, region="us-east-1"))
    with Keyshred.init(tmp_path / "data", cfg, embeddings=bag_of_words) as ks:
        report = ks.erasure.residue_scan([probe], [f"s3://{bucket}/dump/", f"s3://{plain}"])
        with pytest.raises(InvalidInput):
            ks.erasure.residue_scan([probe], [f"s3://{bucket}-missing/x"])
        with pytest.raises(InvalidInput):
            ks.erasure.residue_scan([probe], ["s3://"])
        # A backup target the folder wrote to whose bucket has gone since: counted
        # as unreadable, never skipped in silence.
        (ks.path / TARGETS_FILE).write_text(f"s3://{bucket}-gone/b\n", encoding="utf-8")
        gone = ks.erasure.residue_scan([probe], [ks.path])
        assert gone.unreadable == {"object_store": 1} and gone.clean
        assert [(s["role"], s["listed"]) for s in gone.object_stores] == [("backup target", False)]
    assert report.roots == [f"s3://{bucket}/dump", f"s3://{plain}"]
    hits = {(h.root, h.path, h.encoding, h.version) for h in report.hits}
    assert hits == {
        (0, "a.bin", "utf-8", first["VersionId"]),  # the overwritten version
        (0, "x", "hex", next(iter(_versions(moto, bucket, "dump/x")))),
        (0, "x/y", "utf-16-be", next(iter(_versions(moto, bucket, "dump/x/y")))),
        (1, "k/v.txt", "utf-8", "null"),  # never versioned
    }
    assert report.objects_scanned == 5 and report.files_scanned == 0
    assert [(s["objects"], s["noncurrent"]) for s in report.object_stores] == [(3, 1), (1, 0)]

    # The CLI: exit 1, hits named by key and version, the probe never printed.
    args = ["verify", "residue", "--probe", probe, f"s3://{bucket}/dump"]
    text = run(*args, "--path", str(tmp_path / "data"))
    assert text.returncode == 1, text.stderr
    assert f"a.bin (version {first['VersionId']})" in text.stdout
    assert "1 noncurrent" in text.stdout
    as_json = run(*args, "--path", str(tmp_path / "data"), "--json")
    assert json.loads(as_json.stdout)["objects_scanned"] == 4
    missing = run(
        "verify",
        "residue",
        "--probe",
        probe,
        f"s3://{bucket}-missing",
        "--path",
        str(tmp_path / "data"),
    )
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    for proc in (text, as_json, missing):
        assert_no_probe(proc.stdout + proc.stderr, [probe])
