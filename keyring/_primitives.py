"""Raw cryptographic primitives. Private: only ``keyshred.keyring`` imports this module.

Everything above this layer speaks in task-shaped calls (seal, open, wrap, destroy);
this is the one place that touches pyca/cryptography's hazmat-level objects, so an
audit of how keys are used starts and ends here.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import secrets
import threading
from collections.abc import Callable

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
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
    "ff1_decrypt",
    "ff1_encrypt",
    "hkdf_sha256",
    "hmac_sha256",
    "new_aead",
    "nonces",
    "random_bytes",
    "random_key",
    "random_nonce",
    "raw_aes",
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
    return nonces(1)


_NONCE_POOL = 4096  # bytes of os.urandom drawn at once for nonces


class _NoncePool:
    __slots__ = ("at", "buf", "generation")

    def __init__(self) -> None:
        self.buf = b""
        self.at = 0
        self.generation = -1


# Each thread's pool. One thread-local lookup per call: every attribute read on a
# ``threading.local`` goes through its per-thread dictionary, several of them cost
# more than the slicing itself.
_threads = threading.local()
_fork_generation = 0


def _forked() -> None:
    global _fork_generation  # noqa: PLW0603 - one counter for the whole process
    _fork_generation += 1


os.register_at_fork(after_in_child=_forked)


def nonces(count: int) -> bytes:
    """``count`` fresh 96-bit nonces, concatenated. Drawn from ``os.urandom`` 4 KiB
    at a time per thread: a nonce is public (it is stored with its ciphertext), and
    a system call per seal was a measurable share of a sanitize. A forked child
    draws anew, so parent and child never hand out the same bytes. (Keys and
    secrets never come from this pool.)"""
    n = count * NONCE_BYTES
    try:
        pool: _NoncePool = _threads.pool
    except AttributeError:
        pool = _threads.pool = _NoncePool()
    at = pool.at
    if at + n > len(pool.buf) or pool.generation != _fork_generation:
        if n > _NONCE_POOL:
            return os.urandom(n)
        pool.buf = os.urandom(_NONCE_POOL)
        pool.generation = _fork_generation
        at = 0
    pool.at = at + n
    return pool.buf[at : at + n]


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


# -- FF1 format-preserving encryption (NIST SP 800-38G Rev. 1) ----------------------
#
# The vault's token ids are 10 hex digits: FF1 over radix 16 turns a token's row
# number into them and back under a secret key, so ids never collide (the numbers
# are unique), reveal no order and cannot be guessed, and a token finds its row by
# primary key. Tested against NIST's published samples.


def raw_aes(key: bytes) -> Callable[[bytes], bytes]:
    """AES on whole 16-byte blocks, each enciphered on its own: FF1's PRF (a CBC-MAC
    that the callers chain themselves) and CIPH_K. Never a mode for data."""
    encryptor = Cipher(algorithms.AES(key), modes.ECB()).encryptor()  # noqa: S305 - block cipher calls of FF1's PRF, not a data mode
    return encryptor.update


def _ff1_setup(
    ciph: Callable[[bytes], bytes], tweak: bytes, radix: int, n: int
) -> tuple[int, int, int, int, bytes]:
    if not 2 <= radix <= 2**16 or radix**n < 1_000_000 or n > 2**32 - 1 or n < 2:
        raise ValueError("FF1 needs radix**n >= 1,000,000 and 2 <= radix <= 65536")
    u = n // 2
    v = n - u
    b = -(-math.ceil(v * math.log2(radix) - 1e-9) // 8)
    d = 4 * -(-b // 4) + 4
    p = (
        bytes([1, 2, 1])
        + radix.to_bytes(3, "big")
        + bytes([10, u % 256])
        + n.to_bytes(4, "big")
        + len(tweak).to_bytes(4, "big")
    )
    return u, v, b, d, ciph(p)  # CBC-MAC over P alone: the chaining value for Q


def _ff1_round(
    ciph: Callable[[bytes], bytes],
    tweak: bytes,
    state: bytes,
    sizes: tuple[int, int],
    *,
    i: int,
    num: int,
) -> int:
    b, d = sizes
    q = tweak + bytes((-len(tweak) - b - 1) % 16) + bytes([i]) + num.to_bytes(b, "big")
    r = state
    for start in range(0, len(q), 16):  # the CBC-MAC over Q, chained from P's block
        r = ciph(bytes(x ^ y for x, y in zip(r, q[start : start + 16], strict=True)))
    s = r
    j = 1
    while len(s) < d:
        s += ciph(bytes(x ^ y for x, y in zip(r, j.to_bytes(16, "big"), strict=True)))
        j += 1
    return int.from_bytes(s[:d], "big")


def _num(digits: list[int], radix: int) -> int:
    x = 0
    for digit in digits:
        x = x * radix + digit
    return x


def _str(x: int, radix: int, m: int) -> list[int]:
    out = [0] * m
    for k in range(m - 1, -1, -1):
        x, out[k] = divmod(x, radix)
    return out


def _ff1_check(digits: list[int], radix: int) -> None:
    if any(not 0 <= digit < radix for digit in digits):
        raise ValueError("a digit is out of the radix")


def ff1_encrypt(key: bytes, tweak: bytes, radix: int, digits: list[int]) -> list[int]:
    """FF1.Encrypt(K, T, X) of SP 800-38G over numerals in ``radix``."""
    _ff1_check(digits, radix)
    ciph = raw_aes(key)
    u, v, b, d, state = _ff1_setup(ciph, tweak, radix, len(digits))
    a, bb = _num(digits[:u], radix), _num(digits[u:], radix)
    for i in range(10):
        m = u if i % 2 == 0 else v
        y = _ff1_round(ciph, tweak, state, (b, d), i=i, num=bb)
        a, bb = bb, (a + y) % radix**m
    return _str(a, radix, u) + _str(bb, radix, v)


def ff1_decrypt(key: bytes, tweak: bytes, radix: int, digits: list[int]) -> list[int]:
    """FF1.Decrypt(K, T, Y) of SP 800-38G: the inverse of ``ff1_encrypt``."""
    _ff1_check(digits, radix)
    ciph = raw_aes(key)
    u, v, b, d, state = _ff1_setup(ciph, tweak, radix, len(digits))
    a, bb = _num(digits[:u], radix), _num(digits[u:], radix)
    for i in range(9, -1, -1):
        m = u if i % 2 == 0 else v
        y = _ff1_round(ciph, tweak, state, (b, d), i=i, num=a)
        a, bb = (bb - y) % radix**m, a
    return _str(a, radix, u) + _str(bb, radix, v)
