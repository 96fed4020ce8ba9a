"""One behaviour suite for every store that holds personal data (issue 20, item 1):
each implements ``keyshred.storage.erasable.Erasable``, and each runs here on SQLite
and on PostgreSQL (``catalog_url``).

Per store: two subjects' data; the store's ``evict`` drops what this process cached
of one of them; its ``erase`` (after suppression and key destruction, in the
coordinator's order: ``DROP`` stores before the catalog rows go, ``REBUILD`` stores
after) removes that subject; ``verify`` fails before and passes after; the other
subject's data is intact. Then the faults: a worker process runs a whole erasure and
is SIGKILLed inside the store's ``erase`` (``keyshred.storage.faults.ERASE_POINTS``);
the resumed request completes, verification passes, nothing of the subject is left.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from keyshred import Keyshred
from keyshred.config import TokenSettings
from keyshred.errors import SubjectErased, SubjectSuppressed
from keyshred.receipts import verify_receipt
from keyshred.storage.checkpoints import CheckpointRow
from keyshred.storage.erasable import DROP, Erasable, ErasureTarget
from keyshred.storage.faults import ERASE_POINTS
from tests import zygote
from tests.erasure_worker import VICTIM, register_producers
from tests.storage.conftest import make_config
from tests.storage.test_vectors import bag_of_words

WORKER = Path(__file__).resolve().parents[1] / "erasure_worker.py"
ALICE, BOB = VICTIM, "bob@example.org"
NS = ("m",)
STORES = ("memories", "vectors", "vault", "checkpoints", "exports", "derived")


@dataclass
class Held:
    """What the test keeps of a subject to check it afterwards."""

    source: str = ""  # the memory id a derived asset is built from
    sanitized: Any = None
    package: bytes = b""
    values: dict[str, Any] = field(default_factory=dict)


def config(catalog_url: str | None) -> Any:
    cfg = make_config(catalog_url)
    # Tokens wait for group commit long enough to be pending in this process.
    return cfg.model_copy(update={"tokens": TokenSettings(group_commit_ms=10_000)})


def populate(ks: Keyshred, subject: str, tmp: Path) -> Held:
    held = Held()
    src = ks.memories.put(subject, NS, "k", {"text": f"{subject} drinks tea"}, index=True)
    held.source = src.memory_id
    ref = ks.subject_ref(subject)
    th = ks.checkpoints.ensure_thread(f"thread-{subject}", ref, "default")
    ks.checkpoints.put_checkpoint(th, CheckpointRow("", "", "c1", None, b"state"), None)
    held.sanitized = ks.vault.sanitize(f"mail {subject}", subject, "support", timedelta(hours=1))
    ks.vault.flush()
    dest = tmp / f"export-{subject}.zip"
    ks.export(subject, dest, passphrase="correct horse battery")
    held.package = dest.read_bytes()
    return held


def derive(ks: Keyshred, alice: Held, bob: Held) -> str:
    """Bob's summary built from both subjects' memories (rebuilt when Alice goes)."""
    summary = ks.derived.register(
        "summary",
        subject=BOB,
        namespace=("s",),
        key="summary",
        value="summary of 2",
        produced_from=[alice.source, bob.source],
        producer="digest",
        producer_version="1",
    )
    return summary.memory_id


def bob_intact(ks: Keyshred, bob: Held, *, rebuilt: bool) -> None:
    ref = ks.subject_ref(BOB)
    got = ks.memories.get(BOB, NS, "k")
    assert got is not None and got.value == {"text": f"{BOB} drinks tea"}
    hits = ks.memories.search(BOB, NS, query="tea", limit=5)
    assert [m.memory_id for m in hits] == [got.memory_id]
    restored = ks.vault.restore(bob.sanitized.text, "support", "suite", subject=BOB)
    assert restored == f"mail {BOB}"
    th = ks.checkpoints.thread(f"thread-{BOB}")
    assert th is not None and ks.checkpoints.get(th, "", "c1") is not None
    assert ks.checkpoints.count(ref) > 0
    opened = ks.open_export(bob.package, passphrase="correct horse battery")
    assert opened
    if rebuilt:  # until then it is sealed under a key Alice co-owned: unreadable
        summary = ks.memories.get(BOB, ("s",), "summary")
        assert summary is not None and summary.value == "digest of 1 memories"


def store_named(ks: Keyshred, name: str) -> Erasable:
    (store,) = [s for s in ks.erasure.stores if s.name == name]
    assert isinstance(store, Erasable)
    return store


def warm(ks: Keyshred, name: str, subject: str) -> Callable[[], bool]:
    """Fill the store's cache with the subject and return a probe: whether this
    process still holds anything of the subject in that store's memory."""
    ref = ks.subject_ref(subject)
    if name == "memories":
        assert ks.memories.get(subject, NS, "k") is not None
        return lambda: ref in ks._memories._partitions
    if name == "vectors":
        assert ks.memories.search(subject, NS, query="tea", limit=1)
        return lambda: ref in ks._vectors._cache
    if name == "vault":
        ks.vault.sanitize(f"call {subject}", subject, "support", timedelta(hours=1))
        # Every token is stored before sanitize returns: the vault holds no pending
        # row, and the subject's keys are the keyring's (evicted by it).
        return lambda: False
    if name == "checkpoints":
        assert ks.checkpoints.thread(f"thread-{subject}") is not None
        return lambda: any(t.subject_ref == ref for t in ks._checkpoints._threads.values())
    return lambda: False  # exports and derived assets cache nothing of their own either


@pytest.fixture
def two(catalog_url: str, tmp_path: Path) -> Iterator[tuple[Keyshred, Held, Held, str]]:
    ks = Keyshred.init(tmp_path / "data", config(catalog_url), embeddings=bag_of_words)
    register_producers(ks)
    alice = populate(ks, ALICE, tmp_path)
    bob = populate(ks, BOB, tmp_path)
    summary = derive(ks, alice, bob)
    yield ks, alice, bob, summary
    ks.close()


@pytest.mark.parametrize("name", STORES)
def test_store_erases_one_subject_verifies_and_keeps_the_other(
    name: str, two: tuple[Keyshred, Held, Held, str]
) -> None:
    ks, _alice, bob, summary = two
    store = store_named(ks, name)
    ref = ks.subject_ref(ALICE)

    cached = warm(ks, name, ALICE)
    if name not in ("exports", "derived", "vault"):  # these cache nothing of their own
        assert cached(), "the warm-up cached nothing: the evict check would prove nothing"
    store.evict(ref)
    assert not cached()

    # The coordinator's order: suppress, destroy keys, find the closure, then the
    # store (DROP stores before the catalog rows go, REBUILD stores after).
    ks.catalog.suppress(ref)
    ks.keyring.destroy(ref, None)
    own = tuple(sorted(ks.catalog.asset_kinds(ref)))
    closure = tuple(a.asset_id for a in ks.catalog.derived_from_subject(ref) if a.kind != "vector")
    assert summary in closure
    target = ErasureTarget(ref, None, None, own, closure)
    before = store.verify(target)
    assert before and not all(c.passed for c in before), before

    if store.phase == DROP:
        result = store.erase(target)
        ks.catalog.delete_subject_assets(ref)
    else:
        ks.catalog.delete_subject_assets(ref)
        result = store.erase(target)
    assert result.store == name
    if name in ("vault", "checkpoints", "exports", "derived"):
        assert result.found and (result.count or result.items)
    if name == "derived":
        assert [dict(i)["action"] for i in result.items] == ["rebuilt"]

    checks = store.verify(target)
    assert checks and all(c.passed for c in checks), checks
    for c in checks:  # details are counts, never data
        assert ALICE not in c.detail and "tea" not in c.detail

    if name != "derived":  # (a resumed derived step skips what it recorded)
        # A second erase (a resumed step) finds nothing more and does no harm.
        assert store.erase(target).count == 0
        assert all(c.passed for c in store.verify(target))

    store.evict(ref)
    assert not cached()
    assert ks.keyring.cache.get_owner(ref, "default") is None
    bob_intact(ks, bob, rebuilt=name == "derived")


def resume_and_check(data: Path, catalog_url: str, request_id: str) -> None:
    with Keyshred.open(data, config(catalog_url), embeddings=bag_of_words) as ks:
        register_producers(ks)
        for call in (
            lambda: ks.memories.get(ALICE, NS, "k"),
            lambda: ks.memories.put(ALICE, NS, "x", 1),
        ):
            with pytest.raises((SubjectSuppressed, SubjectErased)):
                call()
        done = ks.erasure.resume(request_id)
        assert done.state == "completed", done.error
        receipt = ks.erasure.receipt(request_id)
        assert receipt is not None
        verify_receipt(receipt, ks.keyring.signer().public_key)
        assert receipt.verification and all(c.passed for c in receipt.verification)
        assert {s.store for s in receipt.stores} >= set(STORES)
        ref = ks.subject_ref(ALICE)
        assert ks.vault.count(ref) == 0 and ks.checkpoints.count(ref) == 0
        assert ks.catalog.assets(ref) == []
        assert not ks.memories.partition_path(ref).exists()


@pytest.mark.parametrize("name", STORES)
def test_killed_inside_the_store_erase_then_resume_completes(
    name: str, catalog_url: str, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    with Keyshred.init(data, config(catalog_url), embeddings=bag_of_words) as ks:
        register_producers(ks)
        alice = populate(ks, ALICE, tmp_path)
        bob = populate(ks, BOB, tmp_path)
        derive(ks, alice, bob)
    point = ERASE_POINTS[name]
    proc = zygote.run(
        [sys.executable, str(WORKER), "erase", str(data), "req-suite", point, catalog_url],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr[-2000:]
    with Keyshred.open(data, config(catalog_url), embeddings=bag_of_words) as ks:
        req = ks.erasure.status("req-suite")
        assert req.state != "completed"
        step = name if name == "derived" else f"drop_{name}"
        assert step not in req.steps_done  # killed inside it
    resume_and_check(data, catalog_url, "req-suite")
    with Keyshred.open(data, config(catalog_url), embeddings=bag_of_words) as ks:
        bob_intact(ks, bob, rebuilt=True)
