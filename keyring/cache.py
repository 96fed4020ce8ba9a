"""A bounded, TTL'd, explicitly evictable in-process cache of unwrapped DEKs.

The cache is an erasure target: ``destroy`` evicts a subject's entries before it
returns, and the TTL bounds how long another process's copy can outlive a destroy
(reads are also refused earlier by the subject guard, which every process checks).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from keyshred.keyring.datakey import DataKey

__all__ = ["KeyCache"]


class KeyCache:
    """LRU by key id, with an owner index for the seal path's (holder, scope, owner
    set) lookup."""

    def __init__(
        self,
        max_entries: int = 10_000,
        ttl_seconds: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max = max(0, max_entries)
        self._ttl = ttl_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._by_id: OrderedDict[bytes, tuple[DataKey, float]] = OrderedDict()
        self._by_owner: dict[tuple[str, str, str], bytes] = {}
        self.hits = 0
        self.misses = 0

    def get(self, key_id: bytes) -> DataKey | None:
        with self._lock:
            entry = self._by_id.get(key_id)
            if entry is None:
                self.misses += 1
                return None
            key, expires = entry
            if expires <= self._clock():
                self._drop(key_id)
                self.misses += 1
                return None
            self._by_id.move_to_end(key_id)
            self.hits += 1
            return key

    def get_owner(self, subject_ref: str, scope: str, tag: str = "") -> DataKey | None:
        """The cached key of (holder, scope, owner set tag)."""
        key_id = self._by_owner.get((subject_ref, scope, tag))
        if key_id is None:
            return None
        with self._lock:  # ``get`` inline: this runs on every seal
            entry = self._by_id.get(key_id)
            if entry is not None and entry[1] > self._clock():
                self._by_id.move_to_end(key_id)
                self.hits += 1
                return entry[0]
        return self.get(key_id)  # gone or expired meanwhile: counted and dropped there

    def put(self, key: DataKey) -> None:
        if self._max == 0:
            return
        with self._lock:
            self._by_id[key.key_id] = (key, self._clock() + self._ttl)
            self._by_id.move_to_end(key.key_id)
            self._by_owner[(key.subject_ref, key.scope, key.owner_tag)] = key.key_id
            while len(self._by_id) > self._max:
                oldest = next(iter(self._by_id))
                self._drop(oldest)

    def _drop(self, key_id: bytes) -> None:
        entry = self._by_id.pop(key_id, None)
        if entry is not None:
            owner = (entry[0].subject_ref, entry[0].scope, entry[0].owner_tag)
            if self._by_owner.get(owner) == key_id:
                del self._by_owner[owner]

    def purge_expired(self) -> int:
        """Drop expired entries now, so their key material does not linger in memory."""
        with self._lock:
            now = self._clock()
            doomed = [kid for kid, (_, expires) in self._by_id.items() if expires <= now]
            for kid in doomed:
                self._drop(kid)
            return len(doomed)

    def evict(self, key_ids: Iterable[bytes]) -> int:
        with self._lock:
            n = 0
            for key_id in key_ids:
                if key_id in self._by_id:
                    self._drop(key_id)
                    n += 1
            return n

    def evict_subject(self, subject_ref: str, scope: str | None = None) -> int:
        with self._lock:
            doomed = [
                kid
                for kid, (key, _) in self._by_id.items()
                if key.subject_ref == subject_ref and (scope is None or key.scope == scope)
            ]
            for kid in doomed:
                self._drop(kid)
            return len(doomed)

    def clear(self) -> None:
        with self._lock:
            self._by_id.clear()
            self._by_owner.clear()

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, key_id: object) -> bool:
        return key_id in self._by_id

    def __repr__(self) -> str:
        return f"KeyCache(entries={len(self._by_id)}, max={self._max}, ttl={self._ttl})"
