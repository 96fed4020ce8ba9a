"""Where backups go: a local folder (embedded default) or an S3 prefix.

A target is a flat object store with five verbs; everything a backup writes is
either ciphertext (partition segments, the sealed key store) or pseudonymous
metadata (the catalog snapshot, manifests, tombstones). ``put_file`` and
``put_bytes`` are atomic per object: a reader sees the whole object or none.

``delete_prefix`` removes *every version*: on a versioned S3 bucket a plain delete
only adds a delete marker and the old bytes stay retrievable, which would make an
erasure from backups a lie.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from keyshred._extras import require
from keyshred.errors import ConfigError, KeyshredError, NotFound

__all__ = ["BackupTarget", "LocalTarget", "S3Target", "open_target"]

Progress = Callable[[int], None]
_CHUNK = 1 << 20


class BackupTarget(ABC):
    """A flat object store for backup objects (keys are ``/``-separated)."""

    url: str

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def put_file(self, key: str, path: Path, progress: Progress | None = None) -> None: ...

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """The object's bytes; ``NotFound`` if there is none."""

    @abstractmethod
    def get_file(self, key: str, dest: Path, progress: Progress | None = None) -> None:
        """Download to ``dest``; ``NotFound`` if there is none."""

    @abstractmethod
    def keys(self, prefix: str) -> list[str]:
        """Every key under ``prefix`` (current versions), sorted."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Delete every object and every version under ``prefix``; how many."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release connections."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def _kernel_copy(src: Any, out: Any) -> None:
    out.flush()
    size = os.fstat(src.fileno()).st_size
    sent = 0
    try:
        while sent < size:
            n = os.sendfile(out.fileno(), src.fileno(), sent, min(size - sent, 1 << 30))
            if n == 0:
                break
            sent += n
    except OSError:
        src.seek(sent)
        out.seek(sent)
        shutil.copyfileobj(src, out, _CHUNK)


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise KeyshredError(f"invalid backup object key {key!r}")
    return key


def _make_root(root: Path) -> None:
    """Create the target folder now, so that a path that cannot hold one (a file, a
    read-only or virtual file system) is a ``ConfigError`` before any work is done."""
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise  # a full disk, not a wrong path: the facade types it StorageFull
        raise ConfigError(
            f"cannot use {root} as a backup folder: {exc.strerror or type(exc).__name__}"
        ) from None


class LocalTarget(BackupTarget):
    """A folder (ideally on another disk or a mounted remote file system)."""

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.root = Path(root)
        self.url = str(self.root)
        self._fsync = fsync
        _make_root(self.root)

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    @contextlib.contextmanager
    def _atomic(self, key: str) -> Iterator[Any]:
        final = self._path(key)
        final.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as out:
                yield out
                out.flush()
                if self._fsync:
                    os.fsync(out.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def put_file(self, key: str, path: Path, progress: Progress | None = None) -> None:
        with self._atomic(key) as out, path.open("rb") as src:
            # In-kernel copy (sendfile / copy_file_range): the bytes never pass
            # through Python; progress is reported per file.
            _kernel_copy(src, out)
            if progress is not None:
                progress(os.fstat(src.fileno()).st_size)

    def put_bytes(self, key: str, data: bytes) -> None:
        with self._atomic(key) as out:
            out.write(data)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise NotFound(f"backup object {key} does not exist") from None

    def get_file(self, key: str, dest: Path, progress: Progress | None = None) -> None:
        src = self._path(key)
        if not src.is_file():
            raise NotFound(f"backup object {key} does not exist")
        dest.parent.mkdir(parents=True, exist_ok=True)
        with src.open("rb") as inp, dest.open("wb") as out:
            while chunk := inp.read(_CHUNK):
                out.write(chunk)
                if progress is not None:
                    progress(len(chunk))

    def keys(self, prefix: str) -> list[str]:
        base = self.root / prefix if prefix else self.root
        if not base.exists():
            return []
        out = []
        for p in base.rglob("*"):
            if p.is_file() and not p.name.endswith(".tmp"):
                out.append(p.relative_to(self.root).as_posix())
        return sorted(out)

    def delete_prefix(self, prefix: str) -> int:
        base = self.root / _check_key(prefix.rstrip("/"))
        if not base.exists():
            return 0
        if base.is_file():
            base.unlink()
            return 1
        n = sum(1 for p in base.rglob("*") if p.is_file())
        shutil.rmtree(base)
        return n


class S3Target(BackupTarget):
    """An S3 bucket and prefix through boto3 (``keyshred[aws]``); multipart above
    ``multipart_mb``; versioned buckets handled by deleting every version."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        multipart_mb: int = 16,
        client: Any = None,
    ) -> None:
        boto3 = require("boto3", extra="aws")
        from boto3.s3.transfer import TransferConfig

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.endpoint_url = endpoint_url  # a copy from the same service is server side
        self._client = client or boto3.client("s3", endpoint_url=endpoint_url, region_name=region)
        self._transfer = TransferConfig(
            multipart_threshold=multipart_mb << 20, multipart_chunksize=multipart_mb << 20
        )
        self._errors = require("botocore.exceptions", extra="aws")

    def _key(self, key: str) -> str:
        _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _strip(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    def _missing(self, exc: Exception) -> bool:
        code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
        return code in ("404", "NoSuchKey", "NotFound")

    def _call(self, fn: Callable[..., Any], **kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except self._errors.ClientError as exc:
            if self._missing(exc):
                raise NotFound(f"backup object {kwargs.get('Key', '')} does not exist") from None
            code = exc.response.get("Error", {}).get("Code", "error")
            raise KeyshredError(f"S3 {fn.__name__} failed: {code}") from None
        except self._errors.BotoCoreError as exc:
            raise KeyshredError(f"S3 is unreachable: {type(exc).__name__}") from None

    def exists(self, key: str) -> bool:
        try:
            self._call(self._client.head_object, Bucket=self.bucket, Key=self._key(key))
        except NotFound:
            return False
        return True

    def put_file(self, key: str, path: Path, progress: Progress | None = None) -> None:
        self._call(
            self._client.upload_file,
            Filename=str(path),
            Bucket=self.bucket,
            Key=self._key(key),
            Config=self._transfer,
            Callback=progress,
        )

    def copy_from(self, bucket: str, source: str, key: str) -> None:
        """Copy an object of the same service into ``key`` server side (nothing
        passes through this process; multipart above ``multipart_mb``).
        ``NotFound`` if the source is gone."""
        self._call(
            self._client.copy,
            CopySource={"Bucket": bucket, "Key": source},
            Bucket=self.bucket,
            Key=self._key(key),
            Config=self._transfer,
        )

    def put_bytes(self, key: str, data: bytes) -> None:
        self._call(self._client.put_object, Bucket=self.bucket, Key=self._key(key), Body=data)

    def get_bytes(self, key: str) -> bytes:
        answer = self._call(self._client.get_object, Bucket=self.bucket, Key=self._key(key))
        return bytes(answer["Body"].read())

    def get_file(self, key: str, dest: Path, progress: Progress | None = None) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._call(
                self._client.download_file,
                Bucket=self.bucket,
                Key=self._key(key),
                Filename=str(dest),
                Config=self._transfer,
                Callback=progress,
            )
        except KeyshredError:
            if not self.exists(key):
                raise NotFound(f"backup object {key} does not exist") from None
            raise

    def keys(self, prefix: str) -> list[str]:
        full = (
            self._key(prefix.rstrip("/")) + "/"
            if prefix
            else (self.prefix + "/" if self.prefix else "")
        )
        out: list[str] = []
        token: str | None = None
        while True:
            args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full}
            if token:
                args["ContinuationToken"] = token
            page = self._call(self._client.list_objects_v2, **args)
            out += [self._strip(o["Key"]) for o in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return sorted(out)
            token = page["NextContinuationToken"]

    def delete_prefix(self, prefix: str) -> int:
        full = self._key(prefix.rstrip("/"))
        n = 0
        for exact in (full, full + "/"):
            args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": exact}
            while True:
                page = self._call(self._client.list_object_versions, **args)
                doomed = [
                    {"Key": v["Key"], "VersionId": v["VersionId"]}
                    for kind in ("Versions", "DeleteMarkers")
                    for v in page.get(kind, [])
                    if exact.endswith("/") or v["Key"] == exact
                ]
                for start in range(0, len(doomed), 1000):
                    part = doomed[start : start + 1000]
                    self._call(
                        self._client.delete_objects,
                        Bucket=self.bucket,
                        Delete={"Objects": part, "Quiet": True},
                    )
                n += sum(1 for d in doomed)
                if not page.get("IsTruncated"):
                    break
                args["KeyMarker"] = page.get("NextKeyMarker")
                args["VersionIdMarker"] = page.get("NextVersionIdMarker")
        return n

    def versions(self, prefix: str) -> int:
        """How many object versions and delete markers exist under ``prefix``
        (what a test checks after an erasure)."""
        page = self._call(
            self._client.list_object_versions, Bucket=self.bucket, Prefix=self._key(prefix)
        )
        return len(page.get("Versions", [])) + len(page.get("DeleteMarkers", []))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._client.close()


def open_target(
    url: str,
    *,
    fsync: bool = True,
    endpoint_url: str | None = None,
    region: str | None = None,
    multipart_mb: int = 16,
) -> BackupTarget:
    """``s3://bucket/prefix`` or a folder path."""
    if url.startswith("s3://"):
        parsed = urlparse(url)
        if not parsed.netloc:
            raise ConfigError(f"backup target {url!r} names no bucket")
        return S3Target(
            parsed.netloc,
            parsed.path,
            endpoint_url=endpoint_url,
            region=region,
            multipart_mb=multipart_mb,
        )
    if "://" in url:
        raise ConfigError("a backup target is a folder path or s3://bucket/prefix")
    return LocalTarget(url, fsync=fsync)
