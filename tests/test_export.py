"""Subject export: one snapshot point under writers, nothing of other subjects,
sealed to a passphrase or a public key and to the subject's key, expiring, and
unreadable once the subject is erased."""

from __future__ import annotations

import base64
import json
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import HumanMessage
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

from keyshred import Keyshred
from keyshred.errors import (
    IntegrityError,
    InvalidInput,
    SubjectErased,
    SubjectSuppressed,
    TokenExpired,
)
from keyshred.export import open_export
from keyshred.integrations.langgraph import KeyshredSaver
from keyshred.keyring.package import generate_recipient_key
from tests.storage.conftest import make_config

NS = ("notes",)
PASS = "correct horse battery staple"


@pytest.fixture
def ks(catalog_url: str, tmp_path: Path) -> Iterator[Keyshred]:
    store = Keyshred.init(tmp_path / "data", make_config(catalog_url))
    yield store
    store.close()


def test_export_is_consistent_and_holds_only_the_subject(ks: Keyshred, tmp_path: Path) -> None:
    mine = f"zq{uuid.uuid4().hex[:8]}"
    theirs = f"zq{uuid.uuid4().hex[:8]}"
    ks.memories.put("gia", NS, "base", {"text": f"{mine} base"})
    ks.memories.put("hal", NS, "x", {"text": f"{theirs} private"})
    ks.memories.put("hal", ("facts",), "met", {"text": f"{theirs} met gia"}, mentions=["gia"])
    ks.vault.sanitize("mail gia@example.org", "gia", "support", timedelta(days=1))
    ks.consent.grant("gia", scope="support/health", category="health")
    ks.memories.correct("gia", NS, "base", {"text": f"{mine} corrected"}, reason="typo")

    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            ks.memories.put("gia", ("stream",), f"s{i:05d}", {"i": i})
            i += 1

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        while ks.memories.count("gia") < 20:
            stop.wait(0.01)
        result = ks.export("gia", tmp_path / "gia.ksx", passphrase=PASS)
    finally:
        stop.set()
        thread.join()
    package = (tmp_path / "gia.ksx").read_bytes()
    assert mine.encode() not in package and b"gia@example.org" not in package  # sealed
    files = ks.open_export(package, passphrase=PASS)
    manifest = files["manifest.json"]
    assert manifest["counts"] == result.counts
    stream = sorted(m["key"] for m in files["memories.json"] if m["namespace"] == ["stream"])
    # One snapshot point: the writer's keys form an unbroken prefix s00000..s(n-1).
    assert stream == [f"s{i:05d}" for i in range(len(stream))]
    assert manifest["counts"]["memories"] == len(files["memories.json"])
    history = [m for m in files["memories.json"] if m["namespace"][0] == "~history"]
    assert len(history) == 1 and history[0]["value"]["value"]["text"] == f"{mine} base"
    assert [t["kind"] for t in files["tokens.json"]] == ["EMAIL"]
    assert "gia@example.org" not in json.dumps(files)  # token values are not exported
    assert [c["purpose"] for c in files["consents.json"]] == ["support"]
    assert files["mentions.json"] and "content" not in files["mentions.json"][0]
    assert any(e["event"] == "memory.corrected" for e in files["audit.json"])
    everything = json.dumps(files)
    assert theirs not in everything  # nothing of another subject, not even the mention's text
    assert mine in everything


def test_export_seal_expiry_tamper_and_erasure(ks: Keyshred, tmp_path: Path) -> None:
    ks.memories.put("ivo", NS, "k", {"v": 1})
    private, public = generate_recipient_key()
    res = ks.export(
        "ivo", tmp_path / "a.ksx", recipient_public_key=public, expires_in=timedelta(hours=1)
    )
    package = (tmp_path / "a.ksx").read_bytes()
    assert ks.open_export(package, private_key=private)["memories.json"][0]["value"] == {"v": 1}
    other_private, _ = generate_recipient_key()
    with pytest.raises(IntegrityError):
        ks.open_export(package, private_key=other_private)
    with pytest.raises(InvalidInput):
        ks.open_export(package, passphrase=PASS)
    tampered = package.replace(b'"expires_at":"', b'"expires_at":"2', 1)
    with pytest.raises(IntegrityError):
        ks.open_export(tampered, private_key=private)
    with pytest.raises(TokenExpired):
        open_export(ks, package, private_key=private, now=res.expires_at + timedelta(seconds=1))
    with pytest.raises(InvalidInput):
        ks.export("ivo", tmp_path / "b.ksx", passphrase="short")
    # The retention run after the expiry destroys the export's key.
    ks.export("ivo", tmp_path / "c.ksx", passphrase=PASS, expires_in=timedelta(seconds=30))
    report = ks.retention.run(now=datetime.now(UTC) + timedelta(minutes=1))
    assert report.exports_expired == 1
    # Erasing the subject makes every package unreadable.
    ks.erase("ivo", requested_by="dpo", reason="art17")
    with pytest.raises((SubjectErased, SubjectSuppressed)):
        ks.open_export(package, private_key=private)


def test_a_tampered_kdf_header_is_refused_before_any_work(
    ks: Keyshred, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scrypt cost is the format's: a header asking for n=2^20 (seconds of work)
    or missing its KDF is ``IntegrityError`` before any derivation."""
    from keyshred.keyring import _primitives as prim

    ks.memories.put("jo", NS, "k", {"v": 1})
    ks.export("jo", tmp_path / "j.ksx", passphrase=PASS)
    package = (tmp_path / "j.ksx").read_bytes()
    line, body = package.split(b"\n", 1)
    header = json.loads(line)
    derived: list[int] = []
    real = prim.scrypt_derive

    def spy(passphrase: bytes, *, salt: bytes, n: int, r: int, p: int) -> bytes:
        derived.append(n)
        return real(passphrase, salt=salt, n=n, r=r, p=p)

    monkeypatch.setattr(prim, "scrypt_derive", spy)
    costly = {**header, "kdf": {**header["kdf"], "n": 2**20}}
    no_kdf = {k: v for k, v in header.items() if k != "kdf"}
    for bad in (costly, no_kdf):
        tampered = json.dumps(bad, sort_keys=True, separators=(",", ":")).encode() + b"\n" + body
        with pytest.raises(IntegrityError):
            ks.open_export(tampered, passphrase=PASS)
    assert derived == []
    assert ks.open_export(package, passphrase=PASS)["memories.json"][0]["value"] == {"v": 1}
    assert derived == [2**15]


# -- agent threads ------------------------------------------------------------------

PHONE = "+44 20 7946 0958"


def _thread(saver: Any, thread: str, subject: str, value: Any, pending: Any) -> None:
    cfg = {"configurable": {"thread_id": thread, "checkpoint_ns": "", "subject_id": subject}}
    cp = empty_checkpoint()
    cp["channel_values"] = {"messages": value}
    stored = saver.put(cfg, cp, {"source": "input", "step": 1}, {})
    conf = {**stored["configurable"], "subject_id": subject}
    saver.put_writes({"configurable": conf}, [("notes", pending)], "task-1", "~a")


class _OwnSerde(JsonPlusSerializer):
    """An application's serializer whose type names LangGraph's default does not know."""

    def dumps_typed(self, obj: Any) -> tuple[str, bytes]:
        _, data = super().dumps_typed(obj)
        return "app-format", data[::-1]

    def loads_typed(self, data: tuple[str, bytes]) -> Any:
        return super().loads_typed(("msgpack", data[1][::-1]))


def test_export_holds_the_subjects_agent_threads(ks: Keyshred, tmp_path: Path) -> None:
    """Checkpoints, metadata and pending writes of the subject's threads, decoded
    (LangChain messages in their own serialized form), at the same point in time as
    the rest; nothing of another subject's threads; a thread of a suppressed scope
    left out; a value only the application's serializer reads given as bytes."""
    mine, theirs = f"zq{uuid.uuid4().hex[:8]}", f"zq{uuid.uuid4().hex[:8]}"
    saver = KeyshredSaver(ks)
    _thread(saver, "gia-chat", "gia", [HumanMessage(content=f"{mine} hello")], f"{mine} note")
    _thread(saver, "hal-chat", "hal", [HumanMessage(content=f"{theirs} hi")], theirs)
    _thread(KeyshredSaver(ks, scope="marketing"), "gia-offers", "gia", [f"{mine} offer"], "x")
    _thread(KeyshredSaver(ks, serde=_OwnSerde()), "gia-own", "gia", [f"{mine} own"], "y")
    ks.catalog.suppress(ks.subject_ref("gia"), scope="marketing")

    result = ks.export("gia", tmp_path / "gia.ksx", passphrase=PASS)
    package = (tmp_path / "gia.ksx").read_bytes()
    assert mine.encode() not in package
    files = ks.open_export(package, passphrase=PASS)
    threads = {t["thread_id"]: t for t in files["threads.json"]}
    assert set(threads) == {"gia-chat", "gia-own"}
    assert result.counts["threads"] == 2 and result.counts["checkpoints"] == 2
    assert files["manifest.json"]["counts"] == result.counts
    (chat,) = threads["gia-chat"]["checkpoints"]
    (message,) = chat["checkpoint"]["channel_values"]["messages"]
    assert message["kwargs"]["content"] == f"{mine} hello"
    assert message["id"][-1] == "HumanMessage"
    assert chat["metadata"]["source"] == "input"
    assert chat["pending_writes"] == [
        {"task_id": "task-1", "task_path": "~a", "channel": "notes", "value": f"{mine} note"}
    ]
    assert threads["gia-chat"]["scope"] == "default"
    (own,) = threads["gia-own"]["checkpoints"]
    assert own["checkpoint"]["serialized_as"] == "app-format"
    assert _OwnSerde().loads_typed(("app-format", base64.b64decode(own["checkpoint"]["base64"])))[
        "channel_values"
    ] == {"messages": [f"{mine} own"]}
    everything = json.dumps(files)
    assert theirs not in everything and "offer" not in everything


def test_an_export_holding_a_thread_about_another_subject_goes_with_them(
    ks: Keyshred, tmp_path: Path
) -> None:
    """Gia's thread holds a phone number bob registered: sealed under a key bob
    co-owns, so the package's key is bob's too, and erasing bob makes it unreadable
    (as for an exported memory about bob)."""
    ks.subjects.register_identifiers("bob", phones=[PHONE])
    _thread(KeyshredSaver(ks), "gia-chat", "gia", [f"call bob on {PHONE}"], "later")
    ks.export("gia", tmp_path / "gia.ksx", passphrase=PASS)
    package = (tmp_path / "gia.ksx").read_bytes()
    files = ks.open_export(package, passphrase=PASS)
    (cp,) = files["threads.json"][0]["checkpoints"]
    assert cp["checkpoint"]["channel_values"]["messages"] == [f"call bob on {PHONE}"]
    req = ks.erase("bob", requested_by="dpo", reason="art17")
    assert req.state == "completed", req.error
    with pytest.raises((SubjectErased, SubjectSuppressed)):
        ks.open_export(package, passphrase=PASS)
