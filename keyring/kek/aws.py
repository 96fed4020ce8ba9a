"""KEK provider on AWS KMS (``pip install 'keyshred[aws]'``).

Each epoch is one symmetric KMS key named by an alias ``<prefix>/epoch-<N>``; the
highest live N is the current epoch. DEKs are wrapped with ``Encrypt`` and bound to
their context through KMS's ``EncryptionContext`` (pseudonymous names only: it shows
up in CloudTrail). KMS has no batch API, so the batch twins fan out on a thread pool.

Destroying an epoch disables its key at once, schedules its deletion (the pending
window, 7 days at least, counts towards a receipt's ``backup_final_date``) and removes
its alias. Real KMS refuses to decrypt with a disabled or pending-deletion key; moto's
server does not, so this provider also refuses by itself any epoch whose alias is gone
or whose key is not ``Enabled``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

from keyshred._extras import require
from keyshred.errors import (
    ConfigError,
    IntegrityError,
    InvalidInput,
    KekEpochDestroyed,
    KekError,
    KekUnavailable,
)
from keyshred.keyring.kek import (
    Context,
    DestroyedEpoch,
    EpochInfo,
    KekProvider,
    WrappedKey,
)
from keyshred.keyring.kek._quiet import key_operation

__all__ = ["AwsKmsKek"]

boto3 = require("boto3", extra="aws")
botocore_exceptions = require("botocore.exceptions", extra="aws", package="boto3")
botocore_config = require("botocore.config", extra="aws", package="boto3")

# Calls whose request or answer holds key material: botocore logs neither.
_KEY_OPERATIONS = frozenset({"encrypt", "decrypt", "re_encrypt", "generate_data_key"})
_DESTROYED_CODES = {"DisabledException", "KMSInvalidStateException", "NotFoundException"}


class AwsKmsKek(KekProvider):
    """KMS-backed KEK epochs, one KMS key per epoch behind an alias."""

    name = "aws"

    def __init__(
        self,
        *,
        alias_prefix: str = "alias/keyshred/kek",
        region: str | None = None,
        endpoint_url: str | None = None,
        pending_window_days: int = 7,
        workers: int = 8,
        client: Any = None,
        create: bool = True,
    ) -> None:
        if not alias_prefix.startswith("alias/"):
            raise InvalidInput("an AWS KMS alias prefix starts with 'alias/'")
        if not 7 <= pending_window_days <= 30:
            raise InvalidInput("KMS pending deletion windows are 7 to 30 days")
        self._prefix = alias_prefix.rstrip("/") + "/epoch-"
        self._window = pending_window_days
        # One attempt per call: retries with backoff and the circuit breaker are
        # keyshred's (keyring/kek/resilient.py), not stacked on botocore's own.
        self._kms = client or boto3.client(
            "kms",
            region_name=region,
            endpoint_url=endpoint_url,
            config=botocore_config.Config(retries={"total_max_attempts": 1}),
        )
        self._lock = threading.Lock()
        self._epochs: dict[int, str] = {}  # epoch -> key id
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="ks-kms")
        # Nothing is asked of KMS here (the first call that needs an epoch lists the
        # aliases and, if asked, creates epoch 1), so a process opens while KMS is
        # unreachable and is served once it is back, without a restart.
        self._create = create
        self._ready = False
        self._ready_lock = threading.Lock()

    def _prepare(self) -> None:
        if self._ready:
            return
        with self._ready_lock:
            if self._ready:
                return
            self._refresh()
            if not self._epochs:
                if not self._create:
                    raise ConfigError(f"no KMS key behind {self._prefix}*")
                self._create_epoch(1)
            self._ready = True

    # -- plumbing ------------------------------------------------------------------

    def _call(self, op: str, **kwargs: Any) -> dict[str, Any]:
        quiet = key_operation() if op in _KEY_OPERATIONS else contextlib.nullcontext()
        try:
            with quiet:
                result: dict[str, Any] = getattr(self._kms, op)(**kwargs)
            return result
        except botocore_exceptions.ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code == "InvalidCiphertextException":
                raise IntegrityError("wrapped key failed authentication") from None
            if code in _DESTROYED_CODES:
                raise KekEpochDestroyed("the KMS key of this KEK epoch is destroyed") from None
            if code in {"AccessDeniedException", "UnrecognizedClientException"}:
                raise KekUnavailable("AWS KMS refused our credentials") from None
            raise KekError(f"AWS KMS {op} failed: {code or 'unknown error'}") from None
        except botocore_exceptions.BotoCoreError:
            raise KekUnavailable("cannot reach AWS KMS") from None

    def _refresh(self) -> None:
        epochs: dict[int, str] = {}
        marker: str | None = None
        while True:
            page = self._call("list_aliases", **({"Marker": marker} if marker else {}))
            for alias in page.get("Aliases", []):
                name = alias.get("AliasName", "")
                if name.startswith(self._prefix) and alias.get("TargetKeyId"):
                    suffix = name[len(self._prefix) :]
                    if suffix.isdigit():
                        epochs[int(suffix)] = alias["TargetKeyId"]
            if not page.get("Truncated"):
                break
            marker = page["NextMarker"]
        with self._lock:
            self._epochs = epochs

    def _create_epoch(self, epoch: int) -> None:
        meta = self._call(
            "create_key",
            Description=f"keyshred KEK epoch {epoch}",
            KeyUsage="ENCRYPT_DECRYPT",
            KeySpec="SYMMETRIC_DEFAULT",
        )["KeyMetadata"]
        self._call(
            "create_alias", AliasName=f"{self._prefix}{epoch:06d}", TargetKeyId=meta["KeyId"]
        )
        self._refresh()

    def _key_for(self, epoch: int) -> str:
        self._prepare()
        key_id = self._epochs.get(epoch)
        if key_id is None:
            self._refresh()
            key_id = self._epochs.get(epoch)
        if key_id is None:
            raise KekEpochDestroyed(f"KEK epoch {epoch} of the KMS provider is destroyed")
        return key_id

    # -- provider interface --------------------------------------------------------

    def current_epoch(self) -> int:
        self._prepare()
        if not self._epochs:
            self._refresh()
        return max(self._epochs)

    def epochs(self) -> list[EpochInfo]:
        self._prepare()
        self._refresh()
        out = []
        for epoch, key_id in sorted(self._epochs.items()):
            meta = self._call("describe_key", KeyId=key_id)["KeyMetadata"]
            if meta.get("KeyState") == "Enabled":
                created = meta["CreationDate"]
                out.append(EpochInfo(epoch, created.astimezone(UTC)))
        return out

    def wrap(self, key: bytes, context: Context) -> WrappedKey:
        epoch = self.current_epoch()
        result = self._call(
            "encrypt", KeyId=self._key_for(epoch), Plaintext=key, EncryptionContext=dict(context)
        )
        return WrappedKey(epoch, bytes(result["CiphertextBlob"]))

    def unwrap(self, wrapped: WrappedKey, context: Context) -> bytes:
        key_id = self._key_for(wrapped.epoch)
        result = self._call(
            "decrypt",
            KeyId=key_id,
            CiphertextBlob=wrapped.blob,
            EncryptionContext=dict(context),
        )
        return bytes(result["Plaintext"])

    def wrap_many(self, items: Sequence[tuple[bytes, Context]]) -> list[WrappedKey]:
        if len(items) <= 1:
            return [self.wrap(k, c) for k, c in items]
        return list(self._pool.map(lambda item: self.wrap(*item), items))

    def unwrap_many(self, items: Sequence[tuple[WrappedKey, Context]]) -> list[bytes]:
        if len(items) <= 1:
            return [self.unwrap(w, c) for w, c in items]
        return list(self._pool.map(lambda item: self.unwrap(*item), items))

    def rotate(self) -> int:
        self._prepare()
        self._refresh()
        epoch = max(self._epochs, default=0) + 1
        self._create_epoch(epoch)
        return epoch

    def destroy_epochs_before(self, epoch: int) -> list[DestroyedEpoch]:
        self._prepare()
        self._refresh()
        if epoch not in self._epochs:
            raise ConfigError(f"epoch {epoch} is not a live epoch of the KMS provider")
        destroyed = []
        for old in sorted(e for e in self._epochs if e < epoch):
            key_id = self._epochs[old]
            # Disable first: from this call on, real KMS refuses every decrypt.
            self._call("disable_key", KeyId=key_id)
            result = self._call(
                "schedule_key_deletion", KeyId=key_id, PendingWindowInDays=self._window
            )
            self._call("delete_alias", AliasName=f"{self._prefix}{old:06d}")
            when = result.get("DeletionDate")
            effective = (
                when.astimezone(UTC)
                if isinstance(when, datetime)
                else datetime.now(UTC) + timedelta(days=self._window)
            )
            destroyed.append(DestroyedEpoch(old, effective))
        self._refresh()
        return destroyed

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    def __repr__(self) -> str:
        return f"AwsKmsKek(alias_prefix={self._prefix[:-7]!r})"
