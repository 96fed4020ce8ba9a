"""Rewrites and resumed erasures, found by four attacker reviews of the derived
step (keyshred/erasure/derived.py) and of update/correct/touch
(storage/memory_edit.py, storage/memory_write.py): which owners a rewrite keeps,
what touch may extend, what a resumed erasure claims, which sources a rebuild
uses, what was derived while a request waited, and what is left on disk. Each
test is named for the property it holds; its docstring tells the defect it
found (in the past tense of the code it was found in) and why it happened."""

from __future__ import annotations

import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from keyshred import Keyshred
from keyshred.erasure import RebuildFailed
from keyshred.erasure.derived import _run
from keyshred.errors import KeyshredError
from keyshred.storage import Memory, PutItem
from keyshred.storage.partition import Partition
from tests.scenarios import (
    PROBE,
    VICTIM,
    clean_rebuild,
    derive,
    expiring_probe_memory,
    victim_summary,
)
from tests.storage.conftest import SEGMENTS, make_config


def _expiring_summary(
    ks: Keyshred, *, producer: str, rebuild: Any = None, text: str = "victim text"
) -> tuple[Memory, Memory, Memory]:
    """The victim's memory (``text``) expiring in 5 s, Bob's memory, and Bob's
    summary of both at ("s",) "d" (what a retention request then rebuilds)."""
    [v] = ks.memories.put_many(VICTIM, [PutItem(("m",), "k", text, ttl=timedelta(seconds=5))])
    b = ks.memories.put("bob", ("m",), "b", "bob text")
    s = derive(
        ks,
        "bob",
        "d",
        [v.memory_id, b.memory_id],
        value=f"summary of {text}",
        producer=producer,
        rebuild=rebuild,
    )
    return v, b, s


def _expired_victim_memory_in_manual_review(ks: Keyshred) -> tuple[str, str]:
    """A retention request for the victim's expired memory waits in manual_review
    (Bob's summary of it names a producer nobody registered yet). Returns
    (request id, summary id). During the wait the summary is readable: retention
    destroys no key."""
    _v, _b, s = _expiring_summary(ks, producer="later")
    report = ks.retention.run(now=datetime.now(UTC) + timedelta(seconds=30))
    [req] = report.requests
    assert req["state"] == "manual_review"
    return req["request_id"], s.memory_id


# -- update / correct / touch -----------------------------------------------------------


@pytest.mark.parametrize("sources", [5, [["not", "hashable"]], [{"a": 1}]])
def test_update_of_a_derived_memory_with_odd_sources_raises_keyshred_error(
    ks: Keyshred, sources: Any
) -> None:
    """update() of a derived memory (one with sources) with ``sources=5`` or a list
    holding an unhashable item raises a bare ``TypeError`` ('int' object is not
    iterable / unhashable type: 'list') out of the public API.

    Cause: the new "kept owners" block in ``EditMixin.update`` computes
    ``set(item.sources) & set(existing.sources)`` *before* ``_checked(item)`` and
    ``_put_rows`` validate ``sources`` (on a plain memory ``existing.sources`` is
    empty and the short-circuit hides it; before the change the same input was
    ``InvalidInput``)."""
    victim_summary(ks)
    with pytest.raises(KeyshredError):
        ks.memories.update("bob", ("s",), "d", "new", sources=sources)


def test_an_update_that_drops_a_live_source_sheds_its_owner(
    ks: Keyshred,
) -> None:
    """Bob's plan was written from the victim's memory and his own
    (``sources=[v, b]``). Bob rewrites it from his own memory only
    (``update(..., sources=[b])``): the declared provenance no longer includes the
    victim. Yet the victim's erasure destroys Bob's plan (it is dropped, gone).

    Cause: ``update`` keeps *all* owners of the old key (``Kept``) as soon as *one*
    old source is kept (``set(item.sources) & set(existing.sources)``); only
    explicitly dropped *mentions* are subtracted, never the owners that came from an
    explicitly dropped source that the catalog still holds. The new value is sealed
    under a key co-owned by ``victim@default`` forever (every later update keeping
    ``b`` keeps it too), so the victim's erasure makes it opaque and, a plain memory
    naming no producer, drops it. Before this change the owners came from the new
    sources, and the plan survived. Inconsistent too: ``sources=[]`` (all dropped)
    does reset the owners. A bystander's data vanishes through another subject's
    erasure although nothing in it is declared to be about them."""
    v = ks.memories.put(VICTIM, ("m",), "k", "victim text")
    b = ks.memories.put("bob", ("m",), "b", "bob text")
    ks.memories.put(
        "bob", ("n",), "plan", "plan from victim and bob", sources=[v.memory_id, b.memory_id]
    )
    ks.memories.update("bob", ("n",), "plan", "plan from bob text only", sources=[b.memory_id])
    assert ks.erase(VICTIM, requested_by="dpo", reason="art17").state == "completed"
    got = ks.memories.get("bob", ("n",), "plan")
    assert got is not None, "Bob's plan, declared derived from his own memory only, was dropped"
    assert got.value == "plan from bob text only"


def test_a_dropped_mention_stays_an_owner_while_a_deleted_source_may_name_it(ks: Keyshred) -> None:
    """Alice's memory mentions Carol; Bob's digest is built from it (and mentions
    Carol too). Alice deletes her memory (its catalog row goes). Bob rewrites the
    digest keeping its provenance but with ``mentions=[]``. Carol's erasure then
    leaves Bob's digest readable, with the text about Carol it got from Alice's
    memory.

    Cause: ``update`` subtracts every dropped mention from the kept owners of the
    old key, although Carol was an owner of that key *also* through the (kept)
    deleted source: README, "every owner of a derived asset's sources, followed
    through derived sources". With the source gone from the catalog the old key's
    owner list is the only record of that, and the filter erases it. The new commit
    introduced kept owners precisely for "a summary rewritten after one of its
    sources was deleted still goes with that source's subject"."""
    a = ks.memories.put("alice", ("m",), "a", "alice met carol at the clinic", mentions=["carol"])
    b = ks.memories.put("bob", ("m",), "b", "bob text")
    ks.derived.register(
        "digest",
        subject="bob",
        namespace=("s",),
        key="d",
        value="digest: alice met carol at the clinic",
        produced_from=[a.memory_id, b.memory_id],
        producer="dg",
        producer_version="1",
        mentions=["carol"],
        rebuild=lambda sources: "rebuilt: " + " | ".join(m.value for m in sources),
    )
    ks.memories.delete("alice", ("m",), "a")
    ks.memories.update("bob", ("s",), "d", "digest v2: alice met carol at the clinic", mentions=[])
    assert ks.erase("carol", requested_by="dpo", reason="art17").state == "completed"
    got = ks.memories.get("bob", ("s",), "d")
    assert got is None or "carol" not in str(got.value), "text about Carol outlived her erasure"


def test_touch_stays_within_the_consents_end(ks: Keyshred) -> None:
    """A memory stored under consent that ends tomorrow is retained until tomorrow
    (``_target`` caps retain-until at the consent's end). ``touch`` with 30 days
    pushes it to 30 days: past the end of the consent it was stored under.

    Cause: ``EditMixin.touch`` computes its cap as
    ``policy.retain_until(rule, now, None)``: the consent end is never looked up
    (nor whether a consent is still active at all). Nothing else deletes data when
    a consent's ``end_at`` passes: the retain-until is the only enforcement.
    (Pre-existing in ``touch``, which this change revised to validate input.)"""
    end = datetime.now(UTC) + timedelta(days=1)
    ks.consent.grant("ann", scope="support/health", category="health", end_at=end)
    m = ks.memories.put(
        "ann", ("h",), "k", "ann has asthma", scope="support/health", category="health"
    )
    assert m.retain_until <= end
    ks.memories.touch("ann", [(("h",), "k")], timedelta(days=30))
    got = ks.memories.get("ann", ("h",), "k")
    assert got is not None
    assert got.retain_until <= end, "touch kept the memory past the end of its consent"


# -- derived step -----------------------------------------------------------------------


def test_a_receipt_never_claims_a_rebuild_whose_write_failed(
    ks: Keyshred,
) -> None:
    """The derived step records the intent "rebuilt" before writing; here the write
    fails (the rebuild function returned a non-JSON value: ``InvalidInput`` inside
    ``memories.rebuild``), so the request is ``retryable_failure`` with the intent
    left in its progress. Bob then writes his own note at the summary's name (same
    asset id). The resumed erasure sees a row that no longer touches the erasure and
    changed since the intent, and ``_landed(intent, "rebuilt")`` records "rebuilt":
    the signed receipt says the erasure rebuilt Bob's summary with producer dg v1,
    though the rebuild never wrote anything (the function was never called again).

    The code even says "a stale intent must not claim a later change of the
    holder's", but ``updated_us`` changing cannot tell the step's own write from the
    holder's."""
    calls = {"n": 0}

    def rebuild(sources: list[Any]) -> Any:
        calls["n"] += 1
        return {1, 2}  # not JSON: the write after the intent fails

    _, _, s_id = victim_summary(ks, rebuild=rebuild)
    req = ks.erase(VICTIM, requested_by="dpo", reason="art17", request_id="r1")
    assert req.state != "completed"
    ks.memories.put("bob", ("s",), "d", "bob's own note")  # same asset id
    assert ks.memories.get("bob", ("s",), "d").memory_id == s_id
    assert ks.erasure.resume("r1").state == "completed"
    assert calls["n"] == 1, "the rebuild function ran only once, and failed"
    receipt = ks.erasure.receipt("r1")
    assert receipt is not None
    claimed = [d for d in receipt.derived if d.asset_id == s_id and d.action == "rebuilt"]
    assert not claimed, "the receipt claims a rebuild that never happened"


def test_a_rebuild_never_reads_an_expired_source(ks: Keyshred) -> None:
    """Bob's digest is built from the victim's memory and a short-lived memory of
    Bob's whose retain-until has passed (unreadable by every read: ``get`` returns
    None) but which the retention sweep has not removed yet. The victim's erasure
    rebuilds the digest *from the expired memory*: its text lives on in the rebuilt
    digest, with a fresh (ten-year) retention. README: "A rebuild function runs only
    on sources that remain and can be read (none: the asset is dropped)".

    Cause: ``DerivedStore._readable_sources`` reads with ``rows_by_id``, which returns
    every readable row whatever its ``retain_us`` (the read path's ``_row_once`` hides
    rows past their retain-until)."""
    v = ks.memories.put(VICTIM, ("m",), "k", "victim text")
    [e] = ks.memories.put_many(
        "bob", [PutItem(("m",), "e", "bob short-lived secret", ttl=timedelta(seconds=1))]
    )
    seen: list[list[Any]] = []

    def rebuild(sources: list[Any]) -> str:
        seen.append([m.value for m in sources])
        return "rebuilt: " + " | ".join(m.value for m in sources)

    derive(
        ks, "bob", "d", [v.memory_id, e.memory_id], value="digest", producer="dg", rebuild=rebuild
    )
    time.sleep(1.5)
    assert ks.memories.get("bob", ("m",), "e") is None  # expired: gone for every read
    assert ks.erase(VICTIM, requested_by="dpo", reason="art17").state == "completed"
    assert seen == [], f"the rebuild ran on an expired source: {seen}"
    got = ks.memories.get("bob", ("s",), "d")
    assert got is None or "short-lived" not in str(got.value)


def test_an_asset_derived_from_the_closure_during_the_wait_goes_with_it(
    ks: Keyshred,
) -> None:
    """A retention request for the victim's expired memory waits in manual_review
    (Bob's summary names a producer not registered yet). Retention destroys no key,
    so the summary, still holding the expired text, stays readable during the wait.
    Carol derives her own asset from it. Once the producer is registered, the
    resumed request rebuilds Bob's summary and completes (signed receipt), but
    Carol's asset, built from the not-yet-rebuilt summary, still holds the expired
    victim text.

    Cause: the derived step acts only on ``target.closure``, listed once by the
    closure step, and "decides from the row as it is now" only for those ids;
    DerivedStore.verify checks only provenance pointing at *erased* ids, and
    Carol's points at the summary (rebuilt, not erased). A resumed (or slow)
    request misses everything derived from its closure since the closure was listed."""
    rid, s_id = _expired_victim_memory_in_manual_review(ks)
    summary = ks.memories.get("bob", ("s",), "d")
    assert summary is not None
    derive(
        ks,
        "carol",
        "t",
        [s_id],
        kind="copy",
        namespace=("c",),
        value="carol's copy: " + str(summary.value),
        producer="copy",
        rebuild=lambda sources: "carol's copy: " + " | ".join(str(m.value) for m in sources),
    )
    ks.derived.register_producer("later", "1", lambda sources: "rebuilt without victim")
    assert ks.erasure.resume(rid).state == "completed"
    got = ks.memories.get("carol", ("c",), "t")
    assert got is None or "victim text" not in str(got.value), (
        "a copy of the expired victim text outlived the completed retention request"
    )


def test_a_version_made_during_the_wait_goes_with_the_request(
    ks: Keyshred,
) -> None:
    """Same wait as above. Bob corrects his summary meanwhile: the superseded value
    (the expired victim text) becomes a history version, a new asset the closure
    never listed. The resumed request rebuilds the summary but not the version;
    verification then fails ("no provenance points at erased assets") and the
    request is dead-lettered in manual_review, where ``resume`` does nothing any
    more, while ``history()`` keeps serving the expired victim text for the
    summary's full retention.

    Cause: as above, the closure is listed once; ``correct`` of a closure asset of
    an open (waiting) request is allowed and creates a version outside it."""
    rid, _ = _expired_victim_memory_in_manual_review(ks)
    ks.memories.correct("bob", ("s",), "d", "bob's corrected summary", reason="fix")
    ks.derived.register_producer("later", "1", lambda sources: "rebuilt without victim")
    state = ks.erasure.resume(rid).state
    history = ks.memories.history("bob", ("s",), "d")
    leftover = [h for h in history if "victim text" in str(h["value"])]
    assert not leftover, f"expired victim text still in history() (request {state})"
    assert state == "completed"


# -- earlier findings: resumed erasures, rebuilds from nothing, register's input ----


def test_resumed_erasure_keeps_a_bystanders_memory_rewritten_meanwhile(ks: Keyshred) -> None:
    """Bob's summary of the victim's memory is in the erasure's closure; the erasure
    waits in manual_review (its producer unknown). Meanwhile Bob writes a note of his
    own at that key: the put reuses the asset id of the (opaque) summary. The resumed
    derived step re-reads the asset by that id, finds a plain memory with no source
    left, and deletes Bob's new note, which holds nothing of the victim."""
    victim_summary(ks, producer="later")
    req = ks.erase(VICTIM, requested_by="dpo", reason="art17", request_id="r1")
    assert req.state == "manual_review"
    # Bob's own note, nothing about the victim, at the key of the summary.
    ks.memories.put("bob", ("s",), "d", "bob's own note")
    ks.derived.register_producer("later", "1", lambda sources: "rebuilt")
    assert ks.erasure.resume("r1").state == "completed"
    mine = ks.memories.get("bob", ("s",), "d")
    assert mine is not None, "the resumed erasure deleted the bystander's own new memory"
    assert mine.value == "bob's own note"


def test_sigkilled_erasure_resumed_keeps_a_bystanders_memory_written_meanwhile(
    tmp_path: Path,
) -> None:
    """Defect 1 with a crash instead of manual_review: the erasure of
    tests/test_erasure_faults.py's population is SIGKILLed after its closure (and
    catalog) step; Bob writes his own note over his opaque "digest" (same asset id),
    then the erasure is resumed: the derived step deletes Bob's note."""
    from tests.erasure_worker import register_producers
    from tests.storage.test_vectors import bag_of_words
    from tests.test_erasure_faults import kill_erasure_at

    data = kill_erasure_at("catalog", tmp_path)
    with Keyshred.open(data, make_config(None), embeddings=bag_of_words) as store:
        register_producers(store)
        store.memories.put("bob", ("s",), "digest", "bob's own note")
        assert store.erasure.resume("req-fault").state == "completed"
        mine = store.memories.get("bob", ("s",), "digest")
        assert mine is not None, "the resumed erasure deleted the bystander's own new memory"
        assert mine.value == "bob's own note"


def test_a_provenance_cycle_never_rebuilds_from_nothing(ks: Keyshred) -> None:
    """steps._sources_first assumes a cycle is "never made by the API", but update
    accepts any source the catalog holds: D <- E <- D. The victim's erasure then
    rebuilds E from D while D is still opaque: the rebuild function runs on no
    source at all ("digest of 0 memories"), which the derived step promises never
    to do (dropped when no source remains)."""
    v = ks.memories.put(VICTIM, ("m",), "k", "victim text")
    b = ks.memories.put("bob", ("m",), "b", "bob text")

    def digest(sources: list[object]) -> str:
        return f"digest of {len(sources)} memories"

    d = derive(
        ks,
        "bob",
        "d",
        [v.memory_id, b.memory_id],
        value="victim text digest",
        producer="dg",
        rebuild=digest,
    )
    e = derive(ks, "bob", "e", [d.memory_id], value="digest of d", producer="dg")
    try:
        ks.memories.update("bob", ("s",), "d", "cyclic", sources=[e.memory_id, v.memory_id])
    except KeyshredError:
        return  # refusing the cycle is a fix
    assert ks.erase(VICTIM, requested_by="dpo", reason="art17").state == "completed"
    got = ks.memories.get("bob", ("s",), "e")
    assert got is None or got.value != "digest of 0 memories", "rebuilt from no source"


def test_a_rebuild_never_runs_on_no_source_when_a_source_owner_is_suppressed(
    ks: Keyshred,
) -> None:
    """Carol's summary E of Bob's summary D of the victim's memory. Bob's own erasure
    has stopped after its suppress step (a crash, a manual_review). The victim's
    erasure leaves D to Bob's erasure, but counts D as a remaining source of E;
    ``_source_memories`` then skips D (its owner is suppressed) and the rebuild
    function runs on an empty list. Here it raises IndexError, which escapes
    ``ks.erase`` (only KeyshredError/OSError/SQLAlchemyError are caught) and leaves
    the request "propagating"; every resume raises it again."""
    calls: list[int] = []

    def first(sources: list[object]) -> str:
        calls.append(len(sources))
        return "summary: " + sources[0].value  # type: ignore[attr-defined]

    v = ks.memories.put(VICTIM, ("m",), "k", "victim text")
    b = ks.memories.put("bob", ("m",), "b", "bob text")
    d = derive(
        ks,
        "bob",
        "d",
        [v.memory_id, b.memory_id],
        kind="first",
        value="victim text",
        producer="first",
        rebuild=first,
    )
    derive(
        ks,
        "carol",
        "e",
        [d.memory_id],
        kind="first",
        value="summary: victim text",
        producer="first",
    )

    class Stop(Exception):
        pass

    def stop(step: str, req: object) -> None:
        if step == "suppress":
            raise Stop

    ks.erasure.on_step = stop
    with pytest.raises(Stop):
        ks.erase("bob", requested_by="dpo", reason="art17", request_id="rb")
    ks.erasure.on_step = None
    try:
        ks.erase(VICTIM, requested_by="dpo", reason="art17", request_id="rv")
    except KeyshredError:
        pass
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"{type(exc).__name__} escaped ks.erase; state {ks.erasure.status('rv').state}")
    assert 0 not in calls, "the rebuild function ran on no source"


@pytest.mark.parametrize("produced_from", [None, 5])
def test_register_refuses_sources_that_are_no_list(ks: Keyshred, produced_from: object) -> None:
    src = ks.memories.put("bob", ("m",), "b", "bob text")
    del src
    with pytest.raises(KeyshredError):
        ks.derived.register(
            "digest",
            subject="bob",
            namespace=("s",),
            key="d",
            value="v",
            produced_from=produced_from,  # type: ignore[arg-type]
            producer="p",
            producer_version="1",
        )


def test_register_with_an_iterator_of_sources_writes_nothing(ks: Keyshred) -> None:
    """``produced_from`` as a generator: the asset is stored, then the audit's
    ``len(produced_from)`` raises TypeError: no ``derived.registered`` event, the
    rebuild function not registered, and the caller told it failed."""
    src = ks.memories.put("bob", ("m",), "b", "bob text")
    try:
        ks.derived.register(
            "digest",
            subject="bob",
            namespace=("s",),
            key="d",
            value="v",
            produced_from=(s for s in [src.memory_id]),  # type: ignore[arg-type]
            producer="p",
            producer_version="1",
            rebuild=lambda sources: "rebuilt",
        )
    except KeyshredError:
        assert ks.memories.get("bob", ("s",), "d") is None, "refused, yet written"
    except Exception as exc:  # noqa: BLE001
        written = ks.memories.get("bob", ("s",), "d") is not None
        pytest.fail(f"{type(exc).__name__} (not a KeyshredError); asset written: {written}")


@pytest.mark.parametrize(
    "field", [{"kind": "k" * 30}, {"producer_version": "1" * 100}], ids=["kind", "version"]
)
def test_register_refuses_a_kind_or_version_wider_than_the_catalog(
    catalog_url: str, tmp_path: Path, field: dict[str, str]
) -> None:
    """safe() admits 128 characters; the catalog's kind column is String(32) (with
    "derived:" before it) and producer_version String(64): on PostgreSQL the write
    raises psycopg's StringDataRightTruncation; on SQLite it is stored."""
    with Keyshred.init(tmp_path / "data", make_config(catalog_url)) as store:
        b = store.memories.put("bob", ("m",), "b", "bob text")
        args: dict[str, str] = {"kind": "digest", "producer_version": "1", **field}
        try:
            store.derived.register(
                args["kind"],
                subject="bob",
                namespace=("s",),
                key="d",
                value="v",
                produced_from=[b.memory_id],
                producer="p",
                producer_version=args["producer_version"],
            )
        except KeyshredError:
            pass
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"{type(exc).__module__}.{type(exc).__name__}: not a KeyshredError")


# -- second review: what a waiting or slow request must still find ---------------------


def _join(sources: list[Any]) -> str:
    return "rebuilt: " + " | ".join(str(m.value) for m in sources)


def _retention_chain(ks: Keyshred, *, carol_producer: str = "later") -> tuple[str, str, str]:
    """The victim's memory expiring in 5 s, Bob's summary S of it and of his own
    memory (producer p1, registered), Carol's copy D of S (``carol_producer``).
    Returns (victim memory id, S id, D id)."""
    v, _b, s = _expiring_summary(ks, producer="p1", rebuild=_join)
    d = derive(
        ks,
        "carol",
        "t",
        [s.memory_id],
        kind="copy",
        namespace=("c",),
        value="carol's copy: summary of victim text",
        producer=carol_producer,
        rebuild=None if carol_producer == "later" else _join,
    )
    return v.memory_id, s.memory_id, d.memory_id


def _retention_run(ks: Keyshred) -> dict[str, Any]:
    report = ks.retention.run(now=datetime.now(UTC) + timedelta(seconds=30))
    [req] = report.requests
    return req


def test_a_version_corrected_after_its_sources_rebuild_goes_with_the_request(
    ks: Keyshred,
) -> None:
    """A retention request for the victim's expired memory rebuilds Bob's summary S
    and then waits in manual_review on Carol's copy D of S (her producer is not
    registered yet). Retention destroys no key, so D, still holding the expired
    victim text, stays readable; Carol corrects it. The superseded value (the
    expired victim text) becomes a history version H with D's sources ([S]). Once
    the producer is registered the resumed request completes, yet
    ``history()`` serves the victim's expired text for the version's whole
    retention. README: "Another subject's erasure removes the versions ... built
    from what it removes or rebuilds".

    Cause: ``_grown`` does find H (derived from S since the closure was listed),
    but ``_CleanSince.after`` judges it by its row's ``updated_us``: H was written
    after S's rebuild, so it counts as "built from the rebuilt value". A history
    version's value dates from the superseded row (its ``valid_from``), not from the
    write that moved it into the ``~`` history namespace."""
    _, _, _ = _retention_chain(ks)
    req = _retention_run(ks)
    assert req["state"] == "manual_review"
    assert ks.memories.get("carol", ("c",), "t").value == "carol's copy: summary of victim text"
    ks.memories.correct("carol", ("c",), "t", "carol's own corrected note", reason="fix")
    ks.derived.register_producer("later", "1", _join)
    assert ks.erasure.resume(req["request_id"]).state == "completed"
    leftover = [
        h for h in ks.memories.history("carol", ("c",), "t") if "victim text" in str(h["value"])
    ]
    assert not leftover, f"expired victim text still served by history(): {leftover}"


def test_a_copy_written_by_a_clock_ahead_still_goes_with_the_request(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Carol's copy D of Bob's summary S (which holds the victim's soon-expiring
    text) is written by a process whose clock runs ahead (here 5 seconds; any skew
    larger than the time between D's write and S's rebuild does it). The retention
    request for the expired memory lists D in its closure, rebuilds S, then leaves
    D alone: it completes with a signed receipt while D still serves the expired
    victim text. Before this change every closure asset built from a closure asset
    was rebuilt.

    Cause: ``_CleanSince.after`` compares ``updated_us`` of two rows of different
    partitions, each stamped by the clock of the process that wrote it
    (``_put_rows``: ``now_us = to_us(self._clock())``, taken before the lock, even
    before embedding). Wall clocks of two workers (or one stepped by NTP) do not
    order writes; in distributed mode they are different machines. Even with one
    clock, a row is stamped before the rebuild it may race with commits."""
    _v, _b, s = _expiring_summary(ks, producer="p1", rebuild=_join)
    real = ks.memories._clock
    monkeypatch.setattr(ks.memories, "_clock", lambda: real() + timedelta(seconds=5))
    derive(
        ks,
        "carol",
        "t",
        [s.memory_id],
        kind="copy",
        namespace=("c",),
        value="carol's copy: summary of victim text",
        producer="p2",
        rebuild=_join,
    )
    monkeypatch.setattr(ks.memories, "_clock", real)
    req = _retention_run(ks)
    assert req["state"] == "completed"
    assert "victim" not in str(ks.memories.get("bob", ("s",), "d").value)  # S was rebuilt
    got = ks.memories.get("carol", ("c",), "t")
    assert got is None or "victim text" not in str(got.value), (
        f"the completed retention request left Carol's copy: {got.value!r}"
    )


def test_a_copy_made_while_the_derived_step_runs_goes_with_the_request(ks: Keyshred) -> None:
    """A retention request for the victim's expired memory rebuilds Bob's summary S
    (its rebuild function is slow: an LLM call). While it runs, S still holds the
    expired victim text and is readable (retention destroys no key), and another
    worker of the application copies it into Carol's asset D. The request completes
    (signed receipt) and D keeps serving the expired victim text.

    Cause: ``DerivedStore.erase`` lists what was derived from the closure
    (``_grown``) once, before its loop; an asset derived from a closure asset
    after that listing but before that asset is rebuilt is never looked at, and
    ``verify`` checks only provenance naming *erased* ids (D names S, rebuilt). The
    new ``_grown`` covers a wait between runs, not the run itself."""
    [v] = ks.memories.put_many(
        VICTIM, [PutItem(("m",), "k", "victim text", ttl=timedelta(seconds=5))]
    )
    b = ks.memories.put("bob", ("m",), "b", "bob text")
    copied: list[str] = []

    def slow_rebuild(sources: list[Any]) -> str:
        # Meanwhile, elsewhere in the application: Carol's worker copies S.
        old = ks.memories.get("bob", ("s",), "d")
        d = derive(
            ks,
            "carol",
            "t",
            [old.memory_id],
            kind="copy",
            namespace=("c",),
            value=f"carol's copy: {old.value}",
            producer="p2",
            rebuild=_join,
        )
        copied.append(d.memory_id)
        return _join(sources)

    derive(
        ks,
        "bob",
        "d",
        [v.memory_id, b.memory_id],
        value="summary of victim text",
        producer="p1",
        rebuild=slow_rebuild,
    )
    req = _retention_run(ks)
    assert copied, "the copy was made during the derived step"
    assert req["state"] == "completed"
    got = ks.memories.get("carol", ("c",), "t")
    assert got is None or "victim text" not in str(got.value), (
        f"the completed retention request left Carol's copy: {got.value!r}"
    )


def test_touch_never_brings_back_an_expired_memory(ks: Keyshred) -> None:
    """A memory stored with a one-second TTL expires: every read hides it ("Reads
    hide a memory the moment its retain-until passes") and the next retention run
    is to remove it. ``touch`` with one day, before the sweep, gives it a new
    retain-until, and ``get`` serves the expired value again. README: "touch never
    extends a memory past the policy's maximum or the end of the consent it is
    stored under" - but it extends one past the retain-until it already reached.

    Cause: ``EditMixin.touch`` takes every row of the partition cache
    (``part.rows.get(part.lookup(ns, k))``) without checking ``row.retain_us``
    against now, unlike every read (``_row_once``) and now the derived step
    (``rows_by_id(live=True)``); the new cap (``_target``) is computed from *now*,
    so it does not stop it either."""
    import time

    ks.memories.put_many("ann", [PutItem(("m",), "k", "ann short-lived", ttl=timedelta(seconds=1))])
    time.sleep(1.2)
    assert ks.memories.get("ann", ("m",), "k") is None  # expired: hidden by every read
    ks.memories.touch("ann", [(("m",), "k")], timedelta(days=1))
    assert ks.memories.get("ann", ("m",), "k") is None, "touch resurrected an expired memory"


def test_a_failed_rebuild_is_not_claimed_for_the_holders_rewrite(
    ks: Keyshred,
) -> None:
    """The derived step records the intent "rebuilt" with the sources it rebuilds
    from ([Bob's memory]); the write then fails (the function returned a value that
    is no JSON), the request is left for a retry. Bob puts his own note at the
    summary's name, derived from his own memory (``sources=[b]``, what any holder
    rewriting a summary of that memory passes). The resumed erasure records
    "rebuilt" for the summary: the signed receipt says producer dg v1 rebuilt it,
    although the function's only run failed and Bob's note is what is stored.

    Cause: ``_landed`` claims a killed rebuild for any row that changed since the
    intent (``updated_us``) and whose sources equal the intent's. The sources are
    the asset's remaining sources, exactly what a holder deriving from the same
    memory names too: they do not identify the step's own write."""
    calls = {"n": 0}

    def rebuild(sources: list[Any]) -> Any:
        calls["n"] += 1
        return {1, 2}  # no JSON: the write after the intent fails

    _, b_id, s_id = victim_summary(ks, rebuild=rebuild)
    assert ks.erase(VICTIM, requested_by="dpo", reason="art17", request_id="r1").state != (
        "completed"
    )
    mine = ks.memories.put("bob", ("s",), "d", "bob's own note", sources=[b_id])
    assert mine.memory_id == s_id
    assert ks.erasure.resume("r1").state == "completed"
    assert calls["n"] == 1, "the rebuild function ran once, and failed"
    assert ks.memories.get("bob", ("s",), "d").value == "bob's own note"
    receipt = ks.erasure.receipt("r1")
    assert receipt is not None
    claimed = [d for d in receipt.derived if d.asset_id == s_id and d.action == "rebuilt"]
    assert not claimed, "the receipt claims a rebuild that never wrote"


# -- third review: cycles, expired assets, a holder writing during a rebuild, residue --


def _expiring_victim_memory(ks: Keyshred) -> str:
    [v] = ks.memories.put_many(
        VICTIM, [PutItem(("m",), "k", "victim text", ttl=timedelta(seconds=5))]
    )
    return v.memory_id


def _all_values(ks: Keyshred, subject: str, names: list[tuple[tuple[str, ...], str]]) -> str:
    out = []
    for ns, k in names:
        got = ks.memories.get(subject, ns, k)
        if got is not None:
            out.append(str(got.value))
        out.extend(str(h["value"]) for h in ks.memories.history(subject, ns, k))
    return "\n".join(out)


def test_a_retention_rebuild_of_a_provenance_cycle_keeps_no_expired_text(ks: Keyshred) -> None:
    """Bob's digest D is built from the victim's memory (expiring) and his own; his
    digest E is built from D; Bob then re-derives D from E too (``update(...,
    sources=[E, v, b])``: the API accepts it, the README says a cycle is possible).
    The retention request for the victim's expired memory completes (signed receipt
    of kind retention) while D and E still serve the expired victim text.

    Cause: ``sources_first`` keeps a cycle's found order and ``DerivedStore``
    rebuilds its first asset "from what can be read then, the opaque one not
    counted". That reasoning holds only for a subject erasure (the cycle's rows are
    opaque, their key destroyed). A retention request destroys no key: the cycle's
    other asset, not rebuilt yet, is readable (``_readable_sources``, live rows),
    so the first rebuild is fed its old value, which still holds the expired
    text; the second is rebuilt from the first. Each asset is acted on once
    (``seen``), so nothing takes the text out again. The step's verify only checks
    that no provenance names an *erased* id."""
    v = _expiring_victim_memory(ks)
    b = ks.memories.put("bob", ("m",), "b", "bob text")
    d = derive(
        ks, "bob", "d", [v, b.memory_id], value="digest: victim text", producer="dg", rebuild=_join
    )
    e = derive(ks, "bob", "e", [d.memory_id], value="digest of d: victim text", producer="dg")
    ks.memories.update(
        "bob", ("s",), "d", "digest: victim text", sources=[e.memory_id, v, b.memory_id]
    )
    req = _retention_run(ks)
    assert req["state"] == "completed"
    left = _all_values(ks, "bob", [(("s",), "d"), (("s",), "e")])
    assert "victim text" not in left, f"expired victim text outlived the request:\n{left}"


def test_a_retention_rebuild_of_a_self_derived_asset_keeps_no_expired_text(
    ks: Keyshred,
) -> None:
    """The smallest cycle: Bob re-derives his digest D from itself and its sources
    (``update(..., sources=[D, v, b])``, accepted: D is in the catalog). The
    retention request for the victim's expired memory rebuilds D *from D*, whose
    old value holds the expired text, and completes: the text is in the rebuilt
    value, under a fresh retention.

    Cause: as for the two-asset cycle: ``_readable_sources`` counts the asset being
    rebuilt as one of its own remaining sources (a retention request destroys no
    key, so its old row is readable)."""
    v = _expiring_victim_memory(ks)
    b = ks.memories.put("bob", ("m",), "b", "bob text")
    d = derive(
        ks, "bob", "d", [v, b.memory_id], value="digest: victim text", producer="dg", rebuild=_join
    )
    ks.memories.update(
        "bob", ("s",), "d", "digest: victim text", sources=[d.memory_id, v, b.memory_id]
    )
    req = _retention_run(ks)
    assert req["state"] == "completed"
    left = _all_values(ks, "bob", [(("s",), "d")])
    assert "victim text" not in left, f"expired victim text outlived the request:\n{left}"


@pytest.mark.parametrize("how", ["put", "update", "register"])
def test_duplicate_source_ids_are_one_source(ks: Keyshred, how: str) -> None:
    """A source id listed twice (``sources=[b, b]``, easily made by an application
    collecting the memories a summary read) makes ``put``, ``update`` and
    ``ks.derived.register`` raise ``sqlite3.IntegrityError`` (UNIQUE constraint
    failed: ks_asset_sources) out of the public API: no ``KeyshredError``, and the
    driver's message names the catalog's tables.

    Cause: ``_put_rows`` checks each source (a non-empty str) and the catalog
    inserts one ``ks_asset_sources`` row per listed id; nothing removes or refuses
    duplicates (mentions are deduplicated with a set, sources are not)."""
    b = ks.memories.put("bob", ("m",), "b", "bob text")
    ks.memories.put("bob", ("n",), "q", "x", sources=[b.memory_id])
    twice = [b.memory_id, b.memory_id]
    try:
        if how == "put":
            ks.memories.put("bob", ("n",), "p", "x", sources=twice)
        elif how == "update":
            ks.memories.update("bob", ("n",), "q", "y", sources=twice)
        else:
            derive(ks, "bob", "d", twice, value="v", producer="p")
    except KeyshredError:
        pass
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"{type(exc).__module__}.{type(exc).__name__}: not a KeyshredError")


def test_an_expired_derived_asset_is_dropped_not_renewed(
    ks: Keyshred,
) -> None:
    """Bob gives his digest one second (``touch``); it expires and every read hides
    it ("Reads hide a memory the moment its retain-until passes"), waiting for the
    next retention sweep. The victim's erasure then rebuilds it: ``get`` serves the
    digest again, with a retain-until ten years away (the policy's default), not
    the one Bob gave it.

    Cause: ``DerivedStore._act`` reads the asset's row with
    ``rows_by_id(..., opaque=True)`` (no ``live=True``) and never compares its
    ``retain_us`` with now; ``memories.rebuild`` then writes through ``_put_rows``
    without ``kept`` (no ``Kept(retain_us=row.retain_us)``), so the retention is
    computed afresh from the policy. The last commit made ``touch`` and the rebuild's
    *sources* respect retain-until; the rebuilt asset itself does not."""
    victim_summary(ks, rebuild=_join)
    assert ks.memories.touch("bob", [(("s",), "d")], timedelta(seconds=1)) == 1
    import time

    time.sleep(1.3)
    assert ks.memories.get("bob", ("s",), "d") is None  # expired: gone for every read
    assert ks.erase(VICTIM, requested_by="dpo", reason="art17").state == "completed"
    got = ks.memories.get("bob", ("s",), "d")
    assert got is None, (
        f"the erasure brought back an expired memory: {got.value!r} until {got.retain_until}"
    )


def test_a_bystanders_ended_consent_drops_the_asset_not_the_erasure(ks: Keyshred) -> None:
    """Bob's digest of the victim's memory (and of his own) is stored in a scope
    that needs consent; Bob's consent ends (its retain-until is the consent's end,
    so the digest is expired and hidden by every read). The victim's erasure
    cannot finish: its derived step raises ``ConsentRequired`` and the request is
    ``retryable_failure`` (then ``manual_review``), no receipt, although the
    digest was already unreadable and due for deletion.

    Cause: as in the previous test, ``_act`` rebuilds an expired row; the rebuild
    goes through ``_put_rows`` -> ``_target``, which looks up an active consent of
    the *holder* and finds none. The victim's request depends on a bystander's
    consent and on when the next retention run happens."""
    end = datetime.now(UTC) + timedelta(seconds=2)
    ks.consent.grant("bob", scope="support/health", category="health", end_at=end)
    victim_summary(ks, rebuild=_join, scope="support/health")
    import time

    time.sleep(2.3)
    assert ks.memories.get("bob", ("s",), "d") is None  # expired with the consent
    req = ks.erase(VICTIM, requested_by="dpo", reason="art17", request_id="r1")
    assert req.state == "completed", f"{req.state}: {ks.erasure.status('r1').error}"


def test_a_rebuild_whose_flush_failed_leaves_no_expired_text_on_disk(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retention request for the victim's expired memory rebuilds Bob's digest.
    The rebuild's catalog transaction commits, then the flush that takes the
    previous version out of the live files fails (here ``OSError`` ENOSPC; a
    SIGKILL between the commit and the flush does the same). The request is
    retried: the resumed derived step sees the rebuilt row, records "rebuilt"
    (``_landed``) and completes with a signed receipt, yet the previous version,
    with the expired victim text, is still a hot log record of Bob's partition in
    the catalog, under Bob's live key: ``ks.erasure.residue_scan`` finds it
    (``catalog/catalog.db``, ``memory_log_record``, decrypted; no hit without the
    fault).

    Cause: ``EditMixin.rebuild`` flushes after ``_put_rows`` committed ("the previous
    version leaves the live files at once ... rebuilding is how its data leaves this
    asset": a retention request destroys no key). When the flush does not happen,
    ``DerivedStore._act`` -> ``_landed(intent, "rebuilt", row)`` accepts the row as
    done and nothing flushes the partition again; the text stays until some later
    flush or compaction of Bob's partition (``flush_records`` writes away)."""
    from keyshred.storage import memory_edit
    from keyshred.storage.partition import Partition

    _v, _b, _ = _expiring_summary(ks, producer="dg", rebuild=_join, text="victimsecretxyz text")
    armed = {"on": False}
    flush, rebuild = Partition.flush, memory_edit.EditMixin.rebuild

    def failing_flush(self: Any, *a: Any, **k: Any) -> Any:
        if armed["on"]:
            armed["on"] = False
            raise OSError(28, "No space left on device")
        return flush(self, *a, **k)

    def arming_rebuild(self: Any, *a: Any, **k: Any) -> Any:
        armed["on"] = True
        return rebuild(self, *a, **k)

    monkeypatch.setattr(Partition, "flush", failing_flush)
    monkeypatch.setattr(memory_edit.EditMixin, "rebuild", arming_rebuild)
    req = _retention_run(ks)
    assert req["state"] != "completed"  # the failed flush: retried
    monkeypatch.setattr(memory_edit.EditMixin, "rebuild", rebuild)
    assert ks.erasure.resume(req["request_id"]).state == "completed"
    assert "victimsecretxyz" not in str(ks.memories.get("bob", ("s",), "d").value)
    report = ks.erasure.residue_scan(["victimsecretxyz"], [ks.path])
    assert not report.hits, f"expired text left in the live files: {report.hits}"


@pytest.mark.parametrize("mode", ["retention-update", "erasure-put", "erasure-put-drop"])
def test_a_holders_write_during_a_slow_rebuild_is_kept(ks: Keyshred, mode: str) -> None:
    """While the derived step runs the (slow: an LLM call) rebuild function of Bob's
    digest, Bob writes the digest's name himself: a retention request's digest is
    readable, and Bob rewrites it from his own memory only (``update(...,
    sources=[b])``); under a subject erasure it is opaque, and Bob puts a note of
    his own over it (``put``, no source, no mention). When the function returns,
    the step writes its rebuilt value over Bob's new one (or, when the function
    returns ``None``, deletes it): Bob's write, which holds nothing of the victim and
    names no closure asset, is lost without a trace (not even as a history version).

    Cause: ``DerivedStore._rebuild_one`` decides from the row read before the
    function ran, then ``memories.rebuild`` writes through ``_put_rows`` without
    ``unchanged=`` (the guard ``correct`` uses) and ``delete_by_id`` deletes
    whatever row has that id. The class docstring's rule (decide "from its row as
    it is *now*"; a holder's new memory at the asset's name is left alone) holds
    between runs, not across the function's run."""
    if mode == "retention-update":
        v = _expiring_victim_memory(ks)
    else:
        v = ks.memories.put(VICTIM, ("m",), "k", "victim text").memory_id
    b = ks.memories.put("bob", ("m",), "b", "bob text")

    def slow(sources: list[Any]) -> str | None:
        # Meanwhile, elsewhere in the application: Bob rewrites his digest.
        if mode == "retention-update":
            ks.memories.update("bob", ("s",), "d", "bob's own new text", sources=[b.memory_id])
        else:
            ks.memories.put("bob", ("s",), "d", "bob's own new text")
        return None if mode.endswith("drop") else _join(sources)

    derive(
        ks,
        "bob",
        "d",
        [v, b.memory_id],
        value="summary of victim text",
        producer="dg",
        rebuild=slow,
    )
    if mode == "retention-update":
        assert _retention_run(ks)["state"] == "completed"
    else:
        assert ks.erase(VICTIM, requested_by="dpo", reason="art17").state == "completed"
    got = ks.memories.get("bob", ("s",), "d")
    assert got is not None and got.value == "bob's own new text", (
        f"Bob's own write was overwritten by the erasure: {got and got.value!r}"
    )


def test_a_closure_asset_rewritten_during_the_wait_leaves_no_expired_text_on_disk(
    ks: Keyshred,
) -> None:
    """A retention request for the victim's expired memory waits in manual_review
    (the producer of Bob's digest is not registered yet). Bob rewrites the digest
    from his own memory only (``update(..., sources=[b])``). Resumed, the request
    rightly leaves Bob's new value alone and completes with a signed receipt, but
    the digest's previous value, with the expired victim text, is still a hot log
    record of Bob's partition under Bob's live key: ``residue_scan`` finds it.

    Cause: a retention request destroys no key: removing the data physically is
    the whole removal. For the assets it rebuilds, ``EditMixin.rebuild`` flushes the
    partition so that "the previous version leaves the live files at once"; an
    asset ``_act`` leaves alone (``_touches`` false, a holder's rewrite) gets no
    flush, and the superseded record stays until some later flush or compaction of
    that partition."""
    _v, b, _ = _expiring_summary(ks, producer="later", text="victimsecretxyz text")
    req = _retention_run(ks)
    assert req["state"] == "manual_review"
    ks.memories.update("bob", ("s",), "d", "bob's own new text", sources=[b.memory_id])
    ks.derived.register_producer("later", "1", _join)
    assert ks.erasure.resume(req["request_id"]).state == "completed"
    assert ks.memories.get("bob", ("s",), "d").value == "bob's own new text"
    report = ks.erasure.residue_scan(["victimsecretxyz"], [ks.path])
    assert not report.hits, f"expired text left in the live files: {report.hits}"


# -- fourth review: purges that must run, resumed requests, duplicate sources ------------


def _probe_digest(
    ks: Keyshred, holder: str, v: str, *, producer: str = "dg", rebuild: Any = clean_rebuild
) -> str:
    own = ks.memories.put(holder, ("m",), "own", f"{holder} text")
    d = derive(
        ks,
        holder,
        "d",
        [v, own.memory_id],
        value=f"summary of {PROBE} text",
        producer=producer,
        rebuild=rebuild,
    )
    return d.memory_id


def _hits_in(ks: Keyshred, subject: str) -> list[Any]:
    prefix = f"subject={ks.memories._ref(subject)}/"
    report = ks.erasure.residue_scan([PROBE], [ks.path])
    return [h for h in report.hits if prefix in h.path]


@SEGMENTS  # Bob's segment files are what is scanned
def test_a_retention_rebuild_leaves_no_old_segment_on_disk(ks: Keyshred) -> None:
    """Bob's digest of the victim's expiring memory sits in a flushed Parquet
    segment of Bob's partition (any flush does it: ``close()``, the flush
    threshold, a compaction). The retention request for the expired memory
    rebuilds the digest and completes with a receipt, yet Bob's *previous*
    segment, holding the expired victim text under Bob's live key, is still on
    disk: ``residue_scan`` decrypts it (``memory_segment``, layer ``decrypted``).
    README: "A request that destroyed no key (retention, a scope) rewrites the
    holders' partitions without the superseded values before it is done".

    Cause: ``EditMixin.rebuild`` flushes with ``purge=False``, so the old segment
    is only *retired* (deleted after ``retired_grace_seconds``, 300 s by
    default, and only by a later cleanup). The new ``purge_superseded`` then calls
    ``Partition.flush(purge=True)``, which returns at once when nothing is dirty
    (``if not self._dirty and head.next_seq == head.base_seq: return``) - and the
    rebuild's own flush just left nothing dirty - so ``_cleanup(purge=True)``
    never runs. Same for a scope erasure, and for a holder's rewrite flushed
    during a wait (a restart's ``close()`` flushes). The purge is a no-op exactly
    when it is needed."""
    v = expiring_probe_memory(ks)
    _probe_digest(ks, "bob", v)
    ks.memories.flush()  # the digest is in a segment, as after any restart
    assert _hits_in(ks, "bob"), "the probe is planted in Bob's segment"
    req = _retention_run(ks)
    assert req["state"] == "completed"
    assert PROBE not in str(ks.memories.get("bob", ("s",), "d").value)  # rebuilt
    hits = _hits_in(ks, "bob")
    assert not hits, f"expired victim text still decryptable in Bob's files: {hits}"


def test_a_resumed_request_purges_holders_acted_on_before(ks: Keyshred) -> None:
    """A retention request rebuilds Bob's digest (producer registered), then stops
    in ``manual_review`` on Carol's digest (producer not registered yet). Once it
    is registered, the resumed request rebuilds Carol's digest and completes; but
    Bob's partition is never purged: his previous segment with the expired victim
    text is still decryptable on disk after the "completed" receipt.

    Cause: ``DerivedStore.erase`` builds ``holders`` (the partitions it purges at
    the end) only from the assets ``_act`` handles *in this run*; assets already
    in ``target.done`` (``handled``/``seen``) are skipped, so their holders are
    never purged by any run. Independent of the early return of the previous
    test: fixing only ``purge_superseded`` leaves Bob out of ``holders``."""
    v = expiring_probe_memory(ks)
    _probe_digest(ks, "bob", v)
    _probe_digest(ks, "carol", v, producer="later", rebuild=None)
    ks.memories.flush()
    req = _retention_run(ks)
    assert req["state"] == "manual_review"
    assert PROBE not in str(ks.memories.get("bob", ("s",), "d").value)  # rebuilt in run 1
    ks.derived.register_producer("later", "1", clean_rebuild)
    assert ks.erasure.resume(req["request_id"]).state == "completed"
    hits = _hits_in(ks, "bob")
    assert not hits, f"expired victim text still decryptable in Bob's files: {hits}"


def test_register_audits_the_sources_stored(ks: Keyshred) -> None:
    """``ks.derived.register(..., produced_from=[b, b])`` now stores one provenance
    edge (``_put_rows`` deduplicates), but the ``derived.registered`` audit event
    says ``sources: 2``: the tamper-evident audit trail records a provenance the
    catalog never held (and disagrees with exports and ``catalog.asset``).

    Cause: ``DerivedApi.register`` audits ``len(sources)`` of the caller's list;
    the dedup happens later, inside ``_put_rows``."""
    b = ks.memories.put("bob", ("m",), "b", "bob text")
    m = derive(ks, "bob", "d", [b.memory_id, b.memory_id], value="v", producer="p")
    stored = ks.catalog.asset(m.memory_id).sources
    [event] = [
        e for e in ks.audit.events(event="derived.registered") if e.data["asset_id"] == m.memory_id
    ]
    assert event.data["sources"] == len(stored), (
        f"audit says {event.data['sources']} sources, the catalog holds {len(stored)}"
    )


def test_a_retention_rebuild_of_many_assets_compacts_the_holder_once(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One expiring memory of the victim feeds N digests of one holder. The
    retention request rebuilds them one by one, and each ``EditMixin.rebuild``
    flushes (compacts) the holder's whole partition: N compactions, each writing
    every row of the scope's segment again - O(N x partition size), quadratic
    for a holder with many derived assets (10k digests: 10k rewrites of a 10k-row
    segment). The new end-of-request ``purge_superseded`` (one per holder) makes
    the per-asset flush redundant for a request that destroys no key. (Also
    quadratic, smaller: ``unread=inside - seen`` builds a fresh set of the
    closure's size for every asset.) A dropped asset still costs a purge of its
    own (``delete_by_id``: "deleted" means the bytes are gone at once)."""
    v = expiring_probe_memory(ks)
    b = ks.memories.put("bob", ("m",), "b", "bob text").memory_id
    n = 30
    for i in range(n):
        derive(
            ks,
            "bob",
            f"d{i}",
            [v, b],
            value=f"summary {i} of victim",
            producer="dg",
            rebuild=lambda sources: "rebuilt",
        )
    ks.memories.flush()
    calls: Counter[str] = Counter()
    flush = Partition.flush
    bob = ks.memories._ref("bob")

    def counting(self: Partition, **kw: Any) -> None:
        if self.subject_ref == bob:
            calls["flush"] += 1
        return flush(self, **kw)

    monkeypatch.setattr(Partition, "flush", counting)
    assert _retention_run(ks)["state"] == "completed"
    assert calls["flush"] <= 3, f"{calls['flush']} compactions of Bob's partition for {n} rebuilds"


def test_a_rebuild_functions_exception_leaves_no_plaintext_anywhere(
    ks: Keyshred, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """The application's rebuild function raises with the value it was given in its
    message: the request fails with ``RebuildFailed`` naming the type only (no
    message, no chained exception), and no log line or file of the data folder
    (catalog, request documents, audit) holds the text in the clear."""
    probe = "probe-7f3a-rebuild-secret"
    v = ks.memories.put(VICTIM, ("m",), "k", "victim text")
    b = ks.memories.put("bob", ("m",), "b", f"{probe} bob text")

    def leaky(sources: list[Any]) -> Any:
        raise ValueError(" | ".join(str(m.value) for m in sources))

    derive(ks, "bob", "d", [v.memory_id, b.memory_id], value="x", producer="leaky", rebuild=leaky)
    req = ks.erase(VICTIM, requested_by="dpo", reason="art17", request_id="leak")
    assert req.state != "completed"
    status = ks.erasure.status("leak")
    assert "RebuildFailed" in str(status.error) and probe not in str(status.error)
    with pytest.raises(RebuildFailed) as raised:
        _run(leaky, [ks.memories.get("bob", ("m",), "b")], ks.catalog.asset(b.memory_id))  # type: ignore[list-item, arg-type]
    assert probe not in str(raised.value) and raised.value.exception_type == "ValueError"
    assert raised.value.__context__ is None and raised.value.__cause__ is None
    ks.close()
    out, err = capfd.readouterr()
    assert probe not in out + err + caplog.text
    for path in (p for p in ks.path.rglob("*") if p.is_file()):
        assert probe.encode() not in path.read_bytes(), path


def test_an_asset_dropped_before_its_record_failed_is_in_the_receipt(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Carol's copy of Bob's summary, made while a retention request waited, is
    found only by the derived step's new walk (``_grown``), never by the closure.
    Its drop lands (catalog row and provenance edges gone) and the record of that
    action fails (the catalog unreachable for that one write): only its intent is
    recorded. The resumed step walked the provenance again, found no edge to the
    copy any more and never looked at its intent: the receipt left the drop out.
    (Found by the review of revision 0014.)"""
    from keyshred.erasure import items

    rid, s_id = _expired_victim_memory_in_manual_review(ks)
    c = derive(
        ks,
        "carol",
        "t",
        [s_id],
        kind="copy",
        namespace=("c",),
        value="carol's copy",
        producer="dropper",
        rebuild=lambda sources: None,  # its producer drops what it cannot rebuild
    )
    ks.derived.register_producer("later", "1", lambda sources: "rebuilt without victim")
    put_entry = items.put_entry

    def failing(conn: Any, request_id: str, step: str, item: str, **kw: Any) -> None:
        if item == c.memory_id and "action" in kw["entry"]:
            raise OSError("the catalog went away")
        put_entry(conn, request_id, step, item, **kw)

    monkeypatch.setattr(items, "put_entry", failing)
    assert ks.erasure.resume(rid).state != "completed"
    assert ks.catalog.asset(c.memory_id) is None  # the drop landed
    monkeypatch.setattr(items, "put_entry", put_entry)
    assert ks.erasure.resume(rid).state == "completed"
    receipt = ks.erasure.receipt(rid)
    assert receipt is not None
    assert (c.memory_id, "dropped") in [(d.asset_id, d.action) for d in receipt.derived]


# -- drops: one purge per holder ---------------------------------------------------------


def _count_flushes(monkeypatch: pytest.MonkeyPatch, ref: str) -> Counter[str]:
    calls: Counter[str] = Counter()
    flush = Partition.flush

    def counting(self: Partition, **kw: Any) -> None:
        if self.subject_ref == ref:
            calls["flush"] += 1
        return flush(self, **kw)

    monkeypatch.setattr(Partition, "flush", counting)
    return calls


@SEGMENTS  # Bob's segment files are what is scanned
@pytest.mark.parametrize("request_kind", ["retention", "erasure"])
def test_many_drops_of_one_holder_compact_it_once_and_leave_no_text(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch, request_kind: str
) -> None:
    """Bob holds N digests made from the victim's memory alone: an erasure (or a
    retention request for the memory) drops each. Each drop was a
    ``delete_by_id`` that rewrote Bob's whole partition at once ("deleted" means
    the bytes are gone): N compactions of a partition of N+ rows, quadratic in
    the holder's derived assets, where the rebuilds already shared one purge per
    holder at the step's end. An erasure's drops (opaque rows: the victim
    co-owned their key) now leave the rewrite to that purge; a retention
    request's (readable rows: no key destroyed) still rewrite at once, so that no
    failure later in the step leaves them decryptable. Either way none of the
    digests' text is decryptable in Bob's files at completion."""
    v = expiring_probe_memory(ks)
    n = 30
    for i in range(n):
        derive(ks, "bob", f"d{i}", [v], value=f"digest {i} of {PROBE} text", producer="dg")
    ks.memories.put("bob", ("m",), "own", "bob's own text")
    ks.memories.flush()  # the digests sit in a segment, as after any restart
    assert _hits_in(ks, "bob"), "the probe is planted in Bob's segment"
    calls = _count_flushes(monkeypatch, ks.memories._ref("bob"))
    if request_kind == "retention":
        state = _retention_run(ks)["state"]
    else:
        state = ks.erase(VICTIM, requested_by="dpo", reason="art17").state
    assert state == "completed"
    if request_kind == "erasure":
        assert calls["flush"] <= 3, f"{calls['flush']} compactions of Bob's partition, {n} drops"
    assert ks.memories.get("bob", ("m",), "own").value == "bob's own text"
    assert all(ks.memories.get("bob", ("s",), f"d{i}") is None for i in range(n))
    hits = _hits_in(ks, "bob")
    assert not hits, f"a dropped digest's text is still decryptable in Bob's files: {hits}"


@SEGMENTS  # Bob's segment files are what is scanned
def test_a_request_waiting_for_a_producer_leaves_no_dropped_text_on_disk(ks: Keyshred) -> None:
    """A retention request drops Bob's digest of the victim's expired memory
    (made from it alone), then stops in ``manual_review`` on Carol's digest (its
    producer not registered yet). The wait may last days: the dropped digest's
    text must not stay decryptable in Bob's files meanwhile, although the step's
    one purge per holder comes at its end, which this run never reaches."""
    v = expiring_probe_memory(ks)
    derive(ks, "bob", "d", [v], value=f"digest of {PROBE} text", producer="dg")
    _probe_digest(ks, "carol", v, producer="later", rebuild=None)
    ks.memories.flush()
    assert _hits_in(ks, "bob")
    req = _retention_run(ks)
    assert req["state"] == "manual_review"
    assert ks.memories.get("bob", ("s",), "d") is None  # dropped before the stop
    hits = _hits_in(ks, "bob")
    assert not hits, f"the dropped digest's text is still decryptable in Bob's files: {hits}"
    ks.derived.register_producer("later", "1", clean_rebuild)
    assert ks.erasure.resume(req["request_id"]).state == "completed"
    assert not _hits_in(ks, "carol") and not _hits_in(ks, "bob")


# -- the catalog's WAL ------------------------------------------------------------------


def _sealed_hot_records(ks: Keyshred) -> list[bytes]:
    """The sealed values of the catalog's hot records, as stored."""
    with ks.catalog.engine.connect() as conn:
        rows = conn.exec_driver_sql("SELECT * FROM ks_mem_hot").fetchall()
    return [bytes(c) for r in rows for c in r if isinstance(c, bytes | memoryview) and len(c) > 40]


def test_a_completed_retention_request_leaves_no_sealed_copy_in_the_catalogs_wal(
    ks: Keyshred,
) -> None:
    """A retention request deletes the expired memory's hot record (``secure_delete``
    zeroes its page in ``catalog.db``), but the commits that wrote it left page
    images holding its sealed value in ``catalog.db-wal``, which SQLite reuses
    without clearing: after the "completed" receipt the expired text was still
    there, sealed under the subject's live key (retention destroys no key;
    ``residue_scan`` reads no WAL). The erasures that drop vectors or threads
    scrubbed the WAL; a request's verify step now does, for every kind."""
    ks.memories.put(VICTIM, ("m",), "keep", "a memory that stays")
    [expiring] = ks.memories.put_many(
        VICTIM, [PutItem(("m",), "k", f"{PROBE} text", ttl=timedelta(seconds=5))]
    )
    sealed = _sealed_hot_records(ks)
    assert len(sealed) == 2
    wal = ks.path / "catalog" / "catalog.db-wal"
    assert all(s[-48:] in wal.read_bytes() for s in sealed)  # both written through the WAL
    assert _retention_run(ks)["state"] == "completed"
    assert ks.memories.get(VICTIM, ("m",), "k") is None
    live = _sealed_hot_records(ks)
    gone = [s for s in sealed if s not in live]
    assert gone, "the expired memory's hot record is gone from the catalog"
    for path in ks.path.rglob("*"):
        if path.is_file():
            raw = path.read_bytes()
            assert not any(s[-48:] in raw for s in gone), f"expired sealed value in {path.name}"
    assert expiring.memory_id
