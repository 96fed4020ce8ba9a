"""Jobs in the catalog: erasure requests, retention runs and backup maintenance run
as leased jobs (``keyshred.jobs``, issue 22).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

from __future__ import annotations

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


def downgrade() -> None:
    op.drop_index("ks_jobs_due", table_name="ks_jobs")
    op.drop_table("ks_jobs")
