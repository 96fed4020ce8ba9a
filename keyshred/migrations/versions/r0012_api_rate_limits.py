"""The HTTP API's rate-limit buckets shared by every process of a deployment
(issue 23): ``ks_api_rate``, a row per credential (a keyed hash of it) with its
tokens and the database time they were counted at (``keyshred.api.ratelimit``).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision: str | None = "0011"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # A catalog that ``Catalog`` alone created has today's tables already.
    if "ks_api_rate" in set(sa.inspect(op.get_bind()).get_table_names()):
        return
    op.create_table(
        "ks_api_rate",
        sa.Column("credential", sa.String(64), primary_key=True),
        sa.Column("tokens", sa.Float, nullable=False),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("allowed", sa.Boolean, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("ks_api_rate")
