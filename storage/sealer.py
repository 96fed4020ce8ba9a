"""How storage encrypts small records: through the keyring, or (benchmarks only) not.

``KeyringSealer`` seals with the subject's scope DEK through the envelope.
``PlaintextSealer`` exists so benchmarks can run *the same engine* with encryption
off and print what encryption costs; nothing in the public API selects it.
"""

from __future__ import annotations

from typing import Protocol

from keyshred.keyring.envelope import Place
from keyshred.keyring.keyring import Keyring

__all__ = ["KeyringSealer", "PlaintextSealer", "Sealer"]


class Sealer(Protocol):
    encrypted: bool

    def seal(self, plaintext: bytes, place: Place, *, create: bool = True) -> bytes:
        """``create=False``: never create the scope's key (a compaction rewrites
        rows a put sealed under it; if it is gone, the scope was crypto-erased)."""
        ...

    def open(self, ciphertext: bytes, place: Place) -> bytes: ...


class KeyringSealer:
    encrypted = True

    def __init__(self, keyring: Keyring) -> None:
        self._keyring = keyring

    def seal(self, plaintext: bytes, place: Place, *, create: bool = True) -> bytes:
        if create:
            return self._keyring.seal(plaintext, place)
        key = self._keyring.data_key(place.subject_ref, place.scope, create=False)
        return key.seal(plaintext, place)

    def open(self, ciphertext: bytes, place: Place) -> bytes:
        return self._keyring.open(ciphertext, place)


class PlaintextSealer:
    encrypted = False

    def seal(self, plaintext: bytes, place: Place, *, create: bool = True) -> bytes:
        del place, create
        return plaintext

    def open(self, ciphertext: bytes, place: Place) -> bytes:
        del place
        return ciphertext
