"""Receipts in the JSON form issued before receipts were JWS, for the tests that
check such receipts keep verifying: the signature that form carried (Ed25519 over
``Receipt.canonical()``, the embedded key), made as the code of that time did (see
tests/vectors/receipts_f8fbea5.py, the code itself)."""

from __future__ import annotations

import base64

from keyshred.keyring.keyring import Signer
from keyshred.receipts import Receipt, Signature

__all__ = ["sign_json_form"]


def sign_json_form(receipt: Receipt, signer: Signer) -> Receipt:
    """``receipt`` in the JSON form, signed by ``signer`` (round-trip it through
    ``to_json``/``load_receipt`` to get what was stored)."""
    signature = Signature(
        public_key=base64.b64encode(signer.public_key).decode("ascii"),
        value=base64.b64encode(signer.sign(receipt.canonical())).decode("ascii"),
    )
    return Receipt.model_validate_json(
        receipt.model_copy(update={"signature": signature}).to_json()
    )
