"""The backup manifest: what one generation holds, signed.

Layout on a target::

    objects/subject=<subject_ref>/<sha256>   partition files (already ciphertext),
                                             content-addressed: a file unchanged since
                                             an earlier generation is not copied again
    generations/<gen>/catalog.db             the catalog at the snapshot instant
    generations/<gen>/keystore.sealed        the key store, every key re-wrapped under
                                             the generation's own archive KEK epoch
    generations/<gen>/manifest.json          written last: a generation without it
                                             does not exist (an interrupted backup)
    tombstones/<tombstone_id>.json           erasures since, signed; replayed on restore

Segment objects live under their subject's prefix so that erasing a subject from
the backups is one prefix delete (every object version included).
"""

from __future__ import annotations

import base64
import json
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from keyshred.errors import IntegrityError
from keyshred.keyring.keyring import Signer, verify_signature
from keyshred.keyring.keystore import Tombstone

__all__ = [
    "BlobRef",
    "Manifest",
    "SealedRef",
    "Segment",
    "TombstoneRecord",
    "gen_prefix",
    "object_key",
]

GENERATIONS = "generations"
OBJECTS = "objects"
TOMBSTONES = "tombstones"


def gen_prefix(generation: str) -> str:
    return f"{GENERATIONS}/{generation}"


def object_key(subject_ref: str, sha256: str) -> str:
    return f"{OBJECTS}/subject={subject_ref}/{sha256}"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Segment(_Model):
    """One partition file: where it goes in a data folder, whose it is, its hash."""

    path: str  # relative to the data folder, e.g. memories/subject=<ref>/seg-….parquet
    subject_ref: str
    size: int
    sha256: str

    @property
    def object(self) -> str:
        return object_key(self.subject_ref, self.sha256)


class BlobRef(_Model):
    object: str
    size: int
    sha256: str


class SealedRef(BlobRef):
    wrapped: str  # base64 of the one-off key, wrapped by the KEK epoch below
    kek_epoch: int


class _Signature(_Model):
    algorithm: Literal["Ed25519"] = "Ed25519"
    public_key: str
    value: str


class _Signed(_Model):
    signature: _Signature | None = None

    def canonical(self) -> bytes:
        body = self.model_dump(mode="json", exclude={"signature"})
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")

    def signed(self, signer: Signer) -> Any:
        sig = _Signature(
            public_key=base64.b64encode(signer.public_key).decode("ascii"),
            value=base64.b64encode(signer.sign(self.canonical())).decode("ascii"),
        )
        return self.model_copy(update={"signature": sig})

    def verify(self, public_key: bytes, what: str) -> None:
        if self.signature is None:
            raise IntegrityError(f"{what} is not signed")
        if base64.b64decode(self.signature.public_key) != public_key:
            raise IntegrityError(f"{what} is signed by another key")
        try:
            verify_signature(public_key, base64.b64decode(self.signature.value), self.canonical())
        except IntegrityError:
            raise IntegrityError(f"{what} does not verify (tampered)") from None

    def to_bytes(self) -> bytes:
        return self.model_dump_json(indent=1).encode("utf-8")


class Manifest(_Signed):
    format: Literal["keyshred-backup/1"] = "keyshred-backup/1"
    generation: str
    created_at: datetime
    retention_class: str
    expires_at: datetime
    previous: str | None
    kek_provider: str
    kek_epoch: int  # the epoch that sealed the key store: its destruction ends this generation
    keystore: SealedRef
    catalog: BlobRef
    config: dict[str, Any]  # settings only, never secrets
    subjects: list[str]  # subject_refs with a live key in the sealed key store
    tombstones: list[str]  # tombstone ids already in the sealed key store
    segments: list[Segment]
    vectors_included: bool
    bytes_total: int
    # "archive": the key store copy is re-wrapped under this generation's own archive
    # KEK epoch (``kek_epoch``), independent of the live lineage; "live": sealed under
    # a live KEK epoch (generations made before the archive lineage existed).
    kek_lineage: Literal["live", "archive"] = "live"

    def canonical(self) -> bytes:
        # Left out while "live", so manifests signed before the field existed verify.
        unset = {"kek_lineage"} if self.kek_lineage == "live" else set()
        body = self.model_dump(mode="json", exclude={"signature", *unset})
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def parse(cls, raw: bytes, generation: str) -> Manifest:
        try:
            manifest = cls.model_validate_json(raw)
        except ValidationError:
            raise IntegrityError(f"the manifest of generation {generation} is malformed") from None
        if manifest.generation != generation:
            raise IntegrityError(f"the manifest of generation {generation} names another one")
        return manifest


class TombstoneRecord(_Signed):
    """A tombstone as the backup target keeps it (key ids, never data)."""

    format: Literal["keyshred-tombstone/1"] = "keyshred-tombstone/1"
    tombstone_id: str
    subject_ref: str
    scope: str | None
    key_ids: list[str]
    erased_at: datetime

    @classmethod
    def of(cls, tombstone: Tombstone) -> TombstoneRecord:
        return cls(
            tombstone_id=tombstone.tombstone_id,
            subject_ref=tombstone.subject_ref,
            scope=tombstone.scope,
            key_ids=[k.hex() for k in tombstone.key_ids],
            erased_at=tombstone.erased_at,
        )

    def tombstone(self) -> Tombstone:
        return Tombstone(
            self.tombstone_id,
            self.subject_ref,
            self.scope,
            tuple(bytes.fromhex(k) for k in self.key_ids),
            self.erased_at,
        )
