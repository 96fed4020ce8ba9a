"""Issue #21's shared profile across worker processes: each worker has its own data
folder (as separate machines have) and shares the PostgreSQL catalog and key store,
a KEK (a shared local key file, or OpenBao's Transit) and the S3 partition store
(moto's server over HTTP, a versioned bucket).

Worker 1 writes, worker 2 reads and searches; two workers write 500 memories each
to one new subject at once and a third reads all 1,000; a worker killed inside a
compaction loses nothing; an erasure from a third worker leaves no object version of
the subject in the bucket and no row in the catalog, and the others refuse it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
import sqlalchemy as sa

from keyshred import Config, Keyshred
from tests import zygote
from tests.conftest import pg_schema, pg_url
from tests.servers import Server, new_bucket
from tests.storage.test_vectors import bag_of_words

WORKER = Path(__file__).resolve().parent / "shared_worker.py"
pytest.importorskip("psycopg")


@dataclass
class Shared:
    config: str  # Config as JSON, for the workers' command lines
    catalog_url: str
    bucket: str
    moto: Server
    tmp: Path

    def run(self, worker: int, *args: str, check_kill: bool = False) -> list[str]:
        """Run one command in worker ``worker``'s own folder; its output lines."""
        proc = zygote.run(
            [sys.executable, str(WORKER), str(self.tmp / f"w{worker}"), self.config, *args],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        if check_kill:
            assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-3000:]
        else:
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        return proc.stdout.splitlines()

    def start(self, worker: int, *args: str) -> zygote.Popen:
        return zygote.Popen(
            [sys.executable, str(WORKER), str(self.tmp / f"w{worker}"), self.config, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def read(self, worker: int, *args: str) -> Any:
        (line,) = [x for x in self.run(worker, *args) if x.startswith("READ ")]
        return json.loads(line.removeprefix("READ "))

    def versions(self, prefix: str) -> list[str]:
        s3 = boto3.client("s3", endpoint_url=self.moto.url, region_name="us-east-1")
        out = []
        for page in s3.get_paginator("list_object_versions").paginate(
            Bucket=self.bucket, Prefix=prefix
        ):
            out += [v["Key"] for v in [*page.get("Versions", []), *page.get("DeleteMarkers", [])]]
        return out

    def catalog_rows(self, ref: str) -> dict[str, int]:
        engine = sa.create_engine(self.catalog_url)
        try:
            with engine.connect() as conn:
                return {
                    table: int(
                        conn.execute(
                            sa.text(f"SELECT count(*) FROM {table} WHERE subject_ref = :r"),
                            {"r": ref},
                        ).scalar()
                        or 0
                    )
                    for table in (
                        "ks_assets",
                        "ks_mem_partitions",
                        "ks_mem_hot",
                        "ks_mem_segments",
                        "ks_mem_vectors",
                    )
                }
        finally:
            engine.dispose()


@pytest.fixture(params=["local-kek", "openbao"])
def shared(
    request: pytest.FixtureRequest,
    moto: Server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Shared]:
    with pg_schema() as schema:
        options = f"options=-csearch_path%3D{schema}"
        bucket = new_bucket(moto)
        catalog_url = pg_url(schema)
        config = Config.model_validate(
            {
                "profile": "distributed",
                "storage": {
                    "catalog_url": catalog_url,
                    "uri": f"s3://{bucket}/parts",
                    "flush_records": 50,
                },
                "keyring": {"store_url": f"postgresql://postgres@127.0.0.1:5432/test?{options}"},
                "kek": _kek(request, tmp_path, monkeypatch),
                "vectors": {"uri": f"s3://{bucket}/vectors"},
                "s3": {"endpoint_url": moto.url, "region": "us-east-1"},
            }
        )
        yield Shared(config.model_dump_json(), catalog_url, bucket, moto, tmp_path)


def _kek(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> dict[str, Any]:
    """The workers' one KEK: a key file they all read, or OpenBao's Transit (its
    token in the environment the workers inherit; a transit key per test)."""
    if request.param == "local-kek":
        return {
            "local_path": str(tmp_path / "shared-kek.json"),
            "archive_local_path": str(tmp_path / "shared-archive-kek.json"),
        }
    server: Server = request.getfixturevalue("openbao")
    monkeypatch.setenv("VAULT_TOKEN", server.token)
    return {
        "provider": "vault",
        "vault": {"url": server.url, "key": f"ks-shared-{uuid.uuid4().hex[:10]}"},
    }


def _only_ref(shared: Shared) -> str:
    """The subject_ref of the one partition in the catalog (as the workers compute
    it: one ref key in the shared key store)."""
    engine = sa.create_engine(shared.catalog_url)
    try:
        with engine.connect() as conn:
            (ref,) = [
                r[0] for r in conn.execute(sa.text("SELECT subject_ref FROM ks_mem_partitions"))
            ]
    finally:
        engine.dispose()
    return str(ref)


def test_one_worker_writes_another_reads_and_searches(shared: Shared) -> None:
    acked = [x for x in shared.run(1, "write", "alice", "0", "120") if x.startswith("ACK")]
    assert len(acked) == 120
    got = shared.read(2, "read", "alice", "120")
    assert got["count"] == 120
    assert got["got"] == {str(i): i for i in range(120)}
    hits = shared.read(2, "search", "alice", "note 40 about kayaks")
    assert "k40" in hits


def test_two_workers_write_one_new_subject_at_once_and_a_third_reads_all(
    shared: Shared,
) -> None:
    procs = [
        shared.start(1, "write", "bob", "0", "500"),
        shared.start(2, "write", "bob", "500", "500"),
    ]
    outs = [p.communicate(timeout=1800) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-2000:] + err[-3000:]
    acked = {int(x.split()[1]) for out, _ in outs for x in out.splitlines() if x.startswith("ACK")}
    assert acked == set(range(1000))
    got = shared.read(3, "read", "bob", "1000")
    assert got["count"] == 1000
    assert got["got"] == {str(i): i for i in range(1000)}


@pytest.mark.parametrize("point", ["flush.after_segment", "flush.after_manifest"])
def test_sigkill_of_a_compacting_worker_loses_nothing(shared: Shared, point: str) -> None:
    shared.run(1, "write", "carol", "0", "30")
    out = shared.run(2, "compact-kill", "carol", point, check_kill=True)
    acked = sorted(int(x.split()[1]) for x in out if x.startswith("ACK"))
    assert acked == list(range(1000, 1010))
    got = shared.read(3, "read", "carol", "30")
    assert got["count"] == 40
    assert got["got"] == {str(i): i for i in range(30)}
    late = shared.read(3, "read", "carol", "1010")["got"]
    assert all(late[str(i)] == i for i in range(1000, 1010))
    # The next writer's compaction leaves exactly the objects the catalog names.
    shared.run(1, "write", "carol", "30", "60")
    ref = _only_ref(shared)
    engine = sa.create_engine(shared.catalog_url)
    try:
        with engine.connect() as conn:
            listed = {
                r[0]
                for r in conn.execute(
                    sa.text("SELECT name FROM ks_mem_segments WHERE subject_ref = :r"), {"r": ref}
                )
            }
    finally:
        engine.dispose()
    s3 = boto3.client("s3", endpoint_url=shared.moto.url, region_name="us-east-1")
    current = {
        o["Key"].rsplit("/", 1)[-1]
        for o in s3.list_objects_v2(Bucket=shared.bucket, Prefix=f"parts/subject={ref}/").get(
            "Contents", []
        )
        if not o["Key"].endswith("/")
    }
    assert current == listed


def test_an_erasure_from_a_third_worker_leaves_nothing_in_the_bucket_or_the_catalog(
    shared: Shared,
) -> None:
    shared.run(1, "write", "dana", "0", "60")
    # More than a compaction keeps in the catalog (32): erik has segments too.
    shared.run(2, "write", "erik", "0", "40")
    assert shared.read(2, "read", "dana", "60")["count"] == 60
    engine = sa.create_engine(shared.catalog_url)
    try:
        with engine.connect() as conn:
            refs = {
                r[0] for r in conn.execute(sa.text("SELECT subject_ref FROM ks_mem_partitions"))
            }
    finally:
        engine.dispose()
    assert len(refs) == 2
    before = {ref: shared.versions(f"parts/subject={ref}/") for ref in refs}
    assert all(before.values())
    result = shared.read(3, "erase", "dana")
    assert result["state"] == "completed", result["error"]
    gone = [ref for ref in refs if not shared.versions(f"parts/subject={ref}/")]
    assert len(gone) == 1
    (dana,) = gone
    assert shared.versions(f"vectors/{dana}.lance/") == []
    assert shared.catalog_rows(dana) == dict.fromkeys(
        ("ks_assets", "ks_mem_partitions", "ks_mem_hot", "ks_mem_segments", "ks_mem_vectors"), 0
    )
    for worker in (1, 2):
        assert shared.read(worker, "refuses", "dana") == "refused"
    (erik,) = refs - {dana}
    assert shared.versions(f"parts/subject={erik}/")
    assert shared.read(1, "read", "erik", "5")["got"] == {str(i): i for i in range(5)}


def test_long_lived_workers_read_each_others_writes_at_once(shared: Shared) -> None:
    """Two open workers (two folders, one process: their subject locks are separate
    PostgreSQL sessions): every acknowledged write, deletion and vector of one is
    what the other reads and searches next, without reopening anything."""
    config = Config.model_validate_json(shared.config)
    one = Keyshred.init(shared.tmp / "a", config, embeddings=bag_of_words)
    two = Keyshred.init(shared.tmp / "b", config, embeddings=bag_of_words)
    try:
        ns = ("notes",)
        one.memories.put("fay", ns, "k0", {"text": "kayak on the river"}, index=True)
        assert [m.key for m in two.memories.search("fay", query="kayak river", limit=1)] == ["k0"]
        one.memories.put("fay", ns, "k1", {"text": "mountain climbing trip"}, index=True)
        got = two.memories.get("fay", ns, "k1")
        assert got is not None and got.value == {"text": "mountain climbing trip"}
        embedder = two.memories.embedder
        embedded: list[int] = []
        real = embedder.embed
        embedder.embed = lambda texts: (embedded.append(len(texts)), real(texts))[1]  # type: ignore[method-assign]
        hits = two.memories.search("fay", query="mountain climbing", limit=1)
        assert [m.key for m in hits] == ["k1"]
        # Its vector was read from the dataset worker one wrote, not re-embedded as
        # "missing" because of a stale cache.
        assert embedded == []
        assert two.memories.delete("fay", ns, "k0")
        assert one.memories.get("fay", ns, "k0") is None
        assert "k0" not in [m.key for m in one.memories.search("fay", query="kayak", limit=5)]
        two.memories.put("fay", ns, "k2", {"text": "a third note"})
        assert one.memories.count("fay") == 2
    finally:
        two.close()
        one.close()


def test_a_backup_from_one_worker_restores_every_subject(shared: Shared) -> None:
    """Worker 1's and worker 3's subjects, compacted and not: a backup taken by
    worker 2 holds them all (the bucket's segments, the catalog's hot rows)."""
    shared.run(1, "write", "ivan", "0", "70")  # compacted at 50, 20 hot rows
    shared.run(3, "write", "jill", "0", "7")  # hot rows only
    got = shared.read(
        2,
        "backup-restore",
        str(shared.tmp / "backups"),
        str(shared.tmp / "restored"),
        "ivan:70",
        "jill:7",
    )
    assert got == {"subjects": 2, "counts": {"ivan": 70, "jill": 7}}
