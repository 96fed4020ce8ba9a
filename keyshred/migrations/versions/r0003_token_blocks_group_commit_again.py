"""The vault's token blocks record their process's group-commit interval again.

Revision 0002 dropped ``group_commit_ms`` with the journal; measured again at low
load, the journal was 1.91x the best simple design (the issue's bar is 1.5x) and it
came back (issue 20). A process with group commit hands tokens out before their rows
are stored, so another process that meets a number without a row must know how long
it may still wait for it: the interval of the process whose block it is. Blocks
taken while the column was gone were taken by processes that stored every token
before handing it out: 0, the default.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # Batch mode (a table copy on SQLite) keeps AUTOINCREMENT, which reflection loses:
    # a block number freed at the top is still never handed out again.
    with op.batch_alter_table(
        "ks_token_blocks", table_kwargs={"sqlite_autoincrement": True}
    ) as batch:
        batch.add_column(sa.Column("group_commit_ms", sa.Float, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table(
        "ks_token_blocks", table_kwargs={"sqlite_autoincrement": True}
    ) as batch:
        batch.drop_column("group_commit_ms")
