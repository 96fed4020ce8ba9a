"""The audit log: append-only, hash-chained events that hold metadata only.

Each event stores ``hash = SHA-256(prev_hash || canonical JSON of the event)``;
``verify`` recomputes the chain and raises ``IntegrityError`` naming the first event
that was edited, removed or reordered. Events carry subject_refs, request ids, asset
counts, states, timings: never a subject id, a value or key material (``record``
refuses values that are not plain metadata types).

Retention: ``prune(before)`` deletes old events and records an anchor (the hash of
the last pruned event) so the remaining chain still verifies from its first event.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from keyshred import db
from keyshred.db import utc
from keyshred.errors import IntegrityError, InvalidInput
from keyshred.schema import audit_anchor, audit_events
from keyshred.storage.catalog import Catalog

__all__ = ["AuditEvent", "AuditLog"]

GENESIS = "0" * 64
_SAFE = (str, int, float, bool, type(None))


@dataclass(frozen=True, slots=True)
class AuditEvent:
    seq: int
    at: datetime
    event: str
    subject_ref: str | None
    request_id: str | None
    data: dict[str, Any]
    prev_hash: str
    hash: str


def _canonical(at: datetime, event: str, ref: str | None, rid: str | None, data: str) -> bytes:
    doc = [at.astimezone(UTC).isoformat(timespec="microseconds"), event, ref, rid, data]
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _check_metadata(data: Mapping[str, Any]) -> None:
    for key, value in data.items():
        if isinstance(value, Mapping):
            _check_metadata(value)
        elif isinstance(value, list | tuple):
            if not all(isinstance(v, _SAFE) for v in value):
                raise InvalidInput(f"audit field {key!r} holds a non-metadata value")
        elif not isinstance(value, _SAFE):
            raise InvalidInput(f"audit field {key!r} holds a non-metadata value")


def _last_hash(conn: Any) -> str:
    """The hash the next event chains to: the newest event's, or after a prune the
    anchor's (or the genesis value of an empty log). On PostgreSQL the transaction
    first takes the chain's lock: writers in other processes wait for its commit."""
    if conn.dialect.name == "postgresql":
        db.advisory_xact_lock(conn, db.AUDIT_LOCK)
    last = conn.execute(
        sa.select(audit_events.c.hash).order_by(audit_events.c.seq.desc()).limit(1)
    ).scalar()
    if last is None:
        last = conn.execute(sa.select(audit_anchor.c.last_hash)).scalar() or GENESIS
    return str(last)


class AuditLog:
    """Hash-chained events in the catalog database."""

    def __init__(self, catalog: Catalog, *, retention_days: int = 2190) -> None:
        self.retention_days = retention_days
        self._engine = catalog.engine
        self._catalog = catalog
        self._lock = threading.Lock()

    def record(
        self,
        event: str,
        *,
        subject_ref: str | None = None,
        request_id: str | None = None,
        **data: Any,
    ) -> AuditEvent:
        _check_metadata(data)
        body = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
        with self._lock, self._catalog.transaction() as conn:
            last = _last_hash(conn)
            at = datetime.now(UTC)
            digest = hashlib.sha256(
                last.encode() + _canonical(at, event, subject_ref, request_id, body)
            ).hexdigest()
            seq = conn.execute(
                audit_events.insert().values(
                    at=at,
                    event=event,
                    subject_ref=subject_ref,
                    request_id=request_id,
                    data=body,
                    prev_hash=last,
                    hash=digest,
                )
            ).inserted_primary_key[0]
        return AuditEvent(int(seq), at, event, subject_ref, request_id, data, last, digest)

    def record_many(
        self, event: str, items: Sequence[Mapping[str, Any]], *, subject_ref: str | None = None
    ) -> int:
        """Record one ``event`` per item of ``items`` (each the event's data), chained
        in order, in one transaction (a batch deletion of thousands of memories
        would otherwise commit thousands of times); returns how many."""
        bodies = []
        for data in items:
            _check_metadata(data)
            bodies.append(json.dumps(data, sort_keys=True, separators=(",", ":"), default=str))
        if not bodies:
            return 0
        with self._lock, self._catalog.transaction() as conn:
            last = _last_hash(conn)
            rows = []
            for body in bodies:
                at = datetime.now(UTC)
                digest = hashlib.sha256(
                    last.encode() + _canonical(at, event, subject_ref, None, body)
                ).hexdigest()
                rows.append(
                    {
                        "at": at,
                        "event": event,
                        "subject_ref": subject_ref,
                        "request_id": None,
                        "data": body,
                        "prev_hash": last,
                        "hash": digest,
                    }
                )
                last = digest
            # One statement per row, in order: the chain follows the sequence numbers.
            for row in rows:
                conn.execute(audit_events.insert().values(**row))
        return len(rows)

    def events(
        self,
        *,
        subject_ref: str | None = None,
        request_id: str | None = None,
        event: str | None = None,
    ) -> list[AuditEvent]:
        query = sa.select(audit_events).order_by(audit_events.c.seq)
        if event is not None:
            query = query.where(audit_events.c.event == event)
        if subject_ref is not None:
            query = query.where(audit_events.c.subject_ref == subject_ref)
        if request_id is not None:
            query = query.where(audit_events.c.request_id == request_id)
        with self._engine.connect() as conn:
            rows = conn.execute(query).all()
        return [
            AuditEvent(
                r.seq,
                utc(r.at),  # type: ignore[arg-type]
                r.event,
                r.subject_ref,
                r.request_id,
                json.loads(r.data),
                r.prev_hash,
                r.hash,
            )
            for r in rows
        ]

    def verify(self) -> int:
        """Recompute the chain; returns the number of events checked."""
        with self._engine.connect() as conn:
            anchor = conn.execute(sa.select(audit_anchor)).first()
            rows = conn.execute(sa.select(audit_events).order_by(audit_events.c.seq)).all()
        expected = anchor.last_hash if anchor is not None else GENESIS
        previous_seq = anchor.pruned_through if anchor is not None else 0
        for r in rows:
            if r.seq <= previous_seq:
                raise IntegrityError(f"audit event {r.seq} is out of order")
            if r.prev_hash != expected:
                raise IntegrityError(f"audit chain broken at event {r.seq} (removed or reordered)")
            digest = hashlib.sha256(
                r.prev_hash.encode()
                + _canonical(utc(r.at), r.event, r.subject_ref, r.request_id, r.data)  # type: ignore[arg-type]
            ).hexdigest()
            if digest != r.hash:
                raise IntegrityError(f"audit event {r.seq} was edited")
            expected, previous_seq = r.hash, r.seq
        return len(rows)

    def apply_retention(self, now: datetime | None = None) -> int:
        """Prune events older than ``audit.retention_days``."""
        now = now or datetime.now(UTC)
        return self.prune(now - timedelta(days=self.retention_days))

    def prune(self, before: datetime) -> int:
        """Delete events older than ``before`` (audit retention), keeping an anchor."""
        with self._lock, self._catalog.transaction() as conn:
            doomed = conn.execute(
                sa.select(audit_events.c.seq, audit_events.c.hash)
                .where(audit_events.c.at < before)
                .order_by(audit_events.c.seq.desc())
                .limit(1)
            ).first()
            if doomed is None:
                return 0
            n = conn.execute(audit_events.delete().where(audit_events.c.seq <= doomed.seq)).rowcount
            conn.execute(audit_anchor.delete())
            conn.execute(
                audit_anchor.insert().values(
                    id=1,
                    pruned_through=doomed.seq,
                    last_hash=doomed.hash,
                    pruned_at=datetime.now(UTC),
                )
            )
            return int(n)
