"""The staging sweep removes only what a restore created: a parent folder may hold
other things, and a name that merely contains ``.restoring-`` is not ours."""

from __future__ import annotations

from pathlib import Path

from keyshred.backup import staging
from keyshred.backup.staging import RESTORING


def test_sweep_leaves_what_a_restore_did_not_create(tmp_path: Path) -> None:
    """Names a restore never makes (no 8-hex id, or not a dot name) stay, with their
    contents; a real abandoned staging folder next to them goes."""
    notes = tmp_path / f".thesis{RESTORING}notes"
    notes.mkdir()
    (notes / "chapter1.txt").write_text("mine")
    user_lock = tmp_path / f".db{RESTORING}plan.lock"
    user_lock.write_text("mine")
    longer = tmp_path / f".x{RESTORING}deadbeef-old"
    longer.mkdir()
    ours = tmp_path / f".r{RESTORING}0badf00d"
    (ours / "keys").mkdir(parents=True)
    (tmp_path / f".r{RESTORING}0badf00d.lock").touch()

    assert staging.sweep(tmp_path) == 1

    assert (notes / "chapter1.txt").read_text() == "mine"
    assert user_lock.read_text() == "mine"
    assert longer.is_dir()
    assert not ours.exists()
    assert not (tmp_path / f".r{RESTORING}0badf00d.lock").exists()


def test_sweep_marked_ignores_a_marker_naming_a_foreign_folder(tmp_path: Path) -> None:
    """A marker whose path is not a staging folder name never deletes that folder."""
    foreign = tmp_path / f".photos{RESTORING}2024"
    foreign.mkdir()
    (foreign / "a.jpg").write_bytes(b"jpg")
    markers = tmp_path / "data" / ".backup-staging"
    markers.mkdir(parents=True)
    (markers / "restore-12345678").write_text(str(foreign))

    staging.sweep_marked(markers)

    assert (foreign / "a.jpg").read_bytes() == b"jpg"
