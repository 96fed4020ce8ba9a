"""Sealed export packages: readable only with the recipient's secret *and* the
subject's live key, and only before the package's expiry.

A package's content key is ``HKDF(recipient secret || subject export key)``:

- the recipient secret is either scrypt of a passphrase (salt and cost in the
  header) or an X25519 exchange between a one-off key (its public half in the header)
  and the recipient's key pair;
- the subject export key is derived from a DEK of the subject created for this one
  package (scope ``~export:<id>``). It never leaves keyshred: opening a package goes
  through ``Keyshred.open_export``, which checks the expiry and the subject's guard
  first. Erasing the subject (or the export's expiry, at the next retention run)
  destroys that DEK, and every copy of the package becomes noise.

The header (format, ids, expiry, KDF parameters) is the AEAD's associated data:
changing it fails authentication. The header is not authenticated until the content
key exists, so it is checked before any work: every field present, of its type, none
extra, and the scrypt cost exactly the one its format version fixes (a header cannot
make opening expensive). Anything else is ``IntegrityError``, at once. Only
``keyshred.keyring`` touches the primitives.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, TypeVar

from keyshred.errors import IntegrityError, InvalidInput
from keyshred.keyring import _primitives as prim

__all__ = [
    "PackageHeader",
    "generate_recipient_key",
    "open_package",
    "read_header",
    "seal_package",
]

FORMAT = "keyshred-export/1"
_T = TypeVar("_T")
# The scrypt cost of each format version: fixed, never read from a header.
_SCRYPT: Final = {FORMAT: {"n": 2**15, "r": 8, "p": 1}}
_SALT_BYTES = 16
_NONCE_BYTES = 12
_X25519_BYTES = 32
_MAX_HEADER = 4096  # a header is ~400 bytes; a longer first line is not one
_COMMON = frozenset(
    {"format", "export_id", "subject_ref", "key_scope", "expires_at", "nonce", "mode"}
)
_BY_MODE: Final = {"passphrase": _COMMON | {"kdf"}, "x25519": _COMMON | {"ephemeral"}}
_KDF_FIELDS = frozenset({"name", "salt", "n", "r", "p"})
_MALFORMED = "the package header is malformed"


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _unb64(text: Any, size: int | None = None) -> bytes:
    if not isinstance(text, str):
        raise IntegrityError(_MALFORMED)
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        raise IntegrityError(_MALFORMED) from None
    if size is not None and len(raw) != size:
        raise IntegrityError(_MALFORMED)
    return raw


def _text(header: dict[str, Any], name: str) -> str:
    value = header[name]
    if not isinstance(value, str) or not value:
        raise IntegrityError(_MALFORMED)
    return value


def _check_kdf(kdf: Any, fmt: str) -> None:
    """The KDF block must name scrypt with this format's cost exactly."""
    if not isinstance(kdf, dict) or set(kdf) != _KDF_FIELDS or kdf["name"] != "scrypt":
        raise IntegrityError(_MALFORMED)
    _unb64(kdf["salt"], _SALT_BYTES)
    for name, value in _SCRYPT[fmt].items():
        got = kdf[name]
        if type(got) is not int or got != value:  # bool is an int: excluded by ``type``
            raise IntegrityError(_MALFORMED)


def _known(header: dict[str, Any], name: str, table: Mapping[str, _T]) -> _T | None:
    """``table[header[name]]`` if that is a string the table knows (a list or a
    dict there is no key, not a ``TypeError``)."""
    value = header.get(name)
    return table.get(value) if isinstance(value, str) else None


def _parse_header(line: bytes) -> dict[str, Any]:
    """The header as a dict, every field checked (``IntegrityError`` otherwise)."""
    if len(line) > _MAX_HEADER:
        raise IntegrityError(_MALFORMED)
    try:
        header = json.loads(line)
    except (ValueError, RecursionError):
        raise IntegrityError("this is not a keyshred export package") from None
    if not isinstance(header, dict) or _known(header, "format", _SCRYPT) is None:
        raise IntegrityError("this is not a keyshred export package")
    fields = _known(header, "mode", _BY_MODE)
    if fields is None or set(header) != fields:
        raise IntegrityError(_MALFORMED)
    for name in ("export_id", "subject_ref", "key_scope", "expires_at"):
        _text(header, name)
    _unb64(header["nonce"], _NONCE_BYTES)
    if header["mode"] == "passphrase":
        _check_kdf(header["kdf"], header["format"])
    else:
        _unb64(header["ephemeral"], _X25519_BYTES)
    return header


@dataclass(frozen=True)
class PackageHeader:
    export_id: str
    subject_ref: str
    key_scope: str
    expires_at: datetime
    header: dict[str, Any]


def generate_recipient_key() -> tuple[str, str]:
    """An X25519 key pair for receiving exports: (private, public), base64."""
    private, public = prim.x25519_generate()
    return _b64(private), _b64(public)


def _recipient_secret(
    header: dict[str, Any], passphrase: str | None, private_key: str | None
) -> bytes:
    mode = header.get("mode")
    if mode == "passphrase":
        if not passphrase:
            raise InvalidInput("this package opens with a passphrase")
        cost = _SCRYPT[header["format"]]
        return prim.scrypt_derive(
            passphrase.encode("utf-8"), salt=_unb64(header["kdf"]["salt"]), **cost
        )
    if mode == "x25519":
        if not private_key:
            raise InvalidInput("this package opens with the recipient's private key")
        try:
            private = _unb64(private_key, _X25519_BYTES)
        except IntegrityError:
            raise InvalidInput("the private key is not an X25519 key") from None
        try:
            return prim.x25519_exchange(private, _unb64(header["ephemeral"]))
        except ValueError:  # e.g. a low-order point in a tampered header
            raise IntegrityError(_MALFORMED) from None
    raise IntegrityError("unknown package mode")


def seal_package(
    content: bytes,
    *,
    export_id: str,
    subject_ref: str,
    key_scope: str,
    subject_key: bytes,
    expires_at: datetime,
    passphrase: str | None = None,
    recipient_public_key: str | None = None,
) -> bytes:
    """The package bytes (JSON header line, then base64 ciphertext)."""
    if (passphrase is None) == (recipient_public_key is None):
        raise InvalidInput("an export is sealed to a passphrase or to a public key (one of them)")
    header: dict[str, Any] = {
        "format": FORMAT,
        "export_id": export_id,
        "subject_ref": subject_ref,
        "key_scope": key_scope,
        "expires_at": expires_at.isoformat(),
        "nonce": _b64(prim.random_nonce()),
    }
    if passphrase is not None:
        if len(passphrase) < 12:
            raise InvalidInput("an export passphrase has at least 12 characters")
        header["mode"] = "passphrase"
        header["kdf"] = {
            "name": "scrypt",
            "salt": _b64(prim.random_bytes(_SALT_BYTES)),
            **_SCRYPT[FORMAT],
        }
        secret = _recipient_secret(header, passphrase, None)
    else:
        ephemeral, ephemeral_public = prim.x25519_generate()
        header["mode"] = "x25519"
        header["ephemeral"] = _b64(ephemeral_public)
        try:
            secret = prim.x25519_exchange(ephemeral, _unb64(recipient_public_key, _X25519_BYTES))
        except (ValueError, IntegrityError):
            raise InvalidInput("the recipient public key is not an X25519 key") from None
    aad = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    key = prim.hkdf_sha256(secret + subject_key, salt=b"keyshred/export", info=aad)
    body = prim.new_aead(key).encrypt(_unb64(header["nonce"]), content, aad)
    return aad + b"\n" + base64.b64encode(body) + b"\n"


def read_header(package: bytes) -> PackageHeader:
    """The checked header (``IntegrityError`` for anything malformed, before any
    key derivation)."""
    if not isinstance(package, bytes | bytearray):
        raise InvalidInput("an export package is bytes (the file's content)")
    line, sep, _ = package.partition(b"\n")
    if not sep:
        raise IntegrityError("this is not a keyshred export package")
    header = _parse_header(line)
    try:
        expires_at = datetime.fromisoformat(header["expires_at"])
    except ValueError:
        raise IntegrityError(_MALFORMED) from None
    if expires_at.tzinfo is None:
        raise IntegrityError(_MALFORMED)
    return PackageHeader(
        header["export_id"], header["subject_ref"], header["key_scope"], expires_at, header
    )


def open_package(
    package: bytes,
    *,
    subject_key: bytes,
    passphrase: str | None = None,
    private_key: str | None = None,
) -> bytes:
    """Decrypt (``IntegrityError`` if anything was altered or the secret is wrong)."""
    head = read_header(package)
    aad, rest = package.split(b"\n", 1)
    secret = _recipient_secret(head.header, passphrase, private_key)
    key = prim.hkdf_sha256(secret + subject_key, salt=b"keyshred/export", info=aad)
    try:
        return prim.new_aead(key).decrypt(
            _unb64(head.header["nonce"]), base64.b64decode(rest.strip()), aad
        )
    except (prim.InvalidTag, ValueError):
        raise IntegrityError("the package does not open: wrong secret, or altered") from None
