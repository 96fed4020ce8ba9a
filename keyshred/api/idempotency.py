"""``Idempotency-Key`` on POSTs, recorded in the catalog database.

Per credential (actor) and key: the first call inserts a row (status NULL: running),
then stores its status, response body and ``Location``. A retry with the same key
and the same request gets that response again; with another request (another body
or route) a 409; while the first still runs a 409 as well (retry later). A call that
failed with a 5xx leaves no record, so its retry runs again.

The request is recorded as a keyed hash, never as its body (which names a subject):
SHA-256 over the route and the canonical JSON of the body, then HMAC-keyed with the
store's reference key through ``keyring.subject_ref`` (under the tenant
``api-idempotency``), so a guessable subject id cannot be recovered from the hash by
trying candidates. Every process of one store derives the same hash.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from keyshred.api.problems import Problem
from keyshred.schema import api_idempotency
from keyshred.storage.catalog import Catalog

__all__ = ["IdempotencyStore", "Stored", "check_key"]

_KEY = re.compile(r"[A-Za-z0-9._:+/=-]{1,128}")
_TENANT = "api-idempotency"


@dataclass(frozen=True, slots=True)
class Stored:
    status: int
    body: Any
    location: str | None


def check_key(value: str) -> str:
    if not _KEY.fullmatch(value):
        raise Problem(
            400,
            "invalid-idempotency-key",
            "The Idempotency-Key header is not valid",
            "1-128 characters of A-Z a-z 0-9 . _ : + / = -",
        )
    return value


class IdempotencyStore:
    def __init__(self, catalog: Catalog, keyed_hash: Any, hours: int) -> None:
        self._catalog = catalog
        self._hash = keyed_hash  # keyring.subject_ref
        self._ttl = timedelta(hours=hours)

    def request_hash(self, route: str, body: Any) -> str:
        canonical = json.dumps([route, body], sort_keys=True, separators=(",", ":"))
        plain = hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()
        return str(self._hash(plain, _TENANT))

    def begin(self, actor: str, key: str, body_hash: str) -> Stored | None:
        """Claim the key (None: go ahead, then ``finish`` or ``abandon``), or the
        response stored for it; a 409 ``Problem`` for another body or a call still
        running."""
        try:
            return self._begin(actor, key, body_hash)
        except sa.exc.IntegrityError:
            # Another call with the key inserted its row between our read and insert.
            raise _running() from None

    def _begin(self, actor: str, key: str, body_hash: str) -> Stored | None:
        now = datetime.now(UTC)
        where = sa.and_(api_idempotency.c.actor == actor, api_idempotency.c.idem_key == key)
        with self._catalog.transaction() as conn:
            conn.execute(api_idempotency.delete().where(where, api_idempotency.c.expires_at < now))
            row = conn.execute(sa.select(api_idempotency).where(where)).first()
            if row is None:
                conn.execute(
                    api_idempotency.insert().values(
                        actor=actor,
                        idem_key=key,
                        body_hash=body_hash,
                        status=None,
                        response=None,
                        location=None,
                        created_at=now,
                        expires_at=now + self._ttl,
                    )
                )
                return None
        if row.body_hash != body_hash:
            raise Problem(
                409,
                "idempotency-key-reused",
                "This Idempotency-Key was used with another request",
                "use a new key for a new request",
            )
        if row.status is None:
            raise _running()
        return Stored(int(row.status), json.loads(row.response), row.location)

    def finish(self, actor: str, key: str, stored: Stored) -> None:
        with self._catalog.transaction() as conn:
            conn.execute(
                api_idempotency.update()
                .where(api_idempotency.c.actor == actor, api_idempotency.c.idem_key == key)
                .values(
                    status=stored.status,
                    response=json.dumps(stored.body, sort_keys=True),
                    location=stored.location,
                )
            )

    def abandon(self, actor: str, key: str) -> None:
        with self._catalog.transaction() as conn:
            conn.execute(
                api_idempotency.delete().where(
                    api_idempotency.c.actor == actor,
                    api_idempotency.c.idem_key == key,
                    api_idempotency.c.status.is_(None),
                )
            )


def _running() -> Problem:
    return Problem(
        409,
        "idempotency-key-in-use",
        "The first request with this Idempotency-Key is still running",
        headers={"Retry-After": "1"},
    )
