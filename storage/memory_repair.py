"""``repair``: compare a subject's partition with the catalog, and with ``apply``
reconcile what is safe (see ``RepairReport``), audited. The operator's tool after a
crash, a restored file or a killed process (``keyshred repair``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from keyshred.errors import InvalidInput, SubjectErased, SubjectSuppressed
from keyshred.storage.catalog import ACTIVE, ERASED
from keyshred.storage.memory_erase import EraseMixin
from keyshred.storage.memory_types import (
    _SUBJECT_REF,
    DELETING,
    MEMORY_KIND,
    VECTOR_KIND,
    RepairReport,
    _storage_key,
)
from keyshred.storage.partition import MemoryRow, Partition

__all__ = ["RepairMixin"]


class RepairMixin(EraseMixin):
    """``repair`` and ``repair_all``."""

    def repair(
        self, subject_ref: str, *, apply: bool = False, forget_lost: bool = False
    ) -> RepairReport:
        """Compare a subject's partition with the catalog; with ``apply`` reconcile
        what is safe (see ``RepairReport``), audited. Never reads a suppressed or
        erased subject: an erasure in progress is resumed, not repaired."""
        if not isinstance(subject_ref, str) or not _SUBJECT_REF.fullmatch(subject_ref):
            raise InvalidInput("a subject_ref is 26 base32 characters (as errors print it)")
        guard = self._catalog.guard(subject_ref)
        epoch = self._catalog.enforce(subject_ref, guard, None)
        if guard.scopes:
            raise SubjectSuppressed(
                f"subject_ref {subject_ref} has suppressed scopes: resume its erasure"
            )
        with self._lock:  # the cached object would check the catalog on load
            cached = self._partitions.pop(subject_ref, None)
        if cached is not None:
            cached.close()
        part = self._new_partition(subject_ref, checked=False)
        try:
            with part.flocked(refresh=False):
                report = self._repair_findings(subject_ref, part)
                if apply and not report.clean:
                    report = self._repair_apply(part, report, epoch, forget_lost=forget_lost)
                if apply:
                    # The namespace index from what the partition holds now (a
                    # deletion killed before its index step left an emptied one).
                    if report.clean:
                        part.reload()
                    self._ns.replace(subject_ref, self._ns_entries(subject_ref, part))
        finally:
            part.close()
        if report.applied and self._audit is not None:
            self._audit.record(
                "memory.repaired",
                subject_ref=subject_ref,
                lost=len(report.lost),
                forgot_lost=report.forgot_lost,
                unfinished_deletes=len(report.unfinished_deletes),
                pending_deletes=len(report.pending_deletes),
                unregistered=len(report.unregistered),
                leftover_files=len(report.leftover_files),
            )
        return report

    def repair_all(self, *, apply: bool = False, forget_lost: bool = False) -> list[RepairReport]:
        """``repair`` of every partition the catalog or the partition store holds
        and every subject with memory assets (subjects under erasure are left to
        their erasure)."""
        refs = set(self._catalog.subjects_with(MEMORY_KIND)) | set(self.partition_refs())
        out = []
        for ref in sorted(r for r in refs if _SUBJECT_REF.fullmatch(r)):
            try:
                out.append(self.repair(ref, apply=apply, forget_lost=forget_lost))
            except (SubjectSuppressed, SubjectErased):
                continue
        return out

    def import_legacy(self) -> tuple[list[str], list[str]]:
        """Import now every memory partition a release before issue #21 left in the
        data folder (``MANIFEST`` + segments + append log); each is imported on its
        first load anyway, under its subject lock, so this only finishes an upgrade
        at once (before moving ``storage.uri`` to S3, say, or to find a tampered
        folder today rather than at its subject's next read). Returns the
        subject_refs imported and those left to their erasure in progress (its drop
        removes their folders unread). Vector datasets of the layout before revision
        0013 are imported (or, for an erased subject, removed) here too."""
        done, left = [], []
        root = self._root
        names = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
        for name in names:
            ref = name.removeprefix("subject=")
            if not name.startswith("subject=") or not _SUBJECT_REF.fullmatch(ref):
                continue
            if not self._legacy_folder(ref).files():
                continue
            status = self._catalog.guard(ref).status
            if status not in (ACTIVE, ERASED):
                left.append(ref)
                continue
            part = self._partition(ref)
            with part.flocked():  # the load under the lock imports (or removes) it
                pass
            done.append(ref)
        # Vectors kept as one LanceDB dataset per subject (before revision 0013): an
        # active subject's are imported into the catalog, an erased one's removed
        # unread (its keys are destroyed), one under erasure left to its drop.
        vectors = self._vectors
        for ref in vectors.legacy_refs() if vectors is not None else []:
            assert vectors is not None  # noqa: S101 - listed by it
            status = self._catalog.guard(ref).status
            if status == ACTIVE:
                vectors.settle(ref)
            elif status == ERASED:
                vectors.drop(ref)
            elif ref not in left:
                left.append(ref)
                continue
            if ref not in done:
                done.append(ref)
        return sorted(done), left

    def partition_refs(self) -> list[str]:
        """Every subject_ref whose partition the catalog or the partition store
        holds (objects another worker left count too)."""
        refs = set(self._hot.subjects())
        refs |= {k.split("/", 1)[0].removeprefix("subject=") for k in self._objects.list_keys("")}
        return sorted(r for r in refs if _SUBJECT_REF.fullmatch(r))

    def _repair_findings(self, ref: str, part: Partition) -> RepairReport:
        rows, leftovers = part.inspect()
        return self._findings(ref, rows, leftovers)

    def _findings(
        self, ref: str, rows: Sequence[MemoryRow], leftovers: Sequence[str]
    ) -> RepairReport:
        """What the partition's ``rows`` and ``leftovers`` mean against the catalog."""
        key = _storage_key(ref)  # memories and derived assets
        status = {a.asset_id: a.status for a in self._catalog.assets(ref) if a.storage_key == key}
        present = {r.memory_id for r in rows}
        missing = status.keys() - present
        return RepairReport(
            ref,
            lost=tuple(sorted(m for m in missing if status[m] != DELETING)),
            unfinished_deletes=tuple(sorted(m for m in missing if status[m] == DELETING)),
            pending_deletes=tuple(
                sorted(m for m in present & status.keys() if status[m] == DELETING)
            ),
            unregistered=tuple(sorted(present - status.keys())),
            leftover_files=tuple(leftovers),
        )

    def _repair_apply(
        self, part: Partition, report: RepairReport, epoch: int, *, forget_lost: bool
    ) -> RepairReport:
        """Act on the findings, under the partition lock the findings were read
        under. Reloading the partition removes the leftover objects."""
        ref = report.subject_ref
        part.reload()
        kinds = {a.asset_id: a.kind for a in self._catalog.assets(ref, kind=VECTOR_KIND)}
        self._forget(ref, set(report.unfinished_deletes), kinds)
        if forget_lost and report.lost:
            self._forget(ref, set(report.lost), kinds)
        by_id = {r.memory_id: r for r in part.all_rows()}
        pending = [by_id[m] for m in report.pending_deletes]
        if pending:
            self._delete_rows(ref, part, pending)
        if report.unregistered:
            found = [by_id[m] for m in report.unregistered]
            # A killed put about a subject erased (or being erased) since: its row is
            # opaque or its mention would be refused by the catalog, which made every
            # repair of this partition fail (and ``repair_all`` skip it). Its put was
            # never acknowledged, and it is about that subject: deleted, not registered.
            doomed = [r for r in found if r.opaque or not self._mentions_active(r)]
            if doomed:
                self._delete_rows(ref, part, doomed)
            gone = {r.memory_id for r in doomed}
            keep = [r for r in found if r.memory_id not in gone]
            if keep:
                self._register_found(ref, keep, epoch)
        return replace(report, applied=True, forgot_lost=forget_lost and bool(report.lost))

    def _mentions_active(self, row: MemoryRow) -> bool:
        for mentioned in row.mentions:
            try:
                self._catalog.check_guard(mentioned)
            except SubjectSuppressed:
                return False
        return True

    def _register_found(self, ref: str, rows: list[MemoryRow], epoch: int) -> None:
        """Register rows a killed put left in the partition. Vectors the put wrote
        are registered with them; a row without its vectors is registered without,
        and its first semantic search embeds it (``_repair``)."""
        embedded = self._vectors.memory_ids(ref) if self._vectors is not None else set()
        found = [r if r.memory_id in embedded else replace(r, index=()) for r in rows]
        self._register_rows(ref, found, expected_epoch=epoch, replace=True, remove=())
