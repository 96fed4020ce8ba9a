"""The vault's token blocks lose ``group_commit_ms``: group commit is gone (every
token is stored before ``sanitize`` returns), so no number waits in a process's
memory and nothing reads how long it may.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # SQLite cannot drop a column in place before 3.35; batch mode copies the table,
    # keeping AUTOINCREMENT (reflection loses it), so a block number freed at the top
    # is still never handed out again.
    with op.batch_alter_table(
        "ks_token_blocks", table_kwargs={"sqlite_autoincrement": True}
    ) as batch:
        batch.drop_column("group_commit_ms")


def downgrade() -> None:
    with op.batch_alter_table(
        "ks_token_blocks", table_kwargs={"sqlite_autoincrement": True}
    ) as batch:
        batch.add_column(sa.Column("group_commit_ms", sa.Float, nullable=False, server_default="0"))
