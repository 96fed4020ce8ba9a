"""Review of e132364 (a thread's policy scope guarded; ``_check_write``; ``_drop`` and
``_create`` each one commit with the asset row).

Defects (failing on e132364):

- a scope erasure (``ks.erase(subject, scope)``) never destroys the keys of the
  scope's threads (``~thread:<ref>``: ``Keyring.destroy(ref, scope)`` takes the keys
  *of that scope* only), so a copy of a thread's rows taken before the erasure (WAL
  frame, dead tuple, backup) still decrypts after it, and a thread made again
  under the same id reuses the old key;
- a listing in progress (``saver.list`` is a generator: the guard is read once,
  then rows are decrypted one by one) goes on returning the thread's checkpoints
  after its scope was suppressed, for one thread and across threads;
- a new thread refused for its suppressed scope leaves a thread key behind
  (``_create`` calls ``first_key(..., guard_scope=None)``; the scope is only
  checked later, in ``insert_assets``), which the scope's erasure never destroys;
- ``copy_thread`` into an existing thread of another scope moves the source
  scope's data out of it: the scope's erasure leaves it readable;
- a saver's scope is never checked against the configuration: a thread of an
  undeclared scope is stored, and ``ks.erase(subject, that scope)`` raises
  ``UnknownScope`` (memories refuse such a scope at the write);
- ids that are ASCII skip ``check_text`` (``_configurable``): a NUL in a checkpoint
  namespace/id/``before``/run id reaches PostgreSQL and comes out as a driver or
  SQLAlchemy error, not a ``KeyshredError``.

Also here, passing (what held): races of two handles creating the same thread, and
a write racing another handle's ``delete_thread`` inside its transaction; a
whole-subject erasure with threads of two scopes.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from langgraph.checkpoint.base import empty_checkpoint

from keyshred import Keyshred
from keyshred.errors import KeyshredError, NotFound, SubjectSuppressed
from keyshred.integrations.langgraph import KeyshredSaver
from keyshred.keyring.envelope import PlaceTemplate, key_id_of
from keyshred.storage import faults
from keyshred.storage.checkpoints import checkpoint_records, thread_scope
from keyshred.storage.schema import checkpoints
from tests.storage.conftest import make_config
from tests.storage.test_thread_faults import _rows_of
from tests.storage.test_thread_scope_guard import ANA, _cfg, _put


def _note(t: Any) -> str:
    return str(t.checkpoint["channel_values"]["notes"][0])


def _raw_checkpoints(ks: Keyshred, ref: str) -> list[tuple[str, str, str | None, bytes]]:
    """(namespace, id, parent, ciphertext) of a thread's checkpoints: what a backup,
    a WAL frame or a dead tuple keeps after the rows are deleted."""
    c = checkpoints.c
    with ks.catalog.engine.connect() as conn:
        return [
            (str(ns), str(cid), None if p is None else str(p), bytes(d))
            for ns, cid, p, d in conn.execute(
                sa.select(c.checkpoint_ns, c.checkpoint_id, c.parent_checkpoint_id, c.data).where(
                    c.thread_ref == ref
                )
            )
        ]


def _decrypts(ks: Keyshred, subject_ref: str, ref: str, raw: Any, probe: str) -> bool:
    """Whether a kept copy of a checkpoint still opens (to plaintext with ``probe``)."""
    template = PlaceTemplate(subject_ref, thread_scope(ref), "checkpoints", "data")
    found = False
    for ns, cid, parent, data in raw:
        try:
            plain = ks.keyring.open_at(data, template, checkpoint_records(ref, ns, cid, parent)[0])
        except KeyshredError:
            continue
        found = found or probe.encode() in plain
    return found


# -- a scope's erasure and the thread keys ----------------------------------------


def test_scope_erasure_destroys_the_threads_key(ks: Keyshred) -> None:
    """After ``ks.erase(ANA, "marketing")`` a pre-erasure copy of the scope's thread
    must be noise, as after ``delete_thread`` (which destroys the key first)."""
    probe = f"probe-{uuid.uuid4().hex[:10]}"
    marketing = KeyshredSaver(ks, scope="marketing")
    for i in range(2):
        _put(marketing, "campaign", f"{probe} {i}")
    subject_ref = ks.subject_ref(ANA)
    ref = str(marketing._store.thread_ref("campaign"))
    kept = _raw_checkpoints(ks, ref)
    assert _decrypts(ks, subject_ref, ref, kept, probe)

    req = ks.erase(ANA, "marketing", requested_by="dpo", reason="consent withdrawn")
    assert req.state == "completed"
    assert marketing.get_tuple(_cfg("campaign")) is None
    assert not _decrypts(ks, subject_ref, ref, kept, probe), (
        "a copy of the scope's thread taken before its erasure still decrypts after it "
        f"(thread keys left: {len(ks.keyring.store.for_subject(subject_ref, thread_scope(ref)))})"
    )


def test_thread_made_again_after_scope_erasure_gets_a_new_key(ks: Keyshred) -> None:
    marketing = KeyshredSaver(ks, scope="marketing")
    _put(marketing, "campaign", "before")
    ref = str(marketing._store.thread_ref("campaign"))
    old = {key_id_of(d) for *_, d in _raw_checkpoints(ks, ref)}
    ks.erase(ANA, "marketing", requested_by="dpo", reason="consent withdrawn")
    _put(marketing, "campaign", "after")
    new = {key_id_of(d) for *_, d in _raw_checkpoints(ks, ref)}
    assert not (old & new), "the thread made again after its scope's erasure reuses the old key"


def test_refused_new_thread_of_a_suppressed_scope_makes_no_key(ks: Keyshred) -> None:
    subject_ref = ks.subject_ref(ANA)
    _put(KeyshredSaver(ks), "support", "kept")  # the subject has a key already
    before = {r.key_id for r in ks.keyring.store.for_subject(subject_ref)}
    ks.catalog.suppress(subject_ref, scope="marketing")
    with pytest.raises(SubjectSuppressed):
        KeyshredSaver(ks, scope="marketing").put(_cfg("new-campaign"), empty_checkpoint(), {}, {})
    made = [r.scope for r in ks.keyring.store.for_subject(subject_ref) if r.key_id not in before]
    assert made == [], f"keys made for a thread its suppressed scope refused: {made}"


# -- reads after the suppression --------------------------------------------------


def test_a_listing_in_progress_stops_at_the_scopes_suppression(ks: Keyshred) -> None:
    marketing = KeyshredSaver(ks, scope="marketing")
    for i in range(3):
        _put(marketing, "campaign", f"note {i}")
    listing = marketing.list(_cfg("campaign"))
    assert _note(next(listing)) == "note 2"
    ks.catalog.suppress(ks.subject_ref(ANA), scope="marketing")
    rest: list[str] = []
    with contextlib.suppress(SubjectSuppressed):
        rest.extend(_note(t) for t in listing)
    assert rest == [], "checkpoints of the thread returned after its scope was suppressed"


def test_a_listing_across_threads_in_progress_stops_at_the_suppression(ks: Keyshred) -> None:
    marketing = KeyshredSaver(ks, scope="marketing")
    for i in range(3):
        _put(marketing, "campaign", f"note {i}")
    listing = marketing.list(None)
    assert _note(next(listing)) == "note 2"
    ks.catalog.suppress(ks.subject_ref(ANA), scope="marketing")
    rest = [_note(t) for t in listing]
    assert rest == [], "the cross-thread listing returned a suppressed scope's checkpoints"


# -- copy_thread across scopes ----------------------------------------------------


def test_copy_into_a_thread_of_another_scope_survives_no_erasure(ks: Keyshred) -> None:
    probe = f"probe-{uuid.uuid4().hex[:10]}"
    marketing, default = KeyshredSaver(ks, scope="marketing"), KeyshredSaver(ks)
    _put(default, "support", "asked about billing")
    _put(marketing, "campaign", probe)
    with contextlib.suppress(KeyshredError):  # refusing the copy is a fine answer
        marketing.copy_thread("campaign", "support")
    ks.erase(ANA, "marketing", requested_by="dpo", reason="consent withdrawn")
    left = [_note(t) for t in default.list(_cfg("support"))]
    assert probe not in left, "the marketing scope's data is readable after its erasure"


# -- a scope no erasure can name --------------------------------------------------


def test_a_thread_of_an_undeclared_scope_is_refused_or_erasable(ks: Keyshred) -> None:
    """Memories refuse a scope the configuration does not declare (``UnknownScope``);
    a saver with one stores threads that no scope erasure can reach, since
    ``ks.erase(subject, scope)`` refuses that scope."""
    try:
        saver = KeyshredSaver(ks, scope="campaigns")  # not in make_config's scopes
        _put(saver, "campaign", "x")
    except KeyshredError:
        return  # refused at the saver's construction or at the write: fine
    try:
        state = ks.erase(ANA, "campaigns", requested_by="dpo", reason="objection").state
    except KeyshredError as exc:
        pytest.fail(f"stored a thread in a scope its erasure refuses: {type(exc).__name__}")
    assert state == "completed" and saver.get_tuple(_cfg("campaign")) is None


# -- errors out of the public API --------------------------------------------------

_NUL_CALLS: dict[str, Callable[[KeyshredSaver], Any]] = {
    "list-ns": lambda s: list(s.list(_cfg("campaign", checkpoint_ns="a\x00"))),
    "list-before": lambda s: list(s.list(None, before={"configurable": {"checkpoint_id": "\x00"}})),
    "delete_for_runs": lambda s: s.delete_for_runs(["\x00"]),
    "put-id": lambda s: s.put(_cfg("campaign"), {**empty_checkpoint(), "id": "x\x00"}, {}, {}),
}


@pytest.mark.parametrize("call", sorted(_NUL_CALLS))
def test_a_nul_in_an_id_is_a_keyshred_error(ks: Keyshred, call: str) -> None:
    saver = KeyshredSaver(ks, scope="marketing")
    _put(saver, "campaign", "x")
    try:
        _NUL_CALLS[call](saver)
    except KeyshredError:
        pass
    except Exception as exc:  # noqa: BLE001 - what is asserted
        pytest.fail(f"{call}: {type(exc).__module__}.{type(exc).__name__} out of the saver")


# -- races between two handles (held) ---------------------------------------------


def _hold_at(point: str, action: Callable[[], None], wait: float = 0.8) -> Any:
    """A fault hook that, the first time ``point`` is reached, starts ``action`` in
    another thread and lets it run into the open transaction for ``wait`` s."""
    state: dict[str, Any] = {"thread": None, "error": None, "done": False}

    def run() -> None:
        try:
            action()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            state["error"] = exc
        state["done"] = True

    def hook(reached: str) -> None:
        if reached == point and state["thread"] is None:
            state["thread"] = threading.Thread(target=run)
            state["thread"].start()
            time.sleep(wait)

    return hook, state


@pytest.fixture
def handles(catalog_url: str, tmp_path: Path) -> Iterator[tuple[Keyshred, Keyshred]]:
    """Two handles on one data folder and catalog (two processes' views)."""
    a = Keyshred.init(tmp_path / "data", make_config(catalog_url))
    b = Keyshred.open(tmp_path / "data", make_config(catalog_url))
    yield a, b
    b.close()
    a.close()


def test_two_handles_create_one_thread_at_once(
    handles: tuple[Keyshred, Keyshred], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = handles
    sa_, sb = KeyshredSaver(a, scope="marketing"), KeyshredSaver(b, scope="marketing")

    def b_put() -> None:
        cp = empty_checkpoint()
        cp["channel_values"] = {"notes": ["by b"]}
        sb.put(_cfg("t"), cp, {}, {})

    hook, state = _hold_at("thread.in_create", b_put)
    monkeypatch.setattr(faults, "hook", hook)
    cp = empty_checkpoint()
    cp["channel_values"] = {"notes": ["by a"]}
    sa_.put(_cfg("t"), cp, {}, {})
    state["thread"].join(20)
    monkeypatch.setattr(faults, "hook", None)
    assert state["done"] and state["error"] is None, repr(state["error"])
    ref = str(sa_._store.thread_ref("t"))
    assert _rows_of(a, ref) == {
        "ks_threads": 1,
        "ks_checkpoints": 2,
        "ks_checkpoint_writes": 0,
        "ks_assets": 1,
    }
    assert {_note(t) for t in sb.list(_cfg("t"))} == {"by a", "by b"}


def test_a_write_racing_another_handles_delete_thread(
    handles: tuple[Keyshred, Keyshred], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = handles
    sa_, sb = KeyshredSaver(a, scope="marketing"), KeyshredSaver(b, scope="marketing")
    _put(sa_, "t", "one")
    _put(sb, "t", "two")  # b caches the thread and its key
    ref = str(sa_._store.thread_ref("t"))

    def b_put() -> None:
        _put(sb, "t", "late")

    hook, state = _hold_at("thread.before_commit", b_put)
    monkeypatch.setattr(faults, "hook", hook)
    sa_.delete_thread("t")
    state["thread"].join(20)
    monkeypatch.setattr(faults, "hook", None)
    assert state["done"]
    assert state["error"] is None or isinstance(state["error"], NotFound), repr(state["error"])
    assert set(_rows_of(a, ref).values()) == {0}
    assert sb.get_tuple(_cfg("t")) is None


def test_whole_subject_erasure_takes_threads_of_every_scope(ks: Keyshred) -> None:
    marketing, default = KeyshredSaver(ks, scope="marketing"), KeyshredSaver(ks)
    _put(marketing, "campaign", "m")
    _put(default, "support", "d")
    refs = [str(default._store.thread_ref(t)) for t in ("campaign", "support")]
    assert ks.erase(ANA, requested_by="dpo", reason="art. 17").state == "completed"
    for ref in refs:
        assert set(_rows_of(ks, ref).values()) == {0}
    assert ks.keyring.store.for_subject(ks.subject_ref(ANA)) == []
    with pytest.raises(SubjectSuppressed):
        default.get_tuple(_cfg("support"))
