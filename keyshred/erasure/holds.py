"""Legal holds and re-admission (``ks.erasure.place_hold``, ``holds``,
``active_holds``, ``release_hold``, ``readmit``): they take a subject, as ``ks.erase``
does; a caller that holds only its pseudonymous reference passes ``subject_ref=``."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable

import sqlalchemy as sa

from keyshred.audit import AuditLog
from keyshred.db import utc
from keyshred.erasure.pending import erasure_pending
from keyshred.erasure.requests import Hold, now, safe
from keyshred.errors import InvalidInput, NotFound, SubjectSuppressed
from keyshred.ids import SubjectLike
from keyshred.schema import legal_holds
from keyshred.storage.catalog import ACTIVE, ERASED, Catalog

__all__ = ["HoldsMixin"]


# keyshred.keyring.Keyring.subject_ref: 26 characters of lowercase base32.
_REF_SHAPE = re.compile(r"[a-z2-7]{26}")


class HoldsMixin:
    """The hold and re-admission part of ``ErasureCoordinator``."""

    _catalog: Catalog
    _audit: AuditLog
    _ref: Callable[[SubjectLike], str]

    def _one_ref(self, subject: SubjectLike | None, subject_ref: str | None) -> str:
        """The reference of ``subject`` or the given ``subject_ref`` (exactly one)."""
        ref = self._maybe_ref(subject, subject_ref)
        if ref is None:
            raise InvalidInput("a subject (or subject_ref=) is required")
        return ref

    def _maybe_ref(self, subject: SubjectLike | None, subject_ref: str | None) -> str | None:
        if subject is not None and subject_ref is not None:
            raise InvalidInput("pass a subject or subject_ref=, not both")
        if subject is not None:
            if isinstance(subject, str) and _REF_SHAPE.fullmatch(subject):
                # These methods took a subject_ref first before 0.2: an old call
                # would hash the ref into another subject's and, for a hold, let the
                # real subject's erasure go ahead. A ref-shaped id is refused (a
                # subject whose id really looks so passes a ``Subject``).
                raise InvalidInput(
                    "this looks like a subject_ref: pass it as subject_ref=..., or the "
                    "subject itself (as ks.erase takes it)"
                )
            return self._ref(subject)
        if subject_ref is not None and not isinstance(subject_ref, str):
            raise InvalidInput("subject_ref is a string")
        return subject_ref

    def place_hold(
        self,
        subject: SubjectLike | None = None,
        *,
        subject_ref: str | None = None,
        reason: str,
        owner: str,
        scope: str | None = None,
    ) -> Hold:
        """Hold the subject's (scope's) erasure: a request waits in ``legal_hold``
        until the hold is released."""
        ref = self._one_ref(subject, subject_ref)
        hold = Hold(
            uuid.uuid4().hex,
            ref,
            scope,
            safe("reason", reason),
            safe("owner", owner),
            now(),
            None,
        )
        with self._catalog.transaction() as conn:
            conn.execute(
                legal_holds.insert().values(
                    hold_id=hold.hold_id,
                    subject_ref=ref,
                    scope=scope,
                    reason=hold.reason,
                    owner=hold.owner,
                    placed_at=hold.placed_at,
                    released_at=None,
                )
            )
        self._audit.record(
            "hold.placed", subject_ref=ref, hold_id=hold.hold_id, scope=scope, owner=owner
        )
        return hold

    def release_hold(self, hold_id: str) -> None:
        with self._catalog.transaction() as conn:
            n = conn.execute(
                legal_holds.update()
                .where(legal_holds.c.hold_id == hold_id, legal_holds.c.released_at.is_(None))
                .values(released_at=now())
            ).rowcount
        if not n:
            raise NotFound(f"no active hold {hold_id}")
        self._audit.record("hold.released", hold_id=hold_id)

    def holds(
        self,
        subject: SubjectLike | None = None,
        *,
        subject_ref: str | None = None,
        scope: str | None = None,
    ) -> list[Hold]:
        """Active holds covering the subject (or the scope)."""
        ref = self._one_ref(subject, subject_ref)
        with self._catalog.engine.connect() as conn:
            rows = conn.execute(
                sa.select(legal_holds).where(
                    legal_holds.c.subject_ref == ref,
                    legal_holds.c.released_at.is_(None),
                )
            ).all()
        return [
            Hold(r.hold_id, r.subject_ref, r.scope, r.reason, r.owner, utc(r.placed_at), None)  # type: ignore[arg-type]
            for r in rows
            if r.scope is None or scope is None or r.scope == scope
        ]

    def active_holds(self) -> list[Hold]:
        """Every active hold, oldest first (by subject_ref: what the console lists)."""
        with self._catalog.engine.connect() as conn:
            rows = conn.execute(
                sa.select(legal_holds)
                .where(legal_holds.c.released_at.is_(None))
                .order_by(legal_holds.c.placed_at)
            ).all()
        return [
            Hold(r.hold_id, r.subject_ref, r.scope, r.reason, r.owner, utc(r.placed_at), None)  # type: ignore[arg-type]
            for r in rows
        ]

    def readmit(
        self, subject: SubjectLike | None = None, *, subject_ref: str | None = None
    ) -> None:
        """Let an erased subject return (new keys; old data stays erased; jobs that
        carry an epoch from before the erasure stay refused). Refused
        (``SubjectSuppressed``) while an erasure of the subject is under way: its
        suppression holds until it completes (readmitting then would make the data
        it has not destroyed yet readable again)."""
        ref = self._one_ref(subject, subject_ref)
        readmitted = self._catalog.set_guard(
            ref, ACTIVE, only_from=ERASED, unless=lambda conn: erasure_pending(conn, ref)
        )
        if not readmitted and self._catalog.guard(ref).status != ACTIVE:
            raise SubjectSuppressed(
                f"an erasure of subject_ref {ref} is under way: readmit once it is completed"
            )
        self._audit.record("subject.readmitted", subject_ref=ref)
