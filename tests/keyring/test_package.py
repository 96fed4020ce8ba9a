"""Export package headers: the header is unauthenticated until the key exists, so
every malformed header is ``IntegrityError`` before any key derivation, and the
scrypt cost is the format's, never the header's."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from keyshred.errors import IntegrityError
from keyshred.keyring import _primitives as prim
from keyshred.keyring.package import open_package, read_header, seal_package

PASS = "correct horse battery staple"
SUBJECT_KEY = bytes(range(32))
CONTENT = b"zqprobe-package-content"


@pytest.fixture
def scrypt_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, int]]:
    """Every scrypt derivation's cost (the real one runs)."""
    calls: list[dict[str, int]] = []
    real = prim.scrypt_derive

    def spy(passphrase: bytes, *, salt: bytes, n: int, r: int, p: int) -> bytes:
        calls.append({"n": n, "r": r, "p": p})
        return real(passphrase, salt=salt, n=n, r=r, p=p)

    monkeypatch.setattr(prim, "scrypt_derive", spy)
    return calls


def _package() -> bytes:
    return seal_package(
        CONTENT,
        export_id="exp-1",
        subject_ref="ref1",
        key_scope="~export:exp-1",
        subject_key=SUBJECT_KEY,
        expires_at=datetime.now(UTC) + timedelta(hours=1),
        passphrase=PASS,
    )


def _split(package: bytes) -> tuple[dict[str, Any], bytes]:
    line, body = package.split(b"\n", 1)
    return json.loads(line), body


def _with(header: dict[str, Any], body: bytes) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode() + b"\n" + body


_WRONG_TYPES: list[Any] = [None, 7, 2.5, True, [], {}, "", "x"]


def _malformed(header: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Headers with a field missing, extra or of the wrong type (or kdf cost off)."""
    for name in header:
        yield f"missing {name}", {k: v for k, v in header.items() if k != name}
        for wrong in _WRONG_TYPES:
            if name in ("export_id", "subject_ref", "key_scope") and wrong == "x":
                continue  # a well-formed value (authentication rejects it)
            yield f"{name}={wrong!r}", {**header, name: wrong}
    yield "extra field", {**header, "note": "hi"}
    yield "x25519 with kdf", {**header, "mode": "x25519"}
    kdf = header["kdf"]
    for name in kdf:
        yield f"kdf missing {name}", {**header, "kdf": {k: v for k, v in kdf.items() if k != name}}
    yield "kdf extra", {**header, "kdf": {**kdf, "maxmem": 1}}
    for name, values in {
        "n": [2**20, 2**14, 2**15 + 1, str(2**15), float(2**15), True, None],
        "r": [16, 1, "8", 8.0],
        "p": [2, 0, "1", True],
        "name": ["argon2", None],
        "salt": ["", "AAAA", 16, "not base64!"],
    }.items():
        for value in values:
            yield f"kdf {name}={value!r}", {**header, "kdf": {**kdf, name: value}}
    yield "format 2", {**header, "format": "keyshred-export/2"}
    yield "naive expiry", {**header, "expires_at": "2030-01-01T00:00:00"}
    yield "bad expiry", {**header, "expires_at": "soon"}
    yield "short nonce", {**header, "nonce": "AAAA"}


def test_malformed_headers_fail_fast_with_integrity_error(
    scrypt_calls: list[dict[str, int]],
) -> None:
    header, body = _split(_package())
    scrypt_calls.clear()  # sealing derived once
    cases = list(_malformed(header))
    assert len(cases) > 100
    for label, bad in cases:
        try:
            open_package(_with(bad, body), subject_key=SUBJECT_KEY, passphrase=PASS)
        except IntegrityError:
            continue
        except Exception as exc:  # name the case that slipped through
            raise AssertionError(f"{label}: {type(exc).__name__}") from exc
        raise AssertionError(f"{label}: opened")
    assert scrypt_calls == [], "a malformed header reached the key derivation"


def test_truncated_and_non_json_packages_fail_with_integrity_error(
    scrypt_calls: list[dict[str, int]],
) -> None:
    package = _package()
    scrypt_calls.clear()  # sealing derived once
    line = package.split(b"\n", 1)[0]
    for cut in range(len(line)):  # every truncation of the header line
        for tail in (b"", b"\n", b"\nAAAA\n"):
            with pytest.raises(IntegrityError):
                open_package(package[:cut] + tail, subject_key=SUBJECT_KEY, passphrase=PASS)
    for junk in (
        b"",
        b"\n",
        b"\xff\xfe\x00\n",
        b"null\n",
        b"[]\n",
        b'"text"\n',
        b"1e999\n",
        b"[" * 100_000 + b"\n",
        b"{" + b" " * 10_000 + b"}\n",
    ):
        with pytest.raises(IntegrityError):
            read_header(junk)
        with pytest.raises(IntegrityError):
            open_package(junk, subject_key=SUBJECT_KEY, passphrase=PASS)
    assert scrypt_calls == []


def test_random_header_corruption_is_integrity_error_and_cost_is_fixed(
    scrypt_calls: list[dict[str, int]],
) -> None:
    package = _package()
    assert open_package(package, subject_key=SUBJECT_KEY, passphrase=PASS) == CONTENT
    rng = random.Random(18)
    end = package.index(b"\n")
    for _ in range(60):
        raw = bytearray(package)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(end)
            raw[at] = (raw[at] + rng.randrange(1, 256)) % 256
        if raw == package:
            continue  # flips that undid each other
        with pytest.raises(IntegrityError):
            open_package(bytes(raw), subject_key=SUBJECT_KEY, passphrase=PASS)
    # Whatever a header said, scrypt ran at the format's cost only.
    assert scrypt_calls and all(c == {"n": 2**15, "r": 8, "p": 1} for c in scrypt_calls)
