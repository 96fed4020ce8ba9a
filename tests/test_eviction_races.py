"""Eviction against reads in flight, and what an eviction must reach besides the
subject's own caches (issue 22 item 2, found by attacking the first version):

- a read that passed its guard before the suppression and loads a key or vectors
  while the eviction runs must not put them back in the cache afterwards;
- the keys' destruction announces the eviction again, so what such a read cached
  between the suppression and the destruction goes too;
- a row of another holder derived from the erased subject's data leaves that
  holder's decrypted partition even when its key already left the key cache;
- the raw subject id the keyring keeps beside its subject_ref leaves with the
  subject's eviction and after the cache TTL.

The mid-load eviction is injected where the race happens (inside the load, after
the record or table was read) rather than hoped for with threads."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from keyshred import Keyshred
from keyshred.errors import SubjectSuppressed
from keyshred.keyring.cache import KeyCache
from keyshred.keyring.datakey import DataKey
from tests.storage.test_vectors import bag_of_words
from tests.test_eviction import NS, PROBE, _config, _nothing, _open, _write


def test_a_key_put_after_an_eviction_that_began_later_is_not_cached() -> None:
    cache = KeyCache(16, 3600)
    key = DataKey(b"k" * 16, "ref", "default", b"\x01" * 32, "")
    since = cache.evictions
    cache.evict_owner("ref")  # the event arrives while the record is being unwrapped
    cache.put(key, since=since)
    assert len(cache) == 0
    cache.put(key, since=cache.evictions)
    assert len(cache) == 1


def _evict_during(obj: Any, name: str, evict: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make ``obj.name`` run ``evict`` once, after doing its work (the record or
    table has been read; the result is not cached yet)."""
    calls: list[int] = []
    original = getattr(obj, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        if not calls:
            calls.append(1)
            evict()
        return out

    monkeypatch.setattr(obj, name, wrapped)
    return calls


def test_a_read_in_flight_does_not_recache_keys_or_vectors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config("sqlite", tmp_path)
    writer = _open(tmp_path / "data", config)
    reader = Keyshred.open(tmp_path / "data", config, embeddings=bag_of_words)
    try:
        _write(writer)
        for subject, read in (
            ("alice", lambda: reader.memories.get("alice", NS, "k0")),
            ("bob", lambda: reader.memories.search("bob", query="kayaks", limit=3)),
        ):
            ref = reader.subject_ref(subject)
            ev = reader._eviction
            with monkeypatch.context() as m:
                # The suppression commits (and its event arrives) while the read,
                # past its guard check, reads the key records and the vectors.
                suppress = lambda ref=ref: writer._catalog.suppress(ref)  # noqa: E731
                store = reader._keyring.store
                calls = [_evict_during(store, n, suppress, m) for n in ("get", "get_many", "find")]
                vectors = reader._memories._vectors
                assert vectors is not None
                calls.append(_evict_during(vectors, "_open_spaces", suppress, m))
                with pytest.raises(SubjectSuppressed):
                    read()  # read again after the eviction closed its partition: refused
                assert any(calls), subject
            held = ev.held(ref)
            assert _nothing(held), (subject, held)
        # Without an eviction in between, reads cache as before.
        carol = reader.subject_ref("carol")
        writer.memories.put("carol", NS, "k", {"text": "carol kayaks"}, index=True)
        assert reader.memories.get("carol", NS, "k") is not None
        assert reader.memories.search("carol", query="kayaks", limit=3)
        held = reader._eviction.held(carol)
        assert held["keys"] >= 1 and held["vectors"] >= 1, held
    finally:
        reader.close()
        writer.close()


def test_the_destruction_evicts_what_was_cached_after_the_suppression(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config("sqlite", tmp_path)
    eraser = _open(tmp_path / "data", config)
    reader = Keyshred.open(tmp_path / "data", config, embeddings=bag_of_words)
    try:
        _write(eraser)
        ref = reader.subject_ref("alice")
        from keyshred.erasure import extent

        original = extent.Extent.destroy_keys
        seen: list[dict[str, int]] = []

        def late_read(self: extent.Extent) -> dict[str, Any]:
            # Between suppression and destruction a reader that passed its guard
            # before the suppression loads the subject into its caches.
            if self.ref == ref:
                with monkeypatch.context() as m:
                    m.setattr(reader._catalog, "enforce", lambda *a, **k: 0)
                    assert reader.memories.get("alice", NS, "k0") is not None
                    assert reader.memories.search("alice", query="kayaks", limit=3)
                seen.append(reader._eviction.held(ref))
            return original(self)

        monkeypatch.setattr(extent.Extent, "destroy_keys", late_read)
        req = eraser.erase("alice", requested_by="dpo", reason="gdpr-art17")
        assert req.state == "completed"
        assert seen and not _nothing(seen[0]), seen  # the read did cache
        assert _nothing(reader._eviction.held(ref))
    finally:
        reader.close()
        eraser.close()


def test_a_derived_row_leaves_its_holders_cache_after_its_key_did(tmp_path: Path) -> None:
    config = _config("sqlite", tmp_path)
    writer = _open(tmp_path / "data", config)
    reader = Keyshred.open(tmp_path / "data", config, embeddings=bag_of_words)
    try:
        note = writer.memories.put("alice", NS, "n", {"text": f"{PROBE} alice's note"})
        writer.memories.put(
            "bob", NS, "summary", {"text": f"{PROBE} summary"}, sources=[note.memory_id]
        )
        assert reader.memories.get("bob", NS, "summary") is not None
        bob = reader.subject_ref("bob")
        assert reader._eviction.held(bob)["memories"] >= 1
        # The key that opened Bob's summary (co-owned by Alice) expired from the key
        # cache; the decrypted row stays in Bob's partition.
        reader._keyring.cache.clear()
        writer.erase("alice", requested_by="dpo", reason="gdpr-art17")
        assert reader._eviction.held(bob)["memories"] == 0
        # Bob's summary was rebuilt without Alice's data or dropped: either way the
        # old plaintext is not served.
        got = reader.memories.get("bob", NS, "summary")
        assert got is None or PROBE not in str(got.value)
    finally:
        reader.close()
        writer.close()


def test_raw_subject_ids_leave_with_the_eviction_and_the_ttl(tmp_path: Path) -> None:
    ks = _open(tmp_path / "data", _config("sqlite", tmp_path, ttl=1.0, sweep=0.1))
    try:
        ks.memories.put("alice-raw-id", NS, "k", {"text": "x"})
        ks.memories.put("bob-raw-id", NS, "k", {"text": "y"})
        names = lambda: {sid for _, sid in ks._keyring._refs}  # noqa: E731
        assert {"alice-raw-id", "bob-raw-id"} <= names()
        ref = ks._keyring.subject_ref("alice-raw-id")
        ks._eviction.evict(ref)
        assert "alice-raw-id" not in names()
        deadline = time.monotonic() + 30
        while names() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not names()  # the janitor, without any access
    finally:
        ks.close()
