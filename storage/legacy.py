"""The partition layout of releases before issue #21, read once to be imported.

Those releases kept a subject's memories in a local folder
``<data>/memories/subject=<subject_ref>/``::

    MANIFEST                 {"gen": G, "segments": {scope: {"file", "rows", "key_id"}}}
    seg-g<G>-<n>.parquet     one PME-encrypted Parquet file per scope (the segment
                             format of today: same schema, same footer MAC)
    log-<G+1>.ksl            the append log: records not yet in a segment
    LOCK                     the writers' flock

and, after a crash, ``MANIFEST.tmp``, ``seg-*.tmp`` and files of an older generation
that the old release removed when it next opened the folder. No ``MANIFEST`` at all
is a partition never compacted: its log is ``log-00000001.ksl``.

This module reads that layout with the old reader's rules and nothing more (no
writes, no locks: the caller holds the subject lock) and removes its files;
``Partition`` (``keyshred.storage.partition``) decides when, and moves the rows into
the catalog through its own compaction.

Log framing (big-endian), each record sealed with the scope DEK and bound to
``(subject_ref, scope, "memlog", "<log number>:<sequence>", "record")``::

    u32 body length | u16 scope length | scope | u64 sequence | sealed payload

A record shorter than its length at the end of the file is a torn tail (a crash
mid-append, never acknowledged): the old release ignored it, and so does this.
Anything else malformed raises ``IntegrityError``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from keyshred.errors import IntegrityError, KeyNotFound, SubjectErased
from keyshred.keyring.envelope import Place
from keyshred.storage.sealer import Sealer

__all__ = ["LegacyFolder", "LegacySegment", "log_place"]

MANIFEST = "MANIFEST"
# Every name the old engine wrote in a partition folder (today's segments are
# ``seg-<32 hex>.parquet``: no "g" after the dash, so the two never match).
_NAMES = re.compile(r"(MANIFEST|MANIFEST\.tmp|LOCK|log-\d{8}\.ksl|seg-g\d{8}-\d{3}\.(parquet|tmp))")
_SEGMENT = re.compile(r"seg-g\d{8}-\d{3}\.parquet")
_LEN = struct.Struct(">I")
_SCOPE = struct.Struct(">H")
_SEQ = struct.Struct(">Q")
_MAX_RECORD = 64 * 1024 * 1024  # the old release's limit


def is_legacy_name(name: str) -> bool:
    """Whether a file name in a partition folder is one the old engine wrote."""
    return _NAMES.fullmatch(name) is not None


def log_place(subject_ref: str, scope: str, number: int, seq: int) -> Place:
    """The associated data of an old log record (the old ``AppendLog._place``)."""
    return Place(subject_ref, scope, "memlog", f"{number}:{seq}", "record")


@dataclass(frozen=True, slots=True)
class LegacySegment:
    scope: str
    path: Path
    key_id: bytes  # the scope DEK the old release sealed it under


class LegacyFolder:
    """One subject's folder of the old layout (it may not exist)."""

    def __init__(self, root: Path, subject_ref: str) -> None:
        self.root = root
        self.subject_ref = subject_ref

    def files(self) -> list[Path]:
        """The old layout's files present, sorted (an empty list: nothing to do)."""
        try:
            names = os.listdir(self.root)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(self.root / n for n in names if is_legacy_name(n))

    def holds_data(self) -> bool:
        """Whether there is a manifest or a log (else only locks and temporaries)."""
        return any(p.name == MANIFEST or p.suffix == ".ksl" for p in self.files())

    def manifest(self) -> tuple[int, list[LegacySegment]]:
        """The generation and the segments the manifest names (gen 0, none: no
        manifest yet). A manifest that does not parse, or names a file outside the
        folder or a key id that is no hex, is tampering."""
        path = self.root / MANIFEST
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return 0, []
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or not isinstance(doc.get("segments"), dict):
                raise ValueError
            gen = doc.get("gen", 0)
            if type(gen) is not int or gen < 0:
                raise ValueError
            out = []
            for scope, seg in sorted(doc["segments"].items()):
                name, key_id = seg["file"], seg["key_id"]
                if not isinstance(name, str) or not _SEGMENT.fullmatch(name):
                    raise ValueError
                if not isinstance(key_id, str) or not key_id:
                    raise ValueError
                out.append(LegacySegment(scope, self.root / name, bytes.fromhex(key_id)))
        except (ValueError, TypeError, KeyError):
            raise IntegrityError(
                f"the manifest of legacy partition {self.subject_ref} is corrupt"
            ) from None
        return gen, out

    def log(self, gen: int, sealer: Sealer) -> Iterator[tuple[str, bytes | None]]:
        """(scope, payload) of the complete records of the log after generation
        ``gen``, in order; ``(scope, None)`` for a record sealed under a destroyed
        key (erased: the old reader skipped it too). Stops at a torn tail."""
        number = gen + 1
        path = self.root / f"log-{number:08d}.ksl"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return
        pos, seq = 0, 0
        while pos + _LEN.size <= len(data):
            (n,) = _LEN.unpack_from(data, pos)
            if n > _MAX_RECORD or n < _SCOPE.size + _SEQ.size:
                raise IntegrityError(f"legacy log of partition {self.subject_ref} is corrupt")
            end = pos + _LEN.size + n
            if end > len(data):
                break  # torn tail: never acknowledged
            body = memoryview(data)[pos + _LEN.size : end]
            (slen,) = _SCOPE.unpack_from(body, 0)
            if _SCOPE.size + slen + _SEQ.size > n:
                raise IntegrityError(f"legacy log of partition {self.subject_ref} is corrupt")
            try:
                scope = bytes(body[_SCOPE.size : _SCOPE.size + slen]).decode("utf-8")
            except UnicodeDecodeError:
                raise IntegrityError(
                    f"legacy log of partition {self.subject_ref} is corrupt"
                ) from None
            (rseq,) = _SEQ.unpack_from(body, _SCOPE.size + slen)
            if rseq != seq:
                raise IntegrityError(
                    f"legacy log of partition {self.subject_ref} is out of sequence"
                )
            payload = bytes(body[_SCOPE.size + slen + _SEQ.size :])
            try:
                opened: bytes | None = sealer.open(
                    payload, log_place(self.subject_ref, scope, number, rseq)
                )
            except SubjectErased:
                opened = None
            except KeyNotFound:
                # A key id no key store ever held: the header was altered.
                raise IntegrityError(
                    f"legacy log of partition {self.subject_ref} names an unknown key"
                ) from None
            yield scope, opened
            pos, seq = end, seq + 1

    def remove(self, *, after_first: Callable[[], None] | None = None) -> int:
        """Delete the old layout's files (the lock file last) and the folder if
        nothing else is left in it; returns how many files there were."""
        files = sorted(self.files(), key=lambda p: p.name == "LOCK")
        for i, path in enumerate(files):
            path.unlink(missing_ok=True)
            if i == 0 and after_first is not None:
                after_first()
        if files:
            _fsync_dir(self.root)
        with contextlib.suppress(OSError):
            self.root.rmdir()  # only if empty: today's segments may live here too
        return len(files)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
