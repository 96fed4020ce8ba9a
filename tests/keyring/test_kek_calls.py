"""Provider calls per keyring operation, counted by ``ResilientKek`` around a real
local provider (issue #22 item 3): a new subject costs no call in a process that
holds the live epoch key and at most one in a fresh process; cold reads cost the
one epoch-key unwrap whatever the number of keys, and keys the provider wrapped
directly (a store from before the lineages) are unwrapped in one batch; a rotation
costs one rotate and one wrap whatever the number of DEKs; an erasure costs none."""

from __future__ import annotations

from pathlib import Path

import pytest

from keyshred.keyring.envelope import Place, key_id_of
from keyshred.keyring.kek.local import LocalKek
from keyshred.keyring.kek.resilient import ResilientKek
from keyshred.keyring.keyring import Keyring
from keyshred.keyring.keystore import SQLiteKeyStore
from tests.keyring.test_epochs import _legacy_store


def place(ref: str) -> Place:
    return Place(ref, "default", "memories", "r1", "value")


@pytest.fixture
def paths(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "kek.json", tmp_path / "keystore.db"


def fresh(paths: tuple[Path, Path]) -> tuple[Keyring, ResilientKek]:
    """What a new process builds: a provider, a counting wrapper, a keyring."""
    kek = ResilientKek(LocalKek(paths[0], create=True))
    return Keyring(SQLiteKeyStore(paths[1]), kek), kek


def by_op(kek: ResilientKek) -> dict[str, int]:
    return {op: c.calls for op, c in kek.counts().items() if c.calls}


def test_a_new_subject_costs_no_call_warm_and_one_cold(paths: tuple[Path, Path]) -> None:
    ring, kek = fresh(paths)
    ring.data_key("s-first", "default")
    kek.reset_counts()
    for i in range(50):
        ring.data_key(f"s-{i}", "default")
        ring.seal(b"v", place(f"s-{i}"))
    assert kek.total_calls() == 0
    ring.close()

    ring, kek = fresh(paths)  # opening unwraps the live epoch key (for the ref key)
    assert by_op(kek) == {"unwrap": 1}
    ring.data_key("s-cold", "default")
    ring.subject_ref("someone")
    assert by_op(kek) == {"unwrap": 1}
    ring.close()


def test_a_cold_read_of_200_subjects_costs_the_one_epoch_key_unwrap(
    paths: tuple[Path, Path],
) -> None:
    ring, _ = fresh(paths)
    sealed = {f"s-{i}": ring.seal(b"memory", place(f"s-{i}")) for i in range(200)}
    ring.close()
    for batch in (False, True):
        ring, kek = fresh(paths)
        if batch:
            keys = ring.data_keys_by_id([key_id_of(ct) for ct in sealed.values()])
            assert len(keys) == 200
        else:
            for ref, ct in sealed.items():
                assert ring.open(ct, place(ref)) == b"memory"
        assert by_op(kek) == {"unwrap": 1}
        ring.close()


def test_keys_wrapped_by_the_provider_directly_are_unwrapped_in_one_batch(
    paths: tuple[Path, Path],
) -> None:
    store = SQLiteKeyStore(paths[1])
    legacy = _legacy_store(store, LocalKek(paths[0], create=True), 30)
    store.close()
    ring, kek = fresh(paths)
    records = [ring.store.find(ref, "default") for ref, _ in legacy]
    ids = [r.key_id for r in records if r is not None]
    kek.reset_counts()
    keys = ring.data_keys_by_id(ids)
    assert len(keys) == 30
    assert by_op(kek) == {"unwrap_many": 1}
    ring.close()


def test_a_rotation_of_1000_deks_costs_one_rotate_and_one_wrap(
    paths: tuple[Path, Path],
) -> None:
    ring, kek = fresh(paths)
    for i in range(1000):
        ring.data_key(f"s-{i}", "default")
    kek.reset_counts()
    result = ring.rotate_kek()
    assert result.keys_rewrapped == 1000
    assert by_op(kek) == {"rotate": 1, "wrap": 1}
    kek.reset_counts()
    ring.destroy(ring.subject_ref("someone"))
    ring.destroy("s-1")
    assert kek.total_calls() == 0
    ring.close()
