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
changing it fails authentication. Only ``keyshred.keyring`` touches the primitives.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

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
_SCRYPT = {"n": 2**15, "r": 8, "p": 1}


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _unb64(text: Any) -> bytes:
    try:
        return base64.b64decode(str(text), validate=True)
    except ValueError:
        raise IntegrityError("the package header is malformed") from None


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
        kdf = header["kdf"]
        return prim.scrypt_derive(
            passphrase.encode("utf-8"),
            salt=_unb64(kdf["salt"]),
            n=int(kdf["n"]),
            r=int(kdf["r"]),
            p=int(kdf["p"]),
        )
    if mode == "x25519":
        if not private_key:
            raise InvalidInput("this package opens with the recipient's private key")
        return prim.x25519_exchange(_unb64(private_key), _unb64(header["ephemeral"]))
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
        header["kdf"] = {"name": "scrypt", "salt": _b64(prim.random_bytes(16)), **_SCRYPT}
        secret = _recipient_secret(header, passphrase, None)
    else:
        ephemeral, ephemeral_public = prim.x25519_generate()
        header["mode"] = "x25519"
        header["ephemeral"] = _b64(ephemeral_public)
        try:
            secret = prim.x25519_exchange(ephemeral, _unb64(recipient_public_key))
        except ValueError:
            raise InvalidInput("the recipient public key is not an X25519 key") from None
    aad = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    key = prim.hkdf_sha256(secret + subject_key, salt=b"keyshred/export", info=aad)
    body = prim.new_aead(key).encrypt(_unb64(header["nonce"]), content, aad)
    return aad + b"\n" + base64.b64encode(body) + b"\n"


def read_header(package: bytes) -> PackageHeader:
    try:
        line, _ = package.split(b"\n", 1)
        header = json.loads(line)
        return PackageHeader(
            str(header["export_id"]),
            str(header["subject_ref"]),
            str(header["key_scope"]),
            datetime.fromisoformat(str(header["expires_at"])),
            header,
        )
    except (ValueError, KeyError, TypeError):
        raise IntegrityError("this is not a keyshred export package") from None


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
