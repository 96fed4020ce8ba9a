"""Identifiers: the ``Subject`` a caller names, and safe text forms of key ids.

A subject id is personal data, so ``Subject`` never prints it: its ``repr`` shows the
tenant only. Everything that must name a subject outside the caller's own code uses
its ``subject_ref`` (``Keyshred.subject_ref``).
"""

from __future__ import annotations

from dataclasses import dataclass

from keyshred.errors import InvalidInput

__all__ = ["Subject", "SubjectLike", "as_subject"]


@dataclass(frozen=True, slots=True)
class Subject:
    """A data subject: ``(tenant, id)``. The id never appears in a repr."""

    id: str
    tenant: str = "default"

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise InvalidInput("a subject id must be a non-empty string")
        if not isinstance(self.tenant, str) or not self.tenant:
            raise InvalidInput("a tenant must be a non-empty string")

    def __repr__(self) -> str:
        return f"Subject(tenant={self.tenant!r}, id=<redacted>)"

    __str__ = __repr__


SubjectLike = Subject | str


def as_subject(value: SubjectLike, tenant: str) -> Subject:
    """Accept a ``Subject`` or a bare id (in ``tenant``)."""
    if isinstance(value, Subject):
        return value
    if isinstance(value, str):
        return Subject(value, tenant)
    raise InvalidInput("a subject is a Subject or a subject id string")
