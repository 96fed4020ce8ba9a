"""The residue check: ``keyshred verify residue`` and ``ks.erasure.residue_scan``.

After an erasure, "the keys are destroyed" is a claim; this module checks it the way
an auditor would. It walks every file under the given folders (a data folder, a
backup generation or a whole local backup target, an export) and looks for probe
strings (a phone number, an e-mail, a name) in two layers:

1. **raw**: the bytes of every file, in every form a program may have written the
   probe: UTF-8, UTF-16 (LE and BE), hex (lower and upper case), base64 (standard
   and URL-safe) at each of the three byte alignments (the characters that depend
   on neighbouring bytes are trimmed) and JSON-escaped (as is, and
   ``\\uXXXX``-escaped for non-ASCII text).
   Encryption working means no raw hit anywhere.
2. **decrypted**: everything the *live* keyring can still open, decoded with the
   stores' own readers (``keyshred.storage.partition`` for Parquet segments and
   the catalog's hot rows, each record on its own, rows sealed under owner-set keys
   opened as the partition opens them; ``keyshred.storage.vectors`` for the
   catalog's vector rows and for LanceDB datasets of the layout before revision
   0013, every version), the catalog's sealed columns (memory hot rows, vectors, tokens,
   threads, checkpoints and their writes, in any SQLite catalog found under the
   folders and in the live catalog when the data folder is scanned), the vault's
   token journals, and backup
   generations: each object is mapped back to what it is through the generation's
   manifest and decoded like the original. A generation's own sealed key store is
   never opened: only keys the live keyring can unwrap count. A ciphertext whose key
   was destroyed counts as undecryptable, which is what an erasure should leave
   behind. An export package needs its recipient's secret: only whether its subject
   key still exists is reported.

Object stores are scanned too (issue 21): when the data folder is among the paths,
every S3 prefix it uses (``storage.uri``, ``vectors.uri``, and every S3 backup target
it has written to: ``backup.target`` and the targets remembered in
``keyshred.backup.generations.TARGETS_FILE``), and any ``s3://bucket/prefix`` given
as a path (reached through the ``[s3]`` section, credentials from the AWS chain).
Every object *and every noncurrent version* is read: on a versioned bucket a deleted
object's earlier versions stay retrievable, which is exactly what an attacker with
the bucket would find. Each object's newest version with content is laid out under
its key in a private temporary folder (mode 0700, removed when the prefix is done)
and that folder is scanned like a local one (so segments, LanceDB datasets with
every version their manifests name, and backup generations through their manifests
decode as they do from files); each older version is then downloaded on its own,
scanned raw and decoded by what its key says it is, and deleted. Hits name the
object key relative to the prefix and its version id; PostgreSQL pages are not
objects or files and stay out of reach (its live catalog's sealed columns are read).

Nothing under the scanned folders is written (SQLite files are opened immutable or
read-only beside their writer, LanceDB datasets read by version, files read in
chunks, never mapped); nothing is written to a bucket.

The report holds counts, paths relative to the scanned root (object keys relative
to the prefix, with version ids), kinds, encodings and probe *indexes*: never a
probe, never plaintext (a path that itself holds a probe is replaced by a digest).
Nothing here logs.

Why one module of ~1,250 lines: the scan is one procedure an auditor reads top to
bottom: the probe encodings, then one walk over every kind of file keyshred writes
(SQLite pages and WAL, Parquet, Lance fragments, logs, backup archives, exports), on
a disk or fetched from a bucket, all sharing one needle set and one report.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import sqlite3
import stat
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import pyarrow as pa
import pyarrow.parquet as pq
import sqlalchemy as sa

from keyshred import db
from keyshred._extras import require
from keyshred.backup.generations import TARGETS_FILE
from keyshred.errors import (
    BackendUnavailable,
    ConfigError,
    IntegrityError,
    InvalidInput,
    KekEpochDestroyed,
    KeyNotFound,
    NotFound,
    SubjectErased,
)
from keyshred.keyring import _primitives as prim
from keyshred.keyring.envelope import Place, key_id_of
from keyshred.keyring.keyring import Keyring
from keyshred.keyring.package import read_header
from keyshred.storage.checkpoints import checkpoint_records, thread_scope, write_records
from keyshred.storage.hot import HotTier
from keyshred.storage.objects import ObjectStore
from keyshred.storage.partition import MemoryRow, Partition, decode_record, hot_place
from keyshred.storage.pme import PmeCrypto
from keyshred.storage.s3 import split_s3_uri
from keyshred.storage.schema import (
    checkpoint_writes,
    checkpoints,
    memory_hot,
    memory_vectors,
    threads,
)
from keyshred.storage.sealer import KeyringSealer
from keyshred.storage.subject_lock import SubjectLocks
from keyshred.storage.vectors import VEC_SCHEMA, VectorIndex
from keyshred.vault.journal import MAGIC as _JOURNAL_MAGIC
from keyshred.vault.journal import Segment as JournalSegment
from keyshred.vault.rows import place_template as token_place
from keyshred.vault.schema import tokens

if TYPE_CHECKING:
    from keyshred.config import Config
    from keyshred.storage.catalog import Catalog

__all__ = ["DataFolder", "ResidueHit", "ResidueReport", "probe_forms", "residue_scan"]


class DataFolder(Protocol):
    """What the scan needs of an open data folder (an open ``Keyshred`` is one):
    where it is, the keyring that decrypts, the catalog it checks, and its
    configuration (where its object stores are)."""

    @property
    def path(self) -> Path: ...
    @property
    def config(self) -> Config: ...
    @property
    def keyring(self) -> Keyring: ...
    @property
    def catalog(self) -> Catalog: ...


# Kinds of what was found or decoded (report keys; no personal data).
SEGMENT = "memory_segment"
LOG = "memory_log_record"  # a hot record of a partition, in a catalog
MEMORY_ROW = "memory_row"  # rows of segments and hot records
VECTOR = "vector"
VECTOR_DATASET = "vector_dataset"
TOKEN = "token"  # noqa: S105 - a kind's name, not a secret
TOKEN_JOURNAL = "token_journal"  # noqa: S105 - held tokens of group commit
THREAD = "thread"
CHECKPOINT = "checkpoint"
CHECKPOINT_WRITE = "checkpoint_write"
DATABASE = "database"
BACKUP_MANIFEST = "backup_manifest"
BACKUP_KEYSTORE = "backup_keystore"
BACKUP_OBJECT = "backup_object"
EXPORT = "export"
FILE = "file"
FILE_NAME = "file_name"
FOLDER = "folder"  # a folder the walk could not list (counted as unreadable)
OBJECT_STORE = "object_store"  # an S3 prefix that could not be listed (unreadable)
RAW = "raw"
DECRYPTED = "decrypted"
LIVE_CATALOG = "<live catalog>"

_MIN_PROBE_CHARS = 3
_CHUNK = 8 << 20
_MIN_NEEDLE_BYTES = 4  # shorter encoded forms (a trimmed base64 piece) match noise
_SQLITE_MAGIC = b"SQLite format 3\x00"
_SEGMENT_NAME = re.compile(r"seg-[0-9a-f]{32}\.parquet")
_SUBJECT_DIR = "subject="
_ERASED = (SubjectErased, KekEpochDestroyed)
# What a file that does not decode raises: ours (already typed) and the readers'
# own (pyarrow, LanceDB, SQLite through SQLAlchemy, JSON).
_UNREADABLE = (
    IntegrityError,
    KeyNotFound,
    OSError,
    ValueError,
    RuntimeError,
    KeyError,
    TypeError,
    sa.exc.SQLAlchemyError,
)


# -- probes ------------------------------------------------------------------------


def _base64_pieces(data: bytes) -> list[bytes]:
    """The base64 of ``data`` at byte offsets 0, 1 and 2 of a longer stream: the
    characters that also depend on the bytes before or after are trimmed."""
    pieces = []
    for shift in range(3):
        encoded = base64.b64encode(b"\x00" * shift + data).rstrip(b"=")
        start = -(-8 * shift // 6)  # characters holding a bit of the bytes before
        end = 8 * (shift + len(data)) // 6  # the last character made only of ours
        pieces.append(encoded[start:end])
    return pieces


def probe_forms(probe: str) -> list[tuple[str, bytes]]:
    """Every (encoding name, bytes) a probe is searched as; identical byte strings
    are kept once, under the first name, and forms too short to mean anything are
    left out."""
    raw = probe.encode("utf-8")
    forms: list[tuple[str, bytes]] = [
        ("utf-8", raw),
        ("utf-16-le", probe.encode("utf-16-le")),
        ("utf-16-be", probe.encode("utf-16-be")),
        ("hex", raw.hex().encode("ascii")),
        ("hex-upper", raw.hex().upper().encode("ascii")),
    ]
    pieces = _base64_pieces(raw)
    forms += [(f"base64-{shift}", piece) for shift, piece in enumerate(pieces)]
    # The URL-safe alphabet (JWTs, URLs) differs only in '+' and '/'.
    urlsafe = bytes.maketrans(b"+/", b"-_")
    forms += [(f"base64url-{k}", piece.translate(urlsafe)) for k, piece in enumerate(pieces)]
    escaped = json.dumps(probe, ensure_ascii=True)[1:-1]
    forms += [
        ("json", json.dumps(probe, ensure_ascii=False)[1:-1].encode("utf-8")),
        ("json-ascii", escaped.encode("ascii")),
        # Other serializers write \u00E9 where Python writes \u00e9.
        (
            "json-ascii-upper",
            re.sub(r"\\u([0-9a-f]{4})", lambda m: "\\u" + m.group(1).upper(), escaped).encode(),
        ),
    ]
    out: list[tuple[str, bytes]] = []
    seen: set[bytes] = set()
    for name, needle in forms:
        if len(needle) >= _MIN_NEEDLE_BYTES and needle not in seen:
            seen.add(needle)
            out.append((name, needle))
    return out


class _Needles:
    """Every encoded form of every probe; ``find`` says which occur in a buffer."""

    def __init__(self, probes: Sequence[str]) -> None:
        self.items = [
            (index, name, needle)
            for index, probe in enumerate(probes)
            for name, needle in probe_forms(probe)
        ]

        self._overlap = max((len(n) for _, _, n in self.items), default=1) - 1

    def find(self, data: bytes) -> list[tuple[str, int]]:
        return [(name, index) for index, name, needle in self.items if needle in data]

    def find_in(self, fd: int) -> tuple[list[tuple[str, int]], int]:
        """``find`` over a file read in chunks (a mapping would die of SIGBUS if a
        live file, a SQLite WAL say, were truncated under it); returns the forms
        found and the bytes read."""
        found: dict[tuple[str, int], None] = {}
        tail = b""
        size = 0
        while chunk := os.read(fd, _CHUNK):
            size += len(chunk)
            buf = tail + chunk
            found.update(dict.fromkeys(self.find(buf)))
            tail = buf[len(buf) - self._overlap :] if self._overlap else b""
        return list(found), size


def _check_probes(probes: Any) -> list[str]:
    if isinstance(probes, str) or not isinstance(probes, Iterable):
        raise InvalidInput("probes is a list of strings")
    out = list(probes)
    if not out:
        raise InvalidInput("give at least one probe")
    for probe in out:
        if not isinstance(probe, str) or len(probe.strip()) < _MIN_PROBE_CHARS:
            # Never echo the probe: it is the personal data being looked for.
            raise InvalidInput(f"a probe is text of at least {_MIN_PROBE_CHARS} characters")
        try:
            probe.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidInput("a probe is valid Unicode text") from None
    return out


def _check_paths(paths: Any) -> list[Path | str]:
    """Folders and files as ``Path``; S3 prefixes (a ``str`` ``s3://bucket/prefix``:
    a ``Path`` would fold its ``//``) as their normalized URL."""
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    if not isinstance(paths, Iterable):
        raise InvalidInput("paths is a list of folders or files")
    out: list[Path | str] = []
    for p in paths:
        # bytes paths are refused too: the report names paths as text.
        if not isinstance(p, str | os.PathLike) or isinstance(os.fspath(p), bytes):
            raise InvalidInput("paths is a list of folders or files (str or Path)")
        if isinstance(p, str) and p.startswith("s3://"):
            try:
                bucket, prefix = split_s3_uri(p)
            except ConfigError:
                raise InvalidInput("an S3 location to scan is s3://bucket/prefix") from None
            out.append(_s3_url(bucket, prefix))
            continue
        out.append(Path(p))
    if not out:
        raise InvalidInput("give at least one folder or file to scan")
    for p in out:
        if isinstance(p, str):
            continue  # reached when scanned (a bucket that does not exist: InvalidInput)
        try:
            # A NUL, a lone surrogate or a name too long is no file, not a crash.
            os.stat(p)
        except FileNotFoundError:
            raise InvalidInput(f"{p!s} does not exist") from None
        except (OSError, ValueError):
            raise InvalidInput("a path to scan cannot be opened (not a valid file name?)") from None
    return out


# -- the report --------------------------------------------------------------------


@dataclass(frozen=True, slots=True, order=True)
class ResidueHit:
    """One probe found: where (``root`` indexes ``ResidueReport.roots``; ``path`` is
    relative to it: in an S3 root, the object key relative to the prefix, and
    ``version`` its version id), in what (``kind``), in which layer (``raw`` bytes or
    ``decrypted`` plaintext), in which encoding, and which probe (its index)."""

    root: int
    path: str
    kind: str
    layer: str
    encoding: str
    probe: int
    version: str = ""  # an object version id ("null" on an unversioned bucket)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "root": self.root,
            "path": self.path,
            "kind": self.kind,
            "layer": self.layer,
            "encoding": self.encoding,
            "probe": self.probe,
        }
        if self.version:
            out["version"] = self.version
        return out


@dataclass
class ResidueReport:
    """What a residue scan did and found (counts and places only: no probe, no
    plaintext). ``undecryptable`` counts ciphertexts whose key was destroyed (what
    an erasure leaves); ``unreadable`` those no live key is known for or that failed
    to decode; ``locked`` export packages whose key is live but that also need the
    recipient's secret. ``objects_scanned`` counts object versions read from S3
    (``bytes_scanned`` counts files' and objects' bytes); ``object_stores`` says, for
    each S3 prefix scanned (a root), why it was, what it held and every (key,
    version) read."""

    roots: list[str]
    probes: int
    files_scanned: int = 0
    objects_scanned: int = 0
    bytes_scanned: int = 0
    generations: int = 0  # backup generations read through their manifests
    decrypted: dict[str, int] = field(default_factory=dict)
    undecryptable: dict[str, int] = field(default_factory=dict)
    unreadable: dict[str, int] = field(default_factory=dict)
    locked: dict[str, int] = field(default_factory=dict)
    hits: list[ResidueHit] = field(default_factory=list)
    object_stores: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return not self.hits

    def as_dict(self) -> dict[str, Any]:
        return {
            "clean": self.clean,
            "roots": list(self.roots),
            "probes": self.probes,
            "files_scanned": self.files_scanned,
            "objects_scanned": self.objects_scanned,
            "bytes_scanned": self.bytes_scanned,
            "generations": self.generations,
            "decrypted": dict(sorted(self.decrypted.items())),
            "undecryptable": dict(sorted(self.undecryptable.items())),
            "unreadable": dict(sorted(self.unreadable.items())),
            "locked": dict(sorted(self.locked.items())),
            "hits": [h.as_dict() for h in self.hits],
            "object_stores": [dict(store) for store in self.object_stores],
            "seconds": round(self.seconds, 3),
        }

    def __repr__(self) -> str:
        return (
            f"ResidueReport(files_scanned={self.files_scanned}, "
            f"objects_scanned={self.objects_scanned}, hits={len(self.hits)}, "
            f"decrypted={sum(self.decrypted.values())}, "
            f"undecryptable={sum(self.undecryptable.values())})"
        )


# -- the scan ----------------------------------------------------------------------


def residue_scan(
    ks: DataFolder, probes: Sequence[str], paths: Sequence[str | os.PathLike[str]]
) -> ResidueReport:
    """Scan ``paths`` for ``probes`` (raw bytes, and everything the live keyring of
    ``ks`` can decrypt); see the module docstring."""
    checked = _check_probes(probes)
    roots = _check_paths(paths)
    s3 = ks.config.s3
    given = {
        url: _S3Place.of(url, "path", s3.endpoint_url, s3.region, s3.addressing_style)
        for url in roots
        if isinstance(url, str)
    }
    # A bucket given to scan that does not exist is a wrong argument, like a missing
    # folder: refused before any work.
    for place in given.values():
        reader = _S3Reader(place)
        try:
            reader.check()
        finally:
            reader.close()
    report = ResidueReport(roots=[str(r) for r in roots], probes=len(checked))
    # The data folder's own object stores, when the data folder is scanned (as its
    # live catalog is): the S3 prefixes it writes and every S3 backup target.
    auto: list[_S3Place] = []
    if any(isinstance(r, Path) and r.is_dir() and _inside(ks.path, r) for r in roots):
        found, bad = _folder_places(ks)
        auto = _uncovered(found, list(given.values()))
        if bad:
            report.unreadable[OBJECT_STORE] = bad
    report.roots += [place.url for place in auto]
    started = time.monotonic()
    scanner = _Scanner(ks, _Needles(checked), report)
    try:
        for index, root in enumerate(roots):
            if isinstance(root, str):
                scanner.scan_s3(index, given[root])
            else:
                scanner.scan_root(index, root)
        for index, place in enumerate(auto, start=len(roots)):
            scanner.scan_s3(index, place)
    finally:
        scanner.close()
    # A folder given to scan may itself be named after a probe.
    report.roots = [scanner.safe_path(r) for r in report.roots]
    report.seconds = time.monotonic() - started
    return report


def _inside(path: Path, root: Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())


@dataclass(frozen=True, slots=True)
class _Object:
    """A backup object as its generation manifest names it."""

    kind: str
    subject_ref: str
    rel: str  # its path in a data folder (memories/subject=…/seg-….parquet)


class _Root:
    """The state of one scanned root: where hits are reported relative to, and what
    was already decoded (a content-addressed object shared by generations is
    decoded once).

    A root of objects fetched from S3 (``remote``) is a private folder of local
    copies; ``names`` maps a copy's relative path to the object key and version it
    is reported as (a copy laid out under its key needs no entry but its version)."""

    def __init__(
        self,
        index: int,
        path: Path,
        *,
        remote: bool = False,
        names: dict[str, tuple[str, str]] | None = None,
    ) -> None:
        self.index = index
        self.path = path
        self.base = path if path.is_dir() else path.parent
        self.raw_done: set[Path] = set()
        self.decoded: set[Path] = set()
        self.remote = remote
        self._names = names or {}
        self._versions = {key: version for key, version in self._names.values()}

    def rel(self, path: Path) -> str:
        rel = os.path.relpath(path, self.base)
        return self._names.get(rel, (rel, ""))[0]

    def version(self, label: str) -> str:
        """The version id of the object ``label`` names ("" for a file, or for a
        LanceDB dataset: it is made of many objects, each listed in the report)."""
        return self._versions.get(label, "")


class _Scanner:
    def __init__(self, ks: DataFolder, needles: _Needles, report: ResidueReport) -> None:
        self._ks = ks
        self._keyring: Keyring = ks.keyring
        self._needles = needles
        self._report = report
        self._sealer = KeyringSealer(self._keyring)
        self._pme = PmeCrypto(self._keyring)  # our own: its key cache is forgotten at close
        self._vectors = VectorIndex("", self._keyring)  # its reader only; never connects
        self._hits: set[ResidueHit] = set()
        self._hot_tier: HotTier | None = None
        self._name_key = prim.random_bytes(32)

    def close(self) -> None:
        self._pme.forget()
        self._report.hits = sorted(self._hits)

    # -- bookkeeping -------------------------------------------------------------------

    def _count(self, which: dict[str, int], kind: str, n: int = 1) -> None:
        if n:
            which[kind] = which.get(kind, 0) + n

    def safe_path(self, rel: str) -> str:
        """A path as reported: one that holds a probe is replaced by a keyed digest
        (a key of this scan only: no one can test guesses against it, and two hits
        in one file still name the same place)."""
        raw = rel.encode("utf-8", "surrogateescape")
        if self._needles.find(raw):
            return "<redacted " + prim.hmac_sha256(self._name_key, raw).hex()[:16] + ">"
        return rel

    def _hit(
        self, root: _Root, label: str, kind: str, layer: str, found: list[tuple[str, int]]
    ) -> None:
        version = root.version(label)
        for encoding, probe in found:
            self._hits.add(
                ResidueHit(root.index, self.safe_path(label), kind, layer, encoding, probe, version)
            )

    def _search_plain(self, root: _Root, label: str, kind: str, plain: bytes) -> None:
        self._hit(root, label, kind, DECRYPTED, self._needles.find(plain))

    # -- walking -----------------------------------------------------------------------

    def scan_root(self, index: int, path: Path) -> None:
        root = _Root(index, path)
        # A folder that cannot be listed is counted, never skipped in silence: a scan
        # that read less than it was given must say so.
        failed: list[OSError] = []
        files = [path] if path.is_file() else sorted(_walk(path, failed.append))
        self._count(self._report.unreadable, FOLDER, len(failed))
        self._scan_files(root, files)
        self._live_catalog(root)

    def _scan_files(self, root: _Root, files: list[Path]) -> None:
        """Raw-search every file, then decode each by what it is (backup objects
        through their generation's manifest)."""
        generations = self._generations(files)
        objects = self._objects(generations)
        kinds: dict[Path, str] = {}
        for file in files:
            obj = objects.get(file.resolve())
            kind = obj.kind if obj else _kind_of(file)
            self._raw(root, file, kind)
            if obj is None:  # backup objects are decoded through their manifest
                kinds[file] = kind
        for file, kind in kinds.items():
            self._decode(root, file, kind)
        self._decode_backups(root, generations, objects)

    def _raw(self, root: _Root, file: Path, kind: str) -> None:
        real = file.resolve()
        if real in root.raw_done:
            return
        root.raw_done.add(real)
        rel = root.rel(file)
        name_hits = self._needles.find(rel.encode("utf-8", "surrogateescape"))
        self._hit(root, rel, FILE_NAME, RAW, name_hits)
        try:
            # O_NONBLOCK: a file given by name that is a FIFO does not wait for a writer.
            fd = os.open(
                file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
            )
        except OSError:
            self._count(self._report.unreadable, kind)
            return
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return
            found, size = self._needles.find_in(fd)
        except OSError:
            self._count(self._report.unreadable, kind)
            return
        finally:
            os.close(fd)
        if root.remote:
            self._report.objects_scanned += 1
        else:
            self._report.files_scanned += 1
        self._report.bytes_scanned += size
        self._hit(root, rel, kind, RAW, found)

    def _decode(self, root: _Root, file: Path, kind: str) -> None:
        """Decode a file found in the walk by what its name, place and first bytes
        say it is."""
        parent = file.parent.name
        if kind == SEGMENT:
            self._segment(root, file, parent.removeprefix(_SUBJECT_DIR), root.rel(file))
        elif kind == VECTOR_DATASET:
            if parent == "_versions" and file.parent.parent.name.endswith(".lance"):
                dataset = file.parent.parent
                if dataset not in root.decoded:
                    root.decoded.add(dataset)
                    ref = dataset.name.removesuffix(".lance")
                    self._dataset(root, dataset, ref, root.rel(dataset))
        elif kind == DATABASE:
            self._sqlite(root, file)
        elif kind == TOKEN_JOURNAL:
            self._token_journal(root, file)
        elif kind == EXPORT:
            self._export(file)

    # -- object stores -----------------------------------------------------------------

    def scan_s3(self, index: int, place: _S3Place) -> None:
        """Every object and every noncurrent version under an S3 prefix: each
        object's newest version with content laid out under its key in a private
        folder and scanned like a local folder, then each older version (and an
        object whose key cannot be a path there) on its own. Nothing stays on disk
        after this returns; nothing is written to the bucket."""
        summary: dict[str, Any] = {
            "root": index,
            "url": self.safe_path(place.url),
            "role": place.role,
            "listed": False,  # whether the prefix could be listed (else: unreadable)
            "objects": 0,
            "noncurrent": 0,
            "delete_markers": 0,
            "bytes": 0,
            "versions": [],
        }
        self._report.object_stores.append(summary)
        try:
            reader = _S3Reader(place)
        except BackendUnavailable:
            self._count(self._report.unreadable, OBJECT_STORE)
            return
        try:
            try:
                listing, markers = reader.listing()
            except (BackendUnavailable, NotFound):
                # Counted, never skipped in silence: the scan read less than it was
                # given (the report says which prefix).
                self._count(self._report.unreadable, OBJECT_STORE)
                return
            summary["listed"] = True
            summary["delete_markers"] = markers
            summary["objects"] = sum(1 for v in listing if v.current)
            summary["noncurrent"] = sum(1 for v in listing if not v.current)
            summary["bytes"] = sum(v.size for v in listing)
            summary["versions"] = [
                {"key": self.safe_path(v.key), "version": v.version, "current": v.current}
                for v in listing
            ]
            # tempfile's folders are created mode 0700; removed even if a reader fails.
            with tempfile.TemporaryDirectory(prefix="keyshred-residue-") as tmp:
                self._scan_listing(index, reader, listing, Path(tmp))
        finally:
            reader.close()

    def _scan_listing(
        self, index: int, reader: _S3Reader, listing: list[_Version], tmp: Path
    ) -> None:
        layout = tmp / "objects"
        layout.mkdir(mode=0o700)
        newest: dict[str, _Version] = {}
        later: list[_Version] = []
        for v in listing:  # newest first within a key
            if v.key in newest:
                later.append(v)
            else:
                newest[v.key] = v
        names: dict[str, tuple[str, str]] = {}
        for key, v in sorted(newest.items()):
            dest = _local_path(layout, key)
            if dest is None:  # a key that is no path here ("a" and "a/b"; "..")
                later.append(v)
                continue
            if self._fetch(reader, v, dest):
                names[key] = (key, v.version)
        root = _Root(index, layout, remote=True, names=names)
        self._scan_files(root, [layout / rel for rel in sorted(names)])
        # One layout at a time on disk: the copies go before older versions come.
        shutil.rmtree(layout)
        for v in later:
            self._scan_version(index, reader, v, tmp / "version")

    def _scan_version(self, index: int, reader: _S3Reader, v: _Version, folder: Path) -> None:
        """One object version on its own: searched raw, and decoded when it is
        complete in itself (a segment, a SQLite catalog, a token journal, an
        export); a LanceDB file's older version is only searched raw (a dataset is
        read through its manifests, from the layout)."""
        folder.mkdir(mode=0o700)
        try:
            dest = _local_path(folder, v.key) or folder / "object"
            rel = os.path.relpath(dest, folder)
            if not self._fetch(reader, v, dest):
                return
            root = _Root(index, folder, remote=True, names={rel: (v.key, v.version)})
            kind = _kind_of(dest)
            self._raw(root, dest, kind)
            if kind in (SEGMENT, DATABASE, TOKEN_JOURNAL, EXPORT):
                self._decode(root, dest, kind)
        finally:
            shutil.rmtree(folder)

    def _fetch(self, reader: _S3Reader, v: _Version, dest: Path) -> bool:
        """Download one version to ``dest`` (mode 0600); a version that cannot be
        read (gone meanwhile, refused) is counted as unreadable."""
        try:
            reader.download(v, dest)
        except (BackendUnavailable, NotFound, OSError):
            dest.unlink(missing_ok=True)
            self._count(self._report.unreadable, _kind_of(dest))
            return False
        return True

    # -- memory partitions -------------------------------------------------------------

    def _partition(self, folder: Path, ref: str) -> Partition:
        # The store's own partition object and reader: how rows are sealed is
        # decided there (and inherited here), never re-implemented. It reads the
        # files it is given; nothing here takes its lock or writes.
        catalog = self._ks.catalog
        if self._hot_tier is None:
            self._hot_tier = HotTier(catalog)
        return Partition(
            ObjectStore.folder(folder),
            ref,
            self._keyring,
            self._sealer,
            self._pme,
            hot=self._hot_tier,
            locks=SubjectLocks(catalog.engine),
        )

    def _segment(self, root: _Root, file: Path, ref: str, label: str) -> None:
        part = self._partition(file.parent, ref)
        try:
            scope = self._segment_scope(file)
            rows = part._read_segment(file.name, scope, path=str(file))
        except _ERASED:
            self._count(self._report.undecryptable, SEGMENT)
            return
        except _UNREADABLE:
            self._count(self._report.unreadable, SEGMENT)
            return
        self._count(self._report.decrypted, SEGMENT)
        self._search_plain(root, label, SEGMENT, self._rows_plain(rows))

    def _rows_plain(self, rows: Sequence[MemoryRow]) -> bytes:
        """Every readable row's names and value, one buffer to search; rows sealed
        under a destroyed owner-set key (opaque) count as undecryptable."""
        parts: list[bytes] = []
        for row in rows:
            if row.opaque:
                self._count(self._report.undecryptable, MEMORY_ROW)
                continue
            self._count(self._report.decrypted, MEMORY_ROW)
            parts += [*(p.encode("utf-8") for p in row.namespace), row.key.encode(), row.value]
        return b"\x00".join(parts)

    def _segment_scope(self, file: Path) -> str:
        """The segment's scope, from its plaintext column. The footer is signed with
        the segment's key, so a destroyed key already raises here."""
        table = pq.ParquetFile(file, decryption_properties=self._pme.decryption()).read(
            columns=["scope"]
        )
        scopes = set(table.column("scope").to_pylist())
        if len(scopes) != 1:
            raise IntegrityError()
        return str(scopes.pop())

    # -- vectors -----------------------------------------------------------------------

    def _dataset(self, root: _Root, dataset: Path, ref: str, label: str) -> None:
        """Every version of a LanceDB dataset: its sealed vectors (each distinct
        ciphertext once) decrypted by the vector store's reader, its plaintext
        columns searched as well."""
        try:
            import lancedb  # slow to import: only when a dataset is found

            table = lancedb.connect(str(dataset.parent)).open_table(
                dataset.name.removesuffix(".lance")
            )
            versions = [int(v["version"]) for v in table.list_versions()]
        except _UNREADABLE:
            self._count(self._report.unreadable, VECTOR_DATASET)
            return
        seen: dict[bytes, tuple[str, str, str, str]] = {}
        for version in versions:
            try:
                table.checkout(version)
                arrow = table.to_arrow()
            except _UNREADABLE:
                self._count(self._report.unreadable, VECTOR_DATASET)
                continue
            cols = [
                arrow.column(n).to_pylist()
                for n in ("vec", "vec_id", "scope", "memory_id", "field")
            ]
            for vec, vec_id, scope, memory_id, fld in zip(*cols, strict=True):
                if vec is not None and vec not in seen:
                    seen[vec] = (vec_id, scope, memory_id, fld)
        self._sealed_vectors(root, label, ref, seen)

    def _sealed_vectors(
        self, root: _Root, label: str, ref: str, seen: dict[bytes, tuple[str, str, str, str]]
    ) -> None:
        """One subject's sealed vectors (a legacy dataset's, or the catalog's rows):
        plaintext columns searched, each key's vectors decrypted by the store's
        reader."""
        plain_meta = b"\x00".join(
            "\x00".join(map(str, meta)).encode("utf-8") for meta in seen.values()
        )
        self._search_plain(root, label, VECTOR, plain_meta)
        by_key: dict[bytes, list[bytes]] = defaultdict(list)
        for vec in seen:
            try:
                by_key[key_id_of(vec)].append(vec)
            except IntegrityError:
                self._count(self._report.unreadable, VECTOR)
        for group in by_key.values():
            self._vectors_of_key(root, label, ref, group, seen)

    def _vectors_of_key(
        self,
        root: _Root,
        label: str,
        ref: str,
        group: list[bytes],
        meta: dict[bytes, tuple[str, str, str, str]],
    ) -> None:
        rows = [meta[v] for v in group]
        table = pa.table(
            {
                "vec_id": [r[0] for r in rows],
                "memory_id": [r[2] for r in rows],
                "scope": [r[1] for r in rows],
                "field": [r[3] for r in rows],
                "updated_us": [0] * len(rows),
                "vec": group,
            },
            schema=VEC_SCHEMA,
        )
        try:
            # The store's own bulk reader: its places, its owner checks. A key that
            # was destroyed raises, or (where the vector store keeps such rows as
            # unreadable) leaves its rows out of what comes back.
            # One matrix per embedding space: spaces of different widths share a
            # key group (a LangGraph store's own embedder beside the handle's).
            spaces = self._vectors._open_spaces(ref, table)
        except _ERASED:
            self._count(self._report.undecryptable, VECTOR, len(group))
            return
        except _UNREADABLE:
            self._count(self._report.unreadable, VECTOR, len(group))
            return
        opened = sum(len(c.vec_ids) for c in spaces.values())
        self._count(self._report.decrypted, VECTOR, opened)
        self._count(self._report.undecryptable, VECTOR, len(group) - opened)
        for cached in spaces.values():
            self._search_plain(root, label, VECTOR, bytes(cached.matrix.tobytes()))

    # -- catalogs ----------------------------------------------------------------------

    def _sqlite(self, root: _Root, file: Path) -> None:
        """A SQLite database found in the walk: if it is a keyshred catalog (the live
        one, a backup generation's, a restored one), decrypt its sealed columns.

        Nothing is written next to it (opening a WAL database even read-only creates
        its ``-shm`` and ``-wal`` files) and a key store is never copied (that would
        be one more copy of its wrapped keys): the tables are listed from the file as
        it is; a catalog with no pending WAL is read as it is too, one whose WAL is in
        use read-only beside its writer, and one with a WAL but no shared-memory file
        from a private copy (its sealed columns are ciphertext)."""
        real = file.resolve()
        if real in root.decoded:
            return
        root.decoded.add(real)
        wal, shm = Path(f"{real}-wal"), Path(f"{real}-shm")
        catalog_tables = {tokens.name, threads.name, checkpoints.name}
        try:
            with contextlib.ExitStack() as stack:
                if not wal.is_file() or wal.stat().st_size == 0:
                    uri = f"{real.as_uri()}?immutable=1"
                elif shm.is_file():
                    uri = f"{real.as_uri()}?mode=ro"  # in use: read beside its writer
                else:
                    with _sqlite_engine(f"{real.as_uri()}?immutable=1") as conn:
                        if not set(sa.inspect(conn).get_table_names()) & catalog_tables:
                            return  # never copy what may be a key store
                    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
                    shutil.copyfile(real, tmp / "db")
                    shutil.copyfile(wal, tmp / "db-wal")
                    uri = f"{(tmp / 'db').as_uri()}?mode=ro"
                conn = stack.enter_context(_sqlite_engine(uri))
                if set(sa.inspect(conn).get_table_names()) & catalog_tables:
                    self._catalog(root, root.rel(file), conn)
        except _UNREADABLE:
            self._count(self._report.unreadable, DATABASE)

    def _live_catalog(self, root: _Root) -> None:
        """The live catalog, when the data folder is scanned but the catalog is not a
        file under the root (PostgreSQL, or a SQLite file kept elsewhere)."""
        if not root.path.is_dir() or not _inside(self._ks.path, root.path):
            return
        catalog = self._ks.catalog
        database = db.sqlite_file(catalog.engine.url)
        if database is not None and _inside(Path(database), root.path):
            return  # found in the walk
        with catalog.engine.connect() as conn:
            self._catalog(root, LIVE_CATALOG, conn)

    def _catalog(self, root: _Root, label: str, conn: sa.Connection) -> None:
        names = set(sa.inspect(conn).get_table_names())
        if tokens.name in names:
            t = tokens.c
            for token, ref, scope, value in conn.execute(
                sa.select(t.token, t.subject_ref, t.scope, t.value)
            ):
                self._open(
                    root,
                    label,
                    TOKEN,
                    partial(self._keyring.open_at, db.blob(value), token_place(ref, scope), token),
                )
        if threads.name in names:
            t = threads.c
            for thread_ref, ref, sealed in conn.execute(
                sa.select(t.thread_ref, t.subject_ref, t.thread)
            ):
                place = Place(ref, thread_scope(thread_ref), "threads", thread_ref, "data")
                self._open(root, label, THREAD, partial(self._keyring.open, bytes(sealed), place))
        if checkpoints.name in names:
            c = checkpoints.c
            query = sa.select(
                c.thread_ref,
                c.checkpoint_ns,
                c.checkpoint_id,
                c.parent_checkpoint_id,
                c.subject_ref,
                c.data,
            )
            for thread_ref, ns, cid, parent, ref, data in conn.execute(query):
                places = [
                    Place(ref, thread_scope(thread_ref), "checkpoints", record, "data")
                    for record in checkpoint_records(thread_ref, ns, cid, parent)
                ]
                opener = partial(self._open_either, db.blob(data), places)
                self._open(root, label, CHECKPOINT, opener)
        if memory_hot.name in names:
            h = memory_hot.c
            query = sa.select(h.subject_ref, h.seq, h.scope, h.record)
            for row in conn.execute(query):
                self._hot_record(root, label, row)
        if memory_vectors.name in names:
            v = memory_vectors.c
            query = sa.select(v.subject_ref, v.vec, v.vec_id, v.scope, v.memory_id, v.field)
            by_ref: dict[str, dict[bytes, tuple[str, str, str, str]]] = defaultdict(dict)
            for row in conn.execute(query):
                by_ref[str(row[0])].setdefault(
                    db.blob(row[1]), (str(row[2]), str(row[3]), str(row[4]), str(row[5]))
                )
            for ref, seen in by_ref.items():
                self._sealed_vectors(root, label, ref, seen)
        if checkpoint_writes.name in names:
            w = checkpoint_writes.c
            query = sa.select(
                w.thread_ref,
                w.checkpoint_ns,
                w.checkpoint_id,
                w.task_id,
                w.idx,
                w.channel,
                w.task_path,
                w.subject_ref,
                w.data,
            )
            for r in conn.execute(query):
                records = write_records(
                    r.thread_ref,
                    r.checkpoint_ns,
                    r.checkpoint_id,
                    r.task_id,
                    r.idx,
                    r.channel,
                    r.task_path,
                )
                places = [
                    Place(r.subject_ref, thread_scope(r.thread_ref), "writes", record, "data")
                    for record in records
                ]
                opener = partial(self._open_either, bytes(r.data), places)
                self._open(root, label, CHECKPOINT_WRITE, opener)

    def _hot_record(self, root: _Root, label: str, row: Any) -> None:
        """One hot record of a partition on its own (a later record overwriting an
        earlier one leaves the earlier one in the table until a compaction)."""
        ref, seq, scope, record = row.subject_ref, int(row.seq), row.scope, bytes(row.record)
        try:
            payload = self._sealer.open(record, hot_place(ref, scope, seq))
            op, items = decode_record(payload)
            # Rows sealed under owner-set keys inside a record are opened by the
            # partition, as when it loads.
            rows = self._partition(self._ks.path, ref)._unseal(items) if op == "put" else []
        except _ERASED:
            self._count(self._report.undecryptable, LOG)
            return
        except _UNREADABLE:
            self._count(self._report.unreadable, LOG)
            return
        self._count(self._report.decrypted, LOG)
        plain = [payload, self._rows_plain(rows)] if op == "put" else [payload]
        self._search_plain(root, label, LOG, b"\x00".join(plain))

    def _open_either(self, data: bytes, places: Sequence[Place]) -> bytes:
        """Open at the first place that authenticates (a checkpoint row is bound to
        its current record, or to the one of releases before 2026-12-07)."""
        for place in places[:-1]:
            try:
                return self._keyring.open(data, place)
            except IntegrityError:
                continue
        return self._keyring.open(data, places[-1])

    def _open(self, root: _Root, label: str, kind: str, opener: Callable[[], bytes]) -> None:
        try:
            plain = opener()
        except _ERASED:
            self._count(self._report.undecryptable, kind)
            return
        except _UNREADABLE:
            self._count(self._report.unreadable, kind)
            return
        self._count(self._report.decrypted, kind)
        self._search_plain(root, label, kind, plain)

    def _token_journal(self, root: _Root, file: Path) -> None:
        """A vault journal: token rows a process wrote before their group commit
        (zeroed once stored; a dead process's stay until replayed)."""
        try:
            rows = JournalSegment(file, -1).read()  # reads by path; the fd is unused
        except _UNREADABLE:
            self._count(self._report.unreadable, TOKEN_JOURNAL)
            return
        label = root.rel(file)
        for _epoch, row in rows:
            token, ref, scope, value = row[1], row[2], row[3], row[10]
            opener = partial(self._keyring.open_at, db.blob(value), token_place(ref, scope), token)
            self._open(root, label, TOKEN_JOURNAL, opener)

    # -- exports -----------------------------------------------------------------------

    def _export(self, file: Path) -> None:
        """An export package cannot be opened without its recipient's secret; its
        subject key can be checked: destroyed means every copy is noise."""
        try:
            header = read_header(_head(file, 4096))
            self._keyring.data_key(header.subject_ref, header.key_scope, create=False)
        except _ERASED:
            self._count(self._report.undecryptable, EXPORT)
            return
        except _UNREADABLE:
            self._count(self._report.unreadable, EXPORT)
            return
        self._count(self._report.locked, EXPORT)

    # -- backups -----------------------------------------------------------------------

    def _generations(self, files: list[Path]) -> list[tuple[Path, Any]]:
        """(target folder, manifest) of every generation found in the walk."""
        from keyshred.backup.manifest import Manifest

        out = []
        for file in files:
            if file.name != "manifest.json" or file.parent.parent.name != "generations":
                continue
            try:
                manifest = Manifest.parse(file.read_bytes(), file.parent.name)
            except _UNREADABLE:
                self._count(self._report.unreadable, BACKUP_MANIFEST)
                continue
            self._report.generations += 1
            out.append((file.parent.parent.parent, manifest))
        return out

    @staticmethod
    def _objects(generations: list[tuple[Path, Any]]) -> dict[Path, _Object]:
        """Every object the generations name, by real path, with what it is."""
        out: dict[Path, _Object] = {}
        for target, manifest in generations:
            for seg in manifest.segments:
                obj = (target / seg.object).resolve()
                out.setdefault(obj, _Object(_object_kind(seg.path), seg.subject_ref, seg.path))
        return out

    def _decode_backups(
        self, root: _Root, generations: list[tuple[Path, Any]], objects: dict[Path, _Object]
    ) -> None:
        """Decode every object of every generation like the file it is a copy of.
        Objects outside the root (one generation folder scanned) are raw-scanned
        too; an object shared by generations is decoded once."""
        done_datasets: set[frozenset[Path]] = set()
        for target, manifest in generations:
            datasets: dict[str, list[tuple[Path, str]]] = defaultdict(list)
            for seg in manifest.segments:
                path = (target / seg.object).resolve()
                obj = objects[path]
                if not path.is_file():
                    continue  # pruned meanwhile
                self._raw(root, path, obj.kind)
                if obj.kind == VECTOR_DATASET:
                    top, _, rest = obj.rel.removeprefix("vectors/").partition("/")
                    datasets[top].append((path, rest))
                    continue
                if path in root.decoded:
                    continue
                root.decoded.add(path)
                if obj.kind == SEGMENT:
                    self._segment(root, path, obj.subject_ref, root.rel(path))
            for top, members in sorted(datasets.items()):
                key = frozenset(p for p, _ in members)
                if key not in done_datasets:
                    done_datasets.add(key)
                    self._backup_dataset(root, top, members)

    def _backup_dataset(self, root: _Root, top: str, members: list[tuple[Path, str]]) -> None:
        """A LanceDB dataset from backup objects: laid out again as symbolic links
        (no copy of the ciphertext) in a private folder, then read like a live one.
        Hits name the subject's object folder and the dataset."""
        with tempfile.TemporaryDirectory(prefix="keyshred-residue-") as tmp:
            dataset = Path(tmp) / top
            for path, rest in members:
                link = dataset / rest
                if link.exists() or ".." in Path(rest).parts:
                    continue
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(path)
            label = f"{root.rel(members[0][0].parent)}/[vectors/{top}]"
            self._dataset(root, dataset, top.removesuffix(".lance"), label)


# -- S3 ---------------------------------------------------------------------------


def _s3_url(bucket: str, prefix: str) -> str:
    return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"


@dataclass(frozen=True, slots=True)
class _S3Place:
    """An S3 prefix to scan, why (``role``), and how to reach it (credentials come
    from the AWS chain, as for every other S3 client of keyshred)."""

    url: str
    bucket: str
    prefix: str  # no slashes at its ends; "" is the whole bucket
    role: str
    endpoint_url: str | None
    region: str | None
    addressing_style: str | None  # None: boto3's default (what S3Target uses)

    @classmethod
    def of(
        cls,
        url: str,
        role: str,
        endpoint_url: str | None,
        region: str | None,
        addressing_style: str | None,
    ) -> _S3Place:
        bucket, prefix = split_s3_uri(url)
        return cls(
            _s3_url(bucket, prefix), bucket, prefix, role, endpoint_url, region, addressing_style
        )

    def covers(self, other: _S3Place) -> bool:
        """Whether every object under ``other`` is under this prefix too."""
        return (
            self.endpoint_url == other.endpoint_url
            and self.bucket == other.bucket
            and (
                not self.prefix
                or other.prefix == self.prefix
                or other.prefix.startswith(self.prefix + "/")
            )
        )


def _folder_places(ks: DataFolder) -> tuple[list[_S3Place], int]:
    """The S3 prefixes of an open data folder: its memory partitions, its vector
    datasets and every S3 backup target it wrote to (the default target and those
    the backup manager remembers); with how many remembered targets could not be
    read or parsed (counted as unreadable object stores)."""
    cfg = ks.config
    s3 = cfg.s3
    out: list[_S3Place] = []
    bad = 0
    for role, uri in (("storage.uri", cfg.storage.uri), ("vectors.uri", cfg.vectors.uri)):
        if uri is not None and uri.startswith("s3://"):
            out.append(_S3Place.of(uri, role, s3.endpoint_url, s3.region, s3.addressing_style))
    urls = [cfg.backup.target or ""]
    try:
        urls += (ks.path / TARGETS_FILE).read_text("utf-8").splitlines()
    except FileNotFoundError:
        pass  # no backup ever went to another target
    except (OSError, UnicodeDecodeError):
        bad += 1
    # The endpoint and region a backup target is opened with (BackupManager.target).
    endpoint = cfg.backup.s3_endpoint_url or s3.endpoint_url
    region = cfg.backup.s3_region or s3.region
    for url in urls:
        if not url.startswith("s3://"):
            continue
        try:
            out.append(_S3Place.of(url, "backup target", endpoint, region, None))
        except ConfigError:
            bad += 1
    return out, bad


def _uncovered(found: list[_S3Place], given: list[_S3Place]) -> list[_S3Place]:
    """``found`` without the prefixes another one (given or found) already covers:
    each object is scanned once."""
    kept: list[_S3Place] = []
    for place in found:
        if any(other.covers(place) for other in [*given, *kept]):
            continue
        kept = [k for k in kept if not place.covers(k)]
        kept.append(place)
    return kept


@dataclass(frozen=True, slots=True)
class _Version:
    """One version of an object with content (delete markers have none)."""

    key: str  # relative to the prefix
    version: str  # "null" on a bucket that was never versioned
    current: bool
    size: int


class _S3Reader:
    """Lists and downloads object versions under one prefix through boto3
    (``keyshred[aws]``); S3's errors come out as ``NotFound`` (no such bucket) or
    ``BackendUnavailable``, naming the error code, never a key."""

    def __init__(self, place: _S3Place) -> None:
        boto3 = require("boto3", extra="aws")
        from botocore.config import Config as BotoConfig

        self._errors = require("botocore.exceptions", extra="aws")
        self._place = place
        extra: dict[str, Any] = {}
        if place.addressing_style:
            extra["config"] = BotoConfig(s3=cast(Any, {"addressing_style": place.addressing_style}))
        try:
            self._client = boto3.client(
                "s3", endpoint_url=place.endpoint_url, region_name=place.region, **extra
            )
        except (self._errors.BotoCoreError, ValueError) as exc:
            raise BackendUnavailable(f"S3 client failed: {type(exc).__name__}") from None
        self._full = f"{place.prefix}/" if place.prefix else ""

    @contextlib.contextmanager
    def _translated(self) -> Iterator[None]:
        try:
            yield
        except self._errors.ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", "error"))
            if code in ("404", "NoSuchBucket"):
                raise NotFound(f"{self._place.url} does not exist") from None
            raise BackendUnavailable(f"S3 refused to be read: {code}") from None
        except self._errors.BotoCoreError as exc:
            raise BackendUnavailable(f"S3 is unreachable: {type(exc).__name__}") from None

    def check(self) -> None:
        """``InvalidInput`` if the bucket does not exist; other failures are left
        to the scan, which counts the prefix as unreadable."""
        try:
            with self._translated():
                self._client.head_bucket(Bucket=self._place.bucket)
        except NotFound:
            raise InvalidInput(f"{self._place.url} does not exist") from None
        except BackendUnavailable:
            pass

    def listing(self) -> tuple[list[_Version], int]:
        """Every version with content under the prefix, by key and newest first
        within a key, and how many delete markers there are. Folder markers
        (empty keys ending in ``/``) hold nothing and are left out."""
        start = len(self._full)
        out: list[tuple[str, bool, float, _Version]] = []
        markers = 0
        with self._translated():
            pages = self._client.get_paginator("list_object_versions")
            for page in pages.paginate(Bucket=self._place.bucket, Prefix=self._full):
                markers += len(page.get("DeleteMarkers", []))
                for item in page.get("Versions", []):
                    key, size = str(item["Key"])[start:], int(item.get("Size", 0))
                    if (not key or key.endswith("/")) and size == 0:
                        continue
                    current = bool(item.get("IsLatest"))
                    v = _Version(key, str(item["VersionId"]), current, size)
                    out.append((key, not current, -item["LastModified"].timestamp(), v))
        out.sort(key=lambda t: t[:3])
        return [t[3] for t in out], markers

    def download(self, v: _Version, dest: Path) -> None:
        """Stream one version into a new file of mode 0600 (never following a link,
        never over an existing file)."""
        args: dict[str, Any] = {"Bucket": self._place.bucket, "Key": self._full + v.key}
        if not (v.version == "null" and v.current):
            args["VersionId"] = v.version
        with self._translated():
            body = self._client.get_object(**args)["Body"]
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
            with os.fdopen(os.open(dest, flags, 0o600), "wb") as out, contextlib.closing(body):
                while chunk := body.read(_CHUNK):
                    out.write(chunk)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._client.close()


def _local_path(folder: Path, key: str) -> Path | None:
    """Where an object key is laid out under ``folder`` (its parent folders made,
    mode 0700), or None if it cannot be: a part that is empty, ``.`` or ``..``, a
    name the file system refuses, or a place an earlier key took."""
    parts = key.split("/")
    if any(part in ("", ".", "..") for part in parts) or "\x00" in key:
        return None
    dest = folder.joinpath(*parts)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if os.path.lexists(dest):
            return None
    except (OSError, ValueError):
        return None
    return dest


@contextlib.contextmanager
def _sqlite_engine(uri: str) -> Iterator[sa.Connection]:
    engine = sa.create_engine(
        "sqlite://", creator=lambda: sqlite3.connect(uri, uri=True, check_same_thread=False)
    )
    try:
        with engine.connect() as conn:
            yield conn
    finally:
        engine.dispose()


def _walk(root: Path, onerror: Callable[[OSError], None]) -> Iterator[Path]:
    for folder, dirs, names in os.walk(root, onerror=onerror, followlinks=False):
        dirs.sort()
        for name in sorted(names):
            path = Path(folder) / name
            # A link is not data (its target is scanned where it is), and only regular
            # files are read: opening a FIFO waits for a writer forever, a device
            # never ends.
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.lstat(path).st_mode):
                    yield path


def _head(file: Path, n: int) -> bytes:
    try:
        with file.open("rb") as f:
            return f.read(n)
    except OSError:
        return b""


def _kind_of(file: Path) -> str:
    """What a file in the walk is, from its name and place."""
    name, parent = file.name, file.parent.name
    if parent.startswith(_SUBJECT_DIR) and _SEGMENT_NAME.fullmatch(name):
        return SEGMENT
    if any(p.endswith(".lance") for p in file.parts[:-1]):
        return VECTOR_DATASET
    if name == "manifest.json" and file.parent.parent.name == "generations":
        return BACKUP_MANIFEST
    if name == "keystore.sealed":
        return BACKUP_KEYSTORE
    head = _head(file, 4096)
    if head.startswith(_SQLITE_MAGIC):
        return DATABASE
    if head.startswith(_JOURNAL_MAGIC):
        return TOKEN_JOURNAL
    if head.startswith(b"{") and b"keyshred-export/" in head.partition(b"\n")[0]:
        return EXPORT
    if parent.startswith(_SUBJECT_DIR) and head[:4] in (b"PAR1", b"PARE"):
        # A Parquet file in a subject's folder under another name: a backup object
        # no manifest in the scanned folders names (pruned generation, one folder).
        return SEGMENT
    return FILE


def _object_kind(rel: str) -> str:
    parts = rel.split("/")
    if (
        parts[0] == "memories"
        and len(parts) == 3
        and parts[1].startswith(_SUBJECT_DIR)
        and _SEGMENT_NAME.fullmatch(parts[2])
    ):
        return SEGMENT
    if parts[0] == "vectors" and len(parts) > 2 and parts[1].endswith(".lance"):
        return VECTOR_DATASET
    return BACKUP_OBJECT
