"""The per-subject append log: small writes made durable before they are batched.

Each record is sealed with the subject's scope DEK and bound to
``(subject_ref, scope, "memlog", "<log number>:<sequence>", "record")``, so records
cannot be reordered, dropped from the middle, or moved to another log or subject
without ``IntegrityError``. Framing (big-endian)::

    u32 body length | u16 scope length | scope | u64 sequence | sealed payload

``append`` writes a batch with one ``write`` and one ``fsync`` (``durability =
"fsync"``) before returning, so an acknowledged write survives ``kill -9`` and power
loss. A crash mid-append leaves a torn tail (a record shorter than its length); it
was never acknowledged, and opening the log for writing truncates it. Anything else
that fails to authenticate raises ``IntegrityError``.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

from keyshred.errors import IntegrityError, SubjectErased
from keyshred.keyring.envelope import Place
from keyshred.storage.sealer import Sealer

__all__ = ["AppendLog"]

_LEN = struct.Struct(">I")
_SCOPE = struct.Struct(">H")
_SEQ = struct.Struct(">Q")
MAX_RECORD = 64 * 1024 * 1024


class AppendLog:
    """One log file of one subject partition."""

    def __init__(
        self,
        path: Path,
        number: int,
        subject_ref: str,
        sealer: Sealer,
        *,
        fsync: bool = True,
    ) -> None:
        self.path = path
        self._path_str = str(path)
        self.number = number
        self._subject_ref = subject_ref
        self._sealer = sealer
        self._fsync = fsync
        self._fd: int | None = None
        self.next_seq = 0
        self.offset = 0  # bytes of complete records

    def _place(self, scope: str, seq: int) -> Place:
        return Place(self._subject_ref, scope, "memlog", f"{self.number}:{seq}", "record")

    def read(
        self, start: int = 0, start_seq: int = 0, *, skip_erased: bool = False
    ) -> Iterator[tuple[str, bytes | None]]:
        """Yield (scope, payload) of complete records from byte ``start``; stops at
        a torn tail. Updates ``offset`` and ``next_seq`` as it goes. With
        ``skip_erased`` a record whose key was destroyed yields ``(scope, None)``."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        pos, seq = start, start_seq
        while pos + _LEN.size <= len(data):
            (n,) = _LEN.unpack_from(data, pos)
            if n > MAX_RECORD or n < _SCOPE.size + _SEQ.size:
                raise IntegrityError(f"log {self.path.name} is corrupt at byte {pos}")
            end = pos + _LEN.size + n
            if end > len(data):
                break  # torn tail: never acknowledged
            body = memoryview(data)[pos + _LEN.size : end]
            (slen,) = _SCOPE.unpack_from(body, 0)
            scope = bytes(body[_SCOPE.size : _SCOPE.size + slen]).decode("utf-8", "replace")
            (rseq,) = _SEQ.unpack_from(body, _SCOPE.size + slen)
            if rseq != seq:
                raise IntegrityError(f"log {self.path.name} is out of sequence at byte {pos}")
            payload = bytes(body[_SCOPE.size + slen + _SEQ.size :])
            try:
                opened: bytes | None = self._sealer.open(payload, self._place(scope, rseq))
            except SubjectErased:
                if not skip_erased:
                    raise
                opened = None
            yield scope, opened
            pos, seq = end, seq + 1
            self.offset, self.next_seq = pos, seq

    def open_for_append(self) -> None:
        """Open (creating) for appends, truncating a torn tail left by a crash."""
        if self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        size = os.fstat(fd).st_size
        if size > self.offset:
            os.ftruncate(fd, self.offset)
            os.fsync(fd)
        os.lseek(fd, self.offset, os.SEEK_SET)
        self._fd = fd

    def append(self, records: Sequence[tuple[str, bytes]]) -> None:
        """Seal and append records; durable when this returns."""
        self.open_for_append()
        assert self._fd is not None  # noqa: S101 - set by open_for_append
        # Other processes may have appended since (the caller caught up with them
        # under the partition lock): write after the last complete record we know.
        os.lseek(self._fd, self.offset, os.SEEK_SET)
        out = bytearray()
        seq = self.next_seq
        for scope, payload in records:
            raw_scope = scope.encode("utf-8")
            sealed = self._sealer.seal(payload, self._place(scope, seq))
            body_len = _SCOPE.size + len(raw_scope) + _SEQ.size + len(sealed)
            out += _LEN.pack(body_len)
            out += _SCOPE.pack(len(raw_scope))
            out += raw_scope
            out += _SEQ.pack(seq)
            out += sealed
            seq += 1
        written = 0
        view = memoryview(out)
        while written < len(out):
            written += os.write(self._fd, view[written:])
        if self._fsync:
            # fdatasync flushes the data and the size that reading it needs (POSIX),
            # not the timestamps: the same durability, a quarter less latency here.
            os.fdatasync(self._fd)
        self.offset += len(out)
        self.next_seq = seq

    def size_on_disk(self) -> int:
        try:
            return os.stat(self._path_str).st_size
        except FileNotFoundError:
            return 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
