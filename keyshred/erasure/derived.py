"""Derived assets (``ks.derived``) and their erasure (``DerivedStore``).

A derived asset (a summary, a fact, an edge) is a memory of its owner with
provenance: the assets it was produced from and the producer (name, version) that
made it. Erasing any source rebuilds it from the remaining sources with the
rebuild function registered for that producer and version, or drops it when the
function returns ``None`` or no source remains.

Rebuild functions are code: they live in the application, not in the data folder,
and a restarted process knows them only if the application registers them again.
Three ways, looked up in this order:

- ``ks.derived.register_producer(name, version, fn)`` (or ``rebuild=`` on
  ``ks.derived.register``), for this handle;
- ``keyshred.erasure.register_rebuilder(name, version, fn)``, the process-wide
  registry an application fills at start-up (for every handle it opens);
- the entry point group ``keyshred.rebuilders``: an entry point named
  ``"<producer>:<version>"`` whose object is the function, so an installed package
  provides its producers' rebuilders without any start-up code.

A derived asset whose producer is known by none of them is never silently dropped:
the erasure stops with ``ProducerUnknown`` and waits in ``manual_review`` (naming
the producer and version) until one is registered, then ``resume`` completes it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from importlib.metadata import entry_points
from typing import Any, Protocol

from keyshred.erasure.requests import ProducerUnknown, iso, safe
from keyshred.errors import InvalidInput, SubjectSuppressed
from keyshred.storage import faults
from keyshred.storage.catalog import AssetRow, Catalog
from keyshred.storage.erasable import REBUILD, ErasureTarget, Phase, StoreCheck, StoreErasure
from keyshred.storage.memories import Memory, MemoryStore, PutItem

__all__ = [
    "ENTRY_POINT_GROUP",
    "DerivedApi",
    "DerivedStore",
    "Rebuild",
    "register_rebuilder",
    "registered_rebuilder",
]

ENTRY_POINT_GROUP = "keyshred.rebuilders"
Rebuild = Callable[[list[Memory]], Any]

# Widths of the catalog's ``ks_assets`` columns (keyshred/storage/schema.py).
_KIND_PREFIX = "derived:"
_KIND_WIDTH = 32
_VERSION_WIDTH = 64

_registry: dict[tuple[str, str], Rebuild] = {}
_registry_lock = threading.Lock()


def register_rebuilder(producer: str, version: str, rebuild: Rebuild) -> None:
    """Register, for every handle of this process, how ``producer`` at ``version``
    rebuilds its output from the remaining source memories (``None`` drops the
    derived asset instead). Call it at application start-up."""
    key = (safe("producer", producer), safe("producer version", version))
    with _registry_lock:
        _registry[key] = rebuild


def registered_rebuilder(producer: str, version: str) -> Rebuild | None:
    """The start-up registry's function, else the ``keyshred.rebuilders`` entry
    point named ``"<producer>:<version>"`` (loaded once), else ``None``."""
    with _registry_lock:
        found = _registry.get((producer, version))
    if found is not None:
        return found
    for ep in entry_points(group=ENTRY_POINT_GROUP, name=f"{producer}:{version}"):
        loaded: Rebuild = ep.load()
        with _registry_lock:
            _registry.setdefault((producer, version), loaded)
        return loaded
    return None


class _Audit(Protocol):
    def record(self, event: str, **fields: Any) -> Any: ...


class DerivedApi:
    """``ks.derived``: assets derived from other assets, with how to rebuild them."""

    def __init__(
        self,
        memories: MemoryStore,
        catalog: Catalog,
        audit: _Audit,
        subject_ref: Callable[[Any], str],
    ) -> None:
        self._memories = memories
        self._catalog = catalog
        self._audit = audit
        self._ref = subject_ref
        self._rebuilders: dict[tuple[str, str], Rebuild] = {}

    def register_producer(self, producer: str, version: str, rebuild: Rebuild) -> None:
        """How ``producer`` at ``version`` rebuilds its output from the remaining
        source memories; returning ``None`` drops the derived asset instead."""
        self._rebuilders[(safe("producer", producer), safe("producer version", version))] = rebuild

    def copy_producers(self, other: DerivedApi) -> None:
        """Take over another store's rebuild functions (a restore's tombstone replay
        rebuilds derived assets the way the live erasure did)."""
        self._rebuilders.update(other._rebuilders)

    def rebuilder(self, producer: str | None, version: str | None) -> Rebuild | None:
        """This handle's function, else the process registry's or an entry point's."""
        if producer is None or version is None:
            return None
        own = self._rebuilders.get((producer, version))
        return own if own is not None else registered_rebuilder(producer, version)

    def register(
        self,
        kind: str,
        *,
        subject: Any,
        namespace: Sequence[str] | str,
        key: str,
        value: Any,
        produced_from: Sequence[str],
        producer: str,
        producer_version: str,
        rebuild: Rebuild | None = None,
        mentions: Iterable[Any] = (),
        scope: str = "default",
        index: bool | Sequence[str] | None = None,
    ) -> Memory:
        """Store a derived asset (a summary, a fact, an edge) as a memory of
        ``subject`` with its provenance; erasing any source rebuilds it."""
        # Everything is checked before the first write: a refusal writes nothing.
        safe("kind", kind)
        safe("producer", producer)
        safe("producer version", producer_version)
        # The catalog's columns (PostgreSQL refuses a longer value only at the
        # insert, with a driver error; SQLite stores it): kind is String(32) with
        # "derived:" before it, producer_version String(64).
        if len(_KIND_PREFIX) + len(kind) > _KIND_WIDTH:
            raise InvalidInput(f"kind is at most {_KIND_WIDTH - len(_KIND_PREFIX)} characters")
        if len(producer_version) > _VERSION_WIDTH:
            raise InvalidInput(f"producer version is at most {_VERSION_WIDTH} characters")
        # Materialized once: an iterator would be used up by the write, leaving the
        # audit event (and the caller) a different list than the one stored.
        if not isinstance(produced_from, list | tuple) or not all(
            isinstance(s, str) for s in produced_from
        ):
            raise InvalidInput("produced_from is a list of asset ids")
        sources = list(produced_from)
        if rebuild is not None and not callable(rebuild):
            raise InvalidInput("rebuild is a function of the remaining source memories")
        if isinstance(mentions, str) or not isinstance(mentions, Iterable):
            raise InvalidInput("mentions is a list of subjects")
        item = PutItem(namespace, key, value, scope, None, None, sources, tuple(mentions), index)
        memory = self._memories.put_derived(
            subject, item, (f"{_KIND_PREFIX}{kind}", producer, producer_version)
        )
        ref = self._ref(subject)
        self._audit.record(
            "derived.registered",
            subject_ref=ref,
            asset_id=memory.memory_id,
            kind=kind,
            producer=producer,
            producer_version=producer_version,
            sources=len(sources),
        )
        # Only once the asset is stored: a refused write (a suppressed subject, bad
        # input) changes nothing, not even which producers this handle knows.
        if rebuild is not None:
            self.register_producer(producer, producer_version, rebuild)
        return memory


class DerivedStore:
    """Other holders' derived assets built from what an erasure removes, as an
    erasable store: each is rebuilt from its remaining sources with its pinned
    producer version, or dropped. Runs after the catalog rows of the erased
    assets are gone (``REBUILD`` phase), one asset at a time, each recorded."""

    name = "derived"
    phase: Phase = REBUILD

    def __init__(self, catalog: Catalog, memories: MemoryStore, producers: DerivedApi) -> None:
        self._catalog = catalog
        self._memories = memories
        self._producers = producers

    def erase(self, target: ErasureTarget) -> StoreErasure:
        erased = set(target.erased)
        done: list[Mapping[str, Any]] = list(target.done)
        handled = {d["asset_id"] for d in done}
        for asset_id in target.closure:
            if asset_id in handled:
                continue
            asset = self._catalog.asset(asset_id)
            if asset is None:
                continue  # already gone (dropped earlier, or erased with its owner)
            action = self._rebuild_one(target, asset, erased)
            if action is not None:
                done.append(action)
                if target.record is not None:
                    target.record(done)
                faults.reached("erase.derived")
                if action["action"] == "dropped":
                    erased.add(asset_id)
        return StoreErasure(
            self.name,
            "rebuilt-or-dropped",
            len(done),
            datetime.now(UTC),
            items=tuple(done),
            found=bool(done),
        )

    def _rebuild_one(
        self, target: ErasureTarget, asset: AssetRow, erased: set[str]
    ) -> dict[str, Any] | None:
        owner = asset.subject_ref
        if owner == target.subject_ref and target.whole_subject:
            return None  # the subject's own derived assets go with it
        try:
            self._catalog.check_guard(owner)
        except SubjectSuppressed:
            return None  # its owner is being erased too; that erasure takes it
        # A source its holder deleted does not remain either: the catalog no longer
        # holds it. Counted, it made the rebuild function run on no source at all
        # (an asset rebuilt from nothing, where the promise is "dropped when no
        # source remains"), or wait in manual_review for a producer with nothing left.
        remaining = [
            s for s in asset.sources if s not in erased and self._catalog.asset(s) is not None
        ]
        mentions = [
            m for m in asset.mentions if m != target.subject_ref or target.scope is not None
        ]
        rebuild = self._producers.rebuilder(asset.producer, asset.producer_version)
        memories = self._memories
        # Opaque too: its shared key went with the subject's; rebuilt (sealed under
        # the key of its remaining owners) or dropped like a readable one.
        row = memories.rows_by_id(owner, [asset.asset_id], opaque=True).get(asset.asset_id)
        if row is None:
            return None
        if rebuild is None and remaining and asset.producer is not None:
            raise ProducerUnknown(
                f"derived asset {asset.asset_id}: no rebuild function registered for "
                f"producer {asset.producer} version {asset.producer_version}; register "
                "it (ks.derived.register_producer or keyshred.erasure.register_rebuilder) "
                "and resume the request"
            )
        base = {
            "asset_id": asset.asset_id,
            "kind": asset.kind,
            "owner_subject_ref": owner,
            "producer": asset.producer,
            "producer_version": asset.producer_version,
            "at": iso(datetime.now(UTC)),
        }
        value = None
        if rebuild is not None and remaining:
            value = rebuild(self._source_memories(remaining))
        if value is None:
            memories.delete_by_id(owner, asset.asset_id)
            return {**base, "action": "dropped"}
        produced_by = (asset.kind, asset.producer, asset.producer_version)
        try:
            memories.rebuild(
                owner, row, value, sources=remaining, mentions=mentions, produced_by=produced_by
            )
        except SubjectSuppressed:
            # Another subject it is about (a mention, a source's owner) is being
            # erased at the same time: no new copy is made under a key that erasure
            # may already have passed. Dropped, the safe way (the owner was checked
            # above, so it is not the holder that is refused).
            memories.delete_by_id(owner, asset.asset_id)
            return {**base, "action": "dropped"}
        return {**base, "action": "rebuilt"}

    def _source_memories(self, ids: Sequence[str]) -> list[Memory]:
        by_owner: dict[str, list[str]] = {}
        for asset_id in ids:
            a = self._catalog.asset(asset_id)
            if a is not None:
                by_owner.setdefault(a.subject_ref, []).append(asset_id)
        out: list[Memory] = []
        for owner, owned in by_owner.items():
            try:
                self._catalog.check_guard(owner)
            except SubjectSuppressed:
                continue
            rows = self._memories.rows_by_id(owner, owned)
            out += [self._memories.memory(rows[i]) for i in owned if i in rows]
        return out

    def verify(self, target: ErasureTarget) -> list[StoreCheck]:
        still = self._catalog.any_source_in(list(target.erased))
        return [StoreCheck("no provenance points at erased assets", not still, f"{still} edges")]

    def evict(self, subject_ref: str) -> None:
        """Nothing cached here: derived assets are memories (``MemoryStore.evict``)."""
        del subject_ref
