"""Removing memories: physical deletion (by namespace and key, by id, by prefix),
the retention sweep, dropping a subject's or a scope's partition files, and the
``Erasable`` interface (``keyshred.storage.erasable``) the erasure coordinator
drives.

A deletion runs in an order that leaves a partition that opens at every instant
(``_delete_rows``): catalog assets marked "deleting", hot delete records, a
compaction that rewrites the segments without the rows, vectors, then the catalog
rows. Erasure and its verification see the whole store: the catalog's partition rows
and every object under the subject's prefix in the partition store.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa

from keyshred.errors import IntegrityError, SubjectSuppressed
from keyshred.storage import faults
from keyshred.storage.erasable import DROP, ErasureTarget, Phase, StoreCheck, StoreErasure
from keyshred.storage.memory_read import ReadMixin
from keyshred.storage.memory_types import (
    _VERSION_SEP,
    DELETING,
    HISTORY,
    MEMORY_KIND,
    Changed,
    _key,
    _namespace,
    _vector_ids,
    _version_of,
)
from keyshred.storage.partition import MemoryRow, Partition, partition_prefix, row_key_id, to_us

# The plaintext columns the retention scan reads (never the encrypted ones).
_SCAN_COLUMNS = ["subject_ref", "memory_id", "retain_until"]

__all__ = ["EraseMixin"]


class EraseMixin(ReadMixin):
    """Deletion, the retention sweep, and ``Erasable``."""

    # -- deletion ----------------------------------------------------------------------

    def delete(self, subject: Any, namespace: Sequence[str] | str, key: str) -> bool:
        """Delete one memory physically: the log records and segment rows holding it
        are rewritten away before this returns. False if there was nothing."""
        ref = self._ref(subject)
        self._catalog.check_guard(ref)
        ns, k = _namespace(namespace), _key(key)
        part = self._partition(ref)
        with part.flocked():
            found = part.lookup(ns, k) if part.rows or part.opaque else None
            # An opaque row (its shared key destroyed) at that name goes too: deleting
            # needs its name's lookup hash, not its key.
            row = None if found is None else part.rows.get(found) or part.opaque.get(found)
            if row is None:
                return False
            # Deletion is not correction: the value goes with every earlier version.
            doomed = [row, *self._history_rows(part, ns, k)]
            self._delete_rows(ref, part, doomed)
        if self._audit is not None:
            self._audit.record(
                "memory.deleted", subject_ref=ref, asset_id=row.memory_id, versions=len(doomed)
            )
        return True

    def delete_many(self, subject: Any, names: Iterable[tuple[Sequence[str] | str, str]]) -> int:
        """Delete the memories named by (namespace, key) physically, with every
        earlier version of each, in one rewrite (one hot transaction, one compaction,
        one vector delete, one catalog delete): time linear in their number. Names
        with nothing stored are skipped; returns how many memories went."""
        ref = self._ref(subject)
        self._catalog.check_guard(ref)
        wanted = {(_namespace(ns), _key(k)) for ns, k in names}
        part = self._partition(ref)
        with part.flocked():
            found: list[MemoryRow] = []
            for ns, k in wanted:
                lookup = part.lookup(ns, k) if part.rows or part.opaque else None
                row = None if lookup is None else part.rows.get(lookup) or part.opaque.get(lookup)
                if row is not None:
                    found.append(row)
            if not found:
                return 0
            # Every earlier version of each, in one pass over the partition (a
            # version's key is its key, the separator, a number: split at the last
            # separator, which the key itself may hold).
            names_found = {(r.namespace, r.key) for r in found}
            history = [
                r
                for r in part.rows.values()
                if r.namespace[:1] == (HISTORY,)
                and (v := _version_of(r.key)) is not None
                and (r.namespace[1:], v[0]) in names_found
            ]
            self._delete_rows(ref, part, [*found, *history])
        if self._audit is not None:
            earlier = Counter((r.namespace[1:], r.key.rpartition(_VERSION_SEP)[0]) for r in history)
            self._audit.record_many(
                "memory.deleted",
                [
                    {"asset_id": r.memory_id, "versions": 1 + earlier[(r.namespace, r.key)]}
                    for r in found
                ],
                subject_ref=ref,
            )
        return len(found)

    def delete_ids(self, ref: str, memory_ids: Iterable[str]) -> int:
        """Physically delete memories of ``ref`` by id in one rewrite (the retention
        path; no guard check: the coordinator decides). Returns how many."""
        wanted = set(memory_ids)
        part = self._partition(ref)
        with part.flocked():
            doomed = [r for r in part.all_rows() if r.memory_id in wanted]
            if doomed:
                self._delete_rows(ref, part, doomed)
        return len(doomed)

    def delete_prefix_ref(self, ref: str, prefix: Sequence[str]) -> int:
        """Physically delete every memory of ``ref`` under a namespace prefix in one
        rewrite (log, segments, vectors, assets); returns how many."""
        self._catalog.check_guard(ref)
        p = tuple(prefix)
        part = self._partition(ref)
        with part.flocked():
            # Opaque rows too: a derived asset's name is readable, and an empty prefix
            # (everything) takes those whose names are sealed with their value.
            doomed = [r for r in part.all_rows() if r.namespace[: len(p)] == p]
            if not doomed:
                return 0
            self._delete_rows(ref, part, doomed)
        return len(doomed)

    def delete_by_id(
        self,
        ref: str,
        memory_id: str,
        *,
        unchanged: MemoryRow | None = None,
        purge: bool = True,
    ) -> bool:
        """Physically delete one memory (and its vectors and assets) by id; with
        ``unchanged``, only if its row is still that one (else ``Changed``: its
        holder wrote it since, nothing deleted). ``purge=False`` leaves the
        rewrite of the partition's files to the caller's ``purge_superseded``:
        the memory is gone for every read and from the catalog at once, its bytes
        at that purge (the erasure's derived step drops many assets of one holder
        and purges each holder once, at its end, rather than once per asset)."""
        part = self._partition(ref)
        with part.flocked():
            # An opaque row too: deleting needs its lookup and id, never its key.
            row = next((r for r in part.all_rows() if r.memory_id == memory_id), None)
            if unchanged is not None and row is not None and row != unchanged:
                raise Changed
            if row is None:
                return False
            self._delete_rows(ref, part, [row], purge=purge)
        return True

    def _delete_rows(
        self, ref: str, part: Partition, rows: Sequence[MemoryRow], *, purge: bool = True
    ) -> None:
        """Delete physically, under the partition lock, in an order that leaves a
        state that opens at every instant: the catalog marks the assets "deleting"
        first, so a partition found lacking a row is known to have lost it on
        purpose (``_finish_deletes``); then the log records, a flush that rewrites
        the rows' segments without them (unless ``purge`` is False: the caller
        purges later), the vectors, and last the catalog rows."""
        ids = [a for r in rows for a in (r.memory_id, *_vector_ids(r))]
        ns_before = self._ns_before(part, rows)
        self._catalog.update_assets(ids, status=DELETING)
        faults.reached("delete.after_mark")
        part.append_deletes(rows)  # one transaction, however many rows
        faults.reached("delete.after_log")
        # The rewrite deletes the old segments at once, not after the grace period:
        # "deleted" means the bytes are gone (a reader that listed one reads the
        # list again).
        if purge:
            part.flush(purge=True)
        faults.reached("delete.after_rewrite")
        indexed = [r.memory_id for r in rows if r.index]
        if indexed and self._vectors is not None:
            self._vectors.delete(ref, indexed)
        faults.reached("delete.after_vectors")
        self._catalog.delete(ids)
        # Last: a crash before it leaves an index row of an emptied namespace (a
        # superset the readers tolerate, and ``repair`` rebuilds), never a namespace
        # with memories that the index lacks.
        self._ns.apply(self._ns_change(ref, part, ns_before))
        # Opaque rows (their owner-set key destroyed) are counted nowhere: the index
        # rows sealed under a key no row of the partition uses any more go now.
        dead = {row_key_id(r) for r in rows if r.opaque} - {row_key_id(r) for r in part.all_rows()}
        if dead - {None}:
            self._ns.drop(ref, key_ids=[k.hex() for k in dead if k is not None])

    def sweep_expired(self, now: datetime) -> int:
        """Physically delete every memory whose retention has passed (found through
        the catalog's index, not by opening partitions); returns how many."""
        n = 0
        for ref, ids in self._catalog.expired(MEMORY_KIND, now).items():
            try:
                self._catalog.check_guard(ref)
            except SubjectSuppressed:
                continue  # an erasure takes it
            part = self._partition(ref)
            with part.flocked():
                wanted = set(ids)
                doomed = [r for r in part.all_rows() if r.memory_id in wanted]
                if doomed:
                    self._delete_rows(ref, part, doomed)
                    n += len(doomed)
        return n

    def expired_in_segments(self, now: datetime) -> dict[str, list[str]]:
        """Memory ids past their retain-until in the segments the catalog lists, by
        subject_ref, from their plaintext columns (no key is opened); only segments
        whose earliest retain-until has passed are read (a catalog fact)."""
        cutoff = to_us(now)
        out: dict[str, list[str]] = {}
        for listed in self._hot.live(expiring_by=cutoff):
            key = f"{partition_prefix(listed.subject_ref)}/{listed.segment.name}"
            try:
                table = self._objects.open_parquet(key).read(columns=_SCAN_COLUMNS)
            except FileNotFoundError:
                continue  # retired since the listing: its successor is read next run
            except Exception as exc:  # noqa: BLE001 - a bad file, said as one
                raise IntegrityError(
                    f"segment {listed.segment.name} of partition {listed.subject_ref} "
                    f"failed to read ({type(exc).__name__})"
                ) from None
            ids = table.column("memory_id").to_pylist()
            until = table.column("retain_until").cast(pa.int64()).to_pylist()
            refs = set(table.column("subject_ref").to_pylist())
            if refs - {listed.subject_ref}:
                raise IntegrityError(f"segment {listed.segment.name} holds another's rows")
            found = [str(m) for m, u in zip(ids, until, strict=True) if u <= cutoff]
            if found:
                out.setdefault(listed.subject_ref, []).extend(found)
        return out

    def sweep_retired(self) -> int:
        """Delete the objects of segments retired longer ago than the grace period,
        for every subject (a compaction deletes its own on the subject's next
        compaction; the retention run calls this for the rest); returns how many."""
        n = 0
        for ref in self._hot.retired_subjects(to_us(datetime.now(UTC)) - self._grace_us):
            try:
                n += self._partition(ref).sweep()
            except SubjectSuppressed:
                continue  # erased meanwhile: the erasure deleted everything
        return n

    # -- Erasable (keyshred.storage.erasable) ------------------------------------------

    name = "memories"
    phase: Phase = DROP

    def erase(self, target: ErasureTarget) -> StoreErasure:
        """The whole partition folder (a subject), one scope's rows and files, or
        exactly the listed memories (retention: with their vectors and assets)."""
        ref = target.subject_ref
        if target.assets is not None:
            n, action = self.delete_ids(ref, target.assets), "memories-deleted"
        elif target.scope is None:
            n, action = self.drop_subject(ref), "partition-dropped"
        else:
            n, action = self.drop_scope(ref, target.scope), "scope-dropped"
        faults.reached("erase.memories")
        # Counts of rows and objects do not show the subject had data: the keys
        # and catalog assets found do.
        return StoreErasure(self.name, action, n, datetime.now(UTC))

    def verify(self, target: ErasureTarget) -> list[StoreCheck]:
        ref = target.subject_ref
        if target.assets is not None:
            rows = self.rows_by_id(ref, target.assets)
            n = len(target.assets)
            return [StoreCheck("memories removed", not rows, f"{len(rows)} of {n} left")]
        # Files of the layout before issue #21 (a folder never imported) count too.
        legacy = len(self._legacy_folder(ref).files())
        if target.scope is not None:
            _, hot_rows, segments = self._hot.counts(ref, target.scope)
            scopes = self._hot_scopes(ref)
            ok = not hot_rows and not segments and not legacy
            detail = f"scopes left: {len(scopes)}; listed the catalog"
            if legacy:
                detail += f"; {legacy} files of the earlier layout left"
            return [StoreCheck("scope segment removed", ok, detail)]
        heads, hot_rows, segments = self._hot.counts(ref)
        indexed = self._ns.count(ref)  # its namespace index rows
        versions = self._objects.versions(partition_prefix(ref))
        ok = not (heads or hot_rows or segments or indexed or versions or legacy)
        detail = (
            f"{len(versions)} objects left (listed {self._objects.url}), "
            f"{heads + hot_rows + segments + indexed} catalog rows left, "
            f"{legacy} files of the earlier layout left"
        )
        return [StoreCheck("memory partition removed", ok, detail)]

    def _hot_scopes(self, ref: str) -> set[str]:
        """Scopes the catalog holds segments or hot rows of for ``ref``."""
        _, segments, records = self._hot.state(ref, since=None)
        return {s.scope for s in segments or []} | {r.scope for r in records}

    def purge_expired(self) -> int:
        """Close the partitions unused for the cache TTL (their decrypted rows go);
        returns how many went. The vector index has its own (``VectorIndex.
        purge_expired``), which the janitor runs beside this."""
        limit = time.monotonic() - self._cache_ttl
        with self._lock:
            doomed = [ref for ref, used in self._used.items() if used <= limit]
            parts = [self._partitions.pop(ref, None) for ref in doomed]
            for ref in doomed:
                del self._used[ref]
        for part in parts:
            if part is not None:
                part.close()
        if doomed:
            self._pme.forget()
        return len(doomed)

    def held(self, subject_ref: str) -> int:
        """How many of the subject's decrypted rows this process holds (a test's and
        a drill's view: no row leaves)."""
        with self._lock:
            part = self._partitions.get(subject_ref)
        if part is None:
            return 0
        return part.held()

    def drop_subject(self, ref: str) -> int:
        """Remove the subject's whole partition (catalog rows and objects); returns
        the rows and objects removed."""
        with self._lock:
            part = self._partitions.pop(ref, None)
        if part is None:
            part = self._new_partition(ref, checked=False)
        n = part.drop()
        self._ns.drop(ref)  # (not counted: the receipt's counts are the partition's)
        self._pme.forget()
        return n

    def drop_scope(self, ref: str, scope: str) -> int:
        """Remove one scope's rows and files from the subject's partition."""
        part = self._partition(ref)
        n = part.drop_scope(scope)
        self._ns.drop(ref, scope)
        self._pme.forget()
        return n
