"""Byte scans: the key store never holds a subject id, a raw DEK or plaintext, and a
destroyed key's wrapped bytes are in no file afterwards (database and WAL)."""

from __future__ import annotations

from pathlib import Path

import pytest

from keyshred import Keyshred
from keyshred.keyring import _primitives as prim
from keyshred.keyring.envelope import Place


def all_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_no_subject_id_dek_or_plaintext_in_any_file(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[bytes] = []
    real = prim.random_key

    def recording() -> bytes:
        key = real()
        made.append(key)
        return key

    monkeypatch.setattr(prim, "random_key", recording)
    subjects = [f"probe-subject-{i}-7d1c@example.org" for i in range(20)]
    with Keyshred.init(data_dir) as ks:
        for s in subjects:
            ref = ks.subject_ref(s)
            for scope in ("default", "support/health"):
                p = Place(ref, scope, "t", "r", "c")
                ks.keyring.seal(f"plaintext-probe-{s}".encode(), p)
    assert len(made) == 40 + 2  # 40 DEKs, the local KEK epoch and the live epoch key
    files = all_bytes(data_dir)
    assert "keys/keystore.db" in files
    for name, data in files.items():
        for s in subjects:
            assert s.encode() not in data, name
            assert b"plaintext-probe" not in data, name
        if name != "keys/kek.local.json":  # the KEK file holds the KEK, by design
            for key in made:
                assert key not in data, name


def test_destroyed_wrapped_key_leaves_no_copy(data_dir: Path) -> None:
    with Keyshred.init(data_dir) as ks:
        refs = [ks.subject_ref(f"s{i}") for i in range(50)]
        for r in refs:
            ks.keyring.data_key(r, "default")
        victim = ks.keyring.store.find(refs[3], "default")
        assert victim is not None
        assert any(victim.wrapped in b for b in all_bytes(data_dir).values())
        ks.keyring.destroy(refs[3])
        for name, data in all_bytes(data_dir).items():
            assert victim.wrapped not in data, name


def test_key_files_are_private(data_dir: Path) -> None:
    with Keyshred.init(data_dir) as ks:
        ks.keyring.data_key(ks.subject_ref("x"), "default")
        assert (data_dir / "keys").stat().st_mode & 0o777 == 0o700
        names = sorted(p.name for p in (data_dir / "keys").iterdir())
        assert {"kek.local.json", "keystore.db"} <= set(names)
        for p in (data_dir / "keys").iterdir():  # WAL and shm files included
            assert p.stat().st_mode & 0o077 == 0, p.name
