"""The envelope: AES-256-GCM ciphertexts with a versioned header, bound to their place.

Format version 1 (all integers big-endian)::

    offset  size  field
    0       2     magic  b"KS"
    2       1     format version (1)
    3       1     algorithm id (1 = AES-256-GCM, 96-bit random nonce, 128-bit tag)
    4       16    key id of the DEK that sealed it
    20      12    nonce
    32      n+16  ciphertext || tag

The associated data is ``b"keyshred/envelope\\x00" || header[0:20] || place``, where
``place`` is the length-prefixed encoding of (subject_ref, scope, table, record id,
column). A ciphertext copied to another row, column, scope or subject therefore fails
authentication exactly like a flipped byte, and every such failure is the same opaque
``IntegrityError``: callers learn that it failed, not why.

The key id is readable without any key so the keyring can decide that a ciphertext's
key was destroyed (``SubjectErased``) before it attempts any decryption.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import overload

from keyshred.errors import IntegrityError, InvalidInput
from keyshred.keyring import _primitives as prim

__all__ = [
    "ALG_AES256GCM",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "KEY_ID_BYTES",
    "OVERHEAD_BYTES",
    "Place",
    "PlaceTemplate",
    "aad_prefix_for",
    "header_for",
    "key_id_of",
    "open_rows_into",
    "open_with",
    "seal_rows",
    "seal_with",
]

MAGIC = b"KS"
FORMAT_VERSION = 1
ALG_AES256GCM = 1
KEY_ID_BYTES = 16
HEADER_BYTES = 4 + KEY_ID_BYTES  # magic, version, alg, key id
_PREFIX = MAGIC + bytes((FORMAT_VERSION, ALG_AES256GCM))
_BODY_START = HEADER_BYTES + prim.NONCE_BYTES
OVERHEAD_BYTES = _BODY_START + prim.TAG_BYTES
_AAD_DOMAIN = b"keyshred/envelope\x00"
_LEN = struct.Struct(">I")
_SLICE_LIMIT = 16 * 1024


def _encode_fields(*parts: str) -> bytes:
    out = bytearray()
    for part in parts:
        raw = part.encode("utf-8")
        out += _LEN.pack(len(raw))
        out += raw
    return bytes(out)


@dataclass(frozen=True, slots=True)
class Place:
    """Where a ciphertext belongs. Every field is bound into the associated data.

    Only pseudonymous values belong here (a subject_ref, never a subject id); record
    ids are keyshred's own random ids.
    """

    subject_ref: str
    scope: str
    table: str
    record_id: str
    column: str
    encoded: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "encoded",
            _encode_fields(self.subject_ref, self.scope, self.table, self.record_id, self.column),
        )


class PlaceTemplate:
    """Places that differ only in record id (one table and column of one subject and
    scope): ``encoded(record_id)`` equals ``Place(..., record_id, column).encoded``
    without encoding the other fields again, for the bulk loops."""

    __slots__ = ("_head", "_tail", "scope", "subject_ref")

    def __init__(self, subject_ref: str, scope: str, table: str, column: str) -> None:
        self.subject_ref = subject_ref
        self.scope = scope
        self._head = _encode_fields(subject_ref, scope, table)
        self._tail = _encode_fields(column)

    def encoded(self, record_id: str) -> bytes:
        raw = record_id.encode("utf-8")
        return b"".join((self._head, _LEN.pack(len(raw)), raw, self._tail))


def header_for(key_id: bytes) -> bytes:
    """The 20-byte header for ``key_id``; DEK objects compute it once."""
    if len(key_id) != KEY_ID_BYTES:
        raise InvalidInput("a key id is 16 bytes")
    return _PREFIX + key_id


def aad_prefix_for(header: bytes) -> bytes:
    """The fixed start of the associated data for one key (domain + header)."""
    return _AAD_DOMAIN + header


def _aad(aad_prefix: bytes, place: Place | bytes) -> bytes:
    """The associated data: the key's prefix, then the place (a ``Place`` or its
    encoding, e.g. from ``PlaceTemplate.encoded``). The only place it is built."""
    return aad_prefix + (place if isinstance(place, bytes) else place.encoded)


def key_id_of(ciphertext: bytes | bytearray | memoryview) -> bytes:
    """Read the key id from a ciphertext header without any key.

    Raises ``IntegrityError`` for anything that is not a well-formed version-1
    envelope (wrong magic, unknown version or algorithm, too short).
    """
    if (
        not isinstance(ciphertext, bytes | bytearray | memoryview)  # a column altered to text
        or len(ciphertext) < OVERHEAD_BYTES
        or bytes(ciphertext[:4]) != _PREFIX
    ):
        raise IntegrityError()
    return bytes(ciphertext[4:HEADER_BYTES])


# -- the pair ------------------------------------------------------------------------


@overload
def seal_with(
    aead: prim.AESGCM,
    header: bytes,
    aad_prefix: bytes,
    plaintext: bytes,
    place: Place | bytes,
    *,
    nonce: bytes | None = None,
) -> bytes: ...


@overload
def seal_with(
    aead: prim.AESGCM,
    header: bytes,
    aad_prefix: bytes,
    plaintext: bytes,
    place: Place | bytes,
    *,
    nonce: bytes | None = None,
    into: memoryview,
) -> None: ...


def seal_with(
    aead: prim.AESGCM,
    header: bytes,
    aad_prefix: bytes,
    plaintext: bytes,
    place: Place | bytes,
    *,
    nonce: bytes | None = None,
    into: memoryview | None = None,
) -> bytes | None:
    """Seal ``plaintext`` for ``place`` under a fresh random nonce (``nonce`` is only
    for test vectors).

    With ``into`` (a writable buffer of exactly ``OVERHEAD_BYTES + len(plaintext)``
    bytes) the envelope is written there and nothing is returned: AES-GCM writes
    straight behind the header, where returning ``bytes`` costs one more copy of the
    ciphertext (at 4 MiB that copy and its fresh pages cost more than the cipher).
    """
    if nonce is None:
        nonce = prim.random_nonce()
    aad = _aad(aad_prefix, place)
    if into is None:
        return header + nonce + aead.encrypt(nonce, plaintext, aad)
    if len(into) != OVERHEAD_BYTES + len(plaintext):
        raise InvalidInput("the output buffer is not the envelope's size")
    into[:HEADER_BYTES] = header
    into[HEADER_BYTES:_BODY_START] = nonce
    aead.encrypt_into(nonce, plaintext, aad, into[_BODY_START:])
    return None


@overload
def open_with(
    aead: prim.AESGCM,
    header: bytes,
    aad_prefix: bytes,
    ciphertext: bytes | bytearray | memoryview,
    place: Place | bytes,
) -> bytes: ...


@overload
def open_with(
    aead: prim.AESGCM,
    header: bytes,
    aad_prefix: bytes,
    ciphertext: bytes | bytearray | memoryview,
    place: Place | bytes,
    *,
    into: memoryview,
) -> None: ...


def open_with(
    aead: prim.AESGCM,
    header: bytes,
    aad_prefix: bytes,
    ciphertext: bytes | bytearray | memoryview,
    place: Place | bytes,
    *,
    into: memoryview | None = None,
) -> bytes | None:
    """Open a ciphertext whose header the caller already matched to ``aead``'s key.

    With ``into`` (a writable buffer of exactly the plaintext's size) the plaintext
    is written there and nothing is returned: the bulk loops fill their output
    without a copy.
    """
    if len(ciphertext) < OVERHEAD_BYTES or ciphertext[:HEADER_BYTES] != header:
        raise IntegrityError()
    aad = _aad(aad_prefix, place)
    try:
        if into is not None:  # a view's slices are views: no copy of the body
            aead.decrypt_into(
                ciphertext[HEADER_BYTES:_BODY_START], ciphertext[_BODY_START:], aad, into
            )
            return None
        if len(ciphertext) <= _SLICE_LIMIT:
            # Small records: slicing copies a few hundred bytes, cheaper than views.
            return aead.decrypt(ciphertext[HEADER_BYTES:_BODY_START], ciphertext[_BODY_START:], aad)
        view = memoryview(ciphertext)
        return aead.decrypt(view[HEADER_BYTES:_BODY_START], view[_BODY_START:], aad)
    except prim.InvalidTag:
        raise IntegrityError() from None


# -- bulk loops on top of the pair ---------------------------------------------------


def seal_rows(
    aead: prim.AESGCM,
    header: bytes,
    aad_prefix: bytes,
    items: Sequence[tuple[str, bytes]],
    template: PlaceTemplate,
) -> list[bytes]:
    """``seal_with`` for ``(record id, plaintext)`` pairs of one place template."""
    place = template.encoded
    return [
        seal_with(aead, header, aad_prefix, plaintext, place(record_id))
        for record_id, plaintext in items
    ]


def open_rows_into(
    aead: prim.AESGCM,
    header: bytes,
    aad_prefix: bytes,
    data: bytes,
    *,
    starts: Sequence[int],
    template: PlaceTemplate,
    record_ids: Sequence[str],
    out: memoryview,
    out_rows: Sequence[int],
    width: int,
) -> None:
    """``open_with`` for equally sized ciphertexts laid end to end in ``data`` (at
    ``starts``), all of one key and one place template, straight into rows of ``out``
    (row ``out_rows[i]`` is ``width`` bytes at ``out_rows[i] * width``): the bulk
    path of a vector partition."""
    view = memoryview(data)
    size = OVERHEAD_BYTES + width
    place = template.encoded
    for start, record_id, row in zip(starts, record_ids, out_rows, strict=True):
        if start < 0 or start + size > len(data):
            raise IntegrityError()
        open_with(
            aead,
            header,
            aad_prefix,
            view[start : start + size],
            place(record_id),
            into=out[row * width : (row + 1) * width],
        )
