"""Backups against the real servers: S3 (a versioned bucket on moto's server, with
multipart uploads) and the KEK-epoch schedule on OpenBao Transit and AWS KMS."""

from __future__ import annotations

import os
import shutil
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from keyshred import Keyshred
from keyshred.backup import S3Target
from keyshred.config import AwsSettings, BackupSettings, Config, KekSettings, VaultSettings
from keyshred.errors import KekEpochDestroyed, SubjectSuppressed
from tests.servers import Server, new_bucket
from tests.storage.conftest import make_config

NS = ("notes",)
pytestmark = pytest.mark.aws


def _config(kek: KekSettings, **backup: Any) -> Config:
    return make_config().model_copy(update={"kek": kek, "backup": BackupSettings(**backup)})


def _aws(server: Server) -> KekSettings:
    return KekSettings(
        provider="aws",
        aws=AwsSettings(
            endpoint_url=server.url,
            region="us-east-1",
            alias_prefix=f"alias/backup-{uuid.uuid4().hex[:8]}",
        ),
    )


def test_s3_versioned_bucket_multipart_erase_restore(moto: Server, tmp_path: Path) -> None:
    bucket = new_bucket(moto)
    cfg = _config(
        _aws(moto),
        target=f"s3://{bucket}/prod/backups",
        s3_endpoint_url=moto.url,
        s3_region="us-east-1",
        multipart_mb=5,
    )
    ks = Keyshred.init(tmp_path / "data", cfg)
    try:
        big = [os.urandom(400_000).hex() for _ in range(16)]  # ~12 MiB of incompressible text
        for i, blob in enumerate(big):
            ks.memories.put("kim", NS, f"b{i}", blob, index=False)
        ks.memories.put("lou", NS, "x", {"text": "lou"}, index=False)
        ks.memories.flush()
        gen = ks.backup.create()
        target = ks.backup.target()
        assert isinstance(target, S3Target)
        kim = ks.subject_ref("kim")
        sizes = [s.size for s in ks.backup.manifest(gen.generation).segments]
        assert max(sizes) > 5 << 20  # went through a multipart upload
        assert target.versions(f"objects/subject={kim}") > 0
        # Overwrite an object to leave an older version behind, as a versioned bucket does.
        seg = next(s for s in ks.backup.manifest(gen.generation).segments if s.subject_ref == kim)
        target.put_bytes(seg.object, target.get_bytes(seg.object))
        assert target.versions(seg.object) == 2

        req = ks.erase("kim", requested_by="dpo", reason="art17")
        assert req.state == "completed", req.error
        receipt = ks.erasure.receipt(req.request_id)
        assert receipt is not None
        assert target.versions(f"objects/subject={kim}") == 0  # every version gone
        kims = [s for s in ks.backup.manifest(gen.generation).segments if s.subject_ref == kim]
        assert receipt.backups.objects_deleted == len({s.object for s in kims}) + 1  # + old version
        # KMS keys are deleted after their pending window: the date includes it.
        assert receipt.backups.backup_final_date == receipt.backups.epoch_destroyed_by + timedelta(
            days=7
        )

        report = ks.backup.restore(gen.generation, tmp_path / "restored")
        assert report.skipped_erased > 0 and len(report.replayed) == 1
        with Keyshred.open(tmp_path / "restored") as r:
            assert r.memories.get("lou", NS, "x").value == {"text": "lou"}  # type: ignore[union-attr]
            with pytest.raises(SubjectSuppressed):
                r.memories.get("kim", NS, "b0")
        again = ks.backup.create()
        assert again.objects_uploaded <= 2  # lou's files are already there
        assert [g.generation for g in ks.backup.generations()] == [
            gen.generation,
            again.generation,
        ]
        assert ks.backup.prune(now=again.created_at + timedelta(days=8)) == [
            gen.generation,
            again.generation,
        ]
        assert target.keys("") == [k for k in target.keys("") if k.startswith("tombstones/")]
    finally:
        ks.close()


@pytest.mark.parametrize("provider", ["vault", "aws"])
def test_epoch_schedule_on_real_kms(
    provider: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the date the receipt names, the scheduled maintenance has destroyed the
    epoch in the real KMS and the generation can never be restored."""
    if provider == "vault":
        server: Server = request.getfixturevalue("openbao")
        monkeypatch.setenv("VAULT_TOKEN", server.token)
        kek = KekSettings(
            provider="vault",
            vault=VaultSettings(url=server.url, key=f"kek-{uuid.uuid4().hex[:8]}"),
        )
        window = timedelta(0)
    else:
        kek = _aws(request.getfixturevalue("moto"))
        window = timedelta(days=7)
    ks = Keyshred.init(tmp_path / "data", _config(kek))
    try:
        ks.memories.put("max", NS, "a", {"text": "max"}, index=False)
        ks.memories.put("ned", NS, "a", {"text": "ned"}, index=False)
        gen = ks.backup.create(retention_class="monthly")
        assert gen.kek_lineage == "archive"
        req = ks.erase("max", requested_by="dpo", reason="art17")
        receipt = ks.erasure.receipt(req.request_id)
        assert receipt is not None and receipt.backups.backup_final_date is not None
        # The archive schedule: the only generation's epoch goes when it expires.
        destroy_at = gen.expires_at
        assert receipt.backups.backup_final_date == destroy_at + window
        assert receipt.live_residue_until is not None

        ks.backup.restore(gen.generation, tmp_path / "early")  # restorable (with replay)
        offsite = tmp_path / "offsite"  # a copy that outlives pruning
        shutil.copytree(ks.backup.target().url, offsite)
        early = ks.backup.maintain(now=destroy_at - timedelta(hours=1))
        # The live lineage rotated and destroyed its old epochs; the backup is intact.
        assert early.rotated_to is not None and early.destroyed
        assert gen.kek_epoch not in [d.epoch for d in early.archive_destroyed]
        assert early.pruned == []
        ks.backup.restore(gen.generation, tmp_path / "copy", target=str(offsite))
        report = ks.backup.maintain(now=destroy_at)
        assert gen.kek_epoch in [d.epoch for d in report.archive_destroyed]
        assert report.pruned == [gen.generation]
        with pytest.raises(KekEpochDestroyed):
            ks.backup.restore(gen.generation, tmp_path / "late", target=str(offsite))
        assert ks.memories.get("ned", NS, "a").value == {"text": "ned"}  # type: ignore[union-attr]
    finally:
        ks.close()
