"""Memory segments record their object's size, SHA-256 and earliest retain-until.

With them a backup copies a partition's segments object to object (a server-side
copy on S3) from a catalog snapshot alone, without downloading them to hash, and the
retention scanner opens only segments that hold something past its retain-until.
Segments written before this revision have none (NULL): a backup hashes those, the
scanner reads them.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None

_COLUMNS = ("size", "sha256", "retain_min")


def upgrade() -> None:
    # A catalog that ``Catalog`` alone created has today's columns already.
    have = {c["name"] for c in sa.inspect(op.get_bind()).get_columns("ks_mem_segments")}
    with op.batch_alter_table("ks_mem_segments") as batch:
        if "size" not in have:
            batch.add_column(sa.Column("size", sa.BigInteger, nullable=True))
        if "sha256" not in have:
            batch.add_column(sa.Column("sha256", sa.String(64), nullable=True))
        if "retain_min" not in have:
            batch.add_column(sa.Column("retain_min", sa.BigInteger, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ks_mem_segments") as batch:
        for name in reversed(_COLUMNS):
            batch.drop_column(name)
