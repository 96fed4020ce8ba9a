"""Attacks on the owner-set keys of issue 19 (races between a write about a subject
and that subject's erasure): each test reproduces a way data about an erased subject
stayed readable with the live keyring, and checks it no longer does."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keyshred import Keyshred
from keyshred.errors import NotFound, SubjectSuppressed
from tests.storage.conftest import make_config
from tests.storage.test_owner_keys import decrypt_partition_files
from tests.storage.test_vectors import bag_of_words


@pytest.fixture
def ks(catalog_url: str, tmp_path: Path) -> Iterator[Keyshred]:
    store = Keyshred.init(tmp_path / "data", make_config(catalog_url), embeddings=bag_of_words)
    yield store
    store.close()


def test_a_key_made_after_the_whole_erasure_seals_nothing_about_the_subject(
    ks: Keyshred, tmp_path: Path
) -> None:
    """A writer checks the mentioned subject's guard, then the subject's whole
    erasure runs (its verify step sweeps keys made so far), then the writer creates
    the shared key. The catalog refuses the mention and the put is undone, but the
    sealed row used to stay in dave's log under a live key the erased subject
    co-owns, which nothing would ever destroy: the victim's phone decrypted."""
    victim = "victim@example.org"
    probe = f"zq{uuid.uuid4().hex[:10]}"
    ks.memories.put(victim, ("notes",), "own", "the victim's own note")
    vref, dref = ks.subject_ref(victim), ks.subject_ref("dave")
    real = ks.keyring.data_key
    erased: list[str] = []

    def late(subject_ref: str, scope: str, **kwargs: Any) -> Any:
        if vref in tuple(kwargs.get("owners", ())) and not erased:
            req = ks.erase(victim, requested_by="dpo", reason="gdpr-art17")
            erased.append(req.state)
        return real(subject_ref, scope, **kwargs)

    ks.keyring.data_key = late  # type: ignore[method-assign]
    try:
        with pytest.raises(SubjectSuppressed) as err:
            ks.memories.put(
                "dave",
                ("facts",),
                "met",
                {"text": f"v phone {probe}"},
                mentions=[victim],
                index=["text"],
            )
    finally:
        ks.keyring.data_key = real  # type: ignore[method-assign]
    assert erased == ["completed"]
    assert victim not in str(err.value) and probe not in str(err.value)
    assert ks.memories.get("dave", ("facts",), "met") is None
    # Nothing about the victim under a key the live keyring still unwraps.
    plain, _ = decrypt_partition_files(ks, ks.memories.partition_path(dref), dref)
    assert not [p for p in plain if probe.encode() in p]
    # The key the writer made may stay (nothing is sealed under it); the residue
    # scan opens every file (log, segments, vectors) with every live key.
    report = ks.erasure.residue_scan([probe], [tmp_path / "data"])
    assert report.clean, report.as_dict()


def test_a_summary_registered_after_its_sources_subject_was_erased_is_not_kept(
    ks: Keyshred, tmp_path: Path
) -> None:
    """The application reads the victim's memory, the victim's erasure completes,
    then the application registers bob's summary built from it. The source is gone
    from the catalog, so it adds no owner: the summary is sealed under bob's own
    key and the victim's data in it outlives the erasure."""
    victim = "victim@example.org"
    probe = f"zq{uuid.uuid4().hex[:10]}"
    mine = ks.memories.put(victim, ("notes",), "phone", f"{probe} phone")
    read = ks.memories.get(victim, ("notes",), "phone")
    assert read is not None
    req = ks.erase(victim, requested_by="dpo", reason="gdpr-art17")
    assert req.state == "completed", req.error
    with pytest.raises(NotFound):
        ks.derived.register(
            "summary",
            subject="bob",
            namespace=("shared",),
            key="summary",
            value=f"bob knows {read.value}",
            produced_from=[mine.memory_id],
            producer="summarizer",
            producer_version="1",
        )
    assert ks.memories.get("bob", ("shared",), "summary") is None
    report = ks.erasure.residue_scan([probe], [tmp_path / "data"])
    assert report.clean, report.as_dict()
    # A source deleted after the summary was made stays a source of its updates.
    other = ks.memories.put("carol", ("notes",), "n", "carol's note")
    ks.derived.register(
        "summary",
        subject="bob",
        namespace=("shared",),
        key="s2",
        value="about carol",
        produced_from=[other.memory_id],
        producer="summarizer",
        producer_version="1",
    )
    assert ks.memories.delete("carol", ("notes",), "n")
    updated = ks.memories.update("bob", ("shared",), "s2", "about carol, again")
    assert updated.sources == (other.memory_id,)
    ks.memories.correct("bob", ("shared",), "s2", "about carol, corrected", reason="typo")


class _Killed(BaseException):
    """Stands for SIGKILL at a fault point: nothing after it runs (``put.after_log``
    is before the put's undo handler)."""


def test_repair_after_a_killed_put_about_a_subject_erased_since(ks: Keyshred) -> None:
    """A put of dave's fact about the victim is killed after its rows were staged;
    the victim is erased. Dave's repair once tried to register the row the kill left
    in the log, with its mention of an erased subject, which the catalog refuses:
    every repair of dave's partition failed and ``repair_all`` skipped it for good.
    Hot rows now commit with their assets, so the killed put left no row at all:
    dave's partition repairs clean and keeps dave's own note."""
    from keyshred.storage import faults

    victim = "victim@example.org"
    ks.memories.put(victim, ("notes",), "own", "the victim's own note")
    ks.memories.put("dave", ("notes",), "mine", "dave's own note")

    def kill(point: str) -> None:
        if point == "put.after_log":
            raise _Killed

    faults.hook = kill
    try:
        with pytest.raises(_Killed):
            ks.memories.put("dave", ("facts",), "met", "dave met v", mentions=[victim])
    finally:
        faults.hook = None
    req = ks.erase(victim, requested_by="dpo", reason="gdpr-art17")
    assert req.state == "completed", req.error
    dref = ks.subject_ref("dave")
    found = ks.memories.repair(dref)
    assert found.clean and not found.unregistered
    done = ks.memories.repair(dref, apply=True)
    assert done.ok
    assert ks.memories.repair(dref).clean
    assert dref in {r.subject_ref for r in ks.memories.repair_all()}
    assert ks.memories.get("dave", ("facts",), "met") is None
    mine = ks.memories.get("dave", ("notes",), "mine")
    assert mine is not None and mine.value == "dave's own note"


def test_a_derived_assets_name_cannot_carry_another_subjects_identifier(
    ks: Keyshred, tmp_path: Path
) -> None:
    """A summary of bob named after the victim's registered e-mail: its name stays
    readable under bob's own key (the rebuild needs it), so after the victim's
    erasure the rebuilt summary kept the e-mail in bob's segment. Refused now; the
    same name on a memory without sources is sealed with its value and goes."""
    from keyshred.errors import InvalidInput

    victim, email = "victim@example.org", "zofia.kowalska@example.org"
    ks.subjects.register_identifiers(victim, emails=[email])
    mine = ks.memories.put(victim, ("notes",), "own", "victim likes kayaks")
    bobs = ks.memories.put("bob", ("notes",), "b", "bob likes chess")

    def register(key: str) -> Any:
        return ks.derived.register(
            "summary",
            subject="bob",
            namespace=("people",),
            key=key,
            value="kayaks and chess",
            produced_from=[mine.memory_id, bobs.memory_id],
            producer="summarizer",
            producer_version="1",
            rebuild=lambda ms: " | ".join(sorted(str(m.value) for m in ms)),
        )

    with pytest.raises(InvalidInput) as err:
        register(f"about {email}")
    assert email not in str(err.value)
    summary = register("about the victim")
    ks.memories.put("bob", ("people",), f"met {email}", "at the lake")
    ks.memories.flush()
    req = ks.erase(victim, requested_by="dpo", reason="gdpr-art17")
    assert req.state == "completed", req.error
    rebuilt = ks.memories.get("bob", ("people",), "about the victim")
    assert rebuilt is not None and rebuilt.memory_id == summary.memory_id
    report = ks.erasure.residue_scan([email], [tmp_path / "data"])
    assert report.clean, report.as_dict()


def test_a_write_refused_for_a_suppressed_source_decrypts_nothing_of_it(ks: Keyshred) -> None:
    """The victim is suppressed (its erasure stopped after the suppress step, whose
    eviction dropped its cached partition). Bob registers a summary of one of its
    memories: refused, but only after reading the key ids of the sources had loaded
    the victim's whole partition, so its decrypted rows sat in this process's cache
    again. The holder's guard is read before its partition is loaded."""
    victim = "victim@example.org"
    v = ks.memories.put(victim, ("m",), "k", "victim plaintext")
    b = ks.memories.put("bob", ("m",), "b", "bob text")

    def stop(step: str, req: object) -> None:
        if step == "suppress":
            raise RuntimeError("stopped after the suppression")

    ks.erasure.on_step = stop
    with pytest.raises(RuntimeError):
        ks.erase(victim, requested_by="dpo", reason="art17", request_id="r1")
    ks.erasure.on_step = None
    ref = ks.subject_ref(victim)
    ks.memories.evict(ref)
    with pytest.raises(SubjectSuppressed):
        ks.derived.register(
            "digest",
            subject="bob",
            namespace=("s",),
            key="d",
            value="summary",
            produced_from=[v.memory_id, b.memory_id],
            producer="p",
            producer_version="1",
        )
    part = ks.memories._partitions.get(ref)
    assert part is None or not part.rows, "the suppressed subject's rows were decrypted"
    assert ks.memories.get("bob", ("s",), "d") is None


def test_data_about_a_subject_being_erased_is_unreadable_from_its_suppression(
    ks: Keyshred,
) -> None:
    """Bob's memory naming the victim and his summary built from the victim's
    memory are sealed under keys the victim co-owns. Between the victim's
    suppression and the destruction of those keys (a crash, a KEK outage, an
    erasure waiting in manual_review) get, search, history and export still
    decrypted them: the suppression stopped reads of the victim's own data only.
    They load opaque from the suppression on, in this process and in a new one."""
    victim = "victim@example.org"
    ks.subjects.register_identifiers(victim, emails=["vic@example.org"])
    v = ks.memories.put(victim, ("m",), "k", "victim text")
    b = ks.memories.put("bob", ("m",), "b", "bob text")
    ks.memories.put("bob", ("m",), "met", "met vic@example.org today")
    ks.derived.register(
        "digest",
        subject="bob",
        namespace=("s",),
        key="d",
        value="summary of victim text",
        produced_from=[v.memory_id, b.memory_id],
        producer="p",
        producer_version="1",
    )
    ks.memories.correct("bob", ("s",), "d", "summary, corrected", reason="typo")

    def stop(step: str, req: object) -> None:
        if step == "suppress":
            raise RuntimeError("stopped after the suppression")

    ks.erasure.on_step = stop
    with pytest.raises(RuntimeError):
        ks.erase(victim, requested_by="dpo", reason="art17", request_id="r1")
    ks.erasure.on_step = None
    for handle in (ks, Keyshred.open(ks.path, embeddings=bag_of_words)):
        m = handle.memories
        assert m.get("bob", ("m",), "met") is None
        assert m.get("bob", ("s",), "d") is None
        assert m.history("bob", ("s",), "d") == []
        assert [x.value for x in m.search("bob", ("m",))] == ["bob text"]
        assert [x.key for x in m.search("bob", ("s",), query="summary victim")] == []
        if handle is not ks:
            handle.close()
    assert ks.memories.get("bob", ("m",), "b").value == "bob text"  # type: ignore[union-attr]
