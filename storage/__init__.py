"""``keyshred.storage``: the catalog, consent, policy and the memory store.

- ``catalog`` (with ``catalog_*``): asset index, provenance, identifiers, consent
  records, the subject guard (SQLAlchemy Core on SQLite or PostgreSQL); its tables
  in ``schema``;
- ``policy``: declared scopes, purposes, categories and retention;
- ``memories``: the memory store (``ks.memories``; its parts in ``memory_*``), over
  per-subject ``partition``s: PME-encrypted Parquet segments and sealed
  hot rows in the catalog (``hot``), segment objects (``objects``), subject locks
  (``subject_lock``), the row format (``rowcodec``);
- ``vectors``: sealed vectors as rows of the catalog (``ks_mem_vectors``; LanceDB
  datasets of the layout before revision 0013 are imported); ``checkpoints``: the
  LangGraph thread engine; ``mentions``: registered identifiers and detected mentions;
- ``pme``: Parquet Modular Encryption with the keyring as its KMS;
- ``erasable``: ``Erasable``, the interface every store holding personal data
  implements for the erasure coordinator (erase, verify, evict);
- ``events``: the eviction event a suppression publishes (PostgreSQL ``NOTIFY``, an
  in-process bus on SQLite) and the listener thread each handle runs.

The names below load on first use (PEP 562): importing one submodule does not
import the others (``keyshred.storage.policy`` alone needs no pyarrow).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keyshred.storage.catalog import AssetRow, Catalog, ConsentRecord, GuardState
    from keyshred.storage.consent import ConsentApi
    from keyshred.storage.erasable import Erasable, ErasureTarget, StoreCheck, StoreErasure
    from keyshred.storage.memories import Memory, MemoryStore, PutItem
    from keyshred.storage.policy import Policy, ScopeRule

_LAZY = {
    "AssetRow": "keyshred.storage.catalog",
    "Catalog": "keyshred.storage.catalog",
    "ConsentApi": "keyshred.storage.consent",
    "ConsentRecord": "keyshred.storage.catalog",
    "Erasable": "keyshred.storage.erasable",
    "ErasureTarget": "keyshred.storage.erasable",
    "GuardState": "keyshred.storage.catalog",
    "Memory": "keyshred.storage.memories",
    "MemoryStore": "keyshred.storage.memories",
    "Policy": "keyshred.storage.policy",
    "PutItem": "keyshred.storage.memories",
    "ScopeRule": "keyshred.storage.policy",
    "StoreCheck": "keyshred.storage.erasable",
    "StoreErasure": "keyshred.storage.erasable",
}

__all__ = [
    "AssetRow",
    "Catalog",
    "ConsentApi",
    "ConsentRecord",
    "Erasable",
    "ErasureTarget",
    "GuardState",
    "Memory",
    "MemoryStore",
    "Policy",
    "PutItem",
    "ScopeRule",
    "StoreCheck",
    "StoreErasure",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
