"""``DataKey``: an unwrapped DEK, usable only through seal/open.

The raw key bytes never leave this object: there is no accessor, ``repr`` shows only
the key id and owner, and pickling or copying raises, so a DEK cannot travel into a
log line, a task queue or a core dump of a serialized object by accident.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn, overload

from keyshred.errors import InvalidInput
from keyshred.keyring import _primitives as prim
from keyshred.keyring.envelope import (
    Place,
    PlaceTemplate,
    aad_prefix_for,
    header_for,
    open_rows_into,
    open_with,
    seal_rows,
    seal_with,
)

__all__ = ["DataKey"]


class DataKey:
    """One subject's scope key (or a key it shares with the other subjects its data
    is about), unwrapped, in memory."""

    __slots__ = (
        "_aad",
        "_aead",
        "_derive_key",
        "header",
        "key_id",
        "owner_tag",
        "scope",
        "subject_ref",
    )

    def __init__(
        self, key_id: bytes, subject_ref: str, scope: str, raw: bytes, owner_tag: str = ""
    ) -> None:
        if len(raw) != prim.KEY_BYTES:
            raise InvalidInput("a DEK is 32 bytes")
        self.key_id = key_id
        # The holder and scope: a shared key (``owner_tag`` not "") seals the holder's
        # rows like the scope key does, and is destroyed when any of its owners is.
        self.subject_ref = subject_ref
        self.scope = scope
        self.owner_tag = owner_tag
        self.header = header_for(key_id)
        self._aad = aad_prefix_for(self.header)
        self._aead = prim.new_aead(raw)
        # Sub-keys (deterministic tokens, keyed lookups) come from a derivation key,
        # so the DEK itself is only ever used for AES-GCM.
        self._derive_key = prim.hmac_sha256(raw, b"keyshred/dek-derive")

    @overload
    def seal(self, plaintext: bytes, place: Place) -> bytes: ...

    @overload
    def seal(self, plaintext: bytes, place: Place, *, into: memoryview) -> None: ...

    def seal(
        self, plaintext: bytes, place: Place, *, into: memoryview | None = None
    ) -> bytes | None:
        """Encrypt ``plaintext`` bound to ``place`` (which must be this key's owner);
        with ``into`` (``OVERHEAD_BYTES + len(plaintext)`` writable bytes) the
        envelope is written there instead of returned (large payloads: no copy)."""
        if place.subject_ref != self.subject_ref or place.scope != self.scope:
            raise InvalidInput("the place does not belong to this key's subject and scope")
        if into is None:
            return seal_with(self._aead, self.header, self._aad, plaintext, place)
        return seal_with(self._aead, self.header, self._aad, plaintext, place, into=into)

    def seal_rows(self, items: Sequence[tuple[str, bytes]], template: PlaceTemplate) -> list[bytes]:
        """``seal`` for many ``(record id, plaintext)`` pairs of one place template
        (one table and column of this key's subject and scope)."""
        if template.subject_ref != self.subject_ref or template.scope != self.scope:
            raise InvalidInput("the place does not belong to this key's subject and scope")
        return seal_rows(self._aead, self.header, self._aad, items, template)

    def open(self, ciphertext: bytes | bytearray | memoryview, place: Place) -> bytes:
        """Decrypt; ``IntegrityError`` unless sealed by this key for exactly ``place``."""
        return open_with(self._aead, self.header, self._aad, ciphertext, place)

    def open_encoded(self, ciphertext: bytes, place_encoded: bytes) -> bytes:
        """``open`` with a pre-encoded place (``PlaceTemplate.encoded``), for bulk reads."""
        return open_with(self._aead, self.header, self._aad, ciphertext, place_encoded)

    def open_rows_into(
        self,
        data: bytes,
        *,
        starts: Sequence[int],
        template: PlaceTemplate,
        record_ids: Sequence[str],
        out: memoryview,
        out_rows: Sequence[int],
        width: int,
    ) -> None:
        """Bulk ``open`` of equally sized ciphertexts into rows of ``out``
        (see ``envelope.open_rows_into``)."""
        open_rows_into(
            self._aead,
            self.header,
            self._aad,
            data,
            starts=starts,
            template=template,
            record_ids=record_ids,
            out=out,
            out_rows=out_rows,
            width=width,
        )

    def derive(self, label: bytes) -> bytes:
        """A 32-byte sub-key for ``label``; destroyed with the DEK."""
        return prim.hmac_sha256(self._derive_key, b"keyshred/derive\x00" + label)

    def _seal_with_nonce(self, plaintext: bytes, place: Place, nonce: bytes) -> bytes:
        """Deterministic sealing for test vectors only."""
        return seal_with(self._aead, self.header, self._aad, plaintext, place, nonce=nonce)

    def __repr__(self) -> str:
        return (
            f"DataKey(key_id={self.key_id.hex()!r}, subject_ref={self.subject_ref!r}, "
            f"scope={self.scope!r}{', shared' if self.owner_tag else ''})"
        )

    def __reduce__(self) -> NoReturn:
        raise TypeError("a DataKey cannot be pickled or copied")

    def __copy__(self) -> NoReturn:
        raise TypeError("a DataKey cannot be pickled or copied")

    def __deepcopy__(self, memo: object) -> NoReturn:
        raise TypeError("a DataKey cannot be pickled or copied")
