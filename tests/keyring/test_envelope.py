"""The envelope format against spec-derived vectors, and every way to break it.

Every seal and open path in use (the pair and the bulk loops on top of it) runs
through the same positive and negative vectors."""

from __future__ import annotations

import copy
import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from keyshred.errors import IntegrityError, InvalidInput
from keyshred.keyring import _primitives as prim
from keyshred.keyring.datakey import DataKey
from keyshred.keyring.envelope import OVERHEAD_BYTES, Place, PlaceTemplate, key_id_of

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


def _template(place: Place) -> PlaceTemplate:
    return PlaceTemplate(place.subject_ref, place.scope, place.table, place.column)


def _seal_into(key: DataKey, plaintext: bytes, place: Place) -> bytes:
    """The large-payload path: the envelope written into the caller's buffer."""
    out = bytearray(OVERHEAD_BYTES + len(plaintext))
    assert key.seal(plaintext, place, into=memoryview(out)) is None
    return bytes(out)


# Every way to seal: the one seal and the bulk loop on top of it. Both must give the
# vector's ciphertext for the vector's nonce (drawn where a real seal draws it).
SEALS: dict[str, Callable[[DataKey, bytes, Place], bytes]] = {
    "seal": lambda key, plaintext, place: key.seal(plaintext, place),
    "seal_rows": lambda key, plaintext, place: key.seal_rows(
        [(place.record_id, plaintext)], _template(place)
    )[0],
    "seal(into=)": _seal_into,
}


def test_seal_into_a_buffer_of_the_wrong_size_is_refused() -> None:
    key = DataKey(b"k" * 16, "ref", "default", bytes(32))
    place = Place("ref", "default", "t", "r", "c")
    for size in (OVERHEAD_BYTES, OVERHEAD_BYTES + 4):
        with pytest.raises(InvalidInput):
            key.seal(b"abc", place, into=memoryview(bytearray(size)))


def _open_rows_into(key: DataKey, ciphertext: bytes, place: Place) -> bytes:
    """The vector partition's bulk path: the ciphertext between two others' bytes."""
    width = max(len(ciphertext) - OVERHEAD_BYTES, 0)
    out = bytearray(b"\xee" * (3 * width))
    key.open_rows_into(
        b"junk" + ciphertext + b"more",
        starts=[4],
        template=_template(place),
        record_ids=[place.record_id],
        out=memoryview(out),
        out_rows=[1],
        width=width,
    )
    assert out[:width] == out[2 * width :] == b"\xee" * width  # other rows untouched
    return bytes(out[width : 2 * width])


# Every way to open: the one open (bytes and buffer inputs, a pre-encoded place) and
# the bulk loop on top of it.
OPENS: dict[str, Callable[[DataKey, bytes, Place], bytes]] = {
    "open": lambda key, ct, place: key.open(ct, place),
    "open(memoryview)": lambda key, ct, place: key.open(memoryview(bytearray(ct)), place),
    "open_encoded": lambda key, ct, place: key.open_encoded(
        ct, _template(place).encoded(place.record_id)
    ),
    "open_rows_into": _open_rows_into,
}


@pytest.mark.parametrize("path", SEALS)
@pytest.mark.parametrize("case", VECTORS["valid"], ids=lambda c: f"{len(c['plaintext']) // 2}B")
def test_valid_vectors_through_every_seal(
    case: dict[str, Any], path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    key, place = _key(case), Place(*case["place"])
    plaintext, ciphertext = bytes.fromhex(case["plaintext"]), bytes.fromhex(case["ciphertext"])
    monkeypatch.setattr(prim, "random_nonce", lambda: bytes.fromhex(case["nonce"]))
    assert SEALS[path](key, plaintext, place) == ciphertext


@pytest.mark.parametrize("path", OPENS)
@pytest.mark.parametrize("case", VECTORS["valid"], ids=lambda c: f"{len(c['plaintext']) // 2}B")
def test_valid_vectors_through_every_open(case: dict[str, Any], path: str) -> None:
    key, place = _key(case), Place(*case["place"])
    plaintext, ciphertext = bytes.fromhex(case["plaintext"]), bytes.fromhex(case["ciphertext"])
    assert OPENS[path](key, ciphertext, place) == plaintext


@pytest.mark.parametrize("path", OPENS)
@pytest.mark.parametrize("case", VECTORS["invalid"], ids=lambda c: c["why"])
def test_invalid_vectors_raise_integrity_error(case: dict[str, Any], path: str) -> None:
    with pytest.raises(IntegrityError) as info:
        OPENS[path](_key(case), bytes.fromhex(case["ciphertext"]), Place(*case["place"]))
    assert str(info.value) == "ciphertext failed authentication"  # opaque: no reason given
    exc = info.value
    assert exc.__cause__ is None and (exc.__context__ is None or exc.__suppress_context__)


def test_a_template_encodes_exactly_the_place() -> None:
    for case in VECTORS["valid"]:
        place = Place(*case["place"])
        assert _template(place).encoded(place.record_id) == place.encoded


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
    with pytest.raises(InvalidInput):
        key.seal_rows([("r", b"x")], PlaceTemplate("someone-else", place.scope, "t", "c"))


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
    """Nonces come straight from os.urandom: fresh in every thread, and a forked child
    does not hand out what the parent will hand out next."""
    import os
    import threading

    seen = [prim.random_nonce() for _ in range(2000)]
    key, place, _ = _sample()
    rows = key.seal_rows([(f"r{i}", b"x") for i in range(500)], _template(place))
    seen += [ct[20:32] for ct in rows]  # the bulk loop draws a nonce per row too
    others: list[bytes] = []
    workers = [
        threading.Thread(target=lambda: others.extend(prim.random_nonce() for _ in range(300)))
    ]
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
            os.write(write, b"".join(prim.random_nonce() for _ in range(10)))
            os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        child = os.read(read, 200)
        os.close(read)
        assert child != b"".join(prim.random_nonce() for _ in range(10))
