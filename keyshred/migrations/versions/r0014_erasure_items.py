"""A request's long lists out of its document (issue 25): ``ks_erasure_items`` holds
an erasure request's own asset ids, its closure and a long step's per-item progress,
so that a step's record writes a few rows instead of a document that grew with the
subject (161 KB for a 2,000-memory subject, rewritten some 60 times per erasure).
Requests recorded before keep their lists in the document and are read from there.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision: str | None = "0013"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # A catalog that ``Catalog`` alone created has today's tables already.
    if "ks_erasure_items" in set(sa.inspect(op.get_bind()).get_table_names()):
        return
    op.create_table(
        "ks_erasure_items",
        sa.Column("request_id", sa.String(64), primary_key=True),
        sa.Column("list", sa.String(64), primary_key=True),
        sa.Column("item", sa.String(128), primary_key=True),
        sa.Column("pos", sa.BigInteger, nullable=False),
        sa.Column("entry", sa.Text, nullable=True),
    )


def downgrade() -> None:
    # Requests recorded with rows get their lists back into their documents, as the
    # earlier release reads them, before the rows go.
    conn = op.get_bind()
    items = sa.table(
        "ks_erasure_items",
        sa.column("request_id"),
        sa.column("list"),
        sa.column("item"),
        sa.column("pos"),
        sa.column("entry"),
    )
    requests = sa.table("ks_deletion_requests", sa.column("request_id"), sa.column("doc"))
    lists: dict[str, dict[str, list[Any]]] = {}
    for rid, name, item, entry in conn.execute(
        sa.select(items.c.request_id, items.c.list, items.c.item, items.c.entry).order_by(
            items.c.request_id, items.c.list, items.c.pos
        )
    ):
        value = item if entry is None else json.loads(entry)
        lists.setdefault(rid, {}).setdefault(name, []).append(value)
    for rid, named in lists.items():
        raw = conn.execute(sa.select(requests.c.doc).where(requests.c.request_id == rid)).scalar()
        if raw is None:
            continue
        doc = json.loads(raw)
        closure = doc.get("details", {}).get("closure")
        if closure is not None:
            closure["own"] = named.get("own", [])
            closure["closure"] = named.get("closure", [])
            closure.pop("own_n", None)
            closure.pop("closure_n", None)
        for name, entries in named.items():
            if name.startswith("progress:"):
                doc.setdefault("progress", {})[name.removeprefix("progress:")] = entries
        conn.execute(
            requests.update()
            .where(requests.c.request_id == rid)
            .values(doc=json.dumps(doc, sort_keys=True))
        )
    op.drop_table("ks_erasure_items")
