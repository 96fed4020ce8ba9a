"""KEK providers: the key-encryption keys that wrap every DEK.

A provider is deliberately small (Tink's ``KmsClient`` is the model): ``wrap`` and
``unwrap`` a 32-byte DEK bound to a context, batch twins of both, and the epoch
lifecycle (``current_epoch``, ``rotate``, ``destroy_epochs_before``). Epochs are the
provider's key versions; a wrapped DEK records the epoch that wrapped it, and once an
epoch is destroyed nothing it wrapped can be unwrapped again, whichever copy of the
key store (a backup, a snapshot) it comes from.

Backends live beside this module, one each: ``local`` (embedded default, a key file),
``vault`` (HashiCorp Vault / OpenBao Transit, ``keyshred[vault]``) and ``aws`` (AWS KMS,
``keyshred[aws]``). Only ``local`` is imported eagerly.
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

__all__ = [
    "Context",
    "DestroyedEpoch",
    "EpochInfo",
    "KekProvider",
    "WrappedKey",
    "encode_context",
]

Context = Mapping[str, str]
"""Associated data for a wrap: pseudonymous names only (key id, subject_ref, scope)."""

_LEN = struct.Struct(">I")


def encode_context(context: Context) -> bytes:
    """Canonical, unambiguous bytes for a context (sorted, length-prefixed)."""
    parts: list[bytes] = []
    pack = _LEN.pack
    for name in sorted(context):
        key, value = name.encode("utf-8"), context[name].encode("utf-8")
        parts += (pack(len(key)), key, pack(len(value)), value)
    return b"".join(parts)


@dataclass(frozen=True, slots=True)
class WrappedKey:
    """A DEK wrapped by one KEK epoch; ``blob`` is the provider's own ciphertext."""

    epoch: int
    blob: bytes

    def __repr__(self) -> str:
        return f"WrappedKey(epoch={self.epoch}, blob=<{len(self.blob)} bytes>)"


@dataclass(frozen=True, slots=True)
class EpochInfo:
    """A live epoch and when it was created."""

    epoch: int
    created_at: datetime


@dataclass(frozen=True, slots=True)
class DestroyedEpoch:
    """An epoch destroyed by ``destroy_epochs_before``.

    ``effective_at`` is when the provider can no longer unwrap with it anywhere: now
    for the local file and Transit (trimmed at once), the end of the pending-deletion
    window for AWS KMS (the key is disabled at once, deleted then).
    """

    epoch: int
    effective_at: datetime


class KekProvider(ABC):
    """Wraps and unwraps DEKs under versioned key-encryption keys."""

    name: str = "abstract"

    @abstractmethod
    def current_epoch(self) -> int:
        """The epoch that new wraps use."""

    @abstractmethod
    def epochs(self) -> list[EpochInfo]:
        """Every epoch that can still unwrap, oldest first."""

    @abstractmethod
    def wrap(self, key: bytes, context: Context) -> WrappedKey:
        """Wrap ``key`` under the current epoch, bound to ``context``."""

    @abstractmethod
    def unwrap(self, wrapped: WrappedKey, context: Context) -> bytes:
        """Unwrap; ``KekEpochDestroyed`` if its epoch is gone, ``IntegrityError`` if
        the blob or context do not authenticate, ``KekUnavailable`` if unreachable."""

    def wrap_many(self, items: Sequence[tuple[bytes, Context]]) -> list[WrappedKey]:
        """Wrap several keys; backends with a batch API override this."""
        return [self.wrap(key, context) for key, context in items]

    def unwrap_many(self, items: Sequence[tuple[WrappedKey, Context]]) -> list[bytes]:
        """Unwrap several keys; the first failure raises (all-or-nothing)."""
        return [self.unwrap(wrapped, context) for wrapped, context in items]

    def rewrap_many(self, items: Sequence[tuple[WrappedKey, Context]]) -> list[WrappedKey]:
        """Re-wrap under the current epoch (KEK rotation); the data is not touched."""
        keys = self.unwrap_many(items)
        pairs = [(key, context) for key, (_, context) in zip(keys, items, strict=True)]
        return self.wrap_many(pairs)

    @abstractmethod
    def rotate(self) -> int:
        """Create a new epoch, make it current, and return it."""

    @abstractmethod
    def destroy_epochs_before(self, epoch: int) -> list[DestroyedEpoch]:
        """Destroy every epoch older than ``epoch`` (which must exist); idempotent."""

    def close(self) -> None:  # noqa: B027 - optional hook, most providers hold nothing
        """Release connections."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
