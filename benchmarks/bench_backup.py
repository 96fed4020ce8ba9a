"""Backup benchmark: backup and restore throughput against a plain copy of the
same bytes, to a local folder and to moto's S3 server over HTTP.

Data: a store with ``SUBJECTS`` subjects and about ``TOTAL_MB`` of memories (values
of random text, so nothing compresses), flushed into Parquet segments.

keyshred backup = freeze + catalog snapshot + hard links, SHA-256 of every file,
copy to the target (fsync'd, atomic per object), sealed key store, signed manifest.
keyshred restore = download, SHA-256 check, unseal the key store, open, replay,
verify every partition (decrypting it), rename into place.

Baselines on the same files: ``shutil.copyfile`` of each file into a folder (and the
same with fsync, which a durable backup needs), and for S3 boto3 ``upload_file`` /
``download_file`` of each file.

Run: ``.venv/bin/python benchmarks/bench_backup.py``
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import boto3

from keyshred import Keyshred
from keyshred.backup import LocalTarget, S3Target
from keyshred.storage.memories import PutItem
from tests.servers import moto_server

# moto's documented dummy credentials; every client gets a loopback endpoint_url.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

SUBJECTS = 20
TOTAL_MB = 200
VALUE_BYTES = 64 * 1024
REPEAT = 3


def build(root: Path) -> Keyshred:
    ks = Keyshred.init(root)
    per_subject = TOTAL_MB * (1 << 20) // VALUE_BYTES // SUBJECTS
    for s in range(SUBJECTS):
        items = [
            PutItem(("docs",), f"d{i}", os.urandom(VALUE_BYTES // 2).hex(), index=False)
            for i in range(per_subject)
        ]
        ks.memories.put_many(f"subject-{s}", items)
    ks.memories.flush()
    return ks


def data_files(root: Path) -> list[Path]:
    return [
        p
        for top in ("memories", "vectors")
        if (root / top).exists()
        for p in (root / top).rglob("*")
        if p.is_file() and p.name not in ("LOCK", "FREEZE")
    ]


def settle() -> None:
    """Write back what earlier steps left dirty, so no step pays for another."""
    os.sync()


def plain_copy(files: list[Path], src: Path, dst: Path, *, fsync: bool) -> float:
    settle()
    t = time.perf_counter()
    for f in files:
        out = dst / f.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, out)
        if fsync:
            fd = os.open(out, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    return time.perf_counter() - t


def mbps(n: int, seconds: float) -> float:
    return n / (1 << 20) / seconds


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, moto_server() as moto:
        base = Path(tmp)
        ks = build(base / "data")
        files = data_files(ks.path)
        size = sum(f.stat().st_size for f in files)
        print(f"{SUBJECTS} subjects, {len(files)} files, {size / (1 << 20):.1f} MiB of segments")
        rows = []

        # -- local folder (best of REPEAT, fresh destinations each time) --------
        def full_backup(name: str, fsync: bool) -> float:
            shutil.rmtree(ks.path / ".backup-staging", ignore_errors=True)  # no hash cache
            settle()
            t = time.perf_counter()
            ks.backup.create(LocalTarget(base / name, fsync=fsync))
            return time.perf_counter() - t

        t_plain = min(
            plain_copy(files, ks.path, base / f"plain{i}", fsync=False) for i in range(REPEAT)
        )
        t_plain_sync = min(
            plain_copy(files, ks.path, base / f"plain-sync{i}", fsync=True) for i in range(REPEAT)
        )
        t_backup = min(full_backup(f"backups{i}", True) for i in range(REPEAT))
        t_backup_nosync = min(full_backup(f"backups-nosync{i}", False) for i in range(REPEAT))
        target = LocalTarget(base / "backups0")
        gen = ks.backup.generations(target)[0]
        t = time.perf_counter()
        again = ks.backup.create(target)
        t_incr = time.perf_counter() - t
        ks.memories.put("subject-0", ("docs",), "changed", "x" * 1000, index=False)
        ks.memories.flush()
        t = time.perf_counter()
        one = ks.backup.create(target)
        t_one = time.perf_counter() - t
        t_plain_back = min(
            plain_copy(data_files(base / "plain0"), base / "plain0", base / f"back{i}", fsync=False)
            for i in range(REPEAT)
        )
        settle()
        t = time.perf_counter()
        ks.backup.restore(gen.generation, base / "restored", target=target)
        t_restore = time.perf_counter() - t
        rows += [
            ("local backup, fsync (default)", mbps(size, t_backup), None, mbps(size, t_plain_sync)),
            ("local backup, flush", mbps(size, t_backup_nosync), mbps(size, t_plain), None),
            ("local restore (+verify)", mbps(size, t_restore), mbps(size, t_plain_back), None),
        ]
        print(
            f"incremental backup, nothing changed: {t_incr * 1000:.0f} ms "
            f"({again.objects_uploaded} objects copied, {again.objects_reused} reused); "
            f"one subject changed: {t_one * 1000:.0f} ms ({one.bytes_uploaded} bytes copied)"
        )

        # -- S3 (moto over HTTP) -------------------------------------------------
        files = data_files(ks.path)  # one subject changed above
        size = sum(f.stat().st_size for f in files)
        s3 = boto3.client("s3", endpoint_url=moto.url, region_name="us-east-1")
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        s3.create_bucket(Bucket=bucket)
        t = time.perf_counter()
        for f in files:
            s3.upload_file(str(f), bucket, f"plain/{f.relative_to(ks.path)}")
        t_s3_plain = time.perf_counter() - t
        target = S3Target(bucket, "ks", endpoint_url=moto.url, region="us-east-1")
        t = time.perf_counter()
        gen_s3 = ks.backup.create(target)
        t_s3 = time.perf_counter() - t
        t = time.perf_counter()
        for f in files:
            out = base / "s3-plain-back" / f.relative_to(ks.path)
            out.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, f"plain/{f.relative_to(ks.path)}", str(out))
        t_s3_plain_back = time.perf_counter() - t
        t = time.perf_counter()
        ks.backup.restore(gen_s3.generation, base / "restored-s3", target=target)
        t_s3_restore = time.perf_counter() - t
        rows += [
            ("S3 backup", mbps(size, t_s3), mbps(size, t_s3_plain), None),
            ("S3 restore (+verify)", mbps(size, t_s3_restore), mbps(size, t_s3_plain_back), None),
        ]
        ks.close()

        print()
        head = ("operation", "keyshred MB/s", "plain MB/s", "ratio", "plain+fsync", "ratio")
        print(f"{head[0]:32} {head[1]:>14} {head[2]:>11} {head[3]:>6} {head[4]:>12} {head[5]:>6}")
        for name, ours, plain, plain_sync in rows:
            first = f"{plain:11.1f} {ours / plain:6.2f}" if plain is not None else " " * 18
            extra = f"{plain_sync:12.1f} {ours / plain_sync:6.2f}" if plain_sync is not None else ""
            print(f"{name:32} {ours:14.1f} {first} {extra}")
        print("\ntarget: local backup >= 0.8x plain copy")


if __name__ == "__main__":
    main()
