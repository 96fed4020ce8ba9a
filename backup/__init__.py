"""``keyshred.backup``: snapshots of ciphertext partitions, restore with tombstone replay.

``ks.backup`` (a ``BackupManager``) takes generations to a folder or an S3 prefix,
lists and prunes them, restores one into an isolated folder (replaying every later
tombstone before anything is exposed) and runs the KEK-epoch schedule that bounds
what any old backup can yield. See ``keyshred.backup.manager``.

The names below load on first use (PEP 562): importing one submodule does not
import the others.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keyshred.backup.manager import (
        BackupManager,
        Generation,
        LiveStatus,
        MaintenanceReport,
        RestoreReport,
    )
    from keyshred.backup.manifest import Manifest, Segment
    from keyshred.backup.targets import BackupTarget, LocalTarget, S3Target, open_target

_LAZY = {
    "BackupManager": "keyshred.backup.manager",
    "BackupTarget": "keyshred.backup.targets",
    "Generation": "keyshred.backup.generations",
    "LiveStatus": "keyshred.backup.maintenance",
    "LocalTarget": "keyshred.backup.targets",
    "MaintenanceReport": "keyshred.backup.maintenance",
    "Manifest": "keyshred.backup.manifest",
    "RestoreReport": "keyshred.backup.restore",
    "S3Target": "keyshred.backup.targets",
    "Segment": "keyshred.backup.manifest",
    "open_target": "keyshred.backup.targets",
}

__all__ = [
    "BackupManager",
    "BackupTarget",
    "Generation",
    "LiveStatus",
    "LocalTarget",
    "MaintenanceReport",
    "Manifest",
    "RestoreReport",
    "S3Target",
    "Segment",
    "open_target",
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
