"""Attack: a listener that could not LISTEN when its handle opened never resets.

``Listener.start`` waits up to the connect timeout, then returns and the handle
serves (its pool works; only the LISTEN connection failed: a transient refusal,
``max_connections``, a pooler). The thread keeps trying, but ``_connect`` resets
the caches only when ``_listening`` was already set, i.e. after a *re*-connection.
Events published before the first LISTEN are lost and nothing evicts what the
handle cached meanwhile: an erased subject's keys and rows stay in memory."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from keyshred.storage import events
from tests.test_eviction import _config, _fill, _nothing, _open, _write


@pytest.mark.parametrize("catalog_url", ["postgres"], indirect=True)
def test_events_missed_before_the_first_listen_are_made_up_for(
    catalog_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(catalog_url, tmp_path)
    eraser = _open(tmp_path / "a", config)
    _write(eraser)
    up = threading.Event()
    real = events.Listener._connect

    def connect(self: events.Listener) -> bool:
        return real(self) if up.is_set() else False

    monkeypatch.setattr(events.Listener, "_connect", connect)
    reader = _open(tmp_path / "b", config)  # waits out the connect timeout
    try:
        assert not reader._eviction.listener.listening
        _fill(reader)
        alice = reader.subject_ref("alice")
        assert not _nothing(reader._eviction.held(alice))
        assert eraser.erase("alice", requested_by="dpo", reason="gdpr").state == "completed"
        up.set()  # the LISTEN connection comes up after the event was sent
        deadline = time.monotonic() + 10
        while not reader._eviction.listener.listening and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reader._eviction.listener.listening
        time.sleep(0.5)
        assert _nothing(reader._eviction.held(alice)), reader._eviction.held(alice)
    finally:
        reader.close()
        eraser.close()
