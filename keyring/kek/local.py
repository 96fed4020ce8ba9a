"""The local KEK provider: epochs kept in one key file (mode 0600) next to the data.

This is the embedded default. It protects against copies of the data folder that
leave the key file behind (backups to another place, a stolen image of the data
volume); it does not protect against someone who can read the key file itself, which
is why the distributed profile uses Vault/OpenBao or AWS KMS.

File format (JSON): ``{"format": "keyshred-local-kek/1", "current": N, "epochs":
{"N": {"key": base64, "created": iso8601}}}``. Writes are atomic (temp file, fsync,
rename) and serialized with ``flock`` so several processes may share one folder.
Destroying an epoch rewrites the file without it; the old bytes are then in no file
(a filesystem may keep freed blocks until reused, which only a KMS-backed profile
avoids).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import struct
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from keyshred.errors import ConfigError, IntegrityError, KekEpochDestroyed
from keyshred.keyring import _primitives as prim
from keyshred.keyring.kek import (
    Context,
    DestroyedEpoch,
    EpochInfo,
    KekProvider,
    WrappedKey,
    encode_context,
)

__all__ = ["LocalKek"]

_FORMAT = "keyshred-local-kek/1"
_AAD_DOMAIN = b"keyshred/kek-local\x00"
_EPOCH = struct.Struct(">I")
_BLOB_BYTES = prim.NONCE_BYTES + prim.KEY_BYTES + prim.TAG_BYTES


class LocalKek(KekProvider):
    """KEK epochs in a local key file."""

    name = "local"

    def __init__(self, path: str | os.PathLike[str], *, create: bool = False) -> None:
        self._path = Path(path)
        self._lock_path = self._path.with_name(self._path.name + ".lock")
        self._mutex = threading.Lock()
        self._keys: dict[int, prim.AESGCM] = {}
        self._created: dict[int, datetime] = {}
        self._current = 0
        if create and not self._path.exists():
            self._path.parent.mkdir(parents=True, exist_ok=True)
            with self._locked():
                if not self._path.exists():
                    self._write({"format": _FORMAT, "current": 0, "epochs": {}}, new_epoch=True)
        self._load()

    # -- file handling -------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _read(self) -> dict[str, Any]:
        try:
            raw = self._path.read_bytes()
        except FileNotFoundError:
            raise ConfigError(
                f"no local KEK file at {self._path}; run 'keyshred init' first"
            ) from None
        try:
            doc = json.loads(raw)
        except ValueError:
            raise IntegrityError("the local KEK file is not valid JSON") from None
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
            raise IntegrityError("the local KEK file has an unknown format")
        return doc

    def _write(self, doc: dict[str, Any], *, new_epoch: bool = False) -> None:
        if new_epoch:
            epoch = int(doc["current"]) + 1
            doc["epochs"][str(epoch)] = {
                "key": base64.b64encode(prim.random_key()).decode("ascii"),
                "created": datetime.now(UTC).isoformat(),
            }
            doc["current"] = epoch
        tmp = self._path.with_name(self._path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, json.dumps(doc, sort_keys=True).encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self._path)
        dir_fd = os.open(self._path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def _load(self) -> None:
        doc = self._read()
        keys: dict[int, prim.AESGCM] = {}
        created: dict[int, datetime] = {}
        try:
            for name, entry in doc["epochs"].items():
                raw = base64.b64decode(entry["key"], validate=True)
                if len(raw) != prim.KEY_BYTES:
                    raise ValueError
                keys[int(name)] = prim.new_aead(raw)
                created[int(name)] = datetime.fromisoformat(entry["created"])
            current = int(doc["current"])
        except (KeyError, TypeError, ValueError):
            raise IntegrityError("the local KEK file is malformed") from None
        if current not in keys:
            raise IntegrityError("the local KEK file has no current epoch")
        with self._mutex:
            self._keys, self._created, self._current = keys, created, current

    # -- provider interface --------------------------------------------------------

    def current_epoch(self) -> int:
        return self._current

    def epochs(self) -> list[EpochInfo]:
        with self._mutex:
            return [EpochInfo(e, self._created[e]) for e in sorted(self._keys)]

    def _aead(self, epoch: int) -> prim.AESGCM:
        aead = self._keys.get(epoch)
        if aead is None:
            self._load()  # another process may have rotated since we read the file
            aead = self._keys.get(epoch)
            if aead is None:
                raise KekEpochDestroyed(f"KEK epoch {epoch} of the local provider is destroyed")
        return aead

    def wrap(self, key: bytes, context: Context) -> WrappedKey:
        epoch = self._current
        nonce = prim.random_nonce()
        aad = _AAD_DOMAIN + _EPOCH.pack(epoch) + encode_context(context)
        return WrappedKey(epoch, nonce + self._keys[epoch].encrypt(nonce, key, aad))

    def unwrap(self, wrapped: WrappedKey, context: Context) -> bytes:
        aead = self._aead(wrapped.epoch)
        blob = wrapped.blob
        if len(blob) != _BLOB_BYTES:
            raise IntegrityError("wrapped key failed authentication")
        aad = _AAD_DOMAIN + _EPOCH.pack(wrapped.epoch) + encode_context(context)
        try:
            return aead.decrypt(blob[: prim.NONCE_BYTES], blob[prim.NONCE_BYTES :], aad)
        except prim.InvalidTag:
            raise IntegrityError("wrapped key failed authentication") from None

    def rotate(self) -> int:
        with self._locked():
            doc = self._read()
            self._write(doc, new_epoch=True)
        self._load()
        return self._current

    def destroy_epochs_before(self, epoch: int) -> list[DestroyedEpoch]:
        with self._locked():
            doc = self._read()
            live = {int(e) for e in doc["epochs"]}
            if epoch not in live:
                raise ConfigError(f"epoch {epoch} is not a live epoch of the local provider")
            doomed = sorted(e for e in live if e < epoch)
            for e in doomed:
                del doc["epochs"][str(e)]
            if doomed:
                self._write(doc)
        self._load()
        now = datetime.now(UTC)
        return [DestroyedEpoch(e, now) for e in doomed]

    def __repr__(self) -> str:
        return f"LocalKek(path={str(self._path)!r}, current_epoch={self._current})"
