"""The memory store's state and its cache of open partitions.

``MemoryStoreBase`` holds what every part of ``MemoryStore`` uses (catalog, keyring,
policy, sealer, vector index, the partition store and the subject locks) and opens
a subject's ``Partition`` (a cache of what the catalog holds) at most once per
process (an LRU of ``max_open_partitions``; one unused for ``cache_ttl_seconds``
is closed by ``purge_expired``, which the handle's janitor runs on a schedule, so
decrypted rows do not outlive their use). A partition opened for reads
and writes is checked against the catalog as it loads: rows the catalog lacks are
reported, and deletions a crash interrupted are finished (``_finish_deletes``).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from keyshred._validate import DEFAULT_MAX_DEPTH
from keyshred.errors import KeyNotFound, KeyshredError, SubjectErased
from keyshred.keyring.datakey import DataKey
from keyshred.keyring.keyring import Keyring
from keyshred.keyring.keystore import owner_subject
from keyshred.storage.catalog import ACTIVE, Catalog
from keyshred.storage.embeddings import Embedder
from keyshred.storage.freeze import FreezeLock
from keyshred.storage.hot import HotTier
from keyshred.storage.legacy import LegacyFolder
from keyshred.storage.memory_types import DELETING, VECTOR_KIND, AuditSink, _storage_key
from keyshred.storage.mentions import MentionFinder
from keyshred.storage.namespaces import Entry, NamespaceIndex
from keyshred.storage.objects import ObjectStore
from keyshred.storage.partition import Filed, MemoryRow, Partition, ns_key, partition_prefix
from keyshred.storage.pme import PmeCrypto
from keyshred.storage.policy import Policy
from keyshred.storage.schema import assets
from keyshred.storage.sealer import KeyringSealer, Sealer
from keyshred.storage.subject_lock import SubjectLocks
from keyshred.storage.vectors import VectorIndex

__all__ = ["MemoryStoreBase", "NsKey"]

NsKey = tuple[tuple[str, ...], str, bytes | None]  # Partition.ns_counts' keys


class MemoryStoreBase:
    """The state shared by the parts of ``MemoryStore``, and its partitions."""

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
        max_open_partitions: int = 256,
        vectors: VectorIndex | None = None,
        embedder: Callable[[], Embedder] | None = None,
        mentions: MentionFinder | None = None,
        freeze: FreezeLock | None = None,
        audit: AuditSink | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        objects: ObjectStore | None = None,
        retired_grace_seconds: float = 300.0,
        cache_ttl_seconds: float = 300.0,
        inline_max_rows: int = 32,
    ) -> None:
        self._root = root / "memories"
        self._grace_seconds = retired_grace_seconds
        self._inline_rows = inline_max_rows
        self._grace_us = int(retired_grace_seconds * 1_000_000)
        # Where segments live (a folder by default, or an S3 prefix), and the
        # catalog's side of partitions: the truth every process shares.
        self._objects = objects or ObjectStore.folder(self._root)
        self._hot = HotTier(catalog)
        self._locks = SubjectLocks(catalog.engine)
        self._vectors = vectors
        if vectors is not None:
            # A legacy vector dataset is imported under the subject lock.
            vectors.use_locks(self._locks)
        self._embedder_factory = embedder
        self._embedder: Embedder | None = None
        # Embedders of other spaces this handle has written or searched with, by
        # space tag: an erasure's semantic probes run in each (memory_index._space).
        self._spaces: dict[str, Embedder] = {}
        self._catalog = catalog
        self._keyring = keyring
        self._policy = policy
        self._ref = subject_ref
        self._max_value = max_value_bytes
        self._max_depth = max_value_depth
        self._flush_records = flush_records
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
        # When each open partition was last handed out (monotonic seconds).
        self._used: dict[str, float] = {}
        self._cache_ttl = cache_ttl_seconds
        self._lock = threading.Lock()
        # (subject_ref, space) -> the partition generation, the vector cache entry
        # (weakly) and the change position of the last vector check (``_fresh_vectors``).
        self._vector_checks: dict[tuple[str, str], tuple[int, Any, int]] = {}
        # Evictions as they begin (``note_eviction``: before the keys go), numbered:
        # a read that overlapped one of its subject drops what it cached meanwhile
        # and reads again, guard check first (``ReadMixin._settled``).
        self._eviction_seq = 0
        self._evicted: deque[tuple[int, str | None]] = deque(maxlen=1024)
        # Held shared by every partition write (and the vector index's drops),
        # exclusive by a backup's snapshot (``frozen``).
        self._freeze = freeze or FreezeLock(root / "FREEZE")
        self._audit = audit  # corrections and deletions are events
        self._sql: str | None = None  # the compiled query of _expected_ids
        # Which subjects hold which namespaces, as keyed lookups (cross-subject reads).
        self._ns = NamespaceIndex(catalog, keyring)

    # -- eviction ----------------------------------------------------------------------

    def note_eviction(self, subject_ref: str | None) -> None:
        """An eviction of the subject (``None``: of everyone) begins: reads in flight
        that touch it will drop what they cached and read again."""
        with self._lock:
            self._eviction_seq += 1
            self._evicted.append((self._eviction_seq, subject_ref))

    def evicted_since(self, seq: int, subject_ref: str) -> bool:
        """Whether an eviction of the subject (or of everyone) began after ``seq``."""
        if self._eviction_seq == seq:
            return False  # the usual answer, on every read: no lock taken for it
        with self._lock:
            if self._eviction_seq - seq > len(self._evicted):
                return True  # older than the record: cannot tell, so yes
            return any(n > seq and r in (None, subject_ref) for n, r in self._evicted)

    def drop_cached(self, subject_ref: str) -> None:
        """Forget what this process holds of the subject: its partition and vectors
        (``evict``) and its unwrapped keys."""
        self.evict(subject_ref)
        self._keyring.evict_subject(subject_ref)

    def evict(self, subject_ref: str) -> None:
        """Forget a subject's decrypted rows, vectors and cached keys in this process,
        and every other subject's partition holding a row that mentions it."""
        self.note_eviction(subject_ref)
        with self._lock:
            parts = {subject_ref: self._partitions.pop(subject_ref, None)}
            mentioning = {
                ref for ref, part in self._partitions.items() if part.mentions(subject_ref)
            }
            shared = {
                ref: set(part.shared_keys)
                for ref, part in self._partitions.items()
                if part.shared_keys and ref not in mentioning
            }
        # Rows sealed under keys the subject co-owns (derived from its data) go too:
        # their owners in one lookup, outside the lock; a key the store no longer
        # lists was destroyed (by this very erasure): its rows go as well.
        if shared:
            try:
                owners = self._keyring.owners_of(set().union(*shared.values()))
            except KeyshredError:
                owners = {}  # cannot tell: none stays
            for ref, ids in shared.items():
                for kid in ids:
                    theirs = owners.get(kid)
                    if theirs is None or subject_ref in {owner_subject(o) for o in theirs}:
                        mentioning.add(ref)
                        break
        with self._lock:
            for ref in mentioning:
                part = self._partitions.pop(ref, None)
                if part is not None:
                    parts[ref] = part
            for ref in parts:
                self._used.pop(ref, None)
        for ref, part in parts.items():
            if part is not None:
                part.close()
            if self._vectors is not None:
                self._vectors.evict(ref)
        self._pme.forget()

    def evict_all(self) -> None:
        """Forget every subject's decrypted rows and vectors, and pyarrow's keys."""
        self.note_eviction(None)
        with self._lock:
            parts = list(self._partitions.values())
            self._partitions.clear()
            self._used.clear()
        for part in parts:
            part.close()
        if self._vectors is not None:
            self._vectors.evict_all()
        self._pme.forget()

    # -- partitions --------------------------------------------------------------------

    def partition_path(self, subject_ref: str) -> Path:
        """The subject's folder when segments live in a folder (an object store
        has no folders, and this path never exists: see ``objects``)."""
        if self._objects.local:
            return Path(self._objects.path(partition_prefix(subject_ref)))
        return self._root / partition_prefix(subject_ref)

    def _new_partition(self, subject_ref: str, *, checked: bool) -> Partition:
        """A partition object; ``checked`` ones compare their rows with the catalog on
        load and finish recorded deletions (repair reads without either)."""
        return Partition(
            self._objects,
            subject_ref,
            self._keyring,
            self._sealer,
            self._pme,
            hot=self._hot,
            locks=self._locks,
            expected_ids=self._expected_ids if checked else None,
            finish_deletes=self._finish_deletes if checked else None,
            freeze=self._freeze,
            retired_grace_seconds=self._grace_seconds,
            inline_max_rows=self._inline_rows,
            legacy=self._legacy_folder(subject_ref),
            guard_status=self._guard_status,
            owners_suppressed=self._catalog.owners_suppressed,
        )

    def _legacy_folder(self, subject_ref: str) -> LegacyFolder:
        """The subject's folder as a release before issue #21 kept it (always in the
        data folder: those releases had no object store), imported on first load."""
        return LegacyFolder(self._root / partition_prefix(subject_ref), subject_ref)

    def _guard_status(self, subject_ref: str) -> str:
        return self._catalog.guard(subject_ref).status

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
            self._used[subject_ref] = time.monotonic()
            return part

    def _expected_ids(self, subject_ref: str) -> Callable[[Any], Filed]:
        """What reads the memories the catalog holds for the subject, except those
        of suppressed scopes (an erasure in progress removes them from files
        first), on the cursor of the partition load's read transaction. The guard
        is read now, before that transaction."""
        guard = self._catalog.guard(subject_ref)
        if guard.status != ACTIVE:
            # An erasure is under way (files go before catalog rows) and every read
            # and write is refused anyway: there is nothing to hold the files to.
            return lambda cur: Filed(set(), complete=False)
        # Every asset stored in the partition: memories and derived assets alike.
        if self._sql is None:
            stmt = sa.select(assets.c.asset_id, assets.c.scope).where(
                assets.c.subject_ref == sa.bindparam("subject_ref"),
                assets.c.storage_key == sa.bindparam("storage_key"),
            )
            self._sql = self._catalog.compile({"partition_ids": stmt})["partition_ids"]
        sql, params = (
            self._sql,
            {"subject_ref": subject_ref, "storage_key": _storage_key(subject_ref)},
        )

        def read(cur: Any) -> Filed:
            cur.execute(sql, params)
            ids = {a for a, scope in cur.fetchall() if scope not in guard.scopes}
            return Filed(ids, frozenset(guard.scopes))

        return read

    # -- the namespace index (keyshred.storage.namespaces) -----------------------------

    @staticmethod
    def _ns_before(part: Partition, rows: Iterable[MemoryRow]) -> dict[NsKey, int]:
        """The counts of the partition's namespaces that a change of ``rows`` may
        move, read before the change (under the partition lock)."""
        return {k: part.ns_counts.get(k, 0) for k in {ns_key(r) for r in rows if not r.opaque}}

    def _ns_key(self, ref: str, k: NsKey) -> DataKey | None:
        """The key rows counted under ``k`` are sealed under (None: destroyed)."""
        _, scope, kid = k
        try:
            if kid is None:
                return self._keyring.data_key(ref, scope, create=False)
            return self._keyring.data_key_by_id(kid)
        except (KeyNotFound, SubjectErased):
            return None

    def _ns_change(
        self,
        ref: str,
        part: Partition,
        before: Mapping[NsKey, int],
        rows: Sequence[MemoryRow] = (),
        previous: Sequence[MemoryRow | None] = (),
    ) -> Callable[[Any], None] | None:
        """The index statements for a change of the partition since ``before``:
        namespaces whose count left zero are added (with the earliest creation
        time among ``rows``, the rows written), those that reached zero removed,
        and rows moved from another key into an indexed one lower its first time.
        Keyshred's own namespaces (``~history``) are not indexed."""
        firsts: dict[NsKey, int] = {}
        for r in rows:
            k = ns_key(r)
            firsts[k] = min(firsts.get(k, r.created_us), r.created_us)
        added: list[Entry] = []
        removed: list[tuple[tuple[str, ...], str]] = []
        for k, was in before.items():
            if k[0][0].startswith("~"):
                continue
            now = part.ns_counts.get(k, 0)
            if (was == 0) == (now == 0):
                continue
            key = self._ns_key(ref, k)
            if key is None:
                continue  # its rows are crypto-erased: a scope's drop takes the row
            if now:
                added.append(Entry(k[0], key, firsts.get(k, 0)))
            else:
                removed.append((k[0], key.key_id.hex()))
        lowered = []
        for r, p in zip(rows, previous, strict=False):
            k = ns_key(r)
            if p is None or p.opaque or ns_key(p) == k or not before.get(k) or r.opaque:
                continue
            if not k[0][0].startswith("~") and (key := self._ns_key(ref, k)) is not None:
                lowered.append((k[0], key.key_id.hex(), r.created_us))
        return self._ns.change(ref, added, removed, lowered)

    def _ns_entries(self, ref: str, part: Partition) -> list[Entry]:
        """Every namespace the loaded partition holds, as index entries (a pending
        subject's first indexing, a repair): first times from the rows themselves."""
        firsts: dict[NsKey, int] = {}
        for r in part.rows.values():
            if r.namespace[0].startswith("~"):
                continue
            k = ns_key(r)
            firsts[k] = min(firsts.get(k, r.created_us), r.created_us)
        out = []
        for k, first in firsts.items():
            key = self._ns_key(ref, k)
            if key is not None:
                out.append(Entry(k[0], key, first))
        return out

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
            # At once, as the deletion would have: the segment that held the rows
            # must not wait out the grace period (nor a compaction into the catalog
            # that committed before the kill be taken as nothing to do).
            part.flush(purge=True)
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
