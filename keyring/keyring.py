"""``Keyring``: the DEK lifecycle on top of a key store and a KEK provider.

- one random DEK per (tenant, holder subject_ref, scope, owner set), random 16-byte
  key id, created on first use and wrapped by the current *live epoch key* (see
  ``keyshred.keyring.epochs``: a random key per epoch wraps DEKs locally; only the
  epoch key is wrapped by the KEK provider). The owners are
  every subject the data under the key is about: the holder alone for its scope key,
  the holder plus mentioned subjects (and the owners of a derived asset's sources) for
  a shared key. The key store indexes each key by every owner;
- unwrap through a bounded, TTL'd cache, with batch unwrap for bulk reads;
- ``rotate_kek`` makes a new live epoch (one provider rotate and one wrap) and
  re-wraps every stored DEK and system secret under it locally, without touching any
  data; ``destroy_kek_epochs_before`` then deletes the old epoch keys and destroys the
  provider's versions; ``maintain_live`` does both on the live schedule;
- ``archive_copy`` / ``open_archive``: a backup generation's key store re-wrapped
  under its own archive epoch (the archive lineage), independent of live epochs;
- ``destroy`` crypto-erases a subject (or one scope): wrapped DEKs deleted and a
  tombstone written in one transaction, caches evicted, then verified. A subject's
  erasure destroys every key it owns, including keys other subjects hold, so no copy
  of data about it outlives the erasure under someone else's key;
- system secrets (the subject-ref HMAC key, the receipt signing key, the vault's
  token-id key, the identifier and namespace lookup keys) are wrapped like DEKs and
  re-wrapped on rotation.

Opening a ciphertext reads its key id first; a key id with a tombstone raises
``SubjectErased`` before any decryption is attempted.

Why one module of ~900 lines: the DEK lifecycle is one state machine over the key
store, the KEK provider and the cache (create, unwrap, rotate, destroy with owner sets,
archive copies, system secrets). Its invariants (a key leaves the cache under the lock
that destroys it; a destroyed key's tombstone commits with the deletion; rotation never
leaves a key wrapped by a destroyed epoch) span those operations, and are reviewed
together; the pieces that stand alone live beside it (``envelope``, ``epochs``,
``cache``, ``keystore``, ``datakey``).
"""

from __future__ import annotations

import base64
import contextlib
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import ClassVar, NoReturn, TypeVar

from keyshred.errors import (
    ConfigError,
    EpochInUse,
    IntegrityError,
    InvalidInput,
    KekEpochDestroyed,
    KekMismatch,
    KekUnavailable,
    KeyNotFound,
    KeyshredError,
    SubjectErased,
)
from keyshred.keyring import _primitives as prim
from keyshred.keyring.cache import KeyCache
from keyshred.keyring.datakey import DataKey
from keyshred.keyring.envelope import KEY_ID_BYTES, Place, PlaceTemplate, key_id_of
from keyshred.keyring.epochs import ARCHIVE, LIVE, Lineage, epoch_key_context, lineage_of, marker
from keyshred.keyring.kek import Context, DestroyedEpoch, KekProvider, WrappedKey, encode_context
from keyshred.keyring.keystore import (
    EpochKeyRecord,
    KeyRecord,
    KeyStore,
    SecretRecord,
    SQLiteKeyStore,
    Tombstone,
    owner_subject,
    owner_tag,
)
from keyshred.keyring.tokenid import TokenIds

__all__ = [
    "ArchiveCopy",
    "DestroyResult",
    "Keyring",
    "LiveMaintenance",
    "RotationResult",
    "Signer",
    "verify_signature",
]

_OWNER_SETS_KEPT = 20_000  # owner sets ``shared_owners`` keeps (then it starts over)

_REF_KEY = "subject-ref-key"
_SIGNING_KEY = "receipt-signing-key"  # its version 1; version n > 1 is "...key.v<n>"
_TOKEN_ID_KEY = "token-id-key"  # noqa: S105 - a secret's name, not a secret
_NAMESPACE_KEY = "namespace-lookup-key"
_IDENTIFIER_KEY = "identifier-key"  # its version 1; version n > 1 is "identifier-key.v<n>"
_REF_DOMAIN = b"keyshred/subject-ref\x00"
_REF_CHARS = 26  # base32 characters: 130 bits of the HMAC
_LEN = struct.Struct(">I")
_ROTATE_PAGE = 1000
_REF_CACHE = 10_000
T = TypeVar("T")


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


def _archive_blob_key(epoch_key: bytes, label: str) -> bytes:
    # A key of its own for the sealed copy, derived from the archive epoch key: the
    # epoch key itself only ever wraps DEKs and secrets.
    return prim.hkdf_sha256(
        epoch_key, salt=b"keyshred/archive-blob", info=label.encode("utf-8"), length=32
    )


def _seal(key: bytes, data: bytes, label: str) -> bytes:
    nonce = prim.random_nonce()
    return nonce + prim.new_aead(key).encrypt(nonce, data, _blob_aad(label))


def _unseal(key: bytes, blob: bytes, label: str) -> bytes:
    if len(blob) < prim.NONCE_BYTES + prim.TAG_BYTES:
        raise IntegrityError("the sealed blob is truncated")
    try:
        return prim.new_aead(key).decrypt(
            blob[: prim.NONCE_BYTES], blob[prim.NONCE_BYTES :], _blob_aad(label)
        )
    except prim.InvalidTag:
        raise IntegrityError("the sealed blob does not authenticate") from None


def _others(holder: str, owners: Iterable[str]) -> tuple[str, ...]:
    """The owners besides the holder, sorted and checked (subject_refs)."""
    if isinstance(owners, str | bytes) or not isinstance(owners, Iterable):
        raise InvalidInput("owners is a collection of subject_refs")
    others = set()
    for owner in owners:
        _check_name("an owner", owner)
        if owner != holder:
            others.add(owner)
    return tuple(sorted(others))


def _identifier_secret(version: int) -> str:
    return _IDENTIFIER_KEY if version == 1 else f"{_IDENTIFIER_KEY}.v{version}"


def _identifier_version(name: str) -> int | None:
    """The identifier key version a secret's name stands for (None: another secret)."""
    return _version_of(_IDENTIFIER_KEY, name)


def _signing_secret(version: int) -> str:
    return _SIGNING_KEY if version == 1 else f"{_SIGNING_KEY}.v{version}"


def _version_of(base: str, name: str) -> int | None:
    """The version of the versioned secret ``base`` a secret's name stands for
    (``base`` is version 1, ``base.v<n>`` version n; None: another secret)."""
    if name == base:
        return 1
    head, _, tail = name.partition(".v")
    if head == base and tail.isdigit():
        return int(tail)
    return None


def _check_name(kind: str, value: str) -> None:
    if not isinstance(value, str) or not value or len(value) > 256:
        raise InvalidInput(f"{kind} must be a non-empty string of at most 256 characters")
    if "\x00" in value:  # PostgreSQL text refuses NUL
        raise InvalidInput(f"{kind} must not contain NUL")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput(f"{kind} must be valid Unicode text") from None


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


@dataclass(frozen=True, slots=True)
class LiveMaintenance:
    """What one run of the live schedule did (``Keyring.maintain_live``)."""

    rotated_to: int | None
    keys_rewrapped: int
    destroyed: list[DestroyedEpoch]
    current_epoch: int
    due_at: datetime


@dataclass(frozen=True, slots=True)
class ArchiveCopy:
    """A key store snapshot re-wrapped under a fresh archive epoch and sealed.
    ``wrapped`` is the archive epoch key wrapped by the archive provider; nothing in
    it depends on a live epoch."""

    epoch: int
    wrapped: WrappedKey
    sealed: bytes
    created_at: datetime
    keys: int

    def __repr__(self) -> str:
        return f"ArchiveCopy(epoch={self.epoch}, sealed=<{len(self.sealed)} bytes>)"


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

    # ``ks.keyring.store`` is guarded as ``ks.keyring`` is (keyshred._handle.Guarded).
    GUARDED_PARTS: ClassVar[tuple[str, ...]] = ("store",)

    def __init__(
        self,
        store: KeyStore,
        kek: KekProvider,
        *,
        tenant: str = "default",
        cache_max_entries: int = 10_000,
        cache_ttl_seconds: float = 300.0,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        archive_kek: KekProvider | Callable[[], KekProvider] | None = None,
    ) -> None:
        _check_name("tenant", tenant)
        self.store = store
        self.kek = kek
        # Two-level lineages: the live epoch key wraps every DEK and secret of this
        # store; archive epoch keys wrap backup generations' copies (and, in a store
        # restored from one, its keys until they are re-wrapped to the live lineage).
        # The archive provider is the same kind as the live one (so its records'
        # marker is known without it) and is reached only when first needed.
        self.live = Lineage(lambda: self.store, kek, LIVE, clock)
        self._archive_source = archive_kek
        self._archive: Lineage | None = None
        self._archive_marker = marker(kek.name, ARCHIVE)
        self.tenant = tenant
        self.cache = KeyCache(cache_max_entries, cache_ttl_seconds)
        self._owners: dict[bytes, tuple[str, ...]] = {}  # ``shared_owners``
        self._owners_lock = threading.Lock()
        self._clock = clock
        self._create_lock = threading.Lock()
        # The subject-ref key is read at once, so a keyring on another KEK's store
        # says so at open (KekMismatch); while the KEK service is down it is read at
        # the first subject_ref instead, so the process opens and serves what needs
        # no key (requests, status, guard checks by subject_ref, crypto-erasure).
        self._ref_key: bytes | None = None
        with contextlib.suppress(KekUnavailable):
            self._ref_key = self._load_ref_key()
        self._signer: Signer | None = None
        self._receipt_signer: Signer | None = None
        self._token_ids: TokenIds | None = None
        self._namespace_key: bytes | None = None
        self._identifier_keys: dict[int, bytes] = {}
        # Set by the mention finder (keyshred.storage.mentions): re-hashes every
        # registered identifier under a new identifier key version (version, key).
        # While it is unset the identifier key is re-wrapped like any secret.
        self.identifier_rehash: Callable[[int, bytes], object] | None = None
        # (tenant, subject id) -> (subject_ref, expiry): the one place a raw subject
        # id stays in memory, so it leaves like a key does: on the subject's eviction
        # and after the cache TTL (the janitor's ``purge_expired``).
        self._refs: dict[tuple[str, str], tuple[str, float]] = {}
        self._ref_names: dict[str, tuple[str, str]] = {}  # subject_ref -> its entry
        self._refs_lock = threading.Lock()
        self._ref_ttl = cache_ttl_seconds
        # Who still needs KEK epochs before N (descriptions, safe to print); the
        # facade points it at the retained backup generations.
        self.epoch_users: Callable[[int], list[str]] | None = None

    # -- system secrets ------------------------------------------------------------

    @property
    def archive(self) -> Lineage | None:
        """The archive lineage (None without an archive provider)."""
        if self._archive is None and self._archive_source is not None:
            source = self._archive_source
            provider = source if isinstance(source, KekProvider) else source()
            self._archive = Lineage(lambda: self.store, provider, ARCHIVE, self._clock)
        return self._archive

    @property
    def archive_kek(self) -> KekProvider | None:
        lineage = self.archive
        return None if lineage is None else lineage.provider

    def _system_secret(self, name: str, make: Callable[[], bytes]) -> bytes:
        record = self.store.get_secret(name)
        if record is None:
            raw = make()
            record = self._under_live(
                lambda epoch, blob: self.store.put_secret(
                    SecretRecord(name, self.live.marker, epoch, blob)
                ),
                raw,
                _secret_context(name),
            )
        try:
            return self._unwrap_one(
                record.kek_provider, record.kek_epoch, record.wrapped, _secret_context(name)
            )
        except IntegrityError:
            # The epoch exists here but its key does not open the secret: the store
            # was made with another KEK (a destroyed epoch raises KekEpochDestroyed).
            provider = record.kek_provider.partition("@")[0]
            raise KekMismatch(
                f"this KEK ({self.kek.name}) cannot unwrap the key store: it was created "
                f"with another KEK (its {name} is wrapped by {provider} KEK "
                f"epoch {record.kek_epoch}), or the key store was altered; configure that "
                "KEK (kek.provider and its settings)"
            ) from None

    def _load_ref_key(self) -> bytes:
        return self._system_secret(_REF_KEY, lambda: prim.random_bytes(32))

    def signer(self) -> Signer:
        """The store's signing key, version 1 of the signing secret (created on
        first use): backups' manifests and tombstone records are signed and checked
        with it, and receipts were until ``rotate_receipt_signer``. It does not
        rotate: a retained generation's manifest must keep verifying."""
        if self._signer is None:
            self._signer = self._signing_key(1)
        return self._signer

    def receipt_signer(self) -> Signer:
        """The key receipts are signed with: the newest signing key version (version
        1, ``signer()``, until the first rotation). A process that opened the store
        before another one rotated keeps signing with the version it loaded, which
        stays published (``signing_public_keys``)."""
        if self._receipt_signer is None:
            newest = max(self._signing_versions(), default=1)
            self._receipt_signer = self.signer() if newest == 1 else self._signing_key(newest)
        return self._receipt_signer

    def rotate_receipt_signer(self) -> Signer:
        """Make a new signing key version and sign receipts with it from now on.
        Older versions stay in the key store, wrapped like every secret and never
        used for receipts again: receipts are kept for good, and every key that
        signed one is published (``signing_public_keys``) so it keeps verifying."""
        self.signer()  # version 1 exists first: it signs backups whatever happens here
        newest = max(self._signing_versions(), default=1)
        self._receipt_signer = self._signing_key(newest + 1)
        return self._receipt_signer

    def signing_public_keys(self) -> list[bytes]:
        """The public key of every signing key version, oldest first: every key that
        signed a receipt (version 1 created if there was none)."""
        self.signer()
        return [self._signing_key(v).public_key for v in sorted(self._signing_versions())]

    def _signing_versions(self) -> list[int]:
        names = (_version_of(_SIGNING_KEY, r.name) for r in self.store.secrets())
        return [v for v in names if v is not None]

    def _signing_key(self, version: int) -> Signer:
        return Signer(
            self._system_secret(
                _signing_secret(version),
                lambda: prim.ed25519_private_bytes(prim.ed25519_generate()),
            )
        )

    def token_ids(self) -> TokenIds:
        """The cipher of the vault's token ids (its key created on first use)."""
        if self._token_ids is None:
            self._token_ids = TokenIds(self._system_secret(_TOKEN_ID_KEY, prim.random_key))
        return self._token_ids

    def namespace_key(self) -> bytes:
        """The key of the catalog's namespace lookup hashes (``keyshred.storage.
        namespaces``: which subjects hold namespaces under a prefix), created on
        first use; a system secret like the subject-ref key."""
        if self._namespace_key is None:
            self._namespace_key = self._system_secret(_NAMESPACE_KEY, prim.random_key)
        return self._namespace_key

    def identifier_key(self, version: int = 1) -> bytes:
        """Version ``version`` of the key of the catalog's identifier lookup hashes
        (registered e-mails, phones, resident ids, names; ``keyshred.storage.mentions``;
        the catalog says which version its hashes are under). Version 1 is created
        on first use when no version exists; a later one only by ``rotate_kek``,
        which destroys the older ones (``KeyNotFound`` for a version destroyed)."""
        key = self._identifier_keys.get(version)
        if key is None:

            def make() -> bytes:
                # Never re-create a version a rotation destroyed.
                if version != 1 or any(
                    _identifier_version(r.name) is not None for r in self.store.secrets()
                ):
                    raise KeyNotFound(f"identifier key version {version} does not exist")
                return prim.random_key()

            key = self._identifier_keys[version] = self._system_secret(
                _identifier_secret(version), make
            )
        return key

    def _rotate_identifier_key(self, epoch: int) -> int:
        """Replace the identifier key by a new version wrapped under live ``epoch``
        instead of re-wrapping it: the catalog re-hashes every registered identifier
        from its sealed normal form (``identifier_rehash``), then the older versions'
        secret rows are deleted. Their rows only ever existed wrapped under older
        epochs, so once those are destroyed the old hashes (in dead tuples, WAL,
        replicas) can no longer be recomputed. Resumable: a version already under
        ``epoch`` (a run the re-hash failed in) is reused. Returns the new version,
        or 0 when nothing was to rotate (no identifier key, or no re-hash hook)."""
        rehash = self.identifier_rehash
        versions = {
            v: r for r in self.store.secrets() if (v := _identifier_version(r.name)) is not None
        }
        if rehash is None or not versions:
            return 0
        newest = max(versions)
        record = versions[newest]
        current = record.kek_provider == self.live.marker and record.kek_epoch >= epoch
        if current and len(versions) == 1:
            return 0
        target = newest if current else newest + 1
        raw = self._system_secret(_identifier_secret(target), prim.random_key)
        rehash(target, raw)
        for v in versions:
            if v != target:
                self.store.delete_secret(_identifier_secret(v))
                self._identifier_keys.pop(v, None)
        self._identifier_keys[target] = raw
        return target

    # -- subject refs --------------------------------------------------------------

    def subject_ref(self, subject_id: str, tenant: str | None = None) -> str:
        """``HMAC-SHA256(ref_key, tenant || subject_id)``, base32, 26 characters."""
        tenant = self.tenant if tenant is None else tenant
        try:
            cached = self._refs.get((tenant, subject_id))  # only ever holds checked names
        except TypeError:  # unhashable: refused below
            cached = None
        if cached is not None and cached[1] > time.monotonic():
            return cached[0]
        _check_name("tenant", tenant)
        if not isinstance(subject_id, str) or not subject_id:
            raise InvalidInput("a subject id must be a non-empty string")
        try:
            t, s = tenant.encode("utf-8"), subject_id.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: not text any store can keep
            raise InvalidInput("a subject id and a tenant are valid Unicode text") from None
        ref_key = self._ref_key
        if ref_key is None:
            ref_key = self._ref_key = self._load_ref_key()
        mac = prim.hmac_sha256(ref_key, _REF_DOMAIN + _LEN.pack(len(t)) + t + s)
        # 20 bytes encode to 32 base32 characters, of which the first 26 are kept.
        ref = base64.b32encode(mac[:20]).decode("ascii").lower()[:_REF_CHARS]
        if self._ref_ttl > 0:
            with self._refs_lock:
                if len(self._refs) >= _REF_CACHE:
                    self._refs.clear()
                    self._ref_names.clear()
                self._refs[(tenant, subject_id)] = (ref, time.monotonic() + self._ref_ttl)
                self._ref_names[ref] = (tenant, subject_id)
        return ref

    def _forget_ref(self, subject_ref: str) -> None:
        with self._refs_lock:
            name = self._ref_names.pop(subject_ref, None)
            if name is not None:
                self._refs.pop(name, None)

    def _purge_refs(self) -> int:
        now = time.monotonic()
        with self._refs_lock:
            doomed = [(name, ref) for name, (ref, expires) in self._refs.items() if expires <= now]
            for name, ref in doomed:
                del self._refs[name]
                self._ref_names.pop(ref, None)
        return len(doomed)

    # -- DEKs ----------------------------------------------------------------------

    # -- wrapping under the lineages ----------------------------------------------------

    def _lineage(self, kek_provider: str) -> Lineage | None:
        """The lineage that wrapped a record (None: the provider itself, a record
        from before the lineages existed)."""
        name = lineage_of(kek_provider)
        if name is None:
            return None
        if kek_provider == self.live.marker:
            return self.live
        if kek_provider == self._archive_marker and self.archive is not None:
            return self.archive
        raise KekMismatch(
            f"this keyring has no {name} KEK {kek_provider.partition('@')[0]!r}: the key "
            "store was made with another KEK provider; configure that one"
        )

    def _unwrap_one(self, kek_provider: str, epoch: int, wrapped: bytes, context: Context) -> bytes:
        lineage = self._lineage(kek_provider)
        if lineage is None:
            return self.kek.unwrap(WrappedKey(epoch, wrapped), context)
        return lineage.unwrap(wrapped, context, epoch)

    def _unwrap_records(self, records: Sequence[KeyRecord]) -> list[bytes]:
        """Raw DEKs of records: locally under their epoch keys, and in one provider
        batch for any record still wrapped by the provider directly."""
        out: list[bytes | None] = [None] * len(records)
        direct: list[int] = []
        for i, r in enumerate(records):
            lineage = self._lineage(r.kek_provider)
            if lineage is None:
                direct.append(i)
            else:
                out[i] = lineage.unwrap(r.wrapped, _record_context(r), r.kek_epoch)
        if direct:
            raws = self.kek.unwrap_many(
                [
                    (
                        WrappedKey(records[i].kek_epoch, records[i].wrapped),
                        _record_context(records[i]),
                    )
                    for i in direct
                ]
            )
            for i, raw in zip(direct, raws, strict=True):
                out[i] = raw
        return [raw for raw in out if raw is not None]

    def _under_live(self, write: Callable[[int, bytes], T], raw: bytes, context: Context) -> T:
        """Wrap ``raw`` under the current live epoch key and ``write(epoch, blob)``;
        if another process destroyed that epoch meanwhile (the store's guard says
        so), wrap again under the newer one."""
        for _ in range(3):
            epoch = self.live.current().epoch
            try:
                return write(epoch, self.live.wrap(raw, context, epoch))
            except KekEpochDestroyed:
                self.live.forget([epoch])
        raise KekEpochDestroyed("the live KEK epoch kept being destroyed while a key was written")

    def _unwrap_record(
        self, record: KeyRecord, owners: Iterable[str] | None = None, *, since: int | None = None
    ) -> DataKey:
        context = _record_context(record)
        try:
            raw = self._unwrap_one(record.kek_provider, record.kek_epoch, record.wrapped, context)
        except KekEpochDestroyed:
            # The DEK survives only under a destroyed epoch: crypto-erased as well.
            raise SubjectErased(
                f"key {record.key_id.hex()} is wrapped by destroyed KEK epoch {record.kek_epoch}"
            ) from None
        key = DataKey(record.key_id, record.subject_ref, record.scope, raw, record.owner_tag)
        self.cache.put(key, owners if owners is not None else (record.owners or None), since=since)
        return key

    def data_key(
        self, subject_ref: str, scope: str, *, create: bool = True, owners: Iterable[str] = ()
    ) -> DataKey:
        """The live DEK of (holder ``subject_ref``, ``scope``, owner set); created on
        first use unless told not to. ``owners`` are the other subjects (refs) the data
        is about: none for the holder's own scope key, else the key shared by that
        owner set, which the erasure of any of them destroys."""
        # A name that is no string would raise from the cache (unhashable) as
        # something else than InvalidInput; strings are checked in full on a miss.
        if type(subject_ref) is not str or type(scope) is not str:
            _check_name("a subject_ref", subject_ref)
            _check_name("scope", scope)
        # An empty tuple (the default, every scope key) skips the ABC check: hot path.
        if owners or (type(owners) is not tuple and not isinstance(owners, Iterable)):
            others = _others(subject_ref, owners)
            tag = owner_tag(others)
        else:
            others, tag = (), ""
        cached = self.cache.get_owner(subject_ref, scope, tag)
        if cached is not None:
            return cached
        _check_name("a subject_ref", subject_ref)
        _check_name("scope", scope)
        since = self.cache.evictions  # before the record is read: see KeyCache.put
        record = self.store.find(subject_ref, scope, tag)
        if record is None:
            if not create:
                if self.store.is_tombstoned(subject_ref, scope):
                    raise SubjectErased(f"the keys of subject_ref {subject_ref} were destroyed")
                raise KeyNotFound(f"no key for subject_ref {subject_ref} in scope {scope!r}")
            record = self._create(subject_ref, scope, others)
        return self._unwrap_record(record, others, since=since)

    def owners_of(self, key_ids: Iterable[bytes]) -> dict[bytes, tuple[str, ...]]:
        """The other owners of each shared key (scope keys are absent)."""
        return self.store.owners_of(list(key_ids))

    def shared_owners(self, key_ids: Iterable[bytes]) -> dict[bytes, tuple[str, ...]]:
        """``owners_of`` for keys known to be shared (``DataKey.owner_tag``), cached:
        a key's owner set is fixed when it is made (its tag names it), so the
        readers that ask on every load or read (is any owner being erased?) pay one
        key store query per key, not per read. Bounded like the key cache."""
        wanted = set(key_ids)
        with self._owners_lock:
            out = {k: self._owners[k] for k in wanted if k in self._owners}
        missing = wanted - out.keys()
        if missing:
            found = self.store.owners_of(list(missing))
            with self._owners_lock:
                if len(self._owners) + len(found) > _OWNER_SETS_KEPT:
                    self._owners.clear()
                self._owners.update(found)
            out.update(found)
        return out

    def _create(self, subject_ref: str, scope: str, others: tuple[str, ...] = ()) -> KeyRecord:
        tag = owner_tag(others)
        with self._create_lock:
            existing = self.store.find(subject_ref, scope, tag)
            if existing is not None:
                return existing
            key_id = prim.random_bytes(KEY_ID_BYTES)
            raw = prim.random_key()
            return self._under_live(
                lambda epoch, blob: self.store.insert(
                    KeyRecord(
                        key_id,
                        self.tenant,
                        subject_ref,
                        scope,
                        self.live.marker,
                        epoch,
                        blob,
                        self._clock(),
                        tag,
                        others,
                    )
                ),
                raw,
                _dek_context(key_id, self.tenant, subject_ref, scope, tag),
            )

    def data_key_by_id(self, key_id: bytes) -> DataKey:
        """The DEK with this id; ``SubjectErased`` if it was destroyed."""
        cached = self.cache.get(key_id)
        if cached is not None:
            return cached
        since = self.cache.evictions
        record = self.store.get(key_id)
        if record is None:
            self._raise_missing(key_id)
        return self._unwrap_record(record, since=since)

    def data_keys_by_id(
        self, key_ids: Iterable[bytes], *, cache: bool = True, missing_ok: bool = False
    ) -> dict[bytes, DataKey]:
        """Batch unwrap: one KEK round trip (per provider batch) for every cache miss.
        ``cache=False`` leaves the misses out of the cache (a scan over many subjects
        would push every hot key out of it); ``missing_ok`` leaves keys that do not
        exist (destroyed, or never issued) out of the answer instead of raising."""
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
        since = self.cache.evictions
        records = self.store.get_many(missing)
        for key_id in missing:
            if key_id not in records and not missing_ok:
                self._raise_missing(key_id)
        ordered = [records[k] for k in missing if k in records]
        try:
            raws = self._unwrap_records(ordered)
        except KekEpochDestroyed:
            raise SubjectErased("a key is wrapped by a destroyed KEK epoch") from None
        for record, raw in zip(ordered, raws, strict=True):
            key = DataKey(record.key_id, record.subject_ref, record.scope, raw, record.owner_tag)
            if cache:
                self.cache.put(key, since=since)
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

    # -- KEK rotation (the live lineage) ----------------------------------------------

    def rotate_kek(self) -> RotationResult:
        """A new live epoch: the provider rotates and wraps a fresh epoch key (two
        provider calls), then every DEK and secret is re-wrapped under it locally."""
        record, _ = self.live.new_epoch(rotate=True)
        keys, secrets = self.rewrap_to_current()
        return RotationResult(record.epoch, keys, secrets)

    def rewrap_to_current(self) -> tuple[int, int]:
        """Re-wrap under the current live epoch key whatever is not under it yet: keys
        of older epochs (a rotation a crash interrupted, a key another process made
        under the epoch it still saw), keys the provider wrapped directly (a store
        from before the lineages: migrated here, at its first rotation) and keys of an
        archive epoch (a store restored from a backup). Resumable: each page commits."""
        for _ in range(3):
            epoch = self.live.current(refresh=True).epoch
            try:
                return self._rewrap_to(epoch)
            except KekEpochDestroyed:
                self.live.forget([epoch])  # destroyed by a newer rotation elsewhere
        raise KekEpochDestroyed("the live KEK epoch kept changing while keys were re-wrapped")

    def _rewrap_to(self, epoch: int) -> tuple[int, int]:
        keys = 0

        live = self.live

        def move(page: list[KeyRecord]) -> None:
            updates = []
            direct = []
            for r in page:
                lineage = self._lineage(r.kek_provider)
                if lineage is None:
                    direct.append(r)
                    continue
                # The context is encoded once for both the old and the new wrap.
                encoded = encode_context(_record_context(r))
                raw = lineage.unwrap_encoded(r.wrapped, encoded, r.kek_epoch)
                updates.append((r.key_id, epoch, live.wrap_encoded(raw, encoded, epoch)))
            if direct:  # wrapped by the provider itself: a store from before the lineages
                raws = self._unwrap_records(direct)
                updates += [
                    (r.key_id, epoch, live.wrap(raw, _record_context(r), epoch))
                    for r, raw in zip(direct, raws, strict=True)
                ]
            self.store.update_wrapped(updates, kek_provider=live.marker, live_epoch=epoch)

        while page := self.store.older_than(epoch, _ROTATE_PAGE):
            move(page)
            keys += len(page)
        while page := self.store.wrapped_by(self._archive_marker, _ROTATE_PAGE):
            move(page)
            keys += len(page)
        self._rotate_identifier_key(epoch)
        secrets = 0
        for record in self.store.secrets():
            if record.kek_provider == self.live.marker and record.kek_epoch >= epoch:
                continue
            context = _secret_context(record.name)
            raw = self._unwrap_one(record.kek_provider, record.kek_epoch, record.wrapped, context)
            self.store.put_secret(
                SecretRecord(
                    record.name, self.live.marker, epoch, self.live.wrap(raw, context, epoch)
                ),
                replace=True,
            )
            secrets += 1
        return keys, secrets

    def destroy_kek_epochs_before(self, epoch: int, *, force: bool = False) -> list[DestroyedEpoch]:
        """Destroy the live epochs older than ``epoch``: their epoch-key rows and the
        provider's key versions. Refused while a key or secret is still wrapped by
        one (checked in the transaction that deletes the rows, so a key another
        process writes under an old epoch meanwhile is caught), and ``EpochInUse``
        while ``epoch_users`` (set by the facade: unexpired backup generations made
        before the archive lineage) still needs one, unless ``force``."""
        users = [] if force or self.epoch_users is None else self.epoch_users(epoch)
        if users:
            raise EpochInUse(
                f"KEK epochs before {epoch} still seal unexpired backup generations "
                f"({', '.join(users)}): destroying them makes those backups, and copies "
                "restored from them, unreadable; wait until they expire or force it",
                tuple(users),
            )
        doomed = self.store.destroy_epoch_keys(LIVE, epoch, [self.live.marker, self.kek.name])
        destroyed = self.kek.destroy_epochs_before(epoch)
        self.live.forget(doomed)
        self.cache.clear()
        return destroyed

    def live_epoch(self) -> EpochKeyRecord:
        """The current live epoch key's record (creation time for the schedule)."""
        return self.live.current(refresh=True)

    def maintain_live(
        self,
        period: timedelta,
        *,
        now: datetime | None = None,
        keep_from: int | None = None,
        lead: timedelta = timedelta(0),
    ) -> LiveMaintenance:
        """The live schedule: rotate when the current epoch is ``period - lead`` old
        (``lead``: the interval the job runs at, so the run that rotates comes before
        the epoch's end, not up to one interval after it), then
        destroy every older live epoch once nothing is wrapped by it (re-wrapping
        first what a crash or another process left behind). ``keep_from``: an epoch
        that must survive (a backup generation sealed before the archive lineage
        existed still needs it); nothing from it on is destroyed."""
        now = now or self._clock()
        current = self.live_epoch()
        rotated: int | None = None
        if now >= current.created_at + period - lead:
            result = self.rotate_kek()
            rotated, keys = result.new_epoch, result.keys_rewrapped
        else:
            keys, _ = self.rewrap_to_current()
        current = self.live_epoch()
        before = current.epoch if keep_from is None else min(current.epoch, keep_from)
        destroyed: list[DestroyedEpoch] = []
        stale = [r.epoch for r in self.live.records() if r.epoch < before]
        oldest = min((e.epoch for e in self.kek.epochs()), default=before)
        if stale or oldest < before:
            for attempt in range(3):
                try:
                    destroyed = self.destroy_kek_epochs_before(before, force=True)
                    break
                except EpochInUse:  # pragma: no cover - force skips the users check
                    raise
                except KeyshredError:
                    if attempt == 2:
                        raise
                    keys += self.rewrap_to_current()[0]  # written under an old epoch meanwhile
        return LiveMaintenance(rotated, keys, destroyed, current.epoch, current.created_at + period)

    # -- the archive lineage (backup generations) --------------------------------------

    def archive_copy(self, snapshot: bytes, label: str) -> ArchiveCopy:
        """A backup generation's key store: a new archive epoch (the archive provider
        rotates and wraps a fresh epoch key: two provider calls), every key and
        secret of ``snapshot`` re-wrapped from its live epoch to that archive epoch
        key, the live epoch keys removed and the image vacuumed, then sealed under a
        key derived from the archive epoch key. Destroying that archive epoch (the
        provider's version) is what ends the generation."""
        _check_name("label", label)
        if self.archive is None:
            raise ConfigError("no archive KEK provider is configured")
        archive = self.archive
        record, raw = archive.new_epoch(rotate=True, persist=False)
        counted = [0]

        def keys(records: list[KeyRecord]) -> list[tuple[str, int, bytes]]:
            raws = self._unwrap_records(records)
            counted[0] += len(records)
            return [
                (archive.marker, record.epoch, archive.wrap(k, _record_context(r), record.epoch))
                for r, k in zip(records, raws, strict=True)
            ]

        def secrets(records: list[SecretRecord]) -> list[tuple[str, int, bytes]]:
            out = []
            for s in records:
                context = _secret_context(s.name)
                k = self._unwrap_one(s.kek_provider, s.kek_epoch, s.wrapped, context)
                out.append((archive.marker, record.epoch, archive.wrap(k, context, record.epoch)))
            return out

        try:
            image = SQLiteKeyStore.rewrap_image(snapshot, keys, secrets, record)
            sealed = _seal(_archive_blob_key(raw, label), image, label)
        finally:
            archive.forget([record.epoch])  # this process keeps no archive key
        return ArchiveCopy(
            record.epoch,
            WrappedKey(record.provider_epoch, record.wrapped),
            sealed,
            record.created_at,
            counted[0],
        )

    def open_archive(self, epoch: int, wrapped: WrappedKey, sealed: bytes, label: str) -> bytes:
        """The key store image of an archive copy (one provider call);
        ``KekEpochDestroyed`` once its archive epoch is destroyed."""
        provider = self.archive_kek
        if provider is None:
            raise ConfigError("no archive KEK provider is configured")
        raw = provider.unwrap(wrapped, epoch_key_context(ARCHIVE, epoch))
        return _unseal(_archive_blob_key(raw, label), sealed, label)

    def drop_archive_epochs(self) -> list[int]:
        """In a store restored from an archive copy, once its keys are re-wrapped to
        the live lineage: delete the archive epoch-key rows (the provider's version
        is the backup schedule's to destroy)."""
        dropped = self.store.destroy_epoch_keys(ARCHIVE, 2**31 - 1, [self._archive_marker])
        if self._archive is not None:
            self._archive.forget(dropped)
        return dropped

    # -- sealed blobs (backup generations made before the archive lineage) -------------

    def seal_blob(self, data: bytes, label: str) -> tuple[WrappedKey, bytes]:
        """Encrypt ``data`` under a fresh one-off key wrapped by the *current* live
        provider epoch, bound to ``label`` (the key store copy of backups made before
        the archive lineage; kept for the drill and tools)."""
        _check_name("label", label)
        key = prim.random_key()
        wrapped = self.kek.wrap(key, _blob_context(label))
        return wrapped, _seal(key, data, label)

    def open_blob(self, wrapped: WrappedKey, blob: bytes, label: str) -> bytes:
        """Decrypt a sealed blob; ``KekEpochDestroyed`` once its epoch is gone,
        ``IntegrityError`` if the blob, its wrapped key or the label were altered."""
        key = self.kek.unwrap(wrapped, _blob_context(label))
        return _unseal(key, blob, label)

    # -- crypto-erasure ------------------------------------------------------------

    def destroy(
        self,
        subject_ref: str,
        scope: str | None = None,
        *,
        also: Sequence[str] = (),
        tombstone_id: str | None = None,
    ) -> DestroyResult:
        """Crypto-erase a subject (every scope) or one scope; idempotent. ``also``:
        the subject's keys of other key scopes that hold data of ``scope`` (its
        agent threads' own keys), destroyed with it under one tombstone.
        ``tombstone_id``: the tombstone's id (an erasure request derives it from its
        own id, so that a resumed request finds the tombstone it wrote, and never
        another request's); default a random one.

        A whole subject: every key it holds and every key it co-owns with others (a
        memory of someone else that mentions it, a summary built from its data). One
        scope: the keys it holds in that scope, whatever their owners, and the keys
        others hold over data derived from that scope (owner ``ref@scope``). The wrapped
        DEKs are deleted and the tombstone written in one transaction, every cache
        entry is evicted, and the result is verified: each destroyed key id must now
        raise ``SubjectErased``.
        """
        held, shared = self._doomed(subject_ref, scope, also)
        tombstone = Tombstone(
            tombstone_id=tombstone_id or uuid.uuid4().hex,
            subject_ref=subject_ref,
            scope=scope,
            key_ids=tuple(sorted(held | {r.key_id for r in shared})),
            erased_at=self._clock(),
        )
        deleted = self.store.destroy(tombstone.key_ids, tombstone) if tombstone.key_ids else 0
        if scope is None:
            self._forget_ref(subject_ref)
        evicted = self.cache.evict(tombstone.key_ids) + self.cache.evict_subject(subject_ref, scope)
        self._verify_destroyed(tombstone.key_ids)
        return DestroyResult(
            tombstone,
            deleted,
            evicted,
            verified=True,
            shared_keys=tuple(sorted((r.key_id, r.subject_ref) for r in shared)),
        )

    def shared_doomed(
        self, subject_ref: str, scope: str | None = None, *, also: Sequence[str] = ()
    ) -> list[tuple[bytes, str]]:
        """(key id, holder's subject_ref) of every key of other holders that
        ``destroy`` with the same arguments would destroy now (read only): what an
        erasure records before it destroys them, since the key store keeps no trace
        of their holders once they are gone."""
        _, shared = self._doomed(subject_ref, scope, also)
        return sorted((r.key_id, r.subject_ref) for r in shared)

    def _doomed(
        self, subject_ref: str, scope: str | None, also: Sequence[str]
    ) -> tuple[set[bytes], list[KeyRecord]]:
        """``destroy``'s keys: the ids of those the subject holds (in ``scope`` and
        ``also``), and the records of those it co-owns with other holders."""
        records = self.store.for_subject(subject_ref, scope)
        if scope is not None:
            for other in dict.fromkeys(also):
                records = [*records, *self.store.for_subject(subject_ref, other)]
        # A whole subject: every key it co-owns, as a person and through any scope's
        # data; one scope: the keys co-owned through that scope's data (a mention is
        # about the person, so only the subject's erasure takes it).
        shared = self.store.owned_by(subject_ref, scope)
        held = {r.key_id for r in records}
        return held, [r for r in shared if r.key_id not in held]

    # -- eviction (another process erased a subject) --------------------------------

    def evict_subject(self, subject_ref: str) -> set[str]:
        """Drop from this process's cache every key the subject holds or co-owns
        (its eviction event: ``keyshred.storage.events``); returns the other holders
        whose co-owned keys went (what was decrypted with them must go too).
        Shared keys unwrapped by id have unknown owners: they are looked up in one
        read, and those of the subject go, as do those the store no longer lists
        (destroyed meanwhile) or all of them when the store cannot be asked."""
        self._forget_ref(subject_ref)
        holders, unknown = self.cache.evict_owner(subject_ref)
        if unknown:
            try:
                owners = self.store.owners_of(unknown)
            except KeyshredError:
                owners = {}  # cannot tell: none stays
            doomed = []
            for key_id in unknown:
                theirs = owners.get(key_id)
                if theirs is None or subject_ref in {owner_subject(o) for o in theirs}:
                    doomed.append(key_id)
                else:
                    self.cache.learn_owners(key_id, theirs)
            holders |= self.cache.evict_shared(doomed)
        holders.discard(subject_ref)
        return holders

    def evict_all(self) -> None:
        """Drop every unwrapped DEK this process holds (events may have been missed).
        Epoch keys stay: they belong to no subject."""
        self.cache.clear()
        with self._refs_lock:
            self._refs.clear()
            self._ref_names.clear()

    def purge_expired(self) -> int:
        """Drop expired DEKs (and subject ids) now (the handle's janitor calls this
        on a schedule); returns the DEKs dropped."""
        self._purge_refs()
        return self.cache.purge_expired()

    def held(self, subject_ref: str) -> int:
        """How many unwrapped DEKs of the subject (held or co-owned) are cached."""
        return self.cache.held(subject_ref)

    def _verify_destroyed(self, key_ids: Sequence[bytes]) -> None:
        for key_id in key_ids:
            try:
                self.data_key_by_id(key_id)
            except SubjectErased:
                continue
            raise KeyshredError(f"key {key_id.hex()} still unwraps after destroy")

    def close(self) -> None:
        self.evict_all()
        self.live.forget()
        self.kek.close()
        if self._archive is not None:
            self._archive.forget()
            self._archive.provider.close()
        self.store.close()

    def __repr__(self) -> str:
        return f"Keyring(tenant={self.tenant!r}, kek={self.kek!r}, store={self.store!r})"
