"""``keyshred.storage``: the catalog, consent, policy and the memory store.

- ``catalog``: asset index, provenance, consent records, the subject guard
  (SQLAlchemy Core on SQLite or PostgreSQL);
- ``policy``: declared scopes, purposes, categories and retention;
- ``memories``: the memory store (``ks.memories``), over per-subject ``partition``s
  of PME-encrypted Parquet segments and an encrypted append log (``applog``);
- ``pme``: Parquet Modular Encryption with the keyring as its KMS.

Vector partitions and checkpoints are not built yet (issues #4 and #8).

The names below load on first use (PEP 562): importing one submodule does not
import the others (``keyshred.storage.policy`` alone needs no pyarrow).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keyshred.storage.catalog import AssetRow, Catalog, ConsentRecord, GuardState
    from keyshred.storage.consent import ConsentApi
    from keyshred.storage.memories import Memory, MemoryStore, PutItem
    from keyshred.storage.policy import Policy, ScopeRule

_LAZY = {
    "AssetRow": "keyshred.storage.catalog",
    "Catalog": "keyshred.storage.catalog",
    "ConsentApi": "keyshred.storage.consent",
    "ConsentRecord": "keyshred.storage.catalog",
    "GuardState": "keyshred.storage.catalog",
    "Memory": "keyshred.storage.memories",
    "MemoryStore": "keyshred.storage.memories",
    "Policy": "keyshred.storage.policy",
    "PutItem": "keyshred.storage.memories",
    "ScopeRule": "keyshred.storage.policy",
}

__all__ = [
    "AssetRow",
    "Catalog",
    "ConsentApi",
    "ConsentRecord",
    "GuardState",
    "Memory",
    "MemoryStore",
    "Policy",
    "PutItem",
    "ScopeRule",
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
