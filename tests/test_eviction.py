"""Eviction everywhere (issue 22 item 2): a subject erased in one process leaves no
unwrapped key, decrypted row or decrypted vector in any other; a listener whose
connection is cut reconnects and evicts everything; cache TTLs are enforced by time;
the receipt counts the processes that evicted.

Key and cache TTLs are an hour in the eviction tests, so only the event can be what
evicted; the TTL test sets them short and never touches the entries it waits on."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keyshred import Config, Keyshred
from keyshred.erasure.eviction import PROCESS_ID
from tests import zygote
from tests.conftest import PG_DSN
from tests.storage.test_vectors import bag_of_words

WORKER = Path(__file__).with_name("eviction_worker.py")
NS = ("notes",)
PROBE = "kayak-probe-7f3a"
HOUR = 3600.0


def _config(url: str, tmp: Path, *, ttl: float = HOUR, sweep: float = 0.2) -> Config:
    shared = url.startswith("postgresql")
    doc: dict[str, Any] = {
        "storage": {
            "uri": str(tmp / "parts"),
            "cache_ttl_seconds": ttl,
            "cache_sweep_seconds": sweep,
        },
        "keyring": {"cache_ttl_seconds": ttl},
        "vectors": {"uri": str(tmp / "vectors")},
        "kek": {
            "local_path": str(tmp / "kek.json"),
            "archive_local_path": str(tmp / "archive-kek.json"),
        },
    }
    if shared:
        doc["profile"] = "distributed"
        doc["storage"]["catalog_url"] = url
        doc["keyring"]["store_url"] = url.replace("postgresql+psycopg://", "postgresql://")
    return Config.model_validate(doc)


def _open(folder: Path, config: Config) -> Keyshred:
    if (folder / "keyshred.toml").exists():
        return Keyshred.open(folder, config, embeddings=bag_of_words)
    return Keyshred.init(folder, config, embeddings=bag_of_words)


def _write(ks: Keyshred) -> None:
    """Alice's memories, and one of Bob's that mentions her (a key she co-owns)."""
    for i in range(3):
        ks.memories.put("alice", NS, f"k{i}", {"text": f"{PROBE} alice {i} kayaks"}, index=True)
    ks.memories.put("bob", NS, "k0", {"text": "bob kayaks"}, index=True)
    ks.memories.put(
        "bob", NS, "k1", {"text": f"{PROBE} with alice"}, mentions=["alice"], index=True
    )


def _fill(ks: Keyshred) -> None:
    for subject in ("alice", "bob"):
        assert ks.memories.get(subject, NS, "k0") is not None
        assert ks.memories.search(subject, query="kayaks", limit=3)


def _nothing(held: dict[str, int]) -> bool:
    return not any(held.values())


class Worker:
    """``tests/eviction_worker.py`` in its own process; ``ready`` waits until it holds
    the subjects (start several first, then wait: they load side by side)."""

    def __init__(self, folder: Path, config: Config, *subjects: str) -> None:
        self.proc = zygote.Popen(
            [sys.executable, str(WORKER), str(folder), config.model_dump_json(), *subjects],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.process_id = ""

    def ready(self) -> Worker:
        self.process_id = json.loads(self._line("READY "))["process"]
        return self

    def _line(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :]
        raise AssertionError(f"worker exited ({self.proc.wait()}) before {prefix.strip()}")

    def held(self, *subjects: str) -> dict[str, dict[str, int]]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"held {' '.join(subjects)}\n")
        self.proc.stdin.flush()
        return dict(json.loads(self._line("HELD ")))

    def quit(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self._line("BYE")
        assert self.proc.wait(timeout=60) == 0


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for w in started:
        if w.proc.poll() is None:
            w.proc.kill()
        w.proc.wait()


@pytest.mark.parametrize("catalog_url", ["postgres"], indirect=True)
def test_erased_in_one_process_evicted_in_four_others(
    catalog_url: str, tmp_path: Path, workers: list[Worker]
) -> None:
    config = _config(catalog_url, tmp_path)
    eraser = _open(tmp_path / "w0", config)
    try:
        _write(eraser)
        workers.extend(Worker(tmp_path / f"w{n}", config, "alice", "bob") for n in range(1, 5))
        for w in workers:
            w.ready()
            held = w.held("alice", "bob")
            # Each holds Alice's key, rows and vectors, and Bob's key she co-owns.
            assert held["alice"]["keys"] >= 1 and held["alice"]["memories"] >= 1
            assert held["alice"]["vectors"] >= 1 and held["bob"]["memories"] >= 1
        req = eraser.erase("alice", requested_by="dpo", reason="gdpr-art17")
        assert req.state == "completed"
        for w in workers:
            held = w.held("alice", "bob")
            assert _nothing(held["alice"]), held
            # Bob's partition held a row mentioning Alice, decrypted under a key
            # she co-owned: it went too (Bob's own data reloads on demand).
            assert held["bob"]["memories"] == 0 and held["bob"]["vectors"] == 0, held
        receipt = eraser.erasure.receipt(req.request_id)
        assert receipt is not None and receipt.metrics is not None
        # The four workers and the erasing process itself (its own listener).
        assert receipt.metrics.eviction_processes == 5
        latency = receipt.metrics.eviction_max_latency_ms
        assert latency is not None and latency >= 0
        assert _nothing(eraser._eviction.held(eraser.subject_ref("alice")))
        assert PROBE not in receipt.to_json()
        for w in workers:
            w.quit()
    finally:
        eraser.close()


def _kill_backend(pid: int) -> None:
    import psycopg

    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        (ok,) = conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()  # type: ignore[misc]
        assert ok


def _until(check: Any, what: str, seconds: float = 30.0) -> None:
    """Poll ``check`` until it is true; the deadline is generous (a shared machine):
    it says whether it happened at all, not how fast."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds:.0f} s: {what}")
        time.sleep(0.05)


@pytest.mark.parametrize("catalog_url", ["postgres"], indirect=True)
def test_listener_cut_reconnects_and_evicts_everything(
    catalog_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="keyshred.evict")
    config = _config(catalog_url, tmp_path)
    ks = _open(tmp_path / "a", config)
    other = _open(tmp_path / "b", config)
    try:
        _write(ks)
        _fill(ks)
        alice, bob = ks.subject_ref("alice"), ks.subject_ref("bob")
        listener = ks._eviction.listener
        assert listener.connections == 1 and listener.resets == 0
        assert not _nothing(ks._eviction.held(bob))
        first = listener.backend_pid()
        assert first is not None
        _kill_backend(first)
        # No event was published: only the reset after the reconnection evicts.
        _until(lambda: listener.resets == 1, "the listener reconnected and reset")
        assert listener.connections == 2 and listener.backend_pid() not in (None, first)
        assert _nothing(ks._eviction.held(alice)) and _nothing(ks._eviction.held(bob))
        # And it listens again: an erasure in another handle reaches it.
        _fill(ks)
        assert not _nothing(ks._eviction.held(alice))
        events = listener.events
        other.erase("alice", requested_by="dpo", reason="gdpr-art17")
        _until(lambda: listener.events > events, "the event after the reconnection")
        assert _nothing(ks._eviction.held(alice))
    finally:
        other.close()
        ks.close()
    assert listener.backend_pid() is None  # closed with the handle
    # The lost connection was logged, with no subject in it.
    assert "lost its connection" in caplog.text
    for secret in ("alice", "bob", alice, bob, PROBE):
        assert secret not in caplog.text


def test_ttl_enforced_by_time_without_access(tmp_path: Path) -> None:
    ks = _open(tmp_path / "data", _config("sqlite", tmp_path, ttl=2.0, sweep=0.1))
    try:
        _write(ks)
        _fill(ks)
        ref = ks.subject_ref("alice")
        held = ks._eviction.held(ref)
        assert held["keys"] >= 1 and held["memories"] >= 1 and held["vectors"] >= 1
        # Nothing touches the caches from here on: only the janitor can empty them.
        _until(lambda: _nothing(ks._eviction.held(ref)), "expired entries dropped")
        assert len(ks._keyring.cache) == 0
    finally:
        ks.close()


def test_sqlite_bus_evicts_every_handle_of_the_process(tmp_path: Path) -> None:
    config = _config("sqlite", tmp_path)
    a = _open(tmp_path / "data", config)
    b = Keyshred.open(tmp_path / "data", config, embeddings=bag_of_words)
    try:
        _write(a)
        _fill(b)
        ref = b.subject_ref("alice")
        assert not _nothing(b._eviction.held(ref))
        req = a.erase("alice", requested_by="dpo", reason="gdpr-art17")
        # Delivered in the suppressing thread after the commit: done on return.
        assert _nothing(b._eviction.held(ref))
        assert b._eviction.held(b.subject_ref("bob"))["memories"] == 0
        receipt = a.erasure.receipt(req.request_id)
        assert receipt is not None and receipt.metrics is not None
        assert receipt.metrics.eviction_processes == 1  # one process, two handles
        assert PROCESS_ID.get()
    finally:
        b.close()
        a.close()


def test_close_stops_the_thread(tmp_path: Path) -> None:
    ks = _open(tmp_path / "data", _config("sqlite", tmp_path))
    thread = ks._eviction.listener._thread
    assert thread is not None and thread.is_alive()
    ks.close()
    assert not thread.is_alive()
