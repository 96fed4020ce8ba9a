"""Eviction events: a subject's suppression tells every process to drop what it holds.

Caches live per process (unwrapped keys, decrypted rows and vectors); only the
erasing process used to evict, so a worker elsewhere kept an erased subject's keys
and plaintext in memory until its TTL, or for ever for an unused partition. The
suppression now publishes an event that every open handle acts on:

- **PostgreSQL**: ``publish`` runs ``pg_notify`` inside the suppressing
  transaction, so the event is delivered at its commit, never before and never for
  a transaction rolled back. Channels are per database, schemas are not: the
  channel is ``keyshred_evict_`` and a digest of the catalog's schema
  (``channel``), so stores in two schemas of one database hear only their own.
  Each handle's ``Listener`` holds its own connection (``LISTEN``) on a daemon
  thread and reconnects with backoff when it drops; after a reconnect it resets
  (evicts everything), since events sent while it was away are lost.
- **SQLite** (the embedded profile: one machine, and in practice one process per
  folder): an in-process bus per database file. ``publish`` only makes the event;
  ``deliver`` hands it to every handle of this process open on that file after the
  commit, in the caller's thread, so the eviction is done when ``suppress`` returns.

An event carries ids only: event id, subject_ref, scope, deletion epoch and the
publishing database's clock in microseconds (``published_us``, read inside the
transaction just before its commit); receivers record their acknowledgement by the
same clock (``keyshred.erasure.eviction``). The listener's thread also runs the
handle's janitor (``tick``), which drops expired cache entries on a schedule.
Log lines name event ids and error types, never a subject_ref.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from keyshred import db

__all__ = ["CHANNEL", "EvictionEvent", "Listener", "channel", "deliver", "publish", "subscribe"]

CHANNEL = "keyshred_evict"  # the channel's prefix: ``channel`` adds the schema's digest
# The channel of the connection's schema (its search_path's first), as SQL: the
# publisher names it inside its NOTIFY, the listener asks it before its LISTEN.
_CHANNEL_EXPR = f"'{CHANNEL}_' || left(md5(coalesce(current_schema(), '')), 12)"
_log = logging.getLogger("keyshred.evict")
_MAX_BACKOFF = 5.0  # seconds between reconnection attempts, at most

# One statement: the database's clock read once, into the payload and the result.
_NOTIFY = sa.text(
    "WITH t AS (SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint AS us) "
    "SELECT pg_notify('keyshred_evict_' || left(md5(coalesce(current_schema(), '')), 12), "
    "json_build_object('event_id', CAST(:event_id AS text), "
    "'subject_ref', CAST(:subject_ref AS text), 'scope', CAST(:scope AS text), "
    "'epoch', CAST(:epoch AS bigint), 'published_us', t.us)::text), t.us FROM t"
)
assert _CHANNEL_EXPR in str(_NOTIFY)  # noqa: S101 - one channel, spelled twice


@dataclass(frozen=True, slots=True)
class EvictionEvent:
    """One subject's suppression, as every process receives it (ids only)."""

    event_id: str
    subject_ref: str
    scope: str | None
    epoch: int
    published_us: int  # the publishing database's clock, microseconds since 1970

    def to_json(self) -> str:
        return json.dumps(
            {
                "event_id": self.event_id,
                "subject_ref": self.subject_ref,
                "scope": self.scope,
                "epoch": self.epoch,
                "published_us": self.published_us,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> EvictionEvent:
        """``ValueError`` for anything but an event (another sender on the channel)."""
        try:
            doc = json.loads(text)
            scope = doc["scope"]
            event = cls(
                str(doc["event_id"]),
                str(doc["subject_ref"]),
                None if scope is None else str(scope),
                int(doc["epoch"]),
                int(doc["published_us"]),
            )
        except (TypeError, KeyError, ValueError, OverflowError, RecursionError) as exc:
            raise ValueError("not an eviction event") from exc
        if not event.event_id or not event.subject_ref:
            raise ValueError("not an eviction event")
        return event


def publish(conn: Connection, subject_ref: str, scope: str | None, epoch: int) -> EvictionEvent:
    """The eviction event of a suppression, inside its transaction ``conn``: on
    PostgreSQL notified at its commit; on SQLite pass the result to ``deliver``
    once the transaction has committed."""
    event_id = uuid.uuid4().hex
    if conn.dialect.name == "postgresql":
        row = conn.execute(
            _NOTIFY,
            {
                "event_id": event_id,
                "subject_ref": subject_ref,
                "scope": scope,
                "epoch": epoch,
            },
        ).one()
        published = int(row[1])
    else:
        published = time.time_ns() // 1000
    return EvictionEvent(event_id, subject_ref, scope, epoch, published)


def channel(conn: Any) -> str:
    """The eviction channel of a PostgreSQL connection's schema (a SQLAlchemy
    ``Connection`` or a psycopg connection)."""
    sql = f"SELECT {_CHANNEL_EXPR}"
    if isinstance(conn, Connection):
        return str(conn.exec_driver_sql(sql).scalar_one())
    row = conn.execute(sql).fetchone()
    return str(row[0])


def deliver(engine: Engine, event: EvictionEvent) -> None:
    """After the suppressing transaction committed: on SQLite hand the event to every
    subscriber of this process on the same database (PostgreSQL delivered it)."""
    if engine.dialect.name != "sqlite":
        return
    for callback in _bus(engine).subscribers():
        try:
            callback(event)
        except Exception as exc:  # noqa: BLE001 - one handle's failure never fails the erasure
            _log.warning("eviction of event %s failed: %s", event.event_id, type(exc).__name__)


class Subscription:
    """A callback on the in-process bus of one SQLite database (``close`` removes it)."""

    def __init__(self, bus: _Bus, callback: Callable[[EvictionEvent], None]) -> None:
        self._bus = bus
        self._callback = callback

    def close(self) -> None:
        self._bus.remove(self._callback)


def subscribe(engine: Engine, callback: Callable[[EvictionEvent], None]) -> Subscription:
    """Call ``callback`` with every event this process delivers on ``engine``'s
    SQLite database (``deliver``)."""
    bus = _bus(engine)
    bus.add(callback)
    return Subscription(bus, callback)


class _Bus:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[EvictionEvent], None]] = []

    def add(self, callback: Callable[[EvictionEvent], None]) -> None:
        with self._lock:
            self._callbacks.append(callback)

    def remove(self, callback: Callable[[EvictionEvent], None]) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._callbacks.remove(callback)

    def subscribers(self) -> list[Callable[[EvictionEvent], None]]:
        with self._lock:
            return list(self._callbacks)


_BUSES: dict[str, _Bus] = {}
_BUSES_LOCK = threading.Lock()


def _bus(engine: Engine) -> _Bus:
    """The bus of ``engine``'s database file (its real path: two URLs of one file
    share it); an in-memory database is its engine's alone."""
    database = db.sqlite_file(engine.url)
    name = os.path.realpath(database) if database is not None else f":memory:{id(engine)}"
    with _BUSES_LOCK:
        bus = _BUSES.get(name)
        if bus is None:
            bus = _BUSES[name] = _Bus()
        return bus


class Listener:
    """A handle's daemon thread: on PostgreSQL it ``LISTEN``s on its own connection
    and calls ``on_event`` for every event (``on_reset`` after a reconnection, when
    events may have been missed); on both databases it calls ``tick`` every
    ``tick_seconds`` (the janitor). ``close`` stops and joins it and closes its
    connection."""

    def __init__(
        self,
        engine: Engine,
        *,
        on_event: Callable[[EvictionEvent], None],
        on_reset: Callable[[], None],
        tick: Callable[[], None],
        tick_seconds: float,
        connect_timeout: float = 5.0,
    ) -> None:
        self._engine = engine
        self._on_event = on_event
        self._on_reset = on_reset
        self._tick = tick
        self._tick_seconds = tick_seconds
        self._connect_timeout = connect_timeout
        self._postgres = engine.dialect.name == "postgresql"
        self._stop = threading.Event()
        self._listening = threading.Event()
        # Set once ``start`` returned: the handle caches from then on, so a first
        # LISTEN made after it must reset too (what was published before is lost).
        self._serving = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._conn: Any = None
        self._thread: threading.Thread | None = None
        self.connections = 0  # how many times LISTEN was established (tests, drills)
        self.resets = 0
        self.events = 0

    def start(self) -> None:
        """Start the thread; on PostgreSQL wait (up to the connect timeout) until it
        listens, so nothing this handle caches after this returns misses an event.
        If it cannot connect yet it keeps trying and resets once it can."""
        self._thread = threading.Thread(target=self._run, name="keyshred-evict", daemon=True)
        self._thread.start()
        if self._postgres:
            self._listening.wait(self._connect_timeout)
        self._serving.set()

    @property
    def listening(self) -> bool:
        return self._listening.is_set()

    def backend_pid(self) -> int | None:
        """The PostgreSQL backend of the listening connection (tests cut it)."""
        conn = self._conn
        return None if conn is None else int(conn.info.backend_pid)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._disconnect()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.05
        next_tick = time.monotonic() + self._tick_seconds
        while not self._stop.is_set():
            if self._postgres and self._conn is None:
                if not self._connect():
                    self._wait([], backoff)
                    backoff = min(backoff * 2, _MAX_BACKOFF)
                    next_tick = self._maybe_tick(next_tick)
                    continue
                backoff = 0.05
            fds = [self._conn.fileno()] if self._conn is not None else []
            ready = self._wait(fds, max(0.0, next_tick - time.monotonic()))
            if ready and self._conn is not None:
                self._drain()
            next_tick = self._maybe_tick(next_tick)

    def _wait(self, fds: list[int], timeout: float) -> bool:
        """Wait for the connection (True: readable) or the timeout or ``close``.

        ``poll``, not ``select``: a process with more than 1024 descriptors open
        (a server's sockets, many stores) gets descriptors ``select`` cannot
        watch, and a listener that fails its wait at once spins reconnecting
        (and resetting every cache) instead of listening."""
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        for fd in fds:
            poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
        try:
            ready = poller.poll(max(0.0, timeout) * 1000.0)
        except (OSError, ValueError):
            self._disconnect()  # the connection's socket went away
            return False
        return any(fd in fds and events for fd, events in ready)

    def _maybe_tick(self, next_tick: float) -> float:
        now = time.monotonic()
        if now < next_tick or self._stop.is_set():
            return next_tick
        try:
            self._tick()
        except Exception as exc:  # noqa: BLE001 - the janitor runs again next tick
            _log.warning("cache janitor failed: %s", type(exc).__name__)
        return now + self._tick_seconds

    def _connect(self) -> bool:
        import psycopg

        url = self._engine.url.set(drivername="postgresql")
        try:
            conn = psycopg.connect(
                url.render_as_string(hide_password=False),
                autocommit=True,
                connect_timeout=max(1, int(self._connect_timeout)),
                # A connection cut without a word (a dead host) is noticed too.
                keepalives=1,
                keepalives_idle=5,
                keepalives_interval=2,
                keepalives_count=3,
            )
            conn.execute(f'LISTEN "{channel(conn)}"')
        except Exception as exc:  # noqa: BLE001 - the loop retries with backoff
            _log.warning("eviction listener cannot listen yet: %s", type(exc).__name__)
            return False
        self._conn = conn
        self.connections += 1
        if self._listening.is_set() or self._serving.is_set():
            # Listening again after a gap, or for the first time after the handle
            # began serving: whatever was published meanwhile is lost.
            self._reset()
        self._listening.set()
        return True

    def _reset(self) -> None:
        self.resets += 1
        try:
            self._on_reset()
        except Exception as exc:  # noqa: BLE001 - the thread must live on
            _log.warning("eviction reset failed: %s", type(exc).__name__)

    def _drain(self) -> None:
        """Read what the server sent; hand over each event; a broken connection is
        dropped (the loop reconnects, then resets)."""
        conn = self._conn
        try:
            pgconn = conn.pgconn
            pgconn.consume_input()
            notices = []
            while (n := pgconn.notifies()) is not None:
                notices.append(n)
            broken = None if pgconn.status == 0 else "closed"  # 0: pq.ConnStatus.OK
        except Exception as exc:  # noqa: BLE001 - any failure here is a lost connection
            notices, broken = [], type(exc).__name__
        for n in notices:
            self._handle(n.extra.decode("utf-8", "replace"))
        if broken is not None:
            _log.warning("eviction listener lost its connection (%s); reconnecting", broken)
            self._disconnect()

    def _handle(self, payload: str) -> None:
        try:
            event = EvictionEvent.from_json(payload)
        except ValueError:
            _log.warning("ignored a message on the eviction channel that is no eviction event")
            return
        self.events += 1
        try:
            self._on_event(event)
        except Exception as exc:  # noqa: BLE001 - the thread must live on
            _log.warning("eviction of event %s failed: %s", event.event_id, type(exc).__name__)

    def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()
