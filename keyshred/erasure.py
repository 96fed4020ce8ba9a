"""The erasure coordinator: a persisted, resumable state machine per request.

States: ``requested → authorized → suppressed → propagating → verifying →
completed``, plus ``rejected``, ``legal_hold`` (an active hold blocks the request and
says so), ``retryable_failure`` (a step failed; ``resume`` continues) and
``manual_review`` (verification failed, or too many attempts).

Steps, each idempotent and recorded before the next starts, so a crash at any point
resumes where it stopped and nothing becomes readable again:

1. ``suppress``      guard + deletion epoch bump in one transaction; caches evicted
2. ``destroy_keys``  the scope DEKs, and the keys of other holders' data the subject
                     co-owns (mentions, derived assets): from here every copy is
                     unreadable
3. ``closure``       the subject's assets and, by reverse provenance and mentions,
                     every derived asset built from them (recorded, then acted on),
                     with the assets each destroyed co-owned key made unreadable
4. ``drop_memories`` / ``drop_vectors`` / ``drop_tokens`` / ``drop_checkpoints``
                     partitions, datasets, tokens and agent threads removed
5. ``catalog``       the subject's assets (and, for a subject, consents and
                     registered identifiers) deleted
6. ``derived``       each derived asset rebuilt from its remaining sources with the
                     pinned producer version, or dropped when it cannot be
7. ``external``      vendor deletion hooks: acknowledgement or ``deletion_not_verifiable``
8. ``tombstone``     the key store's tombstone (key ids, subject_ref, time) confirmed
   ``backups``       the tombstone journaled on the backup target (restores replay it)
                     and the subject's segment objects deleted there, every version
9. ``verify``        keys fail to unwrap, no partition, no asset, no provenance,
                     mention or registered identifier left, probes not found by key
                     or semantic search
10. ``receipt``      signed, stored; the subject stays ``erased`` until re-admitted

Three kinds of request run these steps: a subject or scope erasure, the retention
scanner's listed memories (no key destroyed, the subject stays active) and a
tombstone replayed on a restored copy (no holds, processors, backup deletion or
receipt). Where they differ is written once per kind, in ``_Extent`` and its two
subclasses; the coordinator holds what they share: order, persistence, resumption.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol

import sqlalchemy as sa

from keyshred._validate import check_text
from keyshred.audit import AuditLog
from keyshred.db import utc
from keyshred.errors import (
    InvalidInput,
    KeyNotFound,
    KeyshredError,
    NotFound,
    SubjectErased,
    SubjectSuppressed,
)
from keyshred.keyring.keystore import Tombstone
from keyshred.receipts import (
    Check,
    DerivedAction,
    ExternalCall,
    Receipt,
    SharedKey,
    StoreAction,
    load_receipt,
    sign_receipt,
)
from keyshred.schema import deletion_requests, legal_holds
from keyshred.storage.catalog import ACTIVE, AssetRow, Catalog
from keyshred.storage.partition import row_key_id

if TYPE_CHECKING:
    import os

    from keyshred.facade import Keyshred
    from keyshred.residue import ResidueReport
    from keyshred.storage.memories import Memory

__all__ = [
    "STEPS",
    "DerivedApi",
    "ErasureCoordinator",
    "ErasureRequest",
    "ExternalAnswer",
    "ExternalProcessor",
    "Hold",
    "VerificationFailed",
]

REQUESTED, AUTHORIZED, SUPPRESSED = "requested", "authorized", "suppressed"
PROPAGATING, VERIFYING, COMPLETED = "propagating", "verifying", "completed"
REJECTED, LEGAL_HOLD = "rejected", "legal_hold"
RETRYABLE, MANUAL_REVIEW = "retryable_failure", "manual_review"
ERASED = "erased"

STEPS = (
    "suppress",
    "destroy_keys",
    "closure",
    "drop_memories",
    "drop_vectors",
    "drop_tokens",
    "drop_checkpoints",
    "catalog",
    "derived",
    "external",
    "tombstone",
    "backups",
    "verify",
    "receipt",
)
_STATE_AFTER = {
    "suppress": SUPPRESSED,
    "destroy_keys": PROPAGATING,
    "closure": PROPAGATING,
    "drop_memories": PROPAGATING,
    "drop_vectors": PROPAGATING,
    "drop_tokens": PROPAGATING,
    "drop_checkpoints": PROPAGATING,
    "catalog": PROPAGATING,
    "derived": PROPAGATING,
    "external": PROPAGATING,
    "tombstone": VERIFYING,
    "backups": VERIFYING,
    "verify": VERIFYING,
    "receipt": COMPLETED,
}
_SAFE_TEXT = re.compile(r"[A-Za-z0-9 ._:@/+()#,-]{1,128}")
MAX_ATTEMPTS = 5


class VerificationFailed(KeyshredError):
    """A verification probe found something of the subject after erasure."""


@dataclass(frozen=True, slots=True)
class ExternalAnswer:
    """A vendor's answer: ``verified`` only if it confirmed the deletion."""

    verified: bool
    detail: str = ""


class ExternalProcessor(Protocol):
    """A processor holding the subject's data elsewhere (a model provider's stored
    responses, a hosted memory product). ``delete`` asks it to delete; it must not
    claim a deletion it cannot verify."""

    name: str

    def delete(self, subject_ref: str, scope: str | None) -> ExternalAnswer: ...


@dataclass(slots=True)
class ErasureRequest:
    request_id: str
    subject_ref: str
    scope: str | None
    state: str
    requested_by: str
    reason: str
    created_at: datetime
    updated_at: datetime
    attempts: int
    doc: dict[str, Any] = field(default_factory=dict)

    @property
    def steps_done(self) -> list[str]:
        return list(self.doc.get("done", []))

    @property
    def error(self) -> str | None:
        value = self.doc.get("error")
        return None if value is None else str(value)

    @property
    def found_data(self) -> bool | None:
        """Whether anything of the subject was found (a key, a row, a token, an
        asset); ``False``: it was never stored here. ``None`` until the receipt."""
        value = self.doc.get("found_data")
        return None if value is None else bool(value)

    def __repr__(self) -> str:
        return (
            f"ErasureRequest(request_id={self.request_id!r}, subject_ref={self.subject_ref!r}, "
            f"scope={self.scope!r}, state={self.state!r})"
        )


@dataclass(frozen=True, slots=True)
class Hold:
    hold_id: str
    subject_ref: str
    scope: str | None
    reason: str
    owner: str
    placed_at: datetime
    released_at: datetime | None


def _safe(kind: str, value: str) -> str:
    if not isinstance(value, str) or not _SAFE_TEXT.fullmatch(value):
        raise InvalidInput(
            f"{kind} is 1-128 characters of letters, digits and ._:@/+()#,- "
            "(it lands in receipts and audit events: no personal data)"
        )
    return value


def _found_data(details: dict[str, Any]) -> bool:
    """Whether a request found anything of the subject: a key (every stored value has
    one), an asset, a token, a thread or a derived asset. File counts do not tell:
    a partition folder may hold nothing but its lock file."""
    return bool(
        details["destroy_keys"]["key_ids"]
        or details["catalog"]["assets"]
        or details["drop_tokens"]["count"]
        or details.get("drop_checkpoints", {}).get("count", 0)
        or details["derived"]["actions"]
    )


def _now() -> datetime:
    return datetime.now(UTC)


def _iso(value: datetime) -> str:
    return value.astimezone(UTC).isoformat()


class DerivedApi:
    """``ks.derived``: assets derived from other assets, with how to rebuild them."""

    def __init__(self, ks: Keyshred) -> None:
        self._ks = ks
        self._rebuilders: dict[tuple[str, str], Callable[[list[Memory]], Any]] = {}

    def register_producer(
        self, producer: str, version: str, rebuild: Callable[[list[Memory]], Any]
    ) -> None:
        """How ``producer`` at ``version`` rebuilds its output from the remaining
        source memories; returning ``None`` drops the derived asset instead."""
        self._rebuilders[(_safe("producer", producer), _safe("producer version", version))] = (
            rebuild
        )

    def copy_producers(self, other: DerivedApi) -> None:
        """Take over another store's rebuild functions (a restore's tombstone replay
        rebuilds derived assets the way the live erasure did)."""
        self._rebuilders.update(other._rebuilders)

    def rebuilder(self, producer: str | None, version: str | None) -> Callable[..., Any] | None:
        if producer is None or version is None:
            return None
        return self._rebuilders.get((producer, version))

    def register(
        self,
        kind: str,
        *,
        subject: Any,
        namespace: Sequence[str] | str,
        key: str,
        value: Any,
        produced_from: Sequence[str],
        producer: str,
        producer_version: str,
        rebuild: Callable[[list[Memory]], Any] | None = None,
        mentions: Iterable[Any] = (),
        scope: str = "default",
        index: bool | Sequence[str] | None = None,
    ) -> Memory:
        """Store a derived asset (a summary, a fact, an edge) as a memory of
        ``subject`` with its provenance; erasing any source subject rebuilds it."""
        _safe("kind", kind)
        if rebuild is not None:
            self.register_producer(producer, producer_version, rebuild)
        memory = self._ks.memories.put(
            subject,
            namespace,
            key,
            value,
            scope=scope,
            sources=list(produced_from),
            mentions=mentions,
            index=index,
        )
        ref = self._ks.subject_ref(subject)
        with self._ks.catalog.transaction() as conn:
            from keyshred.storage.schema import assets

            conn.execute(
                assets.update()
                .where(assets.c.asset_id == memory.memory_id)
                .values(
                    kind=f"derived:{kind}",
                    producer=_safe("producer", producer),
                    producer_version=_safe("producer version", producer_version),
                )
            )
        self._ks.audit.record(
            "derived.registered",
            subject_ref=ref,
            asset_id=memory.memory_id,
            kind=kind,
            producer=producer,
            producer_version=producer_version,
            sources=len(produced_from),
        )
        return memory


class _Extent:
    """What a request erases, and so how the steps that differ between kinds of
    request behave: this class is a subject erasure (``scope=None``) or a scope
    erasure; ``_AssetsExtent`` is the retention scanner's listed memories,
    ``_ReplayExtent`` a tombstone replayed on a restored copy. The coordinator runs
    the same steps, in the same order, with the same persistence, for every kind."""

    holds_apply = True  # an active legal hold blocks the request
    calls_processors = True  # external processors are asked to delete
    deletes_backups = True  # the tombstone is journaled and segments deleted on targets
    drops_tokens = True  # the subject's (scope's) tokens go
    signs_receipt = True

    def __init__(self, ks: Keyshred, req: ErasureRequest) -> None:
        self.ks = ks
        self.req = req
        self.ref = req.subject_ref
        self.scope = req.scope

    @property
    def whole_subject(self) -> bool:
        """The subject itself goes (its threads, tokens and mentions with it)."""
        return self.scope is None

    @property
    def memories_action(self) -> str:
        return "partition-dropped" if self.scope is None else "scope-dropped"

    @property
    def vectors_action(self) -> str:
        return "dataset-dropped" if self.scope is None else "scope-deleted"

    def suppress(self) -> dict[str, Any]:
        # Tokens this process holds for group commit are stored first (a flush takes
        # milliseconds), so the tokens step deletes and counts them with the rest.
        self.ks.vault.flush()
        epoch = self.ks.catalog.suppress(self.ref, self.scope)
        self.ks.memories.evict(self.ref)
        at = _now()
        self.ks.metrics.online_latency((at - self.req.created_at).total_seconds())
        return {"epoch": epoch, "at": _iso(at)}

    def own_assets(self) -> dict[str, str]:
        """Asset id -> kind of what the request erases."""
        return self.ks.catalog.asset_kinds(self.ref, self.scope)

    def first_level(self) -> list[AssetRow]:
        """Assets derived from (or, for a whole subject, mentioning) what goes."""
        mentioning = self.ks.catalog.mentioning(self.ref) if self.scope is None else []
        return [*mentioning, *self.ks.catalog.derived_from_subject(self.ref, self.scope)]

    def destroy_keys(self) -> dict[str, Any]:
        # Under the partition lock: a writer that passed its guard check before the
        # suppression finishes first; every later one sees the suppression.
        ks = self.ks
        with ks.memories.locked(self.ref):
            result = ks.keyring.destroy(self.ref, self.scope)
        ks.vectors.evict(self.ref)
        if ks.memories.pme is not None:
            ks.memories.pme.forget()
        at = _now()
        tombstone = result.tombstone
        if not tombstone.key_ids:
            # Resumed after the keys were already destroyed: take the tombstone's.
            previous = [
                t
                for t in ks.keyring.store.tombstones()
                if t.subject_ref == self.ref and t.scope == self.scope
            ]
            if previous:
                tombstone = previous[-1]
                at = tombstone.erased_at
        return {
            "key_ids": [k.hex() for k in tombstone.key_ids],
            "tombstone_id": tombstone.tombstone_id if tombstone.key_ids else None,
            "at": _iso(at),
            "cache_evicted": result.cache_entries_evicted,
            # Keys of other holders' data about the subject, destroyed with its own.
            "shared_keys": [[k.hex(), holder] for k, holder in result.shared_keys],
            # The live epoch that may still sit in database pages with these keys:
            # when the live schedule destroys it.
            "live_residue_until": _iso(ks.backup.live_residue_until(at)),
        }

    def keys_left(self) -> int:
        """Keys the subject (or scope) holds, and for a subject the keys it co-owns."""
        store = self.ks.keyring.store
        held = store.for_subject(self.ref, self.scope)
        return len(held) + len(store.owned_by(self.ref, self.scope))

    def sweep_keys(self) -> list[str] | None:
        """Destroy keys about the subject created after ``destroy_keys`` (a writer
        that passed every guard check just before the suppression); their tombstone
        goes to the backups like the first. Returns their key ids (hex); ``None``
        where the request destroys no key of its own."""
        if not self.keys_left():
            return []
        result = self.ks.keyring.destroy(self.ref, self.scope)
        if self.deletes_backups and result.tombstone.key_ids:
            self.ks.backup.on_erasure(result.tombstone, whole_subject=self.scope is None)
        return [k.hex() for k in result.tombstone.key_ids]

    def drop_memories(self) -> int:
        if self.scope is None:
            return self.ks.memories.drop_subject(self.ref)
        return self.ks.memories.drop_scope(self.ref, self.scope)

    def drop_vectors(self) -> int:
        # Under the freeze lock, like every partition write: a backup never links
        # half of a dataset being removed.
        with self.ks.memories.freeze.shared():
            if self.scope is None:
                return 1 if self.ks.vectors.drop(self.ref) else 0
            return self.ks.vectors.delete_scope(self.ref, self.scope)

    def drop_tokens(self) -> int:
        return self.ks.vault.drop_subject(self.ref, self.scope)

    def drop_checkpoints(self) -> int:
        return self.ks.checkpoints.drop_subject(self.ref, self.scope)

    def drop_catalog(self) -> tuple[int, int]:
        """(assets deleted, consents deleted); a subject's registered identifiers go
        too (only after suppression: a racing registration is refused or deleted)."""
        n = self.ks.catalog.delete_subject_assets(self.ref, scope=self.scope)
        consents = self.ks.catalog.delete_consents(self.ref) if self.scope is None else 0
        if self.scope is None:
            self.ks.catalog.delete_identifiers(self.ref)
        return n, consents

    def verify_stores(self, check: Callable[[str, bool, str], None]) -> None:
        path = self.ks.memories.partition_path(self.ref)
        if self.scope is None:

            def files_left() -> list[str]:
                return [p.name for p in path.rglob("*") if p.is_file()] if path.exists() else []

            left = files_left()
            # A writer racing the erasure re-makes the folder with its lock file when
            # it takes the lock, finds the subject suppressed, and removes both: a lone
            # lock file may be on its way out. Anything else left, or a lock that
            # stays, fails the check.
            deadline = time.monotonic() + 2.0
            while left == ["LOCK"] and time.monotonic() < deadline:
                time.sleep(0.01)
                left = files_left()
            check("memory partition removed", not left, f"{len(left)} files left")
            gone = not self.ks.vectors.exists(self.ref)
            check("vector partition removed", gone, "dataset absent" if gone else "still there")
        else:
            manifest = path / "MANIFEST"
            scopes = json.loads(manifest.read_text())["segments"] if manifest.exists() else {}
            check("scope segment removed", self.scope not in scopes, f"scopes left: {len(scopes)}")

    def backup_coverage(self, keys_at: datetime, deleted: int) -> Any:
        return self.ks.backup.coverage(self.ref, keys_at, deleted=deleted)

    def finish(self) -> None:
        """The guard once the request is done: an erased subject stays ``erased``
        until re-admitted; an erased scope takes new writes under a new key."""
        if self.scope is None:
            self.ks.catalog.set_guard(self.ref, ERASED)
        else:
            self.ks.catalog.release_scope(self.ref, self.scope)


class _AssetsExtent(_Extent):
    """Exactly the listed memories of a subject (the retention scanner's requests):
    deleted physically with their vectors and catalog rows, derived assets rebuilt;
    no key is destroyed (the scope's other memories share it) and the subject stays
    active."""

    calls_processors = False
    drops_tokens = False  # tokens are not memories: their own expiry removes them

    def __init__(self, ks: Keyshred, req: ErasureRequest) -> None:
        super().__init__(ks, req)
        self.assets: list[str] = list(req.doc["assets"])

    @property
    def whole_subject(self) -> bool:
        return False

    @property
    def memories_action(self) -> str:
        return "memories-deleted"

    @property
    def vectors_action(self) -> str:
        return "deleted-with-their-memories"

    def suppress(self) -> dict[str, Any]:
        # Past their retain-until, these memories are already invisible to every
        # read (reads hide expired rows); the subject itself stays active.
        return {"epoch": None, "at": _iso(_now()), "assets": len(self.assets)}

    def own_assets(self) -> dict[str, str]:
        catalog = self.ks.catalog
        out = {}
        for a in self.assets:
            row = catalog.asset(a)
            if row is not None:
                out[a] = row.kind
        for row in catalog.derived_from(self.assets):
            if row.kind == "vector":
                out[row.asset_id] = row.kind
        return out

    def first_level(self) -> list[AssetRow]:
        return self.ks.catalog.derived_from(self.assets)

    def destroy_keys(self) -> dict[str, Any]:
        return {"key_ids": [], "tombstone_id": None, "at": _iso(_now()), "cache_evicted": 0}

    def sweep_keys(self) -> list[str] | None:
        return None  # no key is destroyed: the scope's other memories share it

    def drop_memories(self) -> int:
        return self.ks.memories.delete_ids(self.ref, self.assets)

    def drop_vectors(self) -> int:
        return 0  # removed with their memories

    def drop_tokens(self) -> int:
        return 0

    def drop_checkpoints(self) -> int:
        return 0  # threads have their own retention (``retention.checkpoints_days``)

    def drop_catalog(self) -> tuple[int, int]:
        own = self.req.doc["details"]["closure"]["own"]
        return self.ks.catalog.delete(own), 0

    def verify_stores(self, check: Callable[[str, bool, str], None]) -> None:
        rows = self.ks.memories.rows_by_id(self.ref, self.assets)
        check("memories removed", not rows, f"{len(rows)} of {len(self.assets)} left")

    def backup_coverage(self, keys_at: datetime, deleted: int) -> Any:
        return self.ks.backup.coverage_unkeyed(keys_at)

    def finish(self) -> None:
        pass  # the subject stays active: only those memories went


class _ReplayExtent(_Extent):
    """A live tombstone replayed on a restored copy: the same key ids, tombstone id
    and time; no holds (the live erasure passed them), no processors, no backup
    deletion and no receipt (the live erasure did and signed those)."""

    holds_apply = False
    calls_processors = False
    deletes_backups = False
    signs_receipt = False

    def sweep_keys(self) -> list[str] | None:
        return None  # exactly the live erasure's keys: a returned subject keeps its new ones

    def destroy_keys(self) -> dict[str, Any]:
        # A subject who came back after the erasure has other key ids: untouched.
        t = self.req.doc["replay"]
        tombstone = Tombstone(
            t["tombstone_id"],
            self.ref,
            self.scope,
            tuple(bytes.fromhex(k) for k in t["key_ids"]),
            datetime.fromisoformat(t["erased_at"]),
        )
        ks = self.ks
        with ks.memories.locked(self.ref):
            destroyed = ks.keyring.store.destroy(tombstone.key_ids, tombstone)
        ks.keyring.cache.clear()
        ks.vectors.evict(self.ref)
        if ks.memories.pme is not None:
            ks.memories.pme.forget()
        return {
            "key_ids": t["key_ids"],
            "tombstone_id": tombstone.tombstone_id,
            "at": t["erased_at"],
            "cache_evicted": 0,
            "present": destroyed,
        }


def _check_request(scope: Any, requested_by: Any, reason: Any, probes: Any) -> None:
    """Types of a request's arguments, checked before anything is recorded (their
    content is judged later: odd text makes a rejected request, not an error)."""
    if scope is not None:
        check_text(scope, "a scope")
    check_text(requested_by, "requested_by")
    check_text(reason, "a reason")
    if isinstance(probes, str) or not isinstance(probes, Sequence):
        raise InvalidInput("probes is a list of strings")
    for probe in probes:
        check_text(probe, "a probe")


class ErasureCoordinator:
    """``ks.erasure``: requests, resumption, status, receipts, holds, processors."""

    def __init__(
        self,
        ks: Keyshred,
        *,
        on_step: Callable[[str, ErasureRequest], None] | None = None,
    ) -> None:
        self._ks = ks
        self._catalog: Catalog = ks.catalog
        self._audit: AuditLog = ks.audit
        self._processors: list[ExternalProcessor] = []
        self.on_step = on_step
        self._lock = threading.Lock()
        self._probes: dict[str, list[str]] = {}

    # -- persistence ---------------------------------------------------------------

    def _load(self, request_id: str) -> ErasureRequest:
        with self._catalog.engine.connect() as conn:
            row = conn.execute(
                sa.select(deletion_requests).where(deletion_requests.c.request_id == request_id)
            ).first()
        if row is None:
            raise NotFound(f"no erasure request {request_id}")
        return ErasureRequest(
            row.request_id,
            row.subject_ref,
            row.scope,
            row.state,
            row.requested_by,
            row.reason,
            utc(row.created_at),  # type: ignore[arg-type]
            utc(row.updated_at),  # type: ignore[arg-type]
            row.attempts,
            json.loads(row.doc),
        )

    def _save(self, req: ErasureRequest, receipt: str | None = None) -> None:
        req.updated_at = _now()
        values: dict[str, Any] = {
            "state": req.state,
            "updated_at": req.updated_at,
            "attempts": req.attempts,
            "doc": json.dumps(req.doc, sort_keys=True),
        }
        if receipt is not None:
            values["receipt"] = receipt
        with self._catalog.transaction() as conn:
            conn.execute(
                deletion_requests.update()
                .where(deletion_requests.c.request_id == req.request_id)
                .values(**values)
            )

    def _set_state(self, req: ErasureRequest, state: str, **data: Any) -> None:
        if req.state != state:
            req.state = state
            self._save(req)
            self._audit.record(
                "erasure.state",
                subject_ref=req.subject_ref,
                request_id=req.request_id,
                state=state,
                **data,
            )
            self._ks.metrics.state(state)

    # -- the API -------------------------------------------------------------------

    def request(
        self,
        subject_ref: str,
        scope: str | None,
        *,
        requested_by: str,
        reason: str,
        request_id: str | None = None,
        probes: Sequence[str] = (),
        assets: Sequence[str] | None = None,
        kind: str = "erasure",
    ) -> ErasureRequest:
        """Record a request (idempotent by ``request_id``) without running it.

        ``assets`` narrows the request to exactly those memory assets of the subject
        (the retention scanner's requests): they are deleted physically with their
        vectors and catalog rows and derived assets are rebuilt, but no key is
        destroyed (the scope's other memories share it) and the subject stays active.
        """
        _check_request(scope, requested_by, reason, probes)
        request_id = request_id or uuid.uuid4().hex
        _safe("request id", request_id)
        if scope is not None and not scope.startswith("~"):  # "~…": internal key scopes
            self._ks.policy.scope(scope)
        try:
            existing = self._load(request_id)
        except NotFound:
            pass
        else:
            if existing.subject_ref != subject_ref or existing.scope != scope:
                raise InvalidInput(f"request {request_id} exists for another subject or scope")
            return existing
        now = _now()
        doc: dict[str, Any] = {"done": [], "details": {}, "kind": _safe("kind", kind)}
        if assets is not None:
            doc["assets"] = sorted({_safe("asset id", a) for a in assets})
        if probes:
            # Probe strings stay in this process's memory only: written into the
            # request row they would sit in the catalog's pages and WAL (the drill's
            # byte scan found exactly that). A resumed request verifies without them.
            self._probes[request_id] = list(probes)
        valid = bool(_SAFE_TEXT.fullmatch(requested_by or "")) and bool(
            _SAFE_TEXT.fullmatch(reason or "")
        )
        with self._catalog.transaction() as conn:
            conn.execute(
                deletion_requests.insert().values(
                    request_id=request_id,
                    subject_ref=subject_ref,
                    scope=scope,
                    state=REQUESTED,
                    requested_by=requested_by if valid else "invalid",
                    reason=reason if valid else "invalid",
                    created_at=now,
                    updated_at=now,
                    attempts=0,
                    doc=json.dumps(doc),
                    receipt=None,
                )
            )
        self._audit.record(
            "erasure.requested",
            subject_ref=subject_ref,
            request_id=request_id,
            scope=scope,
            requested_by=requested_by if valid else "invalid",
        )
        self._ks.metrics.state(REQUESTED)
        req = self._load(request_id)
        if not valid:
            self._set_state(req, REJECTED, why="requested_by and reason must be plain metadata")
        return req

    def status(self, request_id: str) -> ErasureRequest:
        return self._load(request_id)

    def resume(self, request_id: str) -> ErasureRequest:
        return self.run(request_id)

    def requests(self, subject_ref: str | None = None) -> list[ErasureRequest]:
        query = sa.select(deletion_requests.c.request_id).order_by(deletion_requests.c.created_at)
        if subject_ref is not None:
            query = query.where(deletion_requests.c.subject_ref == subject_ref)
        with self._catalog.engine.connect() as conn:
            ids = list(conn.execute(query).scalars())
        return [self._load(i) for i in ids]

    def receipt(self, request_id: str) -> Receipt | None:
        with self._catalog.engine.connect() as conn:
            text = conn.execute(
                sa.select(deletion_requests.c.receipt).where(
                    deletion_requests.c.request_id == request_id
                )
            ).scalar()
        return None if text is None else load_receipt(text)

    def residue_scan(
        self, probes: Sequence[str], paths: Sequence[str | os.PathLike[str]]
    ) -> ResidueReport:
        """Search every file under ``paths`` (a data folder, backups, exports) for
        the probes, raw and decrypted with every key the live keyring still opens
        (``keyshred.residue``); the report holds probe indexes, never probes."""
        from keyshred.residue import residue_scan

        return residue_scan(self._ks, probes, paths)

    def register_processor(self, processor: ExternalProcessor) -> None:
        _safe("processor name", processor.name)
        self._processors.append(processor)

    # -- legal holds ---------------------------------------------------------------

    def place_hold(
        self, subject_ref: str, *, reason: str, owner: str, scope: str | None = None
    ) -> Hold:
        hold = Hold(
            uuid.uuid4().hex,
            subject_ref,
            scope,
            _safe("reason", reason),
            _safe("owner", owner),
            _now(),
            None,
        )
        with self._catalog.transaction() as conn:
            conn.execute(
                legal_holds.insert().values(
                    hold_id=hold.hold_id,
                    subject_ref=subject_ref,
                    scope=scope,
                    reason=hold.reason,
                    owner=hold.owner,
                    placed_at=hold.placed_at,
                    released_at=None,
                )
            )
        self._audit.record(
            "hold.placed", subject_ref=subject_ref, hold_id=hold.hold_id, scope=scope, owner=owner
        )
        return hold

    def release_hold(self, hold_id: str) -> None:
        with self._catalog.transaction() as conn:
            n = conn.execute(
                legal_holds.update()
                .where(legal_holds.c.hold_id == hold_id, legal_holds.c.released_at.is_(None))
                .values(released_at=_now())
            ).rowcount
        if not n:
            raise NotFound(f"no active hold {hold_id}")
        self._audit.record("hold.released", hold_id=hold_id)

    def holds(self, subject_ref: str, scope: str | None = None) -> list[Hold]:
        """Active holds covering the subject (or the scope)."""
        with self._catalog.engine.connect() as conn:
            rows = conn.execute(
                sa.select(legal_holds).where(
                    legal_holds.c.subject_ref == subject_ref,
                    legal_holds.c.released_at.is_(None),
                )
            ).all()
        return [
            Hold(r.hold_id, r.subject_ref, r.scope, r.reason, r.owner, utc(r.placed_at), None)  # type: ignore[arg-type]
            for r in rows
            if r.scope is None or scope is None or r.scope == scope
        ]

    # -- running -------------------------------------------------------------------

    def run(self, request_id: str) -> ErasureRequest:
        """Run (or resume) a request until it completes, waits on a hold, or fails."""
        with self._lock:
            req = self._load(request_id)
            if req.state in (COMPLETED, REJECTED):
                return req
            if req.state == MANUAL_REVIEW:
                return req
            if req.state == REQUESTED:
                self._set_state(req, AUTHORIZED, requested_by=req.requested_by)
            if "destroy_keys" not in req.steps_done and self._extent(req).holds_apply:
                holds = self.holds(req.subject_ref, req.scope)
                if holds:
                    req.doc["held"] = True
                    self._set_state(req, LEGAL_HOLD, holds=[h.hold_id for h in holds])
                    return req
            req.attempts += 1
            if req.attempts > 1:
                self._ks.metrics.retry()
            if req.attempts > MAX_ATTEMPTS:
                self._set_state(req, MANUAL_REVIEW, why="too many attempts")
                return req
            self._save(req)
            for step in STEPS:
                if step in req.steps_done:
                    continue
                try:
                    details = getattr(self, f"_step_{step}")(req)
                except VerificationFailed as exc:
                    req.doc["error"] = str(exc)
                    self._set_state(req, MANUAL_REVIEW, step=step)
                    return req
                except (KeyshredError, OSError, sa.exc.SQLAlchemyError) as exc:
                    req.doc["error"] = f"{step}: {type(exc).__name__}"
                    self._ks.metrics.failure(step)
                    self._set_state(req, RETRYABLE, step=step, error=type(exc).__name__)
                    return req
                req.doc["details"][step] = details
                req.doc["done"].append(step)
                req.doc.pop("error", None)
                self._save(req)
                self._set_state(req, _STATE_AFTER[step], step=step)
                if self.on_step is not None:
                    self.on_step(step, req)
            return req

    # -- steps ---------------------------------------------------------------------

    def _extent(self, req: ErasureRequest) -> _Extent:
        """How this request's steps differ from a subject or scope erasure."""
        if "replay" in req.doc:
            return _ReplayExtent(self._ks, req)
        if "assets" in req.doc:
            return _AssetsExtent(self._ks, req)
        return _Extent(self._ks, req)

    def _step_suppress(self, req: ErasureRequest) -> dict[str, Any]:
        return self._extent(req).suppress()

    def _step_closure(self, req: ErasureRequest) -> dict[str, Any]:
        extent = self._extent(req)
        own = extent.own_assets()
        own_ids = set(own)
        closure: list[str] = []
        seen = set(own_ids)
        frontier: set[str] = set()
        # First level by one join on the subject; further levels (derived from
        # derived) by the few ids found.
        level = [a for a in extent.first_level() if a.asset_id not in seen]
        holders: dict[str, list[str]] = {}
        while frontier or level:
            derived = self._catalog.derived_from(frontier) if frontier else []
            nxt = [a for a in [*level, *derived] if a.asset_id not in seen]
            level = []
            frontier = set()
            for a in nxt:
                if a.asset_id in seen or a.kind == "vector":
                    continue
                seen.add(a.asset_id)
                closure.append(a.asset_id)
                frontier.add(a.asset_id)
                holders.setdefault(a.subject_ref, []).append(a.asset_id)
        counts: dict[str, int] = {}
        for kind in own.values():
            counts[kind] = counts.get(kind, 0) + 1
        shared = self._shared_assets(req, holders)
        return {"own": sorted(own_ids), "own_counts": counts, "closure": closure, "shared": shared}

    def _shared_assets(
        self, req: ErasureRequest, holders: dict[str, list[str]]
    ) -> list[dict[str, Any]]:
        """For each co-owned key the request destroyed, the assets of its holder it
        made unreadable: the closure's assets of that holder whose rows are sealed
        under it (read from the rows' key ids; no key is needed)."""
        keys = req.doc["details"]["destroy_keys"].get("shared_keys", [])
        by_holder: dict[str, dict[str, list[str]]] = {}
        for key_hex, holder in keys:
            by_holder.setdefault(holder, {})[key_hex] = []
        for holder, wanted in by_holder.items():
            ids = holders.get(holder, [])
            if not ids:
                continue
            rows = self._ks.memories.rows_by_id(holder, ids, opaque=True)
            for asset_id in sorted(rows):
                key_id = row_key_id(rows[asset_id])
                if key_id is not None and key_id.hex() in wanted:
                    wanted[key_id.hex()].append(asset_id)
        return [
            {"key_id": key_hex, "holder_subject_ref": holder, "assets": assets}
            for holder, wanted in sorted(by_holder.items())
            for key_hex, assets in sorted(wanted.items())
        ]

    def _step_destroy_keys(self, req: ErasureRequest) -> dict[str, Any]:
        return self._extent(req).destroy_keys()

    def replay(self, tombstone: Tombstone) -> ErasureRequest:
        """Replay a tombstone from elsewhere (a restore): the same steps as an
        erasure, without holds, external calls, backup deletion or a receipt."""
        request_id = f"replay-{tombstone.tombstone_id}"
        req = self.request(
            tombstone.subject_ref,
            tombstone.scope,
            requested_by="backup-restore",
            reason="tombstone-replay",
            request_id=request_id,
        )
        if "replay" not in req.doc:
            req.doc["replay"] = {
                "tombstone_id": tombstone.tombstone_id,
                "key_ids": [k.hex() for k in tombstone.key_ids],
                "erased_at": _iso(tombstone.erased_at),
            }
            self._save(req)
        return self.run(request_id)

    def _step_drop_memories(self, req: ErasureRequest) -> dict[str, Any]:
        return {"count": self._extent(req).drop_memories(), "at": _iso(_now())}

    def _step_drop_vectors(self, req: ErasureRequest) -> dict[str, Any]:
        return {"count": self._extent(req).drop_vectors(), "at": _iso(_now())}

    def _step_drop_tokens(self, req: ErasureRequest) -> dict[str, Any]:
        return {"count": self._extent(req).drop_tokens(), "at": _iso(_now())}

    def _step_drop_checkpoints(self, req: ErasureRequest) -> dict[str, Any]:
        return {"count": self._extent(req).drop_checkpoints(), "at": _iso(_now())}

    def _step_catalog(self, req: ErasureRequest) -> dict[str, Any]:
        assets, consents = self._extent(req).drop_catalog()
        return {"assets": assets, "consents": consents, "at": _iso(_now())}

    def _step_derived(self, req: ErasureRequest) -> dict[str, Any]:
        erased = set(req.doc["details"]["closure"]["own"])
        done: list[dict[str, Any]] = list(req.doc.get("derived_done", []))
        handled = {d["asset_id"] for d in done}
        for asset_id in req.doc["details"]["closure"]["closure"]:
            if asset_id in handled:
                continue
            asset = self._catalog.asset(asset_id)
            if asset is None:
                continue  # already gone (dropped earlier, or erased with its owner)
            action = self._rebuild_one(req, asset, erased)
            if action is not None:
                done.append(action)
                req.doc["derived_done"] = done
                self._save(req)
            erased.add(asset_id) if action and action["action"] == "dropped" else None
        return {"actions": done}

    def _rebuild_one(
        self, req: ErasureRequest, asset: AssetRow, erased: set[str]
    ) -> dict[str, Any] | None:
        owner = asset.subject_ref
        if owner == req.subject_ref and self._extent(req).whole_subject:
            return None  # the subject's own derived assets go with it
        try:
            self._catalog.check_guard(owner)
        except SubjectSuppressed:
            return None  # its owner is being erased too; that erasure takes it
        derived = self._ks.derived
        remaining = [s for s in asset.sources if s not in erased]
        mentions = [m for m in asset.mentions if m != req.subject_ref or req.scope is not None]
        rebuild = derived.rebuilder(asset.producer, asset.producer_version)
        # Opaque too: its shared key went with the subject's; rebuilt (sealed under
        # the key of its remaining owners) or dropped like a readable one.
        rows = self._ks.memories.rows_by_id(owner, [asset.asset_id], opaque=True)
        row = rows.get(asset.asset_id)
        if row is None:
            return None
        at = _iso(_now())
        base = {
            "asset_id": asset.asset_id,
            "kind": asset.kind,
            "owner_subject_ref": owner,
            "producer": asset.producer,
            "producer_version": asset.producer_version,
            "at": at,
        }
        value = None
        if rebuild is not None and remaining:
            sources = self._source_memories(remaining)
            value = rebuild(sources)
        if value is None:
            self._ks.memories.delete_by_id(owner, asset.asset_id)
            return {**base, "action": "dropped"}
        produced_by = (asset.kind, asset.producer, asset.producer_version)
        try:
            self._ks.memories.rebuild(
                owner, row, value, sources=remaining, mentions=mentions, produced_by=produced_by
            )
        except SubjectSuppressed:
            # Another subject it is about (a mention, a source's owner) is being
            # erased at the same time: no new copy is made under a key that erasure
            # may already have passed. Dropped, the safe way (the owner was checked
            # above, so it is not the holder that is refused).
            self._ks.memories.delete_by_id(owner, asset.asset_id)
            return {**base, "action": "dropped"}
        return {**base, "action": "rebuilt"}

    def _source_memories(self, ids: Sequence[str]) -> list[Memory]:
        by_owner: dict[str, list[str]] = {}
        for asset_id in ids:
            a = self._catalog.asset(asset_id)
            if a is not None:
                by_owner.setdefault(a.subject_ref, []).append(asset_id)
        out: list[Memory] = []
        for owner, owned in by_owner.items():
            try:
                self._catalog.check_guard(owner)
            except SubjectSuppressed:
                continue
            rows = self._ks.memories.rows_by_id(owner, owned)
            out += [self._ks.memories.memory(rows[i]) for i in owned if i in rows]
        return out

    def _step_external(self, req: ErasureRequest) -> dict[str, Any]:
        if not self._extent(req).calls_processors:
            return {"calls": []}
        calls = list(req.doc.get("external_done", []))
        answered = {c["processor"] for c in calls}
        for processor in self._processors:
            if processor.name in answered:
                continue
            answer = processor.delete(req.subject_ref, req.scope)
            calls.append(
                {
                    "processor": processor.name,
                    "status": "acknowledged" if answer.verified else "deletion_not_verifiable",
                    "detail": answer.detail[:256],
                    "at": _iso(_now()),
                }
            )
            req.doc["external_done"] = calls
            self._save(req)
            self._audit.record(
                "erasure.external",
                subject_ref=req.subject_ref,
                request_id=req.request_id,
                processor=processor.name,
                verified=answer.verified,
            )
        return {"calls": calls}

    def _step_tombstone(self, req: ErasureRequest) -> dict[str, Any]:
        keys = req.doc["details"]["destroy_keys"]
        store = self._ks.keyring.store
        for key_hex in keys["key_ids"]:
            if store.tombstone_for(bytes.fromhex(key_hex)) is None:
                raise KeyshredError(f"no tombstone for key {key_hex}")
        return {"tombstone_id": keys["tombstone_id"], "keys": len(keys["key_ids"])}

    def _step_backups(self, req: ErasureRequest) -> dict[str, Any]:
        if not self._extent(req).deletes_backups:
            return {"targets": 0, "objects_deleted": 0}
        keys = req.doc["details"]["destroy_keys"]
        if not keys["key_ids"]:
            return {"targets": 0, "objects_deleted": 0}
        tombstone = self._ks.keyring.store.tombstone_for(bytes.fromhex(keys["key_ids"][0]))
        if tombstone is None:
            raise KeyshredError("the tombstone is missing")
        return self._ks.backup.on_erasure(tombstone, whole_subject=req.scope is None)

    def _step_verify(self, req: ErasureRequest) -> dict[str, Any]:
        checks: list[dict[str, Any]] = []

        def check(name: str, passed: bool, detail: str) -> None:
            checks.append({"name": name, "passed": passed, "detail": detail})

        keys = req.doc["details"]["destroy_keys"]["key_ids"]
        unwrapped = []
        for key_hex in keys:
            try:
                self._ks.keyring.data_key_by_id(bytes.fromhex(key_hex))
                unwrapped.append(key_hex)
            except (SubjectErased, KeyNotFound):
                pass
        check("keys fail to unwrap", not unwrapped, f"{len(keys)} keys raise SubjectErased")

        extent = self._extent(req)
        swept = extent.sweep_keys()
        if swept is not None:
            if swept:
                req.doc["swept_keys"] = sorted({*req.doc.get("swept_keys", []), *swept})
                # Their wrapped copies sit in pages under the live epoch of now.
                req.doc["swept_residue_until"] = _iso(self._ks.backup.live_residue_until())
                self._save(req)
            left = extent.keys_left()
            check(
                "no key held or co-owned by the subject left",
                not left,
                f"{left} keys left; {len(req.doc.get('swept_keys', []))} made during the "
                "erasure destroyed",
            )
        extent.verify_stores(check)
        own = extent.own_assets()
        check("catalog holds no asset", not own, f"{len(own)} assets left")
        if extent.drops_tokens:
            tokens_left = self._ks.vault.count(req.subject_ref, req.scope)
            check("tokens unresolvable and removed", not tokens_left, f"{tokens_left} tokens left")
        if extent.whole_subject:
            threads_left = self._ks.checkpoints.count(req.subject_ref)
            check("no thread or checkpoint left", not threads_left, f"{threads_left} rows left")
        erased = req.doc["details"]["closure"]["own"]
        still = self._catalog.any_source_in(erased)
        check("no provenance points at erased assets", not still, f"{still} edges")
        if extent.whole_subject:
            mentions = self._catalog.mentioning(req.subject_ref)
            check("no asset mentions the subject", not mentions, f"{len(mentions)} assets")
            ids = self._catalog.count_identifiers(req.subject_ref)
            check("no registered identifier left", not ids, f"{ids} identifiers")

        probes = [p for p in self._probes.pop(req.request_id, []) if p]
        if probes:
            hits = self._probe_hits(req, probes)
            check("probes found nowhere (key and semantic search)", not hits, f"{hits} hits")
        failed = [c["name"] for c in checks if not c["passed"]]
        if failed:
            raise VerificationFailed("verification failed: " + ", ".join(failed))
        return {"checks": checks}

    def _probe_hits(self, req: ErasureRequest, probes: Sequence[str]) -> int:
        """Search every remaining subject that shared derived assets with the erased
        one, by value and by meaning, for the probe strings."""
        owners = set()
        for action in req.doc.get("derived_done", []):
            owners.add(action["owner_subject_ref"])
        owners.discard(req.subject_ref)
        hits = 0
        memories = self._ks.memories
        for owner in owners:
            try:
                self._catalog.check_guard(owner)
            except SubjectSuppressed:
                continue
            part_rows = memories.rows_by_id(owner, [])  # loads the partition
            del part_rows
            part = memories._partition(owner)
            values = [r.value for r in part.rows.values()]
            hits += sum(1 for v in values for p in probes if p.encode() in v)
            indexed = [r for r in part.rows.values() if r.index]
            if indexed and memories.vectors is not None and memories.vectors.count(owner):
                for probe in probes:
                    q = memories.embedder.embed_query(probe)
                    for mid, _ in memories.vectors.search(owner, q, 5):
                        row = next((r for r in indexed if r.memory_id == mid), None)
                        if row is not None and any(p.encode() in row.value for p in probes):
                            hits += 1
        return hits

    def _step_receipt(self, req: ErasureRequest) -> dict[str, Any]:
        d = req.doc["details"]
        keys = d["destroy_keys"]
        completed = _now()
        extent = self._extent(req)
        if not extent.signs_receipt:
            extent.finish()
            self._audit.record(
                "erasure.replayed",
                subject_ref=req.subject_ref,
                request_id=req.request_id,
                keys=len(keys["key_ids"]),
            )
            return {"at": _iso(completed)}
        stores = [
            StoreAction(
                store="keyring", action="keys-destroyed", count=len(keys["key_ids"]), at=keys["at"]
            ),
            StoreAction(
                store="memories",
                action=extent.memories_action,
                count=d["drop_memories"]["count"],
                at=d["drop_memories"]["at"],
            ),
            StoreAction(
                store="vectors",
                action=extent.vectors_action,
                count=d["drop_vectors"]["count"],
                at=d["drop_vectors"]["at"],
            ),
            StoreAction(
                store="vault",
                action="tokens-deleted",
                count=d["drop_tokens"]["count"],
                at=d["drop_tokens"]["at"],
            ),
            StoreAction(
                store="checkpoints",
                action="threads-deleted",
                count=d.get("drop_checkpoints", {}).get("count", 0),
                at=d.get("drop_checkpoints", {}).get("at", d["catalog"]["at"]),
            ),
            StoreAction(
                store="catalog",
                action="assets-deleted",
                count=d["catalog"]["assets"],
                at=d["catalog"]["at"],
            ),
        ]
        if d.get("backups", {}).get("targets"):
            stores.append(
                StoreAction(
                    store="backups",
                    action="segments-deleted-all-versions"
                    if req.scope is None
                    else "tombstone-journaled",
                    count=d["backups"]["objects_deleted"],
                    at=d["backups"]["at"],
                )
            )
        for kind, n in sorted(d["closure"]["own_counts"].items()):
            stores.append(
                StoreAction(
                    store="catalog", action=f"{kind}-assets", count=n, at=d["catalog"]["at"]
                )
            )
        req.doc["found_data"] = _found_data(d)
        receipt = Receipt(
            found_data=req.doc["found_data"],
            request_id=req.request_id,
            subject_ref=req.subject_ref,
            scope=req.scope,
            requested_by=req.requested_by,
            reason=req.reason,
            requested_at=req.created_at,
            suppressed_at=d["suppress"]["at"],
            keys_destroyed_at=keys["at"],
            online_erased_at=keys["at"],
            completed_at=completed,
            key_ids=keys["key_ids"],
            tombstone_id=keys["tombstone_id"],
            live_residue_until=max(
                (
                    datetime.fromisoformat(t)
                    for t in (
                        keys.get("live_residue_until") if keys["key_ids"] else None,
                        req.doc.get("swept_residue_until"),
                    )
                    if t
                ),
                default=None,
            ),
            stores=stores,
            derived=[DerivedAction(**a) for a in d["derived"]["actions"]],
            external=[ExternalCall(**c) for c in d["external"]["calls"]],
            verification=[Check(**c) for c in d["verify"]["checks"]],
            backups=extent.backup_coverage(
                datetime.fromisoformat(keys["at"]), d.get("backups", {}).get("objects_deleted", 0)
            ),
            legal_hold_history=bool(req.doc.get("held")),
            kind=req.doc.get("kind", "erasure"),
            assets=list(req.doc.get("assets", [])),
            shared_keys=[SharedKey(**k) for k in d["closure"].get("shared", [])],
        )
        signed = sign_receipt(receipt, self._ks.keyring.signer())
        extent.finish()
        self._save(req, receipt=signed.to_json())
        self._ks.metrics.completion_latency((completed - req.created_at).total_seconds())
        self._audit.record(
            "erasure.completed",
            subject_ref=req.subject_ref,
            request_id=req.request_id,
            keys=len(keys["key_ids"]),
            derived=len(d["derived"]["actions"]),
        )
        return {"at": _iso(completed)}

    # -- re-admission --------------------------------------------------------------

    def readmit(self, subject_ref: str) -> None:
        """Let an erased subject return (new keys; old data stays erased; jobs that
        carry an epoch from before the erasure stay refused)."""
        self._catalog.set_guard(subject_ref, ACTIVE)
        self._audit.record("subject.readmitted", subject_ref=subject_ref)
