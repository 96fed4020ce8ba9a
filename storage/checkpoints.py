"""Encrypted checkpoints and writes of agent threads (the LangGraph saver's engine).

Each thread belongs to one subject, recorded at its first write, and has its own
key: the subject's DEK for the internal scope ``~thread:<thread_ref>``. Checkpoints
(with their metadata) and pending writes are envelope ciphertext under that key,
bound to (thread, namespace, checkpoint id, task, index), in three catalog tables
(``ks_threads``, ``ks_checkpoints``, ``ks_checkpoint_writes``), so one code path runs
on SQLite and PostgreSQL. Thread ids are stored as keyed pseudonyms (and sealed, for
listing); namespaces, checkpoint/run/task ids and channel names are graph structure
and stay plaintext for the queries.

Deleting a thread deletes its rows *and destroys its key* (with a tombstone that
restores replay): whatever copy of those rows survives — a WAL frame, a PostgreSQL
dead tuple, a backup — is noise. Erasing a subject destroys every thread key with
the subject's other keys and deletes the rows.

Every read checks the subject guard before it decrypts; every write checks it inside
its transaction (a new thread also under the subject's partition lock, before its key
is made), so nothing is written for a subject after the transaction that suppressed
it.

Why one module of ~770 lines: ``CheckpointStore`` is one class over three tables that
change together (a thread, its checkpoints, their writes). The statements compiled
once in its constructor serve every method; what a write seals a read opens at the
same place (thread, namespace, checkpoint id, task, index); and the key rules (a
thread's key is made only at its creation, under the subject's partition lock, never
again once ``drop_thread`` destroyed it, and destroyed before its rows are deleted)
run through creation, writes, reads and deletes alike, so they are read and reviewed
as one unit. The row types at the top and the SQL helpers at the bottom are its
private parts; split off, the class alone would still be above 600 lines.
"""

from __future__ import annotations

import struct
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from keyshred.errors import (
    IntegrityError,
    InvalidInput,
    KeyNotFound,
    NotFound,
    SubjectErased,
    SubjectSuppressed,
)
from keyshred.keyring.datakey import DataKey
from keyshred.keyring.envelope import Place, PlaceTemplate, key_id_of
from keyshred.keyring.keyring import Keyring
from keyshred.storage import faults
from keyshred.storage.catalog import ACTIVE, AssetRow, Catalog
from keyshred.storage.erasable import DROP, ErasureTarget, Phase, StoreCheck, StoreErasure
from keyshred.storage.mentions import MentionFinder
from keyshred.storage.schema import checkpoint_writes, checkpoints, subject_guard, threads

__all__ = [
    "THREAD_KIND",
    "CheckpointRow",
    "CheckpointStore",
    "ExportedThread",
    "WriteRow",
    "checkpoint_records",
    "thread_scope",
    "write_records",
]

THREAD_KIND = "thread"
_TENANT_PREFIX = "~threads/"  # domain of thread pseudonyms (tenants never start with "~")
_LEN = struct.Struct(">I")
_THREADS_KEPT = 20_000  # thread records a process keeps (then it starts over)


def thread_scope(thread_ref: str) -> str:
    """The internal key scope of one thread."""
    return f"~thread:{thread_ref}"


def checkpoint_records(
    thread_ref: str, checkpoint_ns: str, checkpoint_id: str, parent: str | None
) -> tuple[str, str]:
    """The record ids a checkpoint's ciphertext is bound to (in its AAD): the one it
    is sealed at, then the one of releases before 2026-12-07, which rows written
    then carry. The first binds the parent pointer too, every field
    length-prefixed (``-`` for no parent): a row whose parent, namespace or id was
    edited fails to open."""
    up = "-" if parent is None else f"{len(parent)}:{parent}"
    current = (
        f"{thread_ref}|2|{len(checkpoint_ns)}:{checkpoint_ns}"
        f"{len(checkpoint_id)}:{checkpoint_id}{up}"
    )
    return current, f"{thread_ref}/{checkpoint_ns}/{checkpoint_id}"


def write_records(  # noqa: PLR0917 - one write's columns, as they are stored
    thread_ref: str,
    checkpoint_ns: str,
    checkpoint_id: str,
    task_id: str,
    idx: int,
    channel: str,
    task_path: str,
) -> tuple[str, str]:
    """``checkpoint_records`` for a pending write: the current record binds its
    channel and task path too (an edited channel would hand the value to another
    channel of the graph)."""
    at = str(idx)
    current = (
        f"{thread_ref}|2|{len(checkpoint_ns)}:{checkpoint_ns}{len(checkpoint_id)}:{checkpoint_id}"
        f"{len(task_id)}:{task_id}{len(at)}:{at}{len(channel)}:{channel}"
        f"{len(task_path)}:{task_path}"
    )
    return current, f"{thread_ref}/{checkpoint_ns}/{checkpoint_id}/{task_id}/{idx}"


def _open_bound(
    key: DataKey, data: bytes, template: PlaceTemplate, records: Sequence[str]
) -> bytes:
    """Open at the current record, else at the earlier one (a row written before
    it existed); ``IntegrityError`` if neither authenticates."""
    try:
        return key.open_encoded(data, template.encoded(records[0]))
    except IntegrityError:
        return key.open_encoded(data, template.encoded(records[1]))


def _write_order(row: Any) -> tuple[str, str, int]:
    """(task_path, task_id, idx) of a ``writes`` row: LangGraph's order of writes."""
    return row[3], row[0], row[1]


def pack(*parts: bytes) -> bytes:
    return b"".join(_LEN.pack(len(p)) + p for p in parts)


def unpack(raw: bytes) -> list[bytes]:
    out = []
    at, end = 0, len(raw)
    length = _LEN.unpack_from
    while at < end:
        (n,) = length(raw, at)
        at += 4
        out.append(raw[at : at + n])  # one copy (a memoryview's slice made two)
        at += n
    return out


@dataclass(frozen=True, slots=True)
class CheckpointRow:
    thread_id: str
    checkpoint_ns: str
    checkpoint_id: str
    parent_checkpoint_id: str | None
    data: bytes  # plaintext (the saver's serialized checkpoint + metadata)

    def __repr__(self) -> str:
        return f"CheckpointRow(checkpoint_id={self.checkpoint_id!r})"


@dataclass(frozen=True, slots=True)
class WriteRow:
    task_id: str
    idx: int
    channel: str
    task_path: str
    data: bytes  # plaintext (the serialized value)

    def __repr__(self) -> str:
        return f"WriteRow(task_id={self.task_id!r}, idx={self.idx})"


@dataclass(frozen=True, slots=True)
class _Thread:
    thread_ref: str
    subject_ref: str
    scope: str


@dataclass(frozen=True, slots=True)
class ExportedThread:
    """One of a subject's threads as a subject export holds it: every checkpoint
    (newest first within a namespace) with its pending writes, opened; ``key_ids``
    are the keys they were sealed under (the export's key is owned by their
    owners too)."""

    thread_id: str
    scope: str
    created_at: datetime
    checkpoints: list[tuple[CheckpointRow, list[WriteRow]]]
    key_ids: frozenset[bytes]

    def __repr__(self) -> str:
        return f"ExportedThread(scope={self.scope!r}, checkpoints={len(self.checkpoints)})"


@dataclass(frozen=True, slots=True)
class _Serialized:
    """A checkpoint's or write's serialized bytes as the mention finder reads an
    item: as text (undecodable bytes become separators), under the thread's scope."""

    value: str
    scope: str
    namespace: tuple[str, ...] = ()
    key: str = ""


class CheckpointStore:
    """Threads, checkpoints and writes; see the module docstring."""

    def __init__(
        self,
        catalog: Catalog,
        keyring: Keyring,
        *,
        tenant: str,
        locked: Callable[[str], AbstractContextManager[None]],
        mentions: MentionFinder | None = None,
    ) -> None:
        self._catalog = catalog
        self._keyring = keyring
        self._tenant = tenant
        # Registered identifiers of other subjects found in what a thread stores make
        # them co-owners of the key it is sealed under (as for a memory).
        self._mentions = mentions
        # The subject's partition lock (``MemoryStore.locked``): an erasure
        # destroys keys under it after suppressing; a thread is made under it.
        self._locked = locked
        self._threads: dict[str, _Thread] = {}
        self._evictions = 0  # eviction events heard of (``evict``)
        self._lock = threading.Lock()
        self._create_lock = threading.Lock()
        self._templates: dict[tuple[str, str], PlaceTemplate] = {}
        c, w, t = checkpoints.c, checkpoint_writes.c, threads.c
        g = subject_guard.c
        bp = sa.bindparam
        # The subject guard rides along with the checkpoint read (one statement):
        # decided before anything is decrypted, without a round trip of its own.
        cols = [
            c.checkpoint_ns,
            c.checkpoint_id,
            c.parent_checkpoint_id,
            c.data,
            g.status,
            g.deletion_epoch,
            g.suppressed_scopes,
        ]
        # The thread's subject (bound), not the row's column: an edited column must
        # not bring another subject's guard.
        guarded = checkpoints.outerjoin(subject_guard, g.subject_ref == bp("subject_ref"))
        self._sql = catalog.compile(
            {
                "thread": sa.select(t.subject_ref, t.scope).where(t.thread_ref == bp("thread_ref")),
                "insert_thread": threads.insert().values(
                    {col.name: bp(col.name) for col in threads.columns}
                ),
                "upsert_checkpoint": _upsert(catalog.dialect, checkpoints, replace=True),
                "insert_write": _upsert(catalog.dialect, checkpoint_writes, replace=False),
                "replace_write": _upsert(catalog.dialect, checkpoint_writes, replace=True),
                "latest": sa.select(*cols)
                .select_from(guarded)
                .where(c.thread_ref == bp("thread_ref"), c.checkpoint_ns == bp("checkpoint_ns"))
                .order_by(c.checkpoint_id.desc()),
                "one": sa.select(*cols)
                .select_from(guarded)
                .where(
                    c.thread_ref == bp("thread_ref"),
                    c.checkpoint_ns == bp("checkpoint_ns"),
                    c.checkpoint_id == bp("checkpoint_id"),
                ),
                "thread_checkpoints": sa.select(
                    c.thread_ref, c.checkpoint_ns, c.checkpoint_id, c.parent_checkpoint_id, c.data
                )
                .where(c.thread_ref == bp("thread_ref"))
                .order_by(c.checkpoint_id.desc(), c.checkpoint_ns),
                "thread_writes": sa.select(
                    w.checkpoint_ns,
                    w.checkpoint_id,
                    w.task_id,
                    w.idx,
                    w.channel,
                    w.task_path,
                    w.data,
                ).where(w.thread_ref == bp("thread_ref")),
                # Writes unordered: ``_rows`` sorts a checkpoint's few (cheaper than
                # SQLite's sort in a temp tree, and one order on both databases).
                "writes": sa.select(w.task_id, w.idx, w.channel, w.task_path, w.data).where(
                    w.thread_ref == bp("thread_ref"),
                    w.checkpoint_ns == bp("checkpoint_ns"),
                    w.checkpoint_id == bp("checkpoint_id"),
                ),
            }
        )

        # LIMIT compiles as a bound parameter; this one is a constant.
        self._sql["latest"] += " LIMIT 1"
        # A write's checks in its transaction, one statement: the thread's row still
        # exists (a ``delete_thread`` deletes it first) and its subject's guard, both
        # locked ``FOR SHARE`` on PostgreSQL (two statements were two round trips).
        guard = sa.select(g.status, g.deletion_epoch, g.suppressed_scopes).where(
            g.subject_ref == bp("subject_ref")
        )
        thread = sa.select(t.thread_ref).where(t.thread_ref == bp("thread_ref"))
        if catalog.dialect == "postgresql":
            guard, thread = guard.with_for_update(read=True), thread.with_for_update(read=True)
        gc, tc = guard.cte("g"), thread.cte("t")
        self._sql |= catalog.compile(
            {
                "write_check": sa.select(
                    tc.c.thread_ref, gc.c.status, gc.c.deletion_epoch, gc.c.suppressed_scopes
                ).select_from(tc.outerjoin(gc, sa.true()))
            }
        )

    # -- threads -------------------------------------------------------------------

    def thread_ref(self, thread_id: str) -> str:
        if not isinstance(thread_id, str) or not thread_id:
            raise InvalidInput("a thread id is a non-empty string")
        return self._keyring.subject_ref(thread_id, _TENANT_PREFIX + self._tenant)

    def _place(self, th: _Thread, table: str, record: str) -> Place:
        return Place(th.subject_ref, thread_scope(th.thread_ref), table, record, "data")

    def _find(self, thread_ref: str) -> _Thread | None:
        th = self._threads.get(thread_ref)
        if th is not None:
            return th
        with self._catalog.hot(write=False) as cur:
            cur.execute(self._sql["thread"], {"thread_ref": thread_ref})
            row = cur.fetchone()
        if row is None:
            return None
        th = _Thread(thread_ref, str(row[0]), str(row[1]))
        self._remember(th)
        return th

    def _remember(self, th: _Thread) -> None:
        # Bounded like the guard and subject_ref caches: a process that touches more
        # threads than this starts over, rather than growing with the store.
        with self._lock:
            if len(self._threads) >= _THREADS_KEPT:
                self._threads.clear()
            self._threads[th.thread_ref] = th

    def thread(self, thread_id: str, *, check: bool = True) -> _Thread | None:
        """The thread's record (guard-checked), or ``None`` if it has no writes."""
        th = self._find(self.thread_ref(thread_id))
        if th is not None and check:
            self._catalog.check_guard(th.subject_ref, scope=th.scope)
        return th

    def ensure_thread(
        self,
        thread_id: str,
        subject_ref: str | None,
        scope: str,
        *,
        new_subject_ref: str | None = None,
        check: bool = True,
    ) -> _Thread:
        """The thread, created for ``subject_ref`` at its first write (or, when that is
        None, for ``new_subject_ref``: the integration's "a thread that names no user
        is its own subject"); a thread never changes subject (``InvalidInput`` if
        asked to). ``check=False``: an existing thread's guard is left to the
        caller's write, whose transaction reads it (``put_checkpoint``,
        ``put_writes``: on PostgreSQL a round trip less per write)."""
        ref = self.thread_ref(thread_id)
        th = self._find(ref)
        if th is not None:
            if subject_ref is not None and subject_ref != th.subject_ref:
                raise InvalidInput("this thread belongs to another subject")
            if scope != th.scope:
                # One scope per thread: a scope's erasure takes its threads whole,
                # so another scope's data must not be written (or copied) into one.
                raise InvalidInput(f"this thread belongs to scope {th.scope!r}, not {scope!r}")
            if check:
                self._catalog.check_guard(th.subject_ref, scope=th.scope)
            return th
        if subject_ref is None:
            subject_ref = new_subject_ref
        if subject_ref is None:
            raise InvalidInput(
                "no subject for this thread: pass config['configurable']['subject_id'] "
                "or give the saver a subject resolver"
            )
        with self._create_lock:  # threads of one process: one creator
            th = self._find(ref)
            if th is None:
                try:
                    th = self._create(ref, thread_id, subject_ref, scope)
                except self._catalog.engine.dialect.dbapi.IntegrityError:  # type: ignore[union-attr]
                    th = self._find(ref)  # another process created it first
                    if th is None:
                        raise
        if th.subject_ref != subject_ref:
            raise InvalidInput("this thread belongs to another subject")
        return th

    def _create(self, ref: str, thread_id: str, subject_ref: str, scope: str) -> _Thread:
        th = _Thread(ref, subject_ref, scope)
        # Under the subject's partition lock, the lock an erasure destroys keys
        # under after suppressing: the guard, the thread's key (created here and
        # only here) and its row, so that the erasure finds the thread with its
        # key, or the thread is refused before any key is made.
        with self._locked(subject_ref):
            self._catalog.check_guard(subject_ref, scope=scope)
            key = self._keyring.data_key(subject_ref, thread_scope(ref))
            faults.reached("thread.key_made")
            sealed = key.seal(thread_id.encode("utf-8"), self._place(th, "threads", ref))
            now = datetime.now(UTC)
            asset = AssetRow(
                asset_id=ref,
                subject_ref=subject_ref,
                scope=scope,
                kind=THREAD_KIND,
                storage_system="catalog",
                storage_key="ks_checkpoints",
                purpose="agent-thread",
                category="conversation",
                created_at=now,
                retain_until=None,
            )
            row = {
                "thread_ref": ref,
                "subject_ref": subject_ref,
                "scope": scope,
                "thread": sealed,
                "created_at": self._catalog.time_param(now),
            }

            def insert_thread(cur: Any) -> None:
                cur.execute(self._sql["insert_thread"], row)
                faults.reached("thread.in_create")

            # One transaction: the guard re-read, the thread's row (its primary key
            # settles a race between processes) and its asset row. A kill leaves
            # both or neither: never a thread the subject's inventory does not list.
            self._catalog.insert_assets(
                [self._catalog.asset_params(asset)],
                scopes={(subject_ref, scope)},
                replace=[ref],
                also=insert_thread,
            )
        self._remember(th)
        return th

    # -- writes --------------------------------------------------------------------

    def _key(self, th: _Thread) -> DataKey:
        """The thread's key, never created here: a write racing ``delete_thread``
        (which destroys the key first) fails instead of bringing the thread back
        under a new key."""
        try:
            return self._keyring.data_key(th.subject_ref, thread_scope(th.thread_ref), create=False)
        except (KeyNotFound, SubjectErased):
            with self._lock:
                self._threads.pop(th.thread_ref, None)
            # The subject's erasure took it (its guard says so), else delete_thread.
            self._catalog.check_guard(th.subject_ref, scope=th.scope)
            raise NotFound("the thread was deleted") from None

    def _check_write(self, cur: Any, th: _Thread) -> None:
        """In a write's transaction: its subject's guard (``SubjectSuppressed`` as
        for every write), and ``NotFound`` if the thread was deleted, by this
        process or another one whose key destruction this process's key cache has
        not seen (its rows would be stored under a destroyed key, for a thread no
        ``delete_thread`` can find any more)."""
        cur.execute(
            self._sql["write_check"],
            {"thread_ref": th.thread_ref, "subject_ref": th.subject_ref},
        )
        row = cur.fetchone()
        if row is None:
            with self._lock:
                self._threads.pop(th.thread_ref, None)
            # Gone: the subject's erasure took it (its guard says so), else
            # delete_thread.
            self._catalog.enforce(
                th.subject_ref, self._catalog.guard_in(cur, th.subject_ref), None, th.scope
            )
            raise NotFound("the thread was deleted")
        self._catalog.enforce(th.subject_ref, self._catalog.guard_of(*row[1:]), None, th.scope)

    def _sealing_key(self, th: _Thread, datas: Sequence[bytes]) -> DataKey:
        """The thread's key, or, when the data holds registered identifiers of
        other subjects, the thread's key shared with them: erasing any of them
        destroys it, so the thread's state that carries their data goes with them.
        Their guards are read before the key is fetched or made and again after (a
        key made before a suppression is one that erasure destroys; one made after
        is refused here, before anything is sealed under it)."""
        key = self._key(th)  # the thread still exists (a racing delete_thread)
        if self._mentions is None:
            return key
        found = self._mentions.find(
            th.subject_ref,
            [_Serialized(d.decode("utf-8", "replace"), th.scope) for d in datas],
        )
        owners = sorted(set().union(*found)) if found else []
        if not owners:
            return key
        # A key may be made here: never for a holder being erased (the write's own
        # guard read comes later, in its transaction).
        self._catalog.check_guard(th.subject_ref, scope=th.scope)
        self._check_owners(owners)
        shared = self._keyring.data_key(th.subject_ref, thread_scope(th.thread_ref), owners=owners)
        self._check_owners(owners)
        return shared

    def _check_owners(self, owners: Iterable[str]) -> None:
        for owner in owners:
            try:
                self._catalog.check_guard(owner)
            except SubjectSuppressed:
                raise SubjectSuppressed(
                    f"the checkpoint is about subject_ref {owner}, which is being erased "
                    "or was erased"
                ) from None

    def put_checkpoint(self, th: _Thread, row: CheckpointRow, run_id: str | None) -> None:
        record = checkpoint_records(
            th.thread_ref, row.checkpoint_ns, row.checkpoint_id, row.parent_checkpoint_id
        )[0]
        key = self._sealing_key(th, [row.data])
        sealed = key.seal(row.data, self._place(th, "checkpoints", record))
        with self._catalog.hot(write=True) as cur:
            self._check_write(cur, th)
            cur.execute(
                self._sql["upsert_checkpoint"],
                {
                    "thread_ref": th.thread_ref,
                    "checkpoint_ns": row.checkpoint_ns,
                    "checkpoint_id": row.checkpoint_id,
                    "parent_checkpoint_id": row.parent_checkpoint_id,
                    "subject_ref": th.subject_ref,
                    "run_id": run_id,
                    "data": sealed,
                },
            )

    def put_writes(
        self,
        th: _Thread,
        checkpoint_ns: str,
        checkpoint_id: str,
        writes: Sequence[WriteRow],
        *,
        replace: bool,
    ) -> None:
        params = []
        if not writes:
            return
        key = self._sealing_key(th, [w.data for w in writes])
        for w in writes:
            record = write_records(
                th.thread_ref,
                checkpoint_ns,
                checkpoint_id,
                w.task_id,
                w.idx,
                w.channel,
                w.task_path,
            )[0]
            params.append(
                {
                    "thread_ref": th.thread_ref,
                    "checkpoint_ns": checkpoint_ns,
                    "checkpoint_id": checkpoint_id,
                    "task_id": w.task_id,
                    "idx": w.idx,
                    "subject_ref": th.subject_ref,
                    "channel": w.channel,
                    "task_path": w.task_path,
                    "data": key.seal(w.data, self._place(th, "writes", record)),
                }
            )
        if not params:
            return
        with self._catalog.hot(write=True) as cur:
            self._check_write(cur, th)
            cur.executemany(self._sql["replace_write" if replace else "insert_write"], params)

    # -- reads ---------------------------------------------------------------------

    def _open(self, th: _Thread, table: str, record: str, data: bytes) -> bytes:
        return self._keyring.open_at(data, self._template(th, table), record)

    def get(
        self, th: _Thread, checkpoint_ns: str, checkpoint_id: str | None
    ) -> tuple[CheckpointRow, list[WriteRow]] | None:
        """One checkpoint (the latest without an id) and its writes; the subject
        guard is read on the same connection first."""
        with self._catalog.hot(write=False) as cur:
            if checkpoint_id is None:
                cur.execute(
                    self._sql["latest"],
                    {
                        "thread_ref": th.thread_ref,
                        "checkpoint_ns": checkpoint_ns,
                        "subject_ref": th.subject_ref,
                    },
                )
            else:
                cur.execute(
                    self._sql["one"],
                    {
                        "thread_ref": th.thread_ref,
                        "checkpoint_ns": checkpoint_ns,
                        "checkpoint_id": checkpoint_id,
                        "subject_ref": th.subject_ref,
                    },
                )
            found = cur.fetchone()
            if found is None:
                # Nothing to decrypt; the guard still decides for a suppressed subject.
                self._catalog.check_guard(th.subject_ref, scope=th.scope)
                return None
            ns, cid, parent, data, status, epoch, scopes = found
            guard = self._catalog.guard_of(status, epoch, scopes)
            self._catalog.enforce(th.subject_ref, guard, None, th.scope)
            cur.execute(
                self._sql["writes"],
                {"thread_ref": th.thread_ref, "checkpoint_ns": ns, "checkpoint_id": cid},
            )
            writes = cur.fetchall()
        return self._rows(th, ns, cid, parent, data, writes)

    def _keys_for(self, key_ids: Sequence[bytes]) -> dict[bytes, DataKey]:
        """The keys of one read's rows, each looked up once; decided before
        decrypting: state sealed under a key shared with subjects it names, one of
        whom is being erased, is unreadable from that subject's suppression on
        (``SubjectSuppressed``), as it will be once the erasure destroys the key
        (``SubjectErased``); listings skip it either way."""
        keys: dict[bytes, DataKey] = {}
        shared = []
        for kid in key_ids:
            if kid in keys:
                continue
            try:
                key = keys[kid] = self._keyring.data_key_by_id(kid)
            except KeyNotFound:
                raise IntegrityError() from None  # an id never issued: forged
            if key.owner_tag:
                shared.append(kid)
        if shared:
            owners = self._keyring.shared_owners(shared)
            if any(self._catalog.owners_suppressed(owners.get(k, ())) for k in shared):
                raise SubjectSuppressed("this checkpoint is about a subject being erased or erased")
        return keys

    def _template(self, th: _Thread, table: str) -> PlaceTemplate:
        template = self._templates.get((th.thread_ref, table))
        if template is None:
            template = PlaceTemplate(th.subject_ref, thread_scope(th.thread_ref), table, "data")
            if len(self._templates) > 10_000:
                self._templates.clear()
            self._templates[(th.thread_ref, table)] = template
        return template

    def _rows(  # noqa: PLR0917 - one row's columns, positionally as the query returns them
        self, th: _Thread, ns: str, cid: str, parent: str | None, data: bytes, writes: Any
    ) -> tuple[CheckpointRow, list[WriteRow]]:
        for task_id, idx, channel, task_path, _ in writes:
            # SQLite keeps whatever type it was given: a blob in a text column is
            # tampering, refused here rather than met as a TypeError in the sort.
            if not (type(task_id) is type(channel) is type(task_path) is str) or (
                type(idx) is not int
            ):
                raise IntegrityError()
        if len(writes) > 1:
            # LangGraph's order of pending writes, by code point on both databases
            # (a PostgreSQL collation would sort "~" and capitals elsewhere).
            writes = sorted(writes, key=_write_order)
        kids = [key_id_of(data), *(key_id_of(w[-1]) for w in writes)]
        keys = self._keys_for(kids)
        ref = th.thread_ref
        records = checkpoint_records(ref, ns, cid, parent)
        plain = _open_bound(keys[kids[0]], data, self._template(th, "checkpoints"), records)
        out = []
        if writes:
            template = self._template(th, "writes")
            for kid, w in zip(kids[1:], writes, strict=True):
                task_id, idx, channel, task_path, wdata = w
                records = write_records(ref, ns, cid, task_id, idx, channel, task_path)
                out.append(
                    WriteRow(
                        str(task_id),
                        int(idx),
                        str(channel),
                        str(task_path),
                        _open_bound(keys[kid], wdata, template, records),
                    )
                )
        row = CheckpointRow("", str(ns), str(cid), None if parent is None else str(parent), plain)
        return row, out

    def checkpoints(
        self,
        th: _Thread | None,
        *,
        checkpoint_ns: str | None = None,
        checkpoint_id: str | None = None,
        before: str | None = None,
    ) -> Iterator[tuple[str, CheckpointRow, list[WriteRow]]]:
        """Checkpoints newest first, with their writes; ``th=None``: every thread of
        every subject that is not suppressed (others are skipped, not raised)."""
        if th is not None and checkpoint_ns is None and checkpoint_id is None and before is None:
            # The common case (one whole thread): compiled statements on the raw cursor.
            with self._catalog.hot(write=False) as cur:
                cur.execute(self._sql["thread_checkpoints"], {"thread_ref": th.thread_ref})
                rows = cur.fetchall()
                cur.execute(self._sql["thread_writes"], {"thread_ref": th.thread_ref})
                thread_writes: dict[tuple[str, str], list[Any]] = {}
                for wr in cur.fetchall():
                    thread_writes.setdefault((wr[0], wr[1]), []).append(wr[2:])
            heard = self._heard()
            for i, (ref, ns, cid, parent, data) in enumerate(rows):
                if i and (self._catalog.guard_cached or self._heard() != heard):
                    # A listing is consumed at the caller's pace: a suppression
                    # stops it before the next row is decrypted (the first row's
                    # check was the caller's).
                    heard = self._heard()
                    self._catalog.check_guard(th.subject_ref, scope=th.scope)
                try:
                    row, wrs = self._rows(
                        th, ns, cid, parent, data, thread_writes.get((ns, cid), [])
                    )
                except SubjectErased:
                    return  # the thread's key went while we listed
                except SubjectSuppressed:
                    continue  # about a subject being erased: skipped, as once erased
                yield ref, row, wrs
            return
        c, w = checkpoints.c, checkpoint_writes.c
        query = sa.select(
            c.thread_ref, c.checkpoint_ns, c.checkpoint_id, c.parent_checkpoint_id, c.data
        )
        if th is not None:
            query = query.where(c.thread_ref == th.thread_ref)
        if checkpoint_ns is not None:
            query = query.where(c.checkpoint_ns == checkpoint_ns)
        if checkpoint_id is not None:
            query = query.where(c.checkpoint_id == checkpoint_id)
        if before is not None:
            query = query.where(c.checkpoint_id < before)
        query = query.order_by(c.checkpoint_id.desc(), c.thread_ref, c.checkpoint_ns)
        with self._catalog.engine.connect() as conn:
            rows = conn.execute(query).all()
            refs = sorted({r[0] for r in rows})
            writes: dict[tuple[str, str, str], list[Any]] = {}
            for start in range(0, len(refs), 500):
                part = refs[start : start + 500]
                for wr in conn.execute(
                    sa.select(
                        w.thread_ref,
                        w.checkpoint_ns,
                        w.checkpoint_id,
                        w.task_id,
                        w.idx,
                        w.channel,
                        w.task_path,
                        w.data,
                    ).where(w.thread_ref.in_(part))
                ):
                    writes.setdefault((wr[0], wr[1], wr[2]), []).append(wr[3:])
        known: dict[str, _Thread | None] = {}
        checked: set[str] = set()
        heard = self._heard()
        for ref, ns, cid, parent, data in rows:
            # The guard before a thread's first row, and again before a further one
            # once a suppression was heard of (the listing is consumed at the
            # caller's pace): a thread whose subject or scope is suppressed
            # meanwhile is skipped from there on, as it was from the start.
            t = known[ref] = known[ref] if ref in known else self._find(ref)
            if t is None:
                continue
            if self._heard() != heard:
                heard = self._heard()
                checked.clear()
            if ref not in checked or self._catalog.guard_cached:
                try:
                    self._catalog.check_guard(t.subject_ref, scope=t.scope)
                except SubjectSuppressed:
                    known[ref] = None
                    continue
                checked.add(ref)
            try:
                row, wrs = self._rows(t, ns, cid, parent, data, writes.get((ref, ns, cid), []))
            except (SubjectErased, SubjectSuppressed):
                continue  # its key went (or goes) while we listed: nothing of it returned
            yield ref, row, wrs

    def thread_id(self, thread_ref: str) -> str:
        """The thread id behind a pseudonym (unsealed from ``ks_threads``)."""
        th = self._find(thread_ref)
        if th is None:
            raise NotFound("no such thread")
        with self._catalog.engine.connect() as conn:
            sealed = conn.execute(
                sa.select(threads.c.thread).where(threads.c.thread_ref == thread_ref)
            ).scalar_one()
        return self._open(th, "threads", thread_ref, sealed).decode("utf-8")

    def exported(self, conn: Any, subject_ref: str) -> list[ExportedThread]:
        """The subject's threads for its export, read on ``conn`` (the export's one
        transaction: one point in time with the rest of the package, the guard
        included). Left out, as reads refuse and listings skip them: threads of a
        scope suppressed at that point, a thread whose key is gone (a
        ``delete_thread`` a kill interrupted), and checkpoints sealed under a key
        shared with a subject being erased. A subject suppressed by then:
        ``SubjectSuppressed``."""
        g, t = subject_guard.c, threads.c
        guard = self._catalog.guard_of(
            *(
                conn.execute(
                    sa.select(g.status, g.deletion_epoch, g.suppressed_scopes).where(
                        g.subject_ref == subject_ref
                    )
                ).first()
                or (None, None, None)
            )
        )
        self._catalog.enforce(subject_ref, guard, None)
        suppressed_scopes = guard.scopes
        found = conn.execute(
            sa.select(t.thread_ref, t.scope, t.thread, t.created_at)
            .where(t.subject_ref == subject_ref)
            .order_by(t.created_at, t.thread_ref)
        ).all()
        out = []
        for ref, scope, sealed, created_at in found:
            th = _Thread(str(ref), subject_ref, str(scope))
            if th.scope in suppressed_scopes:
                continue
            try:
                thread_id = self._open(th, "threads", th.thread_ref, sealed).decode("utf-8")
            except (KeyNotFound, SubjectErased):
                continue
            # The hot path's own statements, on the export's connection.
            bound = {"thread_ref": th.thread_ref}
            pending: dict[tuple[str, str], list[Any]] = {}
            for wr in conn.exec_driver_sql(self._sql["thread_writes"], bound):
                pending.setdefault((wr[0], wr[1]), []).append(tuple(wr[2:]))
            opened = []
            kids: set[bytes] = set()
            for _, ns, cid, parent, data in conn.exec_driver_sql(
                self._sql["thread_checkpoints"], bound
            ):
                writes = pending.get((ns, cid), [])
                try:
                    opened.append(self._rows(th, ns, cid, parent, data, writes))
                except (SubjectSuppressed, SubjectErased):
                    continue  # about a subject being erased, or erased
                kids.update([key_id_of(data), *(key_id_of(x[-1]) for x in writes)])
            out.append(ExportedThread(thread_id, th.scope, created_at, opened, frozenset(kids)))
        return out

    # -- deletes -------------------------------------------------------------------

    def _delete(self, where_c: Any, where_w: Any) -> int:
        with self._catalog.transaction() as conn:
            n = int(conn.execute(checkpoints.delete().where(where_c)).rowcount or 0)
            conn.execute(checkpoint_writes.delete().where(where_w))
        self._catalog.scrub()
        return n

    def delete_checkpoints(self, th: _Thread, keys: Iterable[tuple[str, str]]) -> int:
        """Delete given (namespace, checkpoint id) of a thread with their writes."""
        keys = list(keys)
        n = 0
        c, w = checkpoints.c, checkpoint_writes.c
        for start in range(0, len(keys), 200):
            part = keys[start : start + 200]
            n += self._delete(
                sa.and_(
                    c.thread_ref == th.thread_ref,
                    sa.tuple_(c.checkpoint_ns, c.checkpoint_id).in_(part),
                ),
                sa.and_(
                    w.thread_ref == th.thread_ref,
                    sa.tuple_(w.checkpoint_ns, w.checkpoint_id).in_(part),
                ),
            )
        return n

    def run_checkpoints(self, run_ids: Sequence[str]) -> list[tuple[str, str, str]]:
        """(thread_ref, namespace, checkpoint id) of checkpoints written by runs."""
        if not run_ids:
            return []
        c = checkpoints.c
        with self._catalog.engine.connect() as conn:
            rows = conn.execute(
                sa.select(c.thread_ref, c.checkpoint_ns, c.checkpoint_id).where(
                    c.run_id.in_(list(run_ids))
                )
            ).all()
        return [(str(a), str(b), str(d)) for a, b, d in rows]

    def drop_thread(self, thread_id: str) -> int:
        """Delete a thread's rows and destroy its key (crypto-erasure with a
        tombstone); returns checkpoints deleted. Idempotent."""
        ref = self.thread_ref(thread_id)
        th = self._find(ref)
        if th is None:
            return 0
        return self._drop(th)

    def _drop(self, th: _Thread) -> int:
        # The key first: a write in flight then fails (``_key``) rather than
        # storing rows after the delete below, or under a key made anew. A kill
        # right after leaves the thread findable (its rows unreadable) for
        # ``delete_thread`` to finish.
        self._keyring.destroy(th.subject_ref, thread_scope(th.thread_ref))
        faults.reached("thread.after_key")
        # One transaction, the thread's row first: a write of another process
        # (whose key cache still holds the key) holds that row ``FOR SHARE`` while
        # it writes, so its rows are committed before the deletes below see the
        # table, or it finds the thread gone (``_check_write``). The thread's
        # asset row goes in the same commit: a kill never leaves it registered
        # for a thread no one can find.
        with self._catalog.transaction() as conn:
            conn.execute(threads.delete().where(threads.c.thread_ref == th.thread_ref))
            n = int(
                conn.execute(
                    checkpoints.delete().where(checkpoints.c.thread_ref == th.thread_ref)
                ).rowcount
                or 0
            )
            conn.execute(
                checkpoint_writes.delete().where(checkpoint_writes.c.thread_ref == th.thread_ref)
            )
            self._catalog.delete([th.thread_ref], conn)
            faults.reached("thread.before_commit")
        faults.reached("thread.after_commit")
        self._catalog.scrub()
        with self._lock:
            self._threads.pop(th.thread_ref, None)
        return n

    def idle_threads(self, before: datetime) -> list[str]:
        """Threads whose newest checkpoint was written before ``before`` (read from
        the time in LangGraph's UUIDv6 checkpoint ids; other ids are skipped)."""
        c = checkpoints.c
        with self._catalog.engine.connect() as conn:
            rows = conn.execute(
                sa.select(c.thread_ref, sa.func.max(c.checkpoint_id)).group_by(c.thread_ref)
            ).all()
        out = []
        for ref, newest in rows:
            at = _uuid6_time(str(newest))
            if at is not None and at < before:
                out.append(str(ref))
        return out

    def drop_thread_ref(self, thread_ref: str) -> int:
        """``drop_thread`` by pseudonym (the retention run has no thread ids)."""
        th = self._find(thread_ref)
        return 0 if th is None else self._drop(th)

    def drop_subject(self, subject_ref: str, scope: str | None = None) -> int:
        """Delete the subject's threads (all, or one thread scope / policy scope);
        the keys go with the erasure's key destruction. Returns the threads deleted
        (the receipt's ``threads-deleted``: threads, not their checkpoints)."""
        with self._catalog.engine.connect() as conn:
            q = sa.select(threads.c.thread_ref, threads.c.scope).where(
                threads.c.subject_ref == subject_ref
            )
            found = conn.execute(q).all()
        refs = [
            str(r) for r, s in found if scope is None or s == scope or thread_scope(str(r)) == scope
        ]
        for start in range(0, len(refs), 200):
            part = refs[start : start + 200]
            self._delete(
                checkpoints.c.thread_ref.in_(part), checkpoint_writes.c.thread_ref.in_(part)
            )
            with self._catalog.transaction() as conn:
                conn.execute(threads.delete().where(threads.c.thread_ref.in_(part)))
        dropped = set(refs)
        if scope is None:  # rows of threads whose record a crash already removed
            with self._catalog.engine.connect() as conn:
                for table in (checkpoints, checkpoint_writes):
                    dropped.update(
                        str(r)
                        for r in conn.execute(
                            sa.select(table.c.thread_ref)
                            .where(table.c.subject_ref == subject_ref)
                            .distinct()
                        ).scalars()
                    )
            self._delete(
                checkpoints.c.subject_ref == subject_ref,
                checkpoint_writes.c.subject_ref == subject_ref,
            )
        with self._lock:
            for r in refs:
                self._threads.pop(r, None)
        return len(dropped)

    def count(self, subject_ref: str) -> int:
        with self._catalog.engine.connect() as conn:
            return int(
                conn.execute(
                    sa.select(sa.func.count())
                    .select_from(checkpoints)
                    .where(checkpoints.c.subject_ref == subject_ref)
                ).scalar_one()
            ) + int(
                conn.execute(
                    sa.select(sa.func.count())
                    .select_from(threads)
                    .where(threads.c.subject_ref == subject_ref)
                ).scalar_one()
            )

    def subject_threads(self, subject_ref: str) -> list[str]:
        with self._catalog.engine.connect() as conn:
            return [
                str(r)
                for (r,) in conn.execute(
                    sa.select(threads.c.thread_ref).where(threads.c.subject_ref == subject_ref)
                )
            ]

    def forget(self) -> None:
        with self._lock:
            self._threads.clear()

    def active(self, subject_ref: str) -> bool:
        return self._catalog.guard(subject_ref).status == ACTIVE

    # -- Erasable (keyshred.storage.erasable) ---------------------------------------

    name = "checkpoints"
    phase: Phase = DROP

    def key_scopes(self, subject_ref: str, scope: str) -> list[str]:
        """The key scopes of the subject's threads in policy scope ``scope`` (each
        thread has a key of its own): a scope's erasure destroys them with the
        scope's keys, so a copy of their rows anywhere is noise from then on."""
        t = threads.c
        with self._catalog.engine.connect() as conn:
            refs = conn.execute(
                sa.select(t.thread_ref).where(t.subject_ref == subject_ref, t.scope == scope)
            ).scalars()
            return [thread_scope(str(r)) for r in refs]

    def erase(self, target: ErasureTarget) -> StoreErasure:
        """The subject's (scope's) agent threads; listed memories leave threads to
        their own retention (``retention.checkpoints_days``)."""
        n = 0 if target.assets is not None else self.drop_subject(target.subject_ref, target.scope)
        faults.reached("erase.checkpoints")
        return StoreErasure(self.name, "threads-deleted", n, datetime.now(UTC), found=n > 0)

    def verify(self, target: ErasureTarget) -> list[StoreCheck]:
        if not target.whole_subject:
            return []  # a scope's threads: their keys are destroyed (``key_scopes``)
        left = self.count(target.subject_ref)
        return [StoreCheck("no thread or checkpoint left", not left, f"{left} rows left")]

    def evict(self, subject_ref: str) -> None:
        """Forget the cached thread records (they hold no key or value); a listing
        under way reads the guard again before its next row."""
        del subject_ref  # the cache is small: all of it goes
        with self._lock:
            self._evictions += 1
        self.forget()

    def _heard(self) -> tuple[int, int]:
        """Guard changes this process made, and eviction events it heard of."""
        return self._catalog.guard_changes, self._evictions


def _uuid6_time(value: str) -> datetime | None:
    """The creation time in a UUIDv6 (LangGraph's checkpoint ids), else ``None``."""
    try:
        u = uuid.UUID(value)
    except ValueError:
        return None
    if u.version != 6:
        return None
    i = u.int
    ticks = ((i >> 96) << 28) | (((i >> 80) & 0xFFFF) << 12) | ((i >> 64) & 0xFFF)
    return datetime.fromtimestamp((ticks - 0x01B21DD213814000) / 1e7, UTC)


def _upsert(dialect: str, table: sa.Table, *, replace: bool) -> Any:
    """INSERT … ON CONFLICT (primary key) DO UPDATE / DO NOTHING, per dialect."""
    values: dict[str, Any] = {col.name: sa.bindparam(col.name) for col in table.columns}
    stmt: Any
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        stmt = pg_insert(table).values(values)
    else:
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        stmt = sqlite_insert(table).values(values)
    keys = [col.name for col in table.primary_key.columns]
    if not replace:
        return stmt.on_conflict_do_nothing(index_elements=keys)
    rest = {col.name: stmt.excluded[col.name] for col in table.columns if col.name not in keys}
    return stmt.on_conflict_do_update(index_elements=keys, set_=rest)
