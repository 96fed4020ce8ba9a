"""Raw cryptographic primitives. Private: only ``keyshred.keyring`` imports this module.

Everything above this layer speaks in task-shaped calls (seal, open, wrap, destroy);
this is the one place that touches pyca/cryptography's hazmat-level objects, so an
audit of how keys are used starts and ends here.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = [
    "AESGCM",
    "KEY_BYTES",
    "NONCE_BYTES",
    "TAG_BYTES",
    "InvalidSignature",
    "InvalidTag",
    "constant_time_equal",
    "ed25519_generate",
    "ed25519_private_bytes",
    "ed25519_private_from_bytes",
    "ed25519_public_bytes",
    "ed25519_public_from_bytes",
    "ed25519_sign",
    "ed25519_verify",
    "hkdf_sha256",
    "hmac_sha256",
    "new_aead",
    "random_bytes",
    "random_key",
    "random_nonce",
    "scrypt_derive",
    "x25519_exchange",
    "x25519_generate",
    "x25519_public_bytes",
]

KEY_BYTES = 32  # AES-256
NONCE_BYTES = 12  # 96-bit GCM nonce, random per message
TAG_BYTES = 16


# AES-GCM with random 96-bit nonces stays within NIST's 2**-32 collision bound for
# 2**32 messages per key; one DEK per (tenant, subject, scope) never comes close.
def random_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def random_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def random_bytes(n: int) -> bytes:
    return secrets.token_bytes(n)


def new_aead(key: bytes) -> AESGCM:
    return AESGCM(key)


def hmac_sha256(key: bytes, message: bytes) -> bytes:
    return hmac.digest(key, message, hashlib.sha256)


def constant_time_equal(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


def ed25519_generate() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def ed25519_private_bytes(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.Raw,
        serialization.PrivateFormat.Raw,
        serialization.NoEncryption(),
    )


def ed25519_private_from_bytes(raw: bytes) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(raw)


def ed25519_public_bytes(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def ed25519_public_from_bytes(raw: bytes) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(raw)


def ed25519_sign(key: Ed25519PrivateKey, message: bytes) -> bytes:
    return key.sign(message)


def ed25519_verify(key: Ed25519PublicKey, signature: bytes, message: bytes) -> None:
    """Raise ``InvalidSignature`` when the signature does not verify."""
    key.verify(signature, message)


def hkdf_sha256(ikm: bytes, *, salt: bytes, info: bytes, length: int = KEY_BYTES) -> bytes:
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(ikm)


def scrypt_derive(passphrase: bytes, *, salt: bytes, n: int, r: int, p: int) -> bytes:
    from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

    return Scrypt(salt=salt, length=KEY_BYTES, n=n, r=r, p=p).derive(passphrase)


def x25519_generate() -> tuple[bytes, bytes]:
    """A fresh X25519 key pair as raw (private, public) bytes."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    key = X25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    return private, x25519_public_bytes(private)


def x25519_public_bytes(private: bytes) -> bytes:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    key = X25519PrivateKey.from_private_bytes(private)
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def x25519_exchange(private: bytes, peer_public: bytes) -> bytes:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

    key = X25519PrivateKey.from_private_bytes(private)
    return key.exchange(X25519PublicKey.from_public_bytes(peer_public))
