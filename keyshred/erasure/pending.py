"""Whether a subject's erasure is still under way: what may lift its suppression.

A request that ends having found nothing re-admits its subject (``Extent.finish``),
and ``readmit`` lets an erased one return: neither may do so while another erasure
of the whole subject is unfinished, whose suppression (and a block it asked for) is
not theirs to lift. Asked inside the transaction that changes the guard, which locks
the guard's row: a request recorded later suppresses again when it runs.
"""

from __future__ import annotations

import json

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from keyshred.erasure.requests import COMPLETED, REJECTED
from keyshred.schema import deletion_requests

__all__ = ["erasure_pending"]


def erasure_pending(conn: Connection, subject_ref: str, *, but: str | None = None) -> bool:
    """Whether an erasure of the whole subject (not ``but``) is neither completed nor
    rejected. Requests for listed assets only (the retention scanner's) do not
    count: they leave the subject active."""
    r = deletion_requests.c
    query = sa.select(r.request_id, r.doc).where(
        r.subject_ref == subject_ref,
        r.scope.is_(None),
        r.state.not_in((COMPLETED, REJECTED)),
    )
    if but is not None:
        query = query.where(r.request_id != but)
    for _, doc in conn.execute(query):
        try:
            assets = "assets" in json.loads(doc)
        except (ValueError, TypeError):
            assets = False  # unreadable: counted, the safe side
        if not assets:
            return True
    return False
