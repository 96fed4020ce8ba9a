"""Token ids: a token's row number enciphered into 10 hex digits, and back.

A vault token such as ``<PHONE_7f3a12c9ab>`` carries ``FF1_K(n)`` (NIST SP 800-38G
format-preserving encryption, radix 16, 10 digits, empty tweak) where ``n`` is the
token's unique 40-bit row number and ``K`` a system secret of the keyring. So

- two tokens never share an id (the numbers are unique and FF1 is a permutation):
  nothing has to be looked up before a token goes out, and no collision exists to
  handle;
- an id reveals neither the number nor the order of issue, and guessing a valid id
  is as hard as with random ids (the stored numbers are a sparse subset of 2**40);
- a token finds its row by primary key, and new rows append in number order instead
  of landing on a random page of an index.

Numbers are enciphered a block at a time (each FF1 round is one AES call over every
number of the block); a single id is deciphered on resolution.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NoReturn

import numpy as np

from keyshred.errors import InvalidInput
from keyshred.keyring import _primitives as prim

__all__ = ["ID_DIGITS", "MAX_NUMBER", "TokenIds"]

ID_DIGITS = 10  # hex digits in a token id: 40 bits
MAX_NUMBER = 16**ID_DIGITS - 1
_HALF = 20  # bits in each FF1 half (5 hex digits)
_MASK = (1 << _HALF) - 1
_TEN = re.compile(r".{10}", re.DOTALL)


class TokenIds:
    """FF1 (radix 16, 10 digits) under one key. The key stays inside: not in
    ``repr``, not picklable."""

    __slots__ = ("_ciph", "_state")

    def __init__(self, key: bytes) -> None:
        if len(key) not in (16, 24, 32):
            raise InvalidInput("a token id key is an AES key")
        self._ciph = prim.raw_aes(key)
        # FF1's P block, enciphered once: every round's PRF is AES(state XOR Q),
        # because with an empty tweak Q is exactly one block (12 zero bytes, the
        # round number, the other half as 3 bytes).
        p = bytes([1, 2, 1]) + (16).to_bytes(3, "big") + bytes([10, 5]) + (10).to_bytes(4, "big")
        self._state = self._ciph(p + bytes(4))

    def encode_many(self, numbers: Sequence[int]) -> list[str]:
        """The 10-digit ids of ``numbers`` (each in ``0 .. MAX_NUMBER``)."""
        if not numbers:
            return []
        if isinstance(numbers, range):  # a block: no Python int per number
            x = np.arange(numbers.start, numbers.stop, numbers.step, dtype=np.uint64)
        else:
            x = np.asarray(numbers, dtype=np.uint64)
        if int(x.max()) > MAX_NUMBER:
            raise InvalidInput("a token number exceeds 40 bits")
        a = (x >> np.uint64(_HALF)).astype(np.uint32)
        b = (x & np.uint64(_MASK)).astype(np.uint32)
        # Q as four big-endian 32-bit words: the first three are the state's, the
        # last is the state's last word XOR (round << 24) XOR B (B < 2**20 fills
        # the low three bytes). R read the same way: NUM(R[:8]) modulo 16**5 is
        # the low 20 bits of its second word.
        state = np.frombuffer(self._state, dtype=">u4")
        q = np.empty((len(x), 4), dtype=">u4")
        q[:, :3] = state[:3]
        mask = np.uint32(_MASK)
        for i in range(10):
            q[:, 3] = b ^ np.uint32(int(state[3]) ^ (i << 24))
            r = np.frombuffer(self._ciph(q.tobytes()), dtype=">u4").reshape(-1, 4)
            a, b = b, (a + (r[:, 1] & mask)) & mask
        out = (a.astype(np.uint64) << np.uint64(_HALF)) | b.astype(np.uint64)
        # Ten hex digits per number: the low five bytes of each, big-endian, in one
        # hex string that the regex engine cuts (a format call per number costs more).
        low = out.astype(">u8").view(np.uint8).reshape(-1, 8)[:, 3:]
        return _TEN.findall(low.tobytes().hex())

    def encode(self, number: int) -> str:
        return self.encode_many([number])[0]

    def decode(self, token_id: str) -> int:
        """The number behind a 10-digit id (every id deciphers to some number; a
        forged one to a number with no row)."""
        if len(token_id) != ID_DIGITS:
            raise InvalidInput("a token id is 10 hex digits")
        x = int(token_id, 16)
        a, b = x >> _HALF, x & _MASK
        state = int.from_bytes(self._state, "big")
        ciph = self._ciph
        for i in range(9, -1, -1):
            r = ciph((state ^ (i << 24) ^ a).to_bytes(16, "big"))
            y = int.from_bytes(r[5:8], "big") & _MASK
            a, b = (b - y) & _MASK, a
        return (a << _HALF) | b

    def __repr__(self) -> str:
        return "TokenIds(<FF1 key hidden>)"

    def __reduce__(self) -> NoReturn:
        raise TypeError("TokenIds cannot be pickled")
