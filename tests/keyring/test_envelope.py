"""The envelope format against spec-derived vectors, and every way to break it."""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from keyshred.errors import IntegrityError, InvalidInput
from keyshred.keyring.datakey import DataKey
from keyshred.keyring.envelope import OVERHEAD_BYTES, Place, key_id_of

VECTORS = json.loads(
    (Path(__file__).parents[1] / "vectors" / "envelope_v1.json").read_text("utf-8")
)


def _key(case: dict[str, Any]) -> DataKey:
    place = case["place"]
    return DataKey(bytes.fromhex(case["key_id"]), place[0], place[1], bytes.fromhex(case["key"]))


@pytest.mark.parametrize("case", VECTORS["valid"], ids=lambda c: f"{len(c['plaintext']) // 2}B")
def test_valid_vectors_seal_and_open_exactly(case: dict[str, Any]) -> None:
    key, place = _key(case), Place(*case["place"])
    plaintext, ciphertext = bytes.fromhex(case["plaintext"]), bytes.fromhex(case["ciphertext"])
    assert key._seal_with_nonce(plaintext, place, bytes.fromhex(case["nonce"])) == ciphertext
    assert key.open(ciphertext, place) == plaintext
    assert key_id_of(ciphertext) == bytes.fromhex(case["key_id"])


@pytest.mark.parametrize("case", VECTORS["invalid"], ids=lambda c: c["why"])
def test_invalid_vectors_raise_integrity_error(case: dict[str, Any]) -> None:
    with pytest.raises(IntegrityError) as info:
        _key(case).open(bytes.fromhex(case["ciphertext"]), Place(*case["place"]))
    assert str(info.value) == "ciphertext failed authentication"  # opaque: no reason given
    exc = info.value
    assert exc.__cause__ is None and (exc.__context__ is None or exc.__suppress_context__)


def _sample() -> tuple[DataKey, Place, bytes]:
    case = VECTORS["valid"][2]
    return _key(case), Place(*case["place"]), bytes.fromhex(case["ciphertext"])


def test_every_flipped_byte_raises() -> None:
    key, place, ct = _sample()
    for i in range(len(ct)):
        for bit in (0x01, 0x80):
            broken = bytearray(ct)
            broken[i] ^= bit
            with pytest.raises(IntegrityError):
                key.open(bytes(broken), place)


def test_every_truncation_raises() -> None:
    key, place, ct = _sample()
    for n in range(len(ct)):
        with pytest.raises(IntegrityError):
            key.open(ct[:n], place)
    with pytest.raises(IntegrityError):
        key.open(ct + b"\x00", place)


@pytest.mark.parametrize("field", ["subject_ref", "scope", "table", "record_id", "column"])
def test_moving_a_ciphertext_to_another_place_raises(field: str) -> None:
    key, place, ct = _sample()
    moved = {**{f: getattr(place, f) for f in Place.__dataclass_fields__ if f != "encoded"}}
    moved[field] += "x"
    with pytest.raises(IntegrityError):
        key.open(ct, Place(**moved))


def test_key_id_is_readable_without_a_key_and_garbage_is_rejected() -> None:
    _, _, ct = _sample()
    assert len(key_id_of(ct)) == 16
    for junk in (b"", b"KS", b"x" * OVERHEAD_BYTES, b"KS\x01\x02" + b"\x00" * 60):
        with pytest.raises(IntegrityError):
            key_id_of(junk)


def test_seal_refuses_a_place_of_another_owner() -> None:
    key, place, _ = _sample()
    with pytest.raises(InvalidInput):
        key.seal(b"x", Place("someone-else", place.scope, "t", "r", "c"))


def test_random_nonces_and_overhead() -> None:
    key, place, _ = _sample()
    a, b = key.seal(b"same", place), key.seal(b"same", place)
    assert a != b
    assert len(a) == 4 + OVERHEAD_BYTES
    assert key.open(a, place) == key.open(b, place) == b"same"


def test_data_key_never_leaks() -> None:
    case = VECTORS["valid"][0]
    key = _key(case)
    assert case["key"] not in repr(key)
    for attempt in (pickle.dumps, copy.copy, copy.deepcopy):
        with pytest.raises(TypeError):
            attempt(key)
    assert not hasattr(key, "__dict__")


def test_nonces_are_fresh_across_threads_and_forks() -> None:
    """Nonces come from a per-thread pool of os.urandom bytes; a forked child draws
    anew instead of handing out what the parent will hand out next."""
    import os
    import threading

    from keyshred.keyring import _primitives as prim

    seen = [prim.nonces(1) for _ in range(2000)]  # several refills of the pool
    batch = prim.nonces(500)
    seen += [batch[i : i + 12] for i in range(0, len(batch), 12)]
    others: list[bytes] = []
    workers = [threading.Thread(target=lambda: others.extend(prim.nonces(1) for _ in range(300)))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seen += others
    assert all(len(n) == 12 for n in seen) and len(set(seen)) == len(seen)
    if hasattr(os, "fork"):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            os.write(write, prim.nonces(10))
            os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        child = os.read(read, 200)
        os.close(read)
        assert child != prim.nonces(10)
