"""Restore staging folders: claimed under a lock, swept when their process is gone.

A restore builds its copy in a hidden folder next to the destination,
``.<name>.restoring-<id>``, and renames it into place once replayed and verified.
A restore killed on the way leaves that folder behind; it must not stay there.

- The restoring process holds an exclusive ``flock`` on ``<folder>.lock`` (a
  sibling file) from before the folder exists until after it is renamed away, so a
  folder whose lock nobody holds belongs to a process that died.
- Every restore sweeps the destination's parent first (``sweep``), and the live data
  folder keeps a marker per restore in flight (``<data>/.backup-staging/restore-*``,
  holding the folder's path: no personal data), so the next ``Keyshred.open`` of
  the data folder sweeps restores that went elsewhere (``sweep_marked``).

A lock file is checked to still be the file at its path after ``flock`` returns: a
sweeper may unlink a lock file whose folder does not exist yet, and the restore that
created it then starts over under a new name rather than hold a lock nobody sees.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RESTORING", "Claim", "claim", "sweep", "sweep_marked"]

RESTORING = ".restoring-"
_LOCK = ".lock"
_MARKER = "restore-"
# Exactly the names ``claim`` makes (and the restores before lock files made): the
# parent is the user's folder and may hold anything else, even a name that merely
# contains ``.restoring-``; the sweep must never delete that.
_STAGING_NAME = re.compile(r"\..+" + re.escape(RESTORING) + r"[0-9a-f]{8}", re.DOTALL)


@dataclass(frozen=True)
class Claim:
    """A staging folder this process holds (``fd`` holds the lock)."""

    folder: Path
    fd: int
    marker: Path | None

    def release(self) -> None:
        """The folder was renamed into place or removed: drop lock file and marker."""
        with contextlib.suppress(FileNotFoundError):
            _lock_path(self.folder).unlink()
        if self.marker is not None:
            with contextlib.suppress(FileNotFoundError):
                self.marker.unlink()
        os.close(self.fd)


def _lock_path(folder: Path) -> Path:
    return folder.with_name(folder.name + _LOCK)


def _lock_still_there(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _try_lock(path: Path) -> int | None:
    """An fd holding ``path``'s lock, or ``None`` (held by a live process, or the
    file was swept away meanwhile)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return None  # its folder is gone, or not ours to write: left as it is
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    if not _lock_still_there(fd, path):
        os.close(fd)
        return None
    return fd


def claim(dest: Path, markers: Path | None) -> Claim:
    """Create and lock a new staging folder for ``dest`` (mode 0700); ``markers`` is
    the live data folder's staging folder, where the marker goes."""
    while True:
        folder = dest.parent / f".{dest.name}{RESTORING}{uuid.uuid4().hex[:8]}"
        lock = _lock_path(folder)
        try:  # other errors (an unwritable parent) raise: no restore without a lock
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue
        fcntl.flock(fd, fcntl.LOCK_EX)
        if _lock_still_there(fd, lock):
            break
        os.close(fd)  # a sweep took it between open and flock: another name
    marker = None
    try:
        if markers is not None:
            markers.mkdir(parents=True, exist_ok=True, mode=0o700)
            marker = markers / f"{_MARKER}{folder.name.rsplit(RESTORING, 1)[1]}"
            marker.write_text(str(folder.resolve()), "utf-8")
        folder.mkdir(mode=0o700)
    except BaseException:
        Claim(folder, fd, marker).release()
        raise
    return Claim(folder, fd, marker)


def _sweep_one(folder: Path) -> bool:
    """Remove ``folder`` (and its lock file) unless a live restore holds it; whether
    nothing is left."""
    lock = _lock_path(folder)
    if not folder.exists() and not lock.exists():
        return True
    fd = _try_lock(lock)
    if fd is None:
        return not folder.exists() and not lock.exists()
    try:
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            lock.unlink()
    finally:
        os.close(fd)
    return not folder.exists()


def _candidates(parent: Path) -> Iterator[Path]:
    try:
        names = os.listdir(parent)
    except OSError:
        return
    seen: set[str] = set()
    for name in names:
        folder = name.removesuffix(_LOCK)
        if not _STAGING_NAME.fullmatch(folder):
            continue
        if folder not in seen:
            seen.add(folder)
            yield parent / folder


def sweep(parent: Path) -> int:
    """Remove every abandoned staging folder (and stray lock file) in ``parent``;
    returns how many were removed."""
    removed = 0
    for folder in _candidates(parent):
        existed = folder.exists()
        if _sweep_one(folder) and existed:
            removed += 1
    return removed


def sweep_marked(markers: Path) -> int:
    """Sweep the staging folders the live data folder's markers name (restores
    this data folder started, wherever they went); returns how many were removed."""
    removed = 0
    try:
        names = [n for n in os.listdir(markers) if n.startswith(_MARKER)]
    except OSError:
        return 0
    for name in names:
        marker = markers / name
        try:
            folder = Path(marker.read_text("utf-8").strip())
        except (OSError, UnicodeDecodeError):
            continue
        if not _STAGING_NAME.fullmatch(folder.name):
            continue  # not written by ``claim``: never delete what it names
        existed = folder.exists()
        if _sweep_one(folder):
            removed += int(existed)
            with contextlib.suppress(OSError):
                marker.unlink()
    return removed
