"""The erasure drill: write a synthetic workload, erase one subject, prove it.

This is the main job (``keyshred drill``, ``make demo``). It grows with the product:
today it exercises the keyring (per-subject DEKs, crypto-erasure, tombstones, KEK
epochs); memories, vectors, tokens, checkpoints and backups join as they are built.

Every check is a real attempt to read what should be gone, timed, with pass/fail.
Probe strings are random per run so a byte scan cannot pass by luck.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sqlite3
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from keyshred.errors import IntegrityError, KeyshredError, SubjectErased
from keyshred.facade import Keyshred
from keyshred.keyring.envelope import Place
from keyshred.keyring.keyring import Keyring
from keyshred.keyring.keystore import SQLiteKeyStore

__all__ = ["DrillCheck", "DrillFailure", "DrillReport", "run_drill", "scan_bytes"]

SCOPES = ("default", "support/health")
_LEN = struct.Struct(">I")


class DrillFailure(KeyshredError):
    """A drill check found something that should be gone (or broken)."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise DrillFailure(message)


@dataclass(frozen=True, slots=True)
class DrillCheck:
    name: str
    passed: bool
    seconds: float
    detail: str


@dataclass(slots=True)
class DrillReport:
    path: str
    subjects: int
    records: int
    erased_subject_ref: str
    checks: list[DrillCheck] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def to_json(self) -> dict[str, object]:
        return {
            "path": self.path,
            "subjects": self.subjects,
            "records": self.records,
            "erased_subject_ref": self.erased_subject_ref,
            "passed": self.passed,
            "checks": [
                {"name": c.name, "passed": c.passed, "seconds": c.seconds, "detail": c.detail}
                for c in self.checks
            ],
        }


def scan_bytes(root: Path, needles: list[bytes]) -> list[tuple[str, int]]:
    """Every (file, needle index) where a needle occurs in a file under ``root``."""
    hits: list[tuple[str, int]] = []
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        data = file.read_bytes()
        hits.extend((str(file.relative_to(root)), i) for i, n in enumerate(needles) if n in data)
    return hits


def _write_records(file: Path, rows: list[tuple[str, str, str, bytes]]) -> None:
    """The drill's own ciphertext file: (subject_ref, scope, record id, ciphertext)."""
    with file.open("wb") as fh:
        for subject_ref, scope, record_id, blob in rows:
            for part in (subject_ref.encode(), scope.encode(), record_id.encode(), blob):
                fh.write(_LEN.pack(len(part)))
                fh.write(part)
        fh.flush()
        os.fsync(fh.fileno())


def _read_records(file: Path) -> Iterator[tuple[str, str, str, bytes]]:
    data = file.read_bytes()
    pos = 0
    while pos < len(data):
        parts = []
        for _ in range(4):
            (n,) = _LEN.unpack_from(data, pos)
            parts.append(data[pos + 4 : pos + 4 + n])
            pos += 4 + n
        yield parts[0].decode(), parts[1].decode(), parts[2].decode(), parts[3]


def run_drill(
    path: Path | None = None,
    *,
    subjects: int = 5,
    records: int = 50,
    progress: Callable[[str], None] = lambda _: None,
) -> DrillReport:
    """Run the drill in ``path`` (a fresh temporary folder when ``None``)."""
    if subjects < 2 or records < 1:
        raise KeyshredError("the drill needs at least 2 subjects and 1 record each")
    tmp = None
    if path is None:
        tmp = Path(tempfile.mkdtemp(prefix="keyshred-drill-"))
        path = tmp / "data"
    try:
        return _drill(path, subjects, records, progress)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _drill(
    path: Path, n_subjects: int, n_records: int, progress: Callable[[str], None]
) -> DrillReport:
    run = secrets.token_hex(6)
    ids = [f"drill-{run}-person-{i}@example.com" for i in range(n_subjects)]
    ks = Keyshred.init(path, exist_ok=True)
    refs = [ks.subject_ref(s) for s in ids]
    victim_ref = refs[0]
    report = DrillReport(str(path), n_subjects, n_subjects * n_records, victim_ref)

    def check(name: str, fn: Callable[[], str]) -> None:
        progress(name)
        start = time.perf_counter()
        try:
            detail, ok = fn(), True
        except KeyshredError as exc:
            detail, ok = str(exc) or type(exc).__name__, False
        report.checks.append(DrillCheck(name, ok, time.perf_counter() - start, detail))

    # -- workload ------------------------------------------------------------------
    progress("writing the workload")
    plaintexts: dict[tuple[str, str, str], bytes] = {}
    rows = []
    for subject, ref in zip(ids, refs, strict=True):
        for i in range(n_records):
            scope = SCOPES[i % len(SCOPES)]
            record_id = f"r{i:06d}"
            text = json.dumps(
                {"who": subject, "note": f"probe-{run}-{ref}-{i} likes green tea", "n": i}
            ).encode()
            place = Place(ref, scope, "drill", record_id, "value")
            rows.append((ref, scope, record_id, ks.keyring.seal(text, place)))
            plaintexts[(ref, scope, record_id)] = text
    records_file = path / "drill" / "records.bin"
    records_file.parent.mkdir(exist_ok=True)
    _write_records(records_file, rows)
    # An old copy of the key store, as a backup taken before the erasure would hold.
    old_keystore = path / "drill" / "keystore-before-erasure.db"
    _copy_sqlite(ks.keyring.store, old_keystore)
    victim_key_ids = [r.key_id for r in ks.keyring.store.for_subject(victim_ref)]

    # -- erase ---------------------------------------------------------------------
    progress("erasing one subject")
    start = time.perf_counter()
    result = ks.keyring.destroy(victim_ref)
    report.checks.append(
        DrillCheck(
            "crypto-erase (destroy DEKs, tombstone, evict caches)",
            result.verified and result.keys_destroyed == len(SCOPES),
            time.perf_counter() - start,
            f"{result.keys_destroyed} keys destroyed, tombstone {result.tombstone.tombstone_id}",
        )
    )

    def unwrap_fails() -> str:
        for key_id in victim_key_ids:
            try:
                ks.keyring.data_key_by_id(key_id)
            except SubjectErased:
                continue
            raise DrillFailure(f"key {key_id.hex()} still unwraps")
        return f"{len(victim_key_ids)} keys raise SubjectErased"

    def victim_unreadable() -> str:
        n = 0
        for ref, scope, record_id, blob in _read_records(records_file):
            if ref != victim_ref:
                continue
            try:
                ks.keyring.open(blob, Place(ref, scope, "drill", record_id, "value"))
            except SubjectErased:
                n += 1
                continue
            raise DrillFailure(f"record {record_id} still decrypts")
        return f"{n} ciphertexts refused before decryption"

    def others_intact() -> str:
        n = 0
        for ref, scope, record_id, blob in _read_records(records_file):
            if ref == victim_ref:
                continue
            got = ks.keyring.open(blob, Place(ref, scope, "drill", record_id, "value"))
            _require(got == plaintexts[(ref, scope, record_id)], f"record {record_id} differs")
            n += 1
        return f"{n} records of {n_subjects - 1} other subjects decrypt unchanged"

    def tampering_detected() -> str:
        ref, scope, record_id, blob = next(
            r for r in _read_records(records_file) if r[0] != victim_ref
        )
        flipped = bytearray(blob)
        flipped[-1] ^= 1
        for candidate, place in (
            (bytes(flipped), Place(ref, scope, "drill", record_id, "value")),
            (blob, Place(ref, scope, "drill", record_id + "x", "value")),
        ):
            try:
                ks.keyring.open(candidate, place)
            except IntegrityError:
                continue
            raise DrillFailure("a tampered or moved ciphertext decrypted")
        return "flipped byte and moved ciphertext both raise IntegrityError"

    def new_key_after_return() -> str:
        key = ks.keyring.data_key(victim_ref, "default")
        _require(key.key_id not in victim_key_ids, "an erased key id came back")
        return "a returning subject gets a new key id; old ciphertexts stay erased"

    def byte_scan() -> str:
        needles = [s.encode() for s in ids] + [f"probe-{run}".encode()]
        hits = scan_bytes(path, needles)
        _require(not hits, f"plaintext found in {sorted({h[0] for h in hits})}")
        files = sum(1 for p in path.rglob("*") if p.is_file())
        return f"{files} files scanned, no subject id or probe text"

    def old_keystore_after_epoch_destroyed() -> str:
        # Before: the pre-erasure key-store copy still unwraps the victim's key while
        # the old KEK epoch lives. That is the risk KEK epochs bound.
        old = Keyring(SQLiteKeyStore(old_keystore), ks.keyring.kek, cache_max_entries=0)
        try:
            old.data_key_by_id(victim_key_ids[0])
            rotation = ks.keyring.rotate_kek()
            ks.keyring.destroy_kek_epochs_before(rotation.new_epoch)
            try:
                old.data_key_by_id(victim_key_ids[0])
            except SubjectErased:
                return (
                    f"old copy unwrapped until epoch {rotation.new_epoch - 1} was destroyed; "
                    f"{rotation.keys_rewrapped} live keys re-wrapped"
                )
            raise DrillFailure("the old key store still unwraps the erased key")
        finally:
            old.store.close()

    check("erased keys no longer unwrap", unwrap_fails)
    check("erased subject's ciphertexts refused", victim_unreadable)
    check("other subjects intact", others_intact)
    check("tampering raises IntegrityError", tampering_detected)
    check("byte scan of the data folder", byte_scan)
    check("old key-store copy dies with its KEK epoch", old_keystore_after_epoch_destroyed)
    check("other subjects readable after KEK rotation", others_intact)
    check("returning subject starts fresh", new_key_after_return)
    ks.close()
    return report


def _copy_sqlite(store: object, dest: Path) -> None:
    if not isinstance(store, SQLiteKeyStore):
        raise KeyshredError("the drill's key-store copy needs the embedded key store")
    src = sqlite3.connect(store.path)
    dst = sqlite3.connect(dest)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()
    os.chmod(dest, 0o600)
