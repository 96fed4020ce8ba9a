"""The few JOSE pieces keyshred's receipts need, built on pyca ``cryptography`` alone.

- JWS compact serialization (RFC 7515 §7.1) with one algorithm, ``EdDSA`` over
  Ed25519 (RFC 8037): ``sign_compact`` / ``parse_compact`` / ``verify_compact``.
  The protected header is RFC 8785 (JCS) canonical JSON, so the same key and
  payload always give the same token (Ed25519 signatures are deterministic), which
  is what lets the test vectors pin exact bytes.
- Ed25519 public keys as OKP JWKs (RFC 8037 §2), their RFC 7638 thumbprint (the
  ``kid``), and a JWK Set (RFC 7517 §5) of them.

Why no JOSE library: verification has exactly one accepted shape here (one
algorithm, one key type, a header of three known members), and a general library's
algorithm negotiation (``alg: none``, HMAC with a public key as secret, embedded
``jwk``/``jku`` keys) is the classic way such tokens get forged. Everything outside
that shape is refused before any signature is checked. Anyone else verifies the
tokens with the JOSE library of their choice (the tests use ``joserfc``).

Why ``EdDSA`` and not RFC 9864's fully specified ``Ed25519``: every JOSE library
in use verifies ``EdDSA`` (RFC 8037); few know ``Ed25519`` yet. With one key type
the two mean the same signature, so the choice is only about who can verify.

Every refusal is an ``IntegrityError`` (``UntrustedSigner`` when the token is
well formed but its key is not one the verifier trusts); messages never carry the
payload.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import rfc8785
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from keyshred.errors import IntegrityError, InvalidInput, UntrustedSigner

__all__ = [
    "ALG",
    "CompactJws",
    "Jwk",
    "b64url_decode",
    "b64url_encode",
    "jwk_thumbprint",
    "jwks",
    "parse_compact",
    "public_jwk",
    "sign_compact",
    "trusted_keys",
    "verify_compact",
]

ALG = "EdDSA"
_ED25519_PUBLIC_BYTES = 32
_ED25519_SIGNATURE_BYTES = 64
# The only header members a token may carry: anything else (crit, jwk, jku, x5u,
# b64=false, ...) changes how a verifier must read the token, and none is needed.
_HEADER_MEMBERS = frozenset({"alg", "kid", "typ"})
_B64URL = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def b64url_encode(data: bytes) -> str:
    """base64url without padding (RFC 7515 §2)."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64url_decode(text: str) -> bytes:
    """Strict base64url without padding: any other character, padding, or trailing
    bits that are not zero (a second spelling of the same bytes) is refused."""
    raw = text.encode("ascii", "replace")
    if not set(raw) <= _B64URL or len(raw) % 4 == 1:
        raise IntegrityError("not base64url")
    try:
        data = base64.urlsafe_b64decode(raw + b"=" * (-len(raw) % 4))
    except (binascii.Error, ValueError):
        raise IntegrityError("not base64url") from None
    if b64url_encode(data) != text:
        raise IntegrityError("not base64url")
    return data


def jwk_thumbprint(public_key: bytes) -> str:
    """RFC 7638 thumbprint (SHA-256, base64url) of an Ed25519 key's OKP JWK: the
    hash of its required members ``crv``, ``kty``, ``x`` in that order, no spaces."""
    _check_public(public_key)
    members = {"crv": "Ed25519", "kty": "OKP", "x": b64url_encode(public_key)}
    digest = hashlib.sha256(rfc8785.dumps(members)).digest()
    return b64url_encode(digest)


@dataclass(frozen=True)
class Jwk:
    """One trusted Ed25519 verification key and its thumbprint."""

    public_key: bytes
    kid: str

    @classmethod
    def of(cls, public_key: bytes) -> Jwk:
        return cls(public_key, jwk_thumbprint(public_key))


def public_jwk(public_key: bytes) -> dict[str, str]:
    """The OKP JWK of an Ed25519 public key, for signatures with EdDSA only."""
    return {
        "kty": "OKP",
        "crv": "Ed25519",
        "x": b64url_encode(public_key),
        "kid": jwk_thumbprint(public_key),
        "use": "sig",
        "alg": ALG,
    }


def jwks(public_keys: Iterable[bytes]) -> dict[str, list[dict[str, str]]]:
    """A JWK Set of the given keys, each once, in the order given."""
    seen: set[bytes] = set()
    keys = []
    for key in public_keys:
        if key not in seen:
            seen.add(key)
            keys.append(public_jwk(key))
    return {"keys": keys}


def trusted_keys(trusted: bytes | Mapping[str, Any]) -> list[Jwk]:
    """The keys a verifier trusts: one raw 32-byte Ed25519 public key, or a JWK Set
    (a parsed ``{"keys": [...]}`` document). A JWKS member that is not an Ed25519
    signing key for EdDSA is skipped (a JWKS may serve other keys too); one whose
    ``kid`` is not its RFC 7638 thumbprint is refused, since a verifier matching on
    that ``kid`` would pick a key by a name it does not own."""
    if isinstance(trusted, bytes):
        _check_public(trusted)
        return [Jwk.of(trusted)]
    if not isinstance(trusted, Mapping) or not isinstance(trusted.get("keys"), list):
        raise InvalidInput("the trusted keys must be a 32-byte Ed25519 key or a JWKS document")
    out = []
    for member in trusted["keys"]:
        if not isinstance(member, Mapping):
            raise InvalidInput("a JWKS member is not an object")
        if member.get("kty") != "OKP" or member.get("crv") != "Ed25519":
            continue
        if member.get("alg", ALG) != ALG or member.get("use", "sig") != "sig":
            continue
        x = member.get("x")
        try:
            key = b64url_decode(x) if isinstance(x, str) else b""
        except IntegrityError:
            key = b""
        if len(key) != _ED25519_PUBLIC_BYTES:
            raise InvalidInput("a JWKS member's x is not an Ed25519 public key")
        jwk = Jwk.of(key)
        if member.get("kid", jwk.kid) != jwk.kid:
            raise InvalidInput("a JWKS member's kid is not its RFC 7638 thumbprint")
        out.append(jwk)
    if not out:
        raise InvalidInput("the JWKS holds no Ed25519 signing key")
    return out


@dataclass(frozen=True)
class CompactJws:
    """A parsed token whose shape is accepted; its signature is not checked yet."""

    header: dict[str, str]
    payload: bytes
    signing_input: bytes
    signature: bytes

    @property
    def kid(self) -> str:
        return self.header["kid"]


def sign_compact(payload: bytes, typ: str, kid: str, sign: Callable[[bytes], bytes]) -> str:
    """``BASE64URL(header).BASE64URL(payload).BASE64URL(signature)``; ``sign`` is the
    signer's ``sign(message) -> bytes`` (the private key never comes here)."""
    header = rfc8785.dumps({"alg": ALG, "kid": kid, "typ": typ})
    signing_input = f"{b64url_encode(header)}.{b64url_encode(payload)}".encode("ascii")
    signature = sign(signing_input)
    return f"{signing_input.decode('ascii')}.{b64url_encode(signature)}"


def parse_compact(token: str, typ: str) -> CompactJws:
    """Split and decode a compact JWS of the one accepted shape: header
    ``{"alg": "EdDSA", "kid": <str>, "typ": typ}`` and nothing else, a 64-byte
    signature. ``alg: none``, another algorithm, a missing ``kid``, unknown header
    members (``crit`` included) and an empty signature are all refused here."""
    parts = token.strip().split(".")
    if len(parts) != 3:
        raise IntegrityError("not a compact JWS")
    head_b64, payload_b64, signature_b64 = parts
    try:
        header = json.loads(b64url_decode(head_b64))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise IntegrityError("the JWS header is not JSON") from None
    if not isinstance(header, dict) or set(header) - _HEADER_MEMBERS:
        raise IntegrityError("the JWS header has members this verifier does not accept")
    if header.get("alg") != ALG:
        raise IntegrityError("the JWS is not signed with EdDSA (the only algorithm accepted)")
    if header.get("typ") != typ:
        raise IntegrityError(f"the JWS is not a {typ}")
    if not isinstance(header.get("kid"), str) or not header["kid"]:
        raise IntegrityError("the JWS header names no key (kid)")
    signature = b64url_decode(signature_b64)
    if len(signature) != _ED25519_SIGNATURE_BYTES:
        raise IntegrityError("the JWS signature is not an Ed25519 signature")
    return CompactJws(
        header=header,
        payload=b64url_decode(payload_b64),
        signing_input=f"{head_b64}.{payload_b64}".encode("ascii"),
        signature=signature,
    )


def verify_compact(token: str, typ: str, keys: Sequence[Jwk]) -> CompactJws:
    """Parse ``token`` and check its signature by the trusted key (of ``keys``, from
    ``trusted_keys``) its ``kid`` names.

    Raises ``UntrustedSigner`` when no trusted key has that ``kid`` (a receipt
    signed by a key the verifier does not know, or a ``kid`` altered), and
    ``IntegrityError`` when the shape or the signature is wrong."""
    jws = parse_compact(token, typ)
    key = next((k for k in keys if k.kid == jws.kid), None)
    if key is None:
        raise UntrustedSigner("the receipt was signed by another key than the trusted one(s)")
    try:
        Ed25519PublicKey.from_public_bytes(key.public_key).verify(jws.signature, jws.signing_input)
    except InvalidSignature:
        raise IntegrityError("signature does not verify") from None
    return jws


def _check_public(public_key: bytes) -> None:
    if not isinstance(public_key, bytes) or len(public_key) != _ED25519_PUBLIC_BYTES:
        raise InvalidInput("an Ed25519 public key is 32 bytes")
    try:
        Ed25519PublicKey.from_public_bytes(public_key)
    except ValueError:
        raise InvalidInput("not an Ed25519 public key") from None
