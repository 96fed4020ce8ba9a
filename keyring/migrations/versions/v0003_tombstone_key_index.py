"""The destroyed keys of a tombstone, found by the tombstone.

``tombstone_for(key_id)`` (every destroyed key's lookup: the erasure's own check
that its keys are gone, an open of a row under a destroyed key) joins a tombstone
to its keys by ``tombstone_id``, which ``tombstone_key`` had no index on: every
call read every destroyed key ever recorded (368 ms a call after 100,000 erasures,
inside the window that ends at "crypto-erased"). The index is on
``(tombstone_id, key_id)``: the join reads a tombstone's keys in key order.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    p = "" if op.get_bind().dialect.name == "sqlite" else "ks_"
    op.execute(
        f"CREATE INDEX {p}tombstone_key_tombstone ON {p}tombstone_key (tombstone_id, key_id)"
    )


def downgrade() -> None:
    raise NotImplementedError("the key store is never downgraded")
