"""Identifiers: the ``Subject`` a caller names, and safe text forms of key ids.

A subject id is personal data, so ``Subject`` never prints it: its ``repr`` shows the
tenant only. Everything that must name a subject outside the caller's own code uses
its ``subject_ref`` (``Keyshred.subject_ref``).
"""

from __future__ import annotations

from dataclasses import dataclass

from keyshred.errors import InvalidInput

__all__ = [
    "RESERVED_IDS",
    "SHARED_KNOWLEDGE",
    "OwnSubject",
    "Subject",
    "SubjectLike",
    "as_subject",
    "check_not_reserved",
]

# The subject of namespaces that belong to nobody (``KeyshredStore(shared=...)``).
SHARED_KNOWLEDGE = "keyshred.shared-knowledge"
# Ids of keyshred's own subjects. No person may be one: an id that comes from a
# user (a LangGraph config's ``user_id``, an HTTP erasure request) equal to one would
# read, export or erase what belongs to nobody. Only an ``OwnSubject`` names them.
RESERVED_IDS = frozenset({SHARED_KNOWLEDGE})


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


@dataclass(frozen=True, slots=True, repr=False)  # Subject's repr: no id, even this one
class OwnSubject(Subject):
    """One of keyshred's own subjects (``RESERVED_IDS``): the only way to name one.
    Never built from a caller's input."""

    def __post_init__(self) -> None:
        Subject.__post_init__(self)
        if self.id not in RESERVED_IDS:
            raise InvalidInput("an OwnSubject is one of keyshred's reserved subjects")


SubjectLike = Subject | str


def check_not_reserved(subject_id: str) -> None:
    """``InvalidInput`` for a person's id that is one of keyshred's own."""
    if subject_id in RESERVED_IDS:
        raise InvalidInput("this subject id is reserved for keyshred's own subjects")


def as_subject(value: SubjectLike, tenant: str) -> Subject:
    """Accept a ``Subject`` or a bare id (in ``tenant``)."""
    if isinstance(value, Subject):
        return value
    if isinstance(value, str):
        return Subject(value, tenant)
    raise InvalidInput("a subject is a Subject or a subject id string")
