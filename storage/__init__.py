"""``keyshred.storage``: the catalog, consent, policy and the memory store.

- ``catalog``: asset index, provenance, consent records, the subject guard
  (SQLAlchemy Core on SQLite or PostgreSQL);
- ``policy``: declared scopes, purposes, categories and retention;
- ``memories``: the memory store (``ks.memories``), over per-subject ``partition``s
  of PME-encrypted Parquet segments and an encrypted append log (``applog``);
- ``pme``: Parquet Modular Encryption with the keyring as its KMS;
- ``erasable``: ``Erasable``, the interface every store holding personal data
  implements for the erasure coordinator (erase, verify, evict).

Vector partitions and checkpoints are not built yet (issues #4 and #8).
"""

from __future__ import annotations

from keyshred.storage.catalog import AssetRow, Catalog, ConsentRecord, GuardState
from keyshred.storage.consent import ConsentApi
from keyshred.storage.erasable import Erasable, ErasureTarget, StoreCheck, StoreErasure
from keyshred.storage.memories import Memory, MemoryStore, PutItem
from keyshred.storage.policy import Policy, ScopeRule

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
