"""Eviction events (keyshred.storage.events) and the key cache's eviction by owner:
an event is delivered at the suppression's commit and never before or for a
rolled-back one (PostgreSQL ``NOTIFY``), the SQLite bus reaches the handles of its
own database file only, and a key the subject co-owns leaves the cache with its own."""

from __future__ import annotations

import os
import select
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from keyshred.keyring import _primitives as prim
from keyshred.keyring.cache import KeyCache
from keyshred.keyring.datakey import DataKey
from keyshred.keyring.kek.local import LocalKek
from keyshred.keyring.keyring import Keyring
from keyshred.keyring.keystore import SQLiteKeyStore
from keyshred.storage.catalog import Catalog
from keyshred.storage.events import (
    EvictionEvent,
    Listener,
    channel,
    deliver,
    publish,
    subscribe,
)
from tests.conftest import PG_DSN


def _notifies(conn: object, wait: float) -> list[str]:
    """The payloads a LISTENing psycopg connection received within ``wait`` s."""
    out: list[str] = []
    deadline = time.monotonic() + wait
    pgconn = conn.pgconn  # type: ignore[attr-defined]
    while time.monotonic() < deadline:
        select.select([conn.fileno()], [], [], max(0.0, deadline - time.monotonic()))  # type: ignore[attr-defined]
        pgconn.consume_input()
        while (n := pgconn.notifies()) is not None:
            out.append(n.extra.decode())
        if out:
            return out
    return out


def test_event_json_round_trip_and_garbage_refused() -> None:
    event = EvictionEvent("e1", "REF", None, 3, 1_700_000_000_000_000)
    assert EvictionEvent.from_json(event.to_json()) == event
    for bad in (
        "",
        "{}",
        '{"event_id": "x"}',
        "[1]",
        '{"event_id":"","subject_ref":"r","scope":null,"epoch":1,"published_us":1}',
    ):
        with pytest.raises(ValueError):
            EvictionEvent.from_json(bad)


@pytest.mark.parametrize("catalog_url", ["postgres"], indirect=True)
def test_postgres_event_arrives_at_commit_never_before_nor_on_rollback(catalog_url: str) -> None:
    psycopg = pytest.importorskip("psycopg")
    catalog = Catalog(catalog_url)
    listener = psycopg.connect(PG_DSN, autocommit=True)
    try:
        with catalog.transaction() as conn:
            name = channel(conn)
        listener.execute(f'LISTEN "{name}"')
        # Rolled back: never delivered.
        with pytest.raises(RuntimeError), catalog.transaction() as conn:
            publish(conn, "REFROLLBACK", None, 1)
            raise RuntimeError("abort")
        assert _notifies(listener, 0.5) == []
        # Published inside an open transaction: nothing until it commits.
        with catalog.transaction() as conn:
            event = publish(conn, "REFCOMMIT", "support", 7)
            assert _notifies(listener, 0.3) == []
        (payload,) = _notifies(listener, 10.0)
        got = EvictionEvent.from_json(payload)
        assert got == event
        assert (got.subject_ref, got.scope, got.epoch) == ("REFCOMMIT", "support", 7)
    finally:
        listener.close()
        catalog.close()


@pytest.mark.parametrize("catalog_url", ["postgres"], indirect=True)
def test_suppress_notifies_every_listener(catalog_url: str) -> None:
    """The guard's own suppression publishes (no caller has to)."""
    catalog = Catalog(catalog_url)
    got: list[EvictionEvent] = []
    listener = Listener(
        catalog.engine,
        on_event=got.append,
        on_reset=lambda: None,
        tick=lambda: None,
        tick_seconds=0.2,
    )
    listener.start()
    try:
        assert listener.listening
        epoch = catalog.suppress("REFSUPPRESSED")
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [(e.subject_ref, e.epoch, e.scope) for e in got] == [("REFSUPPRESSED", epoch, None)]
    finally:
        listener.close()
        catalog.close()
    assert listener.events == 1


@pytest.mark.parametrize("catalog_url", ["postgres"], indirect=True)
def test_a_listener_whose_socket_is_past_descriptor_1024_listens(catalog_url: str) -> None:
    """The CI suite's order-dependent failures: once the test process held more
    than 1024 descriptors, ``select`` refused the listener's socket, and every
    listener spun reconnecting and resetting every cache. ``poll`` has no limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 1400
    if soft < wanted:
        if hard != resource.RLIM_INFINITY and hard < wanted:
            pytest.skip(f"the descriptor limit ({hard}) is too low for this test")
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    catalog = Catalog(catalog_url)
    got: list[EvictionEvent] = []
    listener = Listener(
        catalog.engine,
        on_event=got.append,
        on_reset=lambda: None,
        tick=lambda: None,
        tick_seconds=0.2,
    )
    try:
        listener.start()
        assert listener.listening
        assert listener._conn is not None and listener._conn.fileno() > 1024
        catalog.suppress("REFHIGHFD")
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [e.subject_ref for e in got] == ["REFHIGHFD"]
        time.sleep(0.5)  # a spinning listener would have reconnected by now
        assert (listener.connections, listener.resets) == (1, 0)
    finally:
        listener.close()
        catalog.close()
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_sqlite_bus_reaches_its_own_database_only(tmp_path: Path) -> None:
    a = Catalog(f"sqlite:///{tmp_path / 'a.db'}")
    a2 = Catalog(f"sqlite:///{tmp_path / 'x' / '..' / 'a.db'}")  # the same file
    b = Catalog(f"sqlite:///{tmp_path / 'b.db'}")
    seen: dict[str, list[str]] = {"a": [], "a2": [], "b": []}
    subs = [
        subscribe(a.engine, lambda e: seen["a"].append(e.subject_ref)),
        subscribe(a2.engine, lambda e: seen["a2"].append(e.subject_ref)),
        subscribe(b.engine, lambda e: seen["b"].append(e.subject_ref)),
    ]
    try:
        a.suppress("REFA")  # delivered when suppress returns: no waiting
        assert seen == {"a": ["REFA"], "a2": ["REFA"], "b": []}
        subs[1].close()
        with b.transaction() as conn:
            event = publish(conn, "REFB", None, 1)
        assert seen["b"] == []  # SQLite: nothing before ``deliver`` (after the commit)
        deliver(b.engine, event)
        assert seen == {"a": ["REFA"], "a2": ["REFA"], "b": ["REFB"]}
    finally:
        for s in subs:
            s.close()
        for c in (a, a2, b):
            c.close()


def _key(holder: str, tag: str = "") -> DataKey:
    return DataKey(prim.random_bytes(16), holder, "default", prim.random_key(), tag)


def test_key_cache_evicts_by_owner_and_hands_back_unknown_owners() -> None:
    cache = KeyCache(ttl_seconds=3600)
    own, mention, derived, other, unknown = (
        _key("A"),
        _key("B", "t1"),  # B's memory mentioning A
        _key("C", "t2"),  # C's asset derived from A's support scope
        _key("B", "t3"),  # B's memory mentioning D only
        _key("E", "t4"),  # read by id: owners unknown
    )
    cache.put(own, ())
    cache.put(mention, ["A"])
    cache.put(derived, ["A@support"])
    cache.put(other, ["D"])
    cache.put(unknown)
    assert cache.held("A") == 3
    holders, unknowns = cache.evict_owner("A")
    assert holders == {"B", "C"}
    assert unknowns == [unknown.key_id]
    assert own.key_id not in cache and mention.key_id not in cache
    assert derived.key_id not in cache
    assert other.key_id in cache and unknown.key_id in cache
    assert cache.held("A") == 0


def test_key_cache_purges_expired_without_access() -> None:
    now = [0.0]
    cache = KeyCache(ttl_seconds=10, clock=lambda: now[0])
    key = _key("A")
    cache.put(key, ())
    now[0] = 11.0
    assert len(cache) == 1  # nothing asked for it: still there until a purge
    assert cache.purge_expired() == 1
    assert len(cache) == 0


def test_keyring_evict_subject_looks_up_unknown_owners(tmp_path: Path) -> None:
    keyring = Keyring(
        SQLiteKeyStore(tmp_path / "keys.db"), LocalKek(tmp_path / "kek.json", create=True)
    )
    try:
        shared = keyring.data_key("B", "default", owners=["A"])
        unrelated = keyring.data_key("B", "default", owners=["D"])
        keyring.cache.clear()
        # Read by id, as a partition load does: owners unknown to the cache.
        keyring.data_keys_by_id([shared.key_id, unrelated.key_id])
        assert keyring.held("A") == 0  # unknown until looked up
        assert keyring.evict_subject("A") == {"B"}
        assert shared.key_id not in keyring.cache
        assert unrelated.key_id in keyring.cache  # D's, looked up and kept
        assert keyring.evict_subject("D") == {"B"}  # now known: no lookup needed
        assert len(keyring.cache) == 0
    finally:
        keyring.close()


def test_catalog_suppress_publishes_in_its_transaction(tmp_path: Path) -> None:
    """A suppression whose transaction fails publishes nothing on SQLite either."""
    catalog = Catalog(f"sqlite:///{tmp_path / 'c.db'}")
    seen: list[str] = []
    sub = subscribe(catalog.engine, lambda e: seen.append(e.subject_ref))
    try:
        with catalog.transaction() as conn:
            conn.execute(sa.text("DROP TABLE ks_subject_guard"))
        with pytest.raises(Exception):  # noqa: B017 - any database error
            catalog.suppress("REFGONE")
        assert seen == []
    finally:
        sub.close()
        catalog.close()
