"""Parquet Modular Encryption backed by the keyring.

pyarrow's ``KmsClient`` wraps each file's data keys with a "master key"; here the
master key *is* the subject's scope DEK, named ``ks1-<key id hex>``. Wrapping seals
the Parquet data key with the DEK through the envelope (bound to the subject, scope
and master key id); unwrapping asks the keyring, so a file whose DEK was destroyed
raises ``SubjectErased`` from inside pyarrow's reader. Single wrapping (no
intermediate PME KEKs) keeps nothing but the keyring's own cache in memory, and
``forget()`` clears pyarrow's per-token caches as well — both are erasure targets.
"""

from __future__ import annotations

import base64
from datetime import timedelta
from typing import Any

import pyarrow.parquet.encryption as pe

from keyshred.errors import IntegrityError, KeyNotFound
from keyshred.keyring.envelope import Place
from keyshred.keyring.keyring import Keyring

__all__ = ["MASTER_PREFIX", "PmeCrypto"]

MASTER_PREFIX = "ks1-"


class _KeyringKmsClient(pe.KmsClient):  # type: ignore[misc]
    def __init__(self, keyring: Keyring) -> None:
        super().__init__()
        self._keyring = keyring

    def _key(self, master_key_identifier: str) -> Any:
        if not master_key_identifier.startswith(MASTER_PREFIX):
            raise IntegrityError("unknown Parquet master key")
        try:
            key_id = bytes.fromhex(master_key_identifier[len(MASTER_PREFIX) :])
            return self._keyring.data_key_by_id(key_id)
        except (ValueError, KeyNotFound):
            raise IntegrityError("unknown Parquet master key") from None

    @staticmethod
    def _place(key: Any, master_key_identifier: str) -> Place:
        return Place(key.subject_ref, key.scope, "parquet-pme", master_key_identifier, "data-key")

    def wrap_key(self, key_bytes: bytes, master_key_identifier: str) -> str:
        key = self._key(master_key_identifier)
        sealed = key.seal(bytes(key_bytes), self._place(key, master_key_identifier))
        return base64.b64encode(sealed).decode("ascii")

    def unwrap_key(self, wrapped_key: str, master_key_identifier: str) -> bytes:
        key = self._key(master_key_identifier)
        try:
            sealed = base64.b64decode(wrapped_key, validate=True)
        except ValueError:
            raise IntegrityError() from None
        opened: bytes = key.open(sealed, self._place(key, master_key_identifier))
        return opened


class PmeCrypto:
    """File encryption/decryption properties for one keyring."""

    def __init__(self, keyring: Keyring) -> None:
        self._factory = pe.CryptoFactory(lambda _config: _KeyringKmsClient(keyring))
        self._kms = pe.KmsConnectionConfig()
        self._decryption = pe.DecryptionConfiguration(cache_lifetime=timedelta(minutes=5))

    def encryption(self, key_id: bytes, columns: list[str]) -> Any:
        master = MASTER_PREFIX + key_id.hex()
        config = pe.EncryptionConfiguration(
            footer_key=master,
            column_keys={master: columns},
            encryption_algorithm="AES_GCM_V1",
            plaintext_footer=True,  # metadata columns stay readable for retention scans
            double_wrapping=False,
            data_key_length_bits=256,
            cache_lifetime=timedelta(minutes=5),
        )
        return self._factory.file_encryption_properties(self._kms, config)

    def decryption(self) -> Any:
        return self._factory.file_decryption_properties(self._kms, self._decryption)

    def forget(self) -> None:
        """Drop pyarrow's cached KMS clients and keys (an erasure target)."""
        self._factory.remove_cache_entries_for_all_tokens()
