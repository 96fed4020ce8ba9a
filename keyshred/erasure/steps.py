"""The two steps that read across every store: ``closure`` (what goes, and the
other holders' assets built from it) and ``verify`` (nothing of it is left)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from keyshred.erasure.extent import Wiring, extent_of
from keyshred.erasure.requests import ErasureRequest, VerificationFailed, iso
from keyshred.errors import KeyNotFound, SubjectErased
from keyshred.storage.catalog import ACTIVE, AssetRow

__all__ = ["closure", "sources_first", "verify"]


def closure(w: Wiring, req: ErasureRequest) -> dict[str, Any]:
    """The request's own assets and, by reverse provenance and mentions, every
    derived asset built from them, with the assets each destroyed co-owned key made
    unreadable."""
    extent = extent_of(w, req)
    own = extent.own_assets()
    own_ids = set(own)
    found: list[str] = []
    seen = set(own_ids)
    frontier: set[str] = set()
    # First level by one join on the subject; further levels (derived from
    # derived) by the few ids found.
    level = [a for a in extent.first_level() if a.asset_id not in seen]
    level += [a for a in _sealed_under_destroyed(w, req) if a.asset_id not in seen]
    holders: dict[str, list[str]] = {}
    rows: dict[str, AssetRow] = {}
    while frontier or level:
        derived = w.catalog.derived_from(frontier) if frontier else []
        nxt = [a for a in [*level, *derived] if a.asset_id not in seen]
        level = []
        frontier = set()
        for a in nxt:
            if a.asset_id in seen or a.kind == "vector":
                continue
            seen.add(a.asset_id)
            found.append(a.asset_id)
            rows[a.asset_id] = a
            frontier.add(a.asset_id)
            holders.setdefault(a.subject_ref, []).append(a.asset_id)
    counts: dict[str, int] = {}
    for kind in own.values():
        counts[kind] = counts.get(kind, 0) + 1
    shared = _shared_assets(w, req, holders)
    return {
        "own": sorted(own_ids),
        "own_counts": counts,
        "closure": sources_first(found, rows),
        "shared": shared,
    }


def sources_first(found: list[str], rows: dict[str, AssetRow]) -> list[str]:
    """``found`` with every asset after those of its sources that are in it.

    The derived step rebuilds in this order from the sources' values as they are
    then. Found level by level, a summary that mentions the subject (first level)
    came before a summary it was built from (a later level, or the same one): that
    source, unreadable until rebuilt, was left out of its rebuild (or, dropped
    afterwards, counted as remaining, and the function ran on no source at all).
    Depth first, iterative; a cycle (``update`` may name a source built from the
    memory it rewrites) keeps the found order: its first asset is rebuilt from
    what can be read then, the opaque one not counted (``DerivedStore``)."""
    inside = set(found)
    out: list[str] = []
    placed: set[str] = set()
    for start in found:
        if start in placed:
            continue
        path = {start}
        stack = [(start, iter(rows[start].sources))]
        while stack:
            node, sources = stack[-1]
            nxt = next(
                (x for x in sources if x in inside and x not in placed and x not in path), None
            )
            if nxt is not None:
                path.add(nxt)
                stack.append((nxt, iter(rows[nxt].sources)))
                continue
            stack.pop()
            path.discard(node)
            placed.add(node)
            out.append(node)
    return out


def _sealed_under_destroyed(w: Wiring, req: ErasureRequest) -> list[AssetRow]:
    """Other holders' assets sealed under a co-owned key the request destroyed.

    The catalog's joins find what is derived from the subject's assets it still
    holds. A summary built from a memory its holder deleted since names an asset
    the catalog no longer has, yet its key is co-owned by the subject: it became
    unreadable here and, found by no join, was left opaque (lost to its holder,
    neither rebuilt from its remaining sources nor dropped). Its rows say which key
    they are sealed under; that finds it whatever the catalog's provenance says."""
    by_holder: dict[str, set[bytes]] = {}
    for key_hex, holder in req.doc["details"]["destroy_keys"].get("shared_keys", []):
        by_holder.setdefault(holder, set()).add(bytes.fromhex(key_hex))
    found: list[AssetRow] = []
    for holder, key_ids in sorted(by_holder.items()):
        if holder == req.subject_ref and req.scope is None:
            continue  # the subject's own assets go with it
        for asset_id in w.partitions.sealed_under(holder, key_ids):
            asset = w.catalog.asset(asset_id)
            if asset is not None:
                found.append(asset)
    return found


def _shared_assets(
    w: Wiring, req: ErasureRequest, holders: dict[str, list[str]]
) -> list[dict[str, Any]]:
    """For each co-owned key the request destroyed, the assets of its holder it
    made unreadable: the closure's assets of that holder whose rows are sealed
    under it (read from the rows' key ids; no key is needed)."""
    keys = req.doc["details"]["destroy_keys"].get("shared_keys", [])
    by_holder: dict[str, dict[str, list[str]]] = {}
    for key_hex, holder in keys:
        by_holder.setdefault(holder, {})[key_hex] = []
    for holder, wanted in by_holder.items():
        ids = holders.get(holder, [])
        if not ids:
            continue
        key_ids = w.partitions.key_ids_of(holder, ids)
        for asset_id in sorted(key_ids):
            key_id = key_ids[asset_id]
            if key_id is not None and key_id.hex() in wanted:
                wanted[key_id.hex()].append(asset_id)
    return [
        {"key_id": key_hex, "holder_subject_ref": holder, "assets": assets}
        for holder, wanted in sorted(by_holder.items())
        for key_hex, assets in sorted(wanted.items())
    ]


def verify(
    w: Wiring,
    req: ErasureRequest,
    probes: Sequence[str],
    store_steps: Sequence[str],
    save: Callable[[ErasureRequest], None],
) -> dict[str, Any]:
    """Keys fail to unwrap, no key made during the erasure is left, every store's
    ``verify`` passes, the catalog holds nothing of it, probes are found nowhere;
    ``VerificationFailed`` names the failed checks."""
    checks: list[dict[str, Any]] = []

    def check(name: str, passed: bool, detail: str) -> None:
        checks.append({"name": name, "passed": passed, "detail": detail})

    keys = req.doc["details"]["destroy_keys"]["key_ids"]
    unwrapped = []
    for key_hex in keys:
        try:
            w.keyring.data_key_by_id(bytes.fromhex(key_hex))
            unwrapped.append(key_hex)
        except (SubjectErased, KeyNotFound):
            pass
    check("keys fail to unwrap", not unwrapped, f"{len(keys)} keys raise SubjectErased")

    extent = extent_of(w, req)
    swept = extent.sweep_keys()
    if swept is not None:
        if swept:
            req.doc["swept_keys"] = sorted({*req.doc.get("swept_keys", []), *swept})
            # Their wrapped copies sit in pages under the live epoch of now.
            req.doc["swept_residue_until"] = iso(w.backups.live_residue_until())
            save(req)
        left = extent.keys_left()
        check(
            "no key held or co-owned by the subject left",
            not left,
            f"{left} keys left; {len(req.doc.get('swept_keys', []))} made during the "
            "erasure destroyed",
        )
    target = extent.target()
    for store in w.stores:
        for c in store.verify(target):
            check(c.name, c.passed, c.detail)
    own = extent.own_assets()
    check("catalog holds no asset", not own, f"{len(own)} assets left")
    if extent.whole_subject:
        mentions = w.catalog.mentioning(req.subject_ref)
        check("no asset mentions the subject", not mentions, f"{len(mentions)} assets")
        ids = w.catalog.count_identifiers(req.subject_ref)
        check("no registered identifier left", not ids, f"{ids} identifiers")
    given = int(req.doc.get("probes", 0) or 0)
    if probes:
        hits = _probe_hits(w, req, probes, store_steps)
        check("probes found nowhere (key and semantic search)", not hits, f"{hits} hits")
    elif given:
        # Probes live only in the memory of the process that recorded the request;
        # this one finishes it after that process stopped: said, not skipped.
        check(
            "probe search not run",
            True,
            f"the {given} probes given lived only in the process that recorded the "
            "request, which stopped before verification",
        )
    failed = [c["name"] for c in checks if not c["passed"]]
    if failed:
        raise VerificationFailed("verification failed: " + ", ".join(failed))
    return {"checks": checks}


def _probe_hits(
    w: Wiring, req: ErasureRequest, probes: Sequence[str], store_steps: Sequence[str]
) -> int:
    """Search every remaining subject that shared derived assets with the erased
    one, by value and by meaning, for the probe strings."""
    owners = set()
    for step in store_steps:
        for action in req.doc["details"].get(step, {}).get("actions", []):
            owners.add(action["owner_subject_ref"])
    owners.discard(req.subject_ref)
    hits = 0
    for owner in sorted(owners):
        if w.catalog.guard(owner).status != ACTIVE:
            continue  # being erased too: that erasure verifies it
        hits += w.partitions.probe_hits(owner, probes)
    return hits
