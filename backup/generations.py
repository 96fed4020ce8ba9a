"""The generations on backup targets: where they are, how to list and read them.

``Generations`` is the base of ``BackupManager`` (``keyshred.backup.manager``): it
holds the collaborators every part of ``ks.backup`` uses (the data folder, the
configuration, the keyring, the audit log) and the targets, their manifests and
their tombstone journals. Creating (``manager``), the KEK-epoch schedule and
pruning (``maintenance``) and restoring (``restore``) build on it.
"""

from __future__ import annotations

import hashlib
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from keyshred.audit import AuditLog
from keyshred.backup import staging as restore_staging
from keyshred.backup.manifest import GENERATIONS, TOMBSTONES, Manifest, TombstoneRecord, gen_prefix
from keyshred.backup.targets import BackupTarget, LocalTarget, open_target
from keyshred.config import Config
from keyshred.errors import ConfigError, IntegrityError, NotFound
from keyshred.keyring.keyring import Keyring
from keyshred.keyring.keystore import Tombstone

__all__ = ["STAGING", "TARGETS_FILE", "Generation", "Generations", "Progress"]

Progress = Callable[[str, int, int], None]


class Ticker:
    """A running total of bytes done, reported as one phase to a ``Progress``
    callback; safe to call from the threads of a transfer pool."""

    def __init__(self, progress: Progress | None, phase: str, total: int) -> None:
        self._progress = progress
        self._phase = phase
        self._total = total
        self._done = 0
        self._lock = threading.Lock()

    def __call__(self, n: int) -> None:
        with self._lock:
            self._done += n
            if self._progress is not None:
                self._progress(self._phase, self._done, self._total)


"""``progress(phase, done, total)``: phases ``hash``, ``upload``, ``download`` (bytes)."""

STAGING = ".backup-staging"
# Every target a generation was written to, one URL a line (no personal data): a
# ``--target`` elsewhere holds retained backups as much as ``backup.target`` does.
TARGETS_FILE = "backup-targets"


@dataclass(frozen=True)
class Generation:
    """One backup generation as ``list``/``create`` report it."""

    generation: str
    created_at: datetime
    expires_at: datetime
    retention_class: str
    kek_epoch: int
    segments: int
    subjects: int
    bytes_total: int
    bytes_uploaded: int = 0
    objects_uploaded: int = 0
    objects_reused: int = 0
    kek_lineage: str = "live"

    @classmethod
    def of(cls, m: Manifest, uploaded: int = 0, objects: int = 0, reused: int = 0) -> Generation:
        return cls(
            m.generation,
            m.created_at,
            m.expires_at,
            m.retention_class,
            m.kek_epoch,
            len(m.segments),
            len(m.subjects),
            m.bytes_total,
            uploaded,
            objects,
            reused,
            m.kek_lineage,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            k: v.isoformat() if isinstance(v, datetime) else v for k, v in self.__dict__.items()
        }


def _now() -> datetime:
    return datetime.now(UTC)


def _sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _generation_id(at: datetime) -> str:
    return f"{at:%Y%m%dT%H%M%S%f}Z-{uuid.uuid4().hex[:6]}"


class Generations:
    """The targets and the generations on them (the base of ``BackupManager``)."""

    def __init__(
        self,
        path: Path,
        config: Config,
        keyring: Keyring,
        audit: AuditLog,
        *,
        clock: Callable[[], datetime] = _now,
    ) -> None:
        self._path = path
        self._config = config
        self._settings = config.backup
        self._keyring = keyring
        self._audit = audit
        self.clock = clock
        self._targets: dict[str, BackupTarget] = {}
        self._lock = threading.Lock()
        # Restores this data folder started and a kill interrupted leave a staging
        # folder (wherever they went): removed at the next open.
        restore_staging.sweep_marked(path / STAGING)
        if self._settings.default_class not in self._settings.retention:
            raise ConfigError(
                f"backup.default_class {self._settings.default_class!r} is not a retention class"
            )

    # -- targets -------------------------------------------------------------------

    @property
    def default_url(self) -> str:
        return self._settings.target or str(self._path / "backups")

    def target(self, url: str | None = None) -> BackupTarget:
        """The target at ``url`` (default: ``backup.target`` or ``<data>/backups``)."""
        url = url or self.default_url
        with self._lock:
            target = self._targets.get(url)
            if target is None:
                target = open_target(
                    url,
                    fsync=self._settings.durability == "fsync",
                    # The one [s3] section, unless the backup names its own.
                    endpoint_url=self._settings.s3_endpoint_url or self._config.s3.endpoint_url,
                    region=self._settings.s3_region or self._config.s3.region,
                    multipart_mb=self._settings.multipart_mb,
                )
                self._targets[url] = target
            return target

    def _resolve(self, target: BackupTarget | str | None) -> BackupTarget:
        return target if isinstance(target, BackupTarget) else self.target(target)

    # -- schedule ------------------------------------------------------------------

    @property
    def max_retention(self) -> timedelta:
        return timedelta(days=max(self._settings.retention.values()))

    @property
    def rotate_every(self) -> timedelta:
        """The old single-lineage period; only generations made before the archive
        lineage (sealed under a live epoch) still follow it."""
        return timedelta(days=self._settings.rotate_kek_every_days)

    @property
    def live_period(self) -> timedelta:
        return timedelta(minutes=self._config.keyring.live_rotate_minutes)

    @property
    def live_lead(self) -> timedelta:
        """The maintenance interval: a live epoch is rotated at the first run within
        this much of its end, so it is destroyed by its end date."""
        settings = self._config.keyring
        return timedelta(minutes=min(settings.maintain_every_minutes, settings.live_rotate_minutes))

    def _kms_window(self) -> timedelta:
        if self._config.kek.provider == "aws":
            return timedelta(days=self._config.kek.aws.pending_window_days)
        return timedelta(0)

    def _epoch_created(self) -> dict[int, datetime]:
        return {e.epoch: e.created_at for e in self._keyring.kek.epochs()}

    # -- listing -------------------------------------------------------------------

    def _generation_ids(self, tgt: BackupTarget) -> list[str]:
        keys = tgt.keys(GENERATIONS)
        return sorted(
            {k.split("/")[1] for k in keys if k.endswith("/manifest.json") and k.count("/") == 2}
        )

    def manifest(self, generation: str, target: BackupTarget | str | None = None) -> Manifest:
        """A generation's manifest, signature verified (``IntegrityError`` if not)."""
        tgt = self._resolve(target)
        try:
            raw = tgt.get_bytes(f"{gen_prefix(generation)}/manifest.json")
        except NotFound:
            raise NotFound(f"no backup generation {generation} at {tgt.url}") from None
        manifest = Manifest.parse(raw, generation)
        manifest.verify(self._keyring.signer().public_key, f"generation {generation}")
        return manifest

    def _latest(self, tgt: BackupTarget) -> str | None:
        ids = self._generation_ids(tgt)
        return ids[-1] if ids else None

    def generations(self, target: BackupTarget | str | None = None) -> list[Generation]:
        """Every complete generation on the target, oldest first."""
        tgt = self._resolve(target)
        return [Generation.of(self.manifest(g, tgt)) for g in self._generation_ids(tgt)]

    def _all_manifests(self) -> list[Manifest]:
        return [
            self.manifest(g, tgt)
            for tgt in self._targets_written()
            for g in self._generation_ids(tgt)
        ]

    # -- erasure -------------------------------------------------------------------

    def target_in_use(self) -> bool:
        """Whether the default target was ever written to."""
        return bool(self._targets_in_use())

    def _targets_in_use(self) -> list[BackupTarget]:
        """The default target, unless it is a folder no backup was ever written to."""
        tgt = self.target()
        if isinstance(tgt, LocalTarget) and not tgt.root.exists():
            return []
        return [tgt]

    def _targets_written(self) -> list[BackupTarget]:
        """The default target and every other one a generation was written to (a
        folder since removed holds nothing to protect)."""
        targets = [self.target(), *(self.target(url) for url in self._remembered_urls())]
        return [t for t in targets if not (isinstance(t, LocalTarget) and not t.root.exists())]

    def _remembered_urls(self) -> list[str]:
        try:
            text = (self._path / TARGETS_FILE).read_text("utf-8")
        except FileNotFoundError:
            return []
        return [line for line in text.splitlines() if line]

    def _journal(self, tgt: BackupTarget) -> list[TombstoneRecord]:
        out = []
        public = self._keyring.signer().public_key
        for key in tgt.keys(TOMBSTONES):
            if not key.endswith(".json"):
                continue
            raw = tgt.get_bytes(key)
            try:
                record = TombstoneRecord.model_validate_json(raw)
            except ValueError:
                raise IntegrityError(f"tombstone record {key} is malformed") from None
            record.verify(public, f"tombstone record {key}")
            out.append(record)
        return out

    def tombstones(self, target: BackupTarget | str | None = None) -> list[Tombstone]:
        """Every tombstone known: the live key store's and the target's journal."""
        seen: dict[str, Tombstone] = {t.tombstone_id: t for t in self._keyring.store.tombstones()}
        for record in self._journal(self._resolve(target)):
            seen.setdefault(record.tombstone_id, record.tombstone())
        return sorted(seen.values(), key=lambda t: (t.erased_at, t.tombstone_id))

    def close(self) -> None:
        with self._lock:
            for t in self._targets.values():
                t.close()
            self._targets.clear()


def _parse_generation_time(generation: str) -> datetime | None:
    try:
        return datetime.strptime(generation.split("Z-", maxsplit=1)[0], "%Y%m%dT%H%M%S%f").replace(
            tzinfo=UTC
        )
    except ValueError:
        return None
