"""What the memory store takes and returns, and the small helpers its parts share.

``Memory`` (a read-only view of a row), ``PutItem`` (one write of a batch),
``RepairReport``, ``text_at`` (the text embedded for a JSON path); the checks of
namespaces, keys and batch items; asset ids and the catalog's storage key of a
partition. No I/O: every function here works on values. The underscored helpers are
the store's own, shared by its modules (``memory_write``, ``memory_read`` ...): not API.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from keyshred._validate import check_index, check_text
from keyshred.errors import InvalidInput
from keyshred.storage.partition import MemoryRow, from_us

__all__ = [
    "DELETING",
    "HISTORY",
    "MEMORY_KIND",
    "VECTOR_KIND",
    "AuditSink",
    "Changed",
    "Memory",
    "ProducedBy",
    "PutItem",
    "RepairReport",
    "text_at",
]

MEMORY_KIND = "memory"
HISTORY = "~history"  # superseded versions of corrected memories live under it
_VERSION_SEP = "\x1f"
VECTOR_KIND = "vector"


def _version_of(history_key: str) -> tuple[str, int] | None:
    """(key, version) of a history row's key ``<key><_VERSION_SEP><8 digits>``, or
    None. Split at the last separator: a key may hold the separator itself, and
    a prefix match on ``key + _VERSION_SEP`` then took ``"a\x1fb"``'s versions
    for ``"a"``'s."""
    key, sep, number = history_key.rpartition(_VERSION_SEP)
    if not sep or not number.isdigit() or not number.isascii():
        return None
    return key, int(number)


# A derived asset's (kind, producer, producer version): one for every row a write
# registers, or one per (namespace, key) (rows not listed are plain memories).
Made = tuple[str, str | None, str | None]
ProducedBy = Made | Mapping[tuple[tuple[str, ...], str], Made]
# The status of assets whose deletion has started (``_delete_rows``): the rows may be
# gone from the partition while the catalog still holds them.
DELETING = "deleting"
_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False)  # one encoder, reused
_MAX_NAMESPACE_DEPTH = 32
_MAX_LABEL = 512


class Memory:
    """A memory as returned to its caller; read-only. Its repr shows ids only.

    ``value`` and the timestamps are decoded on first access: a batch write returns
    its memories without paying for JSON parsing nobody asked for.
    """

    __slots__ = ("_row", "_value", "score")

    def __init__(self, row: MemoryRow, score: float | None = None) -> None:
        self._row = row
        self._value: Any = _UNSET
        self.score = score  # cosine similarity, for semantic search results

    memory_id = property(lambda self: self._row.memory_id)
    namespace = property(lambda self: self._row.namespace)
    key = property(lambda self: self._row.key)
    scope = property(lambda self: self._row.scope)
    purpose = property(lambda self: self._row.purpose)
    category = property(lambda self: self._row.category)
    sources = property(lambda self: self._row.sources)
    mentions = property(lambda self: self._row.mentions)
    index = property(lambda self: self._row.index)

    @property
    def value(self) -> Any:
        """The JSON value (a fresh copy per Memory object)."""
        if self._value is _UNSET:
            self._value = json.loads(self._row.value)
        return self._value

    @property
    def created_at(self) -> datetime:
        return from_us(self._row.created_us)

    @property
    def updated_at(self) -> datetime:
        return from_us(self._row.updated_us)

    @property
    def retain_until(self) -> datetime:
        return from_us(self._row.retain_us)

    def __repr__(self) -> str:
        return f"Memory(memory_id={self._row.memory_id!r}, scope={self._row.scope!r})"


_UNSET = object()


@dataclass(frozen=True, slots=True)
class PutItem:
    """One write of a batch (``put_many``)."""

    namespace: Sequence[str]
    key: str
    value: Any
    scope: str = "default"
    purpose: str | None = None
    category: str | None = None
    sources: Sequence[str] = ()
    mentions: Sequence[str] = ()
    index: bool | Sequence[str] | None = None
    ttl: timedelta | None = None  # shortens retention (never beyond the policy's)


_SUBJECT_REF = re.compile(r"[a-z2-7]{26}")  # Keyring.subject_ref's form


@dataclass(frozen=True, slots=True)
class RepairReport:
    """What ``MemoryStore.repair`` found in one partition (asset ids and file names
    only: no personal data), and whether it acted.

    - ``lost``: memories the catalog holds that the partition lacks, with no
      deletion recorded (a truncated or replaced file, or a crash of an older
      version mid-delete); forgotten only with ``forget_lost``;
    - ``unfinished_deletes``: rows gone, their assets marked "deleting": finished;
    - ``pending_deletes``: assets marked "deleting", rows still there: deleted;
    - ``unregistered``: rows the catalog does not know (a put killed before its
      catalog write, never acknowledged): registered, so retention, export and
      erasure find them;
    - ``leftover_files``: files the manifest does not name: removed.
    """

    subject_ref: str
    lost: tuple[str, ...] = ()
    unfinished_deletes: tuple[str, ...] = ()
    pending_deletes: tuple[str, ...] = ()
    unregistered: tuple[str, ...] = ()
    leftover_files: tuple[str, ...] = ()
    applied: bool = False
    forgot_lost: bool = False

    @property
    def clean(self) -> bool:
        """Nothing found."""
        return not (
            self.lost
            or self.unfinished_deletes
            or self.pending_deletes
            or self.unregistered
            or self.leftover_files
        )

    @property
    def ok(self) -> bool:
        """Nothing found, or everything found was reconciled by this run."""
        if not self.applied:
            return self.clean
        return not self.lost or self.forgot_lost

    def as_dict(self) -> dict[str, Any]:
        return {
            "subject_ref": self.subject_ref,
            "lost": list(self.lost),
            "unfinished_deletes": list(self.unfinished_deletes),
            "pending_deletes": list(self.pending_deletes),
            "unregistered": list(self.unregistered),
            "leftover_files": list(self.leftover_files),
            "applied": self.applied,
            "forgot_lost": self.forgot_lost,
            "ok": self.ok,
        }


def _storage_key(ref: str) -> str:
    """The catalog's ``storage_key`` of every asset a subject's partition stores."""
    return f"memories/subject={ref}"


def _vector_ids(row: MemoryRow) -> list[str]:
    """Asset ids of a memory's vectors (one per embedded field)."""
    return [f"{row.memory_id}/{i}" for i in range(len(row.index))]


def _new_id(now_us: int) -> str:
    """A 32-hex-digit asset id: 7 bytes of time, then 9 random bytes. Time-ordered
    ids keep catalog B-tree inserts sequential (a quarter cheaper than random ids)."""
    return (now_us & 0xFFFFFFFFFFFFFF).to_bytes(7, "big").hex() + os.urandom(9).hex()


def _newest_first(row: MemoryRow) -> tuple[int, str]:
    return (row.updated_us, row.memory_id)


def _memory(row: MemoryRow) -> Memory:
    return Memory(row)


def _labels(namespace: Sequence[str] | str) -> tuple[str, ...]:
    if isinstance(namespace, str):
        return (check_text(namespace, "a namespace label"),)
    # Every put and get passes here: tuples and lists skip the ABC check, and ASCII
    # labels the call into check_text.
    if type(namespace) not in (tuple, list) and not isinstance(namespace, Sequence):
        raise InvalidInput("a namespace is a tuple of strings")
    for label in namespace:
        if type(label) is not str or not label.isascii():
            check_text(label, "a namespace label")
    return tuple(namespace)


def _namespace(namespace: Sequence[str] | str) -> tuple[str, ...]:
    ns = _labels(namespace)
    if not ns or len(ns) > _MAX_NAMESPACE_DEPTH:
        raise InvalidInput(f"a namespace has 1 to {_MAX_NAMESPACE_DEPTH} labels")
    for label in ns:
        if not label or len(label) > _MAX_LABEL:
            raise InvalidInput(f"namespace labels are non-empty strings of at most {_MAX_LABEL}")
    return ns


class Changed(Exception):
    """Internal: a row a rewrite (a correction, an erasure's rebuild or drop) read
    was changed by someone else before the rewrite took the subject lock; nothing
    was written, the rewrite reads again. Never seen by callers."""


def _caller_namespace(namespace: Sequence[str] | str) -> tuple[str, ...]:
    """A namespace a caller may write to: those starting with ``~`` are keyshred's
    own (history versions are written by ``correct`` alone; rewritten by a caller
    they would forge what was true when, or outlive their retention)."""
    ns = _namespace(namespace)
    if ns[0].startswith("~"):
        raise InvalidInput("namespaces starting with '~' are keyshred's own")
    return ns


def _prefix(namespace: Sequence[str] | str) -> tuple[str, ...]:
    return _labels(namespace)


def _key(key: str) -> str:
    if not check_text(key, "a key") or len(key) > _MAX_LABEL:
        raise InvalidInput(f"a key is a non-empty string of at most {_MAX_LABEL} characters")
    return key


def _checked(item: Any) -> PutItem:
    """A ``PutItem`` whose fields have the types ``_put_rows`` relies on (values and
    names are checked there, where they are encoded)."""
    if not isinstance(item, PutItem):
        raise InvalidInput("put_many takes a list of PutItem")
    check_text(item.scope, "a scope")
    for name, what in ((item.purpose, "a purpose"), (item.category, "a category")):
        if name is not None:
            check_text(name, what)
    for ids, what in ((item.sources, "sources"), (item.mentions, "mentions")):
        if type(ids) is tuple or type(ids) is list:
            continue  # the usual case, without the ABC check
        if isinstance(ids, str) or not isinstance(ids, Sequence):
            raise InvalidInput(f"{what} is a list")
    check_index(item.index)
    if item.ttl is not None and not isinstance(item.ttl, timedelta):
        raise InvalidInput("a ttl is a timedelta")
    return item


def _reject_nan(value: str) -> Any:
    raise ValueError(value)


class AuditSink(Protocol):
    """Where the store records events (``keyshred.audit.AuditLog``)."""

    def record(self, event: str, **fields: Any) -> Any: ...

    def record_many(
        self, event: str, items: Sequence[Mapping[str, Any]], *, subject_ref: str | None = None
    ) -> int: ...


def text_at(value: Any, path: str) -> str:
    """The text embedded for ``path`` of a JSON value: ``$`` is the whole value, a
    dotted path walks objects (``a.b``) and list indexes (``a.0``). Strings are
    embedded as they are, anything else as canonical JSON; a missing path gives ""."""
    node = value
    if path not in ("$", ""):
        for part in path.removeprefix("$.").split("."):
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return ""
    if isinstance(node, str):
        return node
    return json.dumps(node, sort_keys=True, ensure_ascii=False)
