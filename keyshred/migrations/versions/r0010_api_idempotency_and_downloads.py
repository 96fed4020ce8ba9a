"""The HTTP API's tables (issue 23): ``Idempotency-Key`` records (a keyed hash of
each request, never its body, with the response first given) and access requests'
export packages waiting for their one download.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision: str | None = "0009"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # A catalog that ``Catalog`` alone created has today's tables already.
    have = set(sa.inspect(op.get_bind()).get_table_names())
    if "ks_api_idempotency" not in have:
        op.create_table(
            "ks_api_idempotency",
            sa.Column("actor", sa.String(128), primary_key=True),
            sa.Column("idem_key", sa.String(128), primary_key=True),
            sa.Column("body_hash", sa.String(64), nullable=False),
            sa.Column("status", sa.Integer, nullable=True),
            sa.Column("response", sa.Text, nullable=True),
            sa.Column("location", sa.String(256), nullable=True),
            sa.Column("created_at", sa.BigInteger, nullable=False),
            sa.Column("expires_at", sa.BigInteger, nullable=False),
        )
    if "ks_api_downloads" not in have:
        op.create_table(
            "ks_api_downloads",
            sa.Column("export_id", sa.String(64), primary_key=True),
            sa.Column("actor", sa.String(128), nullable=False),
            sa.Column("subject_ref", sa.String(64), nullable=False),
            sa.Column("created_at", sa.BigInteger, nullable=False),
            sa.Column("expires_at", sa.BigInteger, nullable=False),
            sa.Column("downloaded_at", sa.BigInteger, nullable=True),
            sa.Column("package", sa.LargeBinary, nullable=True),
        )


def downgrade() -> None:
    op.drop_table("ks_api_downloads")
    op.drop_table("ks_api_idempotency")
