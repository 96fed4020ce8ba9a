"""One lock per subject, held by the database: who may change a partition now.

Every change of a subject's memory partition (a put, a delete, a compaction, an
erasure's key destruction and drop) runs under its subject lock, taken from every
process that shares the catalog:

- PostgreSQL: a session advisory lock (``pg_advisory_lock``) on a pooled connection
  held for the span; the server releases it when that connection or its process
  dies, so a killed worker never leaves a subject locked.
- SQLite (the embedded profile: one machine, one database file): a POSIX record lock
  on one byte of a lock file beside the database (offset = the subject's hash), the
  file-level counterpart of an advisory lock; released by the kernel when the
  process dies. A catalog in memory has one process: a thread lock is enough.

Both are per process (a PostgreSQL session, a POSIX record lock), so inside one
process threads are serialized by striped re-entrant locks first, and nested holds
of the same subject take the database lock once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Engine

from keyshred import db

__all__ = ["SubjectLocks"]

_STRIPES = 256
_SPACE = (1 << 62) - 1  # lock-file offsets: collisions between subjects are negligible


def _key(subject_ref: str) -> int:
    digest = hashlib.sha256(b"keyshred-partition-lock\x00" + subject_ref.encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # a signed bigint for PostgreSQL


class SubjectLocks:
    """The subject locks of one catalog database (see the module docstring)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._dialect = engine.dialect.name
        self._stripes = [threading.RLock() for _ in range(_STRIPES)]
        self._mutex = threading.Lock()
        self._held: dict[str, tuple[int, Any]] = {}  # subject_ref -> (depth, release)
        self._fd: int | None = None
        self._pid = os.getpid()
        self._schema: str | None = None  # PostgreSQL: the catalog's, asked once
        database = db.sqlite_file(engine.url)
        self._file = Path(f"{database}-locks") if database is not None else None

    @contextlib.contextmanager
    def hold(self, subject_ref: str) -> Iterator[None]:
        key = _key(subject_ref)
        with self._stripes[key % _STRIPES]:
            with self._mutex:
                depth, release = self._held.get(subject_ref, (0, None))
            if depth == 0:
                release = self._acquire(key)
            with self._mutex:
                self._held[subject_ref] = (depth + 1, release)
            try:
                yield
            finally:
                with self._mutex:
                    depth, release = self._held.pop(subject_ref)
                    if depth > 1:
                        self._held[subject_ref] = (depth - 1, release)
                if depth == 1:
                    release()

    def _acquire(self, key: int) -> Any:
        if self._dialect == "postgresql":
            return self._pg_lock(key)
        if self._file is None:
            return lambda: None
        fd = self._lock_fd()
        offset = key % _SPACE
        fcntl.lockf(fd, fcntl.LOCK_EX, 1, offset)
        return lambda: fcntl.lockf(fd, fcntl.LOCK_UN, 1, offset)

    def _lock_fd(self) -> int:
        with self._mutex:
            if self._fd is None or self._pid != os.getpid():
                # A forked child has its own record locks: open its own descriptor.
                assert self._file is not None  # noqa: S101 - checked by the caller
                self._fd = os.open(self._file, os.O_RDWR | os.O_CREAT, 0o600)
                self._pid = os.getpid()
            return self._fd

    def _pg_lock(self, key: int) -> Any:
        stack = contextlib.ExitStack()
        cur = stack.enter_context(db.cursor(self._engine, write=False))
        try:
            if self._schema is None:
                self._schema = db.current_schema(cur) or "public"
            key = db.lock_key(key, self._schema)
            cur.execute("SELECT pg_advisory_lock(%s)", (key,))
        except BaseException:
            stack.close()
            raise

        def release() -> None:
            try:
                cur.execute("SELECT pg_advisory_unlock(%s)", (key,))
            finally:
                stack.close()

        return release

    def close(self) -> None:
        with self._mutex:
            if self._fd is not None and not self._held:
                os.close(self._fd)
                self._fd = None
