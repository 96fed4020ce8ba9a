"""Memory partitions and vector datasets on S3 (moto's server over HTTP), through the
one ``[s3]`` section: segments are pyarrow objects named by subject_ref and a unique
id, never overwritten; erasure leaves no object version of the subject in a
versioned bucket, and verification says it listed the bucket."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from keyshred import Config, Keyshred
from keyshred.config import BackupSettings, S3Settings, StorageSettings, VectorSettings
from keyshred.errors import ConfigError, KeyshredError, SubjectSuppressed
from keyshred.storage.erasable import ErasureTarget
from keyshred.storage.objects import ObjectStore
from keyshred.storage.s3 import open_partition_store
from tests.servers import Server, new_bucket, s3_client
from tests.storage.test_vectors import bag_of_words

NS = ("notes",)


@pytest.fixture
def bucket(moto: Server) -> str:
    return new_bucket(moto)


def s3_config(catalog_url: str | None, bucket: str, moto: Server, **storage: Any) -> Config:
    """Segments in the bucket; compactions always write them (a partition this small
    otherwise compacts into the catalog), as these tests are about the objects."""
    storage.setdefault("inline_max_rows", 0)
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
        s3_client(moto).get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=prefix)
    ):
        for item in [*page.get("Versions", []), *page.get("DeleteMarkers", [])]:
            out.append((item["Key"], item["VersionId"]))
    return out


def _current(moto: Server, bucket: str, prefix: str) -> list[str]:
    """Current objects under ``prefix`` (no folder markers, no older versions)."""
    page = s3_client(moto).list_objects_v2(Bucket=bucket, Prefix=prefix)
    return [o["Key"] for o in page.get("Contents", []) if o["Key"][-1] != "/"]


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
    # One scope, one live segment; the ones compactions retired stay for the grace
    # period (a reader in another process may have listed them): every object in the
    # bucket is one the catalog names.
    named = ks._memories._hot.segment_names(ref)
    assert sum(1 for at in named.values() if at is None) == 1
    assert sorted(_current(moto, bucket, f"parts/subject={ref}/")) == sorted(
        f"parts/subject={ref}/{n}" for n in named
    )
    assert not (tmp_path / "data" / "memories").exists()  # the local disk holds none
    got = ks.memories.get("alice", NS, "k3")
    assert got is not None and got.value == {"text": "alice likes kayaks 3"}
    hits = ks.memories.search("alice", query="kayaks", limit=3)
    assert len(hits) == 3
    # Vectors are rows of the catalog: no object on the bucket, none on the disk.
    assert not [k for k, _ in versions(moto, bucket, "vectors/")]
    assert not (tmp_path / "data" / "vectors").exists()


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
    s3_client(moto).put_object(Bucket=bucket, Key=f"parts/subject={ref}/seg-x.parquet", Body=b"x")
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


def test_retired_segments_outlive_their_compaction_by_the_grace_period_then_go(
    catalog_url: str, bucket: str, moto: Server, tmp_path: Path
) -> None:
    cfg = s3_config(catalog_url, bucket, moto, flush_records=3, retired_grace_seconds=1.0)
    with Keyshred.init(tmp_path / "data", cfg, embeddings=bag_of_words) as ks:
        for i in range(9):  # three compactions: two retired segments
            ks.memories.put("ida", NS, f"k{i}", {"i": i})
        ref = ks.subject_ref("ida")
        prefix = f"parts/subject={ref}/"
        assert len(_current(moto, bucket, prefix)) == 3  # a reader's old list still reads
        time.sleep(1.1)  # past the grace period
        report = ks.retention.run()
        assert report.retired_segments_deleted == 2
        assert len(_current(moto, bucket, prefix)) == 1
        # No noncurrent version of a retired segment is left on the versioned bucket.
        assert [k for k, _ in versions(moto, bucket, prefix) if k[-1] != "/"] == _current(
            moto, bucket, prefix
        )
        assert ks._memories._hot.segment_names(ref).keys() == {
            k.removeprefix(prefix) for k in _current(moto, bucket, prefix)
        }
        assert ks.memories.count("ida") == 9


def test_a_deletion_leaves_no_retired_segment_behind(
    ks: Keyshred, bucket: str, moto: Server
) -> None:
    for i in range(12):  # compactions: retired segments within their grace period
        ks.memories.put("jan", NS, f"k{i}", {"i": i})
    ref = ks.subject_ref("jan")
    prefix = f"parts/subject={ref}/"
    assert len(_current(moto, bucket, prefix)) > 1
    assert ks.memories.delete("jan", NS, "k0")
    # "Deleted" means the bytes are gone: the segments that held the row went at once,
    # every version of them (a plain delete on a versioned bucket keeps them all).
    assert len(_current(moto, bucket, prefix)) == 1
    assert [k for k, _ in versions(moto, bucket, prefix) if k[-1] != "/"] == _current(
        moto, bucket, prefix
    )
    assert ks.memories.get("jan", NS, "k0") is None
    assert ks.memories.count("jan") == 11


def test_a_backup_to_the_same_service_copies_segments_server_side(
    catalog_url: str, bucket: str, moto: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = s3_config(catalog_url, bucket, moto, flush_records=5)
    cfg = cfg.model_copy(update={"backup": BackupSettings(target=f"s3://{bucket}/backups")})
    with Keyshred.init(tmp_path / "data", cfg, embeddings=bag_of_words) as ks:
        for i in range(12):
            ks.memories.put("kim", NS, f"k{i}", {"i": i})

        def no_download(self: ObjectStore, key: str) -> Any:
            raise AssertionError("a segment passed through this process")

        monkeypatch.setattr(ObjectStore, "open_stream", no_download)
        gen = ks.backup.create()
        segments = [
            s for s in ks.backup.manifest(gen.generation).segments if s.path.startswith("memories/")
        ]
        live = [
            n for n, at in ks._memories._hot.segment_names(ks.subject_ref("kim")).items() if not at
        ]
        assert sorted(s.path.rsplit("/", 1)[1] for s in segments) == sorted(live)
        monkeypatch.undo()
        again = ks.backup.create()  # nothing changed: every object is reused
        assert again.objects_uploaded == 0
        report = ks.backup.restore(gen.generation, tmp_path / "restored")
        assert report.memories_verified == 12


def test_a_backup_takes_a_new_snapshot_when_a_listed_segment_is_deleted_meanwhile(
    catalog_url: str, bucket: str, moto: Server, tmp_path: Path
) -> None:
    cfg = s3_config(catalog_url, bucket, moto, flush_records=5)
    cfg = cfg.model_copy(update={"backup": BackupSettings(workers=1)})
    with Keyshred.init(tmp_path / "data", cfg, embeddings=bag_of_words) as ks:
        for who in ("lea", "max"):
            for i in range(6):
                ks.memories.put(who, NS, f"k{i}", {"i": i})
        deletions = iter(range(1, 6))
        # Segments are copied in subject_ref order, one at a time (workers=1).
        second = max(("lea", "max"), key=ks.subject_ref)

        def meanwhile(phase: str, done: int, total: int) -> None:
            # After the first segment is copied, a deletion rewrites the other
            # partition: the segment the snapshot listed is gone before its copy.
            if phase == "copy" and done and next(deletions, None) == 1:
                ks.memories.delete(second, NS, "k5")

        gen = ks.backup.create(progress=meanwhile)
        report = ks.backup.restore(gen.generation, tmp_path / "restored")
        assert report.memories_verified == 11  # max's deletion is in the new snapshot
        n = [0]

        def always(phase: str, done: int, total: int) -> None:
            if phase == "copy" and done:
                n[0] += 1
                ks.memories.put(second, NS, f"new{n[0]}", {"n": n[0]})
                ks.memories.delete(second, NS, f"new{n[0]}")

        with pytest.raises(KeyshredError, match="kept being deleted"):
            ks.backup.create(progress=always)


def test_the_retention_scan_reads_the_listed_segments_that_hold_something_expired(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i in range(6):  # one compacted segment of five, one hot row
        ks.memories.put("nora", NS, f"k{i}", {"i": i})
    ref = ks.subject_ref("nora")
    later = datetime.now(UTC) + timedelta(days=365 * 30)
    found = ks._memories.expired_in_segments(later)
    assert list(found) == [ref] and len(found[ref]) == 5  # from the bucket's segment
    assert ks.retention.expired(later)[ref] == sorted(ks._catalog.asset_ids(ref, "memory"))

    def opened(self: ObjectStore, key: str, **kwargs: Any) -> Any:
        raise AssertionError("a segment with nothing expired was read")

    # Today nothing has expired: the catalog says so, and no segment is opened.
    monkeypatch.setattr(ObjectStore, "open_parquet", opened)
    assert ks._memories.expired_in_segments(datetime.now(UTC)) == {}


def test_a_reads_first_load_does_not_list_the_bucket_and_a_compaction_removes_leftovers(
    catalog_url: str, bucket: str, moto: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An object no segment row names (a compaction killed after writing it) costs a
    # LIST to find: a read's first load of the subject does not look for it; the
    # subject's next compaction (every delete is one) lists and removes it.
    cfg = s3_config(catalog_url, bucket, moto, flush_records=3)
    with Keyshred.init(tmp_path / "data", cfg, embeddings=bag_of_words) as ks:
        for i in range(4):
            ks.memories.put("kim", NS, f"k{i}", {"i": i})
        ref = ks.subject_ref("kim")
    prefix = f"parts/subject={ref}/"
    stray = f"{prefix}seg-default-killed.parquet"
    s3_client(moto).put_object(Bucket=bucket, Key=stray, Body=b"left by a killed compaction")
    listed: list[str] = []
    real = ObjectStore.list_keys

    def spy(self: ObjectStore, where: str) -> list[str]:
        listed.append(where)
        return real(self, where)

    monkeypatch.setattr(ObjectStore, "list_keys", spy)
    with Keyshred.open(tmp_path / "data", cfg, embeddings=bag_of_words) as ks:
        assert ks.memories.get("kim", NS, "k1").value == {"i": 1}  # type: ignore[union-attr]
        assert listed == [] and stray in _current(moto, bucket, prefix)
        assert ks.memories.delete("kim", NS, "k0")
        assert listed and stray not in _current(moto, bucket, prefix)
        assert not [k for k, _ in versions(moto, bucket, prefix) if k == stray]
        assert ks.memories.count("kim") == 3
