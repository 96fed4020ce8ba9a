"""Fresh-eyes review of a42939e / cf21e68 / 60b4422: erasure-guard sequences that
still leave a subject readable/writable, or make a receipt claim work it did not do.

Each test asserted the correct behaviour and failed on 1b130b5 (2026-12-07); all
pass since the fixes (readmit refused while an erasure is under way; a request's
tombstone found by its own derived id; a request that found nothing lifts no other
request's suppression)."""

from __future__ import annotations

import pytest

from keyshred import Keyshred
from keyshred.errors import SubjectSuppressed


def _stop_after_first_step() -> object:
    """A ``stop`` for ``ks.erasure.run`` that lets exactly one step (``suppress``)
    run: the request is left suppressed and resumable, as a worker killed or stopped
    between steps (or a request waiting on a legal hold) leaves it."""
    calls = {"n": 0}

    def stop() -> bool:
        calls["n"] += 1
        return calls["n"] > 1

    return stop


def _keys_destroyed(ks: Keyshred, request_id: str) -> int:
    receipt = ks.erasure.receipt(request_id)
    assert receipt is not None
    return next(s.count for s in receipt.stores if s.store == "keyring")


def test_readmit_during_a_pending_erasure_does_not_unsuppress_old_data(ks: Keyshred) -> None:
    """DEFECT (medium). ``ks.erasure.readmit`` ("let an *erased* subject return")
    sets the guard to ``active`` whatever it is: called while an erasure of the
    subject is under way (suppressed, keys not yet destroyed: a stopped/killed
    worker, a retryable KEK failure, a hold placed after suppression), it lifts the
    suppression and the subject's OLD data reads back (and new writes are accepted)
    until the request is resumed. README: "from the moment this call reaches the
    catalog, every read and write of the subject fails". The guard change added
    ``set_guard(only_from=...)`` but readmit does not use it.
    Cause: keyshred/erasure/holds.py ``readmit`` (~line 150):
    ``self._catalog.set_guard(ref, ACTIVE)`` with no ``only_from=ERASED``."""
    ks.memories.put("x1", ("p",), "k", {"secret": "old value"})
    req = ks.erasure.submit("x1", requested_by="dpo", reason="art17")
    ran = ks.erasure.run(req.request_id, stop=_stop_after_first_step())  # type: ignore[arg-type]
    assert ran.state == "suppressed"
    with pytest.raises(SubjectSuppressed):
        ks.memories.get("x1", ("p",), "k")
    with pytest.raises(SubjectSuppressed):  # refused: the subject is not erased yet
        ks.erasure.readmit("x1")
    with pytest.raises(SubjectSuppressed):
        ks.memories.get("x1", ("p",), "k")  # currently returns the old memory


def test_an_erasure_that_found_nothing_does_not_lift_another_pending_erasure(
    ks: Keyshred,
) -> None:
    """DEFECT (low). ``Extent.finish(found=False)`` now re-activates only from
    ``suppressed``, but it cannot tell whose suppression that is: request A (no
    block) and request B (``block=True``) of the same id; B has suppressed and is
    pending (stopped between steps, or in legal_hold); A finds nothing and sets
    the guard ``active`` under B. Until B resumes, the id B asked to block takes
    reads and writes (what is written then is destroyed by B's sweep later: silent
    loss of data accepted in good faith), contrary to "a blocked id stays erased".
    Cause: keyshred/erasure/extent.py ``Extent.finish`` (~line 280)
    ``set_guard(ACTIVE, only_from=SUPPRESSED)`` with no check for other requests
    of the subject still under way (e.g. suppressed by a later epoch / unsettled
    requests of the same subject_ref)."""
    a = ks.erasure.submit("ghost", requested_by="dpo", reason="art17")
    b = ks.erasure.submit("ghost", requested_by="dpo", reason="art17", block=True)
    assert ks.erasure.run(b.request_id, stop=_stop_after_first_step()).state == "suppressed"  # type: ignore[arg-type]
    done = ks.erasure.run(a.request_id)
    assert done.state == "completed" and done.found_data is False
    # B (block=True) is still pending: the id must stay refused.
    with pytest.raises(SubjectSuppressed):
        ks.memories.put("ghost", ("p",), "k", {"v": 1})
    assert ks.erasure.run(b.request_id).state == "completed"
    with pytest.raises(SubjectSuppressed):
        ks.memories.put("ghost", ("p",), "k", {"v": 1})


def test_erasure_after_readmission_does_not_claim_the_earlier_erasures_keys(
    ks: Keyshred,
) -> None:
    """DEFECT (medium). A subject erased, re-admitted, who stores nothing more, is
    erased again: the second request destroys nothing, yet its SIGNED receipt says
    ``keyring keys-destroyed count=N`` (the first request's keys, at the first
    request's time) and ``found_data`` True, so the id is blocked again instead of
    being left free (README: an erasure that finds nothing says so and leaves the
    id free). Two concurrent erasures of one subject likewise both claim the same
    keys. Cause: keyshred/erasure/extent.py ``Extent.destroy_keys`` (~lines 178-187):
    "resumed after the keys were already destroyed: take the tombstone's" takes the
    subject's LAST tombstone, whoever made it, not one this request made (e.g. one
    erased at or after ``req.created_at`` / recorded by this request)."""
    ks.memories.put("dana", ("p",), "k", {"v": "first life"})
    first = ks.erase("dana", requested_by="dpo", reason="art17")
    assert first.found_data is True and _keys_destroyed(ks, first.request_id) > 0
    ks.erasure.readmit("dana")
    again = ks.erase("dana", requested_by="dpo", reason="art17-again")
    assert again.state == "completed"
    assert _keys_destroyed(ks, again.request_id) == 0  # currently the first one's count
    assert again.found_data is False
    ks.memories.put("dana", ("p",), "k", {"v": "second life"})  # the id was left free
