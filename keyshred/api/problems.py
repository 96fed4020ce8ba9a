"""Errors as RFC 9457 problem documents (``application/problem+json``).

``Problem`` is what a handler raises on purpose; ``from_error`` maps keyshred's
error tree onto statuses (bad input 400/422, not found 404, a suppressed subject
409, a backend down 503 ...). Every ``detail`` is a fixed sentence or an id that
is safe to log: a ``KeyshredError``'s message names ids and settings, never a
subject id or value, but it is still not echoed for errors raised while reading a
subject's data (the fixed text of its class is given instead).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from keyshred.errors import (
    BackendUnavailable,
    ConfigError,
    ConsentRequired,
    HandleClosed,
    IntegrityError,
    InvalidInput,
    KekUnavailable,
    KeyNotFound,
    KeyshredError,
    NotFound,
    StorageFull,
    SubjectErased,
    SubjectSuppressed,
    TokenExpired,
    UnknownScope,
    ValueTooLarge,
)

__all__ = ["PROBLEM_JSON", "Problem", "from_error"]

PROBLEM_JSON = "application/problem+json"
_BASE = "https://keyshred.dev/problems/"


class Problem(Exception):
    """An HTTP error answer: status, a short type slug, a fixed title and detail."""

    def __init__(
        self,
        status: int,
        slug: str,
        title: str,
        detail: str | None = None,
        *,
        headers: dict[str, str] | None = None,
        errors: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(title)
        self.status = status
        self.slug = slug
        self.title = title
        self.detail = detail
        self.headers = headers or {}
        self.errors = errors

    def body(self, instance: str | None = None) -> dict[str, Any]:
        doc: dict[str, Any] = {"type": _BASE + self.slug, "title": self.title}
        doc["status"] = self.status
        if self.detail is not None:
            doc["detail"] = self.detail
        if instance is not None:
            doc["instance"] = instance
        if self.errors is not None:
            doc["errors"] = self.errors
        return doc


# Most specific first: the first class an error is an instance of decides.
_MAP: tuple[tuple[type[KeyshredError], int, str, str], ...] = (
    (UnknownScope, 422, "unknown-scope", "The scope is not declared"),
    (ValueTooLarge, 413, "too-large", "A value is larger than allowed"),
    (InvalidInput, 422, "invalid-input", "The request is not valid"),
    (NotFound, 404, "not-found", "No such resource"),
    (KeyNotFound, 404, "not-found", "No such resource"),
    (SubjectErased, 409, "subject-erased", "The subject is erased"),
    (SubjectSuppressed, 409, "subject-suppressed", "The subject is suppressed or erased"),
    (ConsentRequired, 409, "consent-required", "No active consent covers this"),
    (TokenExpired, 410, "expired", "It has expired"),
    (BackendUnavailable, 503, "backend-unavailable", "A backend cannot be reached"),
    (KekUnavailable, 503, "kek-unavailable", "The KEK provider cannot be reached"),
    (HandleClosed, 503, "closing", "The service is shutting down"),
    (StorageFull, 507, "storage-full", "The storage is full"),
    (IntegrityError, 500, "integrity", "A stored record failed authentication"),
    (ConfigError, 500, "configuration", "The service is misconfigured"),
)
# Errors whose message is safe and useful to give back (they name settings,
# lengths and expected forms, never the value).
_ECHOED = (InvalidInput, NotFound)


def from_error(exc: KeyshredError, given: Iterable[str] = ()) -> Problem:
    """The problem answer for a keyshred error (500 for one not mapped). Its message
    is given back only for input errors, and only if it repeats none of ``given``
    (the strings of the request's body: a scope named wrongly may be anything)."""
    for cls, status, slug, title in _MAP:
        if isinstance(exc, cls):
            detail = None
            if isinstance(exc, _ECHOED) and not isinstance(exc, UnknownScope):
                text = " ".join(str(exc).split())[:300]
                detail = None if any(g in text for g in given if len(g) >= 3) else text
            headers = {"Retry-After": "5"} if status == 503 else None
            return Problem(status, slug, title, detail, headers=headers)
    return Problem(500, "internal", "The request failed", type(exc).__name__)
