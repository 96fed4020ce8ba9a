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

from keyshred.erasure.requests import ProducerUnknown, RebuildFailed, iso, safe
from keyshred.erasure.steps import sources_first
from keyshred.errors import (
    BackendUnavailable,
    ConsentRequired,
    InvalidInput,
    KeyNotFound,
    SubjectErased,
    SubjectSuppressed,
)
from keyshred.storage import faults
from keyshred.storage.catalog import AssetRow, Catalog
from keyshred.storage.erasable import REBUILD, ErasureTarget, Phase, StoreCheck, StoreErasure
from keyshred.storage.memories import Memory, MemoryStore, PutItem
from keyshred.storage.memory_types import Changed
from keyshred.storage.rowcodec import MemoryRow

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

_ATTEMPTS = 20  # rebuilds of one asset its holder keeps rewriting meanwhile

_registry: dict[tuple[str, str], Rebuild] = {}
_registry_lock = threading.Lock()


def register_rebuilder(producer: str, version: str, rebuild: Rebuild) -> None:
    """Register, for every handle of this process, how ``producer`` at ``version``
    rebuilds its output from the remaining source memories (``None`` drops the
    derived asset instead). Call it at application start-up."""
    key = (safe("producer", producer), safe("producer version", version))
    with _registry_lock:
        _registry[key] = rebuild


class _EntryPoints:
    """The ``keyshred.rebuilders`` entry points as installed at the first lookup.
    Listing them reads every installed distribution's metadata (~20 ms with 175
    installed): once per derived step, not once per asset. A step that starts
    after a package was installed (the ``resume`` of a request waiting for its
    producer) sees it."""

    def __init__(self) -> None:
        self._by_name: dict[str, Any] | None = None

    def named(self, name: str) -> list[Any]:
        if self._by_name is None:
            self._by_name = {}
            for ep in entry_points(group=ENTRY_POINT_GROUP):
                self._by_name.setdefault(ep.name, ep)
        found = self._by_name.get(name)
        return [] if found is None else [found]


def registered_rebuilder(producer: str, version: str) -> Rebuild | None:
    """The start-up registry's function, else the ``keyshred.rebuilders`` entry
    point named ``"<producer>:<version>"`` (loaded once), else ``None``."""
    return _registered(producer, version, None)


def _registered(producer: str, version: str, snapshot: _EntryPoints | None) -> Rebuild | None:
    """``registered_rebuilder``, the entry point looked up in ``snapshot`` when
    given, else among those installed now."""
    with _registry_lock:
        found = _registry.get((producer, version))
    if found is not None:
        return found
    name = f"{producer}:{version}"
    eps = (
        snapshot.named(name)
        if snapshot is not None
        else entry_points(group=ENTRY_POINT_GROUP, name=name)
    )
    for ep in eps:
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
        return self._rebuilder(producer, version, None)

    def _rebuilder(
        self, producer: str | None, version: str | None, snapshot: _EntryPoints | None
    ) -> Rebuild | None:
        if producer is None or version is None:
            return None
        own = self._rebuilders.get((producer, version))
        return own if own is not None else _registered(producer, version, snapshot)

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
        sources = list(dict.fromkeys(produced_from))  # one edge per source, as stored
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
    assets are gone (``REBUILD`` phase), one asset at a time, each recorded.

    What is done to an asset is decided from its row as it is *now*, never from
    what the closure step saw: the step may run long after the closure was listed
    (a request waiting in ``manual_review`` for a producer, a worker SIGKILLed and
    resumed later), and meanwhile the holder may have written a memory of their own
    at the asset's name, which keeps the asset id. A row that no longer touches the
    erasure (``_touches``) is left alone: it holds nothing of the subject. Assets
    derived from the closure or from the erased assets since the closure was
    listed (a retention request destroys no key: what it removes stays readable
    while it waits) are found by walking the provenance again, after every round
    until a walk finds nothing new, and judged alike.

    Crash safety: before it writes, the step records its intent with the row's
    version (``updated_us``) and the sources it rebuilds from; an intent without
    its result is all a kill leaves. Resumed, a row still at that version was not
    written (acted on again); a row changed since, no longer touching the erasure
    and holding exactly those sources was rebuilt by the killed run (recorded as
    rebuilt, so the receipt lists it; any other change is the holder's and claims
    nothing); a row that still touches it is acted on again, which is idempotent
    (the same remaining sources, the same function); an asset gone with a drop
    intended was dropped. A write that raised without landing forgets its intent.
    (A holder's rewrite naming exactly the intended sources, after a SIGKILL
    between an intent and its write, is recorded as the rebuild: nothing in the
    row tells the two apart.)"""

    name = "derived"
    phase: Phase = REBUILD

    def __init__(self, catalog: Catalog, memories: MemoryStore, producers: DerivedApi) -> None:
        self._catalog = catalog
        self._memories = memories
        self._producers = producers

    def erase(self, target: ErasureTarget) -> StoreErasure:
        # What no longer remains: the request's own assets (a retention request's
        # listed memories too, even one the catalog no longer held at its closure)
        # and the closure's assets this step dropped, in this run or a killed one.
        erased = set(target.erased) | set(target.assets or ())
        done: list[Mapping[str, Any]] = []
        intents: dict[str, Mapping[str, Any]] = {}
        for entry in target.done:
            if "action" in entry:
                done.append(entry)
            else:
                intents[entry["asset_id"]] = entry
        erased |= {d["asset_id"] for d in done if d["action"] == "dropped"}
        handled = {d["asset_id"] for d in done}

        def record(asset_id: str, entry: Mapping[str, Any] | None) -> None:
            if target.record is not None:
                target.record(asset_id, entry)

        def intend(action: Mapping[str, Any], row: MemoryRow, sources: Sequence[str]) -> None:
            entry = {
                "asset_id": action["asset_id"],
                "intent": dict(action),
                "updated_us": row.updated_us,
                "sources": list(sources),
            }
            intents[action["asset_id"]] = entry
            record(action["asset_id"], entry)

        def forget(asset_id: str) -> None:
            if intents.pop(asset_id, None) is not None:
                record(asset_id, None)

        # Rounds until a walk finds nothing new: the closure, then what was derived
        # from it or from the erased assets meanwhile (``_grown``), found again after
        # each round (a copy made while a slow rebuild function ran).
        seen: set[str] = set(handled)
        # Holders whose partitions are purged at the end: of the assets acted on or
        # found untouched, in this run or (recorded) a killed or waiting one.
        holders: set[str] = {d["owner_subject_ref"] for d in done}
        holders |= {i["intent"]["owner_subject_ref"] for i in intents.values()}
        # Assets a killed run recorded an intent for: acted on again even when the
        # walk no longer reaches them (a drop that landed took their provenance
        # edges with it; only the intent says it happened).
        pending = list(intents)
        # Entry points listed once for the step, at its first producer lookup.
        snapshot = _EntryPoints()

        def rounds() -> None:
            """Act on the closure and what grew from it, round after round, until a
            walk finds nothing new."""
            while True:
                order = self._grown(list(target.closure), erased)
                reached = set(order)
                order += [a for a in pending if a not in reached]
                todo = [a for a in order if a not in seen]
                if not todo:
                    break
                inside = set(order)
                unread = inside - seen  # shrinks as assets are acted on
                for asset_id in todo:
                    for _ in range(_ATTEMPTS):
                        try:
                            action = self._act(
                                target,
                                asset_id,
                                intents.get(asset_id),
                                erased=erased,
                                inside=inside,
                                unread=unread,
                                holders=holders,
                                intend=intend,
                                snapshot=snapshot,
                            )
                            break
                        except Changed:
                            # Its holder wrote it while the rebuild function ran: that
                            # write is theirs (its intent claims nothing); decide again.
                            forget(asset_id)
                        except BaseException:
                            # A write that failed before it landed left the row as it
                            # was: its intent must not claim a later rewrite of the
                            # holder's.
                            if self._unwritten(asset_id, intents.get(asset_id)):
                                forget(asset_id)
                            raise
                    else:
                        raise BackendUnavailable(
                            f"derived asset {asset_id} kept changing while it was rebuilt"
                        )
                    seen.add(asset_id)
                    unread.discard(asset_id)
                    if action is None:
                        forget(asset_id)  # a stale intent must not claim a later change
                    else:
                        # The action replaces its intent in one write of the progress.
                        intents.pop(asset_id, None)
                        done.append(action)
                        record(asset_id, action)
                        faults.reached("erase.derived")
                        if action["action"] == "dropped":
                            erased.add(asset_id)

        try:
            rounds()
        except Exception:
            # The request stops (to wait in ``manual_review`` for an application's
            # fix, which may take days, or to be retried): what this run rebuilt
            # leaves the holders' files now, not at the end of a later run. Best
            # effort, the step's own error kept: the resumed run purges them again.
            self._purge(holders, best_effort=True)
            raise
        # The values the rebuilt assets held, those their holders superseded while
        # the request waited, and the opaque rows dropped, leave the holders' files
        # before it is done: no key was destroyed for the first two in a retention
        # request or a scope erasure. One rewrite per holder, not one per asset.
        self._purge(holders)

        return StoreErasure(
            self.name,
            "rebuilt-or-dropped",
            len(done),
            datetime.now(UTC),
            items=tuple(done),
            found=bool(done),
        )

    def _purge(self, holders: set[str], *, best_effort: bool = False) -> None:
        for holder in sorted(holders):
            try:
                self._memories.purge_superseded(holder)
            except (SubjectSuppressed, SubjectErased, KeyNotFound):
                pass  # a holder being erased itself meanwhile: that erasure removes the files
            except Exception:
                if not best_effort:
                    raise
                # On the way out of a failed step: its own error is the one to
                # report (a ``ProducerUnknown`` must still wait for its producer).
                continue
            faults.reached("derived.after_first_purge")

    def _act(
        self,
        target: ErasureTarget,
        asset_id: str,
        intent: Mapping[str, Any] | None,
        *,
        erased: set[str],
        inside: set[str],
        unread: set[str],
        holders: set[str],
        intend: Callable[[Mapping[str, Any], MemoryRow, Sequence[str]], None],
        snapshot: _EntryPoints,
    ) -> dict[str, Any] | None:
        """Rebuild or drop one asset if its row still touches the erasure; what a
        killed run did to it (its ``intent``) if that is what the row shows."""
        asset = self._catalog.asset(asset_id)
        if asset is None:
            # Gone: dropped by a killed run of this step (its intent says so), or
            # earlier, or by its holder, or with its owner's own erasure.
            return _landed(intent, "dropped", None)
        if self._left_alone(target, asset):
            return None
        holders.add(asset.subject_ref)
        # Opaque too: its shared key went with the subject's; rebuilt (sealed under
        # the key of its remaining owners) or dropped like a readable one.
        owner = asset.subject_ref
        row = self._memories.rows_by_id(owner, [asset_id], opaque=True).get(asset_id)
        if row is None:
            # Its row gone, its catalog row not yet: a delete killed halfway, which
            # the next open of the partition finishes.
            return _landed(intent, "dropped", None)
        if not _touches(target, asset, row, erased, inside):
            # Holds nothing of the erasure: written since the closure was listed,
            # by its holder (a new memory at the same name keeps the asset id), or
            # by this step's rebuild, killed before recording it (its intent).
            return _landed(intent, "rebuilt", row)
        return self._rebuild_one(
            target, asset, row, erased, unread=unread, intend=intend, snapshot=snapshot
        )

    def _unwritten(self, asset_id: str, intent: Mapping[str, Any] | None) -> bool:
        """Whether the asset's row is still the one ``intent`` was recorded for
        (its write did not land)."""
        asset = self._catalog.asset(asset_id) if intent is not None else None
        if asset is None or intent is None:
            return False
        row = self._memories.rows_by_id(asset.subject_ref, [asset_id], opaque=True).get(asset_id)
        return row is not None and row.updated_us == intent["updated_us"]

    def _left_alone(self, target: ErasureTarget, asset: AssetRow) -> bool:
        """Whether the asset is another erasure's, or the subject's own."""
        if asset.subject_ref == target.subject_ref and target.whole_subject:
            return True  # the subject's own derived assets go with it
        try:
            self._catalog.check_guard(asset.subject_ref, scope=asset.scope)
        except SubjectSuppressed:
            return True  # its owner (or its scope) is being erased too; that erasure takes it
        return False

    def _grown(self, closure: list[str], erased: set[str]) -> list[str]:
        """The closure, and after it (sources first) what was derived since it was
        listed from an asset the erasure removes or from one in the closure: a
        request that waited (``manual_review``, a legal hold, a killed worker) while
        the data it removes stayed readable (a retention request destroys no key)
        saw new summaries of it made, and corrections keep its old value as a
        version. Whether each still holds something of the erasure is decided by
        its row, as for the closure's own."""
        inside = set(closure)
        frontier = inside | erased
        rows: dict[str, AssetRow] = {}
        new: list[str] = []
        while frontier:
            found = [
                a
                for a in self._catalog.derived_from(frontier)
                if a.asset_id not in inside and a.kind != "vector"
            ]
            frontier = set()
            for a in found:
                if a.asset_id not in inside:
                    inside.add(a.asset_id)
                    new.append(a.asset_id)
                    rows[a.asset_id] = a
                    frontier.add(a.asset_id)
        return [*closure, *sources_first(new, rows)] if new else closure

    def _rebuild_one(
        self,
        target: ErasureTarget,
        asset: AssetRow,
        row: MemoryRow,
        erased: set[str],
        *,
        unread: set[str],
        intend: Callable[[Mapping[str, Any], MemoryRow, Sequence[str]], None],
        snapshot: _EntryPoints,
    ) -> dict[str, Any] | None:
        """Rebuild or drop the asset, over ``row`` only (``Changed`` if its holder
        wrote it since it was read). ``unread``: assets of the closure this step
        has not acted on yet (the asset itself among them), never read as sources."""
        owner = asset.subject_ref
        memories = self._memories
        # Past its retain-until it is gone for every read: dropped, not renewed.
        expired = memories.expired(row)
        # Only sources that remain *and can be read* count (``_readable_sources``):
        # deciding by catalog presence while the function got only the readable
        # ones ran it on no source at all. Nor one of the closure not rebuilt yet:
        # in a provenance cycle (``update`` may make one), or the asset itself, its
        # value still holds what the erasure removes when no key was destroyed.
        sources = (
            {}
            if expired
            else self._readable_sources(
                [s for s in asset.sources if s not in erased and s not in unread]
            )
        )
        mentions = [
            m for m in asset.mentions if m != target.subject_ref or target.scope is not None
        ]
        rebuild = self._producers._rebuilder(asset.producer, asset.producer_version, snapshot)
        if rebuild is None and sources and asset.producer is not None:
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
        if rebuild is not None and sources:
            value = _run(rebuild, list(sources.values()), asset)
        dropped = {**base, "action": "dropped"}
        if value is not None:
            rebuilt = {**base, "action": "rebuilt"}
            intend(rebuilt, row, list(sources))
            try:
                memories.rebuild(
                    owner,
                    row,
                    value,
                    sources=list(sources),
                    mentions=mentions,
                    produced_by=(asset.kind, asset.producer, asset.producer_version),
                )
                return rebuilt
            except (SubjectSuppressed, ConsentRequired):
                # Another subject it is about (a mention) is being erased at the
                # same time: no new copy is made under a key that erasure may
                # already have passed. Or its holder's consent ended: a put would
                # be refused, and a request must not wait on a third party's
                # consent. Dropped, the safe way (the owner was checked before, so
                # it is not the holder that is suppressed).
                pass
        intend(dropped, row, ())
        # A readable row's bytes leave the holder's files with the drop (a retention
        # request destroys no key, and a failed step may never reach the purge at
        # its end). An opaque one (its shared key destroyed by this erasure) waits
        # for that purge: its bytes are already undecryptable, and N drops of one
        # holder then cost one rewrite of the partition, not N.
        memories.delete_by_id(owner, asset.asset_id, unchanged=row, purge=not row.opaque)
        return dropped

    def _readable_sources(self, ids: Sequence[str]) -> dict[str, Memory]:
        """The sources among ``ids`` a rebuild may use, in provenance order: held by
        the catalog, their owner and scope not suppressed, their row readable.

        A source whose owner (or scope) is suppressed does not remain: suppression
        ends only in that erasure, which removes the source (a subject found to
        hold nothing is re-admitted, but then holds no source either). So the asset
        is rebuilt without it, or dropped when nothing else is left, rather than
        waiting for that erasure: waiting would tie this request's completion to
        another subject's (a legal hold, a manual review, each of two erasures
        waiting for the other), and the other erasure would rebuild or drop it the
        same way. Without it in the provenance, the rebuilt asset is not sealed
        under a key that subject co-owns (a write naming it would be refused).
        An opaque source (its key destroyed; in a provenance cycle, one this step
        has not rebuilt yet) cannot be read either, and does not count."""
        by_owner: dict[str, list[str]] = {}
        for asset_id in ids:
            a = self._catalog.asset(asset_id)
            if a is None:
                continue  # deleted by its holder: the catalog no longer holds it
            try:
                self._catalog.check_guard(a.subject_ref, scope=a.scope)
            except SubjectSuppressed:
                continue
            by_owner.setdefault(a.subject_ref, []).append(asset_id)
        found: dict[str, Memory] = {}
        for owner, owned in by_owner.items():
            # Readable rows only, within their retain-until: an expired source not
            # swept yet would otherwise renew its text in the rebuilt asset.
            rows = self._memories.rows_by_id(owner, owned, live=True)
            found.update({i: self._memories.memory(rows[i]) for i in owned if i in rows})
        return {i: found[i] for i in ids if i in found}

    def verify(self, target: ErasureTarget) -> list[StoreCheck]:
        still = self._catalog.any_source_in(list(target.erased))
        return [StoreCheck("no provenance points at erased assets", not still, f"{still} edges")]

    def evict(self, subject_ref: str) -> None:
        """Nothing cached here: derived assets are memories (``MemoryStore.evict``)."""
        del subject_ref


def _touches(
    target: ErasureTarget, asset: AssetRow, row: MemoryRow, erased: set[str], inside: set[str]
) -> bool:
    """Whether the asset's row as it is now holds something of the erasure: it is
    opaque (its key destroyed, or co-owned by a subject being erased), mentions
    the subject (a whole-subject erasure), or names a source the erasure removed
    or one of its closure. Any of the closure, rebuilt or not: a row does not say
    when the value it was built from was read (a history version's value is older
    than its row; writers' clocks differ), so a row built from a closure asset is
    rebuilt or dropped with it, even one built after that asset's rebuild."""
    if row.opaque:
        return True
    if target.whole_subject and target.subject_ref in (*asset.mentions, *row.mentions):
        return True
    return any(s in erased or s in inside for s in (*asset.sources, *row.sources))


def _landed(
    intent: Mapping[str, Any] | None, action: str, row: MemoryRow | None
) -> dict[str, Any] | None:
    """What a killed run of the step did, by its recorded intent: ``action``, if
    the row (None: gone) is what that action leaves. A rebuild leaves a row changed
    since the intent with the sources it was given; any other change is the
    holder's, and claims nothing (a receipt must not list a rebuild that never
    wrote)."""
    if intent is None or intent["intent"]["action"] != action:
        return None
    if row is not None and (
        row.updated_us == intent["updated_us"] or list(row.sources) != intent.get("sources")
    ):
        return None
    return dict(intent["intent"])


def _run(rebuild: Rebuild, sources: list[Memory], asset: AssetRow) -> Any:
    """The application's rebuild function on ``sources``; whatever it raises becomes
    ``RebuildFailed`` with the exception's type name only (its message, the
    application's text, may quote the values it was given). Raised outside the
    ``except`` block so that not even ``__context__`` keeps the original."""
    try:
        return rebuild(sources)
    except Exception as exc:  # noqa: BLE001 - the application's code: anything
        failed = type(exc).__name__
    raise RebuildFailed(asset.asset_id, asset.producer, asset.producer_version, failed)
