"""The two-level live KEK lineage: epoch keys wrap DEKs locally, the provider wraps
only epoch keys; rotation, crash resume, stale writers, destruction, migration of
stores made before the lineages, and the live schedule. On both key stores."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from keyshred.errors import KekEpochDestroyed, KeyshredError, SubjectErased
from keyshred.keyring import _primitives as prim
from keyshred.keyring import keyring as keyring_module
from keyshred.keyring.envelope import Place
from keyshred.keyring.epochs import WRAPPED_BYTES, epoch_key_context
from keyshred.keyring.kek import (
    Context,
    DestroyedEpoch,
    EpochInfo,
    KekProvider,
    WrappedKey,
    encode_context,
)
from keyshred.keyring.kek.local import LocalKek
from keyshred.keyring.keyring import Keyring, _dek_context, _secret_context
from keyshred.keyring.keystore import KeyRecord, KeyStore, SecretRecord, SQLiteKeyStore
from tests.keyring.test_keystores import open_store, store_url  # noqa: F401 - fixture

HOUR = timedelta(hours=1)


class CountingKek(KekProvider):
    """A provider that forwards to a real one and counts every call by name."""

    def __init__(self, inner: KekProvider) -> None:
        self.inner = inner
        self.name = inner.name
        self.calls: dict[str, int] = {}
        self.refuse = False

    def _count(self, op: str) -> None:
        if self.refuse:
            raise AssertionError(f"unexpected provider call {op}")
        self.calls[op] = self.calls.get(op, 0) + 1

    def total(self) -> int:
        return sum(self.calls.values())

    def current_epoch(self) -> int:
        return self.inner.current_epoch()  # local state, not a key operation

    def epochs(self) -> list[EpochInfo]:
        self._count("epochs")
        return self.inner.epochs()

    def wrap(self, key: bytes, context: Context) -> WrappedKey:
        self._count("wrap")
        return self.inner.wrap(key, context)

    def unwrap(self, wrapped: WrappedKey, context: Context) -> bytes:
        self._count("unwrap")
        return self.inner.unwrap(wrapped, context)

    def wrap_many(self, items: Sequence[tuple[bytes, Context]]) -> list[WrappedKey]:
        self._count("wrap_many")
        return self.inner.wrap_many(items)

    def unwrap_many(self, items: Sequence[tuple[WrappedKey, Context]]) -> list[bytes]:
        self._count("unwrap_many")
        return self.inner.unwrap_many(items)

    def rotate(self) -> int:
        self._count("rotate")
        return self.inner.rotate()

    def destroy_epochs_before(self, epoch: int) -> list[DestroyedEpoch]:
        self._count("destroy_epochs_before")
        return self.inner.destroy_epochs_before(epoch)


@pytest.fixture
def store(store_url: str | None, tmp_path: Path) -> Iterator[KeyStore]:  # noqa: F811
    s = open_store(store_url, tmp_path)
    yield s
    s.close()


@pytest.fixture
def kek(tmp_path: Path) -> CountingKek:
    return CountingKek(LocalKek(tmp_path / "kek.json", create=True))


def place(ref: str, scope: str = "default") -> Place:
    return Place(ref, scope, "memories", "r1", "value")


def test_a_dek_is_wrapped_by_the_epoch_key_and_unwraps_without_the_provider(
    store: KeyStore, kek: CountingKek
) -> None:
    ring = Keyring(store, kek)
    ref = ring.subject_ref("alice")
    ct = ring.seal(b"hello", place(ref))
    record = store.find(ref, "default")
    assert record is not None
    assert record.kek_provider == "local@live" and len(record.wrapped) == WRAPPED_BYTES
    (epoch_key,) = store.epoch_keys("live")
    assert epoch_key.epoch == record.kek_epoch == kek.current_epoch()
    # The provider cannot open the DEK's wrapping itself: only the epoch key can.
    context = _dek_context(record.key_id, record.tenant, record.subject_ref, record.scope)
    with pytest.raises(KeyshredError):
        kek.inner.unwrap(WrappedKey(record.kek_epoch, record.wrapped), context)
    raw_epoch_key = kek.inner.unwrap(
        WrappedKey(epoch_key.provider_epoch, epoch_key.wrapped),
        epoch_key_context("live", epoch_key.epoch),
    )
    aad = (
        b"keyshred/epoch-wrap\x00"
        + len(b"live").to_bytes(4, "big")
        + b"live"
        + record.kek_epoch.to_bytes(8, "big")
        + encode_context(context)
    )
    raw = prim.new_aead(raw_epoch_key).decrypt(record.wrapped[:12], record.wrapped[12:], aad)
    assert len(raw) == 32
    # Once the epoch key is cached, opening any DEK costs no provider call at all.
    for i in range(20):
        ring.data_key(ring.subject_ref(f"u{i}"), "default")
    ring.cache.clear()
    kek.refuse = True
    assert ring.open(ct, place(ref)) == b"hello"
    for i in range(20):
        ring.data_key(ring.subject_ref(f"u{i}"), "default", create=False)


def test_provider_calls_per_rotation_do_not_grow_with_the_number_of_deks(
    store: KeyStore, kek: CountingKek, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(keyring_module, "_ROTATE_PAGE", 7)  # several pages
    ring = Keyring(store, kek)
    counts = []
    for n in (5, 60):
        for i in range(n):
            ring.data_key(ring.subject_ref(f"n{n}-{i}"), "default")
        kek.calls.clear()
        result = ring.rotate_kek()
        assert result.keys_rewrapped >= n
        counts.append(dict(kek.calls))
    assert counts[0] == counts[1] == {"rotate": 1, "wrap": 1}


def test_destroying_an_epoch_makes_every_dek_of_it_erased(
    store: KeyStore, kek: CountingKek
) -> None:
    ring = Keyring(store, kek)
    refs = [ring.subject_ref(f"s{i}") for i in range(5)]
    for r in refs:
        ring.data_key(r, "default")
    # What a page dump, a WAL or a replica could keep: the rows as they were.
    before = [store.find(r, "default") for r in refs]
    old_epoch = before[0].kek_epoch  # type: ignore[union-attr]
    assert all(r is not None and r.kek_epoch == old_epoch for r in before)
    rotation = ring.rotate_kek()
    for r in before:
        assert r is not None
        assert ring._unwrap_record(r).key_id == r.key_id  # the old wrapping still opens
    ring.destroy_kek_epochs_before(rotation.new_epoch)
    assert [e.epoch for e in store.epoch_keys("live")] == [rotation.new_epoch]
    ring.cache.clear()
    for r in before:
        assert r is not None
        with pytest.raises(SubjectErased):
            ring._unwrap_record(r)
    # A fresh process (no epoch key in memory) fails the same way.
    other = Keyring(store, kek.inner)
    for r in before:
        assert r is not None
        with pytest.raises(SubjectErased):
            other._unwrap_record(r)
    # The live keys were re-wrapped and still open.
    for r in refs:
        assert other.data_key(r, "default", create=False).key_id in {
            b.key_id for b in before if b is not None
        }


def test_a_crash_in_the_middle_of_a_rewrap_resumes(
    store: KeyStore, kek: CountingKek, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(keyring_module, "_ROTATE_PAGE", 4)
    ring = Keyring(store, kek)
    refs = [ring.subject_ref(f"c{i}") for i in range(15)]
    cts = [ring.seal(f"v{i}".encode(), place(r)) for i, r in enumerate(refs)]
    real = store.update_wrapped
    calls = [0]

    def crash_on_second(*args: object, **kwargs: object) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise OSError("killed")
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "update_wrapped", crash_on_second)
    with pytest.raises(OSError):
        ring.rotate_kek()
    monkeypatch.setattr(store, "update_wrapped", real)
    new_epoch = store.epoch_keys("live")[-1].epoch
    left = store.older_than(new_epoch, 100)
    assert 0 < len(left) < 15
    with pytest.raises(KeyshredError, match="still wrapped"):
        ring.destroy_kek_epochs_before(new_epoch)
    assert [e.epoch for e in store.epoch_keys("live")] == [new_epoch - 1, new_epoch]
    # A new process resumes where the crash stopped.
    resumed = Keyring(store, kek.inner)
    keys, _ = resumed.rewrap_to_current()
    assert keys == len(left)
    resumed.destroy_kek_epochs_before(new_epoch)
    for r, ct, i in zip(refs, cts, range(15), strict=True):
        assert resumed.open(ct, place(r)) == f"v{i}".encode()


def test_a_dek_made_under_a_stale_epoch_is_caught(store: KeyStore, tmp_path: Path) -> None:
    """Process B still sees the old epoch after A rotated: its new key lands under
    the old epoch, A's destroy refuses until the re-wrap picked it up, and once the
    old epoch is gone B's next write moves to the new one."""
    a = Keyring(store, LocalKek(tmp_path / "kek.json", create=True))
    b = Keyring(store, LocalKek(tmp_path / "kek.json"))
    b.data_key(b.subject_ref("warm"), "default")  # B now knows the current epoch
    rotation = a.rotate_kek()
    late = b.subject_ref("late")
    ct = b.seal(b"late data", place(late))
    record = store.find(late, "default")
    assert record is not None and record.kek_epoch < rotation.new_epoch
    with pytest.raises(KeyshredError, match="still wrapped"):
        a.destroy_kek_epochs_before(rotation.new_epoch)
    assert a.rewrap_to_current()[0] == 1
    a.destroy_kek_epochs_before(rotation.new_epoch)
    later = b.subject_ref("later")
    b.data_key(later, "default")  # the guard refuses the old epoch; B moves on
    assert store.find(later, "default").kek_epoch == rotation.new_epoch  # type: ignore[union-attr]
    b.cache.clear()
    assert b.open(ct, place(late)) == b"late data"


def _legacy_store(store: KeyStore, kek: KekProvider, n: int) -> list[tuple[str, bytes]]:
    """Rows as a keyring made them before the lineages: every DEK and secret wrapped
    by the provider directly. Returns (subject_ref, raw DEK)."""
    out = []
    for i in range(n):
        key_id, raw, ref = prim.random_bytes(16), prim.random_key(), f"legacy-{i}"
        wrapped = kek.wrap(raw, _dek_context(key_id, "default", ref, "default"))
        store.insert(
            KeyRecord(
                key_id,
                "default",
                ref,
                "default",
                kek.name,
                wrapped.epoch,
                wrapped.blob,
                datetime.now(UTC),
            )
        )
        out.append((ref, raw))
    for name in ("subject-ref-key",):
        w = kek.wrap(prim.random_bytes(32), _secret_context(name))
        store.put_secret(SecretRecord(name, kek.name, w.epoch, w.blob))
    return out


def test_a_store_from_before_the_lineages_opens_and_migrates_at_its_first_rotation(
    store: KeyStore, kek: CountingKek
) -> None:
    legacy = _legacy_store(store, kek.inner, 12)
    ring = Keyring(store, kek)
    ref_before = ring.subject_ref("someone")  # the legacy secret still unwraps
    for ref, raw in legacy:
        key = ring.data_key(ref, "default", create=False)
        assert key.derive(b"x") == prim.hmac_sha256(
            prim.hmac_sha256(raw, b"keyshred/dek-derive"), b"keyshred/derive\x00x"
        )
    fresh = ring.subject_ref("new")
    ring.data_key(fresh, "default")
    assert store.find(fresh, "default").kek_provider == "local@live"  # type: ignore[union-attr]
    assert store.find("legacy-0", "default").kek_provider == "local"  # type: ignore[union-attr]
    rotation = ring.rotate_kek()
    assert rotation.keys_rewrapped == 13 and rotation.secrets_rewrapped == 1
    rows = [store.find(ref, "default") for ref, _ in legacy]
    assert all(r is not None and r.kek_provider == "local@live" for r in rows)
    assert {s.kek_provider for s in store.secrets()} == {"local@live"}
    ring.destroy_kek_epochs_before(rotation.new_epoch)
    reopened = Keyring(store, kek.inner)
    assert reopened.subject_ref("someone") == ref_before
    for ref, raw in legacy:
        key = reopened.data_key(ref, "default", create=False)
        assert key.derive(b"x") == prim.hmac_sha256(
            prim.hmac_sha256(raw, b"keyshred/dek-derive"), b"keyshred/derive\x00x"
        )


def test_the_live_schedule_rotates_when_due_and_destroys_the_previous_epoch(
    store: KeyStore, kek: CountingKek
) -> None:
    ring = Keyring(store, kek)
    ref = ring.subject_ref("a")
    ct = ring.seal(b"data", place(ref))
    first = ring.live_epoch()
    early = ring.maintain_live(HOUR, now=first.created_at + HOUR - timedelta(seconds=1))
    assert early.rotated_to is None and early.destroyed == []
    assert early.due_at == first.created_at + HOUR
    due = ring.maintain_live(HOUR, now=first.created_at + HOUR)
    assert due.rotated_to == first.epoch + 1 and due.keys_rewrapped == 1
    assert [d.epoch for d in due.destroyed] == [first.epoch]
    assert [e.epoch for e in store.epoch_keys("live")] == [first.epoch + 1]
    with pytest.raises(KekEpochDestroyed):
        kek.inner.unwrap(
            WrappedKey(first.provider_epoch, first.wrapped), epoch_key_context("live", first.epoch)
        )
    # keep_from holds an epoch (a backup generation sealed before the lineages).
    second = ring.live_epoch()
    held = ring.maintain_live(HOUR, now=second.created_at + HOUR, keep_from=second.epoch)
    assert held.rotated_to == second.epoch + 1 and held.destroyed == []
    ring.cache.clear()
    assert ring.open(ct, place(ref)) == b"data"


def test_the_store_guards_writes_under_a_destroyed_live_epoch(store: KeyStore) -> None:
    """The key store itself refuses a key or secret under a live epoch whose key is
    gone, and refuses to delete epoch keys something is still wrapped by (nothing is
    deleted then); an epoch key is inserted once (the first writer wins)."""
    from keyshred.keyring.keystore import EpochKeyRecord

    now = datetime.now(UTC)
    first = store.insert_epoch_key(EpochKeyRecord("live", 1, "local", 1, b"a" * 60, now))
    again = store.insert_epoch_key(EpochKeyRecord("live", 1, "local", 1, b"b" * 60, now))
    assert again == first and again.wrapped == b"a" * 60
    store.insert_epoch_key(EpochKeyRecord("live", 2, "local", 2, b"c" * 60, now))
    record = KeyRecord(b"k" * 16, "default", "ann", "default", "local@live", 1, b"w" * 60, now)
    store.insert(record)
    with pytest.raises(KeyshredError, match="still wrapped"):
        store.destroy_epoch_keys("live", 2, ["local@live"])
    assert [e.epoch for e in store.epoch_keys("live")] == [1, 2]
    store.update_wrapped([(record.key_id, 2, b"v" * 60)], live_epoch=2)
    assert store.destroy_epoch_keys("live", 2, ["local@live"]) == [1]
    with pytest.raises(KekEpochDestroyed):
        store.insert(
            KeyRecord(b"j" * 16, "default", "bob", "default", "local@live", 1, b"w" * 60, now)
        )
    with pytest.raises(KekEpochDestroyed):
        store.update_wrapped([(record.key_id, 1, b"x" * 60)], live_epoch=1)
    with pytest.raises(KekEpochDestroyed):
        store.put_secret(SecretRecord("s", "local@live", 1, b"w" * 60))
    assert store.find("bob", "default") is None and store.get_secret("s") is None
    assert store.get(record.key_id).wrapped == b"v" * 60  # type: ignore[union-attr]


def test_a_run_within_the_maintenance_interval_of_the_end_rotates(tmp_path: Path) -> None:
    """With the job scheduled every 5 minutes, an epoch is rotated by the first run
    within 5 minutes of its end, not left for one more interval past it (which would
    break the receipts' ``live_residue_until``)."""
    ring = Keyring(SQLiteKeyStore(tmp_path / "ks.db"), LocalKek(tmp_path / "kek.json", create=True))
    try:
        first = ring.live_epoch()
        lead = timedelta(minutes=5)
        early = ring.maintain_live(HOUR, now=first.created_at + HOUR - lead * 2, lead=lead)
        assert early.rotated_to is None
        # A run a few seconds before the end (the hourly run that used to miss it).
        run = ring.maintain_live(
            HOUR, now=first.created_at + HOUR - timedelta(seconds=3), lead=lead
        )
        assert run.rotated_to == first.epoch + 1
        assert [d.epoch for d in run.destroyed] == [first.epoch]
    finally:
        ring.close()
