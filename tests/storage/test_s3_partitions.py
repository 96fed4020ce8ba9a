"""Memory partitions and vector datasets on S3 (moto's server over HTTP), through the
one ``[s3]`` section: segments are pyarrow objects named by subject_ref and a unique
id, never overwritten; erasure leaves no object version of the subject in a
versioned bucket, and verification says it listed the bucket."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from keyshred import Config, Keyshred
from keyshred.config import S3Settings, StorageSettings, VectorSettings
from keyshred.errors import ConfigError, SubjectSuppressed
from keyshred.storage.erasable import ErasureTarget
from keyshred.storage.s3 import open_partition_store
from tests.servers import Server
from tests.storage.test_vectors import bag_of_words

NS = ("notes",)


def _client(moto: Server) -> Any:
    return boto3.client("s3", endpoint_url=moto.url, region_name="us-east-1")


@pytest.fixture
def bucket(moto: Server) -> str:
    name = f"ks-{uuid.uuid4().hex[:12]}"
    s3 = _client(moto)
    s3.create_bucket(Bucket=name)
    s3.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    return name


def s3_config(catalog_url: str | None, bucket: str, moto: Server, **storage: Any) -> Config:
    return Config(
        storage=StorageSettings(catalog_url=catalog_url, uri=f"s3://{bucket}/parts", **storage),
        vectors=VectorSettings(uri=f"s3://{bucket}/vectors"),
        s3=S3Settings(endpoint_url=moto.url, region="us-east-1"),
    )


@pytest.fixture
def ks(catalog_url: str, bucket: str, moto: Server, tmp_path: Path) -> Iterator[Keyshred]:
    cfg = s3_config(catalog_url, bucket, moto, flush_records=5)
    store = Keyshred.init(tmp_path / "data", cfg, embeddings=bag_of_words)
    yield store
    store.close()


def versions(moto: Server, bucket: str, prefix: str) -> list[tuple[str, str]]:
    out = []
    for page in (
        _client(moto).get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=prefix)
    ):
        for item in [*page.get("Versions", []), *page.get("DeleteMarkers", [])]:
            out.append((item["Key"], item["VersionId"]))
    return out


def test_segments_are_objects_in_the_bucket_and_nothing_local(
    ks: Keyshred, bucket: str, moto: Server, tmp_path: Path
) -> None:
    for i in range(12):  # more than flush_records: compactions run
        ks.memories.put("alice", NS, f"k{i}", {"text": f"alice likes kayaks {i}"}, index=True)
    ks.memories.flush()
    ref = ks.subject_ref("alice")
    # pyarrow keeps an empty "folder" marker when it deletes the last object of a
    # prefix (a key ending in "/", no bytes); every other object is a segment.
    keys = [k for k, _ in versions(moto, bucket, f"parts/subject={ref}/") if k[-1] != "/"]
    assert keys and all(k.endswith(".parquet") and "/seg-" in k for k in keys)
    current = _client(moto).list_objects_v2(Bucket=bucket, Prefix=f"parts/subject={ref}/")
    live = [o["Key"] for o in current.get("Contents", []) if o["Key"][-1] != "/"]
    assert len(live) == 1  # one scope, one live segment; the retired ones deleted
    assert not (tmp_path / "data" / "memories").exists()  # the local disk holds none
    got = ks.memories.get("alice", NS, "k3")
    assert got is not None and got.value == {"text": "alice likes kayaks 3"}
    hits = ks.memories.search("alice", query="kayaks", limit=3)
    assert len(hits) == 3
    assert [k for k, _ in versions(moto, bucket, "vectors/")]  # LanceDB on the bucket


def test_a_new_process_reads_everything_from_the_bucket_and_the_catalog(
    catalog_url: str, bucket: str, moto: Server, tmp_path: Path
) -> None:
    cfg = s3_config(catalog_url, bucket, moto, flush_records=4)
    with Keyshred.init(tmp_path / "data", cfg, embeddings=bag_of_words) as ks:
        for i in range(10):
            ks.memories.put("bob", NS, f"k{i}", {"i": i})
    with Keyshred.open(tmp_path / "data", cfg, embeddings=bag_of_words) as again:
        assert again.memories.count("bob") == 10
        assert [again.memories.get("bob", NS, f"k{i}").value for i in range(10)] == [  # type: ignore[union-attr]
            {"i": i} for i in range(10)
        ]


def test_erasure_leaves_no_object_version_and_verification_lists_the_bucket(
    ks: Keyshred, bucket: str, moto: Server
) -> None:
    for i in range(8):
        ks.memories.put("carol", NS, f"k{i}", {"text": f"carol note {i}"}, index=True)
    ks.memories.put("dave", NS, "k", {"text": "dave's note"})
    ks.memories.flush()
    ref = ks.subject_ref("carol")
    assert len(versions(moto, bucket, f"parts/subject={ref}/")) >= 2  # old versions too
    req = ks.erase("carol", requested_by="dpo", reason="gdpr-art17")
    assert req.state == "completed", req.error
    assert versions(moto, bucket, f"parts/subject={ref}/") == []
    checks = ks.memories.verify(ErasureTarget(ref))
    assert all(c.passed for c in checks)
    assert any(f"s3://{bucket}/parts" in c.detail for c in checks)
    with pytest.raises(SubjectSuppressed):
        ks.memories.get("carol", NS, "k0")
    dave = ks.memories.get("dave", NS, "k")
    assert dave is not None and dave.value == {"text": "dave's note"}


def test_an_object_left_in_the_bucket_fails_verification(
    ks: Keyshred, bucket: str, moto: Server
) -> None:
    ks.memories.put("erin", NS, "k", 1)
    ref = ks.subject_ref("erin")
    assert ks.erase("erin", requested_by="dpo", reason="test").state == "completed"
    target = ErasureTarget(ref)
    assert all(c.passed for c in ks.memories.verify(target))
    # Another worker's upload of the subject after the erasure, say.
    _client(moto).put_object(Bucket=bucket, Key=f"parts/subject={ref}/seg-x.parquet", Body=b"x")
    assert not all(c.passed for c in ks.memories.verify(target))


def test_a_partition_uri_is_a_folder_or_an_s3_prefix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        open_partition_store("gs://bucket/x", tmp_path)
    with pytest.raises(ConfigError):
        open_partition_store("s3:///no-bucket", tmp_path)
    with pytest.raises(ConfigError):
        open_partition_store("s3://b/p", tmp_path, endpoint_url="127.0.0.1:9000")
    folder = open_partition_store(str(tmp_path / "parts"), tmp_path)
    assert folder.local and folder.url == str((tmp_path / "parts").resolve())


def test_a_backup_copies_the_segments_from_the_bucket_and_restores_them_locally(
    ks: Keyshred, bucket: str, moto: Server, tmp_path: Path
) -> None:
    for i in range(12):  # compacted segments in the bucket, and hot rows
        ks.memories.put("gina", NS, f"k{i}", {"i": i})
    ks.memories.put("hugo", NS, "k", {"i": -1})
    gen = ks.backup.create()
    assert any(
        s.path.startswith("memories/subject=") for s in ks.backup.manifest(gen.generation).segments
    )
    req = ks.erase("hugo", requested_by="dpo", reason="gdpr-art17")
    assert req.state == "completed", req.error
    before = versions(moto, bucket, "parts/")
    report = ks.backup.restore(gen.generation, tmp_path / "restored")
    assert [r["subject_ref"] for r in report.replayed] == [ks.subject_ref("hugo")]
    assert report.memories_verified == 12
    with Keyshred.open(tmp_path / "restored", embeddings=bag_of_words) as r:
        assert r.config.storage.uri is None  # the copy never points at the live bucket
        assert [r.memories.get("gina", NS, f"k{i}").value for i in range(12)] == [  # type: ignore[union-attr]
            {"i": i} for i in range(12)
        ]
        with pytest.raises(SubjectSuppressed):
            r.memories.get("hugo", NS, "k")
    assert versions(moto, bucket, "parts/") == before  # the restore touched no live object
