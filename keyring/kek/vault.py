"""KEK provider on HashiCorp Vault / OpenBao Transit (``pip install 'keyshred[vault]'``).

One transit key (``aes256-gcm96``) wraps every DEK, never one key per subject: the
per-subject keys are the DEKs, and Transit stays a small, fixed set of keys an
operator can reason about. Epochs are transit key versions.

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

hvac = require("hvac", extra="vault")
requests = require("requests", extra="vault")
urllib3 = require("urllib3", extra="vault")


class _TransitRefused(Exception):
    """Transit answered a data call with a client error (4xx other than auth)."""


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
        self._token = token
        self._namespace = namespace
        self._verify = verify
        self._timeout = timeout
        self._mount = mount.strip("/")
        self._key = key_name
        self._batch = batch_size
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="ks-vault")
        self._min_available = 0
        # The batch data path (encrypt/decrypt) talks to Transit through one urllib3
        # pool: requests' per-call session machinery (proxy and netrc lookups,
        # hooks) cost more CPU than the server's own work on a 100-key batch.
        pool_kwargs: dict[str, Any] = {"maxsize": max(1, workers), "block": True}
        if isinstance(verify, str):
            pool_kwargs.update(cert_reqs="CERT_REQUIRED", ca_certs=verify)
        elif not verify:
            pool_kwargs.update(cert_reqs="CERT_NONE")
        self._http = urllib3.PoolManager(
            timeout=urllib3.Timeout(total=timeout), retries=False, **pool_kwargs
        )
        self._headers = {"X-Vault-Token": token, "Content-Type": "application/json"}
        if namespace:
            self._headers["X-Vault-Namespace"] = namespace
        if create:
            self._call(self._ensure_key)
        self._refresh()

    # -- plumbing ------------------------------------------------------------------

    def _client(self) -> Any:
        client = getattr(self._local, "client", None)
        if client is None:
            client = hvac.Client(
                url=self._url,
                token=self._token,
                namespace=self._namespace,
                verify=self._verify,
                timeout=self._timeout,
            )
            self._local.client = client
        return client

    def _call(self, fn: Any, *args: Any) -> Any:
        """Run a Transit call, translating transport and auth failures."""
        try:
            return fn(*args)
        except requests.exceptions.RequestException:
            raise KekUnavailable(f"cannot reach Vault/OpenBao at {self._url}") from None
        except (hvac.exceptions.Forbidden, hvac.exceptions.Unauthorized):
            raise KekUnavailable("Vault/OpenBao refused the token for the transit key") from None
        except hvac.exceptions.VaultDown:
            raise KekUnavailable("Vault/OpenBao is sealed or down") from None

    def _post(self, action: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST a Transit data call; ``_TransitRefused`` on a 400 (bad input/blob)."""
        url = f"{self._url.rstrip('/')}/v1/{self._mount}/{action}/{self._key}"
        try:
            with key_operation():  # the body and the answer carry plaintext keys
                resp = self._http.request(
                    "POST", url, body=json.dumps(body).encode("utf-8"), headers=self._headers
                )
        except urllib3.exceptions.HTTPError:
            raise KekUnavailable(f"cannot reach Vault/OpenBao at {self._url}") from None
        if resp.status in (401, 403):
            raise KekUnavailable("Vault/OpenBao refused the token for the transit key")
        if resp.status == 503:
            raise KekUnavailable("Vault/OpenBao is sealed or down")
        if resp.status == 400:
            raise _TransitRefused
        if resp.status != 200:
            raise KekError(f"Transit {action} answered HTTP {resp.status}")
        doc: dict[str, Any] = json.loads(resp.data)
        return doc

    def _ensure_key(self) -> None:
        transit = self._client().secrets.transit
        try:
            transit.read_key(name=self._key, mount_point=self._mount)
        except hvac.exceptions.InvalidPath:
            try:
                transit.create_key(name=self._key, key_type="aes256-gcm96", mount_point=self._mount)
            except hvac.exceptions.InvalidPath:
                raise ConfigError(
                    f"no transit engine mounted at {self._mount!r} on {self._url}"
                ) from None

    def _read_key(self) -> dict[str, Any]:
        try:
            doc: dict[str, Any] = self._call(
                self._client().secrets.transit.read_key, self._key, self._mount
            )
        except hvac.exceptions.InvalidPath:
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
        def run(chunk: range) -> list[WrappedKey]:
            batch = [
                {
                    "plaintext": _b64(items[i][0]),
                    "associated_data": _b64(encode_context(items[i][1])),
                }
                for i in chunk
            ]
            try:
                doc = self._post("encrypt", {"batch_input": batch})
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
                doc = self._post("decrypt", {"batch_input": batch})
                results = doc["data"]["batch_results"]
                if any(r.get("error") for r in results):
                    raise ValueError
                return [base64.b64decode(r["plaintext"]) for r in results]
            except (_TransitRefused, ValueError, KeyError):
                raise self._diagnose([items[i][0].epoch for i in chunk]) from None

        return [k for part in self._map_chunks(run, len(items)) for k in part]

    def rotate(self) -> int:
        self._call(self._client().secrets.transit.rotate_key, self._key, self._mount)
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
            # (hvac's own helper refuses min_encryption == min_decryption, which the
            # server accepts, so the config call goes to the API directly.)
            client = self._client()
            base = f"/v1/{self._mount}/keys/{self._key}"
            self._call(
                lambda: client.adapter.post(
                    f"{base}/config",
                    json={"min_decryption_version": epoch, "min_encryption_version": latest},
                )
            )
            self._call(
                lambda: client.adapter.post(f"{base}/trim", json={"min_available_version": epoch})
            )
        self._refresh()
        now = datetime.now(UTC)
        return [DestroyedEpoch(e, now) for e in range(max(already, 1), epoch)]

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._http.clear()

    def __repr__(self) -> str:
        return f"VaultKek(url={self._url!r}, mount={self._mount!r}, key={self._key!r})"
