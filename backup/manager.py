"""``ks.backup``: snapshots, restore with tombstone replay, retention and KEK epochs.

Three mechanisms together bound what a backup can yield after an erasure:

1. **Tombstone replay**: every restore lands in an isolated folder. The key ids of
   every tombstone recorded after the snapshot (from the live key store and from
   the target's tombstone journal) are deleted from the restored key store in
   memory, before the folder holds anything, so not even a killed restore leaves an
   erased subject's wrapped keys on disk; a subject erased since is not downloaded.
   Then the restore drops those subjects' partitions, assets and derived data,
   verifies, and only then renames the folder into place. A restore killed on the
   way leaves a locked staging folder that the next restore into the same parent,
   or the next open of the data folder, removes (``keyshred.backup.staging``).
2. **Expiring generations**: each generation has a retention class; ``prune``
   deletes expired ones (every S3 object version) and objects no generation needs.
3. **Archive KEK epochs**: each generation takes a new epoch of the *archive*
   lineage (the archive provider rotates and wraps a fresh random epoch key), and
   its key store copy is the snapshot with every key and secret re-wrapped from
   the live epoch key to that archive epoch key, the live epoch keys removed and the
   image vacuumed, then sealed. A generation never depends on a live epoch, which
   the live schedule destroys hourly. Providers destroy "every epoch before N"
   (Transit trims below a minimum version), so destruction is oldest-first: a
   generation's archive epoch is destroyed once it *and every earlier generation*
   have expired, i.e. at the expiry of the latest-expiring generation at or before
   it. The same rule holds for every provider (AWS KMS could destroy one key per
   epoch, but one rule keeps the dates comparable). That date (plus the KMS
   deletion window) is the receipt's ``backup_final_date``.

Generations made before the archive lineage existed were sealed under a live
epoch; the live schedule keeps the oldest such epoch until they expire.

A backup never decrypts or re-encrypts partitions: segments are copied as the
ciphertext they are. Consistency comes from the freeze lock (see
``keyshred.storage.freeze``): for one instant no partition writer runs; in it the
catalog snapshot is pinned, the partition files are hard-linked into a staging
folder and the key store is copied. Everything slow happens after.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from keyshred.backup import staging as restore_staging
from keyshred.backup.manifest import (
    GENERATIONS,
    OBJECTS,
    TOMBSTONES,
    BlobRef,
    Manifest,
    SealedRef,
    Segment,
    TombstoneRecord,
    gen_prefix,
)
from keyshred.backup.targets import BackupTarget, LocalTarget, open_target
from keyshred.config import Config, save_config
from keyshred.errors import (
    ConfigError,
    IntegrityError,
    InvalidInput,
    KekEpochDestroyed,
    KeyshredError,
    NotFound,
)
from keyshred.keyring.kek import DestroyedEpoch, WrappedKey
from keyshred.keyring.keystore import SQLiteKeyStore, Tombstone
from keyshred.receipts import BackupCoverage

if TYPE_CHECKING:
    from keyshred.facade import Keyshred

__all__ = [
    "RESTORE_POINTS",
    "BackupManager",
    "Generation",
    "MaintenanceReport",
    "Progress",
    "RestoreReport",
]

Progress = Callable[[str, int, int], None]
"""``progress(phase, done, total)``: phases ``hash``, ``upload``, ``download`` (bytes)."""

STAGING = ".backup-staging"
# Every target a generation was written to, one URL a line (no personal data): a
# ``--target`` elsewhere holds retained backups as much as ``backup.target`` does.
TARGETS_FILE = "backup-targets"
RESTORE_REPORT = "RESTORE.json"
_SKIP = {"LOCK", "FREEZE"}
_COPY_BELOW = 256 * 1024  # small files are copied; large immutable ones hard-linked
_INCOMPLETE_AFTER = timedelta(hours=6)
_TOKEN_BLOCK_MARGIN = 1024  # blocks of token numbers (1,024 each) skipped past the live mark
RESTORE_POINTS = ("keystore", "segment", "catalog", "opened", "replayed", "verified", "renamed")
"""Where a restore calls ``on_restore_step`` (fault injection kills the process there):
after the key store is written, after each segment, after the catalog, once the copy
is open, after each tombstone replayed, after verification, after the rename."""


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


@dataclass
class RestoreReport:
    """What a restore did; written as ``RESTORE.json`` into the restored folder."""

    generation: str
    path: str
    snapshot_at: datetime
    restored_at: datetime
    segments: int
    skipped_erased: int
    replayed: list[dict[str, Any]] = field(default_factory=list)
    subjects_verified: int = 0
    memories_verified: int = 0
    vectors_verified: int = 0
    keys_rewrapped: int = 0  # moved from the generation's KEK epoch to the live one

    def as_dict(self) -> dict[str, Any]:
        return {
            k: v.isoformat() if isinstance(v, datetime) else v for k, v in self.__dict__.items()
        }


@dataclass
class MaintenanceReport:
    """One maintenance run: the live lineage (``rotated_to``, ``destroyed``, when
    the current live epoch is due), the archive lineage (``archive_destroyed``) and
    the generations pruned."""

    rotated_to: int | None
    destroyed: list[DestroyedEpoch]
    pruned: list[str]
    archive_destroyed: list[DestroyedEpoch] = field(default_factory=list)
    live_epoch: int | None = None
    live_due_at: datetime | None = None
    keys_rewrapped: int = 0

    def as_dict(self) -> dict[str, Any]:
        def epochs(items: list[DestroyedEpoch]) -> list[dict[str, Any]]:
            return [{"epoch": d.epoch, "effective_at": d.effective_at.isoformat()} for d in items]

        return {
            "rotated_to": self.rotated_to,
            "destroyed": epochs(self.destroyed),
            "archive_destroyed": epochs(self.archive_destroyed),
            "live_epoch": self.live_epoch,
            "live_due_at": None if self.live_due_at is None else self.live_due_at.isoformat(),
            "keys_rewrapped": self.keys_rewrapped,
            "pruned": self.pruned,
        }


@dataclass(frozen=True)
class LiveStatus:
    """The live lineage for status and health output."""

    epoch: int
    created_at: datetime
    due_at: datetime
    overdue: bool
    residue_until: datetime  # when this epoch is destroyed by the schedule

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


class BackupManager:
    """``ks.backup``: see the module docstring."""

    def __init__(self, ks: Keyshred, *, clock: Callable[[], datetime] = _now) -> None:
        self._ks = ks
        self._settings = ks.config.backup
        self.clock = clock
        self._targets: dict[str, BackupTarget] = {}
        self._lock = threading.Lock()
        self.on_restore_step: Callable[[str], None] | None = None
        # Restores this data folder started and a kill interrupted leave a staging
        # folder (wherever they went): removed at the next open.
        restore_staging.sweep_marked(ks.path / STAGING)
        if self._settings.default_class not in self._settings.retention:
            raise ConfigError(
                f"backup.default_class {self._settings.default_class!r} is not a retention class"
            )

    # -- targets -------------------------------------------------------------------

    @property
    def default_url(self) -> str:
        return self._settings.target or str(self._ks.path / "backups")

    def target(self, url: str | None = None) -> BackupTarget:
        """The target at ``url`` (default: ``backup.target`` or ``<data>/backups``)."""
        url = url or self.default_url
        with self._lock:
            target = self._targets.get(url)
            if target is None:
                target = open_target(
                    url,
                    fsync=self._settings.durability == "fsync",
                    endpoint_url=self._settings.s3_endpoint_url,
                    region=self._settings.s3_region,
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
        return timedelta(minutes=self._ks.config.keyring.live_rotate_minutes)

    @property
    def live_lead(self) -> timedelta:
        """The maintenance interval: a live epoch is rotated at the first run within
        this much of its end, so it is destroyed by its end date."""
        settings = self._ks.config.keyring
        return timedelta(minutes=min(settings.maintain_every_minutes, settings.live_rotate_minutes))

    def _kms_window(self) -> timedelta:
        if self._ks.config.kek.provider == "aws":
            return timedelta(days=self._ks.config.kek.aws.pending_window_days)
        return timedelta(0)

    def _epoch_created(self) -> dict[int, datetime]:
        return {e.epoch: e.created_at for e in self._ks.keyring.kek.epochs()}

    def live_status(self, now: datetime | None = None) -> LiveStatus:
        """The current live epoch: when it is due to rotate, whether that is past
        (the maintenance run did not run in time), and until when a wrapped key of it
        left in database pages can still be unwrapped."""
        now = now or self.clock()
        current = self._ks.keyring.live_epoch()
        due = current.created_at + self.live_period
        return LiveStatus(
            current.epoch, current.created_at, due, now > due, due + self._kms_window()
        )

    def live_residue_until(self, at: datetime | None = None) -> datetime:
        """When the live epoch current at ``at`` (default now) is destroyed by the
        schedule: its creation plus the live period (plus the KMS deletion window)."""
        at = at or self.clock()
        records = self._ks.keyring.live.records()
        current = [r for r in records if r.created_at <= at] or records[:1]
        created = current[-1].created_at if current else at
        until = created + self.live_period
        if current:
            # A generation made before the archive lineage is sealed under a live
            # epoch, and the schedule keeps that epoch (and every later one) until
            # the generation expires: the date is then that expiry.
            epoch = current[-1].epoch
            legacy = [
                g.expires_at
                for tgt in self._targets_written()
                for g in self.generations(tgt)
                if g.kek_lineage == "live" and g.kek_epoch <= epoch and g.expires_at > at
            ]
            until = max([until, *legacy])
        return until + self._kms_window()

    def _legacy_keep_from(self, now: datetime) -> int | None:
        """The oldest live epoch an unexpired generation made before the archive
        lineage is sealed under: the live schedule keeps it (and every later one)."""
        needed = [
            g.kek_epoch
            for tgt in self._targets_written()
            for g in self.generations(tgt)
            if g.kek_lineage == "live" and g.expires_at > now
        ]
        return min(needed) if needed else None

    def rotate_if_due(self, now: datetime | None = None) -> int | None:
        """Rotate the live lineage if its current epoch is ``live_rotate_minutes``
        old (re-wrapping every key locally); otherwise finish any interrupted re-wrap."""
        now = now or self.clock()
        keyring = self._ks.keyring
        current = keyring.live_epoch()
        if now < current.created_at + self.live_period - self.live_lead:
            keyring.rewrap_to_current()
            return None
        result = keyring.rotate_kek()
        self._ks.audit.record("kek.rotated", epoch=result.new_epoch, keys=result.keys_rewrapped)
        return result.new_epoch

    def maintain_live(self, now: datetime | None = None) -> MaintenanceReport:
        """The live schedule alone: rotate when due, destroy every older live epoch
        once nothing is wrapped by it (short of what pre-archive generations need)."""
        now = now or self.clock()
        try:
            keep_from = self._legacy_keep_from(now)
        except KeyshredError as exc:
            # A generation that cannot be read may be one sealed under a live epoch:
            # rotate (harmless) but destroy nothing until it can be read again.
            keep_from = 0
            self._ks.audit.record("kek.live_destroy_deferred", error=type(exc).__name__)
        run = self._ks.keyring.maintain_live(
            self.live_period, now=now, keep_from=keep_from, lead=self.live_lead
        )
        if run.rotated_to is not None:
            self._ks.audit.record("kek.rotated", epoch=run.rotated_to, keys=run.keys_rewrapped)
        for d in run.destroyed:
            self._ks.audit.record("kek.epoch_destroyed", epoch=d.epoch)
        return MaintenanceReport(
            run.rotated_to,
            run.destroyed,
            [],
            live_epoch=run.current_epoch,
            live_due_at=run.due_at,
            keys_rewrapped=run.keys_rewrapped,
        )

    def destroy_due_epochs(self, now: datetime | None = None) -> list[DestroyedEpoch]:
        """The live lineage's destruction on schedule (see ``maintain_live``)."""
        return self.maintain_live(now).destroyed

    def generations_needing(self, before: int, *, now: datetime | None = None) -> list[Generation]:
        """Unexpired generations (on the targets in use) made before the archive
        lineage whose key store is sealed under a live KEK epoch older than
        ``before``: destroying it breaks them. Read-only."""
        now = now or self.clock()
        live = self._epoch_created()
        return [
            g
            for tgt in self._targets_written()
            for g in self.generations(tgt)
            if g.kek_lineage == "live"
            and g.kek_epoch < before
            and g.kek_epoch in live
            and g.expires_at > now
        ]

    @staticmethod
    def archive_schedule(manifests: Sequence[Manifest]) -> dict[str, datetime]:
        """Each archive generation's destruction date: the expiry of the
        latest-expiring generation at or before it (by archive epoch), because a
        provider destroys every epoch below a bound, oldest first."""
        out: dict[str, datetime] = {}
        latest: datetime | None = None
        for m in sorted(
            (m for m in manifests if m.kek_lineage == "archive"),
            key=lambda m: (m.kek_epoch, m.created_at),
        ):
            latest = m.expires_at if latest is None else max(latest, m.expires_at)
            out[m.generation] = latest
        return out

    def _all_manifests(self) -> list[Manifest]:
        return [
            self.manifest(g, tgt)
            for tgt in self._targets_written()
            for g in self._generation_ids(tgt)
        ]

    def destroy_due_archive_epochs(self, now: datetime | None = None) -> list[DestroyedEpoch]:
        """Destroy every archive epoch whose scheduled date has passed (the archive
        provider's key versions: every copy of those generations' key stores, and
        of anything restored from them and not yet re-wrapped, is useless after)."""
        now = now or self.clock()
        manifests = [m for m in self._all_manifests() if m.kek_lineage == "archive"]
        if not manifests:
            return []  # prune destroys before it deletes: nothing left to end
        schedule = self.archive_schedule(manifests)
        kept = [m.kek_epoch for m in manifests if schedule[m.generation] > now]
        provider = self._ks.keyring.archive_kek
        if provider is None:
            return []
        # With none kept, every listed generation is due, and so is every later one
        # already pruned (its date is at most theirs): a new, unused current epoch
        # lets all of them go, the newest included.
        before = min(kept) if kept else provider.rotate()
        if not any(e.epoch < before for e in provider.epochs()):
            return []
        destroyed = provider.destroy_epochs_before(before)
        for d in destroyed:
            self._ks.audit.record("kek.archive_epoch_destroyed", epoch=d.epoch)
        return destroyed

    def maintain(
        self, target: BackupTarget | str | None = None, *, now: datetime | None = None
    ) -> MaintenanceReport:
        """The scheduled job: the live lineage (rotate when due, destroy the previous
        epoch once nothing is wrapped by it), the archive lineage (destroy the epochs
        of expired generations) and pruning. Run it at least every
        ``keyring.live_rotate_minutes`` (``keyshred maintain``)."""
        now = now or self.clock()
        report = self.maintain_live(now)
        report.archive_destroyed = self.destroy_due_archive_epochs(now)
        report.pruned = self.prune(target, now=now, destroy_archive=False)
        return report

    # -- create --------------------------------------------------------------------

    def _capture(self, staging: Path) -> list[tuple[Path, str, str]]:
        """Link or copy every partition file into ``staging`` (writers are frozen).
        Returns (staged path, relative path, subject_ref)."""
        root = self._ks.path
        out: list[tuple[Path, str, str]] = []
        sources: list[tuple[Path, str]] = []
        mem = root / "memories"
        if mem.exists():
            for part in mem.iterdir():
                if part.is_dir() and part.name.startswith("subject="):
                    sources.append((part, part.name.removeprefix("subject=")))
        vec = self._vector_root()
        if vec is not None and vec.exists():
            for ds in vec.iterdir():
                if ds.is_dir() and ds.name.endswith(".lance"):
                    sources.append((ds, ds.name.removesuffix(".lance")))
        for folder, ref in sources:
            top = "memories" if folder.parent == mem else "vectors"
            for src in folder.rglob("*"):
                if src.name in _SKIP or not src.is_file():
                    continue
                rel = f"{top}/{src.relative_to(folder.parent).as_posix()}"
                dst = staging / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                try:
                    size = src.stat().st_size
                    if size < _COPY_BELOW or src.suffix == ".ksl":
                        shutil.copyfile(src, dst)  # small, or appended in place: copy
                    else:
                        try:
                            os.link(src, dst)  # immutable once written: share the inode
                        except OSError:
                            shutil.copyfile(src, dst)
                except FileNotFoundError:
                    continue  # removed by an erasure's unlocked cleanup: not data
                out.append((dst, rel, ref))
        return out

    def _vector_root(self) -> Path | None:
        uri = self._ks.config.vectors.uri
        if uri is None:
            return self._ks.path / "vectors"
        if "://" in uri:
            return None  # an object-store dataset is not ours to copy
        return Path(uri)

    def create(
        self,
        target: BackupTarget | str | None = None,
        *,
        retention_class: str | None = None,
        progress: Progress | None = None,
        now: datetime | None = None,
    ) -> Generation:
        """Take a generation: consistent, incremental, signed. See the module doc."""
        tgt = self._resolve(target)
        klass = retention_class or self._settings.default_class
        if klass not in self._settings.retention:
            raise InvalidInput(f"unknown retention class {klass!r}")
        now = now or self.clock()
        with self._creating():
            self._remember_target(tgt)
            return self._create(tgt, klass, now, progress)

    def _remember_target(self, tgt: BackupTarget) -> None:
        """Record a target other than the default before writing to it (under the
        create lock), so the epoch check finds its generations later."""
        # A relative folder is remembered absolute: later runs have another cwd.
        url = str(tgt.root.resolve()) if isinstance(tgt, LocalTarget) else tgt.url
        default = self.default_url  # compared, not opened (its extra may be missing)
        if "://" not in default:
            default = str(Path(default).resolve())
        if url == default or url in self._remembered_urls() or "\n" in url:
            return
        with (self._ks.path / TARGETS_FILE).open("a", encoding="utf-8") as f:
            f.write(url + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _remembered_urls(self) -> list[str]:
        try:
            text = (self._ks.path / TARGETS_FILE).read_text("utf-8")
        except FileNotFoundError:
            return []
        return [line for line in text.splitlines() if line]

    @contextlib.contextmanager
    def _creating(self) -> Iterator[None]:
        """One backup at a time per data folder (across processes); the holder
        removes staging folders an interrupted backup left behind (their hard links
        would otherwise keep old segments' blocks alive)."""
        root = self._ks.path / STAGING
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(root / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            for stale in root.iterdir():
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
            yield
        finally:
            os.close(fd)

    def _create(
        self, tgt: BackupTarget, klass: str, now: datetime, progress: Progress | None
    ) -> Generation:
        keyring = self._ks.keyring
        generation = _generation_id(now)
        staging = self._ks.path / STAGING / generation
        staging.mkdir(parents=True, mode=0o700)
        try:
            with contextlib.ExitStack() as stack:
                with self._ks.memories.freeze.exclusive():
                    snapshot = stack.enter_context(self._ks.catalog.snapshot())
                    files = self._capture(staging / "files")
                    keystore = keyring.store.snapshot()
                # Writers run again; the catalog export reads the pinned snapshot and
                # the key store copy moves to the generation's own archive epoch.
                copy = keyring.archive_copy(keystore, f"backup:{generation}")
                catalog_path = staging / "catalog.db"
                snapshot.export(catalog_path)
            subjects, tombstone_ids = SQLiteKeyStore.describe_snapshot(keystore)
            del keystore
            sealed, epoch = copy.sealed, copy.epoch
            archive_kek = keyring.archive_kek
            assert archive_kek is not None  # noqa: S101 - archive_copy needs it
            segments, uploaded, n_up, n_reused = self._upload(tgt, files, progress)
            prefix = gen_prefix(generation)
            catalog_sha = _sha256_file(catalog_path)
            tgt.put_file(f"{prefix}/catalog.db", catalog_path)
            tgt.put_bytes(f"{prefix}/keystore.sealed", sealed)
            previous = self._latest(tgt)
            manifest = Manifest(
                generation=generation,
                created_at=now,
                retention_class=klass,
                expires_at=now + timedelta(days=self._settings.retention[klass]),
                previous=previous,
                kek_provider=archive_kek.name,
                kek_epoch=epoch,
                kek_lineage="archive",
                keystore=SealedRef(
                    object=f"{prefix}/keystore.sealed",
                    size=len(sealed),
                    sha256=hashlib.sha256(sealed).hexdigest(),
                    wrapped=base64.b64encode(copy.wrapped.blob).decode("ascii"),
                    kek_epoch=copy.wrapped.epoch,
                ),
                catalog=BlobRef(
                    object=f"{prefix}/catalog.db",
                    size=catalog_path.stat().st_size,
                    sha256=catalog_sha,
                ),
                config=self._ks.config.model_dump(mode="json"),
                subjects=subjects,
                tombstones=tombstone_ids,
                segments=segments,
                vectors_included=self._vector_root() is not None,
                bytes_total=sum(s.size for s in segments),
            ).signed(keyring.signer())
            tgt.put_bytes(f"{prefix}/manifest.json", manifest.to_bytes())  # the commit
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self._ks.audit.record(
            "backup.created",
            generation=generation,
            segments=len(segments),
            uploaded=n_up,
            kek_epoch=epoch,
            kek_lineage="archive",
        )
        return Generation.of(manifest, uploaded, n_up, n_reused)

    def _upload(
        self,
        tgt: BackupTarget,
        files: Sequence[tuple[Path, str, str]],
        progress: Progress | None,
    ) -> tuple[list[Segment], int, int, int]:
        total = sum(p.stat().st_size for p, _, _ in files)
        done = [0, 0]
        lock = threading.Lock()

        def tick(phase: int, n: int) -> None:
            with lock:
                done[phase] += n
                if progress is not None:
                    progress("hash" if phase == 0 else "upload", done[phase], total)

        cache = self._load_hashes()
        fresh: dict[str, list[Any]] = {}

        def one(item: tuple[Path, str, str]) -> tuple[Segment, int]:
            path, rel, ref = item
            st = path.stat()
            size = st.st_size
            # A hard-linked file shares its inode with the data folder's: unchanged
            # since the last backup (same inode, size, mtime and ctime), its hash is.
            ident = [st.st_ino, size, st.st_mtime_ns, st.st_ctime_ns]
            known = cache.get(rel)
            if st.st_nlink > 1 and known is not None and known[:4] == ident:
                sha = str(known[4])
            else:
                sha = _sha256_file(path)
            if st.st_nlink > 1:
                fresh[rel] = [*ident, sha]
            seg = Segment(path=rel, subject_ref=ref, size=size, sha256=sha)
            tick(0, size)
            if tgt.exists(seg.object):
                tick(1, size)
                return seg, 0
            tgt.put_file(seg.object, path, lambda n: tick(1, n))
            return seg, size

        with ThreadPoolExecutor(self._settings.workers) as pool:
            results = list(pool.map(one, files))
        self._save_hashes(fresh)
        segments = [s for s, _ in results]
        uploaded = sum(n for _, n in results)
        n_up = sum(1 for _, n in results if n)
        # Several files can share one object (identical bytes): count objects once.
        return segments, uploaded, n_up, len(results) - n_up

    # The hash cache: relative path -> [inode, size, mtime_ns, ctime_ns, sha256] of
    # the files a backup hard-linked. Paths are pseudonymous (subject_refs).

    def _hash_cache_path(self) -> Path:
        return self._ks.path / STAGING / "hashes.json"

    def _load_hashes(self) -> dict[str, list[Any]]:
        try:
            doc = json.loads(self._hash_cache_path().read_text("utf-8"))
        except (OSError, ValueError):
            return {}
        return doc if isinstance(doc, dict) else {}

    def _save_hashes(self, hashes: dict[str, list[Any]]) -> None:
        path = self._hash_cache_path()
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(hashes), "utf-8")
        os.replace(tmp, path)

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
        manifest.verify(self._ks.keyring.signer().public_key, f"generation {generation}")
        return manifest

    def _latest(self, tgt: BackupTarget) -> str | None:
        ids = self._generation_ids(tgt)
        return ids[-1] if ids else None

    def generations(self, target: BackupTarget | str | None = None) -> list[Generation]:
        """Every complete generation on the target, oldest first."""
        tgt = self._resolve(target)
        return [Generation.of(self.manifest(g, tgt)) for g in self._generation_ids(tgt)]

    # -- prune ---------------------------------------------------------------------

    def prune(
        self,
        target: BackupTarget | str | None = None,
        *,
        now: datetime | None = None,
        destroy_archive: bool = True,
    ) -> list[str]:
        """Delete expired generations (every object version), objects no remaining
        generation needs, interrupted generations and old tombstone records; first
        destroy the archive epochs whose date has passed (unless told not to)."""
        tgt = self._resolve(target)
        now = now or self.clock()
        if destroy_archive:
            self.destroy_due_archive_epochs(now)
        keep: list[Manifest] = []
        pruned: list[str] = []
        for g in self._generation_ids(tgt):
            m = self.manifest(g, tgt)
            if m.expires_at <= now:
                tgt.delete_prefix(gen_prefix(g))
                pruned.append(g)
            else:
                keep.append(m)
        complete = {m.generation for m in keep} | set(pruned)
        for key in tgt.keys(GENERATIONS):
            g = key.split("/")[1]
            if g in complete:
                continue
            started = _parse_generation_time(g)
            if started is None or started + _INCOMPLETE_AFTER <= now:
                tgt.delete_prefix(gen_prefix(g))
        needed = {s.object for m in keep for s in m.segments}
        for key in tgt.keys(OBJECTS):
            if key not in needed:
                tgt.delete_prefix(key)
        horizon = now - max(self.rotate_every, self.live_period) - self.max_retention
        for record in self._journal(tgt):
            if record.erased_at < horizon:
                tgt.delete_prefix(f"{TOMBSTONES}/{record.tombstone_id}.json")
        for g in pruned:
            self._ks.audit.record("backup.pruned", generation=g)
        return pruned

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

    def on_erasure(self, tombstone: Tombstone, *, whole_subject: bool) -> dict[str, Any]:
        """The erasure's backup step: journal the tombstone (so restores replay it
        even from a lost key store) and, for a whole subject, delete its segment
        objects from the target with every version."""
        journaled = 0
        deleted = 0
        for tgt in self._targets_in_use():
            record = TombstoneRecord.of(tombstone).signed(self._ks.keyring.signer())
            tgt.put_bytes(f"{TOMBSTONES}/{tombstone.tombstone_id}.json", record.to_bytes())
            journaled += 1
            if whole_subject:
                deleted += tgt.delete_prefix(f"{OBJECTS}/subject={tombstone.subject_ref}")
        return {"targets": journaled, "objects_deleted": deleted, "at": self.clock().isoformat()}

    def _journal(self, tgt: BackupTarget) -> list[TombstoneRecord]:
        out = []
        public = self._ks.keyring.signer().public_key
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

    def _manifests(self) -> list[Manifest] | BackupCoverage:
        """Every manifest on the targets written to, or the receipt section saying
        why they could not be read."""
        try:
            return self._all_manifests()
        except KeyshredError as exc:
            return BackupCoverage(
                covered=False,
                backup_final_date=None,
                note=f"the backup target could not be read ({type(exc).__name__}); "
                "backup_final_date unknown",
            )

    def generation_destroy_dates(self, manifests: Sequence[Manifest]) -> dict[str, datetime]:
        """When each generation stops yielding keys by schedule (without the KMS
        window): its archive epoch's destruction (``archive_schedule``); for one made
        before the archive lineage, the expiry of the latest-expiring such generation
        sealed at or before its live epoch, plus one live period (the maintenance
        run that then destroys it)."""
        dates = self.archive_schedule(manifests)
        legacy = sorted(
            (m for m in manifests if m.kek_lineage == "live"), key=lambda m: m.kek_epoch
        )
        for m in legacy:
            last = max(o.expires_at for o in legacy if o.kek_epoch <= m.kek_epoch)
            dates[m.generation] = last + self.live_period
        return dates

    def coverage(self, subject_ref: str, erased_at: datetime, deleted: int = 0) -> BackupCoverage:
        """The receipt's backup section for a subject erased at ``erased_at``:
        ``backup_final_date`` is when the archive epoch of the newest generation that
        holds the subject's keys is destroyed by schedule (plus the KMS window)."""
        manifests = self._manifests()
        if isinstance(manifests, BackupCoverage):
            return manifests
        holding = [m for m in manifests if subject_ref in m.subjects and m.created_at <= erased_at]
        if not holding:
            return BackupCoverage(
                covered=True,
                backup_final_date=erased_at,
                note="no retained backup generation held the subject's keys",
                objects_deleted=deleted,
            )
        window = self._kms_window()
        dates = self.generation_destroy_dates(manifests)
        epoch_by = max(dates[m.generation] for m in holding)
        return BackupCoverage(
            covered=True,
            backup_final_date=epoch_by + window,
            note=(
                f"{len(holding)} retained generation(s) hold the subject's wrapped keys; "
                + (
                    f"{deleted} segment object versions were deleted from the target; "
                    if deleted
                    else ""
                )
                + "every restore replays the tombstone; by backup_final_date the archive KEK "
                "epoch of each of them is destroyed by the scheduled maintenance (oldest "
                "first: once it and every earlier generation expired), so no copy of them "
                "can yield a key" + (" (includes the KMS key deletion window)" if window else "")
            ),
            generations=[m.generation for m in holding],
            objects_deleted=deleted,
            expire_by=max(m.expires_at for m in holding),
            epoch_destroyed_by=epoch_by,
        )

    def coverage_unkeyed(self, deleted_at: datetime) -> BackupCoverage:
        """The backup section for deletions that destroy no key (retention): the
        retained generations keep those memories under live keys until they expire;
        a restore brings them back already past their retain-until, hidden from
        every read, and the next retention run deletes them again."""
        manifests = self._manifests()
        if isinstance(manifests, BackupCoverage):
            return manifests
        holding = [m for m in manifests if m.created_at <= deleted_at]
        last = max((m.expires_at for m in holding), default=deleted_at)
        return BackupCoverage(
            covered=True,
            backup_final_date=last,
            note=(
                f"no key destroyed (the scope's other memories share it): {len(holding)} "
                "retained generation(s) hold these memories until they expire; a restore "
                "brings them back past their retain-until, hidden from reads, and the next "
                "retention run deletes them again"
            ),
            generations=[m.generation for m in holding],
            expire_by=last if holding else None,
        )

    # -- restore -------------------------------------------------------------------

    def restore(
        self,
        generation: str,
        into: str | os.PathLike[str],
        *,
        target: BackupTarget | str | None = None,
        progress: Progress | None = None,
    ) -> RestoreReport:
        """Restore ``generation`` into a new folder ``into``: download and verify
        every object, replay every later tombstone, verify, then expose. A restore
        that fails leaves no folder at ``into``; one that is killed leaves a staging
        folder that holds no erased key and is removed by the next restore or open."""
        tgt = self._resolve(target)
        dest = Path(into)
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise InvalidInput(f"{dest} exists and is not empty (or not a folder)")
        manifest = self.manifest(generation, tgt)
        dest.parent.mkdir(parents=True, exist_ok=True)
        restore_staging.sweep(dest.parent)  # what killed restores left here
        claim = restore_staging.claim(dest, self._ks.path / STAGING)
        staging = claim.folder
        try:
            report = self._restore_into(manifest, tgt, staging, progress)
            report.path = str(dest)
            (staging / RESTORE_REPORT).write_text(json.dumps(report.as_dict(), indent=1))
            if dest.exists():
                dest.rmdir()
            os.rename(staging, dest)
            self._point("renamed")
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            claim.release()
        self._ks.audit.record(
            "backup.restored",
            generation=generation,
            replayed=len(report.replayed),
            subjects=report.subjects_verified,
        )
        return report

    def tombstones(self, target: BackupTarget | str | None = None) -> list[Tombstone]:
        """Every tombstone known: the live key store's and the target's journal."""
        seen: dict[str, Tombstone] = {
            t.tombstone_id: t for t in self._ks.keyring.store.tombstones()
        }
        for record in self._journal(self._resolve(target)):
            seen.setdefault(record.tombstone_id, record.tombstone())
        return sorted(seen.values(), key=lambda t: (t.erased_at, t.tombstone_id))

    def _point(self, name: str) -> None:
        if self.on_restore_step is not None:
            self.on_restore_step(name)

    def _open_keystore(self, manifest: Manifest, tgt: BackupTarget) -> bytes:
        """The generation's key store snapshot, in memory: sealed under the
        generation's epoch (gone once destroyed)."""
        keyring = self._ks.keyring
        sealed = tgt.get_bytes(manifest.keystore.object)
        if hashlib.sha256(sealed).hexdigest() != manifest.keystore.sha256:
            raise IntegrityError(
                f"the key store copy of generation {manifest.generation} is tampered"
            )
        wrapped = WrappedKey(
            manifest.keystore.kek_epoch, base64.b64decode(manifest.keystore.wrapped)
        )
        label = f"backup:{manifest.generation}"
        try:
            if manifest.kek_lineage == "archive":
                return keyring.open_archive(manifest.kek_epoch, wrapped, sealed, label)
            return keyring.open_blob(wrapped, sealed, label)
        except KekEpochDestroyed:
            raise KekEpochDestroyed(
                f"generation {manifest.generation} was sealed under {manifest.kek_lineage} "
                f"KEK epoch {manifest.kek_epoch}, which is destroyed: it can never be restored"
            ) from None

    def _restore_into(
        self, manifest: Manifest, tgt: BackupTarget, staging: Path, progress: Progress | None
    ) -> RestoreReport:
        from keyshred.facade import CATALOG_DIR, CATALOG_FILE, Keyshred

        # 1. The key store, with every tombstone recorded since the snapshot applied
        #    in memory first: the folder never holds an erased key, not for a moment.
        keystore = self._open_keystore(manifest, tgt)
        _, had = SQLiteKeyStore.describe_snapshot(keystore)
        tombstones = [t for t in self.tombstones(tgt) if t.tombstone_id not in set(had)]
        keystore = SQLiteKeyStore.apply_tombstones(keystore, tombstones)
        (staging / "keys").mkdir(mode=0o700)
        SQLiteKeyStore.from_snapshot(staging / "keys" / "keystore.db", keystore).close()
        del keystore
        self._point("keystore")

        # 2. Segments, each checked against its hash. A subject erased since the
        #    snapshot is not downloaded at all (its keys are gone already).
        erased = {t.subject_ref for t in tombstones if t.scope is None}
        total = sum(s.size for s in manifest.segments)
        done = [0]
        lock = threading.Lock()

        def tick(n: int) -> None:
            with lock:
                done[0] += n
                if progress is not None:
                    progress("download", done[0], total)

        def fetch(seg: Segment) -> int:
            dst = staging / seg.path
            if not _inside(staging, dst):
                raise IntegrityError(f"segment path {seg.path} leaves the folder")
            if seg.subject_ref in erased:
                tick(seg.size)
                return 1  # replay drops the rest of the subject
            try:
                tgt.get_file(seg.object, dst, tick)
            except NotFound:
                raise IntegrityError(f"segment {seg.path} is missing from the backup") from None
            if _sha256_file(dst) != seg.sha256:
                raise IntegrityError(f"segment {seg.path} fails its SHA-256 check (tampered)")
            self._point("segment")
            return 0

        with ThreadPoolExecutor(self._settings.workers) as pool:
            skipped = sum(pool.map(fetch, manifest.segments))

        # 3. The catalog snapshot.
        catalog_path = staging / CATALOG_DIR / CATALOG_FILE
        tgt.get_file(manifest.catalog.object, catalog_path)
        if _sha256_file(catalog_path) != manifest.catalog.sha256:
            raise IntegrityError(
                f"the catalog copy of generation {manifest.generation} is tampered"
            )
        catalog_path.chmod(0o600)
        self._point("catalog")

        # 4. Configuration: the generation's settings, the live KEK, embedded catalog.
        config = self._restored_config(manifest)
        save_config(staging, config)
        live = self._ks.memories

        def embed(texts: list[str]) -> Any:  # the live model, loaded only if a rebuild needs it
            return live.embedder.embed(texts)

        restored = Keyshred.open(staging, config, embeddings=embed)
        try:
            self._point("opened")
            restored.derived.copy_producers(self._ks.derived)
            report = RestoreReport(
                generation=manifest.generation,
                path="",
                snapshot_at=manifest.created_at,
                restored_at=self.clock(),
                segments=len(manifest.segments),
                skipped_erased=skipped,
            )
            # 5. Replay every tombstone the snapshot did not hold (their keys are
            #    gone already): partitions, catalog rows, tokens, derived data.
            for tomb in tombstones:
                _replay(restored, tomb, report)
                self._point("replayed")
            # 5b. Token numbers: skip every block the live catalog has handed out
            #     (plus a margin for a process that takes one meanwhile), so no
            #     token issued after the snapshot ever gets its id reissued.
            restored.vault.skip_blocks(self._ks.vault.block_mark() + _TOKEN_BLOCK_MARGIN)
            # 6. Verify what remains: every live subject's partition opens, every
            #    file authenticates and matches the catalog.
            self._verify_restored(restored, report)
            # 7. The copy is live data from here on: its keys move from the
            #    generation's epoch to the live one, so the scheduled (or forced)
            #    destruction of the generation's epoch leaves the copy readable.
            #    Keys of the generation's archive epoch move to the copy's live
            #    lineage, and the archive epoch key leaves the copy's key store.
            report.keys_rewrapped, _ = restored.keyring.rewrap_to_current()
            restored.keyring.drop_archive_epochs()
            # 8. An erasure that completed while this restore ran (after step 1 read
            #    the tombstones) reaches the copy too, just before it is exposed.
            self._replay_late(restored, tgt, tombstones, report)
            self._carry_suppressions(restored)
            self._point("verified")
        finally:
            restored.close()
        return report

    def _carry_suppressions(self, restored: Keyshred) -> None:
        """Suppress in the copy every subject (or scope) the live store has
        suppressed: an erasure stopped between its ``suppress`` and ``destroy_keys``
        steps (a kill, a failure) has no tombstone to replay yet, and the copy must
        decide before decrypting as the live store does."""
        import sqlalchemy as sa

        from keyshred.storage.catalog import ACTIVE, Catalog, subject_guard

        columns = (
            subject_guard.c.subject_ref,
            subject_guard.c.status,
            subject_guard.c.deletion_epoch,
            subject_guard.c.suppressed_scopes,
        )
        with self._ks.catalog.engine.connect() as conn:
            rows = conn.execute(sa.select(*columns)).all()
        for ref, status, epoch, scopes in rows:
            live = Catalog.guard_of(status, epoch, scopes)
            copy = restored.catalog.guard(ref)
            if live.status != ACTIVE and copy.status == ACTIVE:
                restored.catalog.suppress(ref)
            for scope in sorted(live.scopes - copy.scopes):
                restored.catalog.suppress(ref, scope)

    def _replay_late(
        self,
        restored: Keyshred,
        tgt: BackupTarget,
        applied: list[Tombstone],
        report: RestoreReport,
    ) -> None:
        """Replay in the copy every tombstone recorded since the restore began."""
        seen = {t.tombstone_id for t in applied}
        seen |= {t.tombstone_id for t in restored.keyring.store.tombstones()}
        late = [t for t in self.tombstones(tgt) if t.tombstone_id not in seen]
        for tomb in late:
            _replay(restored, tomb, report)

    def _restored_config(self, manifest: Manifest) -> Config:
        doc = dict(manifest.config)
        live = self._ks.config
        kek = live.kek
        if kek.provider == "local":
            keys = self._ks.path / "keys"
            local = kek.local_path or str((keys / "kek.local.json").resolve())
            archive = kek.archive_local_path or str((keys / "kek.archive.json").resolve())
            kek = kek.model_copy(update={"local_path": local, "archive_local_path": archive})
        doc["kek"] = kek.model_dump(mode="json")
        doc["storage"] = {**doc.get("storage", {}), "catalog_url": None}
        doc["vectors"] = {**doc.get("vectors", {}), "uri": None}
        doc["backup"] = {**doc.get("backup", {}), "target": None}
        # The restored copy gets its own (SQLite) key store from the sealed snapshot.
        doc["keyring"] = {**doc.get("keyring", {}), "store_url": None}
        try:
            return Config.model_validate(doc)
        except ValueError:
            raise IntegrityError("the configuration in the manifest is not valid") from None

    def _verify_restored(self, restored: Keyshred, report: RestoreReport) -> None:
        from keyshred.storage.catalog import ACTIVE

        mem = restored.path / "memories"
        refs = (
            sorted(p.name.removeprefix("subject=") for p in mem.iterdir() if p.is_dir())
            if mem.exists()
            else []
        )
        for ref in refs:
            if restored.catalog.guard(ref).status != ACTIVE:
                continue
            rows = restored.memories.rows_by_id(ref, [])  # loads: MACs, tags, catalog match
            del rows
            report.memories_verified += restored.memories.count_ref(ref)
            report.subjects_verified += 1
            if restored.vectors.exists(ref):
                report.vectors_verified += restored.vectors.count(ref)  # decrypts each

    def close(self) -> None:
        with self._lock:
            for t in self._targets.values():
                t.close()
            self._targets.clear()


def _replay(restored: Keyshred, tomb: Tombstone, report: RestoreReport) -> None:
    """Replay one tombstone in a restored copy through the erasure steps, and say so."""
    req = restored.erasure.replay(tomb)
    if req.state != "completed":
        raise IntegrityError(
            f"replaying tombstone {tomb.tombstone_id} failed ({req.state}: {req.error})"
        )
    report.replayed.append(
        {
            "tombstone_id": tomb.tombstone_id,
            "subject_ref": tomb.subject_ref,
            "scope": tomb.scope,
            "keys": len(tomb.key_ids),
            "erased_at": tomb.erased_at.isoformat(),
        }
    )


def _inside(root: Path, path: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True


def _parse_generation_time(generation: str) -> datetime | None:
    try:
        return datetime.strptime(generation.split("Z-", maxsplit=1)[0], "%Y%m%dT%H%M%S%f").replace(
            tzinfo=UTC
        )
    except ValueError:
        return None
