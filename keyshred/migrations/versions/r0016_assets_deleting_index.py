"""Unfinished deletions by subject (issue 24): a get of a subject whose partition is
not open reads the catalog alone, unless a deletion of the subject was marked and
not finished (a crash stopped it): then it loads the partition, which finishes it.
A partial index answers that question in one probe however many assets the subject
has.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision: str | None = "0015"
branch_labels: str | None = None
depends_on: str | None = None

_NAME = "ks_assets_deleting"
_WHERE = "status = 'deleting'"


def upgrade() -> None:
    # A catalog that ``Catalog`` alone created has today's indexes already.
    names = {i["name"] for i in sa.inspect(op.get_bind()).get_indexes("ks_assets")}
    if _NAME in names:
        return
    op.create_index(
        _NAME,
        "ks_assets",
        ["subject_ref"],
        sqlite_where=sa.text(_WHERE),
        postgresql_where=sa.text(_WHERE),
    )


def downgrade() -> None:
    op.drop_index(_NAME, table_name="ks_assets")
