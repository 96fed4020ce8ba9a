"""The DEK lifecycle, run against every KEK provider on its real server."""

from __future__ import annotations

import pickle
import shutil
import sqlite3
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from keyshred.errors import IntegrityError, InvalidInput, KeyNotFound, KeyshredError, SubjectErased
from keyshred.keyring import envelope
from keyshred.keyring.envelope import Place
from keyshred.keyring.keyring import Keyring, verify_signature
from keyshred.keyring.keystore import SQLiteKeyStore
from tests.keyring.conftest import KekFactory


@pytest.fixture
def ring(kek_factory: KekFactory, tmp_path: Path) -> Keyring:
    return Keyring(SQLiteKeyStore(tmp_path / "keystore.db"), kek_factory())


def place(ref: str, scope: str = "default", record: str = "r1") -> Place:
    return Place(ref, scope, "memories", record, "value")


def test_one_dek_per_subject_and_scope(ring: Keyring, tmp_path: Path) -> None:
    ref = ring.subject_ref("alice")
    a = ring.data_key(ref, "default")
    assert ring.data_key(ref, "default").key_id == a.key_id
    assert ring.data_key(ref, "support/health").key_id != a.key_id
    assert ring.data_key(ring.subject_ref("bob"), "default").key_id != a.key_id
    # A second keyring on the same store (another process) sees the same key.
    other = Keyring(SQLiteKeyStore(tmp_path / "keystore.db"), ring.kek)
    assert other.data_key(ref, "default", create=False).key_id == a.key_id


def test_concurrent_first_use_creates_exactly_one_key(ring: Keyring) -> None:
    ref = ring.subject_ref("carol")
    ids: list[bytes] = []
    threads = [
        threading.Thread(target=lambda: ids.append(ring.data_key(ref, "s").key_id))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 1
    assert len(ring.store.for_subject(ref)) == 1


def test_seal_open_roundtrip_and_cache_miss_path(ring: Keyring) -> None:
    ref = ring.subject_ref("alice")
    ct = ring.seal(b"hello", place(ref))
    ring.cache.clear()
    assert ring.open(ct, place(ref)) == b"hello"
    with pytest.raises(IntegrityError):
        ring.open(ct, place(ref, record="r2"))


def test_unknown_key_is_not_erased(ring: Keyring) -> None:
    with pytest.raises(KeyNotFound):
        ring.data_key_by_id(b"\x01" * 16)
    with pytest.raises(KeyNotFound):
        ring.data_key(ring.subject_ref("nobody"), "default", create=False)


def test_destroy_subject_decides_before_decrypting(
    ring: Keyring, monkeypatch: pytest.MonkeyPatch
) -> None:
    alice, bob = ring.subject_ref("alice"), ring.subject_ref("bob")
    cts = {s: ring.seal(b"a-" + s.encode(), place(alice, s)) for s in ("default", "health")}
    bob_ct = ring.seal(b"b", place(bob))
    key_ids = [r.key_id for r in ring.store.for_subject(alice)]

    result = ring.destroy(alice)
    assert result.verified and result.keys_destroyed == 2
    assert sorted(result.tombstone.key_ids) == sorted(key_ids)
    assert ring.store.tombstone_for(key_ids[0]) is not None
    assert not any(k in ring.cache for k in key_ids)

    def no_decrypt(*_: object) -> bytes:
        raise AssertionError("decryption was attempted for an erased key")

    monkeypatch.setattr(envelope, "open_with", no_decrypt)
    monkeypatch.setattr("keyshred.keyring.datakey.open_with", no_decrypt)
    for scope, ct in cts.items():
        with pytest.raises(SubjectErased):
            ring.open(ct, place(alice, scope))
    monkeypatch.undo()
    assert ring.open(bob_ct, place(bob)) == b"b"
    # Idempotent: a second destroy finds nothing and changes nothing.
    assert ring.destroy(alice).keys_destroyed == 0


def test_scope_destroy_leaves_other_scopes(ring: Keyring) -> None:
    ref = ring.subject_ref("alice")
    keep = ring.seal(b"keep", place(ref, "default"))
    gone = ring.seal(b"gone", place(ref, "support/health"))
    ring.destroy(ref, "support/health")
    assert ring.open(keep, place(ref, "default")) == b"keep"
    with pytest.raises(SubjectErased):
        ring.open(gone, place(ref, "support/health"))
    # Consent granted again later: a new key, and the old data stays erased.
    fresh = ring.seal(b"new", place(ref, "support/health"))
    assert ring.open(fresh, place(ref, "support/health")) == b"new"
    with pytest.raises(SubjectErased):
        ring.open(gone, place(ref, "support/health"))


def test_batch_unwrap(ring: Keyring) -> None:
    refs = [ring.subject_ref(f"user-{i}") for i in range(120)]
    ids = [ring.data_key(r, "default").key_id for r in refs]
    ring.cache.clear()
    keys = ring.data_keys_by_id(ids)
    assert set(keys) == set(ids)
    ring.destroy(refs[7])
    ring.cache.clear()
    with pytest.raises(SubjectErased):
        ring.data_keys_by_id(ids)


def test_kek_rotation_rewraps_without_touching_data(ring: Keyring, tmp_path: Path) -> None:
    refs = [ring.subject_ref(f"u{i}") for i in range(30)]
    cts = [ring.seal(f"v{i}".encode(), place(r)) for i, r in enumerate(refs)]
    old_epoch = ring.kek.current_epoch()
    ring.store.close()
    backup = tmp_path / "keystore-backup.db"
    shutil.copy(tmp_path / "keystore.db", backup)
    ring.store = SQLiteKeyStore(tmp_path / "keystore.db")

    result = ring.rotate_kek()
    assert result.new_epoch == old_epoch + 1
    assert result.keys_rewrapped == 30 and result.secrets_rewrapped == 1
    assert ring.store.older_than(result.new_epoch, 10) == []
    with pytest.raises(KeyshredError):
        ring.destroy_kek_epochs_before(result.new_epoch + 1)

    # The pre-rotation key-store copy still yields keys while the old epoch lives...
    victim = ring.store.for_subject(refs[0])[0].key_id
    old = Keyring(SQLiteKeyStore(backup), ring.kek, cache_max_entries=0)
    old.data_key_by_id(victim)
    ring.destroy(refs[0])
    ring.destroy_kek_epochs_before(result.new_epoch)
    # ...and nothing once that epoch is destroyed, whatever the copy holds.
    with pytest.raises(SubjectErased):
        old.data_key_by_id(victim)
    ring.cache.clear()
    for i, (r, ct) in enumerate(zip(refs, cts, strict=True)):
        if i == 0:
            with pytest.raises(SubjectErased):
                ring.open(ct, place(r))
        else:
            assert ring.open(ct, place(r)) == f"v{i}".encode()


def test_subject_ref_is_stable_keyed_and_opaque(ring: Keyring, tmp_path: Path) -> None:
    ref = ring.subject_ref("alice@example.com")
    assert ref == ring.subject_ref("alice@example.com")
    assert len(ref) == 26 and ref.isalnum() and ref.islower()
    assert ref != ring.subject_ref("alice@example.com", tenant="other")
    assert ring.subject_ref("ab", tenant="c") != ring.subject_ref("b", tenant="ca")
    # Another deployment (another ref_key) gives a different ref for the same person.
    other = Keyring(SQLiteKeyStore(tmp_path / "other.db"), ring.kek)
    assert other.subject_ref("alice@example.com") != ref
    with pytest.raises(InvalidInput):
        ring.subject_ref("")


def test_signer_signs_and_verifies(ring: Keyring) -> None:
    signer = ring.signer()
    sig = signer.sign(b"receipt")
    verify_signature(signer.public_key, sig, b"receipt")
    with pytest.raises(IntegrityError):
        verify_signature(signer.public_key, sig, b"receipt!")
    with pytest.raises(TypeError):
        pickle.dumps(signer)


def test_cache_is_bounded_and_expires(ring: Keyring) -> None:
    from keyshred.keyring.cache import KeyCache

    now = [0.0]
    cache = KeyCache(max_entries=3, ttl_seconds=10, clock=lambda: now[0])
    keys = [ring.data_key(ring.subject_ref(f"c{i}"), "default") for i in range(4)]
    for k in keys:
        cache.put(k)
    assert len(cache) == 3 and cache.get(keys[0].key_id) is None
    assert cache.get(keys[3].key_id) is keys[3]
    now[0] = 11.0
    assert cache.get(keys[3].key_id) is None
    assert cache.purge_expired() == 2 and len(cache) == 0
    cache.put(keys[1])
    assert cache.evict_subject(keys[1].subject_ref) == 1 and len(cache) == 0


def test_tampered_wrapped_key_in_store_raises(ring: Keyring, tmp_path: Path) -> None:
    ref = ring.subject_ref("mallory-target")
    ct = ring.seal(b"x", place(ref))
    ring.cache.clear()
    db = sqlite3.connect(tmp_path / "keystore.db")
    # Swap in another subject's wrapped key: the context binding must catch it.
    other = ring.data_key(ring.subject_ref("someone"), "default").key_id
    with db:
        (wrapped,) = db.execute("SELECT wrapped FROM dek WHERE key_id = ?", (other,)).fetchone()
        db.execute("UPDATE dek SET wrapped = ? WHERE subject_ref = ?", (wrapped, ref))
    db.close()
    ring.cache.clear()
    with pytest.raises(IntegrityError):
        ring.open(ct, place(ref))


def test_subject_ids_are_checked_before_the_cache(ring: Keyring) -> None:
    for bad in ("", ["alice"], {"id": "alice"}, None, 7):
        with pytest.raises(InvalidInput):
            ring.subject_ref(bad)  # type: ignore[arg-type]
    assert ring.subject_ref("alice") == ring.subject_ref("alice")


def test_a_kek_that_cannot_unwrap_the_store_says_so(tmp_path: Path) -> None:
    """A worker configured with another KEK than the one that made the shared key
    store is told so, not 'wrapped key failed authentication'."""
    from keyshred.errors import ConfigError, KekMismatch
    from keyshred.keyring.kek.local import LocalKek

    Keyring(SQLiteKeyStore(tmp_path / "shared.db"), LocalKek(tmp_path / "a.json", create=True))
    other = LocalKek(tmp_path / "b.json", create=True)
    with pytest.raises(KekMismatch, match="cannot unwrap the key store") as info:
        Keyring(SQLiteKeyStore(tmp_path / "shared.db"), other)
    assert isinstance(info.value, ConfigError)
    assert "another KEK" in str(info.value) and "local KEK epoch 1" in str(info.value)


def test_a_tampered_key_store_secret_is_still_an_integrity_error(tmp_path: Path) -> None:
    """KekMismatch cannot tell a wrong KEK from an altered row: it says both, and
    it stays an IntegrityError too, so tamper handling (``except IntegrityError``)
    still catches an altered secret. (Review finding.)"""
    import sqlite3

    from keyshred.errors import IntegrityError, KekMismatch
    from keyshred.keyring.kek.local import LocalKek

    kek = LocalKek(tmp_path / "a.json", create=True)
    Keyring(SQLiteKeyStore(tmp_path / "ks.db"), kek).close()
    db = sqlite3.connect(tmp_path / "ks.db")
    with db:
        for name, wrapped in db.execute("SELECT name, wrapped FROM secret").fetchall():
            flipped = bytes([wrapped[0]]) + bytes([wrapped[1] ^ 1]) + wrapped[2:]
            db.execute("UPDATE secret SET wrapped = ? WHERE name = ?", (flipped, name))
    db.close()
    with pytest.raises(IntegrityError) as info:
        Keyring(SQLiteKeyStore(tmp_path / "ks.db"), LocalKek(tmp_path / "a.json"))
    assert isinstance(info.value, KekMismatch)


def test_shared_keys_die_with_any_owner(ring: Keyring) -> None:
    dave, vic, zoe = "d" * 26, "v" * 26, "z" * 26
    own = ring.data_key(dave, "default")
    shared = ring.data_key(dave, "default", owners=[vic])
    assert shared.key_id != own.key_id and shared.subject_ref == dave and shared.owner_tag
    assert ring.data_key(dave, "default", owners=(vic, dave)).key_id == shared.key_id
    assert ring.data_key(dave, "default", owners=()).key_id == own.key_id
    three = ring.data_key(dave, "default", owners=[zoe, vic])
    other_holder = ring.data_key(zoe, "default", owners=[vic])
    p = place(dave)
    sealed = shared.seal(b"vic's phone", p)
    own_sealed = own.seal(b"dave's own", p)
    ring.cache.clear()
    assert ring.open(sealed, p) == b"vic's phone"  # from the store, with its owner tag
    assert ring.owners_of([shared.key_id, own.key_id]) == {shared.key_id: (vic,)}
    result = ring.destroy(vic)
    assert set(result.tombstone.key_ids) == {shared.key_id, three.key_id, other_holder.key_id}
    assert {h for _, h in result.shared_keys} == {dave, zoe} and len(result.shared_keys) == 3
    with pytest.raises(SubjectErased):
        ring.open(sealed, p)  # dave's row about vic: gone in every copy
    assert ring.open(own_sealed, p) == b"dave's own"  # dave's own data stays
    fresh = ring.data_key(dave, "default", owners=[vic])  # a new key after the erasure
    assert fresh.key_id != shared.key_id


def test_scope_destroy_takes_the_holders_shared_keys_of_that_scope(ring: Keyring) -> None:
    dave, vic = "d" * 26, "v" * 26
    health = ring.data_key(dave, "health", owners=[vic])
    other = ring.data_key(dave, "default", owners=[vic])
    result = ring.destroy(dave, "health")
    assert result.tombstone.key_ids == (health.key_id,) and result.shared_keys == ()
    assert ring.data_key_by_id(other.key_id).key_id == other.key_id


def test_owner_tag_is_bound_to_the_wrapped_key(ring: Keyring, tmp_path: Path) -> None:
    """A shared key's record moved to pass for the holder's scope key fails to unwrap."""
    dave, vic = "d" * 26, "v" * 26
    shared = ring.data_key(dave, "default", owners=[vic])
    ring.cache.clear()
    record = ring.store.get(shared.key_id)
    assert record is not None
    forged = replace(record, owner_tag="")
    with pytest.raises(IntegrityError):
        ring._unwrap_record(forged)
