"""Derived assets under erasure: findings of an attacker review (reproductions from
the review, kept as regression tests).

- a resumed erasure leaves alone a bystander's memory written, at the id of an
  asset in its closure, while it waited (manual review, a SIGKILL);
- a rebuild function never runs on no source, and its exception is a step failure
  (retry, then manual review), never an exception escaping ``ks.erase``;
- ``ks.derived.register`` refuses bad input before it writes anything.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from keyshred import Keyshred
from keyshred.errors import KeyshredError
from tests.storage.conftest import make_config

VICTIM = "victim@example.org"


@pytest.fixture
def ks(tmp_path: Path) -> Iterator[Keyshred]:
    store = Keyshred.init(tmp_path / "data", make_config(None))
    yield store
    store.close()


def test_resumed_erasure_keeps_a_bystanders_memory_rewritten_meanwhile(ks: Keyshred) -> None:
    """Bob's summary of the victim's memory is in the erasure's closure; the erasure
    waits in manual_review (its producer unknown). Meanwhile Bob writes a note of his
    own at that key: the put reuses the asset id of the (opaque) summary. The resumed
    derived step re-reads the asset by that id, finds a plain memory with no source
    left, and deletes Bob's new note, which holds nothing of the victim."""
    v = ks.memories.put(VICTIM, ("m",), "k", "victim text")
    b = ks.memories.put("bob", ("m",), "b", "bob text")
    ks.derived.register(
        "digest",
        subject="bob",
        namespace=("s",),
        key="d",
        value="summary of victim text",
        produced_from=[v.memory_id, b.memory_id],
        producer="later",
        producer_version="1",
    )
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


def test_update_cannot_make_a_provenance_cycle_that_rebuilds_from_nothing(ks: Keyshred) -> None:
    """steps._sources_first assumes a cycle is "never made by the API", but update
    accepts any source the catalog holds: D <- E <- D. The victim's erasure then
    rebuilds E from D while D is still opaque: the rebuild function runs on no
    source at all ("digest of 0 memories"), which the derived step promises never
    to do (dropped when no source remains)."""
    v = ks.memories.put(VICTIM, ("m",), "k", "victim text")
    b = ks.memories.put("bob", ("m",), "b", "bob text")

    def digest(sources: list[object]) -> str:
        return f"digest of {len(sources)} memories"

    d = ks.derived.register(
        "digest",
        subject="bob",
        namespace=("s",),
        key="d",
        value="victim text digest",
        produced_from=[v.memory_id, b.memory_id],
        producer="dg",
        producer_version="1",
        rebuild=digest,
    )
    e = ks.derived.register(
        "digest",
        subject="bob",
        namespace=("s",),
        key="e",
        value="digest of d",
        produced_from=[d.memory_id],
        producer="dg",
        producer_version="1",
    )
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
    d = ks.derived.register(
        "first",
        subject="bob",
        namespace=("s",),
        key="d",
        value="victim text",
        produced_from=[v.memory_id, b.memory_id],
        producer="first",
        producer_version="1",
        rebuild=first,
    )
    ks.derived.register(
        "first",
        subject="carol",
        namespace=("s",),
        key="e",
        value="summary: victim text",
        produced_from=[d.memory_id],
        producer="first",
        producer_version="1",
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


def test_register_with_an_iterator_of_sources_writes_nothing_or_succeeds(ks: Keyshred) -> None:
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
def test_register_long_kind_or_version_raises_a_keyshred_error(
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
