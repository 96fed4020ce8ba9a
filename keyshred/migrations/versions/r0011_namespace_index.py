"""The namespace index (issue #25 item 2): keyed hashes of every namespace prefix and
the namespaces sealed under their memories' keys, so that searches and namespace
listings across subjects read the catalog instead of every partition
(``keyshred.storage.namespaces``).

A migration cannot decrypt a partition (the keys are behind the KEK), so the
backfill is lazy: every subject holding memories is listed in ``ks_mem_ns_pending``
here, and the store indexes each from its partition before its next read across
subjects (``MemoryStore.index_pending``).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision: str | None = "0010"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # A catalog that ``Catalog`` alone created has today's tables already (and its
    # writes kept them: nothing to backfill).
    if "ks_mem_namespaces" in set(sa.inspect(op.get_bind()).get_table_names()):
        return
    op.create_table(
        "ks_mem_namespaces",
        sa.Column("subject_ref", sa.String(64), primary_key=True),
        sa.Column("ns_hash", sa.String(64), primary_key=True),
        sa.Column("key_id", sa.String(64), primary_key=True),
        sa.Column("scope", sa.String(128), nullable=False),
        sa.Column("first_us", sa.BigInteger, nullable=False),
        sa.Column("labels", sa.LargeBinary, nullable=False),
    )
    op.create_table(
        "ks_mem_ns_prefixes",
        sa.Column("prefix_hash", sa.String(64), primary_key=True),
        sa.Column("subject_ref", sa.String(64), primary_key=True),
        sa.Column("ns_hash", sa.String(64), primary_key=True),
    )
    op.create_index("ks_mem_ns_prefixes_subject", "ks_mem_ns_prefixes", ["subject_ref", "ns_hash"])
    op.create_table(
        "ks_mem_ns_pending",
        sa.Column("subject_ref", sa.String(64), primary_key=True),
    )
    # Every subject with a partition, or with memory assets whose partition is still
    # a folder of the layout before issue #21 (imported on its first load).
    op.execute(
        "INSERT INTO ks_mem_ns_pending (subject_ref) "
        "SELECT subject_ref FROM ks_mem_partitions "
        "UNION SELECT subject_ref FROM ks_assets WHERE kind = 'memory'"
    )


def downgrade() -> None:
    op.drop_table("ks_mem_ns_pending")
    op.drop_index("ks_mem_ns_prefixes_subject", table_name="ks_mem_ns_prefixes")
    op.drop_table("ks_mem_ns_prefixes")
    op.drop_table("ks_mem_namespaces")
