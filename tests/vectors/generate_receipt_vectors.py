"""Regenerate ``receipt_jws.json``: JWS receipt vectors, valid and invalid, in the
pyca style (fixed keys, fixed inputs, the exact expected bytes).

Deliberately independent of ``keyshred.jose`` and ``keyshred.receipts``: the tokens
are assembled from RFC 7515 (compact serialization), RFC 8037 (EdDSA, OKP keys),
RFC 7638 (thumbprints) and RFC 8785 (the payload and header as canonical JSON:
for documents of ASCII member names, strings, integers, booleans and nulls that is
``json.dumps`` with sorted keys, no whitespace and raw UTF-8), with pyca's Ed25519
directly, so the tests cross-check the implementation against the specifications.
Run: ``python tests/vectors/generate_receipt_vectors.py`` (output is deterministic:
Ed25519 signatures are).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

TYP = "keyshred-receipt+jws"


def b64u(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def jcs(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def key(label: str) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(label.encode()).digest())


def public(k: Ed25519PrivateKey) -> bytes:
    return k.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def thumbprint(k: Ed25519PrivateKey) -> str:
    members = {"crv": "Ed25519", "kty": "OKP", "x": b64u(public(k))}
    return b64u(hashlib.sha256(jcs(members)).digest())


def jwk(k: Ed25519PrivateKey) -> dict[str, str]:
    return {
        "kty": "OKP",
        "crv": "Ed25519",
        "x": b64u(public(k)),
        "kid": thumbprint(k),
        "use": "sig",
        "alg": "EdDSA",
    }


def token(header: dict[str, Any], payload: bytes, k: Ed25519PrivateKey) -> str:
    signing_input = f"{b64u(jcs(header))}.{b64u(payload)}"
    return f"{signing_input}.{b64u(k.sign(signing_input.encode()))}"


RECEIPT: dict[str, Any] = {
    "format": "keyshred-receipt/1",
    "request_id": "req-vector-1",
    "subject_ref": "abcdefghijklmnopqrstuvwxyz",
    "scope": None,
    "requested_by": "dpo@example.com",
    "reason": 'Art. 17 DSGVO – Löschung \u00e9\u4e2d\U0001f600 "quoted" \\ \n',
    "requested_at": "2026-12-02T18:00:00Z",
    "suppressed_at": "2026-12-02T18:00:01Z",
    "keys_destroyed_at": "2026-12-02T18:00:02.123456Z",
    "online_erased_at": "2026-12-02T18:00:02.123456Z",
    "completed_at": "2026-12-02T18:00:03Z",
    "key_ids": ["00112233445566778899aabbccddeeff"],
    "tombstone_id": "tomb-1",
    "stores": [
        {"store": "keyring", "action": "keys-destroyed", "count": 1, "at": "2026-12-02T18:00:02Z"}
    ],
    "derived": [],
    "external": [],
    "verification": [{"name": "unwrap-fails", "passed": True, "detail": "1 key"}],
    "backups": {
        "covered": True,
        "backup_final_date": None,
        "note": "no backup held the subject",
        "generations": [],
        "objects_deleted": 0,
        "expire_by": None,
        "epoch_destroyed_by": None,
    },
    "legal_hold_history": False,
    "kind": "erasure",
    "assets": [],
    "found_data": True,
    "shared_keys": [],
    "live_residue_until": "2026-12-02T19:00:00Z",
}


def main() -> None:
    signer, other = key("receipt-vector-signer"), key("receipt-vector-other")
    kid = thumbprint(signer)
    header = {"alg": "EdDSA", "kid": kid, "typ": TYP}
    payload = jcs(RECEIPT)
    valid = token(header, payload, signer)
    head_b64, payload_b64, sig_b64 = valid.split(".")

    flipped = bytearray(payload)
    flipped[payload.index(b"req-vector-1")] ^= 0x01  # "req" -> "seq"
    bad_sig = bytearray(base64.urlsafe_b64decode(sig_b64 + "=="))
    bad_sig[0] ^= 0x80
    hs256_header = {"alg": "HS256", "kid": kid, "typ": TYP}
    hs256_input = f"{b64u(jcs(hs256_header))}.{payload_b64}"
    # The classic confusion: an HMAC keyed with the published public key.
    hs256_sig = hmac.new(public(signer), hs256_input.encode(), hashlib.sha256).digest()
    invalid = [
        ("payload byte flipped", f"{head_b64}.{b64u(bytes(flipped))}.{sig_b64}", "IntegrityError"),
        (
            "signature bit flipped",
            f"{head_b64}.{payload_b64}.{b64u(bytes(bad_sig))}",
            "IntegrityError",
        ),
        (
            "kid altered to a key not in the JWKS",
            token({**header, "kid": thumbprint(key("nobody"))}, payload, signer),
            "UntrustedSigner",
        ),
        (
            "kid names the other trusted key, signed by the first",
            token({**header, "kid": thumbprint(other)}, payload, signer),
            "IntegrityError",
        ),
        (
            "signed by a key not in the JWKS (its own kid)",
            token({**header, "kid": thumbprint(key("intruder"))}, payload, key("intruder")),
            "UntrustedSigner",
        ),
        (
            "alg none, empty signature",
            f"{b64u(jcs({'alg': 'none', 'typ': TYP}))}.{payload_b64}.",
            "IntegrityError",
        ),
        (
            "alg none with the kid",
            f"{b64u(jcs({'alg': 'none', 'kid': kid, 'typ': TYP}))}.{payload_b64}.",
            "IntegrityError",
        ),
        (
            "alg HS256 keyed with the public key",
            f"{hs256_input}.{b64u(hs256_sig)}",
            "IntegrityError",
        ),
        ("typ JWT", token({**header, "typ": "JWT"}, payload, signer), "IntegrityError"),
        ("no typ", token({"alg": "EdDSA", "kid": kid}, payload, signer), "IntegrityError"),
        ("no kid", token({"alg": "EdDSA", "typ": TYP}, payload, signer), "IntegrityError"),
        (
            "embedded jwk header",
            token({**header, "jwk": jwk(key("intruder"))}, payload, signer),
            "IntegrityError",
        ),
        (
            "crit header",
            token({**header, "crit": ["exp"], "exp": 1}, payload, signer),
            "IntegrityError",
        ),
        ("padded base64url", f"{head_b64}.{payload_b64}.{sig_b64}==", "IntegrityError"),
        ("two segments", f"{head_b64}.{payload_b64}", "IntegrityError"),
        (
            "JWS JSON serialization",
            json.dumps({"payload": payload_b64, "signatures": []}),
            "IntegrityError",
        ),
        (
            "signed payload is not a receipt",
            token(header, jcs({**RECEIPT, "extra": 1}), signer),
            "IntegrityError",
        ),
    ]
    doc = {
        "format": "keyshred receipt JWS (RFC 7515 compact, EdDSA/Ed25519, JCS payload); "
        "see keyshred/jose.py and keyshred/receipts.py",
        "signing_key_seed": hashlib.sha256(b"receipt-vector-signer").hexdigest(),
        "jwks": {"keys": [jwk(other), jwk(signer)]},
        "valid": {"header": header, "payload": payload.decode(), "jws": valid},
        "invalid": [{"reason": r, "jws": t, "error": e} for r, t, e in invalid],
    }
    out = Path(__file__).with_name("receipt_jws.json")
    out.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
