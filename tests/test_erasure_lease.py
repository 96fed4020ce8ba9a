"""One worker at a time runs an erasure request (``keyshred.erasure.lease``): racing
workers run each step once, log ``erasure.completed`` once and sign one receipt; a
worker that lost its lease records nothing more; a dead holder's lease is taken over
(at once on the same machine, when it runs out elsewhere)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import sqlalchemy as sa

from keyshred import Keyshred
from keyshred.erasure import STEPS
from keyshred.erasure.lease import LeaseLost, claim
from keyshred.receipts import verify_receipt
from keyshred.schema import deletion_requests
from tests import zygote
from tests.erasure_worker import register_producers
from tests.storage.conftest import make_config
from tests.storage.test_vectors import bag_of_words

WORKER = Path(__file__).with_name("erasure_worker.py")
VICTIM = "victim@example.org"


def _store(catalog_url: str, data: Path, **erasure: float) -> Keyshred:
    config = make_config(catalog_url if catalog_url.startswith("postgresql") else None)
    if erasure:
        config = config.model_copy(update={"erasure": config.erasure.model_copy(update=erasure)})
    ks = Keyshred.init(data, config, embeddings=bag_of_words)
    register_producers(ks)
    return ks


def _pending(ks: Keyshred, request_id: str) -> None:
    for i in range(5):
        ks.memories.put(VICTIM, ("m",), f"k{i}", f"note {i}", index=True)
    ks.memories.put("bob", ("m",), "b", "bob's note")
    ks.erasure.request(
        ks.subject_ref(VICTIM),
        None,
        requested_by="dpo",
        reason="lease-test",
        request_id=request_id,
    )


def _counts(ks: Keyshred, request_id: str) -> tuple[int, dict[str, int]]:
    completed = ks.audit.events(request_id=request_id, event="erasure.completed")
    states: dict[str, int] = {}
    for e in ks.audit.events(request_id=request_id, event="erasure.state"):
        step = e.data.get("step")
        if step is not None:
            states[step] = states.get(step, 0) + 1
    return len(completed), states


def test_racing_workers_run_each_step_once_and_sign_one_receipt(
    catalog_url: str, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    with _store(catalog_url, data) as ks:
        _pending(ks, "req-race")
    url = catalog_url if catalog_url.startswith("postgresql") else "-"
    racers = [
        zygote.Popen(
            [sys.executable, str(WORKER), "resume", str(data), "req-race", url, "0.2"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    for p in racers:
        assert p.stdout is not None and p.stdout.readline().strip() == "READY"
    for p in racers:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [p.communicate(timeout=180) for p in racers]
    assert all(p.returncode == 0 for p in racers), [e[-2000:] for _, e in outs]
    with Keyshred.open(data, make_config(None if url == "-" else url)) as ks:
        req = ks.erasure.status("req-race")
        assert req.state == "completed"
        completed, states = _counts(ks, "req-race")
        assert completed == 1
        # Each step's state change was logged once: no step ran twice.
        assert all(n == 1 for n in states.values()), states
        assert set(states) <= set(STEPS)
        receipt = ks.erasure.receipt("req-race")
        assert receipt is not None
        verify_receipt(receipt, ks.keyring.signer().public_key)


def test_a_worker_that_lost_its_lease_records_nothing(catalog_url: str, tmp_path: Path) -> None:
    with _store(catalog_url, tmp_path / "data", lease_seconds=1.0) as ks:
        _pending(ks, "req-lost")
        coordinator = ks._erasure
        stale = claim(ks._catalog, "req-lost", 1.0)  # a worker that then stalls
        assert stale is not None
        stale._stop.set()  # its heartbeat stopped with it
        # Another run waits for the lease to run out, then takes the request over.
        req = ks.erasure.resume("req-lost")
        assert req.state == "completed"
        # The stalled worker wakes up: its saves are refused, nothing is recorded.
        mine = ("req-lost", threading.get_ident())
        coordinator._leases[mine] = stale
        try:
            req.doc["details"]["late"] = {}
            with pytest.raises(LeaseLost):
                coordinator._save(req)
        finally:
            del coordinator._leases[mine]
        assert "late" not in ks.erasure.status("req-lost").doc["details"]
        assert _counts(ks, "req-lost")[0] == 1


def test_a_dead_holder_on_this_machine_is_taken_over_at_once(
    catalog_url: str, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    with _store(catalog_url, data, lease_seconds=600.0) as ks:
        _pending(ks, "req-dead")
        # A process of this machine that held the lease and died (its pid is gone).
        gone = zygote.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
            check=True,
        )
        owner = claim(ks._catalog, "req-dead", 600.0)
        assert owner is not None
        owner._stop.set()
        host = owner.owner.split(":")[0]
        with ks._catalog.transaction() as conn:
            conn.execute(
                deletion_requests.update()
                .where(deletion_requests.c.request_id == "req-dead")
                .values(lease_owner=f"{host}:{gone.stdout.strip()}:dead")
            )
        # Not a 600 s wait: the holder is known dead.
        req = ks.erasure.resume("req-dead")
        assert req.state == "completed"
        with ks._catalog.transaction() as conn:
            row = conn.execute(
                sa.select(deletion_requests.c.lease_owner).where(
                    deletion_requests.c.request_id == "req-dead"
                )
            ).scalar()
        assert row is None  # released at the end of the run
