"""What a memory row adds beside itself: its vectors and its catalog assets.

Embedding (one call per batch), registration of rows and their vectors as catalog
assets in one transaction, and the re-embedding of stale vectors that a semantic
search does before it ranks (``_repair``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

from keyshred.errors import KeyshredError
from keyshred.storage.catalog import ASSET_COLUMNS, AssetRow
from keyshred.storage.embeddings import Embedder
from keyshred.storage.memory_base import MemoryStoreBase
from keyshred.storage.memory_types import MEMORY_KIND, VECTOR_KIND, _storage_key, text_at
from keyshred.storage.partition import MemoryRow, Partition, from_us, row_key_id
from keyshred.storage.vectors import VectorIndex, VectorItem

__all__ = ["IndexMixin"]

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

    def _vector_store(self) -> VectorIndex:
        if self._vectors is None:
            raise KeyshredError("this store has no vector index")
        return self._vectors

    # -- indexing ----------------------------------------------------------------------

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
            also=also,
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
