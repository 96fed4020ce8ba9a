"""Memory partitions move into the catalog: ``ks_mem_partitions`` (a subject's
generation and hot sequence range), ``ks_mem_hot`` (sealed rows not yet compacted)
and ``ks_mem_segments`` (the immutable Parquet segments that make up a partition).

The tables start empty: partitions a previous release kept in ``MANIFEST`` and log
files are imported by the partition engine itself, each on its first load under its
subject lock (``keyshred.storage.legacy``, ``Partition._settle_legacy``), not by
this revision (it would need every subject's keys inside one migration).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # A catalog that ``Catalog`` alone created (stamped at 0001 when the facade first
    # opens it) has today's tables already: those are kept as they are.
    existing = set(sa.inspect(op.get_bind()).get_table_names())
    if "ks_mem_partitions" not in existing:
        _create_partitions()
    if "ks_mem_hot" not in existing:
        _create_hot()
    if "ks_mem_segments" not in existing:
        _create_segments()


def _create_partitions() -> None:
    op.create_table(
        "ks_mem_partitions",
        sa.Column("subject_ref", sa.String(64), primary_key=True),
        sa.Column("gen", sa.BigInteger, nullable=False),
        sa.Column("base_seq", sa.BigInteger, nullable=False),
        sa.Column("next_seq", sa.BigInteger, nullable=False),
    )


def _create_hot() -> None:
    op.create_table(
        "ks_mem_hot",
        sa.Column("subject_ref", sa.String(64), primary_key=True),
        sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("scope", sa.String(128), nullable=False),
        sa.Column("record", sa.LargeBinary, nullable=False),
    )


def _create_segments() -> None:
    op.create_table(
        "ks_mem_segments",
        sa.Column("subject_ref", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("scope", sa.String(128), nullable=False),
        sa.Column("rows", sa.Integer, nullable=False),
        sa.Column("key_id", sa.String(64), nullable=False),
        sa.Column("retired_at", sa.BigInteger, nullable=True),
    )


def downgrade() -> None:
    op.drop_table("ks_mem_segments")
    op.drop_table("ks_mem_hot")
    op.drop_table("ks_mem_partitions")
