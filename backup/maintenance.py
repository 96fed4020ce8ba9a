"""The KEK-epoch schedule, pruning and the receipts' backup section.

Two lineages bound what a backup can yield (see ``keyshred.backup.manager``): the
*live* one is rotated every ``keyring.live_rotate_minutes`` and its older epochs
destroyed once nothing is wrapped by them; each generation takes its own epoch of
the *archive* lineage, destroyed once it and every earlier generation have expired
(providers destroy "every epoch before N", oldest first). ``maintain`` runs both
and prunes expired generations; ``coverage`` turns the schedule into the date a
receipt promises (``backup_final_date``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from keyshred.backup.generations import Generation, Generations, _parse_generation_time
from keyshred.backup.manifest import GENERATIONS, OBJECTS, TOMBSTONES, Manifest, gen_prefix
from keyshred.backup.targets import BackupTarget
from keyshred.errors import KeyshredError
from keyshred.keyring.kek import DestroyedEpoch
from keyshred.receipts import BackupCoverage

__all__ = ["LiveStatus", "Maintenance", "MaintenanceReport"]

_INCOMPLETE_AFTER = timedelta(hours=6)


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


class Maintenance(Generations):
    """The schedule part of ``ks.backup``: see the module docstring."""

    def live_status(self, now: datetime | None = None) -> LiveStatus:
        """The current live epoch: when it is due to rotate, whether that is past
        (the maintenance run did not run in time), and until when a wrapped key of it
        left in database pages can still be unwrapped."""
        now = now or self.clock()
        current = self._keyring.live_epoch()
        due = current.created_at + self.live_period
        return LiveStatus(
            current.epoch, current.created_at, due, now > due, due + self._kms_window()
        )

    def live_residue_until(self, at: datetime | None = None) -> datetime:
        """When the live epoch current at ``at`` (default now) is destroyed by the
        schedule: its creation plus the live period (plus the KMS deletion window)."""
        at = at or self.clock()
        records = self._keyring.live.records()
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
        keyring = self._keyring
        current = keyring.live_epoch()
        if now < current.created_at + self.live_period - self.live_lead:
            keyring.rewrap_to_current()
            return None
        result = keyring.rotate_kek()
        self._audit.record("kek.rotated", epoch=result.new_epoch, keys=result.keys_rewrapped)
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
            self._audit.record("kek.live_destroy_deferred", error=type(exc).__name__)
        run = self._keyring.maintain_live(
            self.live_period, now=now, keep_from=keep_from, lead=self.live_lead
        )
        if run.rotated_to is not None:
            self._audit.record("kek.rotated", epoch=run.rotated_to, keys=run.keys_rewrapped)
        for d in run.destroyed:
            self._audit.record("kek.epoch_destroyed", epoch=d.epoch)
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

    def epoch_users(self, before: int) -> list[str]:
        """The generations that need a live epoch older than ``before`` (the
        keyring's ``EpochInUse`` names them)."""
        return [
            f"{g.generation} (epoch {g.kek_epoch}, expires {g.expires_at:%Y-%m-%d})"
            for g in self.generations_needing(before)
        ]

    def destroy_kek_epochs_before(self, epoch: int, *, force: bool = False) -> list[DestroyedEpoch]:
        """Destroy live KEK epochs older than ``epoch``: ``EpochInUse`` while an
        unexpired generation is sealed under one, unless ``force`` (then audited, with
        the generations it breaks). ``maintain`` destroys on schedule."""
        broken = self._generations_broken(epoch) if force else []
        destroyed = self._keyring.destroy_kek_epochs_before(epoch, force=force)
        for d in destroyed:
            self._audit.record("kek.epoch_destroyed", epoch=d.epoch, forced=force, broke=broken)
        return destroyed

    def _generations_broken(self, epoch: int) -> list[str]:
        """For the audit of a forced destruction: the generations it breaks. Force is
        the override for when they cannot be listed either (a tampered manifest, a
        target gone): the audit says so instead of the override failing."""
        try:
            return [g.generation for g in self.generations_needing(epoch)]
        except KeyshredError as exc:
            return [f"unknown: {type(exc).__name__}"]

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
        provider = self._keyring.archive_kek
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
            self._audit.record("kek.archive_epoch_destroyed", epoch=d.epoch)
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
            self._audit.record("backup.pruned", generation=g)
        return pruned

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
