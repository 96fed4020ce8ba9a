"""The erasure receipt, built from what the request recorded: the keys destroyed,
each store's ``StoreErasure`` (unchanged), the catalog, backups, derived actions,
external calls and verification checks."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from keyshred.erasure.requests import ErasureRequest
from keyshred.receipts import (
    Check,
    DerivedAction,
    ExternalCall,
    Receipt,
    ReceiptMetrics,
    SharedKey,
    StoreAction,
)
from keyshred.storage.erasable import StoreErasure

__all__ = ["build_receipt", "found_data"]


def found_data(details: dict[str, Any], store_steps: Sequence[str]) -> bool:
    """Whether a request found anything of the subject: a key (every stored value
    has one), a catalog asset, or a store that says it held something (tokens,
    threads, rebuilt assets). File counts do not tell: a partition folder may hold
    nothing but its lock file."""
    return bool(
        details["destroy_keys"]["key_ids"]
        or details["catalog"]["assets"]
        or any(StoreErasure.from_doc(details[s]).found for s in store_steps if s in details)
    )


def build_receipt(
    req: ErasureRequest,
    store_steps: Sequence[str],
    completed: datetime,
    backups: Any,
    metrics: ReceiptMetrics | None = None,
) -> Receipt:
    d = req.doc["details"]
    keys = d["destroy_keys"]
    results = [StoreErasure.from_doc(d[s]) for s in store_steps if s in d]
    stores = [
        StoreAction(
            store="keyring", action="keys-destroyed", count=len(keys["key_ids"]), at=keys["at"]
        ),
        *(StoreAction(store=r.store, action=r.action, count=r.count, at=r.at) for r in results),
        StoreAction(
            store="catalog",
            action="assets-deleted",
            count=d["catalog"]["assets"],
            at=d["catalog"]["at"],
        ),
    ]
    if d["catalog"].get("packages"):  # (requests from before the step counted them: absent)
        stores.append(
            StoreAction(
                store="api",
                action="access-packages-dropped",
                count=d["catalog"]["packages"],
                at=d["catalog"]["at"],
            )
        )
    if d.get("backups", {}).get("targets"):
        stores.append(
            StoreAction(
                store="backups",
                action="segments-deleted-all-versions"
                if req.scope is None
                else "tombstone-journaled",
                count=d["backups"]["objects_deleted"],
                at=d["backups"]["at"],
            )
        )
    for kind, n in sorted(d["closure"]["own_counts"].items()):
        stores.append(
            StoreAction(store="catalog", action=f"{kind}-assets", count=n, at=d["catalog"]["at"])
        )
    residue = (
        keys.get("live_residue_until") if keys["key_ids"] else None,
        req.doc.get("swept_residue_until"),
    )
    return Receipt(
        found_data=bool(req.doc["found_data"]),
        request_id=req.request_id,
        subject_ref=req.subject_ref,
        scope=req.scope,
        requested_by=req.requested_by,
        reason=req.reason,
        requested_at=req.created_at,
        suppressed_at=d["suppress"]["at"],
        keys_destroyed_at=keys["at"],
        online_erased_at=keys["at"],
        completed_at=completed,
        key_ids=keys["key_ids"],
        tombstone_id=keys["tombstone_id"],
        live_residue_until=max(
            (datetime.fromisoformat(t) for t in residue if t),
            default=None,
        ),
        stores=stores,
        derived=[DerivedAction(**a) for r in results for a in r.items],
        external=[ExternalCall(**c) for c in d["external"]["calls"]],
        verification=[Check(**c) for c in d["verify"]["checks"]],
        backups=backups,
        legal_hold_history=bool(req.doc.get("held")),
        kind=req.doc.get("kind", "erasure"),
        assets=list(req.doc.get("assets", [])),
        shared_keys=[SharedKey(**k) for k in d["closure"].get("shared", [])],
        metrics=metrics,
        identity=req.doc.get("identity"),
    )
