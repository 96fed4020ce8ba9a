"""Erasure under faults: SIGKILL after every step and inside steps (at every storage
fault point), and writers racing the erasure."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from keyshred import Keyshred
from keyshred.erasure import STEPS
from keyshred.errors import StaleEpoch, SubjectErased, SubjectSuppressed
from keyshred.receipts import verify_receipt
from keyshred.storage import faults
from keyshred.storage.faults import POINTS
from tests import zygote
from tests.erasure_worker import register_producers
from tests.storage.conftest import make_config, parquet_config
from tests.storage.test_vectors import bag_of_words

WORKER = Path(__file__).with_name("erasure_worker.py")
VICTIM = "victim@example.org"
PROBE = b"zqprobe-7d41"


# Points only a compaction into segments passes (these partitions are small enough
# to compact into the catalog by default): run with ``inline_max_rows = 0``.
SEGMENT_POINTS = {"flush.after_segment", "drop.after_first_file"}
CONFIGS = {"inline": make_config, "parquet": parquet_config}


def populate(data: Path, layout: str = "inline") -> None:
    config = CONFIGS[layout](None, flush_records=4)
    with Keyshred.init(data, config, embeddings=bag_of_words) as ks:
        for i in range(10):
            ks.memories.put(VICTIM, ("m",), f"k{i}", f"{PROBE.decode()} {i}", index=True)
        src = ks.memories.put("bob", ("m",), "b", "bob likes chess", index=True)

        def bobs(key: str, victims: str, producer: str, *, index: bool | None = None) -> None:
            """Bob's derived memory ``key`` of the victim's memory ``victims`` and his."""
            victim_src = ks.memories.get(VICTIM, ("m",), victims)
            assert victim_src is not None
            ks.derived.register(
                key,
                subject="bob",
                namespace=("s",),
                key=key,
                value=f"{PROBE.decode()} {key}",
                produced_from=[victim_src.memory_id, src.memory_id],
                producer=producer,
                producer_version="1",
                index=index,
            )

        bobs("summary", "k0", "concat")  # dropped: its producer returns None
        # rebuilt by the erasure (the worker knows "digest"), writing vectors too
        bobs("digest", "k0", "digest", index=True)
        # Made from a victim memory deleted since: the catalog's provenance no longer
        # reaches the victim, the key it is sealed under still does (co-owned, destroyed
        # by the erasure), so the closure must find it by its key and rebuild it.
        bobs("recap", "k9", "digest")
        ks.memories.delete(VICTIM, ("m",), "k9")


def victim_unreadable(ks: Keyshred) -> None:
    for call in (
        lambda: ks.memories.get(VICTIM, ("m",), "k1"),
        lambda: ks.memories.search(VICTIM, ("m",)),
        lambda: ks.memories.put(VICTIM, ("m",), "new", 1),
    ):
        with pytest.raises((SubjectSuppressed, SubjectErased)):
            call()


def kill_erasure_at(point: str, tmp_path: Path, layout: str = "inline") -> Path:
    """Populate a data folder, run the erasure in a worker killed at ``point``."""
    data = tmp_path / "data"
    populate(data, layout)
    run_killed("erase", data, "req-fault", point, layout)
    return data


def run_killed(mode: str, data: Path, request_id: str, point: str, layout: str = "inline") -> None:
    """Run the worker's ``mode`` (an erasure) on ``data``; it must die at ``point``."""
    proc = zygote.run(
        [sys.executable, str(WORKER), mode, str(data), request_id, point],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "KS_TEST_LAYOUT": layout},
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr[-2000:]


@pytest.mark.parametrize("step", STEPS)
def test_sigkill_after_each_step_then_resume(step: str, tmp_path: Path) -> None:
    data = kill_erasure_at(step, tmp_path)
    with Keyshred.open(data, make_config(None), embeddings=bag_of_words) as ks:
        assert step in ks.erasure.status("req-fault").steps_done
    resume_and_check(data)


# The vault's group-commit points are a flush's, not the erasure's (their crash test
# is tests/vault/test_group.py); the backup's are a backup's (tests/backup/test_backup_kill.py);
# the thread's are delete_thread's and a thread's creation's
# (tests/storage/test_thread_faults.py).
ERASURE_POINTS = [
    p for p in POINTS if not p.startswith(("vault.", "import.", "vectors.", "backup.", "thread."))
]


@pytest.mark.parametrize("point", ERASURE_POINTS)
def test_sigkill_inside_a_step_then_resume(point: str, tmp_path: Path) -> None:
    """Killed inside drop_memories (the victim's folder half removed) or inside the
    derived step (a bystander's derived memory half deleted or half rebuilt): the
    bystander's partition opens and the resumed erasure completes."""
    layout = "parquet" if point in SEGMENT_POINTS else "inline"
    data = kill_erasure_at(point, tmp_path, layout)
    with Keyshred.open(data, CONFIGS[layout](None), embeddings=bag_of_words) as ks:
        assert ks.erasure.status("req-fault").state != "completed"
        assert ks.memories.get("bob", ("m",), "b") is not None  # opens, at once
        (report,) = [r for r in ks.memories.repair_all() if r.subject_ref == ks.subject_ref("bob")]
        assert not (report.lost or report.unfinished_deletes or report.unregistered), report
    resume_and_check(data)


def resume_and_check(data: Path) -> None:
    with Keyshred.open(data, make_config(None), embeddings=bag_of_words) as ks:
        register_producers(ks)
        victim_unreadable(ks)  # at every moment after suppressed
        done = ks.erasure.resume("req-fault")
        assert done.state == "completed", done.error
        receipt = ks.erasure.receipt("req-fault")
        assert receipt is not None
        verify_receipt(receipt, ks.keyring.signer().public_key)
        assert receipt.key_ids and all(c.passed for c in receipt.verification)
        assert {s.store for s in receipt.stores} >= {"keyring", "memories", "vectors", "catalog"}
        victim_unreadable(ks)
        assert ks.memories.get("bob", ("m",), "b") is not None
        assert ks.memories.get("bob", ("s",), "summary") is None  # its producer drops it
        rebuilt = ks.memories.get("bob", ("s",), "digest")
        assert rebuilt is not None and rebuilt.value == "digest of 1 memories"
        assert ks.catalog.asset(rebuilt.memory_id).producer == "digest"  # type: ignore[union-attr]
        recap = ks.memories.get("bob", ("s",), "recap")  # its victim source deleted before
        assert recap is not None and recap.value == "digest of 1 memories"
        assert all(r.clean for r in ks.memories.repair_all())
    for path in (p for p in data.rglob("*") if p.is_file()):
        assert PROBE not in path.read_bytes(), path


def test_writers_racing_the_erasure(tmp_path: Path) -> None:
    data = tmp_path / "data"
    populate(data)
    procs = [
        zygote.Popen(
            [sys.executable, str(WORKER), "write", str(data)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for p in procs:  # both are writing before the erasure starts
        assert p.stdout is not None and p.stdout.readline().startswith("ACK")
    ks = Keyshred.open(data, make_config(None), embeddings=bag_of_words)
    register_producers(ks)
    ref = ks.subject_ref(VICTIM)
    epoch = ks.deletion_epoch(VICTIM)
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(n: int) -> None:
        i = 0
        while not stop.is_set():
            try:
                ks.memories.put(VICTIM, ("thread",), f"t{n}-{i}", i, epoch=epoch)
            except (SubjectSuppressed, StaleEpoch):
                return
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                return
            i += 1

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    req = ks.erase(VICTIM, requested_by="dpo", reason="race")
    stop.set()
    for t in threads:
        t.join(timeout=30)
    outs = [p.communicate(timeout=60) for p in procs]
    assert not errors, errors
    assert req.state == "completed", req.error
    for out, err in outs:
        assert "REFUSED after" in out, err[-2000:]
    victim_unreadable(ks)
    # Nothing of the subject was registered after its suppression, by anyone.
    assert ks.catalog.assets(ref) == []
    assert ks.catalog.count(ref) == 0
    assert not ks.memories.partition_path(ref).exists() or not [
        p for p in ks.memories.partition_path(ref).rglob("*.parquet")
    ]
    ks.close()


@pytest.mark.parametrize(
    ("layout", "point"),
    [
        ("parquet", "flush.after_segment"),
        ("parquet", "flush.after_manifest"),
        ("inline", "flush.after_records"),
        ("inline", "flush.after_manifest"),
    ],
)
def test_sigkill_inside_a_scope_erasures_compaction_then_resume(
    layout: str, point: str, tmp_path: Path
) -> None:
    """A scope erasure compacts the partition under the subject lock before it
    destroys the scope's key (a memory moved into the scope must leave no old version
    in another scope). Killed inside that compaction: every acknowledged memory of the
    other scope reads, the moved memory's old value never comes back, and the resumed
    erasure completes."""
    from tests.erasure_worker import OWNER

    data = tmp_path / "data"
    with Keyshred.init(data, CONFIGS[layout](None), embeddings=bag_of_words) as ks:
        for i in range(3):
            ks.memories.put(OWNER, ("m",), f"keep{i}", f"kept {i}")
        ks.memories.put(OWNER, ("m",), "moved", f"{PROBE.decode()} old")
        ks.memories.flush(OWNER)
    # The worker moves "moved" into "marketing" and erases that scope at once.
    run_killed("erase-scope", data, "req-scope", point, layout)
    with Keyshred.open(data, CONFIGS[layout](None), embeddings=bag_of_words) as ks:
        done_steps = ks.erasure.status("req-scope").steps_done
        assert "suppress" in done_steps and "destroy_keys" not in done_steps  # inside it
        for i in range(3):
            assert ks.memories.get(OWNER, ("m",), f"keep{i}").value == f"kept {i}"  # type: ignore[union-attr]
        # The scope is suppressed: its memory is refused, and the old value in the
        # default scope's segment does not stand in for it.
        with pytest.raises(SubjectSuppressed):
            ks.memories.get(OWNER, ("m",), "moved")
        done = ks.erasure.resume("req-scope")
        assert done.state == "completed", done.error
        assert ks.memories.get(OWNER, ("m",), "moved") is None  # not its old value
        for i in range(3):
            assert ks.memories.get(OWNER, ("m",), f"keep{i}").value == f"kept {i}"  # type: ignore[union-attr]
        assert all(r.clean for r in ks.memories.repair_all())
    for path in (p for p in data.rglob("*") if p.is_file()):
        assert PROBE not in path.read_bytes(), path


def test_a_derived_asset_stops_nowhere_as_a_plain_memory(tmp_path: Path) -> None:
    """``derived.register`` stopped right after its row's catalog transaction (the
    ``put.after_catalog`` fault point; a kill there leaves the same files) left an
    asset with its producer: the producer was written in a second transaction, and
    a crash between left a plain memory that an erasure of its source dropped
    instead of rebuilding."""
    data = tmp_path / "data"

    class Stop(Exception):
        pass

    def stop(point: str, *_: object) -> None:
        if point == "put.after_catalog":
            raise Stop

    with Keyshred.init(data, make_config(None)) as ks:
        src = ks.memories.put(VICTIM, ("m",), "k", "victim text")
        mine = ks.memories.put("bob", ("m",), "b", "bob likes chess")
        faults.hook = stop
        try:
            with pytest.raises(Stop):
                ks.derived.register(
                    "digest",
                    subject="bob",
                    namespace=("s",),
                    key="digest",
                    value="victim text and chess",
                    produced_from=[src.memory_id, mine.memory_id],
                    producer="digest",
                    producer_version="1",
                )
        finally:
            faults.hook = None
    with Keyshred.open(data, make_config(None)) as ks:
        register_producers(ks)
        got = ks.memories.get("bob", ("s",), "digest")
        assert got is not None
        asset = ks.catalog.asset(got.memory_id)
        assert asset is not None and (asset.kind, asset.producer) == ("derived:digest", "digest")
        assert ks.erase(VICTIM, requested_by="dpo", reason="art17").state == "completed"
        rebuilt = ks.memories.get("bob", ("s",), "digest")
        assert rebuilt is not None and rebuilt.value == "digest of 1 memories"
