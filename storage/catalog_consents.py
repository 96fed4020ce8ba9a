"""Consent records: grants with their purposes, categories, actions and validity,
kept as history when revoked."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from keyshred.db import utc
from keyshred.errors import InvalidInput
from keyshred.storage.catalog_base import ACTIVE, CatalogBase, ConsentRecord, consent_record
from keyshred.storage.schema import consents

__all__ = ["ConsentsMixin"]


class ConsentsMixin(CatalogBase):
    """Grants, revocations and the consent in force."""

    def grant_consent(
        self,
        subject_ref: str,
        purpose: str,
        category: str,
        *,
        actions: Sequence[str] = ("store", "use"),
        start_at: datetime | None = None,
        end_at: datetime | None = None,
        policy_version: str = "1",
    ) -> ConsentRecord:
        now = datetime.now(UTC)
        start = utc(start_at) or now
        end = utc(end_at)
        if end is not None and end <= start:
            raise InvalidInput("a consent must end after it starts")
        if not actions:
            raise InvalidInput("a consent allows at least one action")
        record = ConsentRecord(
            uuid.uuid4().hex,
            subject_ref,
            purpose,
            category,
            tuple(sorted(set(actions))),
            start,
            end,
            policy_version,
            ACTIVE,
            now,
            None,
        )
        with self._write() as conn:
            conn.execute(
                consents.insert().values(
                    consent_id=record.consent_id,
                    subject_ref=subject_ref,
                    purpose=purpose,
                    category=category,
                    actions=json.dumps(list(record.actions)),
                    start_at=start,
                    end_at=end,
                    policy_version=policy_version,
                    status=ACTIVE,
                    created_at=now,
                    revoked_at=None,
                )
            )
        return record

    def revoke_consent(self, subject_ref: str, purpose: str, category: str) -> int:
        """Mark every active consent for (subject, purpose, category) revoked; the
        records stay as history with their policy versions."""
        now = datetime.now(UTC)
        with self._write() as conn:
            return conn.execute(
                consents.update()
                .where(
                    consents.c.subject_ref == subject_ref,
                    consents.c.purpose == purpose,
                    consents.c.category == category,
                    consents.c.status == ACTIVE,
                )
                .values(status="revoked", revoked_at=now)
            ).rowcount

    def consents(self, subject_ref: str) -> list[ConsentRecord]:
        with self.read() as conn:
            rows = conn.execute(
                sa.select(consents)
                .where(consents.c.subject_ref == subject_ref)
                .order_by(consents.c.created_at)
            ).all()
        return [consent_record(r) for r in rows]

    def active_consent(
        self, subject_ref: str, purpose: str, category: str, action: str, at: datetime
    ) -> ConsentRecord | None:
        params = {
            "subject_ref": subject_ref,
            "purpose": purpose,
            "category": category,
            "active": ACTIVE,
        }
        with self._hot(write=False) as cur:
            cur.execute(self._sql["consents_for"], params)
            names = [d[0] for d in cur.description]
            rows = [_Row(dict(zip(names, r, strict=True))) for r in cur.fetchall()]
        covering = [c for c in map(consent_record, rows) if c.covers(action, at)]
        return max(
            covering, key=lambda c: c.end_at or datetime.max.replace(tzinfo=UTC), default=None
        )

    def delete_consents(self, subject_ref: str) -> int:
        with self._write() as conn:
            return conn.execute(
                consents.delete().where(consents.c.subject_ref == subject_ref)
            ).rowcount


class _Row:
    """Attribute access over a DBAPI row dict (what ``consent_record`` reads)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)
