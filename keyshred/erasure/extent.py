"""What a request erases, and so how the steps that differ between kinds of request
behave; and the small collaborators the coordinator is wired with.

``Extent`` is a subject erasure (``scope=None``) or a scope erasure;
``AssetsExtent`` the retention scanner's listed memories, ``ReplayExtent`` a
tombstone replayed on a restored copy. The coordinator runs the same steps, in the
same order, with the same persistence, for every kind; the stores see a request
only as an ``ErasureTarget``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from keyshred.erasure import items
from keyshred.erasure.pending import erasure_pending
from keyshred.erasure.requests import ERASED, ErasureRequest, iso, now, request_tombstone_id
from keyshred.errors import IntegrityError
from keyshred.keyring.keyring import Keyring
from keyshred.keyring.keystore import Tombstone
from keyshred.metrics import Metrics
from keyshred.schema import api_downloads
from keyshred.storage import faults
from keyshred.storage.catalog import AssetRow, Catalog
from keyshred.storage.catalog_base import ACTIVE
from keyshred.storage.catalog_base import SUPPRESSED as GUARD_SUPPRESSED
from keyshred.storage.erasable import Erasable, ErasureTarget, ScopedKeys

__all__ = [
    "AssetsExtent",
    "BackupHooks",
    "Extent",
    "Partitions",
    "ReplayExtent",
    "Wiring",
    "extent_of",
]


class Partitions(Protocol):
    """The memory store's subject-level operations the coordinator needs beyond
    ``Erasable``: its partition lock (keys are destroyed under it, so a writer that
    passed its guard check before the suppression finishes first), the key ids of
    rows (co-owned keys' assets) and the probe search."""

    def locked(
        self, ref: str, *, compact: bool = False
    ) -> contextlib.AbstractContextManager[None]: ...

    def key_ids_of(self, ref: str, memory_ids: Iterable[str]) -> dict[str, bytes | None]: ...

    def sealed_under(self, ref: str, key_ids: Collection[bytes]) -> list[str]: ...

    def probe_hits(self, ref: str, probes: Sequence[str]) -> int: ...


class BackupHooks(Protocol):
    """What an erasure asks of backups (``keyshred.backup.BackupManager``)."""

    def live_residue_until(self, at: datetime | None = None) -> datetime: ...

    def on_erasure(self, tombstone: Tombstone, *, whole_subject: bool) -> dict[str, Any]: ...

    def coverage(self, subject_ref: str, erased_at: datetime, deleted: int = 0) -> Any: ...

    def coverage_unkeyed(self, deleted_at: datetime) -> Any: ...


@dataclass(frozen=True, slots=True)
class Wiring:
    """Everything the steps reach: the stores, the catalog, the keyring and the
    small explicit collaborators (never the facade)."""

    stores: tuple[Erasable, ...]
    catalog: Catalog
    keyring: Keyring
    partitions: Partitions
    backups: BackupHooks
    metrics: Metrics

    def evict(self, ref: str) -> None:
        for store in self.stores:
            store.evict(ref)


class Extent:
    """A subject erasure (``scope=None``) or a scope erasure; see the module
    docstring for the other kinds."""

    holds_apply = True  # an active legal hold blocks the request
    calls_processors = True  # external processors are asked to delete
    deletes_backups = True  # the tombstone is journaled and segments deleted on targets
    signs_receipt = True

    def __init__(self, w: Wiring, req: ErasureRequest) -> None:
        self.w = w
        self.req = req
        self.ref = req.subject_ref
        self.scope = req.scope

    def target(self) -> ErasureTarget:
        """The request as the stores see it (the closure once it is known)."""
        own, closure = self.lists()
        return ErasureTarget(self.ref, self.scope, None, own, closure)

    def lists(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The request's own asset ids and its closure, once the closure step has
        recorded them (in ``keyshred.erasure.items``; in the document for a
        request an earlier release recorded)."""
        details = self.req.doc["details"].get("closure")
        if details is None:
            return (), ()
        if "own" in details:
            return tuple(details["own"]), tuple(details.get("closure", ()))
        cached = self.req.cache.get("closure_lists")
        if cached is None:
            rid = self.req.request_id
            own = tuple(items.read(self.w.catalog, rid, "own"))
            closure = tuple(items.read(self.w.catalog, rid, "closure"))
            if (len(own), len(closure)) != (details.get("own_n"), details.get("closure_n")):
                # Rows lost (a schema downgrade, a partial restore): never taken
                # for an empty closure, which would complete with nothing done.
                raise IntegrityError(
                    f"erasure request {rid}: its closure's recorded lists are incomplete"
                )
            cached = self.req.cache["closure_lists"] = (own, closure)
        own, closure = cached
        return own, closure

    @property
    def whole_subject(self) -> bool:
        """The subject itself goes (its threads, tokens and mentions with it)."""
        return self.scope is None

    def suppress(self) -> dict[str, Any]:
        # Stores give up what this process holds first (the vault stores tokens
        # pending group commit, so its step deletes and counts them with the rest),
        # and again once the guard refuses every new read.
        self.w.evict(self.ref)
        epoch = self.w.catalog.suppress(self.ref, self.scope)
        self.w.evict(self.ref)
        at = now()
        self.w.metrics.online_latency((at - self.req.created_at).total_seconds())
        return {"epoch": epoch, "at": iso(at)}

    def own_assets(self) -> dict[str, str]:
        """Asset id -> kind of what the request erases."""
        return self.w.catalog.asset_kinds(self.ref, self.scope)

    def first_level(self) -> list[AssetRow]:
        """Assets derived from (or, for a whole subject, mentioning) what goes."""
        catalog = self.w.catalog
        mentioning = catalog.mentioning(self.ref) if self.scope is None else []
        return [*mentioning, *catalog.derived_from_subject(self.ref, self.scope)]

    def destroy_keys(self) -> dict[str, Any]:
        w = self.w
        # Under the partition lock: a writer that passed its guard check before the
        # suppression finishes first; every later one sees the suppression. A scope's
        # key goes only once the partition is compacted: a memory that moved out of
        # the scope is then in no other scope's files in its old version, which the
        # next load would otherwise read back once the new one is unreadable.
        rid = self.req.request_id
        tombstone_id = request_tombstone_id(rid)
        with w.partitions.locked(self.ref, compact=self.scope is not None):
            also = self.key_scopes()
            # Other holders' keys about the subject, recorded before they go: the key
            # store keeps their ids (the tombstone) but not whose they were, and the
            # later steps find those holders' assets by them. A request killed after
            # the destruction reads them back from here.
            doomed = w.keyring.shared_doomed(self.ref, self.scope, also=also)
            if doomed:
                entry = {"shared_keys": [[k.hex(), holder] for k, holder in doomed]}
                with w.catalog.transaction() as conn:
                    items.put_entry(conn, rid, "destroy_keys", "shared_keys", pos=0, entry=entry)
            result = w.keyring.destroy(self.ref, self.scope, also=also, tombstone_id=tombstone_id)
        faults.reached("keys.after_destroy")
        w.evict(self.ref)
        epoch = self.req.doc["details"].get("suppress", {}).get("epoch")
        if epoch is not None:
            # Every process again, now that no key of the subject can be loaded: a
            # read that passed its guard before the suppression and cached a key or
            # rows after the first event loses them here.
            w.catalog.announce_eviction(self.ref, self.scope, int(epoch))
        at = now()
        tombstone = result.tombstone
        shared_keys = [[k.hex(), holder] for k, holder in result.shared_keys]
        if not tombstone.key_ids:
            # Resumed after this request destroyed the keys (killed before the step
            # was recorded): its own tombstone, found by the id derived from the
            # request's. Never another's: a request that finds the keys gone because
            # an earlier erasure (or a concurrent one) destroyed them destroyed none.
            previous = w.keyring.store.tombstone(tombstone_id)
            if previous is not None:
                tombstone = previous
                at = tombstone.erased_at
                recorded, _ = items.progress(w.catalog, rid, "destroy_keys")
                shared_keys = [list(p) for e in recorded for p in e.get("shared_keys", [])]
        return {
            "key_ids": [k.hex() for k in tombstone.key_ids],
            "tombstone_id": tombstone.tombstone_id if tombstone.key_ids else None,
            "at": iso(at),
            "cache_evicted": result.cache_entries_evicted,
            # Keys of other holders' data about the subject, destroyed with its own.
            "shared_keys": shared_keys,
            # The scope's other key scopes (its threads' keys), for the sweep: by
            # then the threads' rows are gone, not a key made for them meanwhile.
            "key_scopes": also,
            # The live epoch that may still sit in database pages with these keys:
            # when the live schedule destroys it.
            "live_residue_until": iso(w.backups.live_residue_until(at)),
        }

    def key_scopes(self) -> list[str]:
        """A scope's other key scopes (its agent threads' own keys), those the
        stores hold now and those the key step found: destroyed with the scope's
        keys. A whole subject's erasure takes every key it holds."""
        if self.scope is None:
            return []
        found = {
            s
            for store in self.w.stores
            if isinstance(store, ScopedKeys)
            for s in store.key_scopes(self.ref, self.scope)
        }
        step = self.req.doc.get("details", {}).get("destroy_keys") or {}
        found.update(step.get("key_scopes", ()))
        return sorted(found)

    def keys_left(self) -> int:
        """Keys the subject (or scope) holds, and for a subject the keys it co-owns."""
        store = self.w.keyring.store
        held = store.for_subject(self.ref, self.scope)
        held += [r for s in self.key_scopes() for r in store.for_subject(self.ref, s)]
        return len(held) + len(store.owned_by(self.ref, self.scope))

    def sweep_keys(self) -> list[str] | None:
        """Destroy keys about the subject created after ``destroy_keys`` (a writer
        that passed every guard check just before the suppression); their tombstone
        goes to the backups like the first. Returns their key ids (hex); ``None``
        where the request destroys no key of its own."""
        if not self.keys_left():
            return []
        result = self.w.keyring.destroy(self.ref, self.scope, also=self.key_scopes())
        if self.deletes_backups and result.tombstone.key_ids:
            self.w.backups.on_erasure(result.tombstone, whole_subject=self.scope is None)
        return [k.hex() for k in result.tombstone.key_ids]

    def drop_catalog(self) -> tuple[int, int]:
        """(assets deleted, consents deleted); a subject's registered identifiers go
        too (only after suppression: a racing registration is refused or deleted)."""
        catalog = self.w.catalog
        n = catalog.delete_subject_assets(self.ref, scope=self.scope)
        consents = catalog.delete_consents(self.ref) if self.scope is None else 0
        if self.scope is None:
            catalog.delete_identifiers(self.ref)
        return n, consents

    def drop_packages(self) -> int:
        """Access packages of the subject still waiting for their download (the
        HTTP API's ``ks_api_downloads``): dropped, whatever the scope, since an export
        holds every scope. They are ciphertext, and a subject erasure has destroyed
        their export DEK already; a scope erasure has not, so this is what keeps the
        erased scope's data from being downloaded after its erasure. The rows stay
        (without package) so that the download answers 410 rather than 404."""
        with self.w.catalog.transaction() as conn:
            return int(
                conn.execute(
                    api_downloads.update()
                    .where(
                        api_downloads.c.subject_ref == self.ref,
                        api_downloads.c.package.is_not(None),
                    )
                    .values(package=None)
                ).rowcount
            )

    def backup_coverage(self, keys_at: datetime, deleted: int) -> Any:
        return self.w.backups.coverage(self.ref, keys_at, deleted=deleted)

    def finish(self, *, found: bool) -> None:
        """The guard once the request is done: an erased subject stays ``erased``
        until re-admitted, unless nothing of it was found (``found`` False: the id
        is left free, active again at the new deletion epoch, so jobs from before
        stay refused); an erased scope takes new writes under a new key. An id that
        was erased before this request (an earlier erasure, or blocked) stays
        erased whatever this one found: its suppression left it ``erased``."""
        if self.scope is None:
            if found:
                self.w.catalog.set_guard(self.ref, ERASED)
            else:
                # Not while another erasure of the subject is unfinished: its
                # suppression (and a block it asked for) is not this request's to lift.
                ref, rid = self.ref, self.req.request_id
                self.w.catalog.set_guard(
                    ref,
                    ACTIVE,
                    only_from=GUARD_SUPPRESSED,
                    unless=lambda conn: erasure_pending(conn, ref, but=rid),
                )
        else:
            self.w.catalog.release_scope(self.ref, self.scope)


class AssetsExtent(Extent):
    """Exactly the listed memories of a subject (the retention scanner's requests):
    deleted physically with their vectors and catalog rows, derived assets rebuilt;
    no key is destroyed (the scope's other memories share it) and the subject stays
    active. Tokens and threads are not memories: their own expiry removes them."""

    calls_processors = False

    def __init__(self, w: Wiring, req: ErasureRequest) -> None:
        super().__init__(w, req)
        self.assets: list[str] = list(req.doc["assets"])

    def target(self) -> ErasureTarget:
        base = super().target()
        return ErasureTarget(
            base.subject_ref, base.scope, tuple(self.assets), base.erased, base.closure
        )

    @property
    def whole_subject(self) -> bool:
        return False

    def suppress(self) -> dict[str, Any]:
        # Past their retain-until, these memories are already invisible to every
        # read (reads hide expired rows); the subject itself stays active.
        return {"epoch": None, "at": iso(now()), "assets": len(self.assets)}

    def own_assets(self) -> dict[str, str]:
        catalog = self.w.catalog
        out = {}
        for a in self.assets:
            row = catalog.asset(a)
            if row is not None:
                out[a] = row.kind
        for row in catalog.derived_from(self.assets):
            if row.kind == "vector":
                out[row.asset_id] = row.kind
        return out

    def first_level(self) -> list[AssetRow]:
        return self.w.catalog.derived_from(self.assets)

    def destroy_keys(self) -> dict[str, Any]:
        return {"key_ids": [], "tombstone_id": None, "at": iso(now()), "cache_evicted": 0}

    def sweep_keys(self) -> list[str] | None:
        return None  # no key is destroyed: the scope's other memories share it

    def drop_catalog(self) -> tuple[int, int]:
        own, _ = self.lists()
        return self.w.catalog.delete(list(own)), 0

    def drop_packages(self) -> int:
        return 0  # expired memories only: a pending export of the subject stays

    def backup_coverage(self, keys_at: datetime, deleted: int) -> Any:
        return self.w.backups.coverage_unkeyed(keys_at)

    def finish(self, *, found: bool) -> None:
        del found  # the subject stays active: only those memories went


class ReplayExtent(Extent):
    """A live tombstone replayed on a restored copy: the same key ids, tombstone id
    and time; no holds (the live erasure passed them), no processors, no backup
    deletion and no receipt (the live erasure did and signed those)."""

    holds_apply = False
    calls_processors = False
    deletes_backups = False
    signs_receipt = False

    def sweep_keys(self) -> list[str] | None:
        return None  # exactly the live erasure's keys: a returned subject keeps its new ones

    def destroy_keys(self) -> dict[str, Any]:
        # A subject who came back after the erasure has other key ids: untouched.
        t = self.req.doc["replay"]
        tombstone = Tombstone(
            t["tombstone_id"],
            self.ref,
            self.scope,
            tuple(bytes.fromhex(k) for k in t["key_ids"]),
            datetime.fromisoformat(t["erased_at"]),
        )
        w = self.w
        with w.partitions.locked(self.ref, compact=self.scope is not None):  # as above
            destroyed = w.keyring.store.destroy(tombstone.key_ids, tombstone)
        w.keyring.cache.clear()
        w.evict(self.ref)
        return {
            "key_ids": t["key_ids"],
            "tombstone_id": tombstone.tombstone_id,
            "at": t["erased_at"],
            "cache_evicted": 0,
            "present": destroyed,
        }


def extent_of(w: Wiring, req: ErasureRequest) -> Extent:
    """How this request's steps differ from a subject or scope erasure."""
    if "replay" in req.doc:
        return ReplayExtent(w, req)
    if "assets" in req.doc:
        return AssetsExtent(w, req)
    return Extent(w, req)
