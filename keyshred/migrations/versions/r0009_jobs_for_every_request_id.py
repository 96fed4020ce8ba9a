"""Jobs for the unfinished requests revision 0007 left without one: those whose id
holds a space or an ``@`` (job payloads could not carry them then; a request id is
the caller's metadata and now travels as it is). Requests on legal hold get their
job when the hold is released (``ErasureCoordinator.release_hold``).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

from __future__ import annotations

import json
import time
import uuid

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision: str | None = "0008"
branch_labels: str | None = None
depends_on: str | None = None

# Request states nothing is left to do for, or that wait for a release.
_SETTLED = ("completed", "rejected", "legal_hold")


def upgrade() -> None:
    bind = op.get_bind()
    requests = sa.table("ks_deletion_requests", sa.column("request_id"), sa.column("state"))
    jobs = sa.table(
        "ks_jobs",
        *(
            sa.column(c)
            for c in (
                "job_id", "kind", "payload", "state", "attempts", "max_attempts",
                "run_after", "dedupe_key", "created_at", "updated_at",
            )
        ),
    )  # fmt: skip
    have = set(bind.execute(sa.select(jobs.c.dedupe_key).where(jobs.c.kind == "erasure")).scalars())
    ids = bind.execute(
        sa.select(requests.c.request_id).where(requests.c.state.not_in(_SETTLED))
    ).scalars()
    now = int(time.time() * 1_000_000)
    rows = [
        {
            "job_id": uuid.uuid4().hex,
            "kind": "erasure",
            "payload": json.dumps({"request_id": str(request_id)}, sort_keys=True),
            "state": "queued",
            "attempts": 0,
            "max_attempts": 5,
            "run_after": 0,
            "dedupe_key": f"erasure:{request_id}",
            "created_at": now,
            "updated_at": now,
        }
        for request_id in ids
        if f"erasure:{request_id}" not in have
    ]
    if rows:
        bind.execute(jobs.insert(), rows)


def downgrade() -> None:
    pass  # the jobs stay: revision 0008's code runs them like any other
