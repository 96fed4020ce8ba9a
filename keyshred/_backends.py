"""Build the backends a ``Config`` names (KEK provider, key store)."""

from __future__ import annotations

import os
from pathlib import Path

from keyshred.config import Config
from keyshred.errors import ConfigError
from keyshred.keyring.kek import KekProvider
from keyshred.keyring.kek.local import LocalKek
from keyshred.keyring.kek.resilient import ResilientKek
from keyshred.keyring.keystore import KeyStore, SQLiteKeyStore, SqlKeyStore

__all__ = ["KEYS_DIR", "make_archive_kek", "make_kek", "make_keystore"]

KEYS_DIR = "keys"
LOCAL_KEK_FILE = "kek.local.json"
ARCHIVE_KEK_FILE = "kek.archive.json"
KEYSTORE_FILE = "keystore.db"


def make_kek(config: Config, root: Path, *, create: bool, archive: bool = False) -> ResilientKek:
    """The live lineage's provider, or with ``archive`` the archive lineage's: a
    second key file, transit key (``<key>-archive``) or alias prefix
    (``<alias_prefix>-archive``) of the same provider; behind retries and a circuit
    breaker (``keyring.kek_*`` settings), its calls counted (``ResilientKek``)."""
    k = config.keyring
    return ResilientKek(
        _make_provider(config, root, create=create, archive=archive),
        retries=k.kek_retries,
        retry_max_seconds=k.kek_retry_max_seconds,
        retry_initial_seconds=k.kek_retry_initial_seconds,
        retry_cap_seconds=k.kek_retry_cap_seconds,
        circuit_failures=k.kek_circuit_failures,
        circuit_reset_seconds=k.kek_circuit_reset_seconds,
    )


def _make_provider(config: Config, root: Path, *, create: bool, archive: bool) -> KekProvider:
    """The provider itself. Building one makes no call to a remote service (the
    first use does), so a process opens while its KEK service is down."""
    settings = config.kek
    # The two lineages must be two keys: one shared would let the archive schedule
    # destroy live epochs (every live key with them) and the live one end backups.
    same = "the archive KEK must be another key than the live one: set "
    if settings.provider == "local":
        live_path = (
            Path(settings.local_path) if settings.local_path else root / KEYS_DIR / LOCAL_KEK_FILE
        )
        if archive:
            # The archive file is created on first use, also in an existing folder
            # (made before the archive lineage existed).
            path = (
                Path(settings.archive_local_path)
                if settings.archive_local_path
                else root / KEYS_DIR / ARCHIVE_KEK_FILE
            )
            if path.resolve() == live_path.resolve():
                raise ConfigError(same + "kek.archive_local_path to another file")
            return LocalKek(path, create=True)
        return LocalKek(live_path, create=create)
    if settings.provider == "vault":
        from keyshred.keyring.kek.vault import VaultKek

        token = os.environ.get("KEYSHRED_VAULT_TOKEN") or os.environ.get("VAULT_TOKEN")
        if not token:
            raise ConfigError("the vault KEK provider needs KEYSHRED_VAULT_TOKEN or VAULT_TOKEN")
        v = settings.vault
        if archive and (v.archive_key or f"{v.key}-archive") == v.key:
            raise ConfigError(same + "kek.vault.archive_key to another transit key")
        return VaultKek(
            v.url,
            token,
            mount=v.mount,
            key_name=(v.archive_key or f"{v.key}-archive") if archive else v.key,
            namespace=v.namespace,
            verify=v.verify,
            timeout=v.timeout_seconds,
            batch_size=v.batch_size,
            workers=v.workers,
        )
    from keyshred.keyring.kek.aws import AwsKmsKek

    a = settings.aws
    if archive and a.archive_alias_prefix is not None:
        live, arch = a.alias_prefix.rstrip("/") + "/", a.archive_alias_prefix.rstrip("/") + "/"
        if live.startswith(arch) or arch.startswith(live):  # equal, or one inside the other
            raise ConfigError(same + "kek.aws.archive_alias_prefix outside kek.aws.alias_prefix")
    return AwsKmsKek(
        alias_prefix=(
            (a.archive_alias_prefix or a.alias_prefix.rstrip("/") + "-archive")
            if archive
            else a.alias_prefix
        ),
        region=a.region,
        endpoint_url=a.endpoint_url,
        pending_window_days=a.pending_window_days,
        workers=a.workers,
    )


def make_archive_kek(config: Config, root: Path) -> ResilientKek:
    return make_kek(config, root, create=True, archive=True)


def make_keystore(config: Config, root: Path) -> KeyStore:
    """The one key store class, on the URL's database (``keyring.store_url``), or on
    the data folder's own SQLite file (``keys/keystore.db``) without one."""
    url = config.keyring.store_url
    if url:
        k = config.keyring
        return SqlKeyStore(
            url,
            pool_size=k.pool_size,
            max_overflow=k.pool_max_overflow,
            pool_timeout=k.pool_timeout_seconds,
            pre_ping=k.pool_pre_ping,
        )
    return SQLiteKeyStore(root / KEYS_DIR / KEYSTORE_FILE)
