"""keyshred: erasable-by-design storage for AI-agent memory.

Every record is sealed under a data key that belongs to one data subject; erasing
the subject destroys the key, and with it every copy. See ``Keyshred`` to start.

``__all__`` is the public API in one screen: ``Keyshred`` and its ``Config``, every
type its methods (and its components' methods: ``ks.memories``, ``ks.vault``,
``ks.consent``, ``ks.erasure``, ``ks.backup`` ...) take or return, and the one
error tree under ``KeyshredError``. The names load on first use (PEP 562), so
``import keyshred`` is cheap and importing one component loads only what it uses.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keyshred.audit import AuditEvent
    from keyshred.backup.generations import Generation
    from keyshred.backup.maintenance import LiveStatus, MaintenanceReport
    from keyshred.backup.manifest import Manifest
    from keyshred.backup.restore import RestoreReport
    from keyshred.backup.targets import BackupTarget
    from keyshred.config import Config
    from keyshred.erasure import (
        ErasureRequest,
        ExternalAnswer,
        ExternalProcessor,
        Hold,
        VerificationFailed,
    )
    from keyshred.errors import (
        BackendUnavailable,
        ConfigError,
        ConsentRequired,
        DatabaseError,
        EpochInUse,
        HandleClosed,
        IntegrityError,
        InvalidInput,
        KekCircuitOpen,
        KekEpochDestroyed,
        KekError,
        KekMismatch,
        KekUnavailable,
        KeyNotFound,
        KeyshredError,
        MissingExtraError,
        NotFound,
        StaleEpoch,
        StorageFull,
        SubjectErased,
        SubjectSuppressed,
        TokenError,
        TokenExpired,
        TokenPurposeMismatch,
        TokenSubjectMismatch,
        UnknownScope,
        UnknownToken,
        UntrustedSigner,
        ValueTooLarge,
        WebhookDeliveryFailed,
        WebhookRefused,
        WebhookTimestampInvalid,
    )
    from keyshred.export import ExportResult
    from keyshred.facade import Keyshred
    from keyshred.ids import Subject
    from keyshred.jobs import Job, JobOutcome
    from keyshred.keyring.kek import DestroyedEpoch
    from keyshred.keyring.keystore import Tombstone
    from keyshred.lifecycle import RetentionReport
    from keyshred.receipts import BackupCoverage, Receipt
    from keyshred.residue import ResidueReport
    from keyshred.storage.catalog import ConsentRecord
    from keyshred.storage.erasable import Erasable, ErasureTarget, StoreCheck, StoreErasure
    from keyshred.storage.memories import Memory, PutItem, RepairReport
    from keyshred.vault.detect import Finding
    from keyshred.vault.tokens import Sanitized, VaultStatus

__version__ = "0.1.0"

_LAZY = {
    "Keyshred": "keyshred.facade",
    "Config": "keyshred.config",
    "Subject": "keyshred.ids",
    "Memory": "keyshred.storage.memories",
    "PutItem": "keyshred.storage.memories",
    "RepairReport": "keyshred.storage.memories",
    "ConsentRecord": "keyshred.storage.catalog",
    "Sanitized": "keyshred.vault.tokens",
    "VaultStatus": "keyshred.vault.tokens",
    "Finding": "keyshred.vault.detect",
    "Erasable": "keyshred.storage.erasable",
    "ErasureTarget": "keyshred.storage.erasable",
    "StoreCheck": "keyshred.storage.erasable",
    "StoreErasure": "keyshred.storage.erasable",
    "ErasureRequest": "keyshred.erasure",
    "ExternalAnswer": "keyshred.erasure",
    "ExternalProcessor": "keyshred.erasure",
    "Hold": "keyshred.erasure",
    "VerificationFailed": "keyshred.erasure",
    "BackupCoverage": "keyshred.receipts",
    "Receipt": "keyshred.receipts",
    "ExportResult": "keyshred.export",
    "ResidueReport": "keyshred.residue",
    "AuditEvent": "keyshred.audit",
    "Job": "keyshred.jobs",
    "JobOutcome": "keyshred.jobs",
    "RetentionReport": "keyshred.lifecycle",
    "Generation": "keyshred.backup.generations",
    "LiveStatus": "keyshred.backup.maintenance",
    "MaintenanceReport": "keyshred.backup.maintenance",
    "RestoreReport": "keyshred.backup.restore",
    "Manifest": "keyshred.backup.manifest",
    "BackupTarget": "keyshred.backup.targets",
    "DestroyedEpoch": "keyshred.keyring.kek",
    "Tombstone": "keyshred.keyring.keystore",
    "BackendUnavailable": "keyshred.errors",
    "ConfigError": "keyshred.errors",
    "ConsentRequired": "keyshred.errors",
    "DatabaseError": "keyshred.errors",
    "EpochInUse": "keyshred.errors",
    "HandleClosed": "keyshred.errors",
    "IntegrityError": "keyshred.errors",
    "InvalidInput": "keyshred.errors",
    "KekEpochDestroyed": "keyshred.errors",
    "KekError": "keyshred.errors",
    "KekMismatch": "keyshred.errors",
    "KekCircuitOpen": "keyshred.errors",
    "KekUnavailable": "keyshred.errors",
    "KeyNotFound": "keyshred.errors",
    "KeyshredError": "keyshred.errors",
    "MissingExtraError": "keyshred.errors",
    "NotFound": "keyshred.errors",
    "StaleEpoch": "keyshred.errors",
    "StorageFull": "keyshred.errors",
    "SubjectErased": "keyshred.errors",
    "SubjectSuppressed": "keyshred.errors",
    "TokenError": "keyshred.errors",
    "TokenExpired": "keyshred.errors",
    "TokenPurposeMismatch": "keyshred.errors",
    "TokenSubjectMismatch": "keyshred.errors",
    "UnknownScope": "keyshred.errors",
    "UnknownToken": "keyshred.errors",
    "UntrustedSigner": "keyshred.errors",
    "ValueTooLarge": "keyshred.errors",
    "WebhookDeliveryFailed": "keyshred.errors",
    "WebhookRefused": "keyshred.errors",
    "WebhookTimestampInvalid": "keyshred.errors",
}

__all__ = [
    "AuditEvent",
    "BackendUnavailable",
    "BackupCoverage",
    "BackupTarget",
    "Config",
    "ConfigError",
    "ConsentRecord",
    "ConsentRequired",
    "DatabaseError",
    "DestroyedEpoch",
    "EpochInUse",
    "Erasable",
    "ErasureRequest",
    "ErasureTarget",
    "ExportResult",
    "ExternalAnswer",
    "ExternalProcessor",
    "Finding",
    "Generation",
    "HandleClosed",
    "Hold",
    "IntegrityError",
    "InvalidInput",
    "Job",
    "JobOutcome",
    "KekCircuitOpen",
    "KekEpochDestroyed",
    "KekError",
    "KekMismatch",
    "KekUnavailable",
    "KeyNotFound",
    "Keyshred",
    "KeyshredError",
    "LiveStatus",
    "MaintenanceReport",
    "Manifest",
    "Memory",
    "MissingExtraError",
    "NotFound",
    "PutItem",
    "Receipt",
    "RepairReport",
    "ResidueReport",
    "RestoreReport",
    "RetentionReport",
    "Sanitized",
    "StaleEpoch",
    "StorageFull",
    "StoreCheck",
    "StoreErasure",
    "Subject",
    "SubjectErased",
    "SubjectSuppressed",
    "TokenError",
    "TokenExpired",
    "TokenPurposeMismatch",
    "TokenSubjectMismatch",
    "Tombstone",
    "UnknownScope",
    "UnknownToken",
    "UntrustedSigner",
    "ValueTooLarge",
    "VaultStatus",
    "VerificationFailed",
    "WebhookDeliveryFailed",
    "WebhookRefused",
    "WebhookTimestampInvalid",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
