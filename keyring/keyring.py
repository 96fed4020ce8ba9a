"""``Keyring``: the DEK lifecycle on top of a key store and a KEK provider.

- one random DEK per (tenant, holder subject_ref, scope, owner set), random 16-byte
  key id, created on first use and wrapped by the current KEK epoch. The owners are
  every subject the data under the key is about: the holder alone for its scope key,
  the holder plus mentioned subjects (and the owners of a derived asset's sources) for
  a shared key. The key store indexes each key by every owner;
- unwrap through a bounded, TTL'd cache, with batch unwrap for bulk reads;
- ``rotate_kek`` re-wraps every stored DEK (and system secret) under a new epoch
  without touching any data; ``destroy_kek_epochs_before`` then retires old epochs;
- ``destroy`` crypto-erases a subject (or one scope): wrapped DEKs deleted and a
  tombstone written in one transaction, caches evicted, then verified. A subject's
  erasure destroys every key it owns, including keys other subjects hold, so no copy
  of data about it outlives the erasure under someone else's key;
- system secrets (the subject-ref HMAC key, the receipt signing key, the vault's
  token-id key) are wrapped like DEKs and re-wrapped on rotation.

Opening a ciphertext reads its key id first; a key id with a tombstone raises
``SubjectErased`` before any decryption is attempted.
"""

from __future__ import annotations

import base64
import struct
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import NoReturn

from keyshred.errors import (
    EpochInUse,
    IntegrityError,
    InvalidInput,
    KekEpochDestroyed,
    KekMismatch,
    KeyNotFound,
    KeyshredError,
    SubjectErased,
)
from keyshred.keyring import _primitives as prim
from keyshred.keyring.cache import KeyCache
from keyshred.keyring.datakey import DataKey
from keyshred.keyring.envelope import KEY_ID_BYTES, Place, PlaceTemplate, key_id_of
from keyshred.keyring.kek import Context, DestroyedEpoch, KekProvider, WrappedKey
from keyshred.keyring.keystore import KeyRecord, KeyStore, SecretRecord, Tombstone, owner_tag
from keyshred.keyring.tokenid import TokenIds

__all__ = ["DestroyResult", "Keyring", "RotationResult", "Signer", "verify_signature"]

_REF_KEY = "subject-ref-key"
_SIGNING_KEY = "receipt-signing-key"
_TOKEN_ID_KEY = "token-id-key"  # noqa: S105 - a secret's name, not a secret
_REF_DOMAIN = b"keyshred/subject-ref\x00"
_REF_CHARS = 26  # base32 characters: 130 bits of the HMAC
_LEN = struct.Struct(">I")
_ROTATE_PAGE = 1000
_REF_CACHE = 10_000


def _dek_context(
    record_key_id: bytes, tenant: str, subject_ref: str, scope: str, tag: str = ""
) -> Context:
    context = {
        "keyshred:kind": "dek",
        "keyshred:key_id": record_key_id.hex(),
        "keyshred:tenant": tenant,
        "keyshred:subject_ref": subject_ref,
        "keyshred:scope": scope,
    }
    if tag:
        # Bound, so a shared key's record cannot pass for a scope key (or another
        # owner set's) in an altered key store. Scope keys keep their old context.
        context["keyshred:owners"] = tag
    return context


def _record_context(r: KeyRecord) -> Context:
    return _dek_context(r.key_id, r.tenant, r.subject_ref, r.scope, r.owner_tag)


def _secret_context(name: str) -> Context:
    return {"keyshred:kind": "system-secret", "keyshred:name": name}


def _blob_context(label: str) -> Context:
    return {"keyshred:kind": "blob", "keyshred:label": label}


def _blob_aad(label: str) -> bytes:
    return b"keyshred/blob\x00" + label.encode("utf-8")


def _others(holder: str, owners: Iterable[str]) -> tuple[str, ...]:
    """The owners besides the holder, sorted and checked (subject_refs)."""
    if isinstance(owners, str):
        raise InvalidInput("owners is a collection of subject_refs")
    others = set()
    for owner in owners:
        _check_name("an owner", owner)
        if owner != holder:
            others.add(owner)
    return tuple(sorted(others))


def _check_name(kind: str, value: str) -> None:
    if not isinstance(value, str) or not value or len(value) > 256:
        raise InvalidInput(f"{kind} must be a non-empty string of at most 256 characters")


@dataclass(frozen=True, slots=True)
class DestroyResult:
    """What ``destroy`` did; all fields are safe to log and to put in a receipt."""

    tombstone: Tombstone
    keys_destroyed: int
    cache_entries_evicted: int
    verified: bool
    # (key id, holder subject_ref) of keys other subjects hold that the erased subject
    # co-owned: their data about it is unreadable in every copy from now on.
    shared_keys: tuple[tuple[bytes, str], ...] = ()


@dataclass(frozen=True, slots=True)
class RotationResult:
    new_epoch: int
    keys_rewrapped: int
    secrets_rewrapped: int


class Signer:
    """Ed25519 signatures by the keyring's receipt key; the private half stays here."""

    __slots__ = ("_key", "public_key")

    def __init__(self, raw_private: bytes) -> None:
        self._key = prim.ed25519_private_from_bytes(raw_private)
        self.public_key = prim.ed25519_public_bytes(self._key.public_key())

    def sign(self, message: bytes) -> bytes:
        return prim.ed25519_sign(self._key, message)

    def __repr__(self) -> str:
        return f"Signer(public_key={base64.b64encode(self.public_key).decode()!r})"

    def __reduce__(self) -> NoReturn:
        raise TypeError("a Signer cannot be pickled")


def verify_signature(public_key: bytes, signature: bytes, message: bytes) -> None:
    """Raise ``IntegrityError`` unless ``signature`` is valid for ``message``."""
    try:
        prim.ed25519_verify(prim.ed25519_public_from_bytes(public_key), signature, message)
    except (prim.InvalidSignature, ValueError):
        raise IntegrityError("signature does not verify") from None


class Keyring:
    """Per-subject DEKs wrapped by a KEK provider and kept in a key store."""

    def __init__(
        self,
        store: KeyStore,
        kek: KekProvider,
        *,
        tenant: str = "default",
        cache_max_entries: int = 10_000,
        cache_ttl_seconds: float = 300.0,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        _check_name("tenant", tenant)
        self.store = store
        self.kek = kek
        self.tenant = tenant
        self.cache = KeyCache(cache_max_entries, cache_ttl_seconds)
        self._clock = clock
        self._create_lock = threading.Lock()
        self._ref_key = self._system_secret(_REF_KEY, lambda: prim.random_bytes(32))
        self._signer: Signer | None = None
        self._token_ids: TokenIds | None = None
        self._refs: dict[tuple[str, str], str] = {}
        # Who still needs KEK epochs before N (descriptions, safe to print); the
        # facade points it at the retained backup generations.
        self.epoch_users: Callable[[int], list[str]] | None = None

    # -- system secrets ------------------------------------------------------------

    def _system_secret(self, name: str, make: Callable[[], bytes]) -> bytes:
        record = self.store.get_secret(name)
        if record is None:
            wrapped = self.kek.wrap(make(), _secret_context(name))
            record = self.store.put_secret(
                SecretRecord(name, self.kek.name, wrapped.epoch, wrapped.blob)
            )
        try:
            return self.kek.unwrap(
                WrappedKey(record.kek_epoch, record.wrapped), _secret_context(name)
            )
        except IntegrityError:
            # The epoch exists here but its key does not open the secret: the store
            # was made with another KEK (a destroyed epoch raises KekEpochDestroyed).
            raise KekMismatch(
                f"this KEK ({self.kek.name}) cannot unwrap the key store: it was created "
                f"with another KEK (its {name} is wrapped by {record.kek_provider} KEK "
                f"epoch {record.kek_epoch}), or the key store was altered; configure that "
                "KEK (kek.provider and its settings)"
            ) from None

    def signer(self) -> Signer:
        """The receipt signing key (created on first use)."""
        if self._signer is None:
            raw = self._system_secret(
                _SIGNING_KEY, lambda: prim.ed25519_private_bytes(prim.ed25519_generate())
            )
            self._signer = Signer(raw)
        return self._signer

    def token_ids(self) -> TokenIds:
        """The cipher of the vault's token ids (its key created on first use)."""
        if self._token_ids is None:
            self._token_ids = TokenIds(self._system_secret(_TOKEN_ID_KEY, prim.random_key))
        return self._token_ids

    # -- subject refs --------------------------------------------------------------

    def subject_ref(self, subject_id: str, tenant: str | None = None) -> str:
        """``HMAC-SHA256(ref_key, tenant || subject_id)``, base32, 26 characters."""
        tenant = self.tenant if tenant is None else tenant
        try:
            cached = self._refs.get((tenant, subject_id))  # only ever holds checked names
        except TypeError:  # unhashable: refused below
            cached = None
        if cached is not None:
            return cached
        _check_name("tenant", tenant)
        if not isinstance(subject_id, str) or not subject_id:
            raise InvalidInput("a subject id must be a non-empty string")
        try:
            t, s = tenant.encode("utf-8"), subject_id.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: not text any store can keep
            raise InvalidInput("a subject id and a tenant are valid Unicode text") from None
        mac = prim.hmac_sha256(self._ref_key, _REF_DOMAIN + _LEN.pack(len(t)) + t + s)
        # 20 bytes encode to 32 base32 characters, of which the first 26 are kept.
        ref = base64.b32encode(mac[:20]).decode("ascii").lower()[:_REF_CHARS]
        if len(self._refs) >= _REF_CACHE:
            self._refs.clear()
        self._refs[(tenant, subject_id)] = ref
        return ref

    # -- DEKs ----------------------------------------------------------------------

    def _unwrap_record(self, record: KeyRecord) -> DataKey:
        context = _record_context(record)
        try:
            raw = self.kek.unwrap(WrappedKey(record.kek_epoch, record.wrapped), context)
        except KekEpochDestroyed:
            # The DEK survives only under a destroyed epoch: crypto-erased as well.
            raise SubjectErased(
                f"key {record.key_id.hex()} is wrapped by destroyed KEK epoch {record.kek_epoch}"
            ) from None
        key = DataKey(record.key_id, record.subject_ref, record.scope, raw, record.owner_tag)
        self.cache.put(key)
        return key

    def data_key(
        self, subject_ref: str, scope: str, *, create: bool = True, owners: Iterable[str] = ()
    ) -> DataKey:
        """The live DEK of (holder ``subject_ref``, ``scope``, owner set); created on
        first use unless told not to. ``owners`` are the other subjects (refs) the data
        is about: none for the holder's own scope key, else the key shared by that
        owner set, which the erasure of any of them destroys."""
        if owners:
            others = _others(subject_ref, owners)
            tag = owner_tag(others)
        else:
            others, tag = (), ""
        cached = self.cache.get_owner(subject_ref, scope, tag)
        if cached is not None:
            return cached
        record = self.store.find(subject_ref, scope, tag)
        if record is None:
            if not create:
                if self.store.is_tombstoned(subject_ref, scope):
                    raise SubjectErased(f"the keys of subject_ref {subject_ref} were destroyed")
                raise KeyNotFound(f"no key for subject_ref {subject_ref} in scope {scope!r}")
            _check_name("scope", scope)
            record = self._create(subject_ref, scope, others)
        return self._unwrap_record(record)

    def owners_of(self, key_ids: Iterable[bytes]) -> dict[bytes, tuple[str, ...]]:
        """The other owners of each shared key (scope keys are absent)."""
        return self.store.owners_of(list(key_ids))

    def _create(self, subject_ref: str, scope: str, others: tuple[str, ...] = ()) -> KeyRecord:
        tag = owner_tag(others)
        with self._create_lock:
            existing = self.store.find(subject_ref, scope, tag)
            if existing is not None:
                return existing
            key_id = prim.random_bytes(KEY_ID_BYTES)
            raw = prim.random_key()
            wrapped = self.kek.wrap(raw, _dek_context(key_id, self.tenant, subject_ref, scope, tag))
            return self.store.insert(
                KeyRecord(
                    key_id,
                    self.tenant,
                    subject_ref,
                    scope,
                    self.kek.name,
                    wrapped.epoch,
                    wrapped.blob,
                    self._clock(),
                    tag,
                    others,
                )
            )

    def data_key_by_id(self, key_id: bytes) -> DataKey:
        """The DEK with this id; ``SubjectErased`` if it was destroyed."""
        cached = self.cache.get(key_id)
        if cached is not None:
            return cached
        record = self.store.get(key_id)
        if record is None:
            self._raise_missing(key_id)
        return self._unwrap_record(record)

    def data_keys_by_id(self, key_ids: Iterable[bytes]) -> dict[bytes, DataKey]:
        """Batch unwrap: one KEK round trip (per provider batch) for every cache miss."""
        wanted = list(dict.fromkeys(key_ids))
        out: dict[bytes, DataKey] = {}
        missing = []
        for key_id in wanted:
            key = self.cache.get(key_id)
            if key is None:
                missing.append(key_id)
            else:
                out[key_id] = key
        if not missing:
            return out
        records = self.store.get_many(missing)
        for key_id in missing:
            if key_id not in records:
                self._raise_missing(key_id)
        ordered = [records[k] for k in missing]
        items = [(WrappedKey(r.kek_epoch, r.wrapped), _record_context(r)) for r in ordered]
        try:
            raws = self.kek.unwrap_many(items)
        except KekEpochDestroyed:
            raise SubjectErased("a key is wrapped by a destroyed KEK epoch") from None
        for record, raw in zip(ordered, raws, strict=True):
            key = DataKey(record.key_id, record.subject_ref, record.scope, raw, record.owner_tag)
            self.cache.put(key)
            out[record.key_id] = key
        return out

    def _raise_missing(self, key_id: bytes) -> NoReturn:
        tombstone = self.store.tombstone_for(key_id)
        if tombstone is not None:
            raise SubjectErased(
                f"key {key_id.hex()} of subject_ref {tombstone.subject_ref} was destroyed "
                f"at {tombstone.erased_at.isoformat()}"
            )
        raise KeyNotFound(f"no key with id {key_id.hex()}")

    # -- sealing -------------------------------------------------------------------

    def seal(self, plaintext: bytes, place: Place) -> bytes:
        """Encrypt under the live DEK of ``place``'s subject and scope."""
        return self.data_key(place.subject_ref, place.scope).seal(plaintext, place)

    def open(self, ciphertext: bytes | bytearray | memoryview, place: Place) -> bytes:
        """Decrypt. The key id is read first: a destroyed key raises ``SubjectErased``
        without any decryption; anything malformed or moved raises ``IntegrityError``."""
        try:
            key = self.data_key_by_id(key_id_of(ciphertext))
        except KeyNotFound:
            # A key id we never issued: corrupted or forged, not merely missing.
            raise IntegrityError() from None
        return key.open(ciphertext, place)

    def open_at(
        self, ciphertext: bytes | bytearray | memoryview, template: PlaceTemplate, record_id: str
    ) -> bytes:
        """``open`` at ``template.encoded(record_id)``: many reads of one table of one
        subject and scope without building a ``Place`` each time. A ciphertext of
        another subject or scope fails to authenticate (they are in the AAD)."""
        try:
            key = self.data_key_by_id(key_id_of(ciphertext))
        except KeyNotFound:
            raise IntegrityError() from None
        return key.open_encoded(bytes(ciphertext), template.encoded(record_id))

    # -- KEK rotation --------------------------------------------------------------

    def rotate_kek(self) -> RotationResult:
        """Create a new KEK epoch and re-wrap every DEK and system secret under it."""
        epoch = self.kek.rotate()
        keys, secrets = self.rewrap_to_current()
        return RotationResult(epoch, keys, secrets)

    def rewrap_to_current(self) -> tuple[int, int]:
        """Re-wrap whatever is still under an older epoch (resumable after a crash)."""
        epoch = self.kek.current_epoch()
        keys = 0
        while True:
            page = self.store.older_than(epoch, _ROTATE_PAGE)
            if not page:
                break
            items = [(WrappedKey(r.kek_epoch, r.wrapped), _record_context(r)) for r in page]
            rewrapped = self.kek.rewrap_many(items)
            self.store.update_wrapped(
                [(r.key_id, w.epoch, w.blob) for r, w in zip(page, rewrapped, strict=True)]
            )
            keys += len(page)
        secrets = 0
        for record in self.store.secrets():
            if record.kek_epoch < epoch:
                (wrapped,) = self.kek.rewrap_many(
                    [(WrappedKey(record.kek_epoch, record.wrapped), _secret_context(record.name))]
                )
                self.store.put_secret(
                    SecretRecord(record.name, self.kek.name, wrapped.epoch, wrapped.blob),
                    replace=True,
                )
                secrets += 1
        return keys, secrets

    def destroy_kek_epochs_before(self, epoch: int, *, force: bool = False) -> list[DestroyedEpoch]:
        """Destroy KEK epochs older than ``epoch`` after checking nothing live needs
        them. ``EpochInUse`` while ``epoch_users`` (set by the facade: unexpired
        backup generations) still needs one, unless ``force``."""
        if self.store.older_than(epoch, 1) or any(
            s.kek_epoch < epoch for s in self.store.secrets()
        ):
            raise KeyshredError(
                f"keys are still wrapped by epochs before {epoch}; run rotate/rewrap first"
            )
        users = [] if force or self.epoch_users is None else self.epoch_users(epoch)
        if users:
            raise EpochInUse(
                f"KEK epochs before {epoch} still seal unexpired backup generations "
                f"({', '.join(users)}): destroying them makes those backups, and copies "
                "restored from them, unreadable; wait until they expire or force it",
                tuple(users),
            )
        destroyed = self.kek.destroy_epochs_before(epoch)
        self.cache.clear()
        return destroyed

    # -- sealed blobs (the key store's backup copy) --------------------------------

    def seal_blob(self, data: bytes, label: str) -> tuple[WrappedKey, bytes]:
        """Encrypt ``data`` under a fresh one-off key wrapped by the *current* KEK
        epoch, bound to ``label``. Once that epoch is destroyed the blob is noise,
        wherever copies of it went: this is how a backup of the key store expires."""
        _check_name("label", label)
        key = prim.random_key()
        nonce = prim.random_nonce()
        body = prim.new_aead(key).encrypt(nonce, data, _blob_aad(label))
        wrapped = self.kek.wrap(key, _blob_context(label))
        return wrapped, nonce + body

    def open_blob(self, wrapped: WrappedKey, blob: bytes, label: str) -> bytes:
        """Decrypt a sealed blob; ``KekEpochDestroyed`` once its epoch is gone,
        ``IntegrityError`` if the blob, its wrapped key or the label were altered."""
        key = self.kek.unwrap(wrapped, _blob_context(label))
        if len(blob) < prim.NONCE_BYTES + prim.TAG_BYTES:
            raise IntegrityError("the sealed blob is truncated")
        try:
            return prim.new_aead(key).decrypt(
                blob[: prim.NONCE_BYTES], blob[prim.NONCE_BYTES :], _blob_aad(label)
            )
        except prim.InvalidTag:
            raise IntegrityError("the sealed blob does not authenticate") from None

    # -- crypto-erasure ------------------------------------------------------------

    def destroy(self, subject_ref: str, scope: str | None = None) -> DestroyResult:
        """Crypto-erase a subject (every scope) or one scope; idempotent.

        A whole subject: every key it holds and every key it co-owns with others (a
        memory of someone else that mentions it, a summary built from its data). One
        scope: the keys it holds in that scope, whatever their owners. The wrapped
        DEKs are deleted and the tombstone written in one transaction, every cache
        entry is evicted, and the result is verified: each destroyed key id must now
        raise ``SubjectErased``.
        """
        records = self.store.for_subject(subject_ref, scope)
        shared = self.store.owned_by(subject_ref) if scope is None else []
        held = {r.key_id for r in records}
        shared = [r for r in shared if r.key_id not in held]
        tombstone = Tombstone(
            tombstone_id=uuid.uuid4().hex,
            subject_ref=subject_ref,
            scope=scope,
            key_ids=tuple(sorted(held | {r.key_id for r in shared})),
            erased_at=self._clock(),
        )
        deleted = self.store.destroy(tombstone.key_ids, tombstone) if tombstone.key_ids else 0
        evicted = self.cache.evict(tombstone.key_ids) + self.cache.evict_subject(subject_ref, scope)
        self._verify_destroyed(tombstone.key_ids)
        return DestroyResult(
            tombstone,
            deleted,
            evicted,
            verified=True,
            shared_keys=tuple(sorted((r.key_id, r.subject_ref) for r in shared)),
        )

    def _verify_destroyed(self, key_ids: Sequence[bytes]) -> None:
        for key_id in key_ids:
            try:
                self.data_key_by_id(key_id)
            except SubjectErased:
                continue
            raise KeyshredError(f"key {key_id.hex()} still unwraps after destroy")

    def close(self) -> None:
        self.cache.clear()
        self.kek.close()
        self.store.close()

    def __repr__(self) -> str:
        return f"Keyring(tenant={self.tenant!r}, kek={self.kek!r}, store={self.store!r})"
