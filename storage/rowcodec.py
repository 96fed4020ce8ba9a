"""The row format of memory partitions: ``MemoryRow``, the Parquet schema of a
segment, row-level sealing under owner-set keys, and the codec of hot records.

Plaintext metadata columns (ids, subject_ref, scope, purpose, category, timestamps,
retain_until, status, lookup hash, provenance ids) stay readable without keys so
retention scans can run over every segment with DuckDB or pyarrow.

Row-level keys (DESIGN.md "Row-level keys inside a segment"): a row whose owner set is
more than its holder (it mentions someone, or derives from another subject's data)
carries its sensitive values as one envelope ciphertext under the owner-set DEK,
bound to ``(subject_ref, scope, "memories", memory_id, "row")``, in the ``value``
column (PME on top) and likewise inside the hot record, so erasing any owner makes
exactly those rows unreadable in every copy. Namespace and key go inside that
ciphertext too (their columns hold ``""``), except for a derived asset (a row with
sources): its name is the holder's own, kept under the holder's key so that an
erasure can rebuild it in place.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa

from keyshred.keyring.datakey import DataKey
from keyshred.keyring.envelope import HEADER_BYTES, KEY_ID_BYTES, Place

__all__ = [
    "ENCRYPTED_COLUMNS",
    "PLAINTEXT_COLUMNS",
    "SCHEMA",
    "MemoryRow",
    "decode_record",
    "encode_delete",
    "encode_lookup",
    "encode_puts",
    "from_us",
    "index_record",
    "is_sealed",
    "names_sealed",
    "row_key_id",
    "row_of",
    "row_place",
    "seal_row",
    "to_us",
]

ENCRYPTED_COLUMNS = ["namespace", "key", "value"]
_TS = pa.timestamp("us", tz="UTC")
SCHEMA = pa.schema(
    [
        ("memory_id", pa.string()),
        ("subject_ref", pa.string()),
        ("scope", pa.string()),
        ("purpose", pa.string()),
        ("category", pa.string()),
        ("created_at", _TS),
        ("updated_at", _TS),
        ("retain_until", _TS),
        ("status", pa.string()),
        ("lookup", pa.string()),
        ("sources", pa.list_(pa.string())),
        ("mentions", pa.list_(pa.string())),
        ("index_fields", pa.list_(pa.string())),
        ("namespace", pa.string()),
        ("key", pa.string()),
        ("value", pa.binary()),
    ]
)
PLAINTEXT_COLUMNS = [name for name in SCHEMA.names if name not in ENCRYPTED_COLUMNS]
_SEALED_MAGIC = b"KS\x01"  # an envelope's magic and version: never the start of JSON
_ROW_TABLE = "memories"
_ROW_COLUMN = "row"


@dataclass(frozen=True, slots=True)
class MemoryRow:
    """One memory as the partition holds it (``value`` is its JSON text)."""

    memory_id: str
    namespace: tuple[str, ...]
    key: str
    value: bytes
    scope: str
    purpose: str
    category: str
    created_us: int  # microseconds since the Unix epoch, UTC
    updated_us: int
    retain_us: int
    lookup: str
    sources: tuple[str, ...] = ()
    mentions: tuple[str, ...] = ()
    index: tuple[str, ...] = ()  # the JSON paths embedded into vectors
    # The envelope ciphertext of the row's values under its owner-set key, as the
    # files hold it (None: the holder's own row, under PME and the log's key only).
    sealed: bytes | None = None
    # Its owner-set key was destroyed: ``value`` (and, unless it is a derived
    # asset, ``namespace`` and ``key``) are unknown; only ``sealed`` is kept.
    opaque: bool = False

    def __repr__(self) -> str:
        return f"MemoryRow(memory_id={self.memory_id!r}, scope={self.scope!r})"


def row_place(subject_ref: str, row: MemoryRow) -> Place:
    """Where a row's sealed values belong: its holder, scope and memory id."""
    return Place(subject_ref, row.scope, _ROW_TABLE, row.memory_id, _ROW_COLUMN)


def names_sealed(row: MemoryRow) -> bool:
    """Whether namespace and key travel inside the sealed values: always, but for
    a derived asset (a row with sources), whose name the erasure needs to rebuild it."""
    return not row.sources


def seal_row(key: DataKey, subject_ref: str, row: MemoryRow) -> MemoryRow:
    """The row with its values sealed under ``key`` (an owner-set key of the
    holder's scope): ``[namespace, key]`` (or ``null``) as JSON, a newline, the value."""
    names = json.dumps([list(row.namespace), row.key] if names_sealed(row) else None)
    payload = names.encode("utf-8") + b"\n" + row.value
    return replace(row, sealed=key.seal(payload, row_place(subject_ref, row)))


def row_key_id(row: MemoryRow) -> bytes | None:
    """The id of the owner-set key a row is sealed under (None: the holder's own)."""
    if row.sealed is None:
        return None
    return row.sealed[HEADER_BYTES - KEY_ID_BYTES : HEADER_BYTES]


def is_sealed(value: bytes) -> bool:
    return value[: len(_SEALED_MAGIC)] == _SEALED_MAGIC


def encode_puts(rows: Sequence[MemoryRow]) -> bytes:
    """One hot record for a batch of puts of one scope: a JSON header line with
    every row's fields and its value's length, then the values back to back (they
    are JSON already; re-escaping them inside the header would cost a second pass).
    """
    # Tuples: JSON arrays all the same, and no list copies to allocate per row. A
    # sealed row logs its ciphertext as the value and, if its names are inside it,
    # null and "" for namespace and key.
    header = [
        (
            r.memory_id,
            None if r.sealed is not None and names_sealed(r) else r.namespace,
            "" if r.sealed is not None and names_sealed(r) else r.key,
            r.scope,
            r.purpose,
            r.category,
            r.created_us,
            r.updated_us,
            r.retain_us,
            r.lookup,
            r.sources,
            r.mentions,
            r.index,
            len(r.value if r.sealed is None else r.sealed),
        )
        for r in rows
    ]
    head = json.dumps({"op": "put", "rows": header}, separators=(",", ":")).encode("utf-8")
    return b"".join([head, b"\n", *(r.value if r.sealed is None else r.sealed for r in rows)])


def encode_delete(row: MemoryRow) -> bytes:
    return json.dumps({"op": "del", "l": row.lookup}).encode("utf-8") + b"\n"


def decode_record(payload: bytes) -> tuple[str, list[Any]]:
    """``("put", rows)`` or ``("del", [lookup])``; ValueError/KeyError if malformed.
    A sealed row comes back as it is stored: ``value`` is its ciphertext, and so is
    ``sealed`` (``Partition`` opens it)."""
    op, doc, body = _header(payload)
    if op == "del":
        return "del", [str(doc["l"])]
    rows, pos = [], 0
    for fields in doc["rows"]:
        vlen = _fields(fields)[13]
        rows.append(_row(fields, body[pos : pos + vlen]))
        pos += vlen
    if pos != len(body):
        raise ValueError("trailing bytes")
    return "put", rows


def index_record(payload: bytes) -> tuple[str, list[Any], bytes]:
    """A hot record's header, checked as ``decode_record`` checks it but without
    building its rows: ``("put", fields, body)`` (each row's fields as logged: its
    memory id first, its lookup tenth, its value's length last; the values back to
    back in ``body``) or ``("del", [lookup], b"")``. ``row_of`` builds one row.
    ValueError/KeyError/TypeError if malformed."""
    op, doc, body = _header(payload)
    if op == "del":
        return "del", [str(doc["l"])], b""
    rows = doc["rows"]
    if not isinstance(rows, list):
        raise ValueError("rows are a list")
    total = 0
    for fields in rows:
        _fields(fields)
        vlen = fields[13]
        if not isinstance(vlen, int) or vlen < 0:
            raise ValueError("bad value length")
        if not isinstance(fields[0], str) or not isinstance(fields[9], str):
            raise ValueError("ids are strings")
        total += vlen
    if total != len(body):
        raise ValueError("value lengths and body differ")
    return "put", rows, body


def row_of(rows: list[Any], body: bytes, lookup: str) -> MemoryRow | None:
    """The row filed at ``lookup`` in an ``index_record`` of a put (the last one, as
    a replay keeps it), built alone; None if the record holds none."""
    found, pos = None, 0
    for fields in rows:
        if fields[9] == lookup:
            found = _row(fields, body[pos : pos + fields[13]])
        pos += fields[13]
    return found


def _header(payload: bytes) -> tuple[str, Any, bytes]:
    head, _, body = payload.partition(b"\n")
    doc = json.loads(head)
    op = doc["op"]
    if op not in ("put", "del"):
        raise ValueError("unknown log operation")
    return op, doc, body


def _fields(fields: Any) -> list[Any]:
    if not isinstance(fields, list) or len(fields) != 14:
        raise ValueError("a row of another shape")
    return fields


def _row(fields: Any, value: bytes) -> MemoryRow:
    mid, ns, key, scope, pur, cat, c, u, r, lookup, src, men, idx, vlen = fields
    if len(value) != vlen:
        raise ValueError("truncated value")
    if ns is None and not is_sealed(value):
        raise ValueError("a row without a namespace is not sealed")
    return MemoryRow(
        str(mid),
        () if ns is None else tuple(ns),
        str(key),
        value,
        str(scope),
        str(pur),
        str(cat),
        int(c),
        int(u),
        int(r),
        str(lookup),
        tuple(src),
        tuple(men),
        tuple(idx),
        value if is_sealed(value) else None,
    )


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def to_us(value: datetime) -> int:
    """Microseconds since the Unix epoch (exact, no float rounding)."""
    delta = value.astimezone(UTC) - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def from_us(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


def encode_lookup(namespace: Sequence[str], key: str) -> bytes:
    out = bytearray()
    for part in (*namespace, "\x00", key):
        raw = part.encode("utf-8")
        out += len(raw).to_bytes(4, "big") + raw
    return bytes(out)
