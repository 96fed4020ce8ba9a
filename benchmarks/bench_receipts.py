"""What a JWS receipt costs against the JSON form it replaced, and what a webhook
signature costs, in the same run.

- sign: the JSON form (sorted-key ``json.dumps`` + Ed25519, the code before JWS
  receipts: ``Receipt.canonical``) against the JWS (RFC 8785 payload + JCS header +
  Ed25519 + base64url);
- verify: keyshred's own check of each form (load, signature, fields), and joserfc's
  verification of the same JWS against the JWKS, the check an outside verifier runs;
- webhooks: ``keyshred.webhooks.sign``/``verify`` against ``standardwebhooks``.

Run: ``.venv/bin/python benchmarks/bench_receipts.py [--n N]``. Needs the dev extra
(joserfc, standardwebhooks). Prints microseconds per call (median of 5 rounds).
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import time
import warnings
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from joserfc import jws as jose_jws
from joserfc.jwk import KeySet
from standardwebhooks.webhooks import Webhook

from keyshred import webhooks
from keyshred.jose import jwks
from keyshred.keyring import _primitives as prim
from keyshred.keyring.keyring import Signer
from keyshred.receipts import (
    Receipt,
    Signature,
    load_receipt,
    sign_receipt,
    verify_receipt,
)

VECTORS = Path(__file__).parents[1] / "tests" / "vectors" / "receipt_jws.json"


def per_call(fn: Callable[[], object], n: int) -> float:
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=2000)
    n = parser.parse_args().n
    warnings.simplefilter("ignore")  # joserfc's RFC 9864 note on "EdDSA"
    signer = Signer(prim.ed25519_private_bytes(prim.ed25519_generate()))
    unsigned = Receipt.model_validate_json(json.loads(VECTORS.read_text())["valid"]["payload"])
    published = jwks([signer.public_key])
    keyset = KeySet.import_key_set(published)

    def sign_json() -> Receipt:
        value = base64.b64encode(signer.sign(unsigned.canonical())).decode()
        key = base64.b64encode(signer.public_key).decode()
        return unsigned.model_copy(update={"signature": Signature(public_key=key, value=value)})

    json_text = sign_json().to_json()
    jws_text = sign_receipt(unsigned, signer).serialize()
    rows = [
        ("sign, JSON form", per_call(sign_json, n)),
        ("sign, JWS", per_call(lambda: sign_receipt(unsigned, signer), n)),
        (
            "load + verify, JSON form (keyshred)",
            per_call(lambda: verify_receipt(load_receipt(json_text), published), n),
        ),
        (
            "load + verify, JWS (keyshred)",
            per_call(lambda: verify_receipt(load_receipt(jws_text), published), n),
        ),
        (
            "verify, JWS (joserfc, KeySet)",
            per_call(
                lambda: jose_jws.deserialize_compact(jws_text, keyset, algorithms=["EdDSA"]), n
            ),
        ),
    ]
    secret = webhooks.new_secret()
    body = json.dumps({"request_id": "req-1", "state": "completed"}).encode()
    stamp = int(time.time())
    headers = webhooks.sign(secret, "msg_1", stamp, body)
    official = Webhook(secret)
    moment = datetime.fromtimestamp(stamp, UTC)
    ours = webhooks.sign
    rows += [
        ("webhook sign (keyshred)", per_call(lambda: ours(secret, "msg_1", stamp, body), n)),
        (
            "webhook sign (standardwebhooks)",
            per_call(lambda: official.sign("msg_1", moment, body.decode()), n),
        ),
        ("webhook verify (keyshred)", per_call(lambda: webhooks.verify(secret, headers, body), n)),
        ("webhook verify (standardwebhooks)", per_call(lambda: official.verify(body, headers), n)),
    ]
    print(f"{'operation':<40} {'us/call':>9}")
    for name, us in rows:
        print(f"{name:<40} {us:>9.1f}")
    print(f"sizes: JSON form {len(json_text)} bytes, JWS {len(jws_text)} bytes")


if __name__ == "__main__":
    main()
