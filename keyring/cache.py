"""A bounded, TTL'd, explicitly evictable in-process cache of unwrapped DEKs.

The cache is an erasure target: ``destroy`` evicts a subject's entries before it
returns; in every other process the suppression's eviction event does
(``evict_owner``, through ``Keyring.evict_subject``), and the TTL bounds what a
missed event leaves: the handle's janitor calls ``purge_expired`` on a schedule, so
an expired key leaves memory whether or not anyone asks for it again.

A key is evicted by *owner*, not only by holder: a memory of A that mentions B is
sealed under a key A holds and B co-owns, and B's erasure must take it from every
cache. The cache keeps each shared key's other owners when the keyring knew them
(the seal path names them); a shared key unwrapped by id (a read) has them unknown,
and ``evict_owner`` hands those back for the keyring to look up.
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
    set) lookup, and indexes by holder and co-owner so that an erasure's evictions
    cost what the subject has cached, not a pass over every cached key (a pass over
    10,000 entries, three times per erasure, was most of why time to crypto-erased
    grew with the number of subjects)."""

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
        # A shared key's other owners as subject_refs (a ``ref@scope`` owner is its
        # subject's too); absent: unknown (unwrapped by id), or a scope key.
        self._owners: dict[bytes, frozenset[str]] = {}
        # Key ids by holder, and by known co-owner; shared keys whose owners are
        # unknown (``evict_owner`` hands them all back to be looked up).
        self._held: dict[str, set[bytes]] = {}
        self._co: dict[str, set[bytes]] = {}
        self._unknown: set[bytes] = set()
        self.hits = 0
        self.misses = 0
        # Bumped by every eviction (not by expiry or the LRU): a load that read its key
        # record before one caches nothing (``put(since=…)``), so a read in flight
        # while another process erased the subject cannot put its key back.
        self.evictions = 0

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

    def put(
        self, key: DataKey, owners: Iterable[str] | None = None, *, since: int | None = None
    ) -> None:
        """Cache ``key``; ``owners`` are a shared key's other owners (owner tokens,
        ``ref`` or ``ref@scope``) when known. With ``since`` (``evictions`` read
        before the key's record was), nothing is cached if an eviction came between."""
        if self._max == 0:
            return
        with self._lock:
            if since is not None and since != self.evictions:
                return
            self._by_id[key.key_id] = (key, self._clock() + self._ttl)
            self._by_id.move_to_end(key.key_id)
            self._by_owner[(key.subject_ref, key.scope, key.owner_tag)] = key.key_id
            self._held.setdefault(key.subject_ref, set()).add(key.key_id)
            if key.owner_tag and owners is not None:
                self._set_owners(key.key_id, _subjects(owners))
            elif key.owner_tag and key.key_id not in self._owners:
                self._unknown.add(key.key_id)
            while len(self._by_id) > self._max:
                oldest = next(iter(self._by_id))
                self._drop(oldest)

    def _set_owners(self, key_id: bytes, owners: frozenset[str]) -> None:
        self._unset_owners(key_id)
        self._owners[key_id] = owners
        for ref in owners:
            self._co.setdefault(ref, set()).add(key_id)

    def _unset_owners(self, key_id: bytes) -> None:
        self._unknown.discard(key_id)
        for ref in self._owners.pop(key_id, ()):
            ids = self._co.get(ref)
            if ids is not None:
                ids.discard(key_id)
                if not ids:
                    del self._co[ref]

    def _drop(self, key_id: bytes) -> None:
        entry = self._by_id.pop(key_id, None)
        self._unset_owners(key_id)
        if entry is not None:
            key = entry[0]
            owner = (key.subject_ref, key.scope, key.owner_tag)
            if self._by_owner.get(owner) == key_id:
                del self._by_owner[owner]
            ids = self._held.get(key.subject_ref)
            if ids is not None:
                ids.discard(key_id)
                if not ids:
                    del self._held[key.subject_ref]

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
            self.evictions += 1
            n = 0
            for key_id in key_ids:
                if key_id in self._by_id:
                    self._drop(key_id)
                    n += 1
            return n

    def evict_subject(self, subject_ref: str, scope: str | None = None) -> int:
        with self._lock:
            self.evictions += 1
            doomed = [
                kid
                for kid in self._held.get(subject_ref, ())
                if scope is None or self._by_id[kid][0].scope == scope
            ]
            for kid in doomed:
                self._drop(kid)
            return len(doomed)

    def evict_owner(self, subject_ref: str) -> tuple[set[str], list[bytes]]:
        """Evict every key the subject holds or is known to co-own; returns the
        holders of the co-owned keys that went (their cached rows were decrypted
        with them) and the ids of cached shared keys whose owners are unknown (the
        caller looks them up: ``Keyring.evict_subject``)."""
        with self._lock:
            self.evictions += 1
            own = self._held.get(subject_ref, set())
            co = self._co.get(subject_ref, set()) - own
            holders = {self._by_id[kid][0].subject_ref for kid in co}
            unknown = [kid for kid in self._unknown if kid not in own]
            for kid in [*own, *co]:
                self._drop(kid)
            return holders, unknown

    def evict_shared(self, key_ids: Iterable[bytes]) -> set[str]:
        """Evict these keys; returns their holders."""
        with self._lock:
            self.evictions += 1
            holders = set()
            for key_id in key_ids:
                entry = self._by_id.get(key_id)
                if entry is not None:
                    holders.add(entry[0].subject_ref)
                    self._drop(key_id)
            return holders

    def learn_owners(self, key_id: bytes, owners: Iterable[str]) -> None:
        """Record a cached shared key's other owners (owner tokens), looked up."""
        with self._lock:
            entry = self._by_id.get(key_id)
            if entry is not None and entry[0].owner_tag:  # a scope key has no co-owners
                self._set_owners(key_id, _subjects(owners))

    def held(self, subject_ref: str) -> int:
        """How many cached keys the subject holds or is known to co-own (tests and
        drills ask this to see that an eviction happened; no key leaves)."""
        with self._lock:
            return len(self._held.get(subject_ref, set()) | self._co.get(subject_ref, set()))

    def clear(self) -> None:
        with self._lock:
            self.evictions += 1
            self._by_id.clear()
            self._by_owner.clear()
            self._owners.clear()
            self._held.clear()
            self._co.clear()
            self._unknown.clear()

    @property
    def capacity(self) -> int:
        """How many keys the cache holds at most."""
        return self._max

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, key_id: object) -> bool:
        return key_id in self._by_id

    def __repr__(self) -> str:
        return f"KeyCache(entries={len(self._by_id)}, max={self._max}, ttl={self._ttl})"


def _subjects(owners: Iterable[str]) -> frozenset[str]:
    """The subject_refs of owner tokens (``ref`` or ``ref@scope``: a subject's
    erasure takes both; ``keyring.keystore.owner_token``)."""
    return frozenset(o.split("@", 1)[0] for o in owners)
