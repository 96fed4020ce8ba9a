"""Baseline: the catalog database as keyshred main at fae494a created it.

Revision ID: 0001
Revises:
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

from keyshred.migrations.baseline import metadata

revision = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    metadata.create_all(op.get_bind(), checkfirst=False)


def downgrade() -> None:
    metadata.drop_all(op.get_bind(), checkfirst=False)
