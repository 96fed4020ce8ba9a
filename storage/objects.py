"""Where partition segments live: a folder or an object-store prefix, one code path.

Every segment is written, read, listed and deleted through pyarrow's filesystem
layer (``pyarrow.fs``): ``LocalFileSystem`` for a folder (the embedded profile),
``S3FileSystem`` for ``s3://bucket/prefix``. Objects are immutable: a name is
written once and never overwritten, so there is no rename and no partial object
that the catalog names (a crash mid-write leaves an object no segment row names,
which the next compaction of that subject removes).

On a folder a written object is fsync'd before the catalog commit that publishes
it (the catalog then deletes the hot rows it folded) and made owner-only.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

__all__ = ["ObjectStore"]


class ObjectStore:
    """Objects under one base path of one ``pyarrow.fs`` filesystem; keys are
    relative to the base, with ``/`` separators."""

    def __init__(
        self,
        fs: pafs.FileSystem,
        base: str,
        *,
        url: str,
        versions: Callable[[str], list[tuple[str, str]]] | None = None,
        purge_versions: Callable[[str], int] | None = None,
        purge_object: Callable[[str], int] | None = None,
        endpoint_url: str | None = None,
    ) -> None:
        self.fs = fs
        self.endpoint_url = endpoint_url  # on S3: the service (None: AWS itself)
        self._base = base.rstrip("/")
        self.url = url  # what a receipt may name (no credentials: they never enter it)
        self.local = isinstance(fs, pafs.LocalFileSystem)
        # On a versioned bucket, listing and deleting every version of a prefix (a
        # deleted object's older versions are still there): see keyshred.storage.s3.
        self._versions = versions
        self._purge_versions = purge_versions
        self._purge_object = purge_object

    @classmethod
    def folder(cls, root: Path) -> ObjectStore:
        root = root.resolve()
        return cls(pafs.LocalFileSystem(), str(root), url=str(root))

    def path(self, key: str) -> str:
        return f"{self._base}/{key}" if key else self._base

    def write_table(self, key: str, table: pa.Table, **kwargs: Any) -> tuple[int, str]:
        """Write ``table`` as one Parquet object (durable when this returns);
        returns its size and SHA-256 (what a backup copies it by)."""
        # Serialised in memory first: the digest is of exactly the bytes stored, and
        # the object is one PUT (no multipart upload of a stream on a bucket).
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, **kwargs)
        data = sink.getvalue()
        self.put_bytes(key, data)
        return data.size, hashlib.sha256(memoryview(data)).hexdigest()

    def put_bytes(self, key: str, data: pa.Buffer | bytes) -> None:
        """Write one object (durable when this returns)."""
        path = self.path(key)
        if self.local:
            Path(path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # One stream per object: no directory markers on a bucket, no rename.
        with self.fs.open_output_stream(path) as out:
            out.write(data)
        if self.local:
            os.chmod(path, 0o600)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            fd = os.open(Path(path).parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def open_stream(self, key: str) -> Any:
        """A sequential reader of the object; ``FileNotFoundError`` if it is gone."""
        return self.fs.open_input_stream(self.path(key))

    def s3_object(self, key: str) -> tuple[str, str] | None:
        """(bucket, object key) of ``key`` when the objects are on S3 (a backup to
        the same service copies them server side), else None."""
        if self.local or not self.url.startswith("s3://"):
            return None
        bucket, _, base = self.path(key).partition("/")
        return bucket, base

    def open_parquet(self, key: str, **kwargs: Any) -> pq.ParquetFile:
        """A Parquet reader of the object; ``FileNotFoundError`` if it is gone."""
        source = self.fs.open_input_file(self.path(key))
        return pq.ParquetFile(source, **kwargs)

    def list_keys(self, prefix: str) -> list[str]:
        """Keys of every object under ``prefix`` (a folder-like key), sorted."""
        selector = pafs.FileSelector(self.path(prefix), recursive=True, allow_not_found=True)
        start = len(self._base) + 1
        return sorted(info.path[start:] for info in self.fs.get_file_info(selector) if info.is_file)

    def list_dirs(self, prefix: str = "") -> list[str]:
        """Names of the folders (on a bucket: the common prefixes) right under
        ``prefix``, sorted."""
        selector = pafs.FileSelector(self.path(prefix), recursive=False, allow_not_found=True)
        return sorted(
            info.base_name
            for info in self.fs.get_file_info(selector)
            if info.type == pafs.FileType.Directory
        )

    def size(self, key: str) -> int:
        """The object's size in bytes; ``FileNotFoundError`` if it is gone."""
        info = self.fs.get_file_info(self.path(key))
        if not info.is_file:
            raise FileNotFoundError(key)
        return int(info.size)

    def exists(self, key: str) -> bool:
        return bool(self.fs.get_file_info(self.path(key)).is_file)

    def versions(self, prefix: str) -> list[tuple[str, str]]:
        """(key, version id) of every version of every object under ``prefix``,
        deleted ones too, on a versioned bucket; else each object once."""
        if self._versions is not None:
            return self._versions(prefix)
        return [(key, "") for key in self.list_keys(prefix)]

    def delete(self, key: str) -> None:
        """Delete one object; on a bucket every version of it (objects are never
        overwritten, so older versions of a deleted name are only residue)."""
        if self._purge_object is not None:
            self._purge_object(key)
            return
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(self.path(key))

    def delete_prefix(self, prefix: str, *, after_first: Callable[[], None] | None = None) -> int:
        """Delete every object (every version, on a versioned bucket) under
        ``prefix``, one by one; returns how many objects there were."""
        keys = self.list_keys(prefix)
        for i, key in enumerate(keys):
            self.delete(key)
            if i == 0 and after_first is not None:
                after_first()
        if self._purge_versions is not None:
            self._purge_versions(prefix)
        if self.local:
            with contextlib.suppress(FileNotFoundError, OSError):
                self.fs.delete_dir(self.path(prefix))
        return len(keys)
