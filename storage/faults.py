"""Named points inside multi-step writes, where fault-injection tests stop a process.

A write that touches several stores (the partition's log and segments, the vector
index, the catalog) must leave a state that opens whatever instant the process dies.
Each such instant is a named point here; the code calls ``reached(point)`` there.
In production ``hook`` is ``None`` and ``reached`` does nothing. Crash tests run a
worker process that sets ``hook`` to a function sending itself SIGKILL at one point
(the erasure coordinator's ``on_step`` does the same between erasure steps), then
reopen the data folder in the parent and check what survived.

``POINTS`` lists every point, so tests parametrize over all of them.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["ERASE_POINTS", "POINTS", "hook", "reached"]

POINTS = (
    # MemoryStore._delete_rows: delete, retention, derived-asset drops
    "delete.after_mark",  # the catalog marks the assets "deleting"
    "delete.after_log",  # the delete records are in the log
    "delete.after_rewrite",  # the segments were rewritten without the rows
    "delete.after_vectors",  # the vectors are gone; the catalog rows are next
    # MemoryStore._put_rows: put, update, correct, derived rebuilds
    "put.after_log",  # the rows are in the log, not yet in the catalog
    # the vector rows are written inside the put's catalog transaction, the assets
    # not yet (a kill here commits none of the put)
    "put.after_vectors",
    "put.after_catalog",  # registered; a flush may follow
    # Partition.flush: the segment rewrite (compaction of log into segments)
    "flush.after_segment",  # a new segment file is written, the manifest is old
    "flush.after_manifest",  # the new manifest is committed, old files remain
    # Partition._flush_inline: a small partition's compaction into the catalog
    "flush.after_records",  # its records are sealed, not yet committed
    # Partition._settle_legacy: the import of a folder of the layout before issue #21
    # (its compaction passes the two flush points as well)
    "import.after_read",  # the old files are read into the cache, nothing written
    "import.after_commit",  # the catalog holds the partition, the old files remain
    "import.after_first_file",  # one old file removed, the others not yet
    # VectorIndex._settle: the import of a subject's LanceDB dataset (before r0013)
    "vectors.after_import",  # the catalog holds the rows, the dataset remains
    # Partition.drop: the erasure's removal of a whole partition folder
    "drop.after_first_file",
    # The erasure's key step (keyshred.erasure.extent.Extent.destroy_keys): the keys
    # are destroyed and the tombstone written, the step is not recorded yet (a resumed
    # request must find its own tombstone to report what it destroyed)
    "keys.after_destroy",
    # Each store's Erasable.erase (keyshred.storage.erasable): the store has acted,
    # the erasure has not yet recorded its step
    "erase.memories",
    "erase.vectors",
    "erase.vault",
    "erase.checkpoints",
    "erase.exports",
    # DerivedStore.erase: the first derived asset rebuilt or dropped (and recorded),
    # the others not yet
    "erase.derived",
    # DerivedStore.erase, at its end: the first holder's partition is purged of the
    # superseded values (every asset acted on and recorded), the others not yet
    "derived.after_first_purge",
    # The vault's group commit (keyshred.vault.group): a flush stored its rows, their
    # journal segments are not zeroed yet; a subject's rows of a flush that stores
    # subject by subject (one was suppressed) are stored, the next subject's not yet
    "vault.after_store",
    "vault.after_group",
    # CheckpointStore._create: the thread's key is made (under the subject's lock),
    # its row not yet inserted; the row is inserted in the transaction that
    # registers its asset, not yet committed
    "thread.key_made",
    "thread.in_create",
    # CheckpointStore._drop (delete_thread, retention): the thread's key is destroyed,
    # its rows not yet deleted; the rows' deletes are issued in the open transaction,
    # not yet committed; they are committed, the catalog not yet scrubbed
    "thread.after_key",
    "thread.before_commit",
    "thread.after_commit",
    # BackupManager.create: one segment is in the target, the others not yet; every
    # object is in the target, the manifest (the generation's commit) not yet
    "backup.after_first_object",
    "backup.before_manifest",
)

# The point inside each store's ``erase``, by store name.
ERASE_POINTS = {p.removeprefix("erase."): p for p in POINTS if p.startswith("erase.")}

hook: Callable[[str], None] | None = None


def reached(point: str) -> None:
    """Tell the fault hook (if a test installed one) that ``point`` was reached."""
    if hook is not None:
        hook(point)
