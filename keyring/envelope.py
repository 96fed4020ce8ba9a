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
    "key_id_of",
    "open_rows_into",
    "open_with",
    "seal_into_buffer",
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
    """Places that differ only in record id, encoded without re-encoding the rest
    (bulk decryption of one table of one subject and scope)."""

    __slots__ = ("_head", "_tail", "scope", "subject_ref")

    def __init__(self, subject_ref: str, scope: str, table: str, column: str) -> None:
        self.subject_ref = subject_ref
        self.scope = scope
        self._head = _encode_fields(subject_ref, scope, table)
        self._tail = _encode_fields(column)

    def encoded(self, record_id: str) -> bytes:
        raw = record_id.encode("utf-8")
        return self._head + _LEN.pack(len(raw)) + raw + self._tail


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
    """Open equally sized ciphertexts laid end to end in ``data`` (at ``starts``),
    all of one key and one place template, straight into rows of ``out`` (row
    ``out_rows[i]`` is ``width`` bytes at ``out_rows[i] * width``).

    This is the bulk path of a vector partition: one tight loop, no per-row
    allocation beyond the associated data, the same checks as ``open_with``.
    """
    head = aad_prefix + template._head
    tail = template._tail
    pack = _LEN.pack
    decrypt_into = aead.decrypt_into
    view = memoryview(data)
    size = OVERHEAD_BYTES + width
    join = b"".join
    end = len(data)
    try:
        for start, record_id, row in zip(starts, record_ids, out_rows, strict=True):
            if start + size > end or data[start : start + HEADER_BYTES] != header:
                raise IntegrityError()
            raw = record_id.encode("utf-8")
            decrypt_into(
                data[start + HEADER_BYTES : start + _BODY_START],
                view[start + _BODY_START : start + size],
                join((head, pack(len(raw)), raw, tail)),
                out[row * width : (row + 1) * width],
            )
    except prim.InvalidTag:
        raise IntegrityError() from None


def header_for(key_id: bytes) -> bytes:
    """The 20-byte header for ``key_id``; DEK objects compute it once."""
    if len(key_id) != KEY_ID_BYTES:
        raise InvalidInput("a key id is 16 bytes")
    return _PREFIX + key_id


def aad_prefix_for(header: bytes) -> bytes:
    """The fixed start of the associated data for one key (domain + header)."""
    return _AAD_DOMAIN + header


def key_id_of(ciphertext: bytes | bytearray | memoryview) -> bytes:
    """Read the key id from a ciphertext header without any key.

    Raises ``IntegrityError`` for anything that is not a well-formed version-1
    envelope (wrong magic, unknown version or algorithm, too short).
    """
    if len(ciphertext) < OVERHEAD_BYTES or bytes(ciphertext[:4]) != _PREFIX:
        raise IntegrityError()
    return bytes(ciphertext[4:HEADER_BYTES])


def seal_with(
    aead: prim.AESGCM,
    header: bytes,
    aad_prefix: bytes,
    plaintext: bytes,
    place: Place,
    *,
    nonce: bytes | None = None,
) -> bytes:
    """Seal ``plaintext`` for ``place``. ``nonce`` is only for test vectors."""
    if nonce is None:
        nonce = prim.random_nonce()
    return header + nonce + aead.encrypt(nonce, plaintext, aad_prefix + place.encoded)


def seal_rows(
    aead: prim.AESGCM,
    header: bytes,
    aad_prefix: bytes,
    items: Sequence[tuple[str, bytes]],
    template: PlaceTemplate,
) -> list[bytes]:
    """Seal ``(record id, plaintext)`` pairs of one place template: the bulk twin
    of ``seal_with`` (the fixed part of the associated data is built once)."""
    head = aad_prefix + template._head
    tail = template._tail
    pack = _LEN.pack
    encrypt = aead.encrypt
    size = prim.NONCE_BYTES
    nonces = prim.nonces(len(items))
    out = []
    for i, (record_id, plaintext) in enumerate(items):
        raw = record_id.encode("utf-8")
        nonce = nonces[i * size : (i + 1) * size]
        out.append(header + nonce + encrypt(nonce, plaintext, head + pack(len(raw)) + raw + tail))
    return out


def seal_into_buffer(
    aead: prim.AESGCM, header: bytes, aad_prefix: bytes, plaintext: bytes, place: Place
) -> bytearray:
    """Seal into one freshly allocated buffer: no copy of the ciphertext afterwards.

    For large payloads the concatenation in ``seal_with`` costs a full extra pass
    over the data; here AES-GCM writes straight behind the header.
    """
    nonce = prim.random_nonce()
    buf = bytearray(_BODY_START + len(plaintext) + prim.TAG_BYTES)
    buf[:HEADER_BYTES] = header
    buf[HEADER_BYTES:_BODY_START] = nonce
    aead.encrypt_into(nonce, plaintext, aad_prefix + place.encoded, memoryview(buf)[_BODY_START:])
    return buf


def open_with(
    aead: prim.AESGCM,
    header: bytes,
    aad_prefix: bytes,
    ciphertext: bytes | bytearray | memoryview,
    place: Place | bytes,
) -> bytes:
    """Open a ciphertext whose header the caller already matched to ``aead``'s key."""
    if type(ciphertext) is bytes:  # the common case, checked without a copy
        if len(ciphertext) < OVERHEAD_BYTES or not ciphertext.startswith(header):
            raise IntegrityError()
    elif len(ciphertext) < OVERHEAD_BYTES or bytes(ciphertext[:HEADER_BYTES]) != header:
        raise IntegrityError()
    aad = aad_prefix + (place if isinstance(place, bytes) else place.encoded)
    try:
        if len(ciphertext) <= _SLICE_LIMIT:
            # Small records: slicing copies a few hundred bytes, cheaper than views.
            return aead.decrypt(ciphertext[HEADER_BYTES:_BODY_START], ciphertext[_BODY_START:], aad)
        view = memoryview(ciphertext)
        return aead.decrypt(view[HEADER_BYTES:_BODY_START], view[_BODY_START:], aad)
    except prim.InvalidTag:
        raise IntegrityError() from None
