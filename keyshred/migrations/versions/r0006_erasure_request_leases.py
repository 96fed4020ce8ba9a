"""Erasure requests carry a lease: the worker running one and until when.

Two workers resuming the same request both ran every remaining step, logged
``erasure.completed`` twice and signed two receipts (issue 22). A request is now
claimed with a lease (``keyshred.erasure.lease``); every request starts unleased.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision: str | None = "0005"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # A catalog that ``Catalog`` alone created has today's columns already.
    have = {c["name"] for c in sa.inspect(op.get_bind()).get_columns("ks_deletion_requests")}
    with op.batch_alter_table("ks_deletion_requests") as batch:
        if "lease_owner" not in have:
            batch.add_column(sa.Column("lease_owner", sa.String(64), nullable=True))
        if "lease_until" not in have:
            batch.add_column(sa.Column("lease_until", sa.BigInteger, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ks_deletion_requests") as batch:
        batch.drop_column("lease_until")
        batch.drop_column("lease_owner")
