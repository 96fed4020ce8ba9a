"""``keyshred.backup``: snapshots of ciphertext partitions, restore with tombstone replay.

``ks.backup`` (a ``BackupManager``) takes generations to a folder or an S3 prefix,
lists and prunes them, restores one into an isolated folder (replaying every later
tombstone before anything is exposed) and runs the KEK-epoch schedule that bounds
what any old backup can yield. See ``keyshred.backup.manager``.
"""

from keyshred.backup.manager import BackupManager, Generation, MaintenanceReport, RestoreReport
from keyshred.backup.manifest import Manifest, Segment
from keyshred.backup.targets import BackupTarget, LocalTarget, S3Target, open_target

__all__ = [
    "BackupManager",
    "BackupTarget",
    "Generation",
    "LocalTarget",
    "MaintenanceReport",
    "Manifest",
    "RestoreReport",
    "S3Target",
    "Segment",
    "open_target",
]
