"""The freeze lock: one instant at which every partition writer is out of the way.

Every write to a subject's partition (memories, vectors, flushes, compactions, an
erasure's key destruction and drops) already runs under that partition's lock; it
also holds the data folder's freeze lock *shared* for the same span. A backup takes
the freeze lock *exclusive* for the moment it pins the catalog snapshot and links
the partition files, so a snapshot taken while writers run is one point in time,
across processes (``flock`` on ``<data>/FREEZE``) and threads.

Inside one process all shared holders share one file description (a counter says
when the last one leaves); a thread that waits for the exclusive lock stops new
shared holders from starting, so a stream of writers cannot starve a backup.
Re-entering ``shared`` on the same thread never blocks.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator
from pathlib import Path

__all__ = ["FreezeLock"]


class FreezeLock:
    """Shared for writers, exclusive for a snapshot; see the module docstring."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._cond = threading.Condition()
        self._fd: int | None = None
        self._holders = 0
        self._waiting = 0
        self._local = threading.local()

    def _open(self) -> int:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        depth = getattr(self._local, "depth", 0)
        if depth:
            self._local.depth = depth + 1
            try:
                yield
            finally:
                self._local.depth = depth
            return
        with self._cond:
            while self._waiting:
                self._cond.wait()
            if self._holders == 0:
                if self._fd is None:
                    self._fd = self._open()
                fcntl.flock(self._fd, fcntl.LOCK_SH)  # waits while another process backs up
            self._holders += 1
        self._local.depth = 1
        try:
            yield
        finally:
            self._local.depth = 0
            with self._cond:
                self._holders -= 1
                if self._holders == 0 and self._fd is not None:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        if getattr(self._local, "depth", 0):
            raise RuntimeError("a writer cannot take the freeze lock exclusive")
        with self._cond:
            self._waiting += 1
            while self._holders:
                self._cond.wait()
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
            with self._cond:
                self._waiting -= 1
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            if self._fd is not None and not self._holders:
                os.close(self._fd)
                self._fd = None
