"""Attack: the eviction listener's thread dies on one malformed NOTIFY.

``EvictionEvent.from_json`` turns a payload into an event and converts only
``TypeError``/``KeyError``/``JSONDecodeError`` into ``ValueError``; the listener's
``_handle`` catches ``ValueError`` only. A payload whose ``epoch`` is JSON
``Infinity`` makes ``int(inf)`` raise ``OverflowError`` (a deeply nested payload a
``RecursionError``), which escapes ``_drain`` and ``_run``: the daemon thread ends.
Any role of the database may ``NOTIFY`` on the eviction channel (the channel is shared by
every schema of the database), so from then on this process never evicts an erased
subject again: its unwrapped keys and decrypted rows stay in memory (issue 22's
defect), and the janitor that enforces TTLs stops too."""

from __future__ import annotations

import time
from pathlib import Path

import psycopg
import pytest

from keyshred.storage.events import channel
from tests.conftest import PG_DSN
from tests.test_eviction import _config, _fill, _nothing, _open, _write

POISONS = [
    '{"event_id":"x","subject_ref":"y","scope":null,"epoch":Infinity,"published_us":1}',
    "[" * 3000 + "]" * 3000,
]


@pytest.mark.parametrize("poison", POISONS, ids=["infinity", "nested"])
@pytest.mark.parametrize("catalog_url", ["postgres"], indirect=True)
def test_a_malformed_notify_does_not_stop_eviction(
    catalog_url: str, tmp_path: Path, poison: str
) -> None:
    config = _config(catalog_url, tmp_path)
    ks = _open(tmp_path / "a", config)
    other = _open(tmp_path / "b", config)
    try:
        _write(ks)
        _fill(ks)
        alice = ks.subject_ref("alice")
        assert not _nothing(ks._eviction.held(alice))
        with ks._catalog.transaction() as c:
            name = channel(c)  # the channel of this store's schema
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute("SELECT pg_notify(%s, %s)", (name, poison))
        time.sleep(0.5)
        other.erase("alice", requested_by="dpo", reason="gdpr-art17")
        deadline = time.monotonic() + 5
        while not _nothing(ks._eviction.held(alice)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ks._eviction.listener._thread.is_alive(), "the listener thread died"
        assert _nothing(ks._eviction.held(alice)), ks._eviction.held(alice)
    finally:
        other.close()
        ks.close()
