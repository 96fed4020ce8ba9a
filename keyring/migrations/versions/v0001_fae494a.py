"""The key store's schema as main@fae494a creates it, on each dialect.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

from alembic import op

from keyshred.keyring.migrations import statements

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    for statement in statements(op.get_bind().dialect.name):
        op.execute(statement)


def downgrade() -> None:
    raise NotImplementedError("the key store is never downgraded (a key table is never dropped)")
