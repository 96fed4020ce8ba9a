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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, overload

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

__all__ = [
    "AESGCM",
    "FF1",
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
    """A fresh 96-bit GCM nonce straight from ``os.urandom`` (one getrandom call):
    no pool, so no state that a thread or a forked child could share. A per-thread
    pool saved about 0.3 µs a draw and nothing measurable end to end (sanitize,
    memory puts; benchmarks/README.md), not worth state in the one place where a
    bug means nonce reuse."""
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


# -- FF1 format-preserving encryption (NIST SP 800-38G Rev. 1) ----------------------
#
# The vault's token ids are 10 hex digits: FF1 over radix 16 turns a token's row
# number into them and back under a secret key, so ids never collide (the numbers
# are unique), reveal no order and cannot be guessed, and a token finds its row by
# primary key. One implementation, vectorised over many inputs (each Feistel round
# is one AES call over every input), tested against NIST's published samples.

_FF1_ROUNDS = 10


def raw_aes(key: bytes) -> Callable[[bytes], bytes]:
    """AES on whole 16-byte blocks, each enciphered on its own: FF1's PRF (a CBC-MAC
    that the callers chain themselves) and CIPH_K. Never a mode for data."""
    encryptor = Cipher(algorithms.AES(key), modes.ECB()).encryptor()  # noqa: S305 - block cipher calls of FF1's PRF, not a data mode
    return encryptor.update


def _xor(x: bytes, y: bytes) -> bytes:
    return bytes(p ^ q for p, q in zip(x, y, strict=True))


class FF1:
    """FF1 (SP 800-38G) under one key and tweak, for strings of ``length`` numerals
    in ``radix``.

    A string X is given as its two halves ``A = NUM(X[:u])`` and ``B = NUM(X[u:])``
    (``u = length // 2``): as two ints (one string) or as two ``uint64`` arrays (many
    strings, each round one AES call over all of them). The same rounds serve both;
    only the PRF's block assembly differs, so both give the same answers (the tests
    run NIST's samples through both). Every value of a round fits a 64-bit lane,
    which bounds the domain to ``radix ** ceil(length / 2)`` below about ``2**52``
    (ValueError beyond): every NIST sample and the token ids fit.

    The PRF's input for round i is CBC-MAC(P || Q) with Q = T || 0* || [i] || NUM(B):
    everything but the last block is the same for every input, so its chaining value
    is computed once here; NUM(B) (at most 7 bytes) sits in that last block's low
    half. For arrays, ``y = NUM(S[:d]) mod radix**m`` is the sum of S's bytes times
    ``256**k mod radix**m``, which stays below 2**64 by the same bound.
    """

    __slots__ = ("_ciph", "_d", "_high", "_low", "_mods", "_weights")

    def __init__(self, key: bytes, *, radix: int, length: int, tweak: bytes = b"") -> None:
        n = length
        if not 2 <= radix <= 2**16 or n < 2 or radix**n < 1_000_000 or len(tweak) >= 2**32:
            raise ValueError("FF1 needs radix**n >= 1,000,000 and 2 <= radix <= 65536")
        u, v = n // 2, n - n // 2
        b = ((radix**v - 1).bit_length() + 7) // 8  # bytes of NUM(B): ceil(v * log2(radix) / 8)
        d = 4 * -(-b // 4) + 4
        if (255 * d + 1) * radix**v > 2**64:
            raise ValueError("this FF1 needs radix ** ceil(n / 2) below about 2**52")
        import numpy as np  # only FF1 needs it: importing the keyring stays light

        self._ciph = ciph = raw_aes(key)
        p = (
            bytes([1, 2, 1])
            + radix.to_bytes(3, "big")
            + bytes([10, u % 256])
            + n.to_bytes(4, "big")
            + len(tweak).to_bytes(4, "big")
        )
        pad = bytes((-len(tweak) - b - 1) % 16)
        self._low: list[int] = []
        for i in range(_FF1_ROUNDS):
            q = tweak + pad + bytes([i]) + bytes(b)
            chain = ciph(p)
            for start in range(0, len(q) - 16, 16):
                chain = ciph(_xor(chain, q[start : start + 16]))
            last = _xor(chain, q[-16:])  # XOR NUM(B) into its low bytes to finish Q
            # [i] sits at byte 15 - b >= 8 (b <= 7 by the bound above), so the high
            # half of the last block is the same in every round.
            self._high = int.from_bytes(last[:8], "big")
            self._low.append(int.from_bytes(last[8:], "big"))
        self._d = d
        self._mods = (radix**u, radix**v)
        self._weights = tuple(
            np.array([pow(256, d - 1 - k, m) for k in range(d)], dtype=np.uint64)
            for m in self._mods
        )

    def _prf(self, i: int, half: Any, q: NDArray[Any] | None) -> Any:
        """Round i's ``NUM(S[:d]) mod radix**m`` for one string (``q`` None) or for
        every string (``q`` the blocks' array, high halves already filled in)."""
        m = self._mods[i % 2]
        if q is None:
            block = ((self._high << 64) | half ^ self._low[i]).to_bytes(16, "big")
            return int.from_bytes(self._ciph(block)[: self._d], "big") % m
        import numpy as np

        q[:, 1] = half ^ self._low[i]
        r = np.frombuffer(self._ciph(q.tobytes()), dtype=np.uint8).reshape(-1, 16)
        return (r[:, : self._d] @ self._weights[i % 2]) % m

    def _start(self, a: Any, b: Any) -> NDArray[Any] | None:
        """Check the halves; the blocks' array for arrays, None for one string."""
        if isinstance(a, int):
            if not (0 <= a < self._mods[0] and 0 <= b < self._mods[1]):
                raise ValueError("a numeral string is out of the radix or length")
            return None
        import numpy as np

        if len(a) != len(b):
            raise ValueError("FF1 needs as many A halves as B halves")
        if len(a) and (int(a.max()) >= self._mods[0] or int(b.max()) >= self._mods[1]):
            raise ValueError("a numeral string is out of the radix or length")
        q = np.empty((len(a), 2), dtype=">u8")
        q[:, 0] = self._high
        return q

    @overload
    def encrypt(self, a: int, b: int) -> tuple[int, int]: ...

    @overload
    def encrypt(
        self, a: NDArray[np.uint64], b: NDArray[np.uint64]
    ) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]: ...

    def encrypt(self, a: Any, b: Any) -> tuple[Any, Any]:
        """FF1.Encrypt of the string with halves ``(a, b)``, or of every ``(a[j], b[j])``;
        returns the halves."""
        q = self._start(a, b)
        for i in range(_FF1_ROUNDS):
            a, b = b, (a + self._prf(i, b, q)) % self._mods[i % 2]
        return a, b

    @overload
    def decrypt(self, a: int, b: int) -> tuple[int, int]: ...

    @overload
    def decrypt(
        self, a: NDArray[np.uint64], b: NDArray[np.uint64]
    ) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]: ...

    def decrypt(self, a: Any, b: Any) -> tuple[Any, Any]:
        """FF1.Decrypt, the inverse of ``encrypt``."""
        q = self._start(a, b)
        for i in range(_FF1_ROUNDS - 1, -1, -1):
            m = self._mods[i % 2]
            a, b = (b + m - self._prf(i, a, q)) % m, a
        return a, b


def _ff1_digits(
    key: bytes, tweak: bytes, radix: int, digits: list[int], *, decrypt: bool
) -> list[int]:
    if any(not 0 <= digit < radix for digit in digits):
        raise ValueError("a digit is out of the radix")
    ff1 = FF1(key, radix=radix, length=len(digits), tweak=tweak)
    u = len(digits) // 2
    half_a, half_b = _num(digits[:u], radix), _num(digits[u:], radix)
    a, b = ff1.decrypt(half_a, half_b) if decrypt else ff1.encrypt(half_a, half_b)
    return _str(a, radix, u) + _str(b, radix, len(digits) - u)


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


def ff1_encrypt(key: bytes, tweak: bytes, radix: int, digits: list[int]) -> list[int]:
    """FF1.Encrypt(K, T, X) of SP 800-38G over one string of numerals in ``radix``."""
    return _ff1_digits(key, tweak, radix, digits, decrypt=False)


def ff1_decrypt(key: bytes, tweak: bytes, radix: int, digits: list[int]) -> list[int]:
    """FF1.Decrypt(K, T, Y) of SP 800-38G: the inverse of ``ff1_encrypt``."""
    return _ff1_digits(key, tweak, radix, digits, decrypt=True)
