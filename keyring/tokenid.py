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

FF1 itself is ``keyshred.keyring._primitives.FF1`` (the one implementation, tested
against NIST's samples); this module only maps numbers to its two 5-digit halves
and the result to hex.
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
_HEX_ID = re.compile(r"[0-9a-fA-F]{10}")


class TokenIds:
    """FF1 (radix 16, 10 digits, empty tweak) under one key. The key stays inside:
    not in ``repr``, not picklable."""

    __slots__ = ("_ff1",)

    def __init__(self, key: bytes) -> None:
        if len(key) not in (16, 24, 32):
            raise InvalidInput("a token id key is an AES key")
        self._ff1 = prim.FF1(key, radix=16, length=ID_DIGITS)

    def encode_many(self, numbers: Sequence[int]) -> list[str]:
        """The 10-digit ids of ``numbers`` (each in ``0 .. MAX_NUMBER``)."""
        if not numbers:
            return []
        if isinstance(numbers, range):  # a block: no Python int per number
            x = np.arange(numbers.start, numbers.stop, numbers.step, dtype=np.int64)
        else:
            x = np.asarray(numbers, dtype=np.int64)
        if int(x.min()) < 0 or int(x.max()) > MAX_NUMBER:
            raise InvalidInput("a token number is not in 0 .. 2**40 - 1")
        u = x.astype(np.uint64)
        a, b = self._ff1.encrypt(u >> np.uint64(_HALF), u & np.uint64(_MASK))
        out = (a << np.uint64(_HALF)) | b
        # Ten hex digits per number: the low five bytes of each, big-endian, in one
        # hex string that the regex engine cuts (a format call per number costs more).
        low = out.astype(">u8").view(np.uint8).reshape(-1, 8)[:, 3:]
        return _TEN.findall(low.tobytes().hex())

    def encode(self, number: int) -> str:
        if not 0 <= number <= MAX_NUMBER:
            raise InvalidInput("a token number is not in 0 .. 2**40 - 1")
        a, b = self._ff1.encrypt(number >> _HALF, number & _MASK)
        return f"{(a << _HALF) | b:010x}"

    def decode(self, token_id: str) -> int:
        """The number behind a 10-digit id (every id deciphers to some number; a
        forged one to a number with no row)."""
        if not _HEX_ID.fullmatch(token_id):
            raise InvalidInput("a token id is 10 hex digits")
        x = int(token_id, 16)
        a, b = self._ff1.decrypt(x >> _HALF, x & _MASK)
        return (a << _HALF) | b

    def __repr__(self) -> str:
        return "TokenIds(<FF1 key hidden>)"

    def __reduce__(self) -> NoReturn:
        raise TypeError("TokenIds cannot be pickled")
