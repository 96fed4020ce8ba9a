"""The memory store: per-subject, encrypted, consent-checked, catalogued memories.

Every call follows the data path of DESIGN.md: the subject guard first (a suppressed
or erased subject fails before any key is touched), then consent and retention for
writes, then the subject's partition. Namespaces and keys are personal data: they are
stored only encrypted, and found through a keyed hash under the subject's index key.

``MemoryStore`` is assembled from modules of one job each (mixins over one base):

- ``memory_types``: what callers give and get (``Memory``, ``PutItem``,
  ``RepairReport``, ``text_at``) and the checks of names and batch items;
- ``memory_base``: the store's state and its cache of open partitions, each checked
  against the catalog as it loads;
- ``memory_index``: a row's vectors and catalog assets (embedding, registration);
- ``memory_write``: ``put`` / ``put_many`` and the one write path under them;
- ``memory_edit``: ``update``, ``correct``, ``touch``, ``rebuild``;
- ``memory_read``: ``get``, ``search``, ``history`` and the reads by subject_ref;
- ``memory_erase``: deletion, the retention sweep and the ``Erasable`` interface;
- ``memory_repair``: ``repair`` of a partition against the catalog;
- this module: ``MemoryStore`` itself, the partition lock it lends other stores
  (``locked``, ``first_key``), a backup's freeze, ``flush`` and ``close``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from keyshred.errors import KeyNotFound, SubjectErased
from keyshred.keyring.datakey import DataKey
from keyshred.storage.catalog import ACTIVE
from keyshred.storage.memory_edit import EditMixin
from keyshred.storage.memory_repair import RepairMixin
from keyshred.storage.memory_types import Memory, PutItem, RepairReport, text_at

__all__ = ["Memory", "MemoryStore", "PutItem", "RepairReport", "text_at"]


class MemoryStore(EditMixin, RepairMixin):
    """``ks.memories``: put, get, search, update, delete."""

    # -- locks -------------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self, ref: str, *, compact: bool = False) -> Iterator[None]:
        """Hold the subject's partition lock (without loading it). ``compact``: load
        and compact the partition first, so that no scope's segment or hot row
        holds a version a row of another scope superseded (a memory that moved
        scope). A scope erasure destroys the scope's key under this lock: once its
        rows are unreadable, nothing would say that the old version was replaced,
        and the next load read it back as the memory."""
        part = self._partition(ref)
        with part.flocked(refresh=compact):
            if compact:
                part.flush()
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

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """Hold every partition write of the data folder off (a backup's snapshot)."""
        with self._freeze.exclusive():
            yield

    # -- maintenance -------------------------------------------------------------------

    def flush(self, subject: Any = None) -> None:
        """Compact logged writes (one subject, or every open one): into Parquet
        segments, or, for a partition of at most ``inline_max_rows`` memories, into
        one catalog record per scope."""
        if subject is None:
            with self._lock:
                parts = list(self._partitions.values())
        else:
            parts = [self._partition(self._ref(subject))]
        for part in parts:
            with part.flocked():
                part.flush()

    def partition_rows(self, ref: str) -> tuple[int, int, int]:
        """(heads, hot records, segment rows) the catalog holds for the subject: a
        partition compacted into the catalog is there and not in any object."""
        return self._hot.counts(ref)

    def purge_superseded(self, ref: str) -> None:
        """Rewrite ``ref``'s partition without the values its rows superseded (log
        records and old segments go at once): an erasure that destroyed no key
        (retention, a scope) has the old values of the assets it rebuilt, or that
        their holders rewrote meanwhile, leave the files."""
        part = self._partition(ref)
        with part.flocked():
            part.flush(purge=True)

    def close(self, *, flush: bool = True) -> None:
        """Close every partition, first compacting logged writes (``flush``) unless
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
        self._locks.close()
        self._hot.close()
