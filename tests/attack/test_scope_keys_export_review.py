"""Review of 47f7c69 (a scope's erasure destroys its threads' keys; listings re-read
the guard per row; one scope per thread; threads in the subject export; NUL-free ids).

Defects are the tests whose docstring starts with "DEFECT" (all fixed since; the one
whose test depended on the old code's shape was rewritten for the new one, "Was a
DEFECT"); the others are what held.
"""

from __future__ import annotations

import base64
import contextlib
import json
import threading
import time
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.types import Interrupt, Send

from keyshred import Keyshred
from keyshred.errors import KeyshredError, SubjectErased, SubjectSuppressed
from keyshred.integrations.langgraph import KeyshredSaver
from keyshred.keyring.envelope import key_id_of
from keyshred.storage import faults
from keyshred.storage.checkpoints import thread_scope
from tests.attack.test_thread_scope_review import (
    ANA,
    _cfg,
    _decrypts,
    _note,
    _put,
    _raw_checkpoints,
)

PASS = "correct horse battery staple"
PHONE = "+44 20 7946 0958"


class _Stop(Exception):
    """Raised from an erasure's on_step hook: the run dies right after that step."""


def _stop_after(ks: Keyshred, step: str, seen: dict[str, str]) -> None:
    def hook(done: str, req: Any) -> None:
        seen["request_id"] = req.request_id
        if done == step:
            ks.erasure.on_step = None
            raise _Stop(step)

    ks.erasure.on_step = hook


def _export(ks: Keyshred, subject: str, dest: Path) -> dict[str, Any]:
    ks.export(subject, dest, passphrase=PASS)
    return ks.open_export(dest.read_bytes(), passphrase=PASS)


def _thread(saver: KeyshredSaver, thread: str, subject: str, values: Any, pending: Any) -> None:
    cfg = {"configurable": {"thread_id": thread, "checkpoint_ns": "", "subject_id": subject}}
    cp = empty_checkpoint()
    cp["channel_values"] = values
    stored = saver.put(cfg, cp, {"source": "input", "step": 1}, {})
    conf = {**stored["configurable"], "subject_id": subject}
    saver.put_writes({"configurable": conf}, [("notes", pending)], "task-1", "~a")


# -- the protocol the change touched ----------------------------------------------


def test_erasable_is_still_a_runtime_checkable_protocol(ks: Keyshred) -> None:
    """DEFECT: the diff to storage/erasable.py put ``@runtime_checkable`` twice on
    ``ScopedKeys`` and took it off ``Erasable`` (a public name, ``keyshred.Erasable``):
    ``isinstance(store, Erasable)`` now raises TypeError (tests/storage/
    test_erasable_suite.py fails the same way)."""
    from keyshred import Erasable

    try:
        ok = all(isinstance(s, Erasable) for s in ks.erasure.stores)
    except TypeError as exc:
        pytest.fail(f"isinstance(store, keyshred.Erasable) raises: {exc}")
    assert ok


# -- a scope's erasure and its threads' keys ---------------------------------------


def test_a_thread_made_while_its_scope_is_erased_leaves_no_key_behind(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was a DEFECT on 47f7c69: ``_create`` made the thread's key under the partition
    lock and inserted its row afterwards, in a transaction of its own; an erasure of
    the scope that suppressed and destroyed keys in between found no row, left the
    key, and the thread made again after the erasure was sealed under it. Now the
    key and the row are made under the lock the erasure destroys keys under: an
    erasure started while a thread is made (here from another thread, once the
    thread's key is made) finds the thread with its key."""
    subject_ref = ks.subject_ref(ANA)
    marketing = KeyshredSaver(ks, scope="marketing")
    _put(marketing, "older", "older thread")  # the scope has data: a real erasure
    seen: dict[str, str] = {}
    racer: dict[str, threading.Thread] = {}

    def erase() -> None:
        _stop_after(ks, "destroy_keys", seen)  # suppressed, keys destroyed
        with contextlib.suppress(_Stop):
            ks.erase(ANA, "marketing", requested_by="dpo", reason="objection")

    def hook(point: str) -> None:
        if point == "thread.key_made" and "t" not in racer:
            racer["t"] = threading.Thread(target=erase)
            racer["t"].start()
            time.sleep(0.5)  # the erasure runs into the creation's lock meanwhile

    monkeypatch.setattr(faults, "hook", hook)
    with contextlib.suppress(SubjectSuppressed):
        marketing.put(_cfg("campaign"), empty_checkpoint(), {}, {})
    racer["t"].join(60)
    monkeypatch.setattr(faults, "hook", None)
    done = ks.erasure.resume(seen["request_id"])
    assert done.state == "completed", done.error
    ref = str(ks.checkpoints.thread_ref("campaign"))
    pre = [r.key_id for r in ks.keyring.store.for_subject(subject_ref, thread_scope(ref))]
    assert not pre, f"{len(pre)} key(s) of the scope's thread made before its erasure survived it"
    _put(marketing, "campaign", "after the erasure")
    got = marketing.get_tuple(_cfg("campaign"))
    assert got is not None and _note(got) == "after the erasure"


def test_a_thread_sealed_under_a_shared_key_goes_with_the_scope(ks: Keyshred) -> None:
    """Held: a checkpoint about bob (his registered phone) is sealed under a key the
    thread's owner holds and bob co-owns; the owner's scope erasure destroys it."""
    ks.subjects.register_identifiers("bob", phones=[PHONE])
    probe = f"zq{uuid.uuid4().hex[:8]}"
    marketing = KeyshredSaver(ks, scope="marketing")
    _put(marketing, "campaign", f"{probe} call bob on {PHONE}")
    subject_ref = ks.subject_ref(ANA)
    ref = str(marketing._store.thread_ref("campaign"))
    kept = _raw_checkpoints(ks, ref)
    assert _decrypts(ks, subject_ref, ref, kept, probe)
    req = ks.erase(ANA, "marketing", requested_by="dpo", reason="objection")
    assert req.state == "completed", req.error
    assert not _decrypts(ks, subject_ref, ref, kept, probe)


def test_resumed_scope_erasure_killed_after_its_key_step(ks: Keyshred) -> None:
    """Held: an erasure whose run dies after destroy_keys (on_step), resumed: the
    receipt lists the thread's key, every check passes, a kept copy is noise, the
    subject's thread of another scope goes on."""
    probe = f"zq{uuid.uuid4().hex[:8]}"
    marketing, default = KeyshredSaver(ks, scope="marketing"), KeyshredSaver(ks)
    _put(marketing, "campaign", probe)
    _put(default, "support", "kept")
    subject_ref = ks.subject_ref(ANA)
    ref = str(marketing._store.thread_ref("campaign"))
    kept = _raw_checkpoints(ks, ref)
    seen: dict[str, str] = {}
    _stop_after(ks, "destroy_keys", seen)
    with pytest.raises(_Stop):
        ks.erase(ANA, "marketing", requested_by="dpo", reason="objection")
    with pytest.raises(SubjectSuppressed):
        marketing.get_tuple(_cfg("campaign"))
    done = ks.erasure.resume(seen["request_id"])
    assert done.state == "completed", done.error
    receipt = ks.erasure.receipt(seen["request_id"])
    assert receipt is not None and all(c.passed for c in receipt.verification)
    assert {key_id_of(d).hex() for *_, d in kept} <= set(receipt.key_ids)
    assert not _decrypts(ks, subject_ref, ref, kept, probe)
    assert _note(default.get_tuple(_cfg("support"))) == "kept"


def test_a_backup_from_before_the_scope_erasure_restores_no_thread_key(
    catalog_url: str, tmp_path: Path
) -> None:
    """Held: a generation taken before ``ks.erase(ana, "marketing")``, restored: the
    replayed tombstone destroys the thread's key in the restored key store and its
    rows are gone; the thread of another scope is there."""
    from tests.backup.test_backup import config

    with Keyshred.init(tmp_path / "data", config(catalog_url)) as ks:
        probe = f"zq{uuid.uuid4().hex[:8]}"
        marketing, default = KeyshredSaver(ks, scope="marketing"), KeyshredSaver(ks)
        _put(marketing, "campaign", probe)
        _put(default, "support", "kept")
        ref = str(marketing._store.thread_ref("campaign"))
        kids = {key_id_of(d) for *_, d in _raw_checkpoints(ks, ref)}
        ks.memories.flush()
        gen = ks.backup.create()
        req = ks.erase(ANA, "marketing", requested_by="dpo", reason="objection")
        assert req.state == "completed", req.error
        into = tmp_path / "restored"
        ks.backup.restore(gen.generation, into)
    with Keyshred.open(into) as r:
        for kid in kids:
            with pytest.raises(SubjectErased):
                r.keyring.data_key_by_id(kid)
        assert KeyshredSaver(r, scope="marketing").get_tuple(_cfg("campaign")) is None
        assert _note(KeyshredSaver(r).get_tuple(_cfg("support"))) == "kept"
    for path in (p for p in into.rglob("*") if p.is_file()):
        assert probe.encode() not in path.read_bytes(), path


# -- the export's threads ------------------------------------------------------------


def test_export_leaves_out_a_scope_suppressed_as_it_starts(
    ks: Keyshred, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DEFECT: ``export_subject`` reads the suppressed scopes once, before it takes
    the subject's lock and opens its transaction; ``exported`` then decrypts every
    thread not in that stale set (``_rows`` never reads the holder's guard). A scope
    erasure that suppresses in between (here: its run stops after ``suppress``,
    before its keys go) has the erased scope's threads in the package."""
    probe = f"zq{uuid.uuid4().hex[:8]}"
    _put(KeyshredSaver(ks, scope="marketing"), "campaign", probe)
    _put(KeyshredSaver(ks), "support", "kept")
    flush = ks.vault.flush
    seen: dict[str, str] = {}

    def erasure_starts_then_flush(*args: Any, **kwargs: Any) -> Any:
        if "started" not in seen:
            seen["started"] = "yes"  # the erasure's own evictions flush too
            _stop_after(ks, "suppress", seen)
            with pytest.raises(_Stop):
                ks.erase(ANA, "marketing", requested_by="dpo", reason="objection")
        return flush(*args, **kwargs)

    monkeypatch.setattr(ks.vault, "flush", erasure_starts_then_flush)
    files = _export(ks, ANA, tmp_path / "ana.ksx")
    scopes = sorted(t["scope"] for t in files["threads.json"])
    assert probe not in json.dumps(files["threads.json"]), (
        f"the export holds the thread of a scope suppressed before it read it: {scopes}"
    )


class _PlainJsonSerde(JsonPlusSerializer):
    """An application's serde writing LangGraph's ``json`` type (as LangGraph's own
    serializer did before msgpack); the saver reads it back fine."""

    def dumps_typed(self, obj: Any) -> tuple[str, bytes]:
        return "json", json.dumps(obj, default=str).encode()

    def loads_typed(self, data: tuple[str, bytes]) -> Any:
        return json.loads(data[1])


def test_export_of_a_checkpoint_holding_a_lone_surrogate(ks: Keyshred, tmp_path: Path) -> None:
    """DEFECT: a ``json`` checkpoint value holding a lone surrogate (valid JSON,
    ``"\\ud800"``; the saver stores and reads it) is decoded by ``_loaded`` and
    written with ``ensure_ascii=False``: ``zf.writestr`` raises UnicodeEncodeError
    (not a KeyshredError) and the subject can no longer be exported at all."""
    saver = KeyshredSaver(ks, serde=_PlainJsonSerde())
    _thread(saver, "chat", ANA, {"notes": ["half an emoji \ud83d"]}, "pending")
    got = saver.get_tuple(_cfg("chat"))
    assert got is not None and got.checkpoint["channel_values"]["notes"] == ["half an emoji \ud83d"]
    try:
        files = _export(ks, ANA, tmp_path / "ana.ksx")
    except KeyshredError:
        return  # refused with a KeyshredError: acceptable
    except Exception as exc:  # noqa: BLE001 - what is asserted
        pytest.fail(f"export raised {type(exc).__module__}.{type(exc).__name__}: {exc}")
    assert len(files["threads.json"]) == 1


def test_export_keeps_every_entry_of_a_dict_with_non_string_keys(
    ks: Keyshred, tmp_path: Path
) -> None:
    """DEFECT (data lost from the access package): ``_jsonable`` turns keys into
    ``str(k)``, so ``{1: "a", "1": "b"}`` (msgpack keeps both; the saver returns
    both) is exported with one entry silently dropped."""
    saver = KeyshredSaver(ks)
    _thread(saver, "chat", ANA, {"scores": {1: "int-one", "1": "str-one"}}, "x")
    got = saver.get_tuple(_cfg("chat"))
    assert got is not None
    assert len(got.checkpoint["channel_values"]["scores"]) == 2
    files = _export(ks, ANA, tmp_path / "ana.ksx")
    (cp,) = files["threads.json"][0]["checkpoints"]
    text = json.dumps(cp["checkpoint"])
    assert "int-one" in text and "str-one" in text, cp["checkpoint"]["channel_values"]


def test_export_of_odd_checkpoint_contents(ks: Keyshred, tmp_path: Path) -> None:
    """Held: bytes, sets, Decimal, Send, Interrupt, nested lists, NaN, a 1 MB string,
    pending writes of the same, an unknown type name: the export opens and holds
    every thread; no probe in the sealed file."""
    probe = f"zq{uuid.uuid4().hex[:8]}"
    saver = KeyshredSaver(ks)
    nested: Any = probe
    for _ in range(60):
        nested = [nested]
    values = {
        "b": probe.encode() + b"\x00\xff",
        "s": {probe, "x"},
        "d": Decimal("1.5"),
        "send": Send("node", {"arg": probe}),
        "interrupt": Interrupt(value={"ask": probe}),
        "nested": nested,
        "nan": float("nan"),
        "big": probe + "y" * 1_000_000,
        "tuple_key": {(1, 2): probe},
    }
    _thread(saver, "odd", ANA, values, Send("n", probe))
    _thread(KeyshredSaver(ks, serde=_PlainJsonSerde()), "plain", ANA, {"n": [probe]}, probe)
    dest = tmp_path / "ana.ksx"
    files = _export(ks, ANA, dest)
    assert probe.encode() not in dest.read_bytes()
    assert {t["thread_id"] for t in files["threads.json"]} == {"odd", "plain"}
    text = json.dumps(files["threads.json"])
    assert text.count(probe) >= 6
    (odd,) = [t for t in files["threads.json"] if t["thread_id"] == "odd"]
    (cp,) = odd["checkpoints"]
    got = cp["checkpoint"]["channel_values"]
    assert base64.b64decode(got["b"]["base64"]) == probe.encode() + b"\x00\xff"


def test_export_key_is_co_owned_for_a_pending_write_about_another_subject(
    ks: Keyshred, tmp_path: Path
) -> None:
    """Held: only the pending write names bob's registered phone; the package's key
    is bob's too: erasing bob makes the package unreadable."""
    ks.subjects.register_identifiers("bob", phones=[PHONE])
    _thread(KeyshredSaver(ks), "chat", ANA, {"n": ["nothing of bob"]}, f"call {PHONE}")
    dest = tmp_path / "ana.ksx"
    files = _export(ks, ANA, dest)
    assert PHONE in json.dumps(files["threads.json"])
    assert ks.erase("bob", requested_by="dpo", reason="art17").state == "completed"
    with pytest.raises((SubjectErased, SubjectSuppressed)):
        ks.open_export(dest.read_bytes(), passphrase=PASS)


def test_export_leaves_out_a_deleted_thread_and_another_subjects(
    ks: Keyshred, tmp_path: Path
) -> None:
    """Held: a deleted thread, a pruned checkpoint and another subject's thread are
    not in the package."""
    probe, other = f"zq{uuid.uuid4().hex[:8]}", f"zq{uuid.uuid4().hex[:8]}"
    saver = KeyshredSaver(ks)
    _put(saver, "gone", probe)
    saver.delete_thread("gone")
    _put(saver, "kept", f"{probe}-old")
    _put(saver, "kept", "new")
    saver.prune(["kept"])
    _thread(saver, "bobs", "bob", {"n": [other]}, other)
    files = _export(ks, ANA, tmp_path / "ana.ksx")
    text = json.dumps(files)
    assert probe not in text and other not in text
    assert [t["thread_id"] for t in files["threads.json"]] == ["kept"]


# -- ids and listings ------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    ["copy_thread", "delete_thread", "prune"],
)
def test_a_lone_surrogate_thread_id_is_a_keyshred_error(ks: Keyshred, call: str) -> None:
    """Held: thread ids given as method arguments (not in a config) with a lone
    surrogate come out as a KeyshredError, as they do through a config."""
    saver = KeyshredSaver(ks, scope="marketing")
    _put(saver, "campaign", "x")
    bad = "t\ud800"
    calls = {
        "copy_thread": lambda: saver.copy_thread("campaign", bad),
        "delete_thread": lambda: saver.delete_thread(bad),
        "prune": lambda: saver.prune([bad]),
    }
    try:
        calls[call]()
    except KeyshredError:
        pass
    except Exception as exc:  # noqa: BLE001 - what is asserted
        pytest.fail(f"{call}: {type(exc).__module__}.{type(exc).__name__} out of the saver")


def test_a_listing_of_one_thread_with_a_namespace_stops_at_the_suppression(
    ks: Keyshred,
) -> None:
    """Held: ``list(config)`` with ``checkpoint_ns`` (LangGraph's usual config) takes
    the generic query; it too stops at the scope's suppression."""
    marketing = KeyshredSaver(ks, scope="marketing")
    for i in range(3):
        _put(marketing, "campaign", f"note {i}")
    listing = marketing.list(_cfg("campaign"))
    assert _note(next(listing)) == "note 2"
    ks.catalog.suppress(ks.subject_ref(ANA), scope="marketing")
    rest: list[str] = []
    with contextlib.suppress(SubjectSuppressed):
        rest.extend(_note(t) for t in listing)
    assert rest == []


def test_export_thread_times_carry_their_offset(ks: Keyshred, tmp_path: Path) -> None:
    """DEFECT (SQLite): ``threads.json``'s ``created_at`` is written from the raw
    column (``_iso(t.created_at)``): naive on SQLite ("2026-12-07T06:33:13.441709"),
    "+00:00" on PostgreSQL; every other time in the package carries its offset."""
    from datetime import datetime

    _put(KeyshredSaver(ks), "support", "x")
    files = _export(ks, ANA, tmp_path / "ana.ksx")
    (thread,) = files["threads.json"]
    at = datetime.fromisoformat(thread["created_at"])
    assert at.tzinfo is not None, f"created_at {thread['created_at']!r} has no UTC offset"
