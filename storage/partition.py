"""A subject's memory partition: encrypted Parquet segments plus an append log.

Layout under ``memories/subject=<subject_ref>/``::

    MANIFEST                 {"gen": G, "segments": {scope: {"file", "rows", "key_id"}}}
    seg-g<G>-<n>.parquet     one Parquet file per scope, PME-encrypted with that
                             scope's DEK (namespace, key and value columns)
    log-<L>.ksl              the append log; records not yet in a segment (L > G)
    LOCK                     flock for writers in several processes

Writes land in the log (sealed, fsync'd). ``flush`` rewrites the segment of every
scope that changed since the last flush, then commits by atomically replacing the
MANIFEST, then deletes the old log and superseded segments: a partition stays at one
file per scope plus one log. A crash at any point leaves either the old or the new
manifest, and opening cleans up files the manifest does not name.

Plaintext metadata columns (ids, subject_ref, scope, purpose, category, timestamps,
retain_until, status, lookup hash, provenance ids) stay readable without keys so
retention scans can run over every partition with DuckDB or pyarrow.

Row-level keys (DESIGN.md "Row-level keys inside a segment"): a row whose owner set is
more than its holder (it mentions someone, or derives from another subject's data)
carries its sensitive values as one envelope ciphertext under the owner-set DEK,
bound to ``(subject_ref, scope, "memories", memory_id, "row")``, in the ``value``
column (PME on top) and likewise inside the log record, so erasing any owner makes
exactly those rows unreadable in every copy of the files. Namespace and key go inside
that ciphertext too (their columns hold ``""``), except for a derived asset (a row
with sources): its name is the holder's own, kept under the holder's key so that an
erasure can rebuild it in place. A row whose key was destroyed is *opaque*: kept in
``Partition.opaque`` (never in ``rows``, so no read, search or count sees it), written
back byte for byte by a flush, deletable by id without its key.

Why one module of ~900 lines: ``Partition`` is the storage engine of one subject (log
append, replay, flush to PME segments, atomic MANIFEST commit, opaque rows, crash
repair); every method relies on the same on-disk protocol and lock, which is read and
reviewed as one unit. The row format and log codec at the top are its private parts.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import os
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from keyshred.errors import IntegrityError, KeyNotFound, SubjectErased, SubjectSuppressed
from keyshred.keyring import _primitives as prim
from keyshred.keyring.datakey import DataKey
from keyshred.keyring.envelope import HEADER_BYTES, KEY_ID_BYTES, Place
from keyshred.keyring.keyring import Keyring
from keyshred.storage import faults
from keyshred.storage.applog import AppendLog
from keyshred.storage.freeze import FreezeLock
from keyshred.storage.pme import PmeCrypto
from keyshred.storage.policy import INDEX_SCOPE
from keyshred.storage.sealer import Sealer

__all__ = [
    "ENCRYPTED_COLUMNS",
    "SCHEMA",
    "MemoryRow",
    "Partition",
    "from_us",
    "row_key_id",
    "row_place",
    "seal_row",
    "to_us",
]

ENCRYPTED_COLUMNS = ["namespace", "key", "value"]
_MAC_LABEL = b"segment-mac"
_TS = pa.timestamp("us", tz="UTC")
SCHEMA = pa.schema(
    [
        ("memory_id", pa.string()),
        ("subject_ref", pa.string()),
        ("scope", pa.string()),
        ("purpose", pa.string()),
        ("category", pa.string()),
        ("created_at", _TS),
        ("updated_at", _TS),
        ("retain_until", _TS),
        ("status", pa.string()),
        ("lookup", pa.string()),
        ("sources", pa.list_(pa.string())),
        ("mentions", pa.list_(pa.string())),
        ("index_fields", pa.list_(pa.string())),
        ("namespace", pa.string()),
        ("key", pa.string()),
        ("value", pa.binary()),
    ]
)
PLAINTEXT_COLUMNS = [name for name in SCHEMA.names if name not in ENCRYPTED_COLUMNS]
_MAC_META = b"keyshred.mac"
_SEALED_MAGIC = b"KS\x01"  # an envelope's magic and version: never the start of JSON
_ROW_TABLE = "memories"
_ROW_COLUMN = "row"


@dataclass(frozen=True, slots=True)
class MemoryRow:
    """One memory as the partition holds it (``value`` is its JSON text)."""

    memory_id: str
    namespace: tuple[str, ...]
    key: str
    value: bytes
    scope: str
    purpose: str
    category: str
    created_us: int  # microseconds since the Unix epoch, UTC
    updated_us: int
    retain_us: int
    lookup: str
    sources: tuple[str, ...] = ()
    mentions: tuple[str, ...] = ()
    index: tuple[str, ...] = ()  # the JSON paths embedded into vectors
    # The envelope ciphertext of the row's values under its owner-set key, as the
    # files hold it (None: the holder's own row, under PME and the log's key only).
    sealed: bytes | None = None
    # Its owner-set key was destroyed: ``value`` (and, unless it is a derived
    # asset, ``namespace`` and ``key``) are unknown; only ``sealed`` is kept.
    opaque: bool = False

    def __repr__(self) -> str:
        return f"MemoryRow(memory_id={self.memory_id!r}, scope={self.scope!r})"


def row_place(subject_ref: str, row: MemoryRow) -> Place:
    """Where a row's sealed values belong: its holder, scope and memory id."""
    return Place(subject_ref, row.scope, _ROW_TABLE, row.memory_id, _ROW_COLUMN)


def _names_sealed(row: MemoryRow) -> bool:
    """Whether namespace and key travel inside the sealed values: always, but for
    a derived asset (a row with sources), whose name the erasure needs to rebuild it."""
    return not row.sources


def seal_row(key: DataKey, subject_ref: str, row: MemoryRow) -> MemoryRow:
    """The row with its values sealed under ``key`` (an owner-set key of the
    holder's scope): ``[namespace, key]`` (or ``null``) as JSON, a newline, the value."""
    names = json.dumps([list(row.namespace), row.key] if _names_sealed(row) else None)
    payload = names.encode("utf-8") + b"\n" + row.value
    return replace(row, sealed=key.seal(payload, row_place(subject_ref, row)))


def row_key_id(row: MemoryRow) -> bytes | None:
    """The id of the owner-set key a row is sealed under (None: the holder's own)."""
    if row.sealed is None:
        return None
    return row.sealed[HEADER_BYTES - KEY_ID_BYTES : HEADER_BYTES]


def _is_sealed(value: bytes) -> bool:
    return value[: len(_SEALED_MAGIC)] == _SEALED_MAGIC


def encode_puts(rows: Sequence[MemoryRow]) -> bytes:
    """One log payload for a batch of puts of one scope: a JSON header line with
    every row's fields and its value's length, then the values back to back (they
    are JSON already; re-escaping them inside the header would cost a second pass).
    """
    # Tuples: JSON arrays all the same, and no list copies to allocate per row. A
    # sealed row logs its ciphertext as the value and, if its names are inside it,
    # null and "" for namespace and key.
    header = [
        (
            r.memory_id,
            None if r.sealed is not None and _names_sealed(r) else r.namespace,
            "" if r.sealed is not None and _names_sealed(r) else r.key,
            r.scope,
            r.purpose,
            r.category,
            r.created_us,
            r.updated_us,
            r.retain_us,
            r.lookup,
            r.sources,
            r.mentions,
            r.index,
            len(r.value if r.sealed is None else r.sealed),
        )
        for r in rows
    ]
    head = json.dumps({"op": "put", "rows": header}, separators=(",", ":")).encode("utf-8")
    return b"".join([head, b"\n", *(r.value if r.sealed is None else r.sealed for r in rows)])


def encode_delete(row: MemoryRow) -> bytes:
    return json.dumps({"op": "del", "l": row.lookup}).encode("utf-8") + b"\n"


def decode_record(payload: bytes) -> tuple[str, list[Any]]:
    """``("put", rows)`` or ``("del", [lookup])``; ValueError/KeyError if malformed.
    A sealed row comes back as it is stored: ``value`` is its ciphertext, and so is
    ``sealed`` (``Partition`` opens it)."""
    head, _, body = payload.partition(b"\n")
    doc = json.loads(head)
    if doc["op"] == "del":
        return "del", [str(doc["l"])]
    if doc["op"] != "put":
        raise ValueError("unknown log operation")
    rows, pos = [], 0
    for mid, ns, key, scope, pur, cat, c, u, r, lookup, src, men, idx, vlen in doc["rows"]:
        value = body[pos : pos + vlen]
        if len(value) != vlen:
            raise ValueError("truncated value")
        pos += vlen
        if ns is None and not _is_sealed(value):
            raise ValueError("a row without a namespace is not sealed")
        rows.append(
            MemoryRow(
                str(mid),
                () if ns is None else tuple(ns),
                str(key),
                value,
                str(scope),
                str(pur),
                str(cat),
                int(c),
                int(u),
                int(r),
                str(lookup),
                tuple(src),
                tuple(men),
                tuple(idx),
                value if _is_sealed(value) else None,
            )
        )
    if pos != len(body):
        raise ValueError("trailing bytes")
    return "put", rows


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def to_us(value: datetime) -> int:
    """Microseconds since the Unix epoch (exact, no float rounding)."""
    delta = value.astimezone(UTC) - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def from_us(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


def _encode_lookup(namespace: Sequence[str], key: str) -> bytes:
    out = bytearray()
    for part in (*namespace, "\x00", key):
        raw = part.encode("utf-8")
        out += len(raw).to_bytes(4, "big") + raw
    return bytes(out)


class Partition:
    """One subject's memories: loaded into memory on first use, written through."""

    def __init__(
        self,
        root: Path,
        subject_ref: str,
        keyring: Keyring,
        sealer: Sealer,
        pme: PmeCrypto | None,
        *,
        fsync: bool = True,
        expected_ids: Callable[[str], set[str]] | None = None,
        finish_deletes: Callable[[Partition, set[str]], set[str]] | None = None,
        freeze: FreezeLock | None = None,
    ) -> None:
        self.root = root
        self._manifest_str = str(root / "MANIFEST")  # stat'ed on every write
        self._freeze = freeze
        self._expected_ids = expected_ids
        self._finish_deletes = finish_deletes
        self.subject_ref = subject_ref
        self._keyring = keyring
        self._sealer = sealer
        self._pme = pme
        self._fsync = fsync
        self.lock = threading.RLock()
        self.rows: dict[str, MemoryRow] = {}
        # Rows whose owner-set key was destroyed, by lookup: in the files, in no read.
        self.opaque: dict[str, MemoryRow] = {}
        self._gen = 0
        self._segments: dict[str, dict[str, Any]] = {}
        self._log: AppendLog | None = None
        self._dirty: set[str] = set()
        self._lookup_key: bytes | None = None
        self._manifest_stat: tuple[int, int] | None = None
        self._lock_fd: int | None = None
        self.dropped = False
        self._pending = 0
        self._erased_scopes: set[str] = set()
        self._ns_cache: dict[tuple[str, ...], bytes] = {}
        # Parsed values for filters, keyed by lookup and checked by the identity of
        # the row's value bytes; plaintext like ``rows``, dropped with them.
        self._parsed: dict[str, tuple[bytes, Any]] = {}
        self.loaded = False
        self._flock_depth = 0  # > 0 while this thread is inside ``flocked``

    @property
    def holds_flock(self) -> bool:
        """Whether the caller (holding ``lock``) is inside ``flocked``: a refresh
        outside it may only read."""
        return self._flock_depth > 0

    # -- files and locks -----------------------------------------------------------

    @contextlib.contextmanager
    def flocked(self, *, refresh: bool = True) -> Iterator[None]:
        """Serialize writers across processes (and threads) on this partition;
        ``refresh`` first catches up with what other processes wrote."""
        with self.lock:
            if self.dropped:
                # Erased while someone still held this object: never re-create it.
                raise SubjectSuppressed(f"partition {self.subject_ref} was erased")
            if self._lock_fd is not None and os.fstat(self._lock_fd).st_nlink == 0:
                # Another process dropped the partition (an erasure) while we held it
                # open: forget everything we had; nothing of it may be written back.
                self._close_files()
                self.rows, self.opaque, self._parsed, self.loaded = {}, {}, {}, False
                self._lookup_key, self._manifest_stat = None, None
            if self._lock_fd is None:
                self.root.mkdir(parents=True, exist_ok=True)
                self._lock_fd = os.open(self.root / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            self._flock_depth += 1
            try:
                with self._freeze.shared() if self._freeze else contextlib.nullcontext():
                    if refresh:
                        self._refresh()
                    yield
            except SubjectSuppressed:
                # The holder found the subject suppressed. A folder with nothing but
                # the lock file was made by taking the lock (after an erasure dropped
                # the partition, say): leave nothing behind for the erasure to find.
                self._remove_if_bare()
                raise
            finally:
                self._flock_depth -= 1
                if self._lock_fd is not None:
                    fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _remove_if_bare(self) -> None:
        """Delete the folder if it holds nothing but its lock file (held by us)."""
        try:
            if os.listdir(self.root) != ["LOCK"]:
                return
            os.unlink(self.root / "LOCK")
            os.rmdir(self.root)
        except OSError:
            return  # someone else's files arrived meanwhile: not ours to remove
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)

    def _manifest_path(self) -> Path:
        return self.root / "MANIFEST"

    def _stat_manifest(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self._manifest_str)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns)

    def _refresh(self) -> None:
        """Catch up with what another process committed since we last looked."""
        if not self.loaded or self._stat_manifest() != self._manifest_stat:
            self._load()
            return
        assert self._log is not None  # noqa: S101 - set by _load
        if self._log.size_on_disk() > self._log.offset:
            self._apply_log(self._log, self._log.offset, self._log.next_seq)

    def ensure_loaded(self, *, refresh: bool = True) -> None:
        """Load the partition if needed; with ``refresh``, also catch up with what
        other processes wrote (a writer skips that: it refreshes under its lock)."""
        with self.lock:
            if not self.loaded:
                with self.flocked():
                    pass
            elif refresh:
                self._refresh()

    def parsed_value(self, row: MemoryRow) -> Any:
        """``json.loads(row.value)``, cached while the row is unchanged (read-only:
        callers must not mutate it)."""
        hit = self._parsed.get(row.lookup)
        if hit is not None and hit[0] is row.value:
            return hit[1]
        value = json.loads(row.value)
        if len(self._parsed) > 200_000:
            self._parsed.clear()
        self._parsed[row.lookup] = (row.value, value)
        return value

    # -- lookup hashes -------------------------------------------------------------

    @property
    def lookup_key_id(self) -> int:
        """Identity of the lookup key in use (changes if the key is re-derived)."""
        return id(self._lookup_key)

    def lookup(self, namespace: Sequence[str], key: str, *, create: bool = True) -> str:
        """Keyed hash of (namespace, key) under the subject's index key (created on
        first use unless ``create=False``: then ``KeyNotFound``/``SubjectErased``)."""
        if self._lookup_key is None:
            if self._sealer.encrypted:
                index = self._keyring.data_key(self.subject_ref, INDEX_SCOPE, create=create)
                self._lookup_key = index.derive(b"memory-lookup")
            else:
                self._lookup_key = b"\x00" * 32
        namespace = tuple(namespace)
        ns = self._ns_cache.get(namespace)
        if ns is None:
            ns = _encode_lookup(namespace, "")[:-4]  # the namespace part, then the key
            if len(self._ns_cache) > 4096:
                self._ns_cache.clear()
            self._ns_cache[namespace] = ns
        raw = key.encode("utf-8")
        message = ns + len(raw).to_bytes(4, "big") + raw
        return prim.hmac_sha256(self._lookup_key, message).hex()[:32]

    # -- loading -------------------------------------------------------------------

    def _load(self) -> None:
        # Loading builds many small objects at once; the cyclic GC would walk them
        # repeatedly for nothing (they hold no cycles).
        enabled = gc.isenabled()
        gc.disable()
        try:
            self._load_files()
        finally:
            if enabled:
                gc.enable()

    def _load_files(self) -> None:
        # What the catalog says must be here, read before the files: every write
        # lands in the log before its asset is registered, both under our flock.
        expected = None if self._expected_ids is None else self._expected_ids(self.subject_ref)
        self._read_files()
        if expected is not None:
            missing = expected - {r.memory_id for r in self.all_rows()}
            if missing and self._finish_deletes is not None:
                # Rows the store itself was deleting (marked in the catalog before
                # their bytes went) are not lost: that deletion is finished now. The
                # rest stays what it is, a truncated or replaced file.
                missing = self._finish_deletes(self, missing)
            if missing:
                self.loaded = False
                raise IntegrityError(
                    f"partition {self.subject_ref} lacks {len(missing)} memories the catalog "
                    "holds (a truncated or replaced file)"
                )

    def all_rows(self) -> list[MemoryRow]:
        """Every row the files hold: the readable ones and the opaque ones."""
        return [*self.rows.values(), *self.opaque.values()]

    def _keep(self, row: MemoryRow) -> None:
        """File a row read or written: opaque rows apart from the readable ones."""
        if row.opaque:
            self.rows.pop(row.lookup, None)
            self.opaque[row.lookup] = row
        else:
            self.opaque.pop(row.lookup, None)
            self.rows[row.lookup] = row

    def _unseal(self, rows: list[MemoryRow]) -> list[MemoryRow]:
        """Open the sealed rows among ``rows`` (as the files hold them: ``value`` is
        the ciphertext) with their owner-set keys, one key lookup per key id. A row
        whose key was destroyed comes back opaque; one whose key is not the holder's
        own for that scope, or that fails to open, raises ``IntegrityError``."""
        keys: dict[bytes, DataKey | None] = {}
        out = []
        for row in rows:
            if row.sealed is None:
                out.append(row)
                continue
            key_id = row_key_id(row)
            assert key_id is not None  # noqa: S101 - sealed rows have one
            if key_id not in keys:
                try:
                    found: DataKey | None = self._keyring.data_key_by_id(key_id)
                except SubjectErased:
                    found = None
                except KeyNotFound:
                    raise IntegrityError(
                        f"partition {self.subject_ref} holds a row under an unknown key"
                    ) from None
                if found is not None and (
                    found.subject_ref != self.subject_ref or found.scope != row.scope
                ):
                    raise IntegrityError(f"partition {self.subject_ref} holds another's row")
                keys[key_id] = found
            key = keys[key_id]
            if key is None:
                out.append(replace(row, value=b"", opaque=True))
                continue
            payload = key.open(row.sealed, row_place(self.subject_ref, row))
            head, _, value = payload.partition(b"\n")
            try:
                names = json.loads(head)
                if names is None:
                    ns, k = row.namespace, row.key
                else:
                    ns, k = tuple(names[0]), names[1]
                    if not all(isinstance(x, str) for x in ns) or not isinstance(k, str):
                        raise ValueError
            except (ValueError, TypeError, IndexError):
                raise IntegrityError(
                    f"partition {self.subject_ref} holds a malformed sealed row"
                ) from None
            out.append(replace(row, namespace=ns, key=k, value=value))
        return out

    def _read_files(self, *, cleanup: bool = True) -> None:
        self._erased_scopes = set()
        self.rows = {}
        self.opaque = {}
        self._pending = 0
        self._dirty = set()
        if self._log is not None:
            self._log.close()
        manifest = self._read_manifest()
        self._gen = int(manifest.get("gen", 0))
        self._segments = dict(manifest.get("segments", {}))
        for scope, seg in sorted(self._segments.items()):
            try:
                rows = self._read_segment(self.root / seg["file"], scope)
            except SubjectErased:
                # The scope was crypto-erased (a scope erasure in progress): its rows
                # are gone; the next flush drops the segment from the manifest.
                self._erased_scopes.add(scope)
                self._dirty.add(scope)
                continue
            for row in rows:
                self._keep(row)
        if cleanup:
            self._cleanup()
        self._log = AppendLog(
            self.root / f"log-{self._gen + 1:08d}.ksl",
            self._gen + 1,
            self.subject_ref,
            self._sealer,
            fsync=self._fsync,
        )
        self._apply_log(self._log, 0, 0)
        self._manifest_stat = self._stat_manifest()
        self.loaded = True

    def _read_manifest(self) -> dict[str, Any]:
        try:
            raw = self._manifest_path().read_bytes()
        except FileNotFoundError:
            return {}
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or not isinstance(doc.get("segments"), dict):
                raise ValueError
            return doc
        except ValueError:
            raise IntegrityError(
                f"the manifest of partition {self.subject_ref} is corrupt"
            ) from None

    @staticmethod
    def _columns_mac(mac_key: bytes, cols: dict[str, list[Any]]) -> bytes:
        """A keyed MAC over the plaintext metadata columns, kept in the footer.

        PME authenticates the encrypted columns (AES-GCM, bound to file, row group,
        column and page) and signs the plaintext footer; this MAC covers the
        plaintext column pages too, so a flipped byte there raises instead of
        returning a wrong id, scope or date. Timestamps enter as integers.
        """
        canonical = json.dumps([cols[n] for n in PLAINTEXT_COLUMNS], separators=(",", ":"))
        return prim.hmac_sha256(mac_key, canonical.encode("utf-8")).hex().encode("ascii")

    def _read_segment(self, path: Path, scope: str) -> list[MemoryRow]:
        kwargs: dict[str, Any] = {"page_checksum_verification": True}
        mac_key = b"\x00" * 32
        if self._pme is not None:
            kwargs["decryption_properties"] = self._pme.decryption()
            dek = self._keyring.data_key(self.subject_ref, scope, create=False)
            mac_key = dek.derive(_MAC_LABEL)
        try:
            table = pq.ParquetFile(path, **kwargs).read()
        except (SubjectErased, IntegrityError):
            raise
        except Exception as exc:  # noqa: BLE001 - any failure to read is a bad file
            raise IntegrityError(
                f"segment {path.name} of partition {self.subject_ref} failed to read "
                f"({type(exc).__name__})"
            ) from None
        if table.schema.names != SCHEMA.names:
            raise IntegrityError(f"segment {path.name} has an unexpected schema")
        cols = {
            name: (
                table.column(name).cast(pa.int64())
                if pa.types.is_timestamp(SCHEMA.field(name).type)
                else table.column(name)
            ).to_pylist()
            for name in SCHEMA.names
        }
        stored = (table.schema.metadata or {}).get(_MAC_META)
        if stored is None or not prim.constant_time_equal(stored, self._columns_mac(mac_key, cols)):
            raise IntegrityError(f"segment {path.name} failed authentication")
        if set(cols["scope"]) - {scope} or set(cols["subject_ref"]) - {self.subject_ref}:
            raise IntegrityError(f"segment {path.name} holds rows of another owner")
        namespaces: dict[str, tuple[str, ...]] = {"": ()}  # a few distinct ones, many rows
        try:
            for text in set(cols["namespace"]) - {""}:  # "": names sealed with the value
                ns = json.loads(text)
                if not isinstance(ns, list) or not all(isinstance(x, str) for x in ns):
                    raise ValueError
                namespaces[text] = tuple(ns)
            out = [
                MemoryRow(
                    mid,
                    namespaces[ns],
                    key,
                    value,
                    scope,
                    pur,
                    cat,
                    c,
                    u,
                    r,
                    lk,
                    tuple(src or ()),
                    tuple(men or ()),
                    tuple(idx or ()),
                    value if _is_sealed(value) else None,
                )
                for mid, ns, key, value, pur, cat, c, u, r, lk, src, men, idx in zip(
                    cols["memory_id"],
                    cols["namespace"],
                    cols["key"],
                    cols["value"],
                    cols["purpose"],
                    cols["category"],
                    cols["created_at"],
                    cols["updated_at"],
                    cols["retain_until"],
                    cols["lookup"],
                    cols["sources"],
                    cols["mentions"],
                    cols["index_fields"],
                    strict=True,
                )
            ]
            if any(r.sealed is None and not r.namespace for r in out):
                raise ValueError  # names left out, but the value is not sealed
        except (ValueError, TypeError):
            raise IntegrityError(f"segment {path.name} holds a malformed row") from None
        return self._unseal(out)

    def _apply_log(self, log: AppendLog, start: int, seq: int) -> None:
        for scope, payload in log.read(start, seq, skip_erased=True):
            if payload is None:  # sealed under a destroyed scope key: erased
                self._erased_scopes.add(scope)
                self._dirty.add(scope)
                continue
            try:
                op, items = decode_record(payload)
                if op == "put":
                    for row in items:
                        if row.scope != scope:
                            raise ValueError("row of another scope")
                else:
                    self.rows.pop(items[0], None)
                    self.opaque.pop(items[0], None)
            except (ValueError, KeyError, TypeError):
                raise IntegrityError(f"log {log.path.name} holds a malformed record") from None
            if op == "put":
                for row in self._unseal(items):
                    self._keep(row)
                self._pending += len(items)
            self._dirty.add(scope)

    def _leftovers(self) -> list[Path]:
        """Files the manifest does not name (leftovers of a crash or flush)."""
        keep = {seg["file"] for seg in self._segments.values()}
        keep |= {"MANIFEST", "LOCK", f"log-{self._gen + 1:08d}.ksl"}
        found = self.root.iterdir() if self.root.exists() else iter(())
        return sorted(path for path in found if path.name not in keep)

    def _cleanup(self) -> None:
        """Remove files the manifest does not name (leftovers of a crash or flush)."""
        for path in self._leftovers():
            path.unlink(missing_ok=True)

    def inspect(self) -> tuple[list[MemoryRow], list[str]]:
        """Every row the files hold and the names of leftover files, with nothing
        removed (repair reports before it acts). Callers hold ``flocked``."""
        try:
            self._read_files(cleanup=False)
            return self.all_rows(), [p.name for p in self._leftovers()]
        finally:
            self.rows, self.opaque, self._parsed, self.loaded = {}, {}, {}, False

    def reload(self) -> None:
        """Read the files again, checked against the catalog if this partition was
        given ``expected_ids``, removing leftover files. Callers hold ``flocked``."""
        self._load()

    # -- writes (callers hold ``flocked``) -----------------------------------------

    def append_puts(self, rows: Sequence[MemoryRow]) -> None:
        assert self._log is not None  # noqa: S101 - loaded under flocked()
        by_scope: dict[str, list[MemoryRow]] = {}
        for r in rows:
            by_scope.setdefault(r.scope, []).append(r)
        self._log.append([(scope, encode_puts(part)) for scope, part in by_scope.items()])
        self._pending += len(rows)
        for r in rows:
            old = self.rows.get(r.lookup) or self.opaque.get(r.lookup)
            if old is not None and old.scope != r.scope:
                self._dirty.add(old.scope)
            self._keep(r)
            self._dirty.add(r.scope)

    def append_delete(self, row: MemoryRow) -> None:
        assert self._log is not None  # noqa: S101
        self._log.append([(row.scope, encode_delete(row))])
        self.rows.pop(row.lookup, None)
        self.opaque.pop(row.lookup, None)
        self._dirty.add(row.scope)

    @property
    def log_records(self) -> int:
        """Rows written to the log since the last flush."""
        return self._pending

    def flush(self) -> None:
        """Rewrite the changed scopes' segments, commit a new manifest, drop the log."""
        if not self._dirty and (self._log is None or self._log.next_seq == 0):
            return
        gen = self._gen + 1
        segments = dict(self._segments)
        by_scope: dict[str, list[MemoryRow]] = {}
        for row in self.all_rows():  # opaque rows too: carried over as they are
            by_scope.setdefault(row.scope, []).append(row)
        for n, scope in enumerate(sorted(self._dirty)):
            rows = by_scope.get(scope, [])
            if not rows:
                segments.pop(scope, None)
                continue
            name = f"seg-g{gen:08d}-{n:03d}.parquet"
            key_id = self._write_segment(self.root / name, scope, rows)
            segments[scope] = {"file": name, "rows": len(rows), "key_id": key_id}
            faults.reached("flush.after_segment")
        manifest = {"format": "keyshred-partition/1", "gen": gen, "segments": segments}
        tmp = self.root / "MANIFEST.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, json.dumps(manifest, sort_keys=True).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self._manifest_path())
        _fsync_dir(self.root)
        faults.reached("flush.after_manifest")
        assert self._log is not None  # noqa: S101
        self._log.close()
        self._gen, self._segments, self._dirty = gen, segments, set()
        self._pending = 0
        self._cleanup()
        self._log = AppendLog(
            self.root / f"log-{gen + 1:08d}.ksl",
            gen + 1,
            self.subject_ref,
            self._sealer,
            fsync=self._fsync,
        )
        self._manifest_stat = self._stat_manifest()

    def _write_segment(self, path: Path, scope: str, rows: list[MemoryRow]) -> str:
        rows = sorted(rows, key=lambda r: r.memory_id)
        kwargs: dict[str, Any] = {"write_page_checksum": True}
        key_id = ""
        mac_key = b"\x00" * 32
        if self._pme is not None:
            # Never create a key here: rows reach a flush only after a put created
            # their scope key. If it is gone the subject was crypto-erased, and
            # writing the rows under a fresh key would bring them back.
            dek = self._keyring.data_key(self.subject_ref, scope, create=False)
            key_id = dek.key_id.hex()
            mac_key = dek.derive(_MAC_LABEL)
            kwargs["encryption_properties"] = self._pme.encryption(dek.key_id, ENCRYPTED_COLUMNS)
        n = len(rows)
        cols: dict[str, list[Any]] = {
            "memory_id": [r.memory_id for r in rows],
            "subject_ref": [self.subject_ref] * n,
            "scope": [scope] * n,
            "purpose": [r.purpose for r in rows],
            "category": [r.category for r in rows],
            "created_at": [r.created_us for r in rows],
            "updated_at": [r.updated_us for r in rows],
            "retain_until": [r.retain_us for r in rows],
            "status": ["live"] * n,
            "lookup": [r.lookup for r in rows],
            "sources": [list(r.sources) for r in rows],
            "mentions": [list(r.mentions) for r in rows],
            "index_fields": [list(r.index) for r in rows],
            # A sealed row: its ciphertext, byte for byte (an opaque row's is all
            # there is); its names inside it unless it is a derived asset.
            "namespace": [
                "" if r.sealed is not None and _names_sealed(r) else json.dumps(list(r.namespace))
                for r in rows
            ],
            "key": ["" if r.sealed is not None and _names_sealed(r) else r.key for r in rows],
            "value": [r.value if r.sealed is None else r.sealed for r in rows],
        }
        mac = self._columns_mac(mac_key, cols)
        arrays = [
            pa.array(cols[f.name], pa.int64()).cast(f.type)
            if pa.types.is_timestamp(f.type)
            else pa.array(cols[f.name], f.type)
            for f in SCHEMA
        ]
        table = pa.Table.from_arrays(arrays, schema=SCHEMA.with_metadata({_MAC_META: mac}))
        tmp = path.with_suffix(".tmp")
        pq.write_table(table, tmp, **kwargs)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
        return key_id

    # -- erasure -------------------------------------------------------------------

    def drop(self) -> int:
        """Delete the whole partition folder, holding its lock (writers in other
        processes wait, then find the subject suppressed); returns files removed."""
        with self.lock:
            if not self.root.exists():
                self._close_files()
                self.rows, self.opaque, self.loaded, self.dropped = {}, {}, False, True
                return 0
            with self.flocked(refresh=False):
                files = sorted(p for p in self.root.rglob("*") if p.is_file())
                n = len(files)
                # One by one (the lock file with the folder, last): a kill midway
                # leaves a partial folder, which the resumed erasure drops again.
                for i, path in enumerate(p for p in files if p.name != "LOCK"):
                    path.unlink(missing_ok=True)
                    if i == 0:
                        faults.reached("drop.after_first_file")
                shutil.rmtree(self.root, ignore_errors=True)
                self.dropped = True
            self._close_files()
            self.rows, self.opaque = {}, {}
            self._parsed = {}
            self.loaded = False
            self._lookup_key = None
            return n

    def drop_scope(self, scope: str) -> int:
        """Remove one scope's rows and files (scope erasure); returns rows removed."""
        with self.flocked():
            doomed = [r for r in self.all_rows() if r.scope == scope]
            for r in doomed:
                self.rows.pop(r.lookup, None)
                self.opaque.pop(r.lookup, None)
            self._dirty.add(scope)
            # The log may hold this scope's records: a flush rewrites what remains
            # and deletes the log, so no file keeps the scope's bytes.
            self.flush()
            return len(doomed)

    def _close_files(self) -> None:
        if self._log is not None:
            self._log.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def close(self) -> None:
        with self.lock:
            self._close_files()
            self.rows, self.opaque = {}, {}
            self._parsed = {}
            self.loaded = False
            self._lookup_key = None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
