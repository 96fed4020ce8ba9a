"""Regenerate ``envelope_v1.json`` from the format spec, using pyca's AESGCM directly.

Deliberately independent of ``keyshred.keyring.envelope``: the vectors are computed
from the documented layout (header, AAD construction), so the tests cross-check the
implementation against the spec instead of against itself. Run:
``python tests/vectors/generate_envelope_vectors.py`` (output is deterministic).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from cryptography.hazmat.primitives.ciphers.aead import AESGCM


def place_bytes(*parts: str) -> bytes:
    return b"".join(struct.pack(">I", len(p.encode())) + p.encode() for p in parts)


def det(label: str, n: int) -> bytes:
    return hashlib.sha256(label.encode()).digest()[:n]


def main() -> None:
    cases = []
    for i, (size, place) in enumerate(
        [
            (0, ("ref0aaaaaaaaaaaaaaaaaaaaaa", "default", "memories", "m-1", "value")),
            (1, ("ref1bbbbbbbbbbbbbbbbbbbbbb", "support/health", "memories", "m-2", "key")),
            (64, ("ref2cccccccccccccccccccccc", "default", "vectors", "v-9", "embedding")),
            (1000, ("ref3dddddddddddddddddddddd", "ünïcode/scope", "tokens", "t-😀", "value")),
        ]
    ):
        key = det(f"key-{i}", 32)
        key_id = det(f"key-id-{i}", 16)
        nonce = det(f"nonce-{i}", 12)
        plaintext = det(f"pt-{i}", 32) * (size // 32) + det(f"pt-{i}", 32)[: size % 32]
        header = b"KS" + bytes((1, 1)) + key_id
        aad = b"keyshred/envelope\x00" + header + place_bytes(*place)
        ct = header + nonce + AESGCM(key).encrypt(nonce, plaintext, aad)
        cases.append(
            {
                "key": key.hex(),
                "key_id": key_id.hex(),
                "nonce": nonce.hex(),
                "place": list(place),
                "plaintext": plaintext.hex(),
                "ciphertext": ct.hex(),
            }
        )
    base = cases[1]
    ct = bytes.fromhex(base["ciphertext"])
    negatives = [
        {"why": "unknown format version", "ciphertext": (ct[:2] + b"\x02" + ct[3:]).hex()},
        {"why": "unknown algorithm", "ciphertext": (ct[:3] + b"\x02" + ct[4:]).hex()},
        {"why": "bad magic", "ciphertext": (b"KT" + ct[2:]).hex()},
        {"why": "truncated tag", "ciphertext": ct[:-1].hex()},
        {"why": "truncated to header", "ciphertext": ct[:20].hex()},
        {"why": "empty", "ciphertext": ""},
        {"why": "flipped tag bit", "ciphertext": (ct[:-1] + bytes([ct[-1] ^ 0x80])).hex()},
        {"why": "flipped nonce bit", "ciphertext": (ct[:25] + bytes([ct[25] ^ 1]) + ct[26:]).hex()},
        {
            "why": "moved to another record",
            "ciphertext": ct.hex(),
            "place": [base["place"][0], base["place"][1], "memories", "m-3", "key"],
        },
        {
            "why": "moved to another column",
            "ciphertext": ct.hex(),
            "place": [base["place"][0], base["place"][1], "memories", "m-2", "value"],
        },
        {
            "why": "field boundary shift (length prefixes)",
            "ciphertext": ct.hex(),
            "place": [base["place"][0], base["place"][1], "memoriesm", "-2", "key"],
        },
    ]
    for n in negatives:
        n.setdefault("place", base["place"])
        n.update(key=base["key"], key_id=base["key_id"])
    out = {
        "format": "keyshred envelope v1 (AES-256-GCM); see keyring/envelope.py",
        "valid": cases,
        "invalid": negatives,
    }
    path = Path(__file__).with_name("envelope_v1.json")
    path.write_text(json.dumps(out, indent=2, ensure_ascii=False) + "\n", "utf-8")


if __name__ == "__main__":
    main()
