"""The catalog's side of memory partitions: heads, hot rows and segment lists.

A subject's partition is, in the catalog (``keyshred.storage.schema``):

- its head in ``ks_mem_partitions``: ``gen`` (bumped by every compaction) and the
  sequence range ``[base_seq, next_seq)`` of its hot rows;
- its hot rows in ``ks_mem_hot``: sealed records of writes not yet compacted, one
  per (write, scope), numbered without gaps inside that range;
- its segments in ``ks_mem_segments``: the immutable Parquet objects that hold the
  rest, and those a compaction retired (``retired_at``) whose objects are deleted
  once no reader can still need them.

A put's hot rows go in with its catalog assets, in one transaction (``appender``);
a compaction publishes its segments, retires the old ones and deletes the rows it
folded in one transaction (``publish``). A small partition's compaction publishes
no segment: its rows go back in as one hot record per scope, in that transaction
(``Partition._flush_inline``). Every change compares the head it read with the one
in the database (under the subject lock they are equal; a difference is a lock
that was not held, refused as ``IntegrityError`` rather than merged).
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import sqlalchemy as sa

from keyshred import db
from keyshred.errors import IntegrityError
from keyshred.storage.catalog import Catalog
from keyshred.storage.schema import assets, memory_hot, memory_partitions, memory_segments

__all__ = [
    "EMPTY",
    "Head",
    "HotRecord",
    "HotTier",
    "ListedSegment",
    "Loaded",
    "Newest",
    "Segment",
    "live_segments",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Head:
    gen: int
    base_seq: int
    next_seq: int


EMPTY = Head(0, 0, 0)  # a subject with no partition yet


@dataclass(frozen=True, slots=True)
class Segment:
    name: str
    scope: str
    rows: int
    key_id: str
    # The object's size and SHA-256, its rows' earliest retain-until (microseconds);
    # None for segments written before revision 0005.
    size: int | None = None
    sha256: str | None = None
    retain_min: int | None = None


@dataclass(frozen=True, slots=True)
class ListedSegment:
    """A live segment of some subject, as a backup or the retention scan lists it."""

    subject_ref: str
    segment: Segment


@dataclass(frozen=True, slots=True)
class HotRecord:
    seq: int
    scope: str
    record: bytes  # sealed

    def __repr__(self) -> str:
        return f"HotRecord(seq={self.seq}, scope={self.scope!r})"


@dataclass(frozen=True, slots=True)
class Loaded(Generic[T]):
    """``HotTier.load_state``: a partition's catalog state at one instant."""

    head: Head | None  # None: no partition
    segments: list[Segment]  # the live ones, by scope and name
    records: list[HotRecord]
    names: dict[str, int | None]  # every segment named: name -> retired_at (None: live)
    extra: T | None


@dataclass(frozen=True, slots=True)
class Newest:
    """``HotTier.newest``: what a cold get reads, at one instant."""

    head: Head
    records: list[HotRecord]  # the newest, in sequence order
    deleting: bool  # a deletion of the subject was marked and not finished
    segments: bool  # a live segment holds some of its memories
    # The assets the catalog files in the partition, (id, scope): read for a
    # partition of at most the asked number of hot rows only (else None).
    assets: list[tuple[str, str]] | None


def _p(name: str) -> Any:
    return sa.bindparam(name)


def _segment(r: Any) -> Segment:
    return Segment(
        r.name,
        r.scope,
        int(r.rows),
        r.key_id,
        None if r.size is None else int(r.size),
        r.sha256,
        None if r.retain_min is None else int(r.retain_min),
    )


def live_segments(conn: Any, *, expiring_by: int | None = None) -> list[ListedSegment]:
    """Every subject's live segments on ``conn`` (a connection of the catalog or of
    a snapshot of it); with ``expiring_by`` (microseconds) only those holding a row
    whose retain-until is at or before it (or not known: written before 0005)."""
    seg = memory_segments
    query = sa.select(seg).where(seg.c.retired_at.is_(None))
    if expiring_by is not None:
        query = query.where(sa.or_(seg.c.retain_min.is_(None), seg.c.retain_min <= expiring_by))
    rows = conn.execute(query.order_by(seg.c.subject_ref, seg.c.scope, seg.c.name))
    return [ListedSegment(r.subject_ref, _segment(r)) for r in rows]


class HotTier:
    """Statements on one catalog's partition tables."""

    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog
        # SQLite: a connection kept only to ask ``PRAGMA data_version``, which changes
        # whenever another connection (this process's pool, another process) commits
        # to the file; a reader whose partition is loaded skips the head statement
        # while it does not change (``change_token``). Opened lazily, per process.
        self._watch: sqlite3.Connection | None = None
        self._watch_pid = 0
        self._watch_lock = threading.Lock()
        self._watch_path = db.sqlite_file(catalog.engine.url)
        h, hot, seg = memory_partitions, memory_hot, memory_segments
        self._sql = catalog.compile(
            {
                "head": sa.select(h.c.gen, h.c.base_seq, h.c.next_seq).where(
                    h.c.subject_ref == _p("ref")
                ),
                "advance": h.update()
                .where(
                    h.c.subject_ref == _p("ref"),
                    h.c.gen == _p("gen"),
                    h.c.next_seq == _p("old"),
                )
                .values(next_seq=_p("new")),
                "create": h.insert().values(
                    subject_ref=_p("ref"), gen=_p("gen"), base_seq=_p("base"), next_seq=_p("new")
                ),
                "all_segments": sa.select(
                    seg.c.name,
                    seg.c.scope,
                    seg.c.rows,
                    seg.c.key_id,
                    seg.c.size,
                    seg.c.sha256,
                    seg.c.retain_min,
                    seg.c.retired_at,
                )
                .where(seg.c.subject_ref == _p("ref"))
                .order_by(seg.c.scope, seg.c.name),
                "hot_from": sa.select(hot.c.seq, hot.c.scope, hot.c.record)
                .where(hot.c.subject_ref == _p("ref"), hot.c.seq >= _p("start"))
                .order_by(hot.c.seq),
                # A cold get's one statement, of one instant: the head, whether a
                # deletion of the subject is unfinished (its assets marked; a crash
                # stopped it: the literal lets the partial index ks_assets_deleting
                # answer), whether it has a live segment and its newest hot rows
                # (none joined: a head alone; no row at all: no partition); then,
                # for a partition small enough to be read whole, the assets the
                # catalog files in it (with their scopes: the load's comparison).
                "newest": sa.union_all(
                    sa.select(
                        h.c.gen,
                        h.c.base_seq,
                        h.c.next_seq,
                        sa.exists()
                        .where(
                            assets.c.subject_ref == h.c.subject_ref,
                            assets.c.status == sa.literal_column("'deleting'"),
                        )
                        .label("deleting"),
                        sa.exists()
                        .where(seg.c.subject_ref == h.c.subject_ref, seg.c.retired_at.is_(None))
                        .label("segments"),
                        sa.cast(sa.null(), assets.c.asset_id.type).label("asset_id"),
                        hot.c.seq,
                        hot.c.scope,
                        hot.c.record,
                    )
                    .select_from(
                        h.outerjoin(
                            hot,
                            sa.and_(
                                hot.c.subject_ref == h.c.subject_ref,
                                hot.c.seq >= h.c.base_seq,
                                hot.c.seq >= h.c.next_seq - _p("limit"),
                            ),
                        )
                    )
                    .where(h.c.subject_ref == _p("ref")),
                    sa.select(
                        h.c.gen,
                        h.c.base_seq,
                        h.c.next_seq,
                        sa.cast(sa.null(), sa.Boolean),
                        sa.cast(sa.null(), sa.Boolean),
                        assets.c.asset_id,
                        sa.cast(sa.null(), hot.c.seq.type),
                        assets.c.scope,
                        sa.cast(sa.null(), hot.c.record.type),
                    )
                    .select_from(
                        h.join(
                            assets,
                            sa.and_(
                                assets.c.subject_ref == h.c.subject_ref,
                                assets.c.storage_key == _p("storage_key"),
                            ),
                        )
                    )
                    .where(
                        h.c.subject_ref == _p("ref"),
                        h.c.next_seq - h.c.base_seq <= _p("limit"),
                    ),
                ),
                "segment_names": sa.select(seg.c.name, seg.c.retired_at).where(
                    seg.c.subject_ref == _p("ref")
                ),
                "insert_hot": hot.insert().values(
                    subject_ref=_p("ref"), seq=_p("seq"), scope=_p("scope"), record=_p("record")
                ),
            }
        )

    # -- reads -------------------------------------------------------------------------

    def change_token(self) -> int | None:
        """A number that stays the same while nothing was committed to the catalog
        by anyone (SQLite's ``data_version`` seen from a connection that never
        writes); None where there is none (PostgreSQL: the head is read instead)."""
        if self._watch_path is None:
            return None
        with self._watch_lock:
            if self._watch is None or self._watch_pid != os.getpid():
                # A connection must not cross a fork: a child opens its own.
                self._watch = sqlite3.connect(
                    self._watch_path, check_same_thread=False, isolation_level=None
                )
                self._watch_pid = os.getpid()
            row = self._watch.execute("PRAGMA data_version").fetchone()
        return int(row[0])

    def close(self) -> None:
        """Close the watching connection (a later ``change_token`` opens another)."""
        with self._watch_lock:
            watch, self._watch = self._watch, None
        if watch is not None and self._watch_pid == os.getpid():
            watch.close()

    def head(self, ref: str) -> Head | None:
        """The subject's head (None: no partition); one statement."""
        with self._catalog.hot(write=False) as cur:
            return self._head(cur, ref)

    def state(
        self, ref: str, *, since: int | None
    ) -> tuple[Head | None, list[Segment] | None, list[HotRecord]]:
        """Head, live segments and hot rows of one instant (one read transaction:
        ``REPEATABLE READ`` on PostgreSQL, a deferred ``BEGIN`` on SQLite, no write
        lock). With ``since`` only the hot rows from that sequence on and no segment
        list (a reader catching up)."""
        if since is None:
            loaded: Loaded[None] = self.load_state(ref)
            return loaded.head, loaded.segments, loaded.records
        with self._catalog.hot(write=False, snapshot=True) as cur:
            head = self._head(cur, ref)
            if head is None:
                return None, [], []
            return head, None, self._records(cur, ref, since)

    def load_state(self, ref: str, also: Callable[[Any], T] | None = None) -> Loaded[T]:
        """What a partition's load reads, at one instant: the head, the live
        segments, every segment the catalog names (retired ones with their time:
        the load's cleanup needs them), the hot rows, and ``also(cursor)`` run in
        the same read transaction (the memories the catalog says the partition
        holds). One transaction rather than three: a first touch of a subject
        pays one check-out (and on PostgreSQL one round trip per statement, not
        per statement plus a BEGIN and a COMMIT each). Compiled statements on the
        driver's cursor."""
        with self._catalog.hot(write=False, snapshot=True) as cur:
            extra = None if also is None else also(cur)
            head = self._head(cur, ref)
            if head is None:
                return Loaded(None, [], [], {}, extra)
            cur.execute(self._sql["all_segments"], {"ref": ref})
            segments, names = [], {}
            for name, scope, rows, key_id, size, sha256, retain_min, retired in cur.fetchall():
                names[str(name)] = None if retired is None else int(retired)
                if retired is None:
                    segments.append(
                        Segment(
                            name,
                            scope,
                            int(rows),
                            key_id,
                            None if size is None else int(size),
                            sha256,
                            None if retain_min is None else int(retain_min),
                        )
                    )
            records = self._records(cur, ref, head.base_seq)
        return Loaded(head, segments, records, names, extra)

    def newest(self, ref: str, limit: int, storage_key: str) -> Newest | None:
        """What a cold get reads, of one instant (one statement, no transaction
        around it): the head, the newest ``limit`` hot rows (in sequence order), whether
        a deletion is unfinished or a segment is live, and, if the partition has at
        most ``limit`` hot rows, the assets filed under ``storage_key`` with their
        scopes; None: no partition."""
        with self._catalog.hot(write=False) as cur:
            cur.execute(
                self._sql["newest"], {"ref": ref, "limit": limit, "storage_key": storage_key}
            )
            rows = cur.fetchall()
        head_rows = [r for r in rows if r[3] is not None]  # the first select's
        if not head_rows:
            return None
        gen, base, nxt, deleting, segments = head_rows[0][:5]
        head = Head(int(gen), int(base), int(nxt))
        records = sorted(
            (
                HotRecord(int(seq), scope, db.blob(record))
                for *_, seq, scope, record in head_rows
                if seq is not None
            ),
            key=lambda r: r.seq,
        )
        filed = [(str(r[5]), str(r[7])) for r in rows if r[5] is not None]
        small = head.next_seq - head.base_seq <= limit
        return Newest(head, records, bool(deleting), bool(segments), filed if small else None)

    def _head(self, cur: Any, ref: str) -> Head | None:
        cur.execute(self._sql["head"], {"ref": ref})
        row = cur.fetchone()
        return None if row is None else Head(int(row[0]), int(row[1]), int(row[2]))

    def _records(self, cur: Any, ref: str, start: int) -> list[HotRecord]:
        cur.execute(self._sql["hot_from"], {"ref": ref, "start": start})
        return [
            HotRecord(int(seq), scope, db.blob(record)) for seq, scope, record in cur.fetchall()
        ]

    def segment_names(self, ref: str) -> dict[str, int | None]:
        """Every segment object the catalog names for ``ref``: name -> retired_at (a
        read: it takes no write lock)."""
        with self._catalog.hot(write=False) as cur:
            cur.execute(self._sql["segment_names"], {"ref": ref})
            return {str(name): None if at is None else int(at) for name, at in cur.fetchall()}

    def live(self, *, expiring_by: int | None = None) -> list[ListedSegment]:
        """``live_segments`` of the catalog now."""
        with self._catalog.transaction() as conn:
            return live_segments(conn, expiring_by=expiring_by)

    def retired_subjects(self, before_us: int) -> list[str]:
        """Subjects with a segment retired at or before ``before_us`` whose object
        may still exist (the sweep deletes them)."""
        seg = memory_segments
        with self._catalog.transaction() as conn:
            return [
                str(r)
                for (r,) in conn.execute(
                    sa.select(seg.c.subject_ref)
                    .where(seg.c.retired_at.is_not(None), seg.c.retired_at <= before_us)
                    .distinct()
                )
            ]

    def counts(self, ref: str, scope: str | None = None) -> tuple[int, int, int]:
        """(head rows, hot rows, segment rows) the catalog holds for ``ref``."""
        out = []
        with self._catalog.transaction() as conn:
            for table in (memory_partitions, memory_hot, memory_segments):
                where = table.c.subject_ref == ref
                if scope is not None and "scope" in table.c:
                    where = sa.and_(where, table.c.scope == scope)
                elif scope is not None:
                    out.append(0)
                    continue
                out.append(int(conn.execute(sa.select(sa.func.count()).where(where)).scalar() or 0))
        return out[0], out[1], out[2]

    def subjects(self) -> list[str]:
        with self._catalog.transaction() as conn:
            return [r[0] for r in conn.execute(sa.select(memory_partitions.c.subject_ref))]

    # -- writes ------------------------------------------------------------------------

    def appender(self, ref: str, head: Head, records: Sequence[HotRecord]) -> Callable[[Any], None]:
        """Statements that add ``records`` after ``head`` on a caller's cursor, in
        the caller's transaction (a put's asset registration)."""
        sql = self._sql
        new = head.next_seq + len(records)

        def run(cur: Any) -> None:
            cur.execute(
                sql["advance"], {"ref": ref, "gen": head.gen, "old": head.next_seq, "new": new}
            )
            if cur.rowcount != 1:
                if head != EMPTY:
                    raise IntegrityError(f"partition {ref} changed under its lock")
                cur.execute(sql["create"], {"ref": ref, "gen": 0, "base": 0, "new": new})
            cur.executemany(
                sql["insert_hot"],
                [{"ref": ref, "seq": r.seq, "scope": r.scope, "record": r.record} for r in records],
            )

        return run

    def append(self, ref: str, head: Head, records: Sequence[HotRecord]) -> None:
        """``appender`` in a transaction of its own."""
        with self._catalog.hot(write=True) as cur:
            self.appender(ref, head, records)(cur)

    def publish(
        self,
        ref: str,
        head: Head,
        segments: Sequence[Segment],
        retire: Sequence[str],
        now_us: int,
        *,
        records: Sequence[HotRecord] = (),
    ) -> Head:
        """A compaction's commit: the new segments join the partition, ``retire``
        leave it, the hot rows before ``head.next_seq`` go (they are in the new
        segments now, or in ``records``: a small partition's compaction into the
        catalog, numbered from ``head.next_seq`` on), the generation moves on.
        Returns the new head."""
        h, hot, seg = memory_partitions, memory_hot, memory_segments
        if [r.seq for r in records] != list(range(head.next_seq, head.next_seq + len(records))):
            raise IntegrityError(f"partition {ref}: a compaction's records must follow its head")
        new = Head(head.gen + 1, head.next_seq, head.next_seq + len(records))
        with self._catalog.transaction() as conn:
            changed = conn.execute(
                h.update()
                .where(h.c.subject_ref == ref, h.c.gen == head.gen, h.c.next_seq == head.next_seq)
                .values(gen=new.gen, base_seq=new.base_seq, next_seq=new.next_seq)
            ).rowcount
            if changed != 1:
                if head != EMPTY:
                    raise IntegrityError(f"partition {ref} changed under its lock")
                conn.execute(
                    h.insert().values(
                        subject_ref=ref, gen=new.gen, base_seq=new.base_seq, next_seq=new.next_seq
                    )
                )
            if segments:
                conn.execute(
                    seg.insert(),
                    [
                        {
                            "subject_ref": ref,
                            "name": s.name,
                            "scope": s.scope,
                            "rows": s.rows,
                            "key_id": s.key_id,
                            "retired_at": None,
                            "size": s.size,
                            "sha256": s.sha256,
                            "retain_min": s.retain_min,
                        }
                        for s in segments
                    ],
                )
            if retire:
                conn.execute(
                    seg.update()
                    .where(seg.c.subject_ref == ref, seg.c.name.in_(list(retire)))
                    .values(retired_at=now_us)
                )
            conn.execute(hot.delete().where(hot.c.subject_ref == ref, hot.c.seq < head.next_seq))
            if records:
                conn.execute(
                    hot.insert(),
                    [
                        {"subject_ref": ref, "seq": r.seq, "scope": r.scope, "record": r.record}
                        for r in records
                    ],
                )
        return new

    def forget_segments(self, ref: str, names: Sequence[str]) -> None:
        """Remove retired segments' rows once their objects are deleted."""
        if not names:
            return
        seg = memory_segments
        with self._catalog.transaction() as conn:
            conn.execute(
                seg.delete().where(
                    seg.c.subject_ref == ref,
                    seg.c.name.in_(list(names)),
                    seg.c.retired_at.is_not(None),
                )
            )

    def drop(self, ref: str) -> int:
        """Delete the subject's head, hot rows and segment rows; returns the number
        of hot rows and segment rows there were."""
        n = 0
        with self._catalog.transaction() as conn:
            for table in (memory_hot, memory_segments, memory_partitions):
                count = conn.execute(table.delete().where(table.c.subject_ref == ref)).rowcount
                if table is not memory_partitions:
                    n += int(count)
        return n
