"""Erasure requests, legal holds, processors' answers and the request states.

States: ``requested → authorized → suppressed → propagating → verifying →
completed``, plus ``rejected``, ``legal_hold`` (an active hold blocks the request and
says so), ``retryable_failure`` (a step failed; ``resume`` continues) and
``manual_review`` (verification failed, too many attempts, or a derived asset whose
producer has no rebuild function registered: ``resume`` continues once it is).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from keyshred._validate import check_text
from keyshred.errors import InvalidInput, KeyshredError

__all__ = [
    "AUTHORIZED",
    "COMPLETED",
    "ERASED",
    "LEGAL_HOLD",
    "MANUAL_REVIEW",
    "MAX_ATTEMPTS",
    "PROPAGATING",
    "REJECTED",
    "REQUESTED",
    "REQUEST_STATES",
    "RETRYABLE",
    "STEPS",
    "SUPPRESSED",
    "VERIFYING",
    "ErasureRequest",
    "ExternalAnswer",
    "ExternalProcessor",
    "Hold",
    "ProducerUnknown",
    "RebuildFailed",
    "VerificationFailed",
    "request_tombstone_id",
]


def request_tombstone_id(request_id: str) -> str:
    """The id of the tombstone a request's key step writes: derived from the
    request's, so that the request resumed finds its own tombstone (and no other)."""
    digest = hashlib.sha256(b"keyshred/request-tombstone\x00" + request_id.encode("utf-8"))
    return digest.hexdigest()[:32]


REQUESTED, AUTHORIZED, SUPPRESSED = "requested", "authorized", "suppressed"
PROPAGATING, VERIFYING, COMPLETED = "propagating", "verifying", "completed"
REJECTED, LEGAL_HOLD = "rejected", "legal_hold"
RETRYABLE, MANUAL_REVIEW = "retryable_failure", "manual_review"
ERASED = "erased"
MAX_ATTEMPTS = 5
# Every state a request can be in, in the order a request goes through them.
REQUEST_STATES = (
    REQUESTED,
    AUTHORIZED,
    SUPPRESSED,
    PROPAGATING,
    VERIFYING,
    COMPLETED,
    REJECTED,
    LEGAL_HOLD,
    RETRYABLE,
    MANUAL_REVIEW,
)

# The steps with the facade's stores (memories, vectors, vault, checkpoints,
# exports; derived assets after the catalog): ``ErasureCoordinator.steps`` builds
# the same sequence from whatever stores it is given.
STEPS = (
    "suppress",
    "destroy_keys",
    "closure",
    "drop_memories",
    "drop_vectors",
    "drop_vault",
    "drop_checkpoints",
    "drop_exports",
    "catalog",
    "derived",
    "external",
    "tombstone",
    "backups",
    "verify",
    "receipt",
)
# Step names of earlier releases, read from requests recorded by them.
LEGACY_STEPS = {"drop_tokens": "drop_vault"}

_SAFE_TEXT = re.compile(r"[A-Za-z0-9 ._:@/+()#,-]{1,128}")


class VerificationFailed(KeyshredError):
    """A verification probe found something of the subject after erasure."""


class ProducerUnknown(KeyshredError):
    """A derived asset must be rebuilt, but no rebuild function is registered for
    its producer and version in this process: the request waits in
    ``manual_review`` until one is (``ks.derived.register_producer`` or the
    start-up registry, ``keyshred.erasure.register_rebuilder``), then ``resume``."""


class RebuildFailed(KeyshredError):
    """A producer's rebuild function raised. A failed step like any other (the
    request is retried, then waits in ``manual_review``), never an exception of
    the application's escaping ``ks.erase``. Only the exception's type name is
    kept (``exception_type``, and in the message): its message, the application's
    text, may hold the personal data the function was rebuilding from."""

    def __init__(self, asset_id: str, producer: str | None, version: str | None, kind: str):
        super().__init__(
            f"derived asset {asset_id}: the rebuild function of producer {producer} "
            f"version {version} raised {kind}"
        )
        self.exception_type = kind


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
    # What this process read or computed for the request and did not record in
    # ``doc`` (its closure's id lists, kept in ``keyshred.erasure.items``).
    cache: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

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


def safe(kind: str, value: str) -> str:
    """``value`` if it is plain metadata (it lands in receipts and audit events)."""
    if not isinstance(value, str) or not _SAFE_TEXT.fullmatch(value):
        raise InvalidInput(
            f"{kind} is 1-128 characters of letters, digits and ._:@/+()#,- "
            "(it lands in receipts and audit events: no personal data)"
        )
    return value


def is_safe(value: str | None) -> bool:
    return bool(_SAFE_TEXT.fullmatch(value or ""))


def check_request(scope: Any, requested_by: Any, reason: Any, probes: Any) -> None:
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


def now() -> datetime:
    return datetime.now(UTC)


def iso(value: datetime) -> str:
    return value.astimezone(UTC).isoformat()
