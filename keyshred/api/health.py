"""Liveness and readiness: ``/healthz`` (the process answers) and ``/readyz`` (the
catalog database, the KEK provider and the object store answer).

Each readiness check is a small real round trip: ``SELECT 1`` on the catalog, a
wrap and unwrap of a random throwaway key by the KEK provider (a Transit or KMS
call on the shared profile), and a look-up on the partition store (the folder is
a writable directory; on S3 the bucket exists, one request). A failure names the
component and the error's class, never its message (it may carry a URL or
credentials).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa

from keyshred.facade import MEMORIES_DIR
from keyshred.storage.s3 import open_partition_store

if TYPE_CHECKING:
    from keyshred.facade import Keyshred
    from keyshred.storage.objects import ObjectStore

__all__ = ["Readiness"]

_CONTEXT = {"purpose": "readiness-check"}


class Readiness:
    def __init__(self, ks: Keyshred) -> None:
        self._ks = ks
        s3 = ks.config.s3
        self._objects: ObjectStore = open_partition_store(
            ks.config.storage.uri,
            ks.path / MEMORIES_DIR,
            endpoint_url=s3.endpoint_url,
            region=s3.region,
            addressing_style=s3.addressing_style,
        )

    def check(self) -> dict[str, str]:
        """``{component: "ok" | error class}`` for catalog, kek and objects."""
        return {
            "catalog": self._try(self._catalog),
            "kek": self._try(self._kek),
            "objects": self._try(self._object_store),
        }

    @staticmethod
    def _try(check: Callable[[], None]) -> str:
        try:
            check()
        except Exception as exc:  # noqa: BLE001 - any failure makes the component unready
            return type(exc).__name__
        return "ok"

    def _catalog(self) -> None:
        with self._ks.catalog.engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))

    def _kek(self) -> None:
        kek = self._ks.keyring.kek
        key = os.urandom(32)
        if kek.unwrap(kek.wrap(key, _CONTEXT), _CONTEXT) != key:
            raise RuntimeError("the KEK provider unwrapped another key")

    def _object_store(self) -> None:
        objects = self._objects
        base = objects.path("")
        if objects.local:
            # The folder, or (before the first segment is written) the nearest
            # existing folder above it, must be a writable directory.
            folder = Path(base)
            while not folder.exists() and folder != folder.parent:
                folder = folder.parent
            if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
                raise NotADirectoryError("the partition folder is not a writable directory")
            return
        import pyarrow.fs as pafs

        bucket = base.split("/", 1)[0]
        if objects.fs.get_file_info(bucket).type != pafs.FileType.Directory:
            raise FileNotFoundError("the partition bucket does not exist")
