"""KEK provider on HashiCorp Vault / OpenBao Transit (``pip install 'keyshred[vault]'``).

One transit key (``aes256-gcm96``) wraps every DEK, never one key per subject: the
per-subject keys are the DEKs, and Transit stays a small, fixed set of keys an
operator can reason about. Epochs are transit key versions.

- One HTTP path: every call (data and admin) goes through one thread-safe
  ``urllib3`` pool with the token header; hvac/requests' per-call session work cost
  more client CPU than the server's own work on a 100-key batch (measured).
- ``wrap``/``unwrap`` bind the DEK to its context through Transit's
  ``associated_data``; batch twins send ``batch_input`` in chunks of ``batch_size``
  (OpenBao refuses JSON bodies with too many strings: about 250 entries with
  associated data on a default server) and run chunks on a small thread pool.
- ``destroy_epochs_before(e)`` raises ``min_decryption_version`` to ``e`` and trims
  the key (``min_available_version``), which deletes the older versions' key material
  from the server: ciphertext under them is undecryptable from then on, including
  copies in any backup of keyshred's key store.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
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
    encode_context,
)
from keyshred.keyring.kek._quiet import key_operation

__all__ = ["VaultKek"]

urllib3 = require("urllib3", extra="vault")


class _TransitRefused(Exception):
    """Transit answered with a client error: 400 (bad input or blob) or 404."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _epoch_of(blob: bytes) -> int:
    try:
        prefix, version, _ = blob.split(b":", 2)
        if prefix != b"vault" or not version.startswith(b"v"):
            raise ValueError
        return int(version[1:])
    except ValueError:
        raise IntegrityError("wrapped key failed authentication") from None


class VaultKek(KekProvider):
    """Transit-backed KEK epochs."""

    name = "vault"

    def __init__(
        self,
        url: str,
        token: str,
        *,
        mount: str = "transit",
        key_name: str = "keyshred-kek",
        namespace: str | None = None,
        verify: bool | str = True,
        timeout: float = 10.0,
        batch_size: int = 200,
        workers: int = 4,
        create: bool = True,
    ) -> None:
        if batch_size < 1:
            raise InvalidInput("batch_size must be at least 1")
        self._url = url
        self._mount = mount.strip("/")
        self._key = key_name
        self._base = f"{url.rstrip('/')}/v1/{self._mount}"
        self._batch = batch_size
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="ks-vault")
        self._min_available = 0
        # One urllib3 pool, shared by every thread (it is thread-safe), carries every
        # call; no retries: a failed call surfaces as KekUnavailable to the keyring.
        # Redirects are followed (an HA standby answers 307 to the active node, as
        # hvac followed them); nothing else is retried.
        pool_kwargs: dict[str, Any] = {"maxsize": max(1, workers), "block": True}
        if isinstance(verify, str):
            pool_kwargs.update(cert_reqs="CERT_REQUIRED", ca_certs=verify)
        elif not verify:
            pool_kwargs.update(cert_reqs="CERT_NONE")
        self._http = urllib3.PoolManager(
            timeout=urllib3.Timeout(total=timeout),
            retries=urllib3.Retry(total=None, connect=0, read=0, status=0, other=0, redirect=3),
            **pool_kwargs,
        )
        self._headers = {"X-Vault-Token": token, "Content-Type": "application/json"}
        if namespace:
            self._headers["X-Vault-Namespace"] = namespace
        # Nothing is asked of the server here: the first call that needs the key
        # (creates it if asked and) reads it, so a process opens while the service
        # is down and is served once it is back, without a restart.
        self._create = create
        self._ready = False
        self._ready_lock = threading.Lock()

    # -- plumbing ------------------------------------------------------------------

    def _request(
        self, method: str, path: str, body: dict[str, Any] | None = None, *, keys: bool = False
    ) -> dict[str, Any]:
        """One Transit call. Transport failures, a refused token and a sealed server
        are ``KekUnavailable``; 400 and 404 are ``_TransitRefused`` for the caller to
        name; anything else is ``KekError``. ``keys``: the body or the answer carries
        plaintext keys, so the HTTP libraries' logs are muted for the call."""
        url = f"{self._base}/{path}"
        data = None if body is None else json.dumps(body).encode("utf-8")
        try:
            if keys:
                with key_operation():
                    resp = self._http.request(method, url, body=data, headers=self._headers)
            else:
                resp = self._http.request(method, url, body=data, headers=self._headers)
        except urllib3.exceptions.HTTPError:
            # Drop the pooled connections: after a server restart every one of them
            # is dead, and a retry must open a new one rather than try the next.
            self._http.clear()
            raise KekUnavailable(f"cannot reach Vault/OpenBao at {self._url}") from None
        if resp.status in (401, 403):
            raise KekUnavailable("Vault/OpenBao refused the token for the transit key")
        if resp.status == 503:
            raise KekUnavailable("Vault/OpenBao is sealed or down")
        if resp.status in (400, 404):
            raise _TransitRefused(resp.status)
        if resp.status not in (200, 204):
            raise KekError(f"Transit {path.split('/', 1)[0]} answered HTTP {resp.status}")
        if not resp.data:
            return {}
        doc: dict[str, Any] = json.loads(resp.data)
        return doc

    def _ensure_key(self) -> None:
        try:
            self._request("GET", f"keys/{self._key}")
        except _TransitRefused:
            try:
                self._request("POST", f"keys/{self._key}", {"type": "aes256-gcm96"})
            except _TransitRefused:
                raise ConfigError(
                    f"no transit engine mounted at {self._mount!r} on {self._url}"
                ) from None

    def _prepare(self) -> None:
        """The first use: create the transit key if asked (once per process)."""
        if self._ready:
            return
        with self._ready_lock:
            if not self._ready:
                if self._create:
                    self._ensure_key()
                self._ready = True

    def _read_key(self) -> dict[str, Any]:
        self._prepare()
        try:
            doc = self._request("GET", f"keys/{self._key}")
        except _TransitRefused:
            raise ConfigError(f"transit key {self._key!r} does not exist") from None
        data: dict[str, Any] = doc["data"]
        return data

    def _refresh(self) -> dict[str, Any]:
        data = self._read_key()
        self._min_available = max(
            int(data.get("min_available_version") or 0),
            int(data.get("min_decryption_version") or 0),
        )
        return data

    def _check_epoch(self, epoch: int) -> None:
        if epoch < self._min_available:
            raise KekEpochDestroyed(f"KEK epoch {epoch} of the transit key is destroyed")

    def _diagnose(self, epochs: Sequence[int]) -> KekError | IntegrityError:
        """A Transit call failed: tell a destroyed epoch from a forged blob."""
        self._refresh()
        for epoch in epochs:
            if epoch < self._min_available:
                return KekEpochDestroyed(f"KEK epoch {epoch} of the transit key is destroyed")
        return IntegrityError("wrapped key failed authentication")

    # -- provider interface --------------------------------------------------------

    def current_epoch(self) -> int:
        return int(self._refresh()["latest_version"])

    def epochs(self) -> list[EpochInfo]:
        data = self._refresh()
        out = []
        for version, created in sorted(data["keys"].items(), key=lambda kv: int(kv[0])):
            if int(version) >= self._min_available:
                when = (
                    datetime.fromtimestamp(created, UTC)
                    if isinstance(created, int | float)
                    else datetime.fromisoformat(str(created).replace("Z", "+00:00"))
                )
                out.append(EpochInfo(int(version), when))
        return out

    def wrap(self, key: bytes, context: Context) -> WrappedKey:
        return self.wrap_many([(key, context)])[0]

    def unwrap(self, wrapped: WrappedKey, context: Context) -> bytes:
        return self.unwrap_many([(wrapped, context)])[0]

    def _chunks(self, n: int) -> list[range]:
        return [range(i, min(i + self._batch, n)) for i in range(0, n, self._batch)]

    def _map_chunks(self, fn: Any, n: int) -> list[Any]:
        chunks = self._chunks(n)
        if len(chunks) <= 1:
            return [fn(c) for c in chunks]
        return list(self._pool.map(fn, chunks))

    def wrap_many(self, items: Sequence[tuple[bytes, Context]]) -> list[WrappedKey]:
        self._prepare()

        def run(chunk: range) -> list[WrappedKey]:
            batch = [
                {
                    "plaintext": _b64(items[i][0]),
                    "associated_data": _b64(encode_context(items[i][1])),
                }
                for i in chunk
            ]
            try:
                doc = self._request(
                    "POST", f"encrypt/{self._key}", {"batch_input": batch}, keys=True
                )
            except _TransitRefused:
                raise KekError("Transit refused to wrap the batch") from None
            out = []
            for result in doc["data"]["batch_results"]:
                if result.get("error"):
                    raise KekError("Transit refused to wrap a key")
                blob = result["ciphertext"].encode("ascii")
                out.append(WrappedKey(_epoch_of(blob), blob))
            return out

        return [w for part in self._map_chunks(run, len(items)) for w in part]

    def unwrap_many(self, items: Sequence[tuple[WrappedKey, Context]]) -> list[bytes]:
        self._prepare()
        for wrapped, _ in items:
            self._check_epoch(wrapped.epoch)

        def run(chunk: range) -> list[bytes]:
            batch = [
                {
                    "ciphertext": items[i][0].blob.decode("ascii", "replace"),
                    "associated_data": _b64(encode_context(items[i][1])),
                }
                for i in chunk
            ]
            try:
                doc = self._request(
                    "POST", f"decrypt/{self._key}", {"batch_input": batch}, keys=True
                )
                results = doc["data"]["batch_results"]
                if any(r.get("error") for r in results):
                    raise ValueError
                return [base64.b64decode(r["plaintext"]) for r in results]
            except (_TransitRefused, ValueError, KeyError):
                raise self._diagnose([items[i][0].epoch for i in chunk]) from None

        return [k for part in self._map_chunks(run, len(items)) for k in part]

    def rotate(self) -> int:
        self._prepare()
        try:
            self._request("POST", f"keys/{self._key}/rotate")
        except _TransitRefused:
            raise KekError(f"Transit refused to rotate key {self._key!r}") from None
        return self.current_epoch()

    def destroy_epochs_before(self, epoch: int) -> list[DestroyedEpoch]:
        data = self._refresh()
        latest = int(data["latest_version"])
        if not 1 <= epoch <= latest:
            raise ConfigError(f"epoch {epoch} is not a version of transit key {self._key!r}")
        already = self._min_available
        if epoch > max(already, 1):
            # Trim needs min_encryption_version set; pinning it to the latest version
            # changes nothing for new wraps, which always use the latest version.
            try:
                self._request(
                    "POST",
                    f"keys/{self._key}/config",
                    {"min_decryption_version": epoch, "min_encryption_version": latest},
                )
                self._request("POST", f"keys/{self._key}/trim", {"min_available_version": epoch})
            except _TransitRefused:
                raise KekError(f"Transit refused to destroy epochs of {self._key!r}") from None
        self._refresh()
        now = datetime.now(UTC)
        return [DestroyedEpoch(e, now) for e in range(max(already, 1), epoch)]

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._http.clear()

    def __repr__(self) -> str:
        return f"VaultKek(url={self._url!r}, mount={self._mount!r}, key={self._key!r})"
