"""A request's long lists out of its document (issue 25): ``ks_erasure_items`` holds
an erasure request's own asset ids, its closure and a long step's per-item progress,
so that a step's record writes a few rows instead of a document that grew with the
subject (161 KB for a 2,000-memory subject, rewritten some 60 times per erasure).
Requests recorded before keep their lists in the document and are read from there.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision: str | None = "0013"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # A catalog that ``Catalog`` alone created has today's tables already.
    if "ks_erasure_items" in set(sa.inspect(op.get_bind()).get_table_names()):
        return
    op.create_table(
        "ks_erasure_items",
        sa.Column("request_id", sa.String(64), primary_key=True),
        sa.Column("list", sa.String(64), primary_key=True),
        sa.Column("item", sa.String(128), primary_key=True),
        sa.Column("pos", sa.BigInteger, nullable=False),
        sa.Column("entry", sa.Text, nullable=True),
    )


def downgrade() -> None:
    op.drop_table("ks_erasure_items")
