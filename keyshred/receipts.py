"""Erasure receipts: what was done, when, and what backups still hold — signed.

A receipt names the subject only by subject_ref. It is a pydantic model serialized
as JSON; the signature is Ed25519 over the canonical JSON of every other field
(sorted keys, no whitespace), made with the keyring's receipt key. ``verify`` needs
the receipt and the public key the verifier trusts (never the one inside the
receipt), and runs offline: ``keyshred receipt verify FILE --public-key KEY``, or
``--path DATA`` for the issuing store's own key.
"""

from __future__ import annotations

import base64
import json
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from keyshred.errors import IntegrityError, InvalidInput
from keyshred.keyring.keyring import Signer, verify_signature

__all__ = [
    "BackupCoverage",
    "Check",
    "DerivedAction",
    "ExternalCall",
    "Receipt",
    "ReceiptMetrics",
    "SharedKey",
    "Signature",
    "StoreAction",
    "load_receipt",
    "sign_receipt",
    "verify_receipt",
]

FORMAT = "keyshred-receipt/1"
_ED25519_PUBLIC_BYTES = 32


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StoreAction(_Model):
    store: str  # "keyring", "memories", "vectors", "catalog", ...
    action: str  # "keys-destroyed", "partition-dropped", ...
    count: int
    at: datetime


class DerivedAction(_Model):
    asset_id: str
    kind: str
    owner_subject_ref: str
    action: Literal["rebuilt", "dropped"]
    producer: str | None = None
    producer_version: str | None = None
    at: datetime


class SharedKey(_Model):
    """A key the erased subject co-owned with another holder's data (a memory that
    mentions them, an asset derived from theirs), destroyed with the subject's own:
    ``assets`` are the holder's assets it made unreadable, by asset id (each is then
    rebuilt or dropped: see ``Receipt.derived``)."""

    key_id: str
    holder_subject_ref: str
    assets: list[str] = []


class ExternalCall(_Model):
    processor: str
    status: Literal["acknowledged", "deletion_not_verifiable"]
    detail: str
    at: datetime


class Check(_Model):
    name: str
    passed: bool
    detail: str


class BackupCoverage(_Model):
    """What backups still hold. ``backup_final_date``: after it no retained backup
    (nor any copy of one) can yield the subject's key material, because the archive
    KEK epoch of every generation that held it is destroyed by then by the archive
    schedule (plus the KMS deletion window). ``generations`` are the retained backup
    generations that held the subject's keys; ``expire_by`` is when the last of
    them expires by retention policy and ``epoch_destroyed_by`` when the scheduled
    KEK-epoch destruction makes them unreadable."""

    covered: bool
    backup_final_date: datetime | None
    note: str
    generations: list[str] = []
    objects_deleted: int = 0
    expire_by: datetime | None = None
    epoch_destroyed_by: datetime | None = None


class ReceiptMetrics(_Model):
    """Measured figures of the erasure. ``eviction_processes``: how many processes
    (each open handle's listener, the erasing one's included) acknowledged that they
    dropped the subject's cached keys, rows and vectors after its suppression, by
    the time the receipt was made; ``eviction_max_latency_ms``: the longest time
    from the suppression's commit to one of them having evicted, by the database's
    clock (None when none acknowledged)."""

    eviction_processes: int = 0
    eviction_max_latency_ms: float | None = None


class Signature(_Model):
    algorithm: Literal["Ed25519"] = "Ed25519"
    public_key: str  # base64
    value: str  # base64


class Receipt(_Model):
    format: Literal["keyshred-receipt/1"] = "keyshred-receipt/1"
    request_id: str
    subject_ref: str
    scope: str | None
    requested_by: str
    reason: str
    requested_at: datetime
    suppressed_at: datetime
    keys_destroyed_at: datetime
    online_erased_at: datetime
    completed_at: datetime
    key_ids: list[str]
    tombstone_id: str | None
    stores: list[StoreAction]
    derived: list[DerivedAction]
    external: list[ExternalCall]
    verification: list[Check]
    backups: BackupCoverage
    legal_hold_history: bool = False
    kind: str = "erasure"  # "erasure", "retention" or "consent-withdrawal"
    assets: list[str] = []  # a retention request: exactly these memory assets
    # False: nothing of the subject was stored here (the id is suppressed all the
    # same). None in receipts issued before the field existed.
    found_data: bool | None = None
    # The co-owned keys destroyed with the subject's (None in receipts issued
    # before the field existed).
    shared_keys: list[SharedKey] | None = None
    # When the live KEK epoch current at key destruction is destroyed by the live
    # schedule (its creation + ``keyring.live_rotate_minutes``, + the KMS deletion
    # window): until then a wrapped key left in database pages, WAL, replicas or
    # PITR archives could still be unwrapped by the live keyring; after it, none.
    # None in receipts issued before the field existed, and when no key was destroyed.
    live_residue_until: datetime | None = None
    # Measured figures (eviction everywhere); None in receipts issued before it.
    metrics: ReceiptMetrics | None = None
    signature: Signature | None = None

    def canonical(self) -> bytes:
        # Fields added later are left out while unset, so older receipts verify.
        unset = {
            name
            for name in ("found_data", "shared_keys", "live_residue_until", "metrics")
            if getattr(self, name) is None
        }
        body = self.model_dump(mode="json", exclude={"signature", *unset})
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)


def sign_receipt(receipt: Receipt, signer: Signer) -> Receipt:
    signature = Signature(
        public_key=base64.b64encode(signer.public_key).decode("ascii"),
        value=base64.b64encode(signer.sign(receipt.canonical())).decode("ascii"),
    )
    return receipt.model_copy(update={"signature": signature})


def verify_receipt(receipt: Receipt, public_key: bytes) -> None:
    """Raise ``IntegrityError`` unless the receipt is intact and signed by
    ``public_key``, the key the verifier trusts: the signing key of the store that
    issued it (``ks.keyring.signer().public_key``) or one pinned from it earlier.

    The key written inside the receipt is never trusted by itself: anyone can edit
    a receipt and re-sign it with a fresh key of their own."""
    if not isinstance(public_key, bytes) or len(public_key) != _ED25519_PUBLIC_BYTES:
        raise InvalidInput("verify_receipt needs the trusted Ed25519 public key (32 bytes)")
    if receipt.signature is None:
        raise IntegrityError("the receipt is not signed")
    try:
        key = base64.b64decode(receipt.signature.public_key, validate=True)
        value = base64.b64decode(receipt.signature.value, validate=True)
    except ValueError:
        raise IntegrityError("the receipt's signature is malformed") from None
    if key != public_key:
        raise IntegrityError("the receipt was signed by another key than the trusted one")
    verify_signature(public_key, value, receipt.canonical())


def load_receipt(text: str) -> Receipt:
    try:
        return Receipt.model_validate_json(text)
    except ValidationError:
        raise IntegrityError("not a keyshred receipt (or it was altered)") from None
