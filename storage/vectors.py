"""Sealed vectors: rows of the catalog, every vector sealed with its memory's key.

Every subject's vectors are rows of one catalog table, ``ks_mem_vectors`` (SQLite on
the embedded profile, PostgreSQL on the shared one), keyed by (subject_ref, vec_id).
Columns: ``vec_id`` (memory id + field number), ``memory_id``, ``scope``, ``field``
(the JSON path that was embedded), ``updated_us`` in plaintext; ``vec`` is the
envelope ciphertext of the float32 vector, bound to (subject_ref, scope, "vectors",
vec_id, "embedding"), so a vector moved to another row or subject fails to decrypt.
The key is the holder's scope DEK, or for a memory about other subjects too (one that
mentions them, a derived asset) the owner-set DEK its row is sealed under: a vector
whose key was destroyed is unreadable, left out of every search and count, and
deleted by memory id (no key needed) when its memory goes.

A put writes its vectors in its own catalog transaction (``stage``: the rows, their
assets and their vectors, one commit); a memory's vectors are the key range
``[<memory id>/, <memory id>0)`` of its subject, so replacing or deleting them is an
index seek. Erasing a subject is one DELETE by subject_ref, then the catalog's
``scrub`` (SQLite: the WAL that held the deleted pages is checkpointed and
truncated; ``secure_delete`` zeroes them in the database file). A subject costs no
file and no dataset: a store of a million subjects is a million key ranges.

Until revision 0013 every subject had a LanceDB dataset of these same rows
(``vectors/<subject_ref>.lance``, or under an ``s3://`` prefix): a subject's dataset
is imported into the table on its first touch, under its subject lock, and removed
(``_settle``); the ciphertext moves unchanged (its associated data names no file).
LanceDB is imported only when such a dataset exists.

Search decrypts one subject's rows into a bounded in-memory cache (an erasure
target: ``evict`` drops it; a subject's entry unused for ``cache_ttl_seconds`` is
dropped by ``purge_expired``, which the handle's janitor runs on a schedule) and
ranks by cosine similarity with NumPy, restricted to the memory ids the caller
allows (filters first, then ranking). No other subject's vectors are ever loaded
for a search: the statement reads one subject's key range.

**Embedding spaces.** Vectors made by one embedding function are only ever compared
with queries made by the same function. The handle's own embedder writes the default
space (``DEFAULT_SPACE``, vec ids ``<memory id>/<n>`` as they always were); any other
embedder names its space, and its vectors carry the space's tag in their vec id
(``<memory id>/<n>@<tag>``, the tag a digest of the space's name and dimensions:
``space_tag``). The vec id is in each vector's associated data, so a vector moved to
another space fails to decrypt like one moved to another row. The spaces of a subject
share its rows (the ciphertext column is binary, so their dimensions may differ):
deleting a memory, dropping the subject on erasure and verifying it cover every space
at once. A search, a repair and the counts name one space; the cache holds each
space's matrix apart.

A legacy dataset that fails to decode (damaged or tampered files) is an
``IntegrityError`` (``_lance_call``); a full disk passes through for the facade to
type.
"""

from __future__ import annotations

import gc
import hashlib
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import sqlalchemy as sa

from keyshred import db
from keyshred._handle import is_disk_full
from keyshred.errors import IntegrityError, InvalidInput, KeyshredError, SubjectErased
from keyshred.keyring.envelope import OVERHEAD_BYTES, Place, PlaceTemplate
from keyshred.keyring.keyring import Keyring
from keyshred.storage import faults
from keyshred.storage.catalog import Catalog
from keyshred.storage.erasable import DROP, ErasureTarget, Phase, StoreCheck, StoreErasure
from keyshred.storage.freeze import FreezeLock
from keyshred.storage.objects import ObjectStore
from keyshred.storage.schema import memory_vectors
from keyshred.storage.subject_lock import SubjectLocks

__all__ = [
    "DEFAULT_SPACE",
    "VEC_SCHEMA",
    "StagedVectors",
    "VectorIndex",
    "VectorItem",
    "space_of",
    "space_tag",
]

VEC_SCHEMA = pa.schema(
    [
        ("vec_id", pa.string()),
        ("memory_id", pa.string()),
        ("scope", pa.string()),
        ("field", pa.string()),
        ("updated_us", pa.int64()),
        ("vec", pa.binary()),
    ]
)
_TABLE = "vectors"
_COLUMN = "embedding"

# The handle's own embedding function: vec ids without a tag (every vector written
# before spaces existed is in it).
DEFAULT_SPACE = ""
_SPACE_SEP = "@"  # memory ids are hex and field numbers digits: never in either


def space_tag(name: str, dims: int) -> str:
    """The tag of the embedding space ``name`` with ``dims`` dimensions: 16 hex digits
    of SHA-256. A digest, not the name: the name is configuration (a model or function
    name), but a vec id column is no place for free text, and the dimensions are part
    of the identity (the same model truncated to fewer dimensions is another space)."""
    if not isinstance(name, str) or not name:
        raise InvalidInput("an embedding space has a non-empty name")
    if isinstance(dims, bool) or not isinstance(dims, int) or dims <= 0:
        raise InvalidInput("an embedding space has a positive number of dimensions")
    return hashlib.sha256(f"{name}\0{dims}".encode()).hexdigest()[:16]


def space_of(vec_id: str) -> str:
    """The space tag of a vec id (``DEFAULT_SPACE`` for an untagged one)."""
    return vec_id.partition(_SPACE_SEP)[2]


@dataclass(frozen=True, slots=True)
class VectorItem:
    memory_id: str
    field_no: int
    field: str
    scope: str
    updated_us: int
    vector: np.ndarray[Any, Any]
    # The owner-set key of the memory the vector embeds (None: the holder's scope
    # key): a vector is about the same subjects as its memory, so it is sealed
    # under the same key and erased with any of them.
    key_id: bytes | None = None
    # The embedding space (``space_tag``) of the function that made the vector.
    space: str = DEFAULT_SPACE

    @property
    def vec_id(self) -> str:
        base = f"{self.memory_id}/{self.field_no}"
        return f"{base}{_SPACE_SEP}{self.space}" if self.space else base

    def __repr__(self) -> str:
        return f"VectorItem(vec_id={self.vec_id!r}, scope={self.scope!r})"


class _Cached:
    """One subject's decrypted vectors: rows of ``matrix`` match ``vec_ids``;
    ``updated`` is the version (``updated_us``) of the memory each was embedded from."""

    __slots__ = ("__weakref__", "_versions", "fields", "matrix", "memory_ids", "updated", "vec_ids")

    def __init__(
        self,
        vec_ids: list[str],
        memory_ids: list[str],
        fields: list[str],
        updated: list[int],
        matrix: Any,
    ) -> None:
        self.vec_ids = vec_ids
        self.memory_ids = memory_ids
        self.fields = fields
        self.updated = updated
        self.matrix = matrix
        self._versions: dict[str, int] | None = None

    def versions(self) -> dict[str, int]:
        """memory id -> the version its vectors were embedded from (-1: fields of
        two versions); built once, then kept up to date by ``add`` and ``remove``.
        The caller must not change it."""
        if self._versions is None:
            out: dict[str, int] = {}
            for memory_id, version in zip(self.memory_ids, self.updated, strict=True):
                out[memory_id] = version if out.get(memory_id, version) == version else -1
            self._versions = out
        return self._versions

    def remove(self, memory_ids: set[str]) -> None:
        keep = [i for i, m in enumerate(self.memory_ids) if m not in memory_ids]
        if len(keep) == len(self.memory_ids):
            return
        if self._versions is not None:
            for memory_id in memory_ids:
                self._versions.pop(memory_id, None)
        self.vec_ids = [self.vec_ids[i] for i in keep]
        self.memory_ids = [self.memory_ids[i] for i in keep]
        self.fields = [self.fields[i] for i in keep]
        self.updated = [self.updated[i] for i in keep]
        self.matrix = self.matrix[keep]

    @property
    def dims(self) -> int | None:
        return int(self.matrix.shape[1]) if self.matrix.shape[0] else None

    def add(self, items: Sequence[VectorItem]) -> None:
        if not items:
            return
        self.vec_ids += [it.vec_id for it in items]
        self.memory_ids += [it.memory_id for it in items]
        self.fields += [it.field for it in items]
        self.updated += [it.updated_us for it in items]
        if self._versions is not None:
            have = self._versions
            for it in items:
                old = have.get(it.memory_id, it.updated_us)
                have[it.memory_id] = it.updated_us if old == it.updated_us else -1
        new = np.stack([it.vector for it in items]).astype(np.float32)
        self.matrix = new if self.matrix.shape[0] == 0 else np.vstack([self.matrix, new])


class VectorIndex:
    """Sealed vectors, rows of the catalog's ``ks_mem_vectors`` keyed by subject."""

    def __init__(
        self,
        uri: str,
        keyring: Keyring,
        *,
        catalog: Catalog | None = None,
        cache_max_vectors: int = 500_000,
        compact_every: int = 32,
        storage_options: dict[str, str] | None = None,
        freeze: FreezeLock | None = None,
        store: ObjectStore | None = None,
        cache_ttl_seconds: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # ``uri`` is where the datasets of the layout before revision 0013 are (a
        # folder or an ``s3://`` prefix, ``storage_options`` for LanceDB): read only
        # to import them (``_settle``). ``compact_every`` is accepted and unused (it
        # compacted those datasets). Without a catalog the index is a reader only
        # (``_open_spaces``: the residue scan).
        del compact_every
        self._uri = uri
        self._catalog = catalog
        # On an object store, every object (every version, on a versioned bucket)
        # under a legacy dataset's prefix: what an import and an erasure delete.
        self._store = store
        # The data folder's freeze lock (shared with the memory store): an erasure's
        # drop holds it shared, so a backup never links half of a legacy dataset.
        self._freeze = freeze
        self._keyring = keyring
        self._cache_max = cache_max_vectors
        self._storage_options = storage_options
        self._db: Any = None
        self._lock = threading.RLock()
        # subject_ref -> space tag -> that space's decrypted vectors.
        self._cache: OrderedDict[str, dict[str, _Cached]] = OrderedDict()
        self._evictions = 0  # bumped by every eviction: see ``_cached``
        # Subjects being loaded (how many loads), and those of them written since a
        # load began: such a load may predate the write, and is not cached.
        self._loading: dict[str, int] = {}
        self._written: set[str] = set()
        # When each cached subject was last used: decrypted vectors idle for the TTL
        # leave memory (``purge_expired``), asked for or not.
        self._used: dict[str, float] = {}
        self._ttl = cache_ttl_seconds
        self._clock = clock
        # The subjects that still have a legacy dataset (listed once, on first use).
        self._legacy: set[str] | None = None
        self._locks: SubjectLocks | None = None
        self._sql = catalog.compile(_statements(catalog)) if catalog is not None else {}

    def use_locks(self, locks: SubjectLocks) -> None:
        """The subject locks of the memory store: a legacy import runs under the
        subject's lock, like every other change of the subject's data."""
        self._locks = locks

    # -- the catalog table ---------------------------------------------------------

    def _need_catalog(self) -> Catalog:
        if self._catalog is None:
            raise KeyshredError("this vector index has no catalog (a reader only)")
        return self._catalog

    def exists(self, ref: str) -> bool:
        """Whether the subject has any vector row (readable or not) or a legacy
        dataset left."""
        catalog = self._need_catalog()
        with catalog.hot(write=False) as cur:
            cur.execute(self._sql["any"], {"ref": ref})
            row = cur.fetchone()
            if row is not None and row[0]:
                return True
        return self._legacy_left(ref)

    def _rows(self, ref: str) -> pa.Table:
        """The subject's rows as a table of ``VEC_SCHEMA``, in the order they were
        written (a put's fields in field order): the order searches break ties by."""
        catalog = self._need_catalog()
        with catalog.hot(write=False) as cur:
            cur.execute(self._sql["load"], {"ref": ref})
            rows = cur.fetchall()
        if not rows:
            return VEC_SCHEMA.empty_table()
        rows.sort(key=_write_order)
        vec_ids, memory_ids, scopes, fields, updated, vecs = zip(*rows, strict=True)
        return pa.table(
            [
                list(vec_ids),
                list(memory_ids),
                list(scopes),
                list(fields),
                list(updated),
                [db.blob(v) for v in vecs],
            ],
            schema=VEC_SCHEMA,
        )

    # -- the layout before revision 0013 (one LanceDB dataset per subject) -----------

    def _connect(self) -> Any:
        if self._db is None:
            import lancedb  # imported on first use: it is slow to import

            self._db = lancedb.connect(self._uri, storage_options=self._storage_options)
        return self._db

    def _legacy_refs(self) -> set[str]:
        """Subjects with a dataset of the old layout, listed once per process: the
        code never writes one any more, so the set only shrinks."""
        with self._lock:
            if self._legacy is None:
                self._legacy = self._list_legacy()
            return self._legacy

    def _list_legacy(self) -> set[str]:
        if not self._uri or self._catalog is None:
            return set()
        if "://" not in self._uri:
            folder = Path(self._uri)
            if not folder.is_dir():
                return set()
            return {p.name.removesuffix(".lance") for p in folder.glob("*.lance") if p.is_dir()}
        if self._store is not None:
            # Listed as LanceDB lists them (the folders named ``<ref>.lance``), without
            # importing LanceDB: that alone took 2 s of every process's first touch.
            names = self._store.list_dirs()
            return {n.removesuffix(".lance") for n in names if n.endswith(".lance")}
        with _lance_call("(listing)"):
            listed = self._connect().list_tables()
        return set(getattr(listed, "tables", listed))

    def _legacy_left(self, ref: str) -> bool:
        if ref not in self._legacy_refs():
            return False
        if "://" not in self._uri:
            return (Path(self._uri) / f"{ref}.lance").exists()
        if self._store is not None:
            return bool(self._store.versions(f"{ref}.lance"))
        return ref in self._list_legacy()

    def _settle(self, ref: str) -> None:
        """Import the subject's legacy dataset into the table, then remove it: on
        the subject's first touch, under its subject lock (a concurrent import by
        another process finds the dataset gone, or inserts rows already there). The
        ciphertext moves as it is: its associated data names no file."""
        if ref not in self._legacy_refs():
            return
        with (
            self._locks.hold(ref) if self._locks is not None else nullcontext(),
            # Shared like every partition write: a backup never copies half of
            # the dataset being removed.
            self._freeze.shared() if self._freeze is not None else nullcontext(),
        ):
            if not self._legacy_left(ref):
                self._forget_legacy(ref)
                return
            try:
                table = self._connect().open_table(ref)
            except _LANCE_ERRORS as exc:
                raise _unreadable(ref, exc) from None
            with _lance_call(ref):
                arrow = table.to_arrow()
            rows = [
                {
                    "ref": ref,
                    "vec_id": vec_id,
                    "memory_id": memory_id,
                    "scope": scope,
                    "field": field,
                    "updated_us": int(updated),
                    "vec": vec,
                }
                for vec_id, memory_id, scope, field, updated, vec in zip(
                    *(arrow.column(n).to_pylist() for n in VEC_SCHEMA.names), strict=True
                )
            ]
            if rows:
                with self._need_catalog().hot(write=True) as cur:
                    cur.executemany(self._sql["import"], rows)
            faults.reached("vectors.after_import")
            self._remove_legacy(ref)
            self._forget_legacy(ref)

    def legacy_refs(self) -> list[str]:
        """The subjects that still have a dataset of the layout before revision
        0013 (``keyshred migrate`` imports them at once)."""
        return sorted(self._legacy_refs())

    def settle(self, ref: str) -> None:
        """Import the subject's legacy dataset now (``_settle``), if it has one."""
        self._settle(ref)

    def _forget_legacy(self, ref: str) -> None:
        with self._lock:
            if self._legacy is not None:
                self._legacy.discard(ref)

    def _remove_legacy(self, ref: str) -> bool:
        """Delete the subject's legacy dataset, every file (and object version)."""
        removed = False
        if "://" not in self._uri:
            folder = Path(self._uri) / f"{ref}.lance"
            if folder.exists():
                shutil.rmtree(folder)
                removed = True
        else:
            with _lance_call(ref):
                if ref in self._list_legacy():
                    self._connect().drop_table(ref)
                    removed = True
            if self._store is not None:
                removed = bool(self._store.delete_prefix(f"{ref}.lance")) or removed
        return removed

    # -- sealing -------------------------------------------------------------------

    def _seal(self, ref: str, item: VectorItem) -> bytes:
        raw = np.ascontiguousarray(item.vector, dtype=np.float32).tobytes()
        place = Place(ref, item.scope, _TABLE, item.vec_id, _COLUMN)
        if item.key_id is not None:
            return self._keyring.data_key_by_id(item.key_id).seal(raw, place)
        return self._keyring.seal(raw, place)

    def _open_spaces(self, ref: str, table: pa.Table) -> dict[str, _Cached]:
        """Every space's vectors of a dataset, decrypted, one matrix per space (their
        widths may differ; within a space they may not)."""
        if table.num_rows == 0:
            return {}
        ids = table.column("vec_id")
        if not pc.any(pc.match_substring(ids, _SPACE_SEP)).as_py():
            # The usual case: the handle's space only (found in C++, no copy).
            return {DEFAULT_SPACE: self._open_all(ref, table)}
        spaces = [space_of(v) for v in ids.to_pylist()]
        if len(set(spaces)) == 1:
            return {spaces[0]: self._open_all(ref, table)}
        rows: dict[str, list[int]] = {}
        for i, space in enumerate(spaces):
            rows.setdefault(space, []).append(i)
        return {
            space: self._open_all(ref, table.take(pa.array(idx, pa.int64())))
            for space, idx in rows.items()
        }

    def _open_all(self, ref: str, table: pa.Table) -> _Cached:
        vec_ids = table.column("vec_id").to_pylist()
        memory_ids = table.column("memory_id").to_pylist()
        scopes = table.column("scope").to_pylist()
        fields = table.column("field").to_pylist()
        updated = table.column("updated_us").to_pylist()
        n = len(vec_ids)
        if n == 0:
            return _empty()
        # The ciphertexts sit end to end in each Arrow chunk's data buffer; they are
        # decrypted straight into the rows of one matrix, chunk by chunk, with no
        # per-row bytes objects and no copy of the whole column.
        overhead = OVERHEAD_BYTES
        matrix: np.ndarray[Any, Any] | None = None
        out: memoryview | None = None
        width = 0
        row = 0
        templates: dict[str, PlaceTemplate] = {}
        opaque: list[int] = []  # rows under a destroyed (owner-set) key
        for chunk in table.column("vec").chunks:
            m = len(chunk)
            if m == 0:
                continue
            offsets = np.frombuffer(chunk.buffers()[1], dtype=np.int32)[
                chunk.offset : chunk.offset + m + 1
            ]
            sizes = np.diff(offsets)
            if matrix is None:
                width = int(sizes[0]) - overhead
                if width <= 0 or width % 4:
                    raise IntegrityError(f"vector partition {ref} holds malformed vectors")
                matrix = np.empty((n, width // 4), dtype=np.float32)
                out = memoryview(matrix.data).cast("B")
            if (sizes != width + overhead).any():
                raise IntegrityError(f"vector partition {ref} holds vectors of mixed size")
            data = chunk.buffers()[2].to_pybytes()
            starts = (offsets[:-1] - offsets[0]).tolist() if offsets[0] else offsets[:-1].tolist()
            if offsets[0]:
                data = data[int(offsets[0]) :]
            rows = list(range(row, row + m))
            self._open_chunk(
                ref,
                data,
                starts=starts,
                rows=rows,
                scopes=scopes,
                vec_ids=vec_ids,
                out=out,
                width=width,
                templates=templates,
                opaque=opaque,
            )
            row += m
        assert matrix is not None  # noqa: S101 - n > 0 means at least one row
        cached = _Cached(vec_ids, memory_ids, fields, updated, matrix)
        if opaque:
            # Unreadable, not corrupt: left in the dataset (deleted by id with their
            # memory, without any key), in no search, count or version.
            dead = set(opaque)
            keep = [i for i in range(n) if i not in dead]
            cached = _Cached(
                [vec_ids[i] for i in keep],
                [memory_ids[i] for i in keep],
                [fields[i] for i in keep],
                [updated[i] for i in keep],
                matrix[keep],
            )
        return cached

    def _open_chunk(
        self,
        ref: str,
        data: bytes,
        *,
        starts: list[int],
        rows: list[int],
        scopes: list[str],
        vec_ids: list[str],
        out: Any,
        width: int,
        templates: dict[str, PlaceTemplate],
        opaque: list[int],
    ) -> None:
        # Rows are grouped by (key id, scope), read without slicing every row: a
        # partition normally has one key per scope, often just one.
        flat = np.frombuffer(data, dtype=np.uint8)
        key_ids = flat[np.asarray(starts)[:, None] + np.arange(4, 20)]
        chunk_scopes = [scopes[r] for r in rows]
        groups: dict[tuple[bytes, str], list[int]] = {}
        if (key_ids == key_ids[0]).all() and len(set(chunk_scopes)) == 1:
            groups[(key_ids[0].tobytes(), chunk_scopes[0])] = list(range(len(rows)))
        else:
            for j, scope in enumerate(chunk_scopes):
                groups.setdefault((key_ids[j].tobytes(), scope), []).append(j)
        for (key_id, scope), members in groups.items():
            try:
                key = self._keyring.data_key_by_id(key_id)
            except SubjectErased:
                opaque += [rows[j] for j in members]
                continue
            if key.subject_ref != ref or key.scope != scope:
                raise IntegrityError(f"vector partition {ref} holds another owner's row")
            template = templates.get(scope)
            if template is None:
                template = templates[scope] = PlaceTemplate(ref, scope, _TABLE, _COLUMN)
            key.open_rows_into(
                data,
                starts=[starts[j] for j in members],
                template=template,
                record_ids=[vec_ids[rows[j]] for j in members],
                out=out,
                out_rows=[rows[j] for j in members],
                width=width,
            )

    # -- cache ---------------------------------------------------------------------

    def _cached(self, ref: str) -> dict[str, _Cached]:
        """The subject's decrypted vectors by space (loaded on first use)."""
        with self._lock:
            entry = self._cache.get(ref)
            if entry is not None:
                self._cache.move_to_end(ref)
                self._used[ref] = self._clock()
                return entry
            # An eviction while this loads (another process erased the subject after
            # this read passed its guard) leaves the loaded vectors out of the cache;
            # so does a write committed meanwhile (the load may predate it).
            since = self._evictions
            self._loading[ref] = self._loading.get(ref, 0) + 1
        try:
            self._settle(ref)
            # Loading makes tens of thousands of small objects at once; the cyclic
            # GC would walk the whole heap for nothing (they hold no cycles).
            enabled = gc.isenabled()
            gc.disable()
            try:
                entry = self._open_spaces(ref, self._rows(ref))
            finally:
                if enabled:
                    gc.enable()
        except BaseException:
            with self._lock:
                self._loaded(ref)
            raise
        with self._lock:
            # One hold of the lock from the check to the cache: a write committed
            # after it finds the entry cached and updates it (``_committed``).
            written = self._loaded(ref)
            if since != self._evictions or written:
                return entry
            self._cache[ref] = entry
            self._used[ref] = self._clock()
            total = sum(_size(c) for c in self._cache.values())
            while total > self._cache_max and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                total -= _size(old)
        return entry

    def _loaded(self, ref: str) -> bool:
        """Under ``_lock``: a load of ``ref`` ended; whether a write of it committed
        while it ran."""
        written = ref in self._written
        left = self._loading[ref] - 1
        if left:
            self._loading[ref] = left
        else:
            del self._loading[ref]
            self._written.discard(ref)
        return written

    def evict(self, ref: str | None = None) -> None:
        """Forget decrypted vectors (one subject, or all)."""
        with self._lock:
            self._evictions += 1
            if ref is None:
                self._cache.clear()
                self._used.clear()
            else:
                self._cache.pop(ref, None)
                self._used.pop(ref, None)

    def note_eviction(self, ref: str | None) -> None:
        """An eviction begins: a load that spans it caches nothing (``_cached``)."""
        with self._lock:
            self._evictions += 1

    def evict_all(self) -> None:
        """Forget every subject's decrypted vectors."""
        self.evict(None)

    def purge_expired(self) -> int:
        """Forget the decrypted vectors of subjects unused for the cache TTL; returns
        how many subjects' went."""
        with self._lock:
            limit = self._clock() - self._ttl
            doomed = [ref for ref, used in self._used.items() if used <= limit]
            for ref in doomed:
                self._cache.pop(ref, None)
                del self._used[ref]
            return len(doomed)

    def held(self, ref: str) -> int:
        """How many of the subject's decrypted vectors this process holds."""
        with self._lock:
            return _size(self._cache.get(ref, {}))

    # -- writes --------------------------------------------------------------------

    def upsert(
        self,
        ref: str,
        items: Sequence[VectorItem],
        replace: Iterable[str] = (),
        *,
        only: str | None = None,
    ) -> None:
        """Replace the vectors of the ``replace`` memory ids (and of the items'), then
        add ``items``, in one catalog transaction of its own. The vectors replaced
        are those of every space (a memory written anew: what other spaces embedded
        is of its old value), or with ``only`` those of that space (a repair in one
        space leaves the others be)."""
        staged = self.stage(ref, items, replace, only=only)
        if staged is None:
            return
        with self._need_catalog().hot(write=True) as cur:
            staged.run(cur)
        staged.done()

    def stage(
        self,
        ref: str,
        items: Sequence[VectorItem],
        replace: Iterable[str] = (),
        *,
        only: str | None = None,
    ) -> StagedVectors | None:
        """``upsert``'s statements for a caller's catalog transaction (a put's: its
        rows, assets and vectors in one commit); the caller calls ``done`` once it
        committed, and the decrypted cache takes the change then. None: nothing to
        write. Sealing happens here, before the transaction."""
        replace = set(replace) | {it.memory_id for it in items}
        dims = _dims_by_space(items)
        if only is not None and any(space != only for space in dims):
            raise InvalidInput("vectors of another space than the one being replaced")
        if only is not None and only != DEFAULT_SPACE and not only.isalnum():
            raise InvalidInput("a space tag is alphanumeric")
        if not items and not replace:
            return None
        self._settle(ref)
        with self._lock:
            entry = self._cache.get(ref)
            for space, width in dims.items():
                # The space's width is fixed by its first vector; a cached space
                # tells it without a read (a partition of mixed widths would refuse
                # to load).
                have = entry[space].dims if entry is not None and space in entry else None
                if have is not None and have != width:
                    raise InvalidInput(
                        f"vectors of {width} dimensions in a space of {have} dimensions"
                    )
        rows = [
            {
                "ref": ref,
                "vec_id": it.vec_id,
                "memory_id": it.memory_id,
                "scope": it.scope,
                "field": it.field,
                "updated_us": it.updated_us,
                "vec": self._seal(ref, it),
            }
            for it in items
        ]
        return StagedVectors(self, ref, items=list(items), replace=replace, only=only, rows=rows)

    def _statements_for(
        self, ref: str, replace: set[str], only: str | None, rows: list[dict[str, Any]]
    ) -> Callable[[Any], None]:
        sql = self._sql
        # A memory's vectors are the key range [<memory id>/, <memory id>0) of its
        # subject ('0' follows '/'; memory ids are hex): an index seek, not a scan
        # of the subject's rows.
        ranges = [{"ref": ref, "lo": f"{m}/", "hi": f"{m}0"} for m in sorted(replace)]
        if only is None:
            delete = sql["delete_range"]
        elif only == DEFAULT_SPACE:
            delete = sql["delete_range_default"]
            ranges = [{**r, "space": f"%{_SPACE_SEP}%"} for r in ranges]
        else:
            delete = sql["delete_range_space"]
            ranges = [{**r, "space": f"%{_SPACE_SEP}{only}"} for r in ranges]

        def run(cur: Any) -> None:
            if ranges:
                cur.executemany(delete, ranges)
            if rows:
                cur.executemany(sql["insert"], rows)
            faults.reached("put.after_vectors")

        return run

    def _committed(
        self, ref: str, items: Sequence[VectorItem], replace: set[str], only: str | None
    ) -> None:
        """A write committed: the cached entry (if any) takes it."""
        dims = {it.space for it in items}
        with self._lock:
            self._wrote(ref)
            entry = self._cache.get(ref)
            if entry is None:
                return
            for space, cached in entry.items():
                if only is None or space == only:
                    cached.remove(replace)
            for space in dims:
                entry.setdefault(space, _empty()).add([it for it in items if it.space == space])

    def _wrote(self, ref: str) -> None:
        """Under ``_lock``: a write of ``ref`` committed (a load under way of it is
        not cached)."""
        if ref in self._loading:
            self._written.add(ref)

    def delete(self, ref: str, memory_ids: Iterable[str]) -> int:
        """Delete the vectors of these memories (no key needed: by memory id)."""
        ids = set(memory_ids)
        if not ids:
            return 0
        self._settle(ref)
        ranges = [{"ref": ref, "lo": f"{m}/", "hi": f"{m}0"} for m in sorted(ids)]
        with self._need_catalog().hot(write=True) as cur:
            removed = 0
            for params in ranges:
                cur.execute(self._sql["delete_range"], params)
                removed += max(0, int(cur.rowcount))
        with self._lock:
            self._wrote(ref)
            entry = self._cache.get(ref)
            for cached in (entry or {}).values():
                cached.remove(ids)
        return removed

    def delete_scope(self, ref: str, scope: str) -> int:
        """Delete every vector of one scope (and scrub the catalog's WAL)."""
        self._settle(ref)
        catalog = self._need_catalog()
        with catalog.hot(write=True) as cur:
            cur.execute(self._sql["delete_scope"], {"ref": ref, "scope": scope})
            removed = max(0, int(cur.rowcount))
        with self._lock:
            self._wrote(ref)
            self._cache.pop(ref, None)
        catalog.scrub()
        return removed

    def drop(self, ref: str) -> bool:
        """``drop_rows``: whether there was anything to remove."""
        return self.drop_rows(ref) > 0

    def drop_rows(self, ref: str) -> int:
        """Remove every vector of the subject (erasure): one DELETE by subject_ref,
        then the catalog's scrub (on SQLite the WAL that held the deleted pages is
        checkpointed and truncated; ``secure_delete`` zeroed them in the database),
        and a legacy dataset if one is left."""
        catalog = self._need_catalog()
        with self._lock:
            self._cache.pop(ref, None)
            self._wrote(ref)
        dropped = 0
        # A legacy dataset first, unread (the keys are destroyed; counted as one:
        # what it held was never counted), under the subject lock: an import under
        # way elsewhere has committed its rows before this goes on to delete them.
        if ref in self._legacy_refs():
            with self._locks.hold(ref) if self._locks is not None else nullcontext():
                dropped += 1 if self._remove_legacy(ref) else 0
                self._forget_legacy(ref)
        with catalog.hot(write=True) as cur:
            cur.execute(self._sql["drop"], {"ref": ref})
            dropped += max(0, int(cur.rowcount))
        catalog.scrub()
        with self._lock:
            self._cache.pop(ref, None)
        return dropped

    def remaining(self, ref: str, scope: str | None = None) -> int:
        """How many vector rows the catalog holds for the subject (or one scope)."""
        catalog = self._need_catalog()
        with catalog.hot(write=False) as cur:
            if scope is None:
                cur.execute(self._sql["count"], {"ref": ref})
            else:
                cur.execute(self._sql["count_scope"], {"ref": ref, "scope": scope})
            row = cur.fetchone()
        return int(row[0]) if row else 0

    # -- reads ---------------------------------------------------------------------

    def spaces(self, ref: str) -> set[str]:
        """The tags of the spaces the subject has readable vectors in."""
        return {space for space, c in self._cached(ref).items() if c.vec_ids}

    def _in_space(self, ref: str, space: str | None) -> list[_Cached]:
        entry = self._cached(ref)
        if space is None:
            return list(entry.values())
        cached = entry.get(space)
        return [cached] if cached is not None else []

    def memory_ids(self, ref: str, space: str | None = None) -> set[str]:
        """Memories with vectors (in ``space``, or in any)."""
        return {m for c in self._in_space(ref, space) for m in c.memory_ids}

    def versions(self, ref: str, space: str = DEFAULT_SPACE) -> dict[str, int]:
        """memory id -> the version (``updated_us``) of the memory its vectors in
        ``space`` were embedded from; a memory whose fields disagree maps to -1
        (never a version)."""
        entries = self._in_space(ref, space)
        return dict(entries[0].versions()) if entries else {}

    def version_map(self, ref: str, space: str = DEFAULT_SPACE) -> tuple[object, dict[str, int]]:
        """``versions`` without the copy, and the cache entry it belongs to (its
        identity changes when the subject's vectors are read afresh): for a caller
        that remembers what it checked. The map must not be changed."""
        entries = self._in_space(ref, space)
        if not entries:
            return None, {}
        return entries[0], entries[0].versions()

    def fields_of(self, ref: str, memory_id: str, space: str = DEFAULT_SPACE) -> list[str]:
        return [
            f
            for entry in self._in_space(ref, space)
            for m, f in zip(entry.memory_ids, entry.fields, strict=True)
            if m == memory_id
        ]

    def count(self, ref: str, space: str | None = None) -> int:
        """How many readable vectors (in ``space``, or in every space)."""
        return sum(len(c.vec_ids) for c in self._in_space(ref, space))

    def search(
        self,
        ref: str,
        query: np.ndarray[Any, Any],
        k: int,
        allowed: set[str] | None = None,
        *,
        space: str = DEFAULT_SPACE,
        accept: Callable[[str], bool] | None = None,
        ties: bool = False,
    ) -> list[tuple[str, float]]:
        """Top ``k`` memory ids by cosine similarity among the vectors of ``space``
        (a memory scores its best field). ``allowed`` restricts the ranking to
        those ids; ``accept`` is asked about ids as they come up in rank order (a
        filter applied after ranking: it costs what the ranking reaches, not one
        call per vector). With ``ties`` the scores are those of float64 products
        (the ranking's float32 product scored one text 0.99999994 in one subject and
        0.99999988 in another) and every memory scoring what the ``k``-th scores is
        in the answer too: which of equal scores come first is the caller's order
        (insertion), not the matrix's row order."""
        entry = self._cached(ref).get(space)
        if entry is None or not entry.vec_ids or k <= 0:
            return []
        if entry.matrix.shape[1] != query.shape[0]:
            raise InvalidInput(
                f"query has {query.shape[0]} dimensions, the index {entry.matrix.shape[1]}"
            )
        scores = entry.matrix @ query.astype(np.float32)
        if allowed is not None:
            mask = np.fromiter(
                (m in allowed for m in entry.memory_ids), bool, len(entry.memory_ids)
            )
            scores = np.where(mask, scores, -np.inf)
        n = scores.shape[0]
        take = min(n, k * 4)
        verdicts: dict[str, bool] = {}
        while True:
            top = np.argpartition(-scores, take - 1)[:take] if take < n else np.arange(n)
            top = top[np.argsort(-scores[top], kind="stable")]
            best: dict[str, float] = {}
            rows: dict[str, int] = {}  # the row of each memory's best field
            # With ties: what the k-th scores less float32's error, once reached.
            floor: float | None = None
            ended = False  # a lower score was met after the k-th (or none is left)
            for i in top:
                score = float(scores[i])
                if score == -np.inf or (floor is not None and score < floor):
                    ended = True
                    break
                memory_id = entry.memory_ids[i]
                if accept is not None:
                    ok = verdicts.get(memory_id)
                    if ok is None:
                        ok = verdicts[memory_id] = accept(memory_id)
                    if not ok:
                        continue
                if memory_id not in best:
                    best[memory_id] = score
                    if ties:
                        rows[memory_id] = int(i)
                if len(best) == k and floor is None:
                    if not ties:
                        ended = True
                        break
                    floor = score - _TIE_SLACK * max(1.0, abs(score))
            if (len(best) >= k and ended) or take >= n:
                if ties and best:
                    return _exact_ties(entry.matrix, query, best, rows, k)
                return list(best.items())
            take = min(n, take * 4)

    # -- Erasable (keyshred.storage.erasable) ---------------------------------------

    name = "vectors"
    phase: Phase = DROP

    def erase(self, target: ErasureTarget) -> StoreErasure:
        """The subject's vector rows, or one scope's; listed memories' vectors went
        with them (``MemoryStore.erase``)."""
        now = datetime.now(UTC)
        if target.assets is not None:
            return StoreErasure(self.name, "deleted-with-their-memories", 0, now)
        with self._freeze.shared() if self._freeze is not None else nullcontext():
            if target.scope is None:
                n, action = self.drop_rows(target.subject_ref), "partition-dropped"
            else:
                n, action = self.delete_scope(target.subject_ref, target.scope), "scope-deleted"
        faults.reached("erase.vectors")
        return StoreErasure(self.name, action, n, datetime.now(UTC))

    def verify(self, target: ErasureTarget) -> list[StoreCheck]:
        if not target.whole_subject:
            return []  # scope vectors: counted by the catalog's asset check
        ref = target.subject_ref
        rows = self.remaining(ref)
        checks = [StoreCheck("vector rows removed", rows == 0, f"{rows} rows left")]
        if self._store is not None:
            # A legacy dataset's objects: the object store's own listing (every
            # version), not LanceDB's view.
            left = self._store.versions(f"{ref}.lance")
            detail = f"{len(left)} objects left (listed {self._store.url})"
            checks.append(StoreCheck("legacy vector dataset removed", not left, detail))
        elif self._uri and "://" not in self._uri:
            gone = not (Path(self._uri) / f"{ref}.lance").exists()
            detail = "absent" if gone else "still there"
            checks.append(StoreCheck("legacy vector dataset removed", gone, detail))
        return checks

    # ``evict`` (above) forgets the decrypted vectors: the Erasable ``evict``.


# What LanceDB and pyarrow raise for a file they cannot decode: pyarrow's
# ArrowInvalid (a ValueError) and ArrowIOError (an OSError), Lance's Rust errors
# (``RuntimeError: lance error: ...``).
_LANCE_ERRORS = (OSError, ValueError, RuntimeError)


def _lance_failure(exc: BaseException) -> bool:
    """A decoding failure, not a Python bug that happens to be a RuntimeError."""
    return not isinstance(exc, RuntimeError) or "lance" in str(exc).lower()


@contextmanager
def _lance_call(ref: str) -> Iterator[None]:
    """Run LanceDB calls on ``ref``'s dataset: a file that fails to decode raises
    ``IntegrityError``. A full disk is not damage: it passes through, and the facade
    types it ``StorageFull``; so does an error of ours (already typed)."""
    try:
        yield
    except _LANCE_ERRORS as exc:
        if isinstance(exc, KeyshredError) or not _lance_failure(exc) or is_disk_full(exc):
            raise
        raise _unreadable(ref, exc) from None


def _empty() -> _Cached:
    return _Cached([], [], [], [], np.zeros((0, 0), dtype=np.float32))


def _size(spaces: dict[str, _Cached]) -> int:
    return sum(len(c.vec_ids) for c in spaces.values())


def _dims_by_space(items: Sequence[VectorItem]) -> dict[str, int]:
    """Each space's width among ``items`` (``InvalidInput`` if one space has two)."""
    dims: dict[str, int] = {}
    for it in items:
        width = int(np.asarray(it.vector).shape[-1]) if np.ndim(it.vector) == 1 else -1
        if width <= 0 or dims.setdefault(it.space, width) != width:
            raise InvalidInput("the vectors of one embedding space have one length")
    return dims


def _unreadable(ref: str, exc: BaseException) -> IntegrityError:
    # The backend's message names files and offsets only, but it is not repeated:
    # IntegrityError is deliberately opaque.
    return IntegrityError(f"vector partition {ref} failed to read ({type(exc).__name__})")


def _p(name: str) -> Any:
    return sa.bindparam(name)


def _statements(catalog: Catalog) -> dict[str, Any]:
    """The index's statements on ``ks_mem_vectors`` (compiled once per catalog)."""
    t = memory_vectors.c
    in_range = sa.and_(t.subject_ref == _p("ref"), t.vec_id >= _p("lo"), t.vec_id < _p("hi"))
    return {
        "any": sa.select(sa.exists().where(t.subject_ref == _p("ref"))),
        "count": sa.select(sa.func.count()).where(t.subject_ref == _p("ref")),
        "count_scope": sa.select(sa.func.count()).where(
            t.subject_ref == _p("ref"), t.scope == _p("scope")
        ),
        "load": sa.select(t.vec_id, t.memory_id, t.scope, t.field, t.updated_us, t.vec).where(
            t.subject_ref == _p("ref")
        ),
        "insert": memory_vectors.insert().values(
            subject_ref=_p("ref"),
            vec_id=_p("vec_id"),
            memory_id=_p("memory_id"),
            scope=_p("scope"),
            field=_p("field"),
            updated_us=_p("updated_us"),
            vec=_p("vec"),
        ),
        # A legacy import: rows already there (an import that died before it
        # removed the dataset) stay as they are.
        "import": catalog.insert_ignore(memory_vectors).values(
            subject_ref=_p("ref"),
            vec_id=_p("vec_id"),
            memory_id=_p("memory_id"),
            scope=_p("scope"),
            field=_p("field"),
            updated_us=_p("updated_us"),
            vec=_p("vec"),
        ),
        "delete_range": memory_vectors.delete().where(in_range),
        "delete_range_default": memory_vectors.delete().where(
            in_range, t.vec_id.not_like(_p("space"))
        ),
        "delete_range_space": memory_vectors.delete().where(in_range, t.vec_id.like(_p("space"))),
        "delete_scope": memory_vectors.delete().where(
            t.subject_ref == _p("ref"), t.scope == _p("scope")
        ),
        "drop": memory_vectors.delete().where(t.subject_ref == _p("ref")),
    }


def _write_order(row: Sequence[Any]) -> tuple[int, str, int, str]:
    """Rows as they were written: by version, memory, field number (numerically:
    field 10 after field 9), space."""
    base, _, space = str(row[0]).partition(_SPACE_SEP)
    _, _, n = base.rpartition("/")
    return int(row[4]), str(row[1]), int(n) if n.isdigit() else -1, space


class StagedVectors:
    """A vector write for a caller's catalog transaction (``VectorIndex.stage``):
    ``run`` its statements on the transaction's cursor, ``done`` once it committed."""

    __slots__ = ("_index", "_items", "_only", "_ref", "_replace", "run")

    def __init__(
        self,
        index: VectorIndex,
        ref: str,
        *,
        items: list[VectorItem],
        replace: set[str],
        only: str | None,
        rows: list[dict[str, Any]],
    ) -> None:
        self._index = index
        self._ref = ref
        self._items = items
        self._replace = replace
        self._only = only
        self.run: Callable[[Any], None] = index._statements_for(ref, replace, only, rows)

    def done(self) -> None:
        self._index._committed(self._ref, self._items, self._replace, self._only)

    def __repr__(self) -> str:
        return f"StagedVectors(ref={self._ref!r}, vectors={len(self._items)})"


# How far below the k-th float32 score a candidate may be and still tie with it in
# float64 (a float32 dot product of a few hundred terms is off by ~1e-7 relative).
_TIE_SLACK = 1e-5


def _exact_ties(
    matrix: np.ndarray[Any, Any],
    query: np.ndarray[Any, Any],
    best: dict[str, float],
    rows: dict[str, int],
    k: int,
) -> list[tuple[str, float]]:
    """The candidates rescored in float64 (their stored float32 vectors against the
    query), best first: the ``k`` best and every one scoring what the ``k``-th does.
    Equal vectors then score equally whichever subject's matrix they are in."""
    ids = list(best)
    at = np.fromiter((rows[m] for m in ids), np.intp, len(ids))
    exact = (matrix[at].astype(np.float64) @ query.astype(np.float64)).tolist()
    ranked = sorted(zip(ids, exact, strict=True), key=lambda t: -t[1])
    kth = ranked[min(k, len(ranked)) - 1][1]
    return [(m, float(s)) for m, s in ranked if s >= kth]
