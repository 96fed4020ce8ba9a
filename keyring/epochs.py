"""Two-level KEK lineages: epoch keys wrap DEKs locally, the provider wraps epoch keys.

A lineage (``live`` or ``archive``) is a sequence of epochs. Each epoch has one random
32-byte **epoch key**, wrapped by the KEK provider's key version of the same number and
kept in the key store's epoch-key table (the live lineage) or in a backup generation
(the archive lineage). Every DEK and system secret is wrapped by an epoch key with
AES-256-GCM in this process, bound by associated data to its context plus the lineage
and epoch, so:

- a rotation costs one provider ``rotate`` and one ``wrap`` whatever the number of
  DEKs; re-wrapping them is local work (microseconds each);
- destroying an epoch deletes its epoch-key row and destroys the provider's key
  version, so every copy of that epoch key (dead tuples, WAL, replicas, backups of the
  database) is useless, and with it every DEK wrapping it ever protected.

A wrapped record names its lineage in ``kek_provider`` as ``<provider>@<lineage>``; a
record with a bare provider name was wrapped by the provider directly (a store made
before the lineages existed): it keeps unwrapping through the provider until the first
rotation re-wraps it under an epoch key.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable, Iterable
from datetime import datetime

from keyshred.errors import IntegrityError, KekEpochDestroyed, KekError
from keyshred.keyring import _primitives as prim
from keyshred.keyring.kek import Context, KekProvider, WrappedKey, encode_context
from keyshred.keyring.keystore import LIVE_LINEAGE, EpochKeyRecord, KeyStore

__all__ = [
    "ARCHIVE",
    "LIVE",
    "Lineage",
    "bound_context",
    "epoch_key_context",
    "lineage_of",
    "marker",
    "wrap_aad",
]

LIVE = LIVE_LINEAGE
ARCHIVE = "archive"
_WRAP_DOMAIN = b"keyshred/epoch-wrap\x00"
WRAPPED_BYTES = prim.NONCE_BYTES + prim.KEY_BYTES + prim.TAG_BYTES
_CURRENT_TTL = 60.0  # seconds a process trusts its view of the current live epoch
_LEN = struct.Struct(">I")
_EPOCH = struct.Struct(">Q")


def marker(provider_name: str, lineage: str) -> str:
    """The ``kek_provider`` value of a record wrapped by an epoch key of ``lineage``."""
    return f"{provider_name}@{lineage}"


def lineage_of(kek_provider: str) -> str | None:
    """The lineage a record's ``kek_provider`` names; None: wrapped by the provider."""
    _, at, lineage = kek_provider.partition("@")
    return lineage if at else None


def epoch_key_context(lineage: str, epoch: int) -> Context:
    """What the provider binds an epoch key to: its lineage and epoch."""
    return {"keyshred:kind": "epoch-key", "keyshred:lineage": lineage, "keyshred:epoch": str(epoch)}


def bound_context(context: Context, lineage: str, epoch: int) -> Context:
    """A DEK's or secret's context bound to the epoch key that wraps it."""
    return {**context, "keyshred:lineage": lineage, "keyshred:epoch": str(epoch)}


def wrap_aad(lineage: str, epoch: int, encoded_context: bytes) -> bytes:
    """The associated data of a local wrap: the domain, the lineage and epoch (a
    self-delimiting prefix), then the record's context encoding (``encode_context``).
    The prefix comes first so a re-wrap encodes the context once for both epochs."""
    name = lineage.encode("utf-8")
    return _WRAP_DOMAIN + _LEN.pack(len(name)) + name + _EPOCH.pack(epoch) + encoded_context


class Lineage:
    """The epoch keys of one lineage for one keyring: creation, cached unwrap, and
    the local wrap and unwrap of DEKs and secrets."""

    def __init__(
        self,
        store: Callable[[], KeyStore],
        provider: KekProvider,
        name: str,
        clock: Callable[[], datetime],
    ) -> None:
        self._store = store
        self.provider = provider
        self.name = name
        self.marker = marker(provider.name, name)
        self._clock = clock
        self._lock = threading.Lock()
        self._keys: dict[int, prim.AESGCM] = {}
        self._current: EpochKeyRecord | None = None
        self._current_read = 0.0

    # -- epoch keys ----------------------------------------------------------------

    def records(self) -> list[EpochKeyRecord]:
        """The lineage's epoch keys in the key store, oldest first."""
        return self._store().epoch_keys(self.name)

    def current(self, *, refresh: bool = False) -> EpochKeyRecord:
        """The newest epoch key (made at the provider's current version if there is
        none yet: a new store, or one made before the lineages existed)."""
        with self._lock:
            fresh = time.monotonic() - self._current_read < _CURRENT_TTL
            if self._current is not None and fresh and not refresh:
                return self._current
        records = self.records()
        record = records[-1] if records else self.new_epoch(rotate=False)[0]
        with self._lock:
            self._current, self._current_read = record, time.monotonic()
        return record

    def new_epoch(
        self, *, rotate: bool = True, persist: bool = True
    ) -> tuple[EpochKeyRecord, bytes]:
        """A fresh epoch key wrapped by the provider (after ``rotate`` if asked):
        one provider ``wrap`` (and one ``rotate``). Persisted in the key store unless
        told not to (archive epochs live in their backup generation). Returns the
        record and the raw key; the raw key is also cached for this process."""
        epoch = self.provider.rotate() if rotate else self.provider.current_epoch()
        raw = prim.random_key()
        for _ in range(3):
            wrapped = self.provider.wrap(raw, epoch_key_context(self.name, epoch))
            if wrapped.epoch == epoch:
                break
            epoch = wrapped.epoch  # another process rotated in between: bind to it
        else:  # pragma: no cover - a provider rotating faster than we can wrap
            raise KekError("the KEK provider kept rotating while an epoch key was wrapped")
        record = EpochKeyRecord(
            self.name, epoch, self.provider.name, wrapped.epoch, wrapped.blob, self._clock()
        )
        if persist:
            record = self._store().insert_epoch_key(record)
            if record.wrapped != wrapped.blob:  # another writer's key won
                return record, self._unwrap_epoch_key(record)
        with self._lock:
            self._keys[record.epoch] = prim.new_aead(raw)
            if persist:
                self._current, self._current_read = record, time.monotonic()
        return record, raw

    def _unwrap_epoch_key(self, record: EpochKeyRecord) -> bytes:
        return self.provider.unwrap(
            WrappedKey(record.provider_epoch, record.wrapped),
            epoch_key_context(self.name, record.epoch),
        )

    def _aead(self, epoch: int) -> prim.AESGCM:
        with self._lock:
            aead = self._keys.get(epoch)
        if aead is not None:
            return aead
        record = next((r for r in self.records() if r.epoch == epoch), None)
        if record is None:
            raise KekEpochDestroyed(f"{self.name} KEK epoch {epoch} is destroyed")
        aead = prim.new_aead(self._unwrap_epoch_key(record))
        with self._lock:
            self._keys[epoch] = aead
        return aead

    def remember(self, epoch: int, raw: bytes) -> None:
        """Cache an epoch key already unwrapped (a restore's archive key)."""
        with self._lock:
            self._keys[epoch] = prim.new_aead(raw)

    def forget(self, epochs: Iterable[int] | None = None) -> None:
        """Drop cached epoch keys (all of them, or these epochs)."""
        with self._lock:
            if epochs is None:
                self._keys.clear()
            else:
                for epoch in epochs:
                    self._keys.pop(epoch, None)
            self._current = None

    # -- local wrap ----------------------------------------------------------------

    def wrap(self, key: bytes, context: Context, epoch: int) -> bytes:
        return self.wrap_encoded(key, encode_context(context), epoch)

    def unwrap(self, blob: bytes, context: Context, epoch: int) -> bytes:
        return self.unwrap_encoded(blob, encode_context(context), epoch)

    def wrap_encoded(self, key: bytes, encoded_context: bytes, epoch: int) -> bytes:
        """``wrap`` with the context already encoded (``encode_context``)."""
        nonce = prim.random_nonce()
        aad = wrap_aad(self.name, epoch, encoded_context)
        return nonce + self._aead(epoch).encrypt(nonce, key, aad)

    def unwrap_encoded(self, blob: bytes, encoded_context: bytes, epoch: int) -> bytes:
        aead = self._aead(epoch)
        if len(blob) != WRAPPED_BYTES:
            raise IntegrityError("wrapped key failed authentication")
        try:
            return aead.decrypt(
                blob[: prim.NONCE_BYTES],
                blob[prim.NONCE_BYTES :],
                wrap_aad(self.name, epoch, encoded_context),
            )
        except prim.InvalidTag:
            raise IntegrityError("wrapped key failed authentication") from None

    def __repr__(self) -> str:
        return f"Lineage(name={self.name!r}, provider={self.provider!r})"
