"""What a memory row adds beside itself: its vectors and its catalog assets.

Embedding (one call per batch), registration of rows and their vectors as catalog
assets in one transaction, and the re-embedding of stale vectors that a semantic
search does before it ranks (``_repair``).

Embedding spaces (``keyshred.storage.vectors``): a write or a search names the
embedder it uses (``embedder=``; ``None`` is the handle's own, the default space).
A row records which fields are indexed (``row.index``), not by which function: the
row is the source, and each space's vectors are derived from it by that space's
embedder. A write embeds in its own space and removes what other spaces held of the
memory (embedded from a value it no longer has); a search in space S first embeds,
with S's embedder, the candidates S has no current vectors of (``_repair``). So an
update, a correction or an erasure's rebuild through the handle leaves other spaces
to re-embed on their next search, and no space ever holds another's vectors.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

from keyshred.errors import InvalidInput, KeyshredError
from keyshred.storage.catalog import ASSET_COLUMNS, AssetRow
from keyshred.storage.embeddings import Embedder
from keyshred.storage.memory_base import MemoryStoreBase
from keyshred.storage.memory_types import (
    MEMORY_KIND,
    VECTOR_KIND,
    ProducedBy,
    _storage_key,
    text_at,
)
from keyshred.storage.partition import MemoryRow, Partition, from_us, row_key_id, to_us
from keyshred.storage.vectors import DEFAULT_SPACE, VectorIndex, VectorItem, space_tag

# One memory's embedded texts: (field label, vector), in field order. A path gives
# one vector (labelled by the path), several (``path.0``, ``path.1``: an embedder
# whose ``texts`` finds several) or none.
Embedded = list[tuple[str, Any]]

__all__ = ["IndexMixin"]

_CHECKS_KEPT = 4096  # subjects and spaces whose last vector check is remembered

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
    raise ImportError("keyshred.storage.memory_index does not match the ks_assets columns")


def _same_origin(a: Embedder, b: Embedder) -> bool:
    """Whether two embedders wrap the same function (a provider string by value)."""
    x, y = a.origin, b.origin
    return x is y or (isinstance(x, str) and x == y)


class IndexMixin(MemoryStoreBase):
    """Embeddings, vectors and catalog registration of memory rows."""

    # -- embeddings --------------------------------------------------------------------

    @property
    def embedder(self) -> Embedder:
        """The embedding function (the default model is loaded on first use)."""
        if self._embedder is None:
            if self._embedder_factory is None:
                raise KeyshredError("this store has no embedding function")
            self._embedder = self._embedder_factory()
        return self._embedder

    def _space(self, embedder: Embedder | None) -> tuple[Embedder, str]:
        """The embedder to use and the tag of its space. ``None`` (or the handle's
        own) is the default space; another embedder names its space, and only one
        wrapping the handle's own function may claim the default space."""
        if embedder is None:
            return self.embedder, DEFAULT_SPACE
        if not isinstance(embedder, Embedder):
            raise InvalidInput("embedder is a keyshred.storage.embeddings.Embedder")
        if embedder is self._embedder:
            return embedder, DEFAULT_SPACE
        if embedder.space is None:
            raise InvalidInput(
                "an embedder other than the handle's names its embedding space "
                "(Embedder(..., space='model-name'))"
            )
        if embedder.space == DEFAULT_SPACE:
            own = self.embedder
            if own.source is None or not _same_origin(embedder, own):
                raise InvalidInput(
                    "only the handle's own embedding function writes the default space"
                )
            if embedder.dims is not None and own.dims is not None and embedder.dims != own.dims:
                raise InvalidInput(
                    f"the handle's embeddings have {own.dims} dimensions, not {embedder.dims}"
                )
            return embedder, DEFAULT_SPACE
        if embedder.dims is None:
            raise InvalidInput("an embedding space has fixed dims (Embedder(..., dims=N))")
        tag = space_tag(embedder.space, embedder.dims)
        with self._lock:
            known = self._spaces.setdefault(tag, embedder)
        if known is not embedder and not _same_origin(known, embedder):
            # Two functions under one name would put incomparable vectors side by
            # side; the same function wrapped twice (two stores) is fine.
            raise InvalidInput(
                f"embedding space {embedder.space!r} is already used by another embedding "
                "function on this handle: name each function's space differently"
            )
        return embedder, tag

    def _vector_store(self) -> VectorIndex:
        if self._vectors is None:
            raise KeyshredError("this store has no vector index")
        return self._vectors

    # -- indexing ----------------------------------------------------------------------

    @staticmethod
    def _texts(embedder: Embedder, value: Any, paths: Sequence[str]) -> list[tuple[str, str]]:
        """(field label, text) for every text the paths of a value give."""
        out: list[tuple[str, str]] = []
        for path in paths:
            if embedder.texts is None:
                out.append((path, text_at(value, path)))
                continue
            texts = embedder.texts(value, path)
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise InvalidInput("an embedder's texts are a list of strings")
            if len(texts) == 1:
                out.append((path, texts[0]))
            else:  # (LangGraph's labels for a path that gives several texts)
                out += [(f"{path}.{i}", text) for i, text in enumerate(texts)]
        return out

    def _embed_rows(
        self,
        prepared: Sequence[tuple[Any, ...]],
        fields: Sequence[tuple[str, ...]],
        embedder: Embedder,
    ) -> list[Embedded]:
        """One embedding call for every text of every item of the batch (each
        distinct text once)."""
        labelled: list[list[tuple[str, str]]] = []
        for (_, _, raw, *_), paths in zip(prepared, fields, strict=True):
            labelled.append(self._texts(embedder, json.loads(raw), paths) if paths else [])
        return self._embed_labelled(labelled, embedder)

    def _embed_labelled(
        self, labelled: Sequence[Sequence[tuple[str, str]]], embedder: Embedder
    ) -> list[Embedded]:
        unique: dict[str, int] = {}
        for texts in labelled:
            for _, text in texts:
                unique.setdefault(text, len(unique))
        if not unique:
            return [[] for _ in labelled]
        matrix = embedder.embed(list(unique))
        return [[(label, matrix[unique[text]]) for label, text in texts] for texts in labelled]

    def _embed_one(self, raw: bytes, paths: tuple[str, ...], embedder: Embedder) -> Embedded:
        if not paths:
            return []
        return self._embed_labelled([self._texts(embedder, json.loads(raw), paths)], embedder)[0]

    def _register_rows(
        self,
        ref: str,
        rows: Sequence[MemoryRow],
        *,
        expected_epoch: int,
        replace: bool,
        remove: Sequence[str],
        produced_by: ProducedBy | None = None,
        detected: Sequence[tuple[str, str]] = (),
        also: Callable[[Any], None] | None = None,
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
        plain = (MEMORY_KIND, None, None)

        def made_by(r: MemoryRow) -> tuple[str, str | None, str | None]:
            # One (kind, producer, version) for the batch, or per (namespace, key):
            # a correction's old version is a plain memory, its new value derived.
            if isinstance(produced_by, Mapping):
                return produced_by.get((r.namespace, r.key)) or plain
            return produced_by or plain

        params = [
            (
                r.memory_id,
                ref,
                r.scope,
                made_by(r)[0],
                "parquet",
                storage_key,
                r.purpose,
                r.category,
                db_time(r.created_us),
                db_time(r.retain_us),
                "live",
                r.lookup,
                made_by(r)[1],
                made_by(r)[2],
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
            also=also,
        )

    def _vector_asset(
        self, ref: str, row: MemoryRow, n: int, times: dict[int, datetime]
    ) -> AssetRow:
        return replace(
            self._asset(ref, row, times),
            asset_id=f"{row.memory_id}/{n}",
            kind=VECTOR_KIND,
            storage_system="catalog",
            storage_key=f"ks_mem_vectors/{ref}",
            lookup=None,
            sources=(row.memory_id,),
            mentions=(),
        )

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

    def _fresh_vectors(
        self,
        ref: str,
        part: Partition,
        vectors: VectorIndex,
        *,
        embedder: Embedder,
        space: str,
        hidden: frozenset[str],
    ) -> None:
        """Make the subject's vectors in ``space`` match its memories (``_repair``),
        looking only at what changed since the last check: the partition lists the
        memory ids written or removed since it was loaded (``Partition.changed``),
        and a check is remembered with the partition's generation and the vector
        cache entry it was made against (a weak reference: remembering it keeps no
        decrypted vector alive). Anything else (a reload of either, another
        process's write, a suppressed scope) checks every memory, once."""
        key = (ref, space)
        entry, _ = vectors.version_map(ref, space)
        memo = self._vector_checks.get(key)
        since: int | None = None
        if memo is not None and not hidden and entry is not None:
            generation, seen, position = memo
            if generation == part.generation and seen() is entry:
                since = position
        by_id = part.by_id
        if since is None:
            rows: Iterable[MemoryRow] = by_id.values()
        else:
            changed = dict.fromkeys(part.changed[since:])
            rows = [by_id[m] for m in changed if m in by_id]
        now_us = to_us(self._clock())
        todo = {
            r.memory_id: r
            for r in rows
            if r.index
            and r.scope not in hidden
            and r.retain_us > now_us
            and not r.namespace[0].startswith("~")
        }
        if todo:
            self._repair(ref, part, todo, vectors, embedder=embedder, space=space)
        entry, _ = vectors.version_map(ref, space)
        if hidden or entry is None:
            self._vector_checks.pop(key, None)
            return
        self._vector_checks[key] = (part.generation, weakref.ref(entry), len(part.changed))
        while len(self._vector_checks) > _CHECKS_KEPT:
            self._vector_checks.pop(next(iter(self._vector_checks)))

    def _repair(
        self,
        ref: str,
        part: Partition,
        indexed: dict[str, MemoryRow],
        vectors: VectorIndex,
        *,
        embedder: Embedder,
        space: str = DEFAULT_SPACE,
    ) -> None:
        """Embed, in ``space``, indexed memories whose vectors there are missing or
        stale: embedded from another version of the memory than the row's
        (``updated_us``). A kill between an update's log append and its vector write
        leaves the old value's vectors; so does a failed write rolled back after its
        vectors were replaced, and a write through another space (it removed this
        space's vectors of the memory). Searching them would rank the memory by a
        meaning it no longer has. Other spaces' vectors are left as they are."""
        _, versions = vectors.version_map(ref, space)
        missing = [r for mid, r in indexed.items() if versions.get(mid) != r.updated_us]
        if not missing:
            return
        # Texts first, outside the lock: a memory whose paths give no text (an
        # embedder that skips missing fields) has no vector to make, and must not
        # take the lock on every search.
        labelled = [self._texts(embedder, json.loads(r.value), r.index) for r in missing]
        todo = [
            (r, texts)
            for r, texts in zip(missing, labelled, strict=True)
            if texts or r.memory_id in versions
        ]
        if not todo:
            return
        with part.flocked():
            embedded = self._embed_labelled([texts for _, texts in todo], embedder)
            items = [
                # Stamped with the row's version, which they are now embedded from,
                # and sealed under the row's own (owner-set) key.
                VectorItem(r.memory_id, i, f, r.scope, r.updated_us, vec, row_key_id(r), space)
                for (r, _), vecs in zip(todo, embedded, strict=True)
                for i, (f, vec) in enumerate(vecs)
            ]
            vectors.upsert(ref, items, replace=[r.memory_id for r, _ in todo], only=space)
            times: dict[int, datetime] = {}
            self._catalog.register(
                [self._vector_asset(ref, r, i, times) for r, _ in todo for i in range(len(r.index))]
            )
