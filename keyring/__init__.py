"""``keyshred.keyring``: envelope encryption and the per-subject key hierarchy.

Layers, bottom up: ``_primitives`` (the only module that touches raw crypto),
``envelope`` (the versioned AES-256-GCM format bound to a ``Place``), ``kek`` (KEK
providers: local, vault, aws), ``keystore`` (wrapped DEKs, tombstones), ``cache`` and
``keyring`` (the DEK lifecycle).
"""

from __future__ import annotations

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
