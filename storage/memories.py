"""The memory store: per-subject, encrypted, consent-checked, catalogued memories.

Every call follows the data path of DESIGN.md: the subject guard first (a suppressed
or erased subject fails before any key is touched), then consent and retention for
writes, then the subject's partition. Namespaces and keys are personal data: they are
stored only encrypted, and found through a keyed hash under the subject's index key.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import sqlalchemy as sa

from keyshred._validate import (
    DEFAULT_MAX_DEPTH,
    check_count,
    check_depth,
    check_filter,
    check_index,
    check_text,
)
from keyshred.errors import (
    ConsentRequired,
    InvalidInput,
    KeyNotFound,
    KeyshredError,
    NotFound,
    SubjectErased,
    SubjectSuppressed,
    ValueTooLarge,
)
from keyshred.keyring.datakey import DataKey
from keyshred.keyring.keyring import Keyring
from keyshred.keyring.keystore import owner_token
from keyshred.storage import faults
from keyshred.storage.catalog import ACTIVE, ASSET_COLUMNS, AssetRow, Catalog
from keyshred.storage.embeddings import Embedder
from keyshred.storage.erasable import DROP, ErasureTarget, Phase, StoreCheck, StoreErasure
from keyshred.storage.freeze import FreezeLock
from keyshred.storage.mentions import MentionFinder
from keyshred.storage.partition import (
    MemoryRow,
    Partition,
    from_us,
    row_key_id,
    seal_row,
    to_us,
)
from keyshred.storage.pme import PmeCrypto
from keyshred.storage.policy import Policy
from keyshred.storage.schema import assets
from keyshred.storage.sealer import KeyringSealer, Sealer
from keyshred.storage.vectors import VectorIndex, VectorItem

__all__ = ["Memory", "MemoryStore", "PutItem", "RepairReport", "text_at"]

MEMORY_KIND = "memory"
HISTORY = "~history"  # superseded versions of corrected memories live under it
_VERSION_SEP = "\x1f"
VECTOR_KIND = "vector"
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


# ``_register_rows`` binds memory assets as tuples in the catalog's column order.
_ASSET_ORDER = (
    "asset_id",
    "subject_ref",
    "scope",
    "kind",
    "storage_system",
    "storage_key",
    "purpose",
    "category",
    "created_at",
    "retain_until",
    "status",
    "lookup",
    "producer",
    "producer_version",
)
if _ASSET_ORDER != ASSET_COLUMNS:  # pragma: no cover - a schema edit
    raise ImportError("keyshred.storage.memories does not match the ks_assets columns")


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


class MemoryStore:
    """``ks.memories``: put, get, search, update, delete."""

    def __init__(
        self,
        root: Path,
        catalog: Catalog,
        keyring: Keyring,
        policy: Policy,
        subject_ref: Callable[[Any], str],
        *,
        max_value_bytes: int = 1024 * 1024,
        max_value_depth: int = DEFAULT_MAX_DEPTH,
        flush_records: int = 1000,
        fsync: bool = True,
        max_open_partitions: int = 256,
        vectors: VectorIndex | None = None,
        embedder: Callable[[], Embedder] | None = None,
        mentions: MentionFinder | None = None,
        freeze: FreezeLock | None = None,
        audit: AuditSink | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._root = root / "memories"
        self._vectors = vectors
        self._embedder_factory = embedder
        self._embedder: Embedder | None = None
        self._catalog = catalog
        self._keyring = keyring
        self._policy = policy
        self._ref = subject_ref
        self._max_value = max_value_bytes
        self._max_depth = max_value_depth
        self._flush_records = flush_records
        self._fsync = fsync
        self._max_open = max_open_partitions
        self._clock = clock
        # Always sealed: there is no plaintext mode (a benchmark's baseline brings
        # its own code).
        self._sealer: Sealer = KeyringSealer(keyring)
        self._pme = PmeCrypto(keyring)
        # Registered identifiers found in values add mentions (ks.subjects); the
        # facade builds the finder and shares it with the vault and checkpoints.
        self._mentions = mentions or MentionFinder(
            catalog, keyring, policy, max_chars=max_value_bytes
        )
        self._partitions: OrderedDict[str, Partition] = OrderedDict()
        self._lock = threading.Lock()
        # Held shared by every partition write (and the vector index's drops),
        # exclusive by a backup's snapshot (``frozen``).
        self._freeze = freeze or FreezeLock(root / "FREEZE")
        self._audit = audit  # corrections and deletions are events
        self._sql: str | None = None  # the compiled query of _expected_ids

    # -- partitions ----------------------------------------------------------------

    def partition_path(self, subject_ref: str) -> Path:
        return self._root / f"subject={subject_ref}"

    def _new_partition(self, subject_ref: str, *, checked: bool) -> Partition:
        """A partition object; ``checked`` ones compare their rows with the catalog on
        load and finish recorded deletions (repair reads without either)."""
        return Partition(
            self.partition_path(subject_ref),
            subject_ref,
            self._keyring,
            self._sealer,
            self._pme,
            fsync=self._fsync,
            expected_ids=self._expected_ids if checked else None,
            finish_deletes=self._finish_deletes if checked else None,
            freeze=self._freeze,
        )

    def _partition(self, subject_ref: str) -> Partition:
        with self._lock:
            part = self._partitions.get(subject_ref)
            if part is None:
                part = self._new_partition(subject_ref, checked=True)
                self._partitions[subject_ref] = part
                while len(self._partitions) > self._max_open:
                    _, old = self._partitions.popitem(last=False)
                    old.close()
            else:
                self._partitions.move_to_end(subject_ref)
            return part

    def _expected_ids(self, subject_ref: str) -> set[str]:
        """Memories the catalog holds for the subject, except those of suppressed
        scopes (an erasure in progress removes them from files first)."""
        guard = self._catalog.guard(subject_ref)
        if guard.status != ACTIVE:
            # An erasure is under way (files go before catalog rows) and every read
            # and write is refused anyway: there is nothing to hold the files to.
            return set()
        # Every asset stored in the partition: memories and derived assets alike.
        if self._sql is None:
            stmt = sa.select(assets.c.asset_id, assets.c.scope).where(
                assets.c.subject_ref == sa.bindparam("subject_ref"),
                assets.c.storage_key == sa.bindparam("storage_key"),
            )
            self._sql = self._catalog.compile({"partition_ids": stmt})["partition_ids"]
        with self._catalog.hot(write=False) as cur:
            cur.execute(
                self._sql, {"subject_ref": subject_ref, "storage_key": _storage_key(subject_ref)}
            )
            ids = cur.fetchall()
        return {a for a, scope in ids if scope not in guard.scopes}

    def _finish_deletes(self, part: Partition, missing: set[str]) -> set[str]:
        """Finish the deletions ``_delete_rows`` started (their assets marked
        "deleting") whose rows the partition no longer holds: a flush rewrites
        their bytes away, then their vectors and catalog rows go. Returns the
        missing ids no deletion explains. Runs while the partition is being opened;
        outside the partition lock (a reader catching up while a delete may still
        be running in another process) it only explains, and acts on nothing."""
        ref = part.subject_ref
        marked = {a.asset_id: a.kind for a in self._catalog.assets(ref, status=DELETING)}
        done = {m for m in missing if marked.get(m) not in (None, VECTOR_KIND)}
        if done and part.holds_flock:
            part.flush()
            self._forget(ref, done, marked)
            if self._audit is not None:
                self._audit.record("memory.delete_finished", subject_ref=ref, count=len(done))
        return missing - done

    def _forget(self, ref: str, memory_ids: set[str], kinds: Mapping[str, str]) -> None:
        """Remove the vectors and catalog assets of memories the partition lacks."""
        vector_ids = [
            a for a, kind in kinds.items() if kind == VECTOR_KIND and a.split("/")[0] in memory_ids
        ]
        if self._vectors is not None:
            self._vectors.delete(ref, memory_ids)
        self._catalog.delete([*sorted(memory_ids), *vector_ids])

    def evict(self, subject_ref: str) -> None:
        """Forget a subject's decrypted rows, vectors and cached keys in this process."""
        with self._lock:
            part = self._partitions.pop(subject_ref, None)
        if part is not None:
            part.close()
        if self._vectors is not None:
            self._vectors.evict(subject_ref)
        self._pme.forget()

    # -- embeddings ----------------------------------------------------------------

    @property
    def embedder(self) -> Embedder:
        """The embedding function (the default model is loaded on first use)."""
        if self._embedder is None:
            if self._embedder_factory is None:
                raise KeyshredError("this store has no embedding function")
            self._embedder = self._embedder_factory()
        return self._embedder

    def _vector_store(self) -> VectorIndex:
        if self._vectors is None:
            raise KeyshredError("this store has no vector index")
        return self._vectors

    # -- validation ----------------------------------------------------------------

    def _encode(self, value: Any) -> bytes:
        check_depth(value, self._max_depth)
        try:
            raw = _JSON.encode(value).encode("utf-8")
        except (TypeError, ValueError):
            raise InvalidInput(
                "a memory value must be JSON (dict, list, str, number, bool, None)"
            ) from None
        if len(raw) > self._max_value:
            raise ValueTooLarge(
                f"the value is {len(raw)} bytes; storage.max_value_bytes is {self._max_value}"
            )
        return raw

    # -- writes --------------------------------------------------------------------

    def put(
        self,
        subject: Any,
        namespace: Sequence[str] | str,
        key: str,
        value: Any,
        *,
        scope: str = "default",
        purpose: str | None = None,
        category: str | None = None,
        sources: Sequence[str] = (),
        mentions: Iterable[Any] = (),
        index: bool | Sequence[str] | None = None,
        epoch: int | None = None,
    ) -> Memory:
        """Create or replace the memory at (namespace, key) of ``subject``.

        ``index`` embeds the value for semantic search: ``True`` the whole value,
        a list of JSON paths (``"text"``, ``"a.b"``, ``"$"``) those fields, ``False``
        nothing (removing earlier vectors); ``None`` keeps what an existing memory had.
        """
        if isinstance(mentions, str) or not isinstance(mentions, Iterable):
            raise InvalidInput("mentions is a list of subjects")
        item = PutItem(
            namespace, key, value, scope, purpose, category, sources, tuple(mentions), index
        )
        return self.put_many(subject, [item], epoch=epoch)[0]

    def put_many(
        self, subject: Any, items: Sequence[PutItem], *, epoch: int | None = None
    ) -> list[Memory]:
        """Write a batch for one subject: one log append, one fsync, one catalog
        transaction. All-or-nothing: a bad item fails the batch before anything is
        written."""
        if not isinstance(items, Sequence):
            raise InvalidInput("put_many takes a list of PutItem")
        for item in items:
            if _namespace(_checked(item).namespace)[0].startswith("~"):
                raise InvalidInput("namespaces starting with '~' are keyshred's own")
        ref = self._ref(subject)
        return self._put_rows(ref, items, epoch=epoch)

    def _put_rows(
        self,
        ref: str,
        items: Sequence[PutItem],
        *,
        epoch: int | None = None,
        mention_refs: Sequence[tuple[str, ...]] | None = None,
        produced_by: tuple[str, str | None, str | None] | None = None,
        carried_detected: frozenset[str] = frozenset(),
        kept_sources: Collection[str] = (),
    ) -> list[Memory]:
        """``put_many`` by subject_ref; ``mention_refs`` (one tuple per item) gives
        mentions as refs already, ``produced_by`` the assets' (kind, producer,
        producer version) (rebuilding derived assets); ``carried_detected`` are
        mentions of ``mention_refs`` carried over from an earlier version that were
        detected there (they stay counted as detected); ``kept_sources`` are sources
        the memory had already (an update keeps them even once they are deleted)."""
        guard = self._catalog.guard(ref)
        current_epoch = self._catalog.enforce(ref, guard, epoch)
        now = self._clock()
        now_us = to_us(now)
        prepared = []
        # (scope, purpose, category) -> (scope name, purpose, category, retain_until):
        # a batch usually has one, so policy and consent are looked up once.
        targets: dict[tuple[str, str | None, str | None], tuple[str, str, str, int]] = {}
        # Subjects whose registered identifiers are in each item (one catalog query),
        # and per (namespace, key) those of them no caller declared.
        found = self._mentions.find(ref, items)
        detected: dict[tuple[tuple[str, ...], str], frozenset[str]] = {}
        if any(found) and not kept_sources:
            self._check_derived_names(ref, items)
        for n_item, item in enumerate(items):
            ns, k = _namespace(item.namespace), _key(item.key)
            raw = self._encode(item.value)
            target = targets.get((item.scope, item.purpose, item.category))
            if target is None:
                target = self._target(ref, item, now)
                if target[0] in guard.scopes:
                    raise SubjectSuppressed(
                        f"scope {target[0]!r} of subject_ref {ref} is suppressed"
                    )
                targets[(item.scope, item.purpose, item.category)] = target
            if mention_refs is not None:
                mentioned = tuple(sorted(set(mention_refs[n_item])))
            else:
                mentioned = (
                    tuple(sorted({self._ref(m) for m in item.mentions})) if item.mentions else ()
                )
            detected[(ns, k)] = found[n_item].difference(mentioned) | carried_detected.intersection(
                mentioned
            )
            if found[n_item]:
                mentioned = tuple(sorted(found[n_item].union(mentioned)))
            for source in item.sources:
                if not isinstance(source, str) or not source:
                    raise InvalidInput("sources are asset ids")
            if item.ttl is not None:
                if item.ttl <= timedelta(0):
                    raise InvalidInput("a ttl is positive")
                capped = min(target[3], now_us + int(item.ttl.total_seconds() * 1_000_000))
                target = (target[0], target[1], target[2], capped)
            prepared.append((ns, k, raw, *target, mentioned, item))
        if not prepared:
            return []
        # Who the sources are about (their holders and mentions, transitively): one
        # catalog query for the batch, before the lock. They become key owners.
        source_owners = (
            self._catalog.source_owners({s for *_, item in prepared for s in item.sources})
            if self._sealer.encrypted and any(item.sources for *_, item in prepared)
            else {}
        )
        if self._sealer.encrypted:
            # A new source the catalog does not hold gives no owner, so the value
            # derived from it would go under the holder's key alone: refused. It was
            # deleted or erased (a value read before its subject's erasure completed
            # would otherwise outlive it) or never registered.
            for *_, item in prepared:
                for source in item.sources:
                    if source not in source_owners and source not in kept_sources:
                        raise NotFound(
                            "a source asset is not in the catalog: deleted, erased or "
                            "never registered"
                        )

        part = self._partition(ref)
        # Embedding is slow: do it before taking the partition lock. The fields of an
        # existing memory (index=None) are read now; a concurrent change of them is
        # caught under the lock below and embedded there.
        part.ensure_loaded(refresh=False)  # caught up with others under the lock
        # Lookup hashes computed here (only if the index key exists: no key is created
        # before the lock) are reused under the lock while that key is unchanged.
        lookups: list[str | None] = [
            self._early_lookup(part, ns, k) if item.index is None else None
            for ns, k, _, *_, item in prepared
        ]
        index_key = part.lookup_key_id
        fields = [self._fields(part, lookups[n], item) for n, (*_, item) in enumerate(prepared)]
        vectors = self._embed_rows(prepared, fields)
        with part.flocked():
            # Again under the lock: the erasure coordinator destroys keys and drops
            # partitions under this lock, after suppressing. A writer that gets here
            # after a suppression stops before touching (or creating) any key.
            self._catalog.enforce(ref, self._catalog.guard(ref), epoch)
            rows: list[MemoryRow] = []
            replaced = False
            seen: dict[str, MemoryRow] = {}
            for n, (ns, k, raw, scope, purpose, category, retain, mentioned, item) in enumerate(
                prepared
            ):
                early = lookups[n] if part.lookup_key_id == index_key else None
                lookup = early or part.lookup(ns, k)
                # An opaque row at this name (its shared key destroyed) is replaced
                # like any other: same asset, its vectors and catalog row renewed.
                old = seen.get(lookup) or part.rows.get(lookup) or part.opaque.get(lookup)
                replaced = replaced or old is not None
                if item.index is None and old is not None and old.index != fields[n]:
                    fields[n] = old.index
                    vectors[n] = self._embed_one(raw, old.index)
                row = MemoryRow(
                    memory_id=old.memory_id if old else _new_id(now_us),
                    namespace=ns,
                    key=k,
                    value=raw,
                    scope=scope,
                    purpose=purpose,
                    category=category,
                    created_us=old.created_us if old else now_us,
                    updated_us=now_us,
                    retain_us=retain,
                    lookup=lookup,
                    sources=tuple(item.sources),
                    mentions=mentioned,
                    index=fields[n],
                )
                seen[lookup] = row
                rows.append(row)
            last = {r.lookup: i for i, r in enumerate(rows)}  # last write of a key wins
            vectors = [vectors[i] for i in last.values()]
            rows = [rows[i] for i in last.values()]
            if self._sealer.encrypted:
                rows = self._seal_shared(ref, rows, source_owners)
            previous = {
                r.lookup: part.rows.get(r.lookup) or part.opaque.get(r.lookup) for r in rows
            }
            stale = [v for p in previous.values() if p is not None for v in _vector_ids(p)]
            vec_items = [
                VectorItem(r.memory_id, i, f, r.scope, now_us, vecs[i], row_key_id(r))
                for r, vecs in zip(rows, vectors, strict=True)
                for i, f in enumerate(r.index)
            ]
            part.append_puts(rows)
            faults.reached("put.after_log")
            try:
                if vec_items or stale:
                    self._vector_store().upsert(
                        ref, vec_items, replace=[p.memory_id for p in previous.values() if p]
                    )
                    faults.reached("put.after_vectors")
                self._register_rows(
                    ref,
                    rows,
                    expected_epoch=current_epoch,
                    replace=replaced or bool(vec_items),
                    remove=stale,
                    produced_by=produced_by,
                    detected=[
                        (r.memory_id, m) for r in rows for m in detected[(r.namespace, r.key)]
                    ],
                )
            except BaseException:
                self._undo(part, rows, previous)
                fresh = {r.memory_id for r in rows if previous.get(r.lookup) is None}
                if vec_items and self._vectors is not None:
                    with contextlib.suppress(Exception):  # the original error matters
                        self._vectors.delete(ref, fresh)
                raise
            faults.reached("put.after_catalog")
            if part.log_records >= self._flush_records:
                part.flush()
        return [_memory(r) for r in rows]

    def _check_derived_names(self, ref: str, items: Sequence[PutItem]) -> None:
        """A derived asset's namespace and key stay readable under the holder's
        own key (its rebuild after an erasure needs them), so they may not carry
        another subject's registered identifier: that would outlive the subject's
        erasure in the rebuilt asset. Values are sealed under the owners' key."""
        derived = [
            PutItem(item.namespace, item.key, None, item.scope)
            for item in items
            if item.sources and isinstance(item.scope, str)
        ]
        if derived and any(self._mentions.find(ref, derived)):
            raise InvalidInput(
                "a derived asset's namespace and key stay readable after the erasure "
                "of the subjects it is about (its rebuild needs them): they may not "
                "hold another subject's registered identifier"
            )

    def _seal_shared(
        self, ref: str, rows: list[MemoryRow], source_owners: Mapping[str, set[str]]
    ) -> list[MemoryRow]:
        """Seal every row whose owner set is more than its holder (the subjects it
        mentions, the owners of its sources) under the key of that owner set: one
        key per (holder, scope, owner set), shared by all its rows, created here
        under the partition lock like every first key of a subject."""
        keys: dict[tuple[str, tuple[str, ...]], DataKey] = {}
        checked: set[str] = set()
        out = []
        for r in rows:
            owners = set(r.mentions)
            for source in r.sources:
                owners |= source_owners.get(source, set())
            # The holder's own data of this scope is under the scope key already; of
            # another scope it stays an owner (withdrawing that scope kills this key).
            owners -= {ref, owner_token(ref, r.scope)}
            if not owners:
                out.append(r)
                continue
            for owner in owners - checked:
                # Data about a subject that is being erased (or was) is refused before
                # a key is created for it: a key made after the erasure destroyed the
                # subject's keys would carry the data past it. The catalog refuses the
                # mention again in the write transaction, and the erasure sweeps any
                # key created in between.
                self._check_owner(owner)
                checked.add(owner)
            wanted = (r.scope, tuple(sorted(owners)))
            key = keys.get(wanted)
            if key is None:
                key = keys[wanted] = self._keyring.data_key(ref, r.scope, owners=wanted[1])
            out.append(seal_row(key, ref, r))
        # Checked again once every key exists: a key made before a suppression is
        # one that erasure's destroy step finds, one made after is refused here.
        # Without this, a whole erasure (its verify sweep included) that ran between
        # the first check and the key's creation left the key alive, and the row the
        # catalog then refused stayed readable in the log and the vectors under it.
        for owner in checked:
            self._check_owner(owner)
        return out

    def _check_owner(self, owner: str) -> None:
        """Refuse data about an owner (``ref``, or ``ref@scope``: its data in that
        scope) whose subject, or that scope of it, is suppressed or erased."""
        subject, _, scope = owner.partition("@")
        try:
            self._catalog.check_guard(subject, scope=scope or None)
        except SubjectSuppressed:
            raise SubjectSuppressed(
                f"the memory is about subject_ref {subject}, which is being erased or was erased"
            ) from None

    # -- indexing ------------------------------------------------------------------

    @staticmethod
    def _early_lookup(part: Partition, ns: tuple[str, ...], key: str) -> str | None:
        if not part.rows:
            return None
        try:  # before the partition lock: never create a key here
            return part.lookup(ns, key, create=False)
        except (KeyNotFound, SubjectErased):
            return None

    def _fields(self, part: Partition, lookup: str | None, item: PutItem) -> tuple[str, ...]:
        if item.index is None:
            old = part.rows.get(lookup) if lookup is not None else None
            return old.index if old is not None else ()
        if item.index is False:
            return ()
        if item.index is True:
            return ("$",)
        if isinstance(item.index, str):
            return (item.index,)
        paths = tuple(dict.fromkeys(item.index))
        if not all(isinstance(p, str) and p for p in paths):
            raise InvalidInput("index paths are non-empty strings")
        return paths

    def _embed_rows(
        self, prepared: Sequence[tuple[Any, ...]], fields: Sequence[tuple[str, ...]]
    ) -> list[list[Any]]:
        """One embedding call for every field of every item of the batch."""
        texts: list[str] = []
        spans: list[tuple[int, int]] = []
        for (_, _, raw, *_), paths in zip(prepared, fields, strict=True):
            start = len(texts)
            value = json.loads(raw) if paths else None
            texts += [text_at(value, p) for p in paths]
            spans.append((start, len(texts)))
        if not texts:
            return [[] for _ in prepared]
        matrix = self.embedder.embed(texts)
        return [[matrix[i] for i in range(a, b)] for a, b in spans]

    def _embed_one(self, raw: bytes, paths: tuple[str, ...]) -> list[Any]:
        if not paths:
            return []
        value = json.loads(raw)
        matrix = self.embedder.embed([text_at(value, p) for p in paths])
        return [matrix[i] for i in range(len(paths))]

    def _register_rows(
        self,
        ref: str,
        rows: Sequence[MemoryRow],
        *,
        expected_epoch: int,
        replace: bool,
        remove: Sequence[str],
        produced_by: tuple[str, str | None, str | None] | None = None,
        detected: Sequence[tuple[str, str]] = (),
    ) -> None:
        """Register the rows (and their vectors) as assets in one catalog
        transaction. Memory rows go in as parameter tuples built here: the same
        transaction as ``Catalog.register`` without an ``AssetRow`` per memory (a
        quarter of a batched put's time went into building and converting those)."""
        time_param = self._catalog.time_param
        converted: dict[int, Any] = {}

        def db_time(us: int) -> Any:
            value = converted.get(us)
            if value is None:
                value = converted[us] = time_param(from_us(us))
            return value

        storage_key = _storage_key(ref)
        kind, producer, version = produced_by or (MEMORY_KIND, None, None)
        params = [
            (
                r.memory_id,
                ref,
                r.scope,
                kind,
                "parquet",
                storage_key,
                r.purpose,
                r.category,
                db_time(r.created_us),
                db_time(r.retain_us),
                "live",
                r.lookup,
                producer,
                version,
            )
            for r in rows
        ]
        sources = [(r.memory_id, src) for r in rows for src in r.sources]
        mentions = [(r.memory_id, m) for r in rows for m in r.mentions]
        times: dict[int, datetime] = {}
        vectors = [self._vector_asset(ref, r, i, times) for r in rows for i in range(len(r.index))]
        if vectors:
            params += [self._catalog.asset_params(v) for v in vectors]
            sources += [(v.asset_id, src) for v in vectors for src in v.sources]
        ids = [r.memory_id for r in rows] + [v.asset_id for v in vectors]
        self._catalog.insert_assets(
            params,
            scopes={(ref, r.scope) for r in rows},
            expected_epoch=expected_epoch,
            replace=[*remove, *ids] if replace or remove else (),
            sources=sources,
            mentions=mentions,
            detected=detected,
        )

    def _vector_asset(
        self, ref: str, row: MemoryRow, n: int, times: dict[int, datetime]
    ) -> AssetRow:
        return replace(
            self._asset(ref, row, times),
            asset_id=f"{row.memory_id}/{n}",
            kind=VECTOR_KIND,
            storage_system="lancedb",
            storage_key=f"vectors/{ref}.lance",
            lookup=None,
            sources=(row.memory_id,),
            mentions=(),
        )

    def _target(self, ref: str, item: PutItem, now: datetime) -> tuple[str, str, str, int]:
        """Resolve scope, purpose and category, check consent, compute retention."""
        rule, purpose, category = self._policy.resolve(item.scope, item.purpose, item.category)
        consent_end = None
        if rule.needs_consent:
            consent = self._catalog.active_consent(ref, purpose, category, "store", now)
            if consent is None:
                raise ConsentRequired(
                    f"no active consent of subject_ref {ref} for purpose {purpose!r}, "
                    f"category {category!r}"
                )
            consent_end = consent.end_at
        retain = to_us(self._policy.retain_until(rule, now, consent_end))
        return rule.name, purpose, category, retain

    def _undo(
        self, part: Partition, rows: list[MemoryRow], previous: Mapping[str, MemoryRow | None]
    ) -> None:
        """The catalog refused (e.g. the subject was suppressed meanwhile): take the
        logged writes back so the partition matches the catalog again."""
        try:
            restore = [p for p in previous.values() if p is not None]
            fresh = [r for r in rows if previous.get(r.lookup) is None]
            for r in fresh:
                part.append_delete(r)
            if restore:
                part.append_puts(restore)
        except Exception:  # noqa: BLE001,S110 - the original error matters more
            pass

    def _asset(self, ref: str, row: MemoryRow, times: dict[int, datetime]) -> AssetRow:
        created = times.get(row.created_us)
        if created is None:
            created = times[row.created_us] = from_us(row.created_us)
        retain = times.get(row.retain_us)
        if retain is None:
            retain = times[row.retain_us] = from_us(row.retain_us)
        return AssetRow(
            asset_id=row.memory_id,
            subject_ref=ref,
            scope=row.scope,
            kind=MEMORY_KIND,
            storage_system="parquet",
            storage_key=_storage_key(ref),
            purpose=row.purpose,
            category=row.category,
            created_at=created,
            retain_until=retain,
            lookup=row.lookup,
            sources=row.sources,
            mentions=row.mentions,
        )

    def update(
        self,
        subject: Any,
        namespace: Sequence[str] | str,
        key: str,
        value: Any,
        *,
        sources: Sequence[str] | None = None,
        mentions: Iterable[Any] | None = None,
        epoch: int | None = None,
    ) -> Memory:
        """Replace the value of an existing memory (``NotFound`` if there is none);
        scope, purpose, category and provenance stay as they are, unless ``sources``
        or ``mentions`` (subjects) are given: those replace the old ones. Dropping a
        mention silently would take the memory out of that subject's erasure."""
        existing = self._row(subject, namespace, key)
        if existing is None:
            raise NotFound("no memory at that namespace and key")
        if mentions is not None and (
            isinstance(mentions, str) or not isinstance(mentions, Iterable)
        ):
            raise InvalidInput("mentions is a list of subjects")
        refs = existing.mentions if mentions is None else tuple({self._ref(m) for m in mentions})
        # Kept mentions keep how they came (found in the value, or declared).
        carried = (
            self._catalog.detected_mentions(existing.memory_id)
            if mentions is None and refs
            else frozenset()
        )
        item = PutItem(
            existing.namespace,
            existing.key,
            value,
            existing.scope,
            existing.purpose,
            existing.category,
            existing.sources if sources is None else sources,
        )
        return self._put_rows(
            self._ref(subject),
            [_checked(item)],
            epoch=epoch,
            mention_refs=[refs],
            carried_detected=carried,
            kept_sources=existing.sources,
        )[0]

    def delete(self, subject: Any, namespace: Sequence[str] | str, key: str) -> bool:
        """Delete one memory physically: the log records and segment rows holding it
        are rewritten away before this returns. False if there was nothing."""
        ref = self._ref(subject)
        self._catalog.check_guard(ref)
        ns, k = _namespace(namespace), _key(key)
        part = self._partition(ref)
        with part.flocked():
            found = part.lookup(ns, k) if part.rows or part.opaque else None
            # An opaque row (its shared key destroyed) at that name goes too: deleting
            # needs its name's lookup hash, not its key.
            row = None if found is None else part.rows.get(found) or part.opaque.get(found)
            if row is None:
                return False
            # Deletion is not correction: the value goes with every earlier version.
            doomed = [row, *self._history_rows(part, ns, k)]
            self._delete_rows(ref, part, doomed)
        if self._audit is not None:
            self._audit.record(
                "memory.deleted", subject_ref=ref, asset_id=row.memory_id, versions=len(doomed)
            )
        return True

    # -- correction (supersede, keep history) ----------------------------------------

    @staticmethod
    def _history_ns(ns: tuple[str, ...]) -> tuple[str, ...]:
        return (HISTORY, *ns)

    def _history_rows(self, part: Partition, ns: tuple[str, ...], k: str) -> list[MemoryRow]:
        hns = self._history_ns(ns)
        mark = k + _VERSION_SEP
        return [r for r in part.rows.values() if r.namespace == hns and r.key.startswith(mark)]

    def correct(
        self,
        subject: Any,
        namespace: Sequence[str] | str,
        key: str,
        value: Any,
        *,
        reason: str,
    ) -> Memory:
        """Supersede a memory's value and keep the old one as a history version
        (valid from its last write until now), for "what was true when". Not a
        deletion: ``delete`` and erasure remove the value *and* its history."""
        if not isinstance(reason, str) or not 0 < len(reason) <= 128:
            raise InvalidInput("a correction has a short reason (it is audited)")
        ref = self._ref(subject)
        ns, k = _namespace(namespace), _key(key)
        old = self._row(subject, ns, k)
        if old is None:
            raise NotFound("no memory to correct at that namespace and key")
        part = self._partition(ref)
        version = len(self._history_rows(part, ns, k)) + 1
        now = self._clock()
        record = {
            "value": json.loads(old.value),
            "valid_from": from_us(old.updated_us).isoformat(),
            "valid_to": now.isoformat(),
            "reason": reason,
            "version": version,
        }
        items = [
            PutItem(
                self._history_ns(ns),
                f"{k}{_VERSION_SEP}{version:08d}",
                record,
                old.scope,
                old.purpose,
                old.category,
                old.sources,  # the old value is about the same subjects: same owners
                index=False,
            ),
            PutItem(ns, k, value, old.scope, old.purpose, old.category, old.sources, (), None),
        ]
        carried = self._catalog.detected_mentions(old.memory_id) if old.mentions else frozenset()
        memory = self._put_rows(
            ref,
            items,
            mention_refs=[old.mentions, old.mentions],
            carried_detected=carried,
            kept_sources=old.sources,
        )[1]
        if self._audit is not None:
            self._audit.record(
                "memory.corrected", subject_ref=ref, asset_id=memory.memory_id, version=version
            )
        return memory

    def history(
        self, subject: Any, namespace: Sequence[str] | str, key: str
    ) -> list[dict[str, Any]]:
        """Every superseded version (oldest first), then the current value:
        ``{"value", "valid_from", "valid_to", "reason", "version"}``."""
        ref = self._ref(subject)
        ns, k = _namespace(namespace), _key(key)
        current = self._row(subject, ns, k)
        part = self._partition(ref)
        versions = sorted(self._history_rows(part, ns, k), key=lambda r: r.key)
        out = [json.loads(r.value) for r in versions]
        if current is not None:
            out.append(
                {
                    "value": json.loads(current.value),
                    "valid_from": from_us(current.updated_us).isoformat(),
                    "valid_to": None,
                    "reason": None,
                    "version": len(out) + 1,
                }
            )
        return out

    # -- reads ---------------------------------------------------------------------

    def _row(self, subject: Any, namespace: Sequence[str] | str, key: str) -> MemoryRow | None:
        ref = self._ref(subject)
        guard = self._catalog.guard(ref)
        self._catalog.enforce(ref, guard, None)
        ns, k = _namespace(namespace), _key(key)
        part = self._partition(ref)
        part.ensure_loaded()
        if not part.rows:  # no lookup key is created just to read nothing
            return None
        row = part.rows.get(part.lookup(ns, k))
        if row is not None and row.scope in guard.scopes:
            raise SubjectSuppressed(f"scope {row.scope!r} of subject_ref {ref} is suppressed")
        if row is not None and row.retain_us <= to_us(self._clock()):
            return None  # past its retain-until: gone for every read, deleted by retention
        return row

    def get(self, subject: Any, namespace: Sequence[str] | str, key: str) -> Memory | None:
        row = self._row(subject, namespace, key)
        return None if row is None else _memory(row)

    def search(
        self,
        subject: Any,
        namespace_prefix: Sequence[str] | str = (),
        *,
        query: str | None = None,
        filter: Mapping[str, Any] | None = None,
        scope: str | None = None,
        purpose: str | None = None,
        category: str | None = None,
        limit: int = 10,
        offset: int = 0,
    ) -> list[Memory]:
        """Memories under a namespace prefix, with metadata filters (scope, purpose,
        category) and value filters (``{"field": value}`` or ``{"field": {"$gt": 3}}``)
        applied first. Without ``query``: newest first. With ``query``: ranked by
        cosine similarity inside this subject's own vectors (only indexed memories
        match), each result carrying its ``score``."""
        return self.search_ref(
            self._ref(subject),
            namespace_prefix,
            query=query,
            filter=filter,
            scope=scope,
            purpose=purpose,
            category=category,
            limit=limit,
            offset=offset,
        )

    def search_ref(
        self,
        ref: str,
        namespace_prefix: Sequence[str] | str = (),
        *,
        query: str | None = None,
        filter: Mapping[str, Any] | None = None,
        scope: str | None = None,
        purpose: str | None = None,
        category: str | None = None,
        limit: int = 10,
        offset: int = 0,
        order: str = "newest",
    ) -> list[Memory]:
        """``search`` by subject_ref (guard-checked); ``order="insertion"`` lists
        without a query oldest first, namespace by namespace."""
        check_count(limit, "limit")
        check_count(offset, "offset")
        check_filter(filter)
        if query is not None:
            check_text(query, "a query")
        guard = self._catalog.guard(ref)
        self._catalog.enforce(ref, guard, None)
        prefix = _prefix(namespace_prefix)
        part = self._partition(ref)
        part.ensure_loaded()
        n = len(prefix)
        hidden = guard.scopes  # suppressed scopes: invisible, as if already erased
        now_us = to_us(self._clock())
        hits = []
        test = compile_filter(filter) if filter else None
        own = bool(prefix) and prefix[0].startswith("~")  # keyshred's own namespaces asked for
        for row in list(part.rows.values()):
            if row.namespace[:n] != prefix or row.scope in hidden or row.retain_us <= now_us:
                continue
            if not own and row.namespace[0].startswith("~"):
                continue  # history versions are not search results
            if scope is not None and row.scope != scope:
                continue
            if purpose is not None and row.purpose != purpose:
                continue
            if category is not None and row.category != category:
                continue
            if test is not None and not test(part.parsed_value(row)):
                continue
            hits.append(row)
        if query is not None:
            return self._semantic(ref, part, hits, query, limit=limit, offset=offset)
        if order == "insertion":
            # Oldest first, namespaces in the order they first appeared (LangGraph's
            # InMemoryStore order); only the slice asked for becomes Memory objects.
            first: dict[tuple[str, ...], int] = {}
            for r in hits:
                ns_first = first.get(r.namespace)
                if ns_first is None or r.created_us < ns_first:
                    first[r.namespace] = r.created_us
            top = heapq.nsmallest(
                offset + limit, hits, key=lambda r: (first[r.namespace], r.created_us, r.key)
            )
            return [_memory(r) for r in top[offset:]]
        # Only the first offset + limit are wanted: a bounded heap, not a full sort.
        top = heapq.nlargest(offset + limit, hits, key=_newest_first)
        return [_memory(r) for r in top[offset:]]

    def _semantic(
        self,
        ref: str,
        part: Partition,
        candidates: list[MemoryRow],
        query: str,
        *,
        limit: int,
        offset: int,
    ) -> list[Memory]:
        if not isinstance(query, str):
            raise InvalidInput("a query is a string")
        vectors = self._vector_store()
        indexed = {r.memory_id: r for r in candidates if r.index}
        if not indexed or limit == 0:
            return []
        self._repair(ref, part, indexed, vectors)
        q = self.embedder.embed_query(query)
        ranked = vectors.search(ref, q, offset + limit, allowed=set(indexed))
        return [Memory(indexed[mid], score) for mid, score in ranked[offset:]]

    def _repair(
        self, ref: str, part: Partition, indexed: dict[str, MemoryRow], vectors: VectorIndex
    ) -> None:
        """Embed indexed memories whose vectors are missing or stale: embedded from
        another version of the memory than the row's (``updated_us``). A kill between
        an update's log append and its vector write leaves the old value's vectors;
        so does a failed write rolled back after its vectors were replaced. Searching
        them would rank the memory by a meaning it no longer has."""
        versions = vectors.versions(ref)
        missing = [r for mid, r in indexed.items() if versions.get(mid) != r.updated_us]
        if not missing:
            return
        with part.flocked():
            items = [
                # Stamped with the row's version, which they are now embedded from,
                # and sealed under the row's own (owner-set) key.
                VectorItem(r.memory_id, i, f, r.scope, r.updated_us, vec, row_key_id(r))
                for r in missing
                for i, (f, vec) in enumerate(
                    zip(r.index, self._embed_one(r.value, r.index), strict=True)
                )
            ]
            vectors.upsert(ref, items, replace=[r.memory_id for r in missing])
            times: dict[int, datetime] = {}
            self._catalog.register(
                [self._vector_asset(ref, r, i, times) for r in missing for i in range(len(r.index))]
            )

    def count(self, subject: Any) -> int:
        ref = self._ref(subject)
        self._catalog.check_guard(ref)
        part = self._partition(ref)
        part.ensure_loaded()
        return len(part.rows)

    # -- by subject_ref: the erasure coordinator's entry points ------------------

    def rows_by_id(
        self, ref: str, memory_ids: Iterable[str], *, opaque: bool = False
    ) -> dict[str, MemoryRow]:
        """Rows of ``ref`` by memory id (no guard check: the coordinator decides);
        with ``opaque`` also those whose shared key is destroyed (``row.opaque``:
        no value; a derived asset keeps its namespace and key, for its rebuild)."""
        wanted = set(memory_ids)
        part = self._partition(ref)
        part.ensure_loaded()
        rows = part.all_rows() if opaque else part.rows.values()
        return {r.memory_id: r for r in rows if r.memory_id in wanted}

    def namespaces_ref(self, ref: str, prefix: Sequence[str] = ()) -> set[tuple[str, ...]]:
        """The namespaces of ``ref``'s live memories under ``prefix`` (guard-checked)."""
        guard = self._catalog.guard(ref)
        self._catalog.enforce(ref, guard, None)
        part = self._partition(ref)
        part.ensure_loaded()
        p = tuple(prefix)
        now = to_us(self._clock())
        return {
            r.namespace
            for r in list(part.rows.values())
            if r.namespace[: len(p)] == p
            and r.scope not in guard.scopes
            and r.retain_us > now
            and not r.namespace[0].startswith("~")
        }

    def delete_ids(self, ref: str, memory_ids: Iterable[str]) -> int:
        """Physically delete memories of ``ref`` by id in one rewrite (the retention
        path; no guard check: the coordinator decides). Returns how many."""
        wanted = set(memory_ids)
        part = self._partition(ref)
        with part.flocked():
            doomed = [r for r in part.all_rows() if r.memory_id in wanted]
            if doomed:
                self._delete_rows(ref, part, doomed)
        return len(doomed)

    def delete_prefix_ref(self, ref: str, prefix: Sequence[str]) -> int:
        """Physically delete every memory of ``ref`` under a namespace prefix in one
        rewrite (log, segments, vectors, assets); returns how many."""
        self._catalog.check_guard(ref)
        p = tuple(prefix)
        part = self._partition(ref)
        with part.flocked():
            # Opaque rows too: a derived asset's name is readable, and an empty prefix
            # (everything) takes those whose names are sealed with their value.
            doomed = [r for r in part.all_rows() if r.namespace[: len(p)] == p]
            if not doomed:
                return 0
            self._delete_rows(ref, part, doomed)
        return len(doomed)

    def _delete_rows(self, ref: str, part: Partition, rows: Sequence[MemoryRow]) -> None:
        """Delete physically, under the partition lock, in an order that leaves a
        state that opens at every instant: the catalog marks the assets "deleting"
        first, so a partition found lacking a row is known to have lost it on
        purpose (``_finish_deletes``); then the log records, a flush that rewrites
        the rows' segments without them, the vectors, and last the catalog rows."""
        ids = [a for r in rows for a in (r.memory_id, *_vector_ids(r))]
        self._catalog.update_assets(ids, status=DELETING)
        faults.reached("delete.after_mark")
        for row in rows:
            part.append_delete(row)
        faults.reached("delete.after_log")
        part.flush()
        faults.reached("delete.after_rewrite")
        indexed = [r.memory_id for r in rows if r.index]
        if indexed and self._vectors is not None:
            self._vectors.delete(ref, indexed)
        faults.reached("delete.after_vectors")
        self._catalog.delete(ids)

    def touch(
        self, subject: Any, keys: Sequence[tuple[tuple[str, ...], str]], ttl: timedelta
    ) -> int:
        """Give memories a new retention of ``ttl`` from now (never beyond the
        policy's maximum): a TTL refreshed on read. Returns how many."""
        ref = self._ref(subject)
        self._catalog.check_guard(ref)
        part = self._partition(ref)
        now = self._clock()
        new_us = to_us(now) + int(ttl.total_seconds() * 1_000_000)
        with part.flocked():
            changed = []
            for ns, k in keys:
                row = part.rows.get(part.lookup(ns, k)) if part.rows else None
                if row is None:
                    continue
                rule, _, _ = self._policy.resolve(row.scope, row.purpose, row.category)
                limit = to_us(self._policy.retain_until(rule, now, None))
                changed.append(replace(row, retain_us=min(new_us, limit)))
            if not changed:
                return 0
            part.append_puts(changed)
            for row in changed:
                self._catalog.update_assets([row.memory_id], retain_until=from_us(row.retain_us))
        return len(changed)

    def sweep_expired(self, now: datetime) -> int:
        """Physically delete every memory whose retention has passed (found through
        the catalog's index, not by opening partitions); returns how many."""
        n = 0
        for ref, ids in self._catalog.expired(MEMORY_KIND, now).items():
            try:
                self._catalog.check_guard(ref)
            except SubjectSuppressed:
                continue  # an erasure takes it
            part = self._partition(ref)
            with part.flocked():
                wanted = set(ids)
                doomed = [r for r in part.all_rows() if r.memory_id in wanted]
                if doomed:
                    self._delete_rows(ref, part, doomed)
                    n += len(doomed)
        return n

    # -- repair --------------------------------------------------------------------

    def repair(
        self, subject_ref: str, *, apply: bool = False, forget_lost: bool = False
    ) -> RepairReport:
        """Compare a subject's partition with the catalog; with ``apply`` reconcile
        what is safe (see ``RepairReport``), audited. Never reads a suppressed or
        erased subject: an erasure in progress is resumed, not repaired."""
        if not isinstance(subject_ref, str) or not _SUBJECT_REF.fullmatch(subject_ref):
            raise InvalidInput("a subject_ref is 26 base32 characters (as errors print it)")
        guard = self._catalog.guard(subject_ref)
        epoch = self._catalog.enforce(subject_ref, guard, None)
        if guard.scopes:
            raise SubjectSuppressed(
                f"subject_ref {subject_ref} has suppressed scopes: resume its erasure"
            )
        if not apply and not self.partition_path(subject_ref).exists():
            # A dry run writes nothing: taking the lock would create the folder.
            return self._findings(subject_ref, [], [])
        with self._lock:  # the cached object would check the catalog on load
            cached = self._partitions.pop(subject_ref, None)
        if cached is not None:
            cached.close()
        part = self._new_partition(subject_ref, checked=False)
        try:
            with part.flocked(refresh=False):
                report = self._repair_findings(subject_ref, part)
                if apply and not report.clean:
                    report = self._repair_apply(part, report, epoch, forget_lost=forget_lost)
        finally:
            part.close()
        if report.applied and self._audit is not None:
            self._audit.record(
                "memory.repaired",
                subject_ref=subject_ref,
                lost=len(report.lost),
                forgot_lost=report.forgot_lost,
                unfinished_deletes=len(report.unfinished_deletes),
                pending_deletes=len(report.pending_deletes),
                unregistered=len(report.unregistered),
                leftover_files=len(report.leftover_files),
            )
        return report

    def repair_all(self, *, apply: bool = False, forget_lost: bool = False) -> list[RepairReport]:
        """``repair`` of every partition folder and every subject with memory assets
        (subjects under erasure are left to their erasure)."""
        refs = set(self._catalog.subjects_with(MEMORY_KIND))
        if self._root.exists():
            refs |= {p.name.removeprefix("subject=") for p in self._root.glob("subject=*")}
        out = []
        for ref in sorted(r for r in refs if _SUBJECT_REF.fullmatch(r)):
            try:
                out.append(self.repair(ref, apply=apply, forget_lost=forget_lost))
            except (SubjectSuppressed, SubjectErased):
                continue
        return out

    def _repair_findings(self, ref: str, part: Partition) -> RepairReport:
        rows, leftovers = part.inspect()
        return self._findings(ref, rows, leftovers)

    def _findings(
        self, ref: str, rows: Sequence[MemoryRow], leftovers: Sequence[str]
    ) -> RepairReport:
        """What the partition's ``rows`` and ``leftovers`` mean against the catalog."""
        key = _storage_key(ref)  # memories and derived assets
        status = {a.asset_id: a.status for a in self._catalog.assets(ref) if a.storage_key == key}
        present = {r.memory_id for r in rows}
        missing = status.keys() - present
        return RepairReport(
            ref,
            lost=tuple(sorted(m for m in missing if status[m] != DELETING)),
            unfinished_deletes=tuple(sorted(m for m in missing if status[m] == DELETING)),
            pending_deletes=tuple(
                sorted(m for m in present & status.keys() if status[m] == DELETING)
            ),
            unregistered=tuple(sorted(present - status.keys())),
            leftover_files=tuple(leftovers),
        )

    def _repair_apply(
        self, part: Partition, report: RepairReport, epoch: int, *, forget_lost: bool
    ) -> RepairReport:
        """Act on the findings, under the partition lock the findings were read
        under. Loading the partition removes the leftover files."""
        ref = report.subject_ref
        part.reload()
        kinds = {a.asset_id: a.kind for a in self._catalog.assets(ref, kind=VECTOR_KIND)}
        self._forget(ref, set(report.unfinished_deletes), kinds)
        if forget_lost and report.lost:
            self._forget(ref, set(report.lost), kinds)
        by_id = {r.memory_id: r for r in part.all_rows()}
        pending = [by_id[m] for m in report.pending_deletes]
        if pending:
            self._delete_rows(ref, part, pending)
        if report.unregistered:
            found = [by_id[m] for m in report.unregistered]
            # A killed put about a subject erased (or being erased) since: its row is
            # opaque or its mention would be refused by the catalog, which made every
            # repair of this partition fail (and ``repair_all`` skip it). Its put was
            # never acknowledged, and it is about that subject: deleted, not registered.
            doomed = [r for r in found if r.opaque or not self._mentions_active(r)]
            if doomed:
                self._delete_rows(ref, part, doomed)
            gone = {r.memory_id for r in doomed}
            keep = [r for r in found if r.memory_id not in gone]
            if keep:
                self._register_found(ref, keep, epoch)
        return replace(report, applied=True, forgot_lost=forget_lost and bool(report.lost))

    def _mentions_active(self, row: MemoryRow) -> bool:
        for mentioned in row.mentions:
            try:
                self._catalog.check_guard(mentioned)
            except SubjectSuppressed:
                return False
        return True

    def _register_found(self, ref: str, rows: list[MemoryRow], epoch: int) -> None:
        """Register rows a killed put left in the partition. Vectors the put wrote
        are registered with them; a row without its vectors is registered without,
        and its first semantic search embeds it (``_repair``)."""
        embedded = self._vectors.memory_ids(ref) if self._vectors is not None else set()
        found = [r if r.memory_id in embedded else replace(r, index=()) for r in rows]
        self._register_rows(ref, found, expected_epoch=epoch, replace=True, remove=())

    def count_ref(self, ref: str) -> int:
        """How many memories ``ref``'s partition holds (loads it; no guard check)."""
        part = self._partition(ref)
        part.ensure_loaded()
        return len(part.rows)

    def memory(self, row: MemoryRow) -> Memory:
        return Memory(row)

    def delete_by_id(self, ref: str, memory_id: str) -> bool:
        """Physically delete one memory (and its vectors and assets) by id."""
        part = self._partition(ref)
        with part.flocked():
            # An opaque row too: deleting needs its lookup and id, never its key.
            row = next((r for r in part.all_rows() if r.memory_id == memory_id), None)
            if row is None:
                return False
            self._delete_rows(ref, part, [row])
        return True

    def rebuild(
        self,
        ref: str,
        row: MemoryRow,
        value: Any,
        *,
        sources: Sequence[str],
        mentions: Sequence[str],
        produced_by: tuple[str, str | None, str | None] | None = None,
    ) -> Memory:
        """Replace a derived memory's value and provenance (erasure rebuild), and
        with ``produced_by`` its (kind, producer, producer version) in the same
        catalog transaction: a crash leaves the old asset or the new, never one
        that has forgotten how it is rebuilt."""
        item = PutItem(
            row.namespace,
            row.key,
            value,
            row.scope,
            row.purpose,
            row.category,
            tuple(sources),
            (),
            None,
        )
        memory = self._put_rows(
            ref,
            [item],
            mention_refs=[tuple(mentions)],
            produced_by=produced_by,
            kept_sources=row.sources,
        )[0]
        # The previous version leaves the live files at once, as a deletion's does: it
        # is unreadable already when a destroyed key sealed it, but a scope erasure
        # destroys no co-owned key, and rebuilding is how its data leaves this asset.
        part = self._partition(ref)
        with part.flocked():
            part.flush()
        return memory

    @contextlib.contextmanager
    def locked(self, ref: str) -> Iterator[None]:
        """Hold the subject's partition lock (without loading it)."""
        part = self._partition(ref)
        with part.flocked(refresh=False):
            yield

    def first_key(self, ref: str, key_scope: str, guard_scope: str | None = None) -> DataKey:
        """The subject's key for ``key_scope``, created if need be under the
        partition lock with the guard read again there: the lock an erasure destroys
        keys under after suppressing, so no key is ever created for a subject being
        erased. For stores outside the partition (tokens, agent threads) that make
        a subject's first key; memory writes do the same inside their own lock."""
        with self.locked(ref):
            self._catalog.check_guard(ref, scope=guard_scope)
            return self._keyring.data_key(ref, key_scope)

    def drop_subject(self, ref: str) -> int:
        """Remove the subject's whole partition folder; returns files removed."""
        with self._lock:
            part = self._partitions.pop(ref, None)
        if part is None:
            part = Partition(self.partition_path(ref), ref, self._keyring, self._sealer, self._pme)
        n = part.drop()
        self._pme.forget()
        return n

    def drop_scope(self, ref: str, scope: str) -> int:
        """Remove one scope's rows and files from the subject's partition."""
        part = self._partition(ref)
        n = part.drop_scope(scope)
        self._pme.forget()
        return n

    # -- Erasable (keyshred.storage.erasable) ---------------------------------------

    name = "memories"
    phase: Phase = DROP

    def erase(self, target: ErasureTarget) -> StoreErasure:
        """The whole partition folder (a subject), one scope's rows and files, or
        exactly the listed memories (retention: with their vectors and assets)."""
        ref = target.subject_ref
        if target.assets is not None:
            n, action = self.delete_ids(ref, target.assets), "memories-deleted"
        elif target.scope is None:
            n, action = self.drop_subject(ref), "partition-dropped"
        else:
            n, action = self.drop_scope(ref, target.scope), "scope-dropped"
        faults.reached("erase.memories")
        # File counts do not show the subject had data (a folder may hold only its
        # lock file): the keys and catalog assets found do.
        return StoreErasure(self.name, action, n, datetime.now(UTC))

    def verify(self, target: ErasureTarget) -> list[StoreCheck]:
        ref = target.subject_ref
        if target.assets is not None:
            rows = self.rows_by_id(ref, target.assets)
            n = len(target.assets)
            return [StoreCheck("memories removed", not rows, f"{len(rows)} of {n} left")]
        path = self.partition_path(ref)
        if target.scope is not None:
            manifest = path / "MANIFEST"
            scopes = json.loads(manifest.read_text())["segments"] if manifest.exists() else {}
            left = len(scopes)
            ok = target.scope not in scopes
            return [StoreCheck("scope segment removed", ok, f"scopes left: {left}")]

        def files_left() -> list[str]:
            return [p.name for p in path.rglob("*") if p.is_file()] if path.exists() else []

        left_files = files_left()
        # A writer racing the erasure re-makes the folder with its lock file when it
        # takes the lock, finds the subject suppressed, and removes both: a lone lock
        # file may be on its way out. Anything else left, or a lock that stays,
        # fails the check.
        deadline = time.monotonic() + 2.0
        while left_files == ["LOCK"] and time.monotonic() < deadline:
            time.sleep(0.01)
            left_files = files_left()
        n = len(left_files)
        return [StoreCheck("memory partition removed", not left_files, f"{n} files left")]

    # evict (above) drops the partition's decrypted rows, its vectors and the PME
    # file-key cache: the Erasable ``evict``.

    # -- for the erasure coordinator and exports, by subject_ref ------------------

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """Hold every partition write of the data folder off (a backup's snapshot)."""
        with self._freeze.exclusive():
            yield

    def live_rows(self, ref: str) -> list[MemoryRow]:
        """The live rows of ``ref`` (loads the partition; no guard check). Under
        ``locked(ref)`` they are one point in time (an export)."""
        part = self._partition(ref)
        part.ensure_loaded()
        return list(part.rows.values())

    def key_ids_of(self, ref: str, memory_ids: Iterable[str]) -> dict[str, bytes | None]:
        """The key id each listed row of ``ref`` is sealed under, opaque rows too
        (read from the rows; no key is needed)."""
        rows = self.rows_by_id(ref, memory_ids, opaque=True)
        return {asset_id: row_key_id(row) for asset_id, row in rows.items()}

    def probe_hits(self, ref: str, probes: Sequence[str]) -> int:
        """How often the probe strings are found in ``ref``'s memories, by value and
        by meaning (semantic search of its indexed memories). No guard check."""
        rows = self.live_rows(ref)
        hits = sum(1 for r in rows for p in probes if p.encode() in r.value)
        indexed = [r for r in rows if r.index]
        if indexed and self._vectors is not None and self._vectors.count(ref):
            for probe in probes:
                q = self.embedder.embed_query(probe)
                for mid, _ in self._vectors.search(ref, q, 5):
                    row = next((r for r in indexed if r.memory_id == mid), None)
                    if row is not None and any(p.encode() in row.value for p in probes):
                        hits += 1
        return hits

    # -- maintenance ---------------------------------------------------------------

    def flush(self, subject: Any = None) -> None:
        """Move logged writes into Parquet segments (one subject, or every open one)."""
        if subject is None:
            with self._lock:
                parts = list(self._partitions.values())
        else:
            parts = [self._partition(self._ref(subject))]
        for part in parts:
            with part.flocked():
                part.flush()

    def close(self, *, flush: bool = True) -> None:
        """Close every partition, first moving logged writes into segments unless
        ``flush=False`` (the logs are durable either way)."""
        with self._lock:
            parts = list(self._partitions.values())
            self._partitions.clear()
        for part in parts:
            if flush and part.loaded and self._catalog.guard(part.subject_ref).status == ACTIVE:
                try:
                    with part.flocked():
                        part.flush()
                except (SubjectErased, KeyNotFound):
                    pass  # crypto-erased meanwhile: nothing of it may be written again
            part.close()
        self._freeze.close()


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


_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "$eq": lambda a, b: bool(a == b),
    "$ne": lambda a, b: bool(a != b),
    "$gt": lambda a, b: float(a) > float(b),
    "$gte": lambda a, b: float(a) >= float(b),
    "$lt": lambda a, b: float(a) < float(b),
    "$lte": lambda a, b: float(a) <= float(b),
}


Predicate = Callable[[Any], bool]


def compile_filter(filter: Mapping[str, Any]) -> Predicate:
    """LangGraph's store filter semantics, compiled once per search: ``{"field":
    value}`` equality (nested dicts and lists compared structurally) and
    ``{"field": {"$gt": 3}}`` operators (``$eq $ne $gt $gte $lt $lte``; an unknown
    operator is ``InvalidInput`` at once, not at the first row)."""
    fields = [(name, _compile(expected)) for name, expected in filter.items()]

    def match(value: Any) -> bool:
        if type(value) is not dict:
            return False
        for name, test in fields:  # noqa: SIM110 - no generator per row (hot path)
            if not test(value.get(name)):
                return False
        return True

    return match


def _compile(expected: Any) -> Predicate:
    if isinstance(expected, Mapping):
        if expected and str(next(iter(expected))).startswith("$"):
            ops = []
            for op, operand in expected.items():
                fn = _OPS.get(op)
                if fn is None:
                    raise InvalidInput(f"unknown filter operator {op!r}")
                ops.append((fn, operand))

            def by_ops(actual: Any) -> bool:
                try:
                    for fn, operand in ops:
                        if not fn(actual, operand):
                            return False
                except (TypeError, ValueError):
                    return False
                return True

            return by_ops
        return compile_filter(expected)
    if isinstance(expected, list | tuple):
        items = [_compile(e) for e in expected]

        def by_items(actual: Any) -> bool:
            if not isinstance(actual, list | tuple) or len(actual) != len(items):
                return False
            return all(test(a) for test, a in zip(items, actual, strict=True))

        return by_items
    return lambda actual: bool(actual == expected)
