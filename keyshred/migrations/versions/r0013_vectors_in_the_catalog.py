"""Vectors as sealed rows in the catalog (issue 25): ``ks_mem_vectors``, a row per
vector keyed by (subject_ref, vec_id), instead of one LanceDB dataset per subject
(``keyshred.storage.vectors``). A data folder's existing datasets are imported into
the table on each subject's first touch, under its subject lock, then removed.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision: str | None = "0012"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # A catalog that ``Catalog`` alone created has today's tables already.
    if "ks_mem_vectors" in set(sa.inspect(op.get_bind()).get_table_names()):
        return
    op.create_table(
        "ks_mem_vectors",
        sa.Column("subject_ref", sa.String(64), primary_key=True),
        sa.Column("vec_id", sa.String(128), primary_key=True),
        sa.Column("memory_id", sa.String(64), nullable=False),
        sa.Column("scope", sa.String(128), nullable=False),
        sa.Column("field", sa.Text, nullable=False),
        sa.Column("updated_us", sa.BigInteger, nullable=False),
        sa.Column("vec", sa.LargeBinary, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("ks_mem_vectors")
