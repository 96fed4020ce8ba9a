"""Regenerate ``receipt_legacy_json.json``: a receipt in the JSON form, issued by the
code that issued such receipts (``receipts_f8fbea5.py``, keyshred/receipts.py as of
commit f8fbea5) with the JWS vectors' fixed signing key, so tests check that a
receipt of that form keeps loading and verifying. Run:
``python tests/vectors/generate_legacy_receipt_vector.py`` (deterministic).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

from keyshred.keyring.keyring import Signer

HERE = Path(__file__).parent


def main() -> None:
    spec = importlib.util.spec_from_file_location("receipts_f8fbea5", HERE / "receipts_f8fbea5.py")
    assert spec is not None and spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = old  # pydantic resolves the annotations through it
    spec.loader.exec_module(old)
    fields = json.loads(
        json.loads((HERE / "receipt_jws.json").read_text("utf-8"))["valid"]["payload"]
    )
    fields["request_id"] = "req-legacy-1"
    # As a receipt signed before these fields existed: they are absent, not null.
    for name in ("found_data", "shared_keys", "live_residue_until"):
        del fields[name]
    signer = Signer(hashlib.sha256(b"receipt-vector-signer").digest())
    receipt = old.sign_receipt(old.Receipt.model_validate(fields), signer)
    doc = {
        "format": "keyshred receipt, JSON form (before JWS receipts), made by receipts_f8fbea5.py",
        "receipt": receipt.to_json(),
    }
    out = HERE / "receipt_legacy_json.json"
    out.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
