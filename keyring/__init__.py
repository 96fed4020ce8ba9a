"""``keyshred.keyring``: envelope encryption and the per-subject key hierarchy.

Layers, bottom up: ``_primitives`` (the only module that touches raw crypto),
``envelope`` (the versioned AES-256-GCM format bound to a ``Place``), ``kek`` (KEK
providers: local, vault, aws), ``keystore`` (wrapped DEKs, tombstones), ``cache`` and
``keyring`` (the DEK lifecycle).

The names below load on first use (PEP 562): importing one submodule does not
import the others (``keyshred.keyring.envelope`` alone needs no SQLAlchemy).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keyshred.keyring.cache import KeyCache
    from keyshred.keyring.datakey import DataKey
    from keyshred.keyring.envelope import OVERHEAD_BYTES, Place, key_id_of
    from keyshred.keyring.kek import DestroyedEpoch, EpochInfo, KekProvider, WrappedKey
    from keyshred.keyring.kek.local import LocalKek
    from keyshred.keyring.keyring import (
        DestroyResult,
        Keyring,
        RotationResult,
        Signer,
        verify_signature,
    )
    from keyshred.keyring.keystore import KeyRecord, KeyStore, SQLiteKeyStore, Tombstone

_LAZY = {
    "DataKey": "keyshred.keyring.datakey",
    "DestroyedEpoch": "keyshred.keyring.kek",
    "DestroyResult": "keyshred.keyring.keyring",
    "EpochInfo": "keyshred.keyring.kek",
    "KekProvider": "keyshred.keyring.kek",
    "key_id_of": "keyshred.keyring.envelope",
    "KeyCache": "keyshred.keyring.cache",
    "KeyRecord": "keyshred.keyring.keystore",
    "Keyring": "keyshred.keyring.keyring",
    "KeyStore": "keyshred.keyring.keystore",
    "LocalKek": "keyshred.keyring.kek.local",
    "OVERHEAD_BYTES": "keyshred.keyring.envelope",
    "Place": "keyshred.keyring.envelope",
    "RotationResult": "keyshred.keyring.keyring",
    "Signer": "keyshred.keyring.keyring",
    "SQLiteKeyStore": "keyshred.keyring.keystore",
    "Tombstone": "keyshred.keyring.keystore",
    "verify_signature": "keyshred.keyring.keyring",
    "WrappedKey": "keyshred.keyring.kek",
}

__all__ = [
    "OVERHEAD_BYTES",
    "DataKey",
    "DestroyResult",
    "DestroyedEpoch",
    "EpochInfo",
    "KekProvider",
    "KeyCache",
    "KeyRecord",
    "KeyStore",
    "Keyring",
    "LocalKek",
    "Place",
    "RotationResult",
    "SQLiteKeyStore",
    "Signer",
    "Tombstone",
    "WrappedKey",
    "key_id_of",
    "verify_signature",
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
