"""Data lifecycle: the retention scanner and consent withdrawal.

``ks.retention.run()`` finds memories past their retain-until *from plaintext
metadata only*: the catalog's assets, and the plaintext columns (ids, subject_ref,
retain_until) of the Parquet segments the catalog lists whose earliest retain-until
has passed (read through the partition store: a folder or S3). It never opens a
key. The same run deletes segments compactions retired longer ago than
``storage.retired_grace_seconds``. Each subject's expired memories become one deletion request
scoped to exactly those assets, carried through the erasure state machine (derived
assets built from them rebuilt, legal holds respected, a signed receipt of kind
``retention``). Reads hide a memory the moment its retain-until passes, so the
expired data is suppressed before the scanner even runs. Expired tokens, audit
events past ``audit.retention_days`` and expired backup generations go in the same
run. ``start`` runs it in a loop for a long-running service.

``ks.consent.withdraw(subject, scope)`` (``Consent``) revokes the consent record
(new writes fail at once) and erases the scope: suppression first (reads of the
scope fail at once), then the scope key is destroyed and its data dropped. Granting
consent again later starts a new scope key; nothing old comes back.
``ks.retention.withdraw`` is its deprecated former name.

Both receive their collaborators from the facade (the catalog, the audit log, the
stores they prune, a callable that runs an erasure), never the facade itself.
"""

from __future__ import annotations

import hashlib
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol

from keyshred._handle import typed_errors
from keyshred.errors import KeyshredError, SubjectSuppressed
from keyshred.jobs import Job, JobOutcome
from keyshred.storage.catalog import Catalog
from keyshred.storage.consent import ConsentApi
from keyshred.storage.policy import Policy
from keyshred.vault.schema import tokens

if TYPE_CHECKING:
    from keyshred.audit import AuditLog
    from keyshred.backup.manager import BackupManager
    from keyshred.config import Config
    from keyshred.erasure import ErasureRequest
    from keyshred.storage.checkpoints import CheckpointStore

__all__ = ["Consent", "Erasures", "Lifecycle", "RetentionReport"]


class Erasures(Protocol):
    """The erasure coordinator as these services use it (the facade wires it)."""

    def request(
        self,
        subject_ref: str,
        scope: str | None,
        *,
        requested_by: str,
        reason: str,
        request_id: str | None = None,
        assets: Sequence[str] | None = None,
        kind: str = "erasure",
        identity: Mapping[str, str] | None = None,
    ) -> ErasureRequest: ...

    def run(self, request_id: str) -> ErasureRequest: ...


class MemorySegments(Protocol):
    """The memory store as the retention run uses it (the facade wires it)."""

    def expired_in_segments(self, now: datetime) -> dict[str, list[str]]: ...

    def sweep_retired(self) -> int: ...


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass
class RetentionReport:
    """What one retention run found and did."""

    at: datetime
    expired_memories: int = 0
    subjects: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    held: int = 0
    tokens_deleted: int = 0
    exports_expired: int = 0
    threads_deleted: int = 0
    audit_events_pruned: int = 0
    backup_generations_pruned: list[str] = field(default_factory=list)
    retired_segments_deleted: int = 0
    scan_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            k: v.isoformat() if isinstance(v, datetime) else v for k, v in self.__dict__.items()
        }


class Lifecycle:
    """``ks.retention``: see the module docstring."""

    def __init__(
        self,
        config: Config,
        catalog: Catalog,
        audit: AuditLog,
        *,
        memories: MemorySegments,
        checkpoints: CheckpointStore,
        backups: BackupManager,
        erasures: Erasures,
        expire_exports: Callable[[datetime], int],
        consent: Consent,
    ) -> None:
        self._config = config
        self._catalog = catalog
        self._audit = audit
        self._memories = memories
        self._checkpoints = checkpoints
        self._backups = backups
        self._erasures = erasures
        self._expire_exports = expire_exports
        self._consent = consent
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the scan --------------------------------------------------------------------

    def expired(self, now: datetime | None = None) -> dict[str, list[str]]:
        """Memory ids past their retain-until, by subject_ref, from plaintext
        metadata: the Parquet segments (DuckDB) and the catalog. No key is used."""
        now = now or _now()
        found: dict[str, set[str]] = {}
        for ref, ids in self._memories.expired_in_segments(now).items():
            found.setdefault(ref, set()).update(ids)
        for ref, ids in self._catalog.expired("memory", now).items():
            found.setdefault(ref, set()).update(ids)
        return {ref: sorted(ids) for ref, ids in found.items()}

    def run(self, now: datetime | None = None) -> RetentionReport:
        """One retention run over every layer; see the module docstring."""
        import time

        now = now or _now()
        report = RetentionReport(at=now)
        start = time.perf_counter()
        expired = self.expired(now)
        report.scan_seconds = time.perf_counter() - start
        report.expired_memories = sum(len(v) for v in expired.values())
        report.subjects = len(expired)
        for ref, ids in sorted(expired.items()):
            try:
                self._catalog.check_guard(ref)
            except SubjectSuppressed:
                continue  # an erasure of the subject is under way and takes them
            req = self._request(ref, ids)
            report.requests.append(
                {
                    "request_id": req.request_id,
                    "subject_ref": ref,
                    "memories": len(ids),
                    "state": req.state,
                }
            )
            report.held += req.state == "legal_hold"
        report.tokens_deleted = self.purge_tokens(now)
        days = self._config.retention.checkpoints_days
        if days is not None:
            for ref in self._checkpoints.idle_threads(now - timedelta(days=days)):
                report.threads_deleted += 1 if self._checkpoints.drop_thread_ref(ref) else 0
        report.exports_expired = self._expire_exports(now)
        report.retired_segments_deleted = self._memories.sweep_retired()
        report.audit_events_pruned = self._audit.apply_retention()
        if self._backups.target_in_use():
            report.backup_generations_pruned = self._backups.prune(now=now)
        self._audit.record(
            "retention.run",
            memories=report.expired_memories,
            subjects=report.subjects,
            held=report.held,
            tokens=report.tokens_deleted,
        )
        return report

    def run_job(self, job: Job, stop: Callable[[], bool]) -> JobOutcome:
        """The ``retention`` job's handler (one per period, enqueued by the
        workers): one run; its requests are jobs of their own, so a run killed
        halfway leaves each request it recorded to the workers."""
        del job, stop  # the payload names the period only; a run is one unit
        self.run()
        return JobOutcome.done()

    def _request(self, ref: str, ids: list[str]) -> ErasureRequest:
        # Idempotent: the same expired set is the same request (a held one resumes).
        digest = hashlib.sha256("\n".join(ids).encode()).hexdigest()[:20]
        req = self._erasures.request(
            ref,
            None,
            requested_by="retention-scanner",
            reason="retention-expired",
            request_id=f"retention-{ref[:16]}-{digest}",
            assets=ids,
            kind="retention",
        )
        return self._erasures.run(req.request_id)

    def purge_tokens(self, now: datetime) -> int:
        """Delete tokens past their expiry plus ``retention.tokens_grace_days``."""
        cutoff = now - timedelta(days=self._config.retention.tokens_grace_days)
        with self._catalog.transaction() as conn:
            n = int(conn.execute(tokens.delete().where(tokens.c.expires_at <= cutoff)).rowcount)
        if n:
            # The tokens' values are sealed under their subjects' live keys: the
            # pages the delete replaced leave SQLite's WAL too (no-op on PostgreSQL).
            self._catalog.scrub()
        return n

    # -- what is configured ------------------------------------------------------------

    def show(self) -> dict[str, Any]:
        """Retention per layer, as configured (``keyshred retention show``)."""
        cfg = self._config
        scopes = {
            name: {
                "purpose": s.purpose,
                "basis": s.basis,
                "max_retention_days": s.max_retention_days
                or cfg.storage.default_max_retention_days,
                "legal_max_days": s.legal_max_days,
                "purpose_end": None if s.purpose_end is None else s.purpose_end.isoformat(),
            }
            for name, s in cfg.scopes.items()
        }
        return {
            "memories": {
                "rule": "retain_until = min(purpose end, consent end, now + max, now + legal max)",
                "scopes": scopes,
            },
            "vectors": {"rule": "deleted with their memory"},
            "tokens": {
                "rule": "each token's ttl at sanitize; purged after expiry + grace",
                "grace_days": cfg.retention.tokens_grace_days,
            },
            "checkpoints": {
                "rule": "threads idle longer than checkpoints_days are deleted (key destroyed); "
                "otherwise until delete_thread, prune or the subject's erasure",
                "checkpoints_days": cfg.retention.checkpoints_days,
            },
            "audit": {"retention_days": cfg.audit.retention_days},
            "backups": {
                "classes_days": dict(cfg.backup.retention),
                "archive_kek_epoch": "one per generation, destroyed once it and every "
                "earlier generation have expired",
            },
            "live_kek_epoch": {
                "rule": "rotated every live_rotate_minutes by the maintenance run; the "
                "previous epoch destroyed once every key is re-wrapped",
                "live_rotate_minutes": cfg.keyring.live_rotate_minutes,
            },
            "scan_interval_minutes": cfg.retention.interval_minutes,
        }

    # -- the loop ----------------------------------------------------------------------

    def start(self, interval_minutes: float | None = None) -> threading.Thread:
        """Run ``run()`` every ``interval_minutes`` in a daemon thread."""
        minutes = interval_minutes or self._config.retention.interval_minutes

        def loop() -> None:
            while not self._stop.wait(minutes * 60):
                try:
                    # Typed as a public call is: a driver error (a table dropped or
                    # altered by hand) is DatabaseError, not the end of the loop.
                    with typed_errors():
                        self.run()
                except KeyshredError:
                    continue  # retried at the next interval; the audit log has the runs

        self._stop.clear()
        self._thread = threading.Thread(target=loop, name="keyshred-retention", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- consent withdrawal (moved to ``ks.consent.withdraw``) ------------------------

    def withdraw(
        self,
        subject: Any,
        *,
        scope: str,
        category: str | None = None,
        requested_by: str = "consent-withdrawal",
    ) -> ErasureRequest:
        """Deprecated: ``ks.consent.withdraw(subject, scope)`` does this."""
        warnings.warn(
            "ks.retention.withdraw is deprecated; use ks.consent.withdraw(subject, scope)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self._consent.withdraw(subject, scope, category=category, requested_by=requested_by)


class Consent(ConsentApi):
    """``ks.consent``: consent records (``grant``, ``revoke``, ``list``) and their
    withdrawal, which erases what the consent covered."""

    def __init__(
        self,
        catalog: Catalog,
        policy: Policy,
        subject_ref: Callable[[Any], str],
        audit: AuditLog,
        erasures: Erasures,
    ) -> None:
        super().__init__(catalog, policy, subject_ref)
        self._audit = audit
        self._erasures = erasures

    def withdraw(
        self,
        subject: Any,
        scope: str,
        *,
        category: str | None = None,
        requested_by: str = "consent-withdrawal",
    ) -> ErasureRequest:
        """Withdraw consent for a scope: revoke the record (new writes fail at once),
        then erase the scope (reads fail at once, the scope key is destroyed, its
        data dropped, derived data rebuilt, a signed receipt). The subject's other
        scopes stay readable. A consent record keeps its policy version and history."""
        ref, req = self._record_withdrawal(subject, scope, category, requested_by, None)
        self._audit.record("consent.withdrawn", subject_ref=ref, scope=scope)
        return self._erasures.run(req.request_id)

    def _record_withdrawal(
        self,
        subject: Any,
        scope: str,
        category: str | None,
        requested_by: str,
        identity: Mapping[str, str] | None,
    ) -> tuple[str, ErasureRequest]:
        """Revoke the consent (new writes fail at once) and record the scope erasure
        with its job: the subject_ref and the request."""
        self.revoke(subject, scope=scope, category=category)
        ref = self._ref(subject)
        req = self._erasures.request(
            ref,
            scope,
            requested_by=requested_by,
            reason="consent-withdrawn",
            kind="consent-withdrawal",
            identity=identity,
        )
        return ref, req

    def submit_withdrawal(
        self,
        subject: Any,
        scope: str,
        *,
        category: str | None = None,
        requested_by: str = "consent-withdrawal",
        identity: Mapping[str, str] | None = None,
    ) -> ErasureRequest:
        """``withdraw`` without running the erasure: the consent is revoked now (new
        writes fail at once) and the scope erasure is recorded with its job, which a
        worker runs (what the HTTP API calls); ``identity`` as ``ks.erasure.request``."""
        ref, req = self._record_withdrawal(subject, scope, category, requested_by, identity)
        self._audit.record(
            "consent.withdrawn", subject_ref=ref, scope=scope, request_id=req.request_id
        )
        return req
