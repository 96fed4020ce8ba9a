"""The public API in one screen: ``keyshred.__all__`` is pinned, every name in it
resolves, and every type the facade's public methods (and its components' public
methods) take or return is in it."""

from __future__ import annotations

import inspect
import os
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import keyshred
from keyshred import Keyshred
from keyshred._handle import Guarded

PUBLIC = [
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

# Components an application reaches as attributes (``ks.memories`` ...): their
# methods are walked. The lower layers the facade also exposes for operators and
# integrations (``ks.keyring``, ``ks.catalog``, ``ks.policy``, ``ks.metrics``,
# ``ks.vectors``, ``ks.checkpoints``) have their own types in their packages.
NOT_WALKED = {"keyring", "catalog", "policy", "metrics", "vectors", "checkpoints"}

# Types that public methods still take or return but that are internals on their
# way out (issue #20, item 5: no public internals in MemoryStore).
INTERNAL = {
    "keyshred.keyring.datakey.DataKey": "MemoryStore.first_key (facade wiring)",
    "keyshred.storage.embeddings.Embedder": "MemoryStore.embedder (facade wiring)",
    "keyshred.storage.rowcodec.MemoryRow": "MemoryStore.rows_by_id/memory/rebuild",
}


def test_all_is_pinned() -> None:
    assert keyshred.__all__ == PUBLIC
    assert len(PUBLIC) == len(set(PUBLIC))


def test_every_name_resolves_and_is_listed_by_dir() -> None:
    for name in keyshred.__all__:
        value = getattr(keyshred, name)
        assert isinstance(value, type), name
        assert value.__name__ == name
        assert value.__module__.startswith("keyshred.")
    assert set(keyshred.__all__) <= set(dir(keyshred))
    # One error tree: every error in the API derives from KeyshredError.
    for name in keyshred.__all__:
        value = getattr(keyshred, name)
        if issubclass(value, Exception):
            assert issubclass(value, keyshred.KeyshredError), name


def _classes_in(hint: Any, out: set[type]) -> None:
    origin = typing.get_origin(hint)
    if origin is not None:
        if isinstance(origin, type) and origin.__module__.startswith("keyshred"):
            out.add(origin)
        for arg in typing.get_args(hint):
            _classes_in(arg, out)
    elif isinstance(hint, type) and hint.__module__.startswith("keyshred"):
        out.add(hint)


def _api_types(cls: type, skip: set[str] = frozenset()) -> dict[type, str]:  # type: ignore[assignment]
    """Every keyshred class in the annotations of ``cls``'s public methods."""
    # Names that modules import only for type checking, so hints can resolve.
    namespace = {name: getattr(keyshred, name) for name in keyshred.__all__}
    namespace["os"] = os
    found: dict[type, str] = {}
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") or name in skip:
            continue
        static = inspect.getattr_static(cls, name)
        fn = static.fget if isinstance(static, property) else member
        if not callable(fn) or not getattr(fn, "__module__", "").startswith("keyshred"):
            continue  # not ours (pydantic's BaseModel methods, ...)
        for param, hint in typing.get_type_hints(fn, localns=namespace).items():
            classes: set[type] = set()
            _classes_in(hint, classes)
            for c in classes:
                found.setdefault(c, f"{cls.__name__}.{name} ({param})")
    return found


@pytest.fixture
def ks(tmp_path: Path) -> Iterator[Keyshred]:
    store = Keyshred.init(tmp_path / "data", embeddings=lambda texts: [[0.0] * 4 for _ in texts])
    yield store
    store.close()


def test_every_type_the_api_takes_or_returns_is_listed(ks: Keyshred) -> None:
    found = _api_types(Keyshred, skip=NOT_WALKED)
    components: set[type] = set()
    for name, value in vars(ks).items():
        if name.startswith("_") or name in NOT_WALKED:
            continue
        target = object.__getattribute__(value, "_target") if type(value) is Guarded else value
        if type(target).__module__.startswith("keyshred"):
            components.add(type(target))
    assert len(components) >= 9  # memories, vault, consent, erasure, derived, backup ...
    for component in components:
        for c, where in _api_types(component).items():
            found.setdefault(c, where)
    public = {getattr(keyshred, name) for name in keyshred.__all__}
    missing = {
        f"{c.__module__}.{c.__qualname__}": where
        for c, where in found.items()
        if c not in public
        and c not in components
        and f"{c.__module__}.{c.__qualname__}" not in INTERNAL
    }
    assert not missing, f"types in the public API but not in keyshred.__all__: {missing}"
    # The pinned list is not padded: each of these types is one the API uses.
    for name in ("Memory", "ErasureRequest", "Receipt", "Sanitized", "RestoreReport"):
        assert getattr(keyshred, name) in found, name


def test_consent_withdrawal_is_reached_through_consent(ks: Keyshred) -> None:
    assert callable(ks.consent.withdraw)
    params = list(inspect.signature(ks.consent.withdraw).parameters)
    assert params[:2] == ["subject", "scope"]
