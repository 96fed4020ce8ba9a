"""The partition store on S3: ``s3://bucket/prefix`` through ``pyarrow.fs``.

Segments are read and written by pyarrow's ``S3FileSystem`` (the same code path as
a folder, ``keyshred.storage.objects``). What pyarrow's layer cannot do is see
object versions: on a versioned bucket a deleted object leaves its earlier versions
(and a delete marker) behind, and an erasure must remove every one of them. Listing
and deleting versions goes through boto3 (``keyshred[aws]``), on the same endpoint,
region and credentials chain.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

from keyshred._extras import require
from keyshred.errors import ConfigError
from keyshred.storage.objects import ObjectStore

__all__ = ["open_partition_store", "s3_storage_options", "split_s3_uri"]

_BATCH = 1000  # DeleteObjects takes at most 1,000 keys


def split_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> (bucket, prefix without slashes at its ends)."""
    parts = urlsplit(uri)
    if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
        raise ConfigError("an S3 location is s3://bucket/prefix")
    return parts.netloc, parts.path.strip("/")


def open_partition_store(
    uri: str | None,
    default: Path,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    addressing_style: str = "path",
) -> ObjectStore:
    """The partition store ``uri`` names: a folder (``default`` when None) or an
    S3 prefix reached through the [s3] settings."""
    if uri is None:
        return ObjectStore.folder(default)
    if not uri.startswith("s3://"):
        if "://" in uri:
            raise ConfigError("storage.uri is a folder or s3://bucket/prefix")
        return ObjectStore.folder(Path(uri))
    bucket, prefix = split_s3_uri(uri)
    import pyarrow.fs as pafs

    kwargs: dict[str, Any] = {"force_virtual_addressing": addressing_style == "virtual"}
    if region:
        kwargs["region"] = region
    if endpoint_url:
        parts = urlsplit(endpoint_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError("s3.endpoint_url is http(s)://host[:port]")
        kwargs["endpoint_override"] = parts.netloc
        kwargs["scheme"] = parts.scheme
    fs = pafs.S3FileSystem(**kwargs)
    base = f"{bucket}/{prefix}" if prefix else bucket
    versions = _Versions(bucket, prefix, endpoint_url, region, addressing_style)
    return ObjectStore(
        fs,
        base,
        url=uri,
        versions=versions.list,
        purge_versions=versions.purge,
        purge_object=versions.purge_object,
        endpoint_url=endpoint_url,
    )


class _Versions:
    """Every version of the objects under a prefix, through boto3 (lazily built)."""

    def __init__(
        self,
        bucket: str,
        prefix: str,
        endpoint_url: str | None,
        region: str | None,
        addressing_style: str,
    ) -> None:
        self._bucket = bucket
        self._prefix = prefix
        self._endpoint = endpoint_url
        self._region = region
        self._style = addressing_style
        self._client: Any = None

    def _s3(self) -> Any:
        if self._client is None:
            boto3 = require("boto3", extra="aws")
            from botocore.config import Config as BotoConfig

            self._client = boto3.client(
                "s3",
                endpoint_url=self._endpoint,
                region_name=self._region,
                config=BotoConfig(s3=cast(Any, {"addressing_style": self._style})),
            )
        return self._client

    def _key(self, prefix: str) -> str:
        return f"{self._prefix}/{prefix}/" if self._prefix else f"{prefix}/"

    def list(self, prefix: str) -> list[tuple[str, str]]:
        """(key relative to the store, version id) of every version and delete
        marker under ``prefix`` (an unversioned bucket: version id ``"null"``)."""
        start = len(self._prefix) + 1 if self._prefix else 0
        out = []
        pages = self._s3().get_paginator("list_object_versions")
        for page in pages.paginate(Bucket=self._bucket, Prefix=self._key(prefix)):
            for item in [*page.get("Versions", []), *page.get("DeleteMarkers", [])]:
                out.append((str(item["Key"])[start:], str(item["VersionId"])))
        return sorted(out)

    def purge_object(self, key: str) -> int:
        """Delete every version and delete marker of the one object ``key`` (a
        segment is never overwritten: every version of its name is garbage once it
        is deleted, and a plain delete on a versioned bucket keeps them all)."""
        full = f"{self._prefix}/{key}" if self._prefix else key
        found = []
        pages = self._s3().get_paginator("list_object_versions")
        for page in pages.paginate(Bucket=self._bucket, Prefix=full):
            for item in [*page.get("Versions", []), *page.get("DeleteMarkers", [])]:
                if item["Key"] == full:
                    found.append({"Key": full, "VersionId": str(item["VersionId"])})
        return self._delete(found)

    def _delete(self, batch_items: Sequence[dict[str, str]]) -> int:
        client = self._s3()
        for i in range(0, len(batch_items), _BATCH):
            answer = client.delete_objects(
                Bucket=self._bucket,
                Delete={"Objects": batch_items[i : i + _BATCH], "Quiet": True},
            )
            if answer.get("Errors"):
                raise OSError(f"S3 refused to delete {len(answer['Errors'])} object versions")
        return len(batch_items)

    def purge(self, prefix: str) -> int:
        """Delete every version and delete marker under ``prefix``; returns how many."""
        full = (lambda key: f"{self._prefix}/{key}") if self._prefix else (lambda key: key)
        return self._delete(
            [{"Key": full(key), "VersionId": version} for key, version in self.list(prefix)]
        )


def s3_storage_options(
    endpoint_url: str | None, region: str | None, addressing_style: str
) -> dict[str, str]:
    """LanceDB's ``storage_options`` for the same S3 service (its object_store
    reads credentials from the same AWS chain): only to import vector datasets of
    the layout before revision 0013 from an ``s3://`` ``vectors.uri``."""
    options: dict[str, str] = {}
    if endpoint_url:
        options["aws_endpoint"] = endpoint_url
        if endpoint_url.startswith("http://"):
            options["allow_http"] = "true"
    if region:
        options["aws_region"] = region
    if addressing_style == "virtual":
        options["aws_virtual_hosted_style_request"] = "true"
    return options
