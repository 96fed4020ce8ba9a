"""A subject's memory partition: hot rows in the catalog, immutable segments in an
object store, and a decoded cache of both in this process.

The catalog is the source of truth (``keyshred.storage.hot``): the partition's head,
its sealed hot rows and the list of its segments. Objects live under
``subject=<subject_ref>/seg-<unique id>.parquet`` of the partition store
(``keyshred.storage.objects``: a folder or an S3 prefix), one PME-encrypted Parquet
object per scope, written once and never overwritten.

- A write seals its rows (one hot record per scope, bound to the subject, scope and
  sequence number) and adds them in the catalog transaction that registers its
  assets: one transaction, one commit. The cache takes them at once.
- A compaction (``flush``) writes a new segment for every scope that changed,
  publishes them and retires the old ones in one catalog transaction that also
  deletes the hot rows it folded, then deletes the retired objects. A reader in
  another process that listed a retired segment finds it gone and reads the list
  again (``_load``); it never needs an object the current list does not name.
- Every change runs under the subject lock (``keyshred.storage.subject_lock``: a
  database lock shared by every process on every machine) and first catches up
  with what others committed; reads catch up without it (one catalog statement when
  nothing changed). The local cache may vanish at any time.

A row whose owner-set key was destroyed is *opaque*: kept in ``Partition.opaque``
(never in ``rows``, so no read, search or count sees it), written back byte for byte
by a compaction, deletable by id without its key (``keyshred.storage.rowcodec``).

A folder of the layout before issue #21 (``keyshred.storage.legacy``) is imported on
the first load under the subject lock, through ``flush``, and removed after the
catalog commit (``_settle_legacy``).

Why one module of ~900 lines: ``Partition`` is the storage engine of one subject
(cache, catch-up, hot appends, compaction to PME segments, opaque rows, drops);
every method relies on the same head and lock protocol, read and reviewed as one unit.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from keyshred.errors import (
    IntegrityError,
    KeyNotFound,
    SubjectErased,
    SubjectSuppressed,
)
from keyshred.keyring import _primitives as prim
from keyshred.keyring.datakey import DataKey
from keyshred.keyring.envelope import Place
from keyshred.keyring.keyring import Keyring
from keyshred.storage import faults
from keyshred.storage.catalog_base import ACTIVE, ERASED
from keyshred.storage.freeze import FreezeLock
from keyshred.storage.hot import EMPTY, Head, HotRecord, HotTier, Segment
from keyshred.storage.legacy import LegacyFolder, is_legacy_name
from keyshred.storage.objects import ObjectStore
from keyshred.storage.pme import PmeCrypto
from keyshred.storage.policy import INDEX_SCOPE
from keyshred.storage.rowcodec import (
    ENCRYPTED_COLUMNS,
    PLAINTEXT_COLUMNS,
    SCHEMA,
    MemoryRow,
    decode_record,
    encode_delete,
    encode_lookup,
    encode_puts,
    from_us,
    index_record,
    is_sealed,
    names_sealed,
    row_key_id,
    row_of,
    row_place,
    seal_row,
    to_us,
)
from keyshred.storage.sealer import Sealer
from keyshred.storage.subject_lock import SubjectLocks

__all__ = [
    "ENCRYPTED_COLUMNS",
    "INLINE_MAX_BYTES",
    "SCHEMA",
    "Filed",
    "MemoryRow",
    "Partition",
    "decode_record",
    "from_us",
    "hot_place",
    "lookup_hash",
    "lookup_key_of",
    "namespace_part",
    "newest_row",
    "ns_key",
    "partition_prefix",
    "row_key_id",
    "row_place",
    "seal_row",
    "to_us",
]

_MAC_LABEL = b"segment-mac"
_MAC_META = b"keyshred.mac"
_LOAD_ATTEMPTS = 5  # a reader racing compactions lists segments again this often
# Generations are unique in the process, so a partition reopened after the LRU let
# it go never repeats one an earlier object of the same subject had.
_GENERATIONS = itertools.count(1)
_CHANGES_KEPT = 4096  # changed memory ids kept before a new generation starts
# A partition compacted into the catalog holds at most this many bytes of values
# (a record of the catalog is read whole by every load and cold get).
INLINE_MAX_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class Filed:
    """The memories the catalog files in a partition, read in its load's
    transaction: ``ids`` but for those of ``hidden`` scopes (suppressed: an erasure
    in progress removes them from the files first). ``complete``: every readable
    row of another scope must be among them (False while the whole subject is
    suppressed: every read is refused, and files go before catalog rows)."""

    ids: set[str]
    hidden: frozenset[str] = frozenset()
    complete: bool = True


# Given a subject, what reads the memories the catalog says its partition holds, on
# the cursor of the load's read transaction (the guard is read before, outside it).
ExpectedIds = Callable[[str], Callable[[Any], Filed]]


def partition_prefix(subject_ref: str) -> str:
    """The subject's folder-like prefix in the partition store."""
    return f"subject={subject_ref}"


def hot_place(subject_ref: str, scope: str, seq: int) -> Place:
    """Where a hot record belongs: a record moved to another subject, scope or
    sequence number (reordered, or replayed) fails to open."""
    return Place(subject_ref, scope, "memhot", str(seq), "record")


def lookup_hash(lookup_key: bytes, ns_part: bytes, key: str) -> str:
    """The keyed hash a memory is filed under: ``ns_part`` is the namespace's part
    of ``encode_lookup`` (``namespace_part``), then the key."""
    raw = key.encode("utf-8")
    return prim.hmac_sha256(lookup_key, ns_part + len(raw).to_bytes(4, "big") + raw).hex()[:32]


def namespace_part(namespace: Sequence[str]) -> bytes:
    return encode_lookup(namespace, "")[:-4]


def lookup_key_of(keyring: Keyring, sealer: Sealer, subject_ref: str, *, create: bool) -> bytes:
    """The subject's lookup key (``KeyNotFound``/``SubjectErased`` without one,
    unless ``create``); all zeros in an unencrypted store."""
    if not sealer.encrypted:
        return b"\x00" * 32
    return keyring.data_key(subject_ref, INDEX_SCOPE, create=create).derive(b"memory-lookup")


def newest_row(
    hot: HotTier,
    sealer: Sealer,
    subject_ref: str,
    lookup: str,
    *,
    storage_key: str,
    limit: int,
    hidden: Collection[str] = (),
) -> tuple[bool, MemoryRow | None]:
    """The memory at ``lookup``, read from the catalog without loading the
    partition, for a partition that is its hot rows alone (no live segment, at most
    ``limit`` rows): ``(True, row)`` for a row under the holder's own key, ``(True,
    None)`` if there is none. It checks what a load of such a partition checks:
    every record is opened (bound to the subject, scope and sequence number: a
    flipped, swapped or foreign record raises ``IntegrityError``), the sequence has
    no gap from the head's first to its last, every record is well formed, and the
    replayed partition holds every memory the catalog files in it but for those of
    ``hidden`` scopes (the load's comparison: one missing is a record cut away or
    a head moved). ``(False, None)`` otherwise, and the caller
    loads the partition, which decides: a live segment, more rows, a deletion a
    crash left unfinished (the load finishes it, so its bytes and vectors wait for
    no later write), a record of a ``hidden`` scope (suppressed: not opened), one
    under a destroyed key, a malformed one, a gap, a memory the catalog files and
    the replay lacks or holds and the catalog does not (rows rolled back), or a row
    under an owner-set key (its co-owners' guards decide). The replay is the
    load's: records in sequence order, the last one touching a memory decides."""
    state = hot.newest(subject_ref, limit, storage_key)
    if state is None or state.deleting or state.segments or state.assets is None:
        return False, None
    head, records = state.head, state.records
    if [r.seq for r in records] != list(range(head.base_seq, head.next_seq)):
        return False, None
    indexed: list[tuple[HotRecord, str, list[Any], bytes]] = []
    for rec in records:
        if rec.scope in hidden:
            return False, None
        try:
            payload = sealer.open(rec.record, hot_place(subject_ref, rec.scope, rec.seq))
        except SubjectErased:
            return False, None
        try:
            indexed.append((rec, *index_record(payload)))
        except (ValueError, KeyError, TypeError):
            return False, None
    live: dict[str, tuple[str, int]] = {}  # lookup -> (memory id, record's place)
    for n, (_, op, rows, _) in enumerate(indexed):
        if op == "del":
            live.pop(rows[0], None)
            continue
        for fields in rows:
            live[fields[9]] = (fields[0], n)
    present = {mid for mid, _ in live.values()}
    filed = {aid for aid, scope in state.assets if scope not in hidden}
    if present != filed:
        # One filed and not replayed: a record cut away or a head moved; one
        # replayed and not filed: the partition's rows rolled back to before a
        # delete (or an opaque row whose asset an erasure dropped): the load decides.
        return False, None
    if lookup not in live:
        return True, None
    rec, _, rows, body = indexed[live[lookup][1]]
    try:
        row = row_of(rows, body, lookup)
    except (ValueError, KeyError, TypeError):
        return False, None
    if row is None or row.scope != rec.scope or row.sealed is not None:
        return False, None
    return True, row


class _Vanished(Exception):
    """A listed segment was gone when read: a compaction retired it meanwhile."""


class Partition:
    """One subject's memories: a cache of the catalog's truth, written through."""

    def __init__(
        self,
        objects: ObjectStore,
        subject_ref: str,
        keyring: Keyring,
        sealer: Sealer,
        pme: PmeCrypto | None,
        *,
        hot: HotTier,
        locks: SubjectLocks,
        expected_ids: ExpectedIds | None = None,
        finish_deletes: Callable[[Partition, set[str]], set[str]] | None = None,
        freeze: FreezeLock | None = None,
        retired_grace_seconds: float = 300.0,
        inline_max_rows: int = 0,
        legacy: LegacyFolder | None = None,
        guard_status: Callable[[str], str] | None = None,
        owners_suppressed: Callable[[Iterable[str]], bool] | None = None,
    ) -> None:
        self._objects = objects
        # How long a retired segment's object outlives the compaction that retired
        # it: a reader in another process that listed it just before may still be
        # reading it, and a backup copies what its catalog snapshot lists.
        self._grace_us = int(retired_grace_seconds * 1_000_000)
        # A compaction of at most this many rows (and ``INLINE_MAX_BYTES``) writes
        # them back into the catalog as one hot record per scope, not a segment.
        self._inline_rows = inline_max_rows
        # The subject's folder in the layout of releases before issue #21, imported
        # on the first load under the subject lock (``_settle_legacy``), and the
        # guard's status of the subject, read before anything of it is decrypted.
        self._legacy = legacy
        self._guard_status = guard_status
        # Whether any of a shared key's other owners is suppressed or erased: its
        # rows then load opaque (``_unseal``).
        self._owners_suppressed = owners_suppressed
        self._prefix = partition_prefix(subject_ref)
        self._hot = hot
        self._locks = locks
        self._freeze = freeze
        self._expected_ids = expected_ids
        self._finish_deletes = finish_deletes
        self.subject_ref = subject_ref
        self._keyring = keyring
        self._sealer = sealer
        self._pme = pme
        self.lock = threading.RLock()
        self.rows: dict[str, MemoryRow] = {}
        # ``rows`` by memory id (semantic search maps ranked vectors back to rows).
        self.by_id: dict[str, MemoryRow] = {}
        # What changed since the cache was (re)loaded, for caches kept beside it that
        # check only what changed (the vector staleness check): ``generation`` counts
        # reloads; ``changed`` lists the memory ids written or removed since, in
        # order (reset, with a new generation, when it grows long).
        self.generation = next(_GENERATIONS)
        self.changed: list[str] = []
        # Rows whose owner-set key was destroyed, by lookup: in the files, in no read.
        self.opaque: dict[str, MemoryRow] = {}
        # How many readable rows each (namespace, scope, shared key id or None: the
        # scope key) holds: the namespace index (``keyshred.storage.namespaces``)
        # learns from them, under the lock, which namespaces a write adds or empties.
        self.ns_counts: dict[tuple[tuple[str, ...], str, bytes | None], int] = {}
        # How many readable rows mention each subject: another subject's erasure
        # asks every open partition (``mentions``) without a pass over its rows.
        self.mentioned: dict[str, int] = {}
        # No readable row's retain-until is before this (a lower bound: a row that
        # leaves does not raise it). While it is in the future, the namespaces of
        # the live rows are the keys of ``ns_counts`` (``namespaces_ref``).
        self.earliest_retain_us = _NEVER
        # Keys of shared owner sets that opened rows here (a mention, data derived
        # from another subject's): the eviction of any co-owner takes this cache.
        self.shared_keys: set[bytes] = set()
        self.closes = 0  # how often an eviction (or the open limit) closed it
        self._head: Head = EMPTY
        self._segments: dict[str, Segment] = {}  # the live segment of each scope
        self._dirty: set[str] = set()
        self._pending = 0
        # The hot rows are what a compaction into the catalog wrote, unchanged since
        # (one put record per scope, every row once, no segment): nothing to fold.
        self._folded = False
        self._lookup_key: bytes | None = None
        self.dropped = False
        self._ns_cache: dict[tuple[str, ...], bytes] = {}
        # Parsed values for filters, keyed by lookup and checked by the identity of
        # the row's value bytes; plaintext like ``rows``, dropped with them.
        self._parsed: dict[str, tuple[bytes, Any]] = {}
        self.loaded = False
        self._flock_depth = 0  # > 0 while this thread is inside ``flocked``
        self._staged: Callable[[Any], None] | None = None
        self._uncommitted = False  # the cache holds a staged write not yet committed
        # Another process changed the partition since ``take_foreign_change`` was last
        # asked: caches built beside it (decrypted vectors) are stale.
        self._foreign = False
        # The catalog's change token when the cache last caught up (None: unknown).
        self._token: int | None = None
        # The head a load read and every segment the catalog named then: the load's
        # cleanup uses them while the head is unchanged (no publish since).
        self._names_at: tuple[Head, dict[str, int | None]] | None = None

    @property
    def holds_flock(self) -> bool:
        """Whether the caller (holding ``lock``) is inside ``flocked``: a refresh
        outside it may only read."""
        return self._flock_depth > 0

    # -- the subject lock --------------------------------------------------------------

    @contextlib.contextmanager
    def flocked(self, *, refresh: bool = True) -> Iterator[None]:
        """Hold the subject lock (every process on every machine), and this
        process's data folder freeze shared; ``refresh`` first catches up with what
        others committed. If the block fails with a staged write not known to be
        committed, the cache is dropped: the catalog says what happened."""
        with self.lock:
            if self.dropped:
                # Erased while someone still held this object: never re-create it.
                raise SubjectSuppressed(f"partition {self.subject_ref} was erased")
            with self._locks.hold(self.subject_ref):
                self._flock_depth += 1
                try:
                    with self._freeze.shared() if self._freeze else contextlib.nullcontext():
                        if refresh:
                            self._refresh()
                        try:
                            yield
                        except BaseException:
                            if self._uncommitted:
                                self.invalidate()
                            raise
                finally:
                    self._flock_depth -= 1
                    self._staged, self._uncommitted = None, False

    def invalidate(self) -> None:
        """Forget the cache: the next use reads the catalog again."""
        with self.lock:
            self.rows, self.opaque, self._parsed, self.loaded = {}, {}, {}, False
            self.by_id, self.changed, self.ns_counts, self.mentioned = {}, [], {}, {}
            self.earliest_retain_us = _NEVER
            self.shared_keys = set()
            self.generation = next(_GENERATIONS)
            self._token = None
            self._head, self._segments, self._dirty, self._pending = EMPTY, {}, set(), 0
            self._folded = False

    def _refresh(self) -> None:
        """Catch up with what another process committed since we last looked (on
        SQLite nothing to ask while nobody committed anything: ``change_token``)."""
        token = self._hot.change_token()
        if token is not None and token == self._token and self.loaded:
            return
        self._refresh_from_head()
        self._token = token  # read before the head: a later commit changes it again

    def _refresh_from_head(self) -> None:
        if not self.loaded:
            self._load()
            return
        head = self._hot.head(self.subject_ref) or EMPTY
        if head == self._head:
            return
        self._foreign = True  # our own writes move ``_head`` as they commit
        if (head.gen, head.base_seq) == (self._head.gen, self._head.base_seq):
            now, _, records = self._hot.state(self.subject_ref, since=self._head.next_seq)
            if now is not None and (now.gen, now.base_seq) == (head.gen, head.base_seq):
                self._apply(records, self._head.next_seq, now.next_seq)
                self._head = now
                self._folded = False
                return
        self._load()

    def take_foreign_change(self) -> bool:
        """Whether another process changed the partition since the last call."""
        with self.lock:
            changed, self._foreign = self._foreign, False
            return changed

    def ensure_loaded(self, *, refresh: bool = True) -> None:
        """Load the partition if needed; with ``refresh``, also catch up with what
        other processes wrote (a writer skips that: it refreshes under its lock)."""
        with self.lock:
            if not self.loaded:
                # The first load takes the subject lock: it may finish a deletion a
                # killed process left half done (``finish_deletes``).
                with self.flocked():
                    pass
            elif refresh:
                self._refresh()

    def parsed_value(self, row: MemoryRow) -> Any:
        """``json.loads(row.value)``, cached while the row is unchanged (read-only:
        callers must not mutate it)."""
        hit = self._parsed.get(row.lookup)
        if hit is not None and hit[0] is row.value:
            return hit[1]
        value = json.loads(row.value)
        if len(self._parsed) > 200_000:
            self._parsed.clear()
        self._parsed[row.lookup] = (row.value, value)
        return value

    # -- lookup hashes -------------------------------------------------------------

    @property
    def lookup_key_id(self) -> int:
        """Identity of the lookup key in use (changes if the key is re-derived)."""
        return id(self._lookup_key)

    def lookup(self, namespace: Sequence[str], key: str, *, create: bool = True) -> str:
        """Keyed hash of (namespace, key) under the subject's index key (created on
        first use unless ``create=False``: then ``KeyNotFound``/``SubjectErased``)."""
        if self._lookup_key is None:
            self._lookup_key = lookup_key_of(
                self._keyring, self._sealer, self.subject_ref, create=create
            )
        namespace = tuple(namespace)
        ns = self._ns_cache.get(namespace)
        if ns is None:
            ns = namespace_part(namespace)  # the namespace part, then the key
            if len(self._ns_cache) > 4096:
                self._ns_cache.clear()
            self._ns_cache[namespace] = ns
        return lookup_hash(self._lookup_key, ns, key)

    # -- loading -------------------------------------------------------------------

    def _load(self) -> None:
        # Loading builds many small objects at once; the cyclic GC would walk them
        # repeatedly for nothing (they hold no cycles).
        enabled = gc.isenabled()
        gc.disable()
        try:
            self._load_checked()
        finally:
            if enabled:
                gc.enable()

    def _load_checked(self) -> None:
        # What the catalog says must be here, read with the partition's state in
        # one read transaction: a write registers its assets in the transaction
        # that adds its hot rows, so the two agree.
        also = None if self._expected_ids is None else self._expected_ids(self.subject_ref)
        expected = self._read_state(also=also)
        at, self._names_at = self._names_at, None  # the load's only: not kept after it
        if self.holds_flock and self._expected_ids is not None:
            # Under the lock no compaction is in flight: what a killed one left
            # (an unpublished object, retired ones not yet deleted) goes now. On an
            # object store, finding unpublished objects is a LIST request, on every
            # first touch of every subject (half of a spread get's time against
            # moto): there they wait for the subject's next compaction, which lists
            # (every delete compacts, so no deleted memory's bytes wait on it), and
            # only the retired segments the catalog names go now.
            names = at[1] if at is not None and at[0] == self._head else None
            self._cleanup(listing=self._objects.local, names=names)
        if expected is not None and expected.complete:
            # The other way round: a readable row the catalog does not file is not
            # the store's (every write registers its rows' assets in the commit
            # that adds them, every deletion removes the rows before the assets).
            # It is the partition's catalog rows rolled back to before a delete
            # (the deleted value back; nothing else says so once the rows are all
            # in the catalog), or a put of an old release killed before its
            # catalog write (``keyshred repair`` registers it). Rows rolled back to
            # before an update of a memory still filed cannot be told this way.
            extra = sum(
                1
                for r in self.rows.values()
                if r.memory_id not in expected.ids and r.scope not in expected.hidden
            )
            if extra:
                self.invalidate()
                raise IntegrityError(
                    f"partition {self.subject_ref} holds {extra} memories the catalog does "
                    "not file (its rows rolled back, or a write never registered)"
                )
        if expected is not None:
            missing = expected.ids - {r.memory_id for r in self.all_rows()}
            if missing and self._finish_deletes is not None:
                # Rows the store itself was deleting (marked in the catalog before
                # their rows went) are not lost: that deletion is finished now.
                missing = self._finish_deletes(self, missing)
            if missing:
                self.invalidate()
                raise IntegrityError(
                    f"partition {self.subject_ref} lacks {len(missing)} memories the catalog "
                    "holds (a truncated or replaced segment)"
                )

    def _read_state(
        self,
        *,
        lenient: bool = False,
        view: bool = False,
        also: Callable[[Any], Filed] | None = None,
    ) -> Filed | None:
        """Read the catalog's state; under the subject lock, first import a folder of
        the old layout if there is one (``view``: read its rows into the cache,
        commit and remove nothing — a dry-run repair). Returns what ``also`` read
        in the same transaction (None without it)."""
        extra = None
        for _ in range(_LOAD_ATTEMPTS):
            try:
                extra = self._read_once(lenient=lenient, also=also)
                break
            except _Vanished:
                time.sleep(0.01)  # a compaction is publishing: read its list instead
        else:
            self.invalidate()
            raise IntegrityError(f"a segment of partition {self.subject_ref} is missing")
        if self._legacy is not None and self.holds_flock:
            try:
                self._settle_legacy(self._legacy, view=view)
            except BaseException:
                self.invalidate()
                raise
        return extra

    # -- the layout of releases before issue #21 ---------------------------------------

    def _settle_legacy(self, legacy: LegacyFolder, *, view: bool) -> None:
        """Import the subject's folder of the old layout (``keyshred.storage.legacy``)
        into the catalog, then remove it. Callers hold the subject lock.

        The catalog decides, so a kill at any instant leaves one layout that counts:
        while the subject has no partition head the folder is the partition (an
        import killed before its commit runs again from the folder; the objects it
        wrote are leftovers the load removes); once the import's compaction has
        published, the head exists and what is left of the folder is removed, never
        read again. Nothing else writes the subject before that, under this lock.
        """
        if not legacy.files():
            return
        # Decided before anything is decrypted or written: an erasure in progress
        # (suppressed) drops the folder itself, an erased subject's folder is
        # residue and goes unread; no key is created on any path (compaction asks
        # for keys with ``create=False``), so nothing erased comes back.
        status = ACTIVE if self._guard_status is None else self._guard_status(self.subject_ref)
        if status != ACTIVE:
            if status == ERASED and not view:
                legacy.remove()
            return
        if self._head != EMPTY or self._segments:
            if not view:  # imported; killed before the folder went
                legacy.remove()
            return
        rows, scopes = self._legacy_rows(legacy)
        for row in rows:
            self._keep(row)
        if view:
            return
        self._pending = len(rows)
        self._dirty |= scopes
        faults.reached("import.after_read")
        if self._dirty:
            # The engine's own compaction: new segments (rows' crypto as every
            # segment's; opaque rows byte for byte), published in one transaction.
            self.flush()
        if self._head == EMPTY:
            # Nothing to carry (every row deleted or erased): the head alone says
            # the import is done.
            self._head = self._hot.publish(self.subject_ref, EMPTY, [], [], to_us_now())
        faults.reached("import.after_commit")
        legacy.remove(after_first=lambda: faults.reached("import.after_first_file"))

    def _legacy_rows(self, legacy: LegacyFolder) -> tuple[list[MemoryRow], set[str]]:
        """The rows the old reader returned for the folder (segments, then the log
        replayed over them) and every scope named in it."""
        gen, segments = legacy.manifest()
        by_lookup: dict[str, MemoryRow] = {}
        scopes: set[str] = set()
        for seg in segments:
            scopes.add(seg.scope)
            try:
                key = self._keyring.data_key_by_id(seg.key_id)
            except SubjectErased:
                continue  # the scope was crypto-erased: its rows are gone
            except KeyNotFound:
                raise IntegrityError(
                    f"a legacy segment of partition {self.subject_ref} names an unknown key"
                ) from None
            if key.subject_ref != self.subject_ref or key.scope != seg.scope or key.owner_tag:
                raise IntegrityError(
                    f"a legacy segment of partition {self.subject_ref} names another's key"
                )
            try:
                rows = self._read_segment(seg.path.name, seg.scope, path=str(seg.path), key=key)
            except FileNotFoundError:
                raise IntegrityError(
                    f"a legacy segment of partition {self.subject_ref} is missing"
                ) from None
            except SubjectErased:
                continue
            for row in rows:
                by_lookup[row.lookup] = row
        for scope, payload in legacy.log(gen, self._sealer):
            scopes.add(scope)
            if payload is None:  # sealed under a destroyed scope key: erased
                continue
            try:
                op, items = decode_record(payload)
                if op == "put" and any(row.scope != scope for row in items):
                    raise ValueError("row of another scope")
            except (ValueError, KeyError, TypeError):
                raise IntegrityError(
                    f"legacy log of partition {self.subject_ref} holds a malformed record"
                ) from None
            if op == "put":
                for row in self._unseal(items):
                    by_lookup[row.lookup] = row
            else:
                by_lookup.pop(items[0], None)
        return list(by_lookup.values()), scopes

    def _read_once(
        self, *, lenient: bool, also: Callable[[Any], Filed] | None = None
    ) -> Filed | None:
        """One read of the catalog's state and the segments it lists; ``lenient``
        (repair) takes a listed segment that is gone as holding nothing, and marks
        its scope for the next compaction, instead of reading the list again."""
        self.invalidate()
        state = self._hot.load_state(self.subject_ref, also)
        head, records = state.head or EMPTY, state.records
        self._names_at = (head, state.names)
        for seg in state.segments:
            if seg.scope in self._segments:
                raise IntegrityError(f"partition {self.subject_ref} lists two segments of a scope")
            self._segments[seg.scope] = seg
            try:
                rows = self._read_segment(seg.name, seg.scope, digest=(seg.size, seg.sha256))
            except _Vanished:
                if not lenient:
                    raise
                self._dirty.add(seg.scope)
                continue
            except SubjectErased:
                # The scope was crypto-erased (a scope erasure in progress): its rows
                # are gone; the next compaction retires the segment.
                self._dirty.add(seg.scope)
                continue
            for row in rows:
                self._keep_stored(row)
        folded = self._apply(records, head.base_seq, head.next_seq)
        self._folded = folded and not state.segments
        if self._folded:
            self._pending = 0  # as after the compaction that wrote them
        self._head = head
        self.loaded = True
        self._foreign = True  # read afresh: caches built beside the old state are stale
        return state.extra

    def _apply(self, records: Sequence[HotRecord], start: int, end: int) -> bool:
        """Apply hot records ``[start, end)``: every sequence number once, in order.
        Returns whether they are one put record per scope, all opened, whose rows
        are the partition's rows once each (a compaction into the catalog wrote
        them, ``_flush_inline``)."""
        if [r.seq for r in records] != list(range(start, end)):
            self.invalidate()
            raise IntegrityError(
                f"hot rows of partition {self.subject_ref} are missing or out of sequence"
            )
        folded = bool(records)
        scopes: set[str] = set()
        items_seen = 0
        for rec in records:
            try:
                payload = self._sealer.open(
                    rec.record, hot_place(self.subject_ref, rec.scope, rec.seq)
                )
            except SubjectErased:  # sealed under a destroyed scope key: erased
                self._dirty.add(rec.scope)
                folded = False
                continue
            try:
                op, items = decode_record(payload)
                if op == "put" and any(row.scope != rec.scope for row in items):
                    raise ValueError("row of another scope")
            except (ValueError, KeyError, TypeError):
                self.invalidate()
                raise IntegrityError(
                    f"partition {self.subject_ref} holds a malformed hot record"
                ) from None
            if op == "put":
                for row in self._unseal(items):
                    self._keep(row)
                self._pending += len(items)
                items_seen += len(items)
                folded = folded and rec.scope not in scopes
                scopes.add(rec.scope)
            else:
                self._forget(items[0])
                folded = False
            self._dirty.add(rec.scope)
        return folded and items_seen == len(self.rows) + len(self.opaque)

    def all_rows(self) -> list[MemoryRow]:
        """Every row the partition holds: the readable ones and the opaque ones."""
        return [*self.rows.values(), *self.opaque.values()]

    def _keep_stored(self, row: MemoryRow) -> None:
        """``_keep`` for a row read from a segment: segments of two scopes may both
        hold a memory that moved scope (releases before this check did not rewrite
        the old scope when a load, not a write, applied the move), and the newer
        version counts, whatever the order the segments are read in."""
        held = self.rows.get(row.lookup) or self.opaque.get(row.lookup)
        if held is not None and held.updated_us > row.updated_us:
            self._dirty.add(row.scope)  # rewritten without it at the next compaction
            return
        self._keep(row)

    def _keep(self, row: MemoryRow) -> None:
        """File a row read or written: opaque rows apart from the readable ones. A
        row that replaces one of another scope (a memory moved scope) makes that
        scope dirty: its segment still holds the old version, which the next
        compaction rewrites away. Loads and writes alike: a load that applied a
        move from the hot rows and then compacted only the new scope left the old
        version in the old scope's segment, where a later load read it over the
        new one (an erasure of a co-owner then dropped the memory)."""
        self._folded = False  # ``_read_once`` decides again after a load's replay
        old = self.rows.pop(row.lookup, None)
        stale = old if old is not None else self.opaque.get(row.lookup)
        if stale is not None and stale.scope != row.scope:
            self._dirty.add(stale.scope)
        if old is not None:
            self.by_id.pop(old.memory_id, None)
            self._changed(old.memory_id)
            self._count(old, -1)
        if row.opaque:
            self.opaque[row.lookup] = row
        else:
            self.opaque.pop(row.lookup, None)
            self.rows[row.lookup] = row
            self.by_id[row.memory_id] = row
            self._count(row, 1)
        self._changed(row.memory_id)

    def _forget(self, lookup: str) -> None:
        """Remove the row at ``lookup`` (readable or opaque) from the cache."""
        self._folded = False
        old = self.rows.pop(lookup, None)
        if old is not None:
            self.by_id.pop(old.memory_id, None)
            self._changed(old.memory_id)
            self._count(old, -1)
        self.opaque.pop(lookup, None)

    def _count(self, row: MemoryRow, n: int) -> None:
        if n > 0 and row.retain_us < self.earliest_retain_us:
            self.earliest_retain_us = row.retain_us
        k = ns_key(row)
        count = self.ns_counts.get(k, 0) + n
        if count > 0:
            self.ns_counts[k] = count
        else:
            self.ns_counts.pop(k, None)
        for ref in row.mentions:
            count = self.mentioned.get(ref, 0) + n
            if count > 0:
                self.mentioned[ref] = count
            else:
                self.mentioned.pop(ref, None)

    def _changed(self, memory_id: str) -> None:
        if len(self.changed) >= _CHANGES_KEPT:
            # Readers compare generations first: a new one makes them check all.
            self.changed, self.generation = [], next(_GENERATIONS)
        self.changed.append(memory_id)

    def _unseal(self, rows: list[MemoryRow]) -> list[MemoryRow]:
        """Open the sealed rows among ``rows`` (as stored: ``value`` is the
        ciphertext) with their owner-set keys, one key lookup per key id. A row
        whose key was destroyed comes back opaque; one whose key is not the holder's
        own for that scope, or that fails to open, raises ``IntegrityError``."""
        keys: dict[bytes, DataKey | None] = {}
        for row in rows:
            if row.sealed is None:
                continue
            key_id = row_key_id(row)
            assert key_id is not None  # noqa: S101 - sealed rows have one
            if key_id not in keys:
                try:
                    found: DataKey | None = self._keyring.data_key_by_id(key_id)
                except SubjectErased:
                    found = None
                except KeyNotFound:
                    raise IntegrityError(
                        f"partition {self.subject_ref} holds a row under an unknown key"
                    ) from None
                if found is not None and (
                    found.subject_ref != self.subject_ref or found.scope != row.scope
                ):
                    raise IntegrityError(f"partition {self.subject_ref} holds another's row")
                if found is not None and found.owner_tag:
                    self.shared_keys.add(key_id)
                keys[key_id] = found
        shared = [k for k, key in keys.items() if key is not None and key.owner_tag]
        if shared and self._owners_suppressed is not None:
            # Decided before decrypting: rows about a subject whose erasure has
            # started (a co-owner suppressed) load opaque, as they will be once its
            # erasure destroys their key; no read sees them in between.
            owners = self._keyring.shared_owners(shared)
            for key_id in shared:
                if self._owners_suppressed(owners.get(key_id, ())):
                    keys[key_id] = None
        out = []
        for row in rows:
            if row.sealed is None:
                out.append(row)
                continue
            key = keys[row_key_id(row)]  # type: ignore[index]  # (sealed rows have one)
            if key is None:
                out.append(replace(row, value=b"", opaque=True))
                continue
            payload = key.open(row.sealed, row_place(self.subject_ref, row))
            head, _, value = payload.partition(b"\n")
            try:
                names = json.loads(head)
                if names is None:
                    ns, k = row.namespace, row.key
                else:
                    ns, k = tuple(names[0]), names[1]
                    if not all(isinstance(x, str) for x in ns) or not isinstance(k, str):
                        raise ValueError
            except (ValueError, TypeError, IndexError):
                raise IntegrityError(
                    f"partition {self.subject_ref} holds a malformed sealed row"
                ) from None
            out.append(replace(row, namespace=ns, key=k, value=value))
        return out

    def _leftovers(
        self,
        *,
        purge: bool = False,
        listing: bool = True,
        names: dict[str, int | None] | None = None,
    ) -> tuple[list[str], list[str]]:
        """Objects under the partition's prefix to delete, and the retired segment
        rows to forget with them: objects no segment row names (a compaction that
        never committed: a crash after writing its segment) and segments retired
        longer ago than the grace period (a reader that listed one before its
        compaction committed may still be reading it until then); with ``purge``
        every retired one (a scope erasure: nobody may read them any more). Without
        ``listing`` the objects are not listed: only the retired ones go. ``names``:
        the segments the catalog names, as read under this lock with no publish
        since (a load's), else they are read now."""
        named = self._hot.segment_names(self.subject_ref) if names is None else names
        cutoff = to_us_now() - (0 if purge else self._grace_us)
        expired = {n for n, at in named.items() if at is not None and (purge or at <= cutoff)}
        if not listing:
            return sorted(expired), sorted(expired)
        start = len(self._prefix) + 1
        found = [k[start:] for k in self._objects.list_keys(self._prefix)]
        # In a folder, the old layout's files share the subject's folder: they go
        # only with their import (``_settle_legacy``) or the subject's drop.
        objects = [
            n
            for n in found
            if (n not in named or n in expired) and not (self._objects.local and is_legacy_name(n))
        ]
        return objects, sorted(expired)

    def _cleanup(
        self,
        *,
        purge: bool = False,
        listing: bool = True,
        names: dict[str, int | None] | None = None,
    ) -> int:
        """Delete leftover objects and forget retired segments past the grace
        period; returns how many objects went (without ``listing``: retired ones
        only, see ``_leftovers``). Under the subject lock only: a compaction writes
        its objects under it, so none is in flight."""
        objects, retired = self._leftovers(purge=purge, listing=listing, names=names)
        for name in objects:
            self._objects.delete(f"{self._prefix}/{name}")
        self._hot.forget_segments(self.subject_ref, retired)
        return len(objects)

    def sweep(self) -> int:
        """Delete the objects of segments retired longer ago than the grace period
        (and any a killed compaction left); returns how many objects went."""
        with self.flocked(refresh=False):
            return self._cleanup()

    def inspect(self) -> tuple[list[MemoryRow], list[str]]:
        """Every row the partition holds and the names of leftover objects, with
        nothing removed (repair reports before it acts). Callers hold ``flocked``."""
        try:
            self._read_state(lenient=True, view=True)
            return self.all_rows(), self._leftovers()[0]
        finally:
            self.invalidate()

    def reload(self) -> None:
        """Read the partition again, checked against the catalog if this partition
        was given ``expected_ids``, removing leftover objects. Callers hold
        ``flocked``. A listed segment that is gone holds nothing: the next
        compaction retires it (repair after a lost object)."""
        self._read_state(lenient=True)
        self._cleanup()
        if self._dirty:
            self.flush()

    # -- writes (callers hold ``flocked``) -----------------------------------------

    def append_puts(self, rows: Sequence[MemoryRow], *, commit: bool = True) -> None:
        """Add the rows as hot records. With ``commit=False`` they are staged for
        the caller's catalog transaction (``take_staged``), which registers their
        assets in the same commit; the cache takes them at once either way (a
        failed block drops it, ``flocked``)."""
        by_scope: dict[str, list[MemoryRow]] = {}
        for r in rows:
            by_scope.setdefault(r.scope, []).append(r)
        self._write(self._put_records(by_scope), commit=commit)
        self._pending += len(rows)
        for r in rows:
            self._keep(r)  # a move makes the old scope dirty too
            self._dirty.add(r.scope)

    def _put_records(
        self, by_scope: dict[str, list[MemoryRow]], *, create: bool = True
    ) -> list[HotRecord]:
        """One sealed put record per scope (in ``by_scope``'s order), numbered from
        the head on; ``create=False``: never a new scope key (a compaction)."""
        start = self._head.next_seq
        return [
            HotRecord(
                start + n,
                scope,
                self._sealer.seal(
                    encode_puts(part),
                    hot_place(self.subject_ref, scope, start + n),
                    create=create,
                ),
            )
            for n, (scope, part) in enumerate(by_scope.items())
        ]

    def append_deletes(self, rows: Sequence[MemoryRow]) -> None:
        """Add one hot delete record per row, in one catalog transaction."""
        seq = self._head.next_seq
        records = [
            HotRecord(
                seq + n,
                row.scope,
                self._sealer.seal(
                    encode_delete(row), hot_place(self.subject_ref, row.scope, seq + n)
                ),
            )
            for n, row in enumerate(rows)
        ]
        if not records:
            return
        self._write(records, commit=True)
        for row in rows:
            self._forget(row.lookup)
            self._dirty.add(row.scope)

    def _write(self, records: list[HotRecord], *, commit: bool) -> None:
        if self._staged is not None:
            raise IntegrityError("a staged write of this partition was not committed")
        head = self._head
        if commit:
            self._hot.append(self.subject_ref, head, records)
        else:
            self._staged = self._hot.appender(self.subject_ref, head, records)
            self._uncommitted = True
        self._head = Head(head.gen, head.base_seq, head.next_seq + len(records))
        self._folded = False

    def take_staged(self) -> Callable[[Any], None] | None:
        """The statements of the last ``append_puts(commit=False)``, for the
        caller's transaction (which calls ``committed`` once it has)."""
        staged, self._staged = self._staged, None
        return staged

    def committed(self) -> None:
        """The staged write committed: the cache matches the catalog again."""
        self._uncommitted = False

    @property
    def log_records(self) -> int:
        """Rows written to the hot tier since the last compaction."""
        return self._pending

    def flush(self, *, purge: bool = False) -> None:
        """Compaction: write a new segment of every scope that changed, publish them
        and retire the old ones in one catalog transaction that deletes the folded
        hot rows; retired objects are deleted after the grace period (``purge``:
        at once). A small partition (``inline_max_rows``, ``INLINE_MAX_BYTES``) is
        compacted into the catalog instead (``_flush_inline``)."""
        idle = not self._dirty and self._head.next_seq == self._head.base_seq
        every = [] if idle else self.all_rows()  # opaque rows too: carried as they are
        small = not idle and self._inline_fits(every)
        if idle or (self._folded and small):
            if purge:
                # Nothing to fold, but segments an earlier compaction retired (with
                # the values they held) still go at once, as ``purge`` promises.
                self._cleanup(purge=True)
            return
        if small:
            self._flush_inline(every, purge=purge)
            return
        by_scope: dict[str, list[MemoryRow]] = {}
        for row in every:
            by_scope.setdefault(row.scope, []).append(row)
        published: list[Segment] = []
        retire: list[str] = []
        for scope in sorted(self._dirty):
            old = self._segments.get(scope)
            if old is not None:
                retire.append(old.name)
            rows = by_scope.get(scope, [])
            if not rows:
                continue
            name = f"seg-{uuid.uuid4().hex}.parquet"
            published.append(self._write_segment(name, scope, rows))
            faults.reached("flush.after_segment")
        now_us = to_us_now()
        self._head = self._hot.publish(self.subject_ref, self._head, published, retire, now_us)
        faults.reached("flush.after_manifest")
        for scope in self._dirty:
            self._segments.pop(scope, None)
        self._segments.update({seg.scope: seg for seg in published})
        self._dirty, self._pending = set(), 0
        self._cleanup(purge=purge)

    def _inline_fits(self, rows: Sequence[MemoryRow]) -> bool:
        """Whether a compaction of ``rows`` goes into the catalog (``_flush_inline``)."""
        if len(rows) > self._inline_rows:
            return False
        size = sum(len(r.value if r.sealed is None else r.sealed) for r in rows)
        return size <= INLINE_MAX_BYTES

    def _flush_inline(self, rows: Sequence[MemoryRow], *, purge: bool) -> None:
        """Compaction into the catalog: the partition's rows become one hot put
        record per scope, sealed as a write seals them (the scope key, bound to the
        subject, scope and sequence number; never a new key: if it is gone, the
        scope was crypto-erased), in the transaction that deletes the hot rows they
        fold and retires every live segment. Why not a segment: a partition this
        small costs a Parquet object's footer and column keys many times over its
        rows, and a first read of it (a segment read and its decryption, several
        milliseconds) many times what reading its hot rows costs; the cold get
        (``newest_row``) reads it from the catalog alone."""
        by_scope: dict[str, list[MemoryRow]] = {}
        for row in sorted(rows, key=lambda r: (r.scope, r.memory_id)):
            by_scope.setdefault(row.scope, []).append(row)
        head = self._head
        records = self._put_records(by_scope, create=False)
        retire = sorted(seg.name for seg in self._segments.values())
        faults.reached("flush.after_records")
        self._head = self._hot.publish(
            self.subject_ref, head, [], retire, to_us_now(), records=records
        )
        faults.reached("flush.after_manifest")
        self._segments = {}
        # The records are hot rows: a compaction into segments must fold them. They
        # count as no pending write (``flush_records`` counts writes since this).
        self._dirty, self._pending = set(by_scope), 0
        self._folded = True
        self._cleanup(purge=purge)

    def _read_segment(
        self,
        name: str,
        scope: str,
        *,
        path: str | None = None,
        key: DataKey | None = None,
        digest: tuple[int | None, str | None] = (None, None),
    ) -> list[MemoryRow]:
        """The rows of one segment object (or, with ``path``, of a local file),
        authenticated with the scope's live key (or ``key``: a legacy segment's).
        ``digest``: the size and SHA-256 the catalog recorded for the object; an
        object that does not match them (an older copy of the segment put back under
        its name, whose MAC is as good) is refused before it is parsed."""
        kwargs: dict[str, Any] = {"page_checksum_verification": True}
        mac_key = b"\x00" * 32
        if self._pme is not None:
            kwargs["decryption_properties"] = self._pme.decryption()
            dek = key or self._keyring.data_key(self.subject_ref, scope, create=False)
            mac_key = dek.derive(_MAC_LABEL)
        try:
            if path is not None:
                table = pq.ParquetFile(path, **kwargs).read()
            elif digest[1] is not None:
                with self._objects.open_stream(f"{self._prefix}/{name}") as src:
                    data = src.read()
                if len(data) != digest[0] or hashlib.sha256(data).hexdigest() != digest[1]:
                    raise IntegrityError(
                        f"segment {name} of partition {self.subject_ref} is not the object "
                        "the catalog recorded (replaced or rolled back)"
                    )
                table = pq.ParquetFile(pa.BufferReader(data), **kwargs).read()
            else:  # written before the catalog recorded digests (revision 0005)
                table = self._objects.open_parquet(f"{self._prefix}/{name}", **kwargs).read()
        except (SubjectErased, IntegrityError):
            raise
        except FileNotFoundError:
            if path is not None:
                raise
            raise _Vanished() from None
        except Exception as exc:  # noqa: BLE001 - any failure to read is a bad file
            raise IntegrityError(
                f"segment {name} of partition {self.subject_ref} failed to read "
                f"({type(exc).__name__})"
            ) from None
        if table.schema.names != SCHEMA.names:
            raise IntegrityError(f"segment {name} has an unexpected schema")
        cols = {
            n: (
                table.column(n).cast(pa.int64())
                if pa.types.is_timestamp(SCHEMA.field(n).type)
                else table.column(n)
            ).to_pylist()
            for n in SCHEMA.names
        }
        stored = (table.schema.metadata or {}).get(_MAC_META)
        if stored is None or not prim.constant_time_equal(stored, _columns_mac(mac_key, cols)):
            raise IntegrityError(f"segment {name} failed authentication")
        if set(cols["scope"]) - {scope} or set(cols["subject_ref"]) - {self.subject_ref}:
            raise IntegrityError(f"segment {name} holds rows of another owner")
        try:
            out = _rows_of(cols, scope)
        except (ValueError, TypeError):
            raise IntegrityError(f"segment {name} holds a malformed row") from None
        return self._unseal(out)

    def _write_segment(self, name: str, scope: str, rows: list[MemoryRow]) -> Segment:
        rows = sorted(rows, key=lambda r: r.memory_id)
        kwargs: dict[str, Any] = {"write_page_checksum": True}
        key_id = ""
        mac_key = b"\x00" * 32
        if self._pme is not None:
            # Never create a key here: rows reach a compaction only after a put
            # created their scope key. If it is gone the subject was crypto-erased,
            # and writing the rows under a fresh key would bring them back.
            dek = self._keyring.data_key(self.subject_ref, scope, create=False)
            key_id = dek.key_id.hex()
            mac_key = dek.derive(_MAC_LABEL)
            kwargs["encryption_properties"] = self._pme.encryption(dek.key_id, ENCRYPTED_COLUMNS)
        n = len(rows)
        cols: dict[str, list[Any]] = {
            "memory_id": [r.memory_id for r in rows],
            "subject_ref": [self.subject_ref] * n,
            "scope": [scope] * n,
            "purpose": [r.purpose for r in rows],
            "category": [r.category for r in rows],
            "created_at": [r.created_us for r in rows],
            "updated_at": [r.updated_us for r in rows],
            "retain_until": [r.retain_us for r in rows],
            "status": ["live"] * n,
            "lookup": [r.lookup for r in rows],
            "sources": [list(r.sources) for r in rows],
            "mentions": [list(r.mentions) for r in rows],
            "index_fields": [list(r.index) for r in rows],
            # A sealed row: its ciphertext, byte for byte (an opaque row's is all
            # there is); its names inside it unless it is a derived asset.
            "namespace": [
                "" if r.sealed is not None and names_sealed(r) else json.dumps(list(r.namespace))
                for r in rows
            ],
            "key": ["" if r.sealed is not None and names_sealed(r) else r.key for r in rows],
            "value": [r.value if r.sealed is None else r.sealed for r in rows],
        }
        mac = _columns_mac(mac_key, cols)
        arrays = [
            pa.array(cols[f.name], pa.int64()).cast(f.type)
            if pa.types.is_timestamp(f.type)
            else pa.array(cols[f.name], f.type)
            for f in SCHEMA
        ]
        table = pa.Table.from_arrays(arrays, schema=SCHEMA.with_metadata({_MAC_META: mac}))
        size, sha256 = self._objects.write_table(f"{self._prefix}/{name}", table, **kwargs)
        return Segment(name, scope, n, key_id, size, sha256, min(r.retain_us for r in rows))

    # -- erasure -------------------------------------------------------------------

    def drop(self) -> int:
        """Delete the whole partition: its catalog rows, then every object under its
        prefix, holding the subject lock (writers elsewhere wait, then find the
        subject suppressed); returns the hot rows, segment rows and objects removed."""
        with self.lock:
            with self.flocked(refresh=False):
                n = self._hot.drop(self.subject_ref)
                n += self._objects.delete_prefix(
                    self._prefix, after_first=lambda: faults.reached("drop.after_first_file")
                )
                if self._legacy is not None:
                    # Not imported (the subject was suppressed first): never read,
                    # removed with the rest (its folder may be apart from the store).
                    n += self._legacy.remove()
                self.dropped = True
            self.close()
            return n

    def drop_scope(self, scope: str) -> int:
        """Remove one scope's rows and segment (scope erasure); returns rows removed."""
        with self.flocked():
            doomed = [r for r in self.all_rows() if r.scope == scope]
            for r in doomed:
                self._forget(r.lookup)
            self._dirty.add(scope)
            # Hot rows may hold this scope's records: a compaction folds what
            # remains and deletes them, so no row or object keeps the scope's bytes
            # (retired segments go at once, not after the grace period: a reader
            # that listed one re-reads the list, ``_load``).
            self.flush(purge=True)
            return len(doomed)

    def close(self) -> None:
        with self.lock:
            self.closes += 1  # a reader that was handed this partition reads again
            self.invalidate()
            self._lookup_key = None
            self._ns_cache = {}

    def mentions(self, subject_ref: str) -> bool:
        """Whether a decrypted row here mentions the subject (its erasure elsewhere
        must take this cache too). Read without the lock: a row added meanwhile is
        checked by the next eviction or the erasure's own rebuild."""
        return subject_ref in self.mentioned

    def held(self) -> int:
        """How many decrypted rows (and parsed values) the cache holds."""
        with self.lock:
            return len(self.rows) + len(self.opaque) + len(self._parsed)


_NEVER = 2**63 - 1  # a retain-until no row has


def ns_key(row: MemoryRow) -> tuple[tuple[str, ...], str, bytes | None]:
    """What ``Partition.ns_counts`` counts a readable row under."""
    return (row.namespace, row.scope, row_key_id(row))


def to_us_now() -> int:
    return time.time_ns() // 1000


def _columns_mac(mac_key: bytes, cols: dict[str, list[Any]]) -> bytes:
    """A keyed MAC over the plaintext metadata columns, kept in the footer.

    PME authenticates the encrypted columns (AES-GCM, bound to file, row group,
    column and page) and signs the plaintext footer; this MAC covers the plaintext
    column pages too, so a flipped byte there raises instead of returning a wrong id,
    scope or date. Timestamps enter as integers.
    """
    canonical = json.dumps([cols[n] for n in PLAINTEXT_COLUMNS], separators=(",", ":"))
    return prim.hmac_sha256(mac_key, canonical.encode("utf-8")).hex().encode("ascii")


def _rows_of(cols: dict[str, list[Any]], scope: str) -> list[MemoryRow]:
    """A segment's columns as rows (ValueError/TypeError if malformed)."""
    namespaces: dict[str, tuple[str, ...]] = {"": ()}  # a few distinct ones, many rows
    for text in set(cols["namespace"]) - {""}:  # "": names sealed with the value
        ns = json.loads(text)
        if not isinstance(ns, list) or not all(isinstance(x, str) for x in ns):
            raise ValueError
        namespaces[text] = tuple(ns)
    out = [
        MemoryRow(
            mid,
            namespaces[ns],
            key,
            value,
            scope,
            pur,
            cat,
            c,
            u,
            r,
            lk,
            tuple(src or ()),
            tuple(men or ()),
            tuple(idx or ()),
            value if is_sealed(value) else None,
        )
        for mid, ns, key, value, pur, cat, c, u, r, lk, src, men, idx in zip(
            cols["memory_id"],
            cols["namespace"],
            cols["key"],
            cols["value"],
            cols["purpose"],
            cols["category"],
            cols["created_at"],
            cols["updated_at"],
            cols["retain_until"],
            cols["lookup"],
            cols["sources"],
            cols["mentions"],
            cols["index_fields"],
            strict=True,
        )
    ]
    if any(r.sealed is None and not r.namespace for r in out):
        raise ValueError  # names left out, but the value is not sealed
    return out


# Re-exported for the store's modules, which import the row format from here.
_ = (from_us, seal_row, to_us)
