"""Eviction everywhere: each open handle drops an erased subject's cached keys, rows
and vectors when its suppression commits, wherever it was erased, and says so.

``Eviction`` is one handle's side of ``keyshred.storage.events``: it subscribes (the
SQLite bus) or runs a ``Listener`` (PostgreSQL ``LISTEN``), and on an event evicts
the subject from every cache of this process — the keyring's DEKs (held *or
co-owned*: ``Keyring.evict_subject``), the memory store's decrypted partitions and
pyarrow's key caches, the vector index's decrypted vectors, and each store's own
``evict`` (tokens pending group commit, cached thread records) — then records an
acknowledgement in ``ks_eviction_acks`` dated by the database's clock. After a
listener reconnects it evicts everything (events may have been missed). Its thread
is also the janitor: every ``sweep_seconds`` expired entries leave every cache,
whether or not anyone asks for them again.

``eviction_metrics`` is what the receipt states: how many processes acknowledged
the request's suppression and the longest time from its commit to one of them
having evicted. Acknowledgements are pruned when a receipt is made (``prune``).
Nothing here logs or stores a subject id: subject_refs and event ids only.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import sqlalchemy as sa

from keyshred.erasure.requests import ErasureRequest
from keyshred.keyring.keyring import Keyring
from keyshred.receipts import ReceiptMetrics
from keyshred.schema import eviction_acks
from keyshred.storage.catalog import Catalog
from keyshred.storage.erasable import Erasable
from keyshred.storage.events import EvictionEvent, Listener, Subscription, subscribe

__all__ = [
    "ACK_RETENTION_US",
    "PROCESS_ID",
    "Cache",
    "Eviction",
    "EvictionMetrics",
    "eviction_metrics",
    "prune",
    "receipt_metrics",
]

_A = eviction_acks
ACK_RETENTION_US = 3_600 * 1_000_000  # acks older than an hour go at the next receipt


class Cache(Protocol):
    """An in-process cache of a subject's plaintext or keys (memory partitions,
    decrypted vectors)."""

    def evict(self, subject_ref: str) -> None: ...

    def note_eviction(self, subject_ref: str | None) -> None: ...

    def evict_all(self) -> None: ...

    def purge_expired(self) -> int: ...

    def held(self, subject_ref: str) -> int: ...


class _ProcessId:
    """Random per process, new in a forked child: names a process in acks without its
    host name or pid."""

    def __init__(self) -> None:
        self._pid = -1
        self._value = ""

    def get(self) -> str:
        if self._pid != os.getpid():
            self._value, self._pid = secrets.token_hex(8), os.getpid()
        return self._value


PROCESS_ID = _ProcessId()


def _cache_name(cache: Cache, index: int) -> str:
    return str(getattr(cache, "name", f"cache{index}"))


@dataclass(frozen=True, slots=True)
class EvictionMetrics:
    """The receipt's eviction figures for one suppression."""

    processes: int  # processes that acknowledged its event
    max_latency_ms: float | None  # commit to the last of them having evicted


class Eviction:
    """One handle's eviction listener, janitor and acknowledgements."""

    def __init__(
        self,
        catalog: Catalog,
        keyring: Keyring,
        caches: Sequence[Cache],
        stores: Sequence[Erasable],
        *,
        sweep_seconds: float,
        on_evicted: Callable[[str, int], None] | None = None,
    ) -> None:
        self._catalog = catalog
        # (cache name, entries or subjects dropped): the handle's metrics
        # (``keyshred_cache_evictions_total{cache}``); names only, never a subject.
        self._on_evicted = on_evicted
        self._keyring = keyring
        self._caches = tuple(caches)
        self._stores = tuple(stores)
        self._lock = threading.Lock()  # one eviction at a time: the listener, the bus
        self.evicted = 0  # events acted on (metrics, tests)
        self._subscription: Subscription | None = None
        self._listener = Listener(
            catalog.engine,
            on_event=self.on_event,
            on_reset=self.evict_all,
            tick=self.sweep,
            tick_seconds=sweep_seconds,
        )
        self._ack_sql = _ack_statement(catalog)

    @property
    def listener(self) -> Listener:
        return self._listener

    def start(self) -> None:
        if self._catalog.dialect == "sqlite":
            self._subscription = subscribe(self._catalog.engine, self.on_event)
        self._listener.start()

    def close(self) -> None:
        if self._subscription is not None:
            self._subscription.close()
            self._subscription = None
        self._listener.close()

    def on_event(self, event: EvictionEvent) -> None:
        """Evict the event's subject from every cache of this process, then ack."""
        self.evict(event.subject_ref)
        self._ack(event)

    def evict(self, subject_ref: str) -> None:
        with self._lock:
            # Announced before anything goes: a read in flight that caches the
            # subject after the keys went sees it and drops what it cached.
            for cache in self._caches:
                cache.note_eviction(subject_ref)
            # Keys first: without them nothing cached elsewhere can be re-derived.
            # Other holders whose keys the subject co-owned (a memory mentioning
            # it, an asset derived from its data) lose what they decrypted too.
            holders = self._keyring.evict_subject(subject_ref)
            for cache in self._caches:
                cache.evict(subject_ref)
                for holder in sorted(holders):
                    cache.evict(holder)
            for store in self._stores:
                store.evict(subject_ref)
            self.evicted += 1
        self._report("keys", 1)
        for i, cache in enumerate(self._caches):
            self._report(_cache_name(cache, i), 1)

    def evict_all(self) -> None:
        """Drop every subject's cached keys, rows and vectors (after a gap in the
        listener's connection: events may have been lost)."""
        with self._lock:
            for cache in self._caches:
                cache.note_eviction(None)
            self._keyring.evict_all()
            for cache in self._caches:
                cache.evict_all()
        self._report("all", 1)

    def sweep(self) -> None:
        """The janitor: expired entries leave every cache now."""
        self._report("keys", self._keyring.purge_expired())
        for i, cache in enumerate(self._caches):
            self._report(_cache_name(cache, i), cache.purge_expired())

    def _report(self, cache: str, count: int) -> None:
        if self._on_evicted is not None and count:
            self._on_evicted(cache, count)

    def held(self, subject_ref: str) -> dict[str, int]:
        """What this process caches of the subject, by cache: counts only (tests and
        drills check that an eviction left nothing)."""
        out = {"keys": self._keyring.held(subject_ref)}
        for i, cache in enumerate(self._caches):
            out[_cache_name(cache, i)] = cache.held(subject_ref)
        return out

    def _ack(self, event: EvictionEvent) -> None:
        params: dict[str, object] = {
            "event_id": event.event_id,
            "process_id": PROCESS_ID.get(),
            "subject_ref": event.subject_ref,
            "epoch": event.epoch,
            "published_at": event.published_us,
        }
        if self._catalog.dialect == "sqlite":
            params["evicted_at"] = time.time_ns() // 1000
        with self._catalog.hot(write=True) as cur:
            cur.execute(self._ack_sql, params)


def _ack_statement(catalog: Catalog) -> str:
    """``INSERT … ON CONFLICT DO NOTHING`` (two handles of one process ack once),
    ``evicted_at`` by the database's clock on PostgreSQL (SQLite has none: this
    host's, as the event's was)."""
    bp = sa.bindparam
    now: sa.ColumnElement[int] = (
        sa.literal_column("(extract(epoch FROM clock_timestamp()) * 1000000)::bigint")
        if catalog.dialect == "postgresql"
        else bp("evicted_at")
    )
    stmt = catalog.insert_ignore(_A).values(
        event_id=bp("event_id"),
        process_id=bp("process_id"),
        subject_ref=bp("subject_ref"),
        epoch=bp("epoch"),
        published_at=bp("published_at"),
        evicted_at=now,
    )
    return catalog.compile({"ack": stmt})["ack"]


def eviction_metrics(catalog: Catalog, subject_ref: str, epoch: int | None) -> EvictionMetrics:
    """How many processes acknowledged the suppression of ``subject_ref`` at deletion
    epoch ``epoch`` and the longest time from its commit to one's eviction."""
    if epoch is None:  # a retention request suppresses nothing
        return EvictionMetrics(0, None)
    query = sa.select(
        sa.func.count(sa.distinct(_A.c.process_id)),
        sa.func.max(
            sa.type_coerce(_A.c.evicted_at, sa.BigInteger)
            - sa.type_coerce(_A.c.published_at, sa.BigInteger)
        ),
    ).where(_A.c.subject_ref == subject_ref, _A.c.epoch == epoch)
    with catalog.transaction() as conn:
        n, worst = conn.execute(query).one()
    return EvictionMetrics(int(n), None if worst is None else round(max(0, int(worst)) / 1000, 3))


def prune(catalog: Catalog, subject_ref: str, epoch: int | None, now_us: int) -> int:
    """Delete the acks a receipt has counted and every ack older than an hour."""
    where = _A.c.evicted_at < now_us - ACK_RETENTION_US
    if epoch is not None:
        where = sa.or_(where, sa.and_(_A.c.subject_ref == subject_ref, _A.c.epoch <= epoch))
    with catalog.transaction() as conn:
        return int(conn.execute(_A.delete().where(where)).rowcount)


def receipt_metrics(catalog: Catalog, req: ErasureRequest) -> ReceiptMetrics:
    """The receipt's eviction figures for ``req``'s suppression; the acks counted
    (and any older than an hour) are pruned."""
    epoch = req.doc["details"].get("suppress", {}).get("epoch")
    m = eviction_metrics(catalog, req.subject_ref, epoch)
    prune(catalog, req.subject_ref, epoch, time.time_ns() // 1000)
    return ReceiptMetrics(eviction_processes=m.processes, eviction_max_latency_ms=m.max_latency_ms)
