"""Erasure receipts: what was done, when, and what backups still hold — signed.

A receipt names the subject only by subject_ref. It is issued as a JWS (RFC 7515,
compact serialization) that any JOSE library verifies against the store's JWKS:

- protected header ``{"alg": "EdDSA", "kid": <RFC 7638 thumbprint of the signing
  key>, "typ": "keyshred-receipt+jws"}``;
- payload: the receipt's fields as RFC 8785 (JCS) canonical JSON (the ``rfc8785``
  package: the receipt holds only strings, integers, booleans, nulls, lists and
  objects — datetimes are ISO 8601 strings — but JCS's key order and string escapes
  are easy to get subtly wrong by hand, and other verifiers re-canonicalise);
- signature: Ed25519 by the keyring's receipt key (pyca ``cryptography``; see
  ``keyshred.jose`` for why keyshred uses no JOSE library itself).

``ks.receipts_jwks()`` (``keyshred keys jwks``) publishes the signing keys: every
key that signed a receipt the store still keeps. Receipts issued before (the JSON
form: a pydantic document with an embedded ``signature`` over the sorted-key JSON of
the other fields) keep loading and verifying. ``load_receipt`` reads either form;
``Receipt.serialize()`` gives back the form it was issued in; ``Receipt.form``
says which.

``verify_receipt`` needs the keys the verifier trusts (a JWKS, or one 32-byte
public key), never a key named inside the receipt, and runs offline:
``keyshred receipt verify FILE --jwks JWKS`` (or ``--public-key``, or ``--path DATA``
for the issuing store's own keys). It raises (``IntegrityError``, ``UntrustedSigner``
for a key not trusted); it never returns a bool.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Literal

import rfc8785
from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError

from keyshred.errors import IntegrityError, InvalidInput, UntrustedSigner
from keyshred.jose import jwk_thumbprint, parse_compact, sign_compact, trusted_keys, verify_compact
from keyshred.keyring.keyring import Signer, verify_signature

__all__ = [
    "BackupCoverage",
    "Check",
    "DerivedAction",
    "ExternalCall",
    "Receipt",
    "ReceiptForm",
    "ReceiptMetrics",
    "SharedKey",
    "Signature",
    "StoreAction",
    "load_receipt",
    "sign_receipt",
    "verify_receipt",
    "verify_receipt_text",
]

FORMAT = "keyshred-receipt/1"
JWS_TYPE = "keyshred-receipt+jws"
ReceiptForm = Literal["jws", "json", "unsigned"]


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
    """The signature of a receipt in the JSON form (issued before receipts were
    JWS): Ed25519 over ``Receipt.canonical()``."""

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
    # How the requester's identity was verified, as the HTTP API's identity hook
    # decided it (plain metadata: method, decision, by whom). None: not asked through
    # the API, or issued before the field existed.
    identity: dict[str, str] | None = None
    # The JSON form's signature; None in a JWS receipt (the JWS carries it).
    signature: Signature | None = None
    # The compact JWS this receipt was issued as (None: the JSON form, or unsigned).
    # Private, so it is in no dump of the fields; a copy with edited fields keeps
    # it, and then no longer verifies.
    _jws: str | None = PrivateAttr(default=None)

    @property
    def jws(self) -> str | None:
        """The compact JWS this receipt was issued as (None for the JSON form)."""
        return self._jws

    @property
    def form(self) -> ReceiptForm:
        """``jws`` (issued today), ``json`` (issued before JWS receipts), or
        ``unsigned`` (built, not signed yet)."""
        if self._jws is not None:
            return "jws"
        return "json" if self.signature is not None else "unsigned"

    @property
    def kid(self) -> str | None:
        """The RFC 7638 thumbprint of the key that signed it (the JWS ``kid``; for
        the JSON form, computed from its embedded key). None: unsigned."""
        if self._jws is not None:
            return parse_compact(self._jws, JWS_TYPE).kid
        if self.signature is not None:
            try:
                return jwk_thumbprint(_b64(self.signature.public_key))
            except (IntegrityError, InvalidInput):
                return None
        return None

    def payload(self) -> bytes:
        """The JWS payload: every field but the JSON form's ``signature``, as RFC
        8785 canonical JSON (nulls included, but for fields added since JWS receipts
        while they are unset)."""
        # Fields added after JWS receipts are left out while unset, so a receipt
        # issued before one existed re-serializes to the payload it was signed over.
        unset = {name for name in ("metrics", "identity") if getattr(self, name) is None}
        body = self.model_dump(mode="json", exclude={"signature", *unset})
        return rfc8785.dumps(body)

    def serialize(self) -> str:
        """The receipt as issued and stored: its compact JWS, or for a receipt of
        the JSON form that JSON document (``to_json``)."""
        return self._jws if self._jws is not None else self.to_json()

    def canonical(self) -> bytes:
        """What the JSON form's signature covers (sorted keys, no whitespace)."""
        # Fields added later are left out while unset, so older receipts verify.
        unset = {
            name
            for name in ("found_data", "shared_keys", "live_residue_until", "metrics", "identity")
            if getattr(self, name) is None
        }
        body = self.model_dump(mode="json", exclude={"signature", *unset})
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")

    def to_json(self) -> str:
        # ``metrics`` (added with eviction everywhere) is left out while unset, so a
        # receipt issued before it serializes as it was stored.
        exclude = {n for n in ("metrics", "identity") if getattr(self, n) is None}
        return self.model_dump_json(indent=2, exclude=exclude)


def sign_receipt(receipt: Receipt, signer: Signer) -> Receipt:
    """The receipt issued as a JWS signed by ``signer`` (the keyring's receipt key:
    ``keyring.receipt_signer()``; its private half never leaves the keyring)."""
    unsigned = receipt.model_copy(update={"signature": None})
    token = sign_compact(
        unsigned.payload(), JWS_TYPE, jwk_thumbprint(signer.public_key), signer.sign
    )
    return _with_jws(unsigned, token)


def verify_receipt(
    receipt: Receipt,
    trusted: bytes | Mapping[str, Any] | None = None,
    *,
    public_key: bytes | None = None,
) -> None:
    """Raise unless the receipt is intact and signed by a key the verifier trusts:
    ``trusted`` is the issuing store's JWKS (``ks.receipts_jwks()``, or the document
    it publishes, pinned earlier) or one raw 32-byte Ed25519 public key
    (``ks.keyring.receipt_signer().public_key``).

    A key named inside the receipt is never trusted by itself: anyone can edit a
    receipt and re-sign it with a fresh key of their own. Raises ``UntrustedSigner``
    when the signing key is not trusted, ``IntegrityError`` when the receipt is
    unsigned, altered or malformed, ``InvalidInput`` when ``trusted`` is not keys.
    ``public_key=`` is the keyword of releases before JWS receipts (one raw key)."""
    given = trusted if trusted is not None else public_key
    if given is None or (trusted is not None and public_key is not None):
        raise TypeError("verify_receipt needs the trusted keys: a JWKS or one public key")
    keys = trusted_keys(given)
    if receipt.jws is not None:
        jws = verify_compact(receipt.jws, JWS_TYPE, keys)
        signed = _from_payload(jws.payload)
        # A copy of a loaded receipt with edited fields keeps the original token.
        if receipt.signature is not None or _fields(signed) != _fields(receipt):
            raise IntegrityError("the receipt differs from what was signed")
        return
    if receipt.signature is None:
        raise IntegrityError("the receipt is not signed")
    try:
        key = base64.b64decode(receipt.signature.public_key, validate=True)
        value = base64.b64decode(receipt.signature.value, validate=True)
    except ValueError:
        raise IntegrityError("the receipt's signature is malformed") from None
    if all(key != k.public_key for k in keys):
        raise UntrustedSigner("the receipt was signed by another key than the trusted one(s)")
    verify_signature(key, value, receipt.canonical())


def verify_receipt_text(text: str, trusted: bytes | Mapping[str, Any]) -> Receipt:
    """``load_receipt`` then ``verify_receipt``: the receipt, once it verified."""
    receipt = load_receipt(text)
    verify_receipt(receipt, trusted)
    return receipt


def load_receipt(text: str) -> Receipt:
    """A receipt in either form: a compact JWS (issued today), or the JSON document
    of receipts issued before. Nothing is verified here (``verify_receipt``), but a
    JWS of any other shape than keyshred issues (``alg`` other than EdDSA, ``none``
    included; another ``typ``; extra header members) is refused at once."""
    stripped = text.strip()
    if not stripped.startswith("{"):
        jws = parse_compact(stripped, JWS_TYPE)
        return _with_jws(_from_payload(jws.payload), stripped)
    try:
        return Receipt.model_validate_json(stripped)
    except ValidationError:
        raise IntegrityError("not a keyshred receipt (or it was altered)") from None


def _from_payload(payload: bytes) -> Receipt:
    try:
        receipt = Receipt.model_validate_json(payload)
    except ValidationError:
        raise IntegrityError("not a keyshred receipt (or it was altered)") from None
    if receipt.signature is not None:
        raise IntegrityError("not a keyshred receipt (or it was altered)")
    return receipt


def _with_jws(receipt: Receipt, token: str) -> Receipt:
    receipt._jws = token
    return receipt


def _fields(receipt: Receipt) -> dict[str, Any]:
    return receipt.model_dump(mode="json", exclude={"signature"})


def _b64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise IntegrityError("the receipt's signature is malformed") from None
