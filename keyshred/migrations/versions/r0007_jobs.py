"""Jobs in the catalog: erasure requests, retention runs and backup maintenance run
as leased jobs (``keyshred.jobs``, issue 22).

Every request an earlier release left unfinished gets its ``erasure`` job here, due
at once, so a worker finishes it (before, only a ``resume`` would).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

from __future__ import annotations

import json
import time
import uuid

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision: str | None = "0006"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # A catalog that ``Catalog`` alone created has the table already.
    if "ks_jobs" in sa.inspect(op.get_bind()).get_table_names():
        return
    op.create_table(
        "ks_jobs",
        sa.Column("job_id", sa.String(64), primary_key=True),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("max_attempts", sa.Integer, nullable=False),
        sa.Column("run_after", sa.BigInteger, nullable=False),
        sa.Column("lease_owner", sa.String(64), nullable=True),
        sa.Column("lease_until", sa.BigInteger, nullable=True),
        sa.Column("last_error", sa.String(128), nullable=True),
        sa.Column("dedupe_key", sa.String(200), nullable=True, unique=True),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.BigInteger, nullable=False),
    )
    op.create_index("ks_jobs_due", "ks_jobs", ["state", "run_after"])
    _backfill()


# Request states nothing is left to do for (keyshred.erasure.requests).
_SETTLED = ("completed", "rejected", "legal_hold")


def _backfill() -> None:
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
        # A request id the job payload cannot carry (an "@" or a space) stays
        # for ``resume``, as before.
        if not set(str(request_id)) & {"@", " ", '"', "\\"}
    ]
    if rows:
        bind.execute(jobs.insert(), rows)


def downgrade() -> None:
    op.drop_index("ks_jobs_due", table_name="ks_jobs")
    op.drop_table("ks_jobs")
