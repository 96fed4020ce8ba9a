"""Eviction acknowledgements: each process that dropped an erased subject's cached
keys, rows and vectors on its suppression's event records when (issue 22), so the
receipt states how many processes evicted and how long the last one took.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision: str | None = "0007"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # A catalog that ``Catalog`` alone created has today's tables already.
    if "ks_eviction_acks" in set(sa.inspect(op.get_bind()).get_table_names()):
        return
    op.create_table(
        "ks_eviction_acks",
        sa.Column("event_id", sa.String(32), primary_key=True),
        sa.Column("process_id", sa.String(32), primary_key=True),
        sa.Column("subject_ref", sa.String(64), nullable=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("published_at", sa.BigInteger, nullable=False),
        sa.Column("evicted_at", sa.BigInteger, nullable=False),
    )
    op.create_index("ks_eviction_acks_subject", "ks_eviction_acks", ["subject_ref", "epoch"])


def downgrade() -> None:
    op.drop_index("ks_eviction_acks_subject", table_name="ks_eviction_acks")
    op.drop_table("ks_eviction_acks")
