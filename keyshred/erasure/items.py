"""A request's long lists, kept out of its JSON document (``ks_erasure_items``).

Every record of a step rewrites the request's document whole, and an erasure
records some twenty times plus twice per derived asset it acts on. The lists that
grow with the subject live here instead, each written once or one row at a time:

- ``own`` and ``closure``: the asset ids the request erases and the other holders'
  assets derived from them, in the closure step's order, written by that step
  (replaced whole if a killed run repeats it);
- ``progress:<step>``: a long step's per-item progress (the derived step's intents
  and actions, keyed by asset id), one row per item, removed with the record that
  marks the step done.

A request recorded before these rows existed keeps its lists in its document; the
readers below look there first.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa

from keyshred.schema import erasure_items
from keyshred.storage.catalog import Catalog

__all__ = ["clear", "drop_entry", "progress", "progress_list", "put_entry", "read", "write"]

_t = erasure_items


def progress_list(step: str) -> str:
    return f"progress:{step}"


def write(conn: Any, request_id: str, name: str, ids: Sequence[str]) -> None:
    """Replace the list ``name`` of the request by ``ids`` (on a caller's connection,
    in its transaction)."""
    clear(conn, request_id, name)
    if ids:
        conn.execute(
            _t.insert(),
            [
                {"request_id": request_id, "list": name, "item": item, "pos": pos, "entry": None}
                for pos, item in enumerate(ids)
            ],
        )


def clear(conn: Any, request_id: str, name: str) -> None:
    conn.execute(_t.delete().where(_t.c.request_id == request_id, _t.c.list == name))


def read(catalog: Catalog, request_id: str, name: str) -> list[str]:
    """The list's items in their order."""
    with catalog.engine.connect() as conn:
        rows = conn.execute(
            sa.select(_t.c.item)
            .where(_t.c.request_id == request_id, _t.c.list == name)
            .order_by(_t.c.pos)
        )
        return [str(r[0]) for r in rows]


def progress(catalog: Catalog, request_id: str, step: str) -> tuple[list[dict[str, Any]], int]:
    """The step's recorded entries in the order they were last written, and the
    position the next one takes."""
    with catalog.engine.connect() as conn:
        rows = conn.execute(
            sa.select(_t.c.entry, _t.c.pos)
            .where(_t.c.request_id == request_id, _t.c.list == progress_list(step))
            .order_by(_t.c.pos)
        ).all()
    return [json.loads(r[0]) for r in rows], (int(rows[-1][1]) + 1 if rows else 0)


def put_entry(
    conn: Any, request_id: str, step: str, item: str, *, pos: int, entry: Mapping[str, Any]
) -> None:
    """Record (or replace) the step's entry for ``item``, placed at ``pos``."""
    drop_entry(conn, request_id, step, item)
    conn.execute(
        _t.insert().values(
            request_id=request_id,
            list=progress_list(step),
            item=item,
            pos=pos,
            entry=json.dumps(dict(entry), sort_keys=True),
        )
    )


def drop_entry(conn: Any, request_id: str, step: str, item: str) -> None:
    conn.execute(
        _t.delete().where(
            _t.c.request_id == request_id,
            _t.c.list == progress_list(step),
            _t.c.item == item,
        )
    )
