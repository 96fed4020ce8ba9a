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
ciphertext they are. Consistency comes from the catalog snapshot: it lists the
immutable segments (and holds the hot rows) of every subject's partition at one
instant, whichever worker on whichever machine wrote them, and a segment a
compaction retires after it stays ``storage.retired_grace_seconds``; the segments
are copied by the size and SHA-256 the catalog recorded, server side on one S3
service (``_copy_segments``). This process's freeze lock (``keyshred.storage.freeze``)
holds its own writers for the instant in which the snapshot is pinned, the vector
files are hard-linked into a staging folder and the key store is copied. Everything
slow happens after.

The manager is split by concern: ``generations`` (targets, listing, journals),
``maintenance`` (the KEK-epoch schedule, pruning, receipt coverage), ``restore``
(restore and replay) and this module (taking a generation, the erasure hook). It
receives its collaborators from the facade (``keyshred.facade``), never the facade.
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
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from pathlib import Path, PurePath
from typing import Any

from keyshred.audit import AuditLog
from keyshred.backup.generations import (
    STAGING,
    TARGETS_FILE,
    Generation,
    Progress,
    Ticker,
    _generation_id,
    _now,
    _sha256_file,
)
from keyshred.backup.maintenance import LiveStatus, Maintenance, MaintenanceReport
from keyshred.backup.manifest import (
    OBJECTS,
    TOMBSTONES,
    BlobRef,
    Manifest,
    SealedRef,
    Segment,
    TombstoneRecord,
    gen_prefix,
)
from keyshred.backup.restore import RESTORE_POINTS, OpenCopy, Restore, RestoreReport
from keyshred.backup.targets import BackupTarget, LocalTarget, S3Target
from keyshred.config import Config, redacted_dump
from keyshred.errors import IntegrityError, InvalidInput, KeyshredError, NotFound
from keyshred.keyring.keyring import Keyring
from keyshred.keyring.keystore import SQLiteKeyStore, Tombstone
from keyshred.storage import faults
from keyshred.storage.catalog import Catalog
from keyshred.storage.hot import ListedSegment
from keyshred.storage.objects import ObjectStore
from keyshred.storage.partition import partition_prefix

__all__ = [
    "RESTORE_POINTS",
    "BackupManager",
    "Generation",
    "LiveStatus",
    "MaintenanceReport",
    "Progress",
    "RestoreReport",
]

_SKIP = {"LOCK", "FREEZE"}
_ATTEMPTS = 3  # snapshots a backup takes when segments it listed vanish meanwhile


class _SegmentGone(Exception):
    """A segment the snapshot listed was deleted before the backup copied it."""


_COPY_BELOW = 256 * 1024  # small files are copied; large immutable ones hard-linked


class BackupManager(Maintenance, Restore):
    """``ks.backup``: see the module docstring.

    Collaborators (the facade wires them): the data folder, the configuration, the
    keyring, the catalog and the audit log; ``freeze`` (the memory store's writer
    freeze, held for the instant of the snapshot); ``flush_tokens`` (tokens issued
    before a backup belong in it); ``import_legacy`` (partitions in the layout of a
    release before issue #21, which the catalog does not list until imported);
    ``open_copy`` (opens a restored folder, see ``keyshred.backup.restore``) and
    ``catalog_file`` (where a data folder keeps its embedded catalog, relative to the
    folder)."""

    def __init__(
        self,
        path: Path,
        config: Config,
        keyring: Keyring,
        catalog: Catalog,
        audit: AuditLog,
        *,
        freeze: Callable[[], AbstractContextManager[object]],
        flush_tokens: Callable[[], object],
        open_copy: OpenCopy,
        catalog_file: PurePath,
        partitions: ObjectStore | None = None,
        import_legacy: Callable[[], object] = lambda: None,
        clock: Callable[[], datetime] = _now,
    ) -> None:
        super().__init__(path, config, keyring, audit, clock=clock)
        self._catalog = catalog
        self._freeze = freeze
        self._flush_tokens = flush_tokens
        self._import_legacy = import_legacy
        self._open_copy = open_copy
        self._catalog_file = catalog_file
        # Where memory segments live (a folder or an S3 prefix): a backup copies
        # the ones its catalog snapshot lists from there.
        self._objects = partitions or ObjectStore.folder(path / "memories")
        self.on_restore_step = None

    # -- create --------------------------------------------------------------------

    def _capture(self, staging: Path) -> list[tuple[Path, str, str]]:
        """Link or copy every file of a legacy vector dataset (the layout before
        revision 0013, not yet imported) into ``staging`` (writers are frozen).
        Returns (staged path, relative path, subject_ref). Vectors are otherwise
        rows of the catalog and travel in its snapshot, like memory hot rows; memory
        segments are not here either: the catalog snapshot lists them
        (``_copy_segments``)."""
        out: list[tuple[Path, str, str]] = []
        vec = self._vector_root()
        if vec is None or not vec.exists():
            return out
        for ds in vec.iterdir():
            if not (ds.is_dir() and ds.name.endswith(".lance")):
                continue
            ref = ds.name.removesuffix(".lance")
            for src in ds.rglob("*"):
                if src.name in _SKIP or not src.is_file():
                    continue
                rel = f"vectors/{src.relative_to(vec).as_posix()}"
                dst = staging / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                try:
                    size = src.stat().st_size
                    if size < _COPY_BELOW:
                        shutil.copyfile(src, dst)  # small: copy
                    else:
                        try:
                            os.link(src, dst)  # immutable once written: share the inode
                        except OSError:
                            shutil.copyfile(src, dst)
                except FileNotFoundError:
                    continue  # removed by an erasure's unlocked cleanup: not data
                out.append((dst, rel, ref))
        return out

    def _copy_segments(
        self,
        tgt: BackupTarget,
        listed: Sequence[ListedSegment],
        staging: Path,
        progress: Progress | None,
    ) -> tuple[list[Segment], int, int]:
        """Copy the memory segments a catalog snapshot lists into the target, as
        the ciphertext objects they are, by the size and SHA-256 the catalog
        recorded: object to object (server side when the partition store and the
        target are the same S3 service), an object the target holds already
        skipped. Returns (segments, bytes copied, objects copied). A listed
        segment that is gone (retired longer ago than the grace period while this
        ran) raises ``_SegmentGone``: the caller takes a new snapshot."""
        store = self._objects
        tick = Ticker(progress, "copy", sum(item.segment.size or 0 for item in listed))

        def one(item: ListedSegment) -> tuple[Segment, int]:
            key = f"{partition_prefix(item.subject_ref)}/{item.segment.name}"
            size, sha = item.segment.size, item.segment.sha256
            fetched: Path | None = None
            try:
                if size is None or sha is None or (not store.local and not self._same_s3(tgt)):
                    # Written before revision 0005 (no digest in the catalog), or to
                    # be uploaded from here: a local copy, hashed.
                    fetched = staging / key
                    fetched.parent.mkdir(parents=True, exist_ok=True)
                    with store.open_stream(key) as src, fetched.open("wb") as f:
                        while chunk := src.read(1 << 20):
                            f.write(chunk)
                    size, sha = fetched.stat().st_size, _sha256_file(fetched)
                seg = Segment(
                    path=f"memories/{key}", subject_ref=item.subject_ref, size=size, sha256=sha
                )
                if tgt.exists(seg.object):
                    tick(size)
                    return seg, 0
                # An object enters the target under its content address once, and
                # every later generation reuses it: check it is the object the
                # catalog recorded before it goes in (a damaged or replaced segment
                # is refused here, not found at a restore).
                where = store.s3_object(key)
                recorded = (item.segment.size, item.segment.sha256)
                if fetched is not None:
                    ok = recorded[1] is None or (size, sha) == recorded
                elif where is None:  # a folder: hashed as it is read
                    local = Path(store.path(key))
                    ok = local.stat().st_size == size and _sha256_file(local) == sha
                else:  # a server-side copy: the size, which S3 states without a read
                    ok = store.size(key) == size
                if not ok:
                    raise IntegrityError(
                        f"segment {item.segment.name} of partition {item.subject_ref} is not "
                        "the object the catalog recorded (damaged or replaced): not backed up"
                    )
                if fetched is None and where is not None and self._same_s3(tgt):
                    assert isinstance(tgt, S3Target)  # noqa: S101 - _same_s3 says so
                    tgt.copy_from(where[0], where[1], seg.object)
                else:
                    tgt.put_file(seg.object, fetched or Path(store.path(key)))
                faults.reached("backup.after_first_object")
                tick(size)
                return seg, size
            except (FileNotFoundError, NotFound):
                raise _SegmentGone() from None
            finally:
                if fetched is not None:
                    fetched.unlink(missing_ok=True)

        with ThreadPoolExecutor(self._settings.workers) as pool:
            results = list(pool.map(one, listed))
        return [s for s, _ in results], sum(n for _, n in results), sum(1 for _, n in results if n)

    def _same_s3(self, tgt: BackupTarget) -> bool:
        """Whether ``tgt`` is on the S3 service the partitions are on."""
        store = self._objects
        return (
            isinstance(tgt, S3Target)
            and store.s3_object("") is not None
            and tgt.endpoint_url == store.endpoint_url
        )

    def _vector_root(self) -> Path | None:
        uri = self._config.vectors.uri
        if uri is None:
            return self._path / "vectors"
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
            for _ in range(_ATTEMPTS - 1):
                try:
                    return self._create(tgt, klass, now, progress)
                except _SegmentGone:
                    continue  # a compaction's grace ran out mid-copy: a new snapshot
            try:
                return self._create(tgt, klass, now, progress)
            except _SegmentGone:
                raise KeyshredError(
                    f"memory segments kept being deleted while the backup copied them "
                    f"({_ATTEMPTS} attempts): storage.retired_grace_seconds is shorter "
                    "than a backup's copy"
                ) from None

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
        with (self._path / TARGETS_FILE).open("a", encoding="utf-8") as f:
            f.write(url + "\n")
            f.flush()
            os.fsync(f.fileno())

    @contextlib.contextmanager
    def _creating(self) -> Iterator[None]:
        """One backup at a time per data folder (across processes); the holder
        removes staging folders an interrupted backup left behind (their hard links
        would otherwise keep old segments' blocks alive)."""
        root = self._path / STAGING
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
        keyring = self._keyring
        generation = _generation_id(now)
        staging = self._path / STAGING / generation
        staging.mkdir(parents=True, mode=0o700)
        # Tokens issued before the backup belong in it, group commit or not.
        self._flush_tokens()
        # A backup copies the segments the catalog lists: partitions a release before
        # issue #21 left in the folder (imported on first use) are imported first.
        self._import_legacy()
        try:
            with contextlib.ExitStack() as stack:
                with self._freeze():
                    snapshot = stack.enter_context(self._catalog.snapshot())
                    # The partitions at the snapshot's instant, in every process on
                    # every machine: the catalog's list (segments are immutable).
                    listed = snapshot.live_segments()
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
            copied, copied_bytes, n_copied = self._copy_segments(
                tgt, listed, staging / "segments", progress
            )
            n_reused += len(copied) - n_copied
            segments, uploaded, n_up = segments + copied, uploaded + copied_bytes, n_up + n_copied
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
                config=redacted_dump(self._config),
                subjects=subjects,
                tombstones=tombstone_ids,
                segments=segments,
                vectors_included=self._vector_root() is not None,
                bytes_total=sum(s.size for s in segments),
            ).signed(keyring.signer())
            faults.reached("backup.before_manifest")
            tgt.put_bytes(f"{prefix}/manifest.json", manifest.to_bytes())  # the commit
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self._audit.record(
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
        return self._path / STAGING / "hashes.json"

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

    def on_erasure(self, tombstone: Tombstone, *, whole_subject: bool) -> dict[str, Any]:
        """The erasure's backup step: journal the tombstone (so restores replay it
        even from a lost key store) and, for a whole subject, delete its segment
        objects from the target with every version."""
        journaled = 0
        deleted = 0
        for tgt in self._targets_in_use():
            record = TombstoneRecord.of(tombstone).signed(self._keyring.signer())
            tgt.put_bytes(f"{TOMBSTONES}/{tombstone.tombstone_id}.json", record.to_bytes())
            journaled += 1
            if whole_subject:
                deleted += tgt.delete_prefix(f"{OBJECTS}/subject={tombstone.subject_ref}")
        return {"targets": journaled, "objects_deleted": deleted, "at": self.clock().isoformat()}
