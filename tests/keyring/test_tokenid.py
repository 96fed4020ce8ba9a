"""FF1 against NIST's samples (as data, failures included) and the token-id cipher
against FF1: unique, invertible, keyed, and the key never shows."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path
from typing import Any

import pytest

from keyshred.errors import InvalidInput
from keyshred.keyring import _primitives as prim
from keyshred.keyring.tokenid import MAX_NUMBER, TokenIds

VECTORS = json.loads((Path(__file__).parents[1] / "vectors" / "ff1.json").read_text("utf-8"))
DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def _digits(text: str, radix: int) -> list[int]:
    return [int(c, radix) if radix <= 36 else DIGITS.index(c) for c in text]


def _text(digits: list[int]) -> str:
    return "".join(DIGITS[d] for d in digits)


@pytest.mark.parametrize("case", VECTORS["valid"], ids=lambda c: c["name"])
def test_nist_samples(case: dict[str, Any]) -> None:
    key, tweak, radix = bytes.fromhex(case["key"]), bytes.fromhex(case["tweak"]), case["radix"]
    plain = _digits(case["plaintext"], radix)
    cipher = prim.ff1_encrypt(key, tweak, radix, plain)
    assert _text(cipher) == case["ciphertext"]
    assert prim.ff1_decrypt(key, tweak, radix, cipher) == plain


@pytest.mark.parametrize("case", VECTORS["valid"], ids=lambda c: c["name"])
def test_nist_samples_through_the_array_lanes(case: dict[str, Any]) -> None:
    """The same FF1 over arrays of halves (how token ids are enciphered a block at a
    time): the sample between other strings gives the sample's answer."""
    import numpy as np

    key, tweak, radix = bytes.fromhex(case["key"]), bytes.fromhex(case["tweak"]), case["radix"]
    plain, expected = _digits(case["plaintext"], radix), _digits(case["ciphertext"], radix)
    n, u = len(plain), len(plain) // 2
    ff1 = prim.FF1(key, radix=radix, length=n, tweak=tweak)

    def halves(digits: list[int]) -> tuple[int, int]:
        return prim._num(digits[:u], radix), prim._num(digits[u:], radix)

    rng = random.Random(n)
    others = [[rng.randrange(radix) for _ in range(n)] for _ in range(5)]
    rows = [halves(d) for d in [*others[:2], plain, *others[2:]]]
    a = np.array([r[0] for r in rows], dtype=np.uint64)
    b = np.array([r[1] for r in rows], dtype=np.uint64)
    ca, cb = ff1.encrypt(a, b)
    assert (int(ca[2]), int(cb[2])) == halves(expected)
    for j, (x, y) in enumerate(zip(ca, cb, strict=True)):  # each one as the int lanes give it
        assert (int(x), int(y)) == ff1.encrypt(*rows[j])
    pa, pb = ff1.decrypt(ca, cb)
    assert [(int(x), int(y)) for x, y in zip(pa, pb, strict=True)] == rows


def test_ff1_refuses_strings_out_of_its_domain() -> None:
    import numpy as np

    ff1 = prim.FF1(bytes(16), radix=10, length=10)
    with pytest.raises(ValueError):
        ff1.encrypt(100_000, 0)  # a half of 6 digits
    with pytest.raises(ValueError):
        ff1.decrypt(np.array([1], dtype=np.uint64), np.array([100_000], dtype=np.uint64))
    with pytest.raises(ValueError):  # beyond 64-bit lanes: refused, never wrong
        prim.FF1(bytes(16), radix=10, length=40)


@pytest.mark.parametrize("case", VECTORS["invalid"], ids=lambda c: c["name"])
def test_ff1_refuses_what_the_standard_does_not_define(case: dict[str, Any]) -> None:
    key, tweak, radix = bytes.fromhex(case["key"]), bytes.fromhex(case["tweak"]), case["radix"]
    plain = [DIGITS.index(c) for c in case["plaintext"]]
    with pytest.raises(ValueError):
        prim.ff1_encrypt(key, tweak, radix, plain)


def test_token_ids_are_ff1_radix_16_and_invert() -> None:
    key = prim.random_key()
    ids = TokenIds(key)
    rng = random.Random(3)
    numbers = [0, 1, 1023, 1024, MAX_NUMBER] + [rng.randrange(MAX_NUMBER) for _ in range(300)]
    encoded = ids.encode_many(numbers)
    for n, token_id in zip(numbers, encoded, strict=True):
        reference = prim.ff1_encrypt(key, b"", 16, [int(c, 16) for c in f"{n:010x}"])
        assert token_id == "".join(f"{d:x}" for d in reference)
        assert ids.decode(token_id) == n and ids.encode(n) == token_id
    # A block of consecutive numbers: distinct ids in no visible order.
    block = ids.encode_many(range(4096, 4096 + 1024))
    assert len(set(block)) == 1024 and block != sorted(block)
    # A range (enciphered without a Python int per number) as the same numbers listed.
    assert ids.encode_many(range(5, 5000, 7)) == ids.encode_many(list(range(5, 5000, 7)))
    assert block == [ids.encode(n) for n in range(4096, 4096 + 1024)]
    assert [ids.decode(i) for i in block] == list(range(4096, 4096 + 1024))
    # Another key, other ids.
    assert TokenIds(prim.random_key()).encode_many(range(4096, 4096 + 1024)) != block


def test_token_ids_refuse_bad_input_and_keep_the_key() -> None:
    key = prim.random_key()
    ids = TokenIds(key)
    with pytest.raises(InvalidInput):
        ids.encode(MAX_NUMBER + 1)
    with pytest.raises(InvalidInput):
        ids.decode("abc")
    with pytest.raises(InvalidInput):
        TokenIds(b"short")
    assert key.hex() not in repr(ids) and "hidden" in repr(ids)
    with pytest.raises(TypeError):
        pickle.dumps(ids)
