"""The token journal: group commit that loses nothing when its process dies.

With group commit ``sanitize`` returns before its tokens are in the catalog. So that
a crash cannot lose them, each call first copies its token rows (sealed values and
pseudonymous fields, never plaintext) into this process's journal, a file mapped
into memory (``MAP_SHARED``). Once ``sanitize`` returns, the rows are in the
operating system's page cache, which a dying process does not take with it: the
promise the embedded catalog's own commit makes (SQLite in WAL mode with
``synchronous=NORMAL`` writes, it does not fsync). A mapped copy costs no system
call; a ``write`` per call cost more than the rest of the journal here.

A journal is a series of segment files (1 MiB, or one record's size if larger). The
flush that takes the pending rows as its batch also detaches the current segment
(and any that filled up) under the same lock as the appends, so a segment holds
only rows of batches not stored yet; once its batch is in the catalog (or dropped
by the guard) it is zeroed and kept for later appends (two are enough to alternate),
and deleted when the vault closes.

Each segment is held with an exclusive ``flock`` by the process that writes it. A
segment nobody holds belongs to a process that died: ``orphans`` hands it to the
caller, who replays it (rows already stored are skipped, rows whose subject was
suppressed or erased since, or that expired, are dropped) and then ``retire``\\ s it.
A segment is created under a temporary name and renamed once locked, so a scan never
takes a segment that is being born for an orphan.

A record holds the rows of one call, framed as ``<length, crc32>``; the frame is
written after the record, so a record whose frame is still zero was never complete
and the segment ends there. A frame that fails its checksum followed by nothing but
zeros was being written when the process died (ignored); anywhere else, or a record
that does not parse, is corruption: ``read`` raises ``IntegrityError``.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import uuid
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from keyshred.errors import IntegrityError

__all__ = ["MAGIC", "Segment", "TokenJournal", "encode"]

MAGIC = b"KSTJ2\n"
_FRAME = struct.Struct("<II")  # payload length, crc32 of the payload
# A call's shared fields: epoch, created (us), expires (us), deterministic, row
# count, length of "subject_ref\0scope\0purpose"; then per row: number, token,
# lookup and value lengths, then those bytes. A row's kind is in its token.
_CALL = struct.Struct("<qqqBIH")
_ROW = struct.Struct("<qBBI")
_SUFFIX = ".journal"


def encode(epoch: int, rows: Sequence[Sequence[Any]]) -> bytes:
    """One record (unframed): the token rows of one call, in ``ks_tokens`` column
    order. The rows of a call share subject, scope, purpose, mode and times: the
    first row's are written once for all."""
    _, _, ref, scope, _, purpose, deterministic, _, created, expires, _ = rows[0]
    common = f"{ref}\0{scope}\0{purpose}".encode()
    parts = [_CALL.pack(epoch, created, expires, deterministic, len(rows), len(common)), common]
    pack = _ROW.pack
    for row in rows:
        token, lk, value = row[1], row[7] or b"", row[10]
        parts += (pack(row[0], len(token), len(lk), len(value)), token.encode(), lk, value)
    return b"".join(parts)


def _decode(payload: bytes, epochs_rows: list[tuple[int, tuple[Any, ...]]]) -> None:
    epoch, created, expires, det, count, n_common = _CALL.unpack_from(payload)
    at = _CALL.size
    ref, scope, purpose = payload[at : at + n_common].decode().split("\0")
    at += n_common
    for _ in range(count):
        number, n_token, n_lookup, n_value = _ROW.unpack_from(payload, at)
        at += _ROW.size
        token = payload[at : at + n_token].decode()
        at += n_token
        lookup = payload[at : at + n_lookup] if det else None
        at += n_lookup
        value = payload[at : at + n_value]
        at += n_value
        if len(value) != n_value or not token.startswith("<") or len(token) < 14:
            raise ValueError("truncated row")
        row = (
            number,
            token,
            ref,
            scope,
            token[1:-12],  # <KIND_0123456789>
            purpose,
            bool(det),
            lookup,
            created,
            expires,
            value,
        )
        epochs_rows.append((epoch, row))
    if at != len(payload):
        raise ValueError("trailing bytes")


class Segment:
    """One journal file, the descriptor that holds its lock and (for this process's
    own segments) its mapping and how much of it is used."""

    __slots__ = ("fd", "map", "path", "used")

    def __init__(self, path: Path, fd: int, mapping: mmap.mmap | None = None) -> None:
        self.path = path
        self.fd = fd
        self.map = mapping
        self.used = len(MAGIC)

    def __repr__(self) -> str:
        return f"Segment({self.path.name})"

    def read(self) -> list[tuple[int, tuple[Any, ...]]]:
        """Every complete record: ``(epoch, row)``. ``IntegrityError`` for a file that
        is not a journal, or a record that fails its checks."""
        with open(self.path, "rb") as f:  # a fresh description: the lock stays put
            data = f.read()
        if not data.startswith(MAGIC):
            raise IntegrityError("not a keyshred token journal")
        out: list[tuple[int, tuple[Any, ...]]] = []
        at, end = len(MAGIC), len(data)
        while at + _FRAME.size <= end:
            size, crc = _FRAME.unpack_from(data, at)
            if size == 0:
                break  # the end (a frame is written after its record)
            payload = data[at + _FRAME.size : at + _FRAME.size + size]
            if len(payload) != size or zlib.crc32(payload) != crc:
                if not data[at + _FRAME.size :].strip(b"\0") or len(payload) != size:
                    break  # being written when its process died
                raise IntegrityError("a token journal record failed its checksum")
            at += _FRAME.size + size
            try:
                _decode(payload, out)
            except (struct.error, ValueError):
                raise IntegrityError("a token journal record does not parse") from None
        return out


_SEGMENT_BYTES = 1 << 20


class TokenJournal:
    """This process's journal in ``directory`` (created 0700 on first use)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._current: Segment | None = None
        self._filled: list[Segment] = []  # full, rows not stored yet
        self._spare: list[Segment] = []  # zeroed, still locked, for the next appends

    def __repr__(self) -> str:
        return f"TokenJournal({self.directory.name!r})"

    def append(self, record: bytes) -> None:
        """Copy ``record`` (from ``encode``) into the current segment, then its
        frame. The caller serializes appends with ``detach``."""
        size = len(record)
        segment = self._current
        if segment is None or segment.used + _FRAME.size + size > len(segment.map):  # type: ignore[arg-type]
            segment = self._next(size)
        mapping = segment.map
        at = segment.used
        start = at + _FRAME.size
        mapping[start : start + size] = record  # type: ignore[index]
        mapping[at:start] = _FRAME.pack(size, zlib.crc32(record))  # type: ignore[index]
        segment.used = start + size

    def _next(self, size: int) -> Segment:
        if self._current is not None:
            self._filled.append(self._current)
        need = len(MAGIC) + _FRAME.size + size
        if self._spare and need <= len(self._spare[-1].map):  # type: ignore[arg-type]
            segment = self._spare.pop()
        else:
            segment = self._create(max(_SEGMENT_BYTES, need))
        self._current = segment
        return segment

    def detach(self) -> list[Segment]:
        """Take out the segments holding rows (the current one and any that filled
        up): their rows are the batch being taken (and earlier ones not stored
        yet). The next append starts a spare or a new segment."""
        segments = self._filled
        if self._current is not None:
            segments.append(self._current)
        self._current, self._filled = None, []
        return segments

    def release(self, segments: Sequence[Segment]) -> None:
        """This journal's segments whose rows are stored (or dropped): zeroed and
        kept as spares (two of the usual size at most; the others are deleted)."""
        for segment in segments:
            mapping = segment.map
            if mapping is not None and len(mapping) == _SEGMENT_BYTES and len(self._spare) < 2:
                # The first frame first: a process killed while zeroing the rest
                # leaves a segment that ends at once (empty), never one whose first
                # record is intact after zeros (which reads as corruption).
                start = len(MAGIC)
                mapping[start : start + _FRAME.size] = bytes(_FRAME.size)
                mapping[start : segment.used] = bytes(segment.used - start)
                segment.used = len(MAGIC)
                self._spare.append(segment)
            else:
                self.retire([segment])

    def close(self) -> None:
        """Delete the spares and an unused current segment (one with rows stays, for
        the next process to replay)."""
        self.retire(self._spare)
        self._spare = []
        current = self._current
        if current is not None and current.used <= len(MAGIC):
            self._current = None
            self.retire([current])

    def retire(self, segments: Sequence[Segment]) -> None:
        """Delete segments and release their locks (replayed orphans, spares)."""
        for segment in segments:
            with contextlib.suppress(FileNotFoundError):
                segment.path.unlink()
            if segment.map is not None:
                with contextlib.suppress(ValueError, BufferError):
                    segment.map.close()
            with contextlib.suppress(OSError):
                os.close(segment.fd)

    def forget(self, detached: Sequence[Segment] = ()) -> None:
        """In a forked child: the parent's segments (and ``detached``, those a flush
        of the parent had taken) are the parent's. The child closes its copies of
        their descriptors and mappings: a lock belongs to the open file description
        the two share, so a child that outlives its parent would otherwise keep the
        dead parent's segments locked, and no one could replay them while it lives
        (closing the child's copy leaves the parent's lock as it is)."""
        segments = [*self._filled, *self._spare, *detached]
        if self._current is not None:
            segments.append(self._current)
        for segment in segments:
            if segment.map is not None:
                with contextlib.suppress(ValueError, BufferError):
                    segment.map.close()
            with contextlib.suppress(OSError):
                os.close(segment.fd)
        self._current = None
        self._filled = []
        self._spare = []

    def orphans(self) -> Iterator[Segment]:
        """Segments (and half-born ones) of processes that are gone, each locked for
        the caller, who replays and then retires it (or closes ``fd`` to leave it)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return
        for name in names:
            if not (name.endswith(_SUFFIX) or name.endswith(".tmp")):
                continue
            path = self.directory / name
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # retired meanwhile
            except OSError:
                continue  # not ours to replay (permissions, a read-only folder): left
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue  # its process is alive (this one's own segments included)
            if name.endswith(".tmp") or not path.exists():
                # Never renamed (its process died while creating it: no rows yet), or
                # retired between the listing and the lock. (A creator that lost its
                # file to this between ``open`` and ``flock`` tries again.)
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                os.close(fd)
                continue
            yield Segment(path, fd)

    def _create(self, size: int) -> Segment:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        for _ in range(8):
            try:
                return self._try_create(size)
            except FileNotFoundError:
                continue  # a scan took the half-born file for a dead process's
        return self._try_create(size)

    def _try_create(self, size: int) -> Segment:
        name = uuid.uuid4().hex
        tmp = self.directory / f"{name}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            # Allocated now, not sparse: a copy into a mapped page the file system
            # cannot allocate would kill the process (SIGBUS) where a full disk
            # should be an error here, before any record depends on the segment.
            os.posix_fallocate(fd, 0, size)
            os.pwrite(fd, MAGIC, 0)
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            path = self.directory / f"{name}{_SUFFIX}"
            os.rename(tmp, path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        return Segment(path, fd, mapping)
