"""Restore with tombstone replay: a generation comes back only without what was erased.

Every restore lands in an isolated folder. The key ids of every tombstone recorded
after the snapshot (from the live key store and from the target's tombstone journal)
are deleted from the restored key store in memory, before the folder holds anything,
so not even a killed restore leaves an erased subject's wrapped keys on disk; a
subject erased since is not downloaded. Then the copy is opened (``open_copy``, a
factory the facade injects), the erasure steps replay each tombstone in it, what
remains is verified, and only then is the folder renamed into place. A restore
killed on the way leaves a locked staging folder that the next restore into the same
parent, or the next open of the data folder, removes (``keyshred.backup.staging``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path, PurePath
from typing import Any, Protocol

from keyshred.backup import staging as restore_staging
from keyshred.backup.generations import STAGING, Generations, Progress, Ticker, _sha256_file
from keyshred.backup.manifest import Manifest, Segment
from keyshred.backup.targets import BackupTarget
from keyshred.config import Config, save_config
from keyshred.errors import IntegrityError, InvalidInput, KekEpochDestroyed, NotFound
from keyshred.keyring.kek import WrappedKey
from keyshred.keyring.keyring import Keyring
from keyshred.keyring.keystore import SQLiteKeyStore, Tombstone
from keyshred.storage.catalog import Catalog
from keyshred.vault.store import block_mark as token_block_mark
from keyshred.vault.store import skip_blocks as skip_token_blocks

__all__ = ["RESTORE_POINTS", "OpenCopy", "Restore", "RestoreReport", "RestoredCopy"]

RESTORE_REPORT = "RESTORE.json"
_TOKEN_BLOCK_MARGIN = 1024  # blocks of token numbers (1,024 each) skipped past the live mark
RESTORE_POINTS = ("keystore", "segment", "catalog", "opened", "replayed", "verified", "renamed")
"""Where a restore calls ``on_restore_step`` (fault injection kills the process there):
after the key store is written, after each segment, after the catalog, once the copy
is open, after each tombstone replayed, after verification, after the rename."""


class _Replayed(Protocol):
    @property
    def state(self) -> str: ...
    @property
    def error(self) -> str | None: ...


class _Replayer(Protocol):
    def replay(self, tombstone: Tombstone) -> _Replayed: ...


class _CopyMemories(Protocol):
    def rows_by_id(self, ref: str, memory_ids: Iterable[str]) -> object: ...
    def count_ref(self, ref: str) -> int: ...
    def partition_refs(self) -> list[str]: ...


class _CopyVectors(Protocol):
    def exists(self, ref: str) -> bool: ...
    def count(self, ref: str) -> int: ...


class RestoredCopy(Protocol):
    """What a restore needs of the opened copy (an open ``Keyshred`` has it all):
    its catalog and keyring, the erasure steps to replay tombstones with, and the
    stores to verify."""

    @property
    def path(self) -> Path: ...
    @property
    def catalog(self) -> Catalog: ...
    @property
    def keyring(self) -> Keyring: ...
    @property
    def erasure(self) -> _Replayer: ...
    @property
    def memories(self) -> _CopyMemories: ...
    @property
    def vectors(self) -> _CopyVectors: ...
    def close(self) -> None: ...


OpenCopy = Callable[[Path, Config], RestoredCopy]
"""``open_copy(folder, config)``: open the restored folder as a data folder, able to
rebuild derived assets as the live one does (its embedding model, its producers)."""


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


class Restore(Generations):
    """The restore part of ``ks.backup``: see the module docstring."""

    # Set by ``BackupManager``: how to open the copy, and where its catalog goes.
    _open_copy: OpenCopy
    _catalog: Catalog
    _catalog_file: PurePath
    on_restore_step: Callable[[str], None] | None

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
        claim = restore_staging.claim(dest, self._path / STAGING)
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
        self._audit.record(
            "backup.restored",
            generation=generation,
            replayed=len(report.replayed),
            subjects=report.subjects_verified,
        )
        return report

    def _point(self, name: str) -> None:
        if self.on_restore_step is not None:
            self.on_restore_step(name)

    def _open_keystore(self, manifest: Manifest, tgt: BackupTarget) -> bytes:
        """The generation's key store snapshot, in memory: sealed under the
        generation's epoch (gone once destroyed)."""
        keyring = self._keyring
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
        tick = Ticker(progress, "download", sum(s.size for s in manifest.segments))

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
        catalog_path = staging / self._catalog_file
        tgt.get_file(manifest.catalog.object, catalog_path)
        if _sha256_file(catalog_path) != manifest.catalog.sha256:
            raise IntegrityError(
                f"the catalog copy of generation {manifest.generation} is tampered"
            )
        catalog_path.chmod(0o600)
        self._point("catalog")

        # 4. Configuration: the generation's settings, the live KEK, embedded catalog.
        #    The copy rebuilds derived data as the live folder does (its model, its
        #    producers): ``open_copy`` sees to that.
        config = self._restored_config(manifest)
        save_config(staging, config)
        restored = self._open_copy(staging, config)
        try:
            self._point("opened")
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
            skip_token_blocks(
                restored.catalog, token_block_mark(self._catalog) + _TOKEN_BLOCK_MARGIN
            )
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

    def _carry_suppressions(self, restored: RestoredCopy) -> None:
        """Suppress in the copy every subject (or scope) the live store has
        suppressed: an erasure stopped between its ``suppress`` and ``destroy_keys``
        steps (a kill, a failure) has no tombstone to replay yet, and the copy must
        decide before decrypting as the live store does."""
        import sqlalchemy as sa

        from keyshred.storage.catalog import ACTIVE, Catalog
        from keyshred.storage.schema import subject_guard

        columns = (
            subject_guard.c.subject_ref,
            subject_guard.c.status,
            subject_guard.c.deletion_epoch,
            subject_guard.c.suppressed_scopes,
        )
        with self._catalog.engine.connect() as conn:
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
        restored: RestoredCopy,
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
        live = self._config
        kek = live.kek
        if kek.provider == "local":
            keys = self._path / "keys"
            local = kek.local_path or str((keys / "kek.local.json").resolve())
            archive = kek.archive_local_path or str((keys / "kek.archive.json").resolve())
            kek = kek.model_copy(update={"local_path": local, "archive_local_path": archive})
        doc["kek"] = kek.model_dump(mode="json")
        # The copy is embedded: its own catalog and partition folder, never the live
        # bucket (its tombstone replay would otherwise erase live objects).
        doc["storage"] = {**doc.get("storage", {}), "catalog_url": None, "uri": None}
        doc["vectors"] = {**doc.get("vectors", {}), "uri": None}
        doc["backup"] = {**doc.get("backup", {}), "target": None}
        # The restored copy gets its own (SQLite) key store from the sealed snapshot.
        doc["keyring"] = {**doc.get("keyring", {}), "store_url": None}
        # No completion webhooks: the copy's replays and any request run on it must
        # not call the production endpoints (the manifest's secrets are masked, too).
        doc["webhooks"] = []
        try:
            return Config.model_validate(doc)
        except ValueError:
            raise IntegrityError("the configuration in the manifest is not valid") from None

    def _verify_restored(self, restored: RestoredCopy, report: RestoreReport) -> None:
        from keyshred.storage.catalog import ACTIVE

        # Every partition the restored catalog or its partition store holds.
        for ref in restored.memories.partition_refs():
            if restored.catalog.guard(ref).status != ACTIVE:
                continue
            rows = restored.memories.rows_by_id(ref, [])  # loads: MACs, tags, catalog match
            del rows
            report.memories_verified += restored.memories.count_ref(ref)
            report.subjects_verified += 1
            if restored.vectors.exists(ref):
                report.vectors_verified += restored.vectors.count(ref)  # decrypts each


def _replay(restored: RestoredCopy, tomb: Tombstone, report: RestoreReport) -> None:
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
