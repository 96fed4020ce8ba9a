"""The job table (``keyshred.jobs``) on SQLite and PostgreSQL: claims and leases
(a dead holder's job taken over, a stale holder records nothing), retries with
exponential backoff and full jitter then the dead letter, payloads that never hold
a subject id, the outbox (a request and its job commit together), erasure jobs run
in-process, idempotent external calls, periodic jobs once per period, and the
queue's gauges."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from keyshred import Config, Keyshred
from keyshred.erasure import ErasureRequest, ExternalAnswer
from keyshred.errors import InvalidInput
from keyshred.jobs import Job, JobOutcome, check_payload
from keyshred.leases import host
from keyshred.schema import deletion_requests, jobs
from keyshred.store_metrics import StoreMetrics
from keyshred.worker import Worker
from tests.storage.conftest import make_config
from tests.storage.test_vectors import bag_of_words

VICTIM = "victim@example.org"
PROBE = "zqjobsprobe-0e77"


def _store(catalog_url: str, path: Path, **settings: Any) -> Keyshred:
    config = make_config(catalog_url if catalog_url.startswith("postgresql") else None)
    defaults = {"retention_every_seconds": 0, "backup_maintain_every_seconds": 0}
    config = config.model_copy(
        update={"jobs": config.jobs.model_copy(update={**defaults, **settings})}
    )
    return Keyshred.init(path, config, embeddings=bag_of_words)


@pytest.fixture
def ks(catalog_url: str, tmp_path: Path) -> Any:
    with _store(catalog_url, tmp_path / "data") as store:
        yield store


def _set(ks: Keyshred, job_id: str, **values: Any) -> None:
    with ks._catalog.transaction() as conn:
        conn.execute(jobs.update().where(jobs.c.job_id == job_id).values(**values))


def test_claim_complete_dedupe_and_delay(ks: Keyshred) -> None:
    q = ks.jobs.queue
    first = q.enqueue("test.kind", {"thing": "t-1"})
    assert q.enqueue("test.kind", {"thing": "t-2"}, dedupe_key="p:1") == q.enqueue(
        "test.kind", {"thing": "t-3"}, dedupe_key="p:1"
    )
    q.enqueue("test.kind", {"thing": "t-4"}, delay=3600)  # not due for an hour
    assert q.depth()["queued"] == 3
    claimed = [q.claim(["test.kind"]), q.claim(["test.kind"])]
    assert all(c is not None for c in claimed)
    assert {c.payload["thing"] for c in claimed if c} == {"t-1", "t-2"}
    assert q.claim(["test.kind"]) is None  # the third is not due
    assert q.claim(["other"]) is None
    job = next(c for c in claimed if c and c.job_id == first)
    assert job.state == "running" and job.attempts == 1
    assert q.complete(job)
    assert q.get(first).state == "succeeded"
    assert q.depth() == {"queued": 1, "running": 1, "succeeded": 1, "manual_review": 0}
    assert [j.job_id for j in q.list(["succeeded"])] == [first]
    assert q.oldest_queued_age_seconds() >= 0


def test_an_expired_lease_is_taken_over_and_the_stale_holder_records_nothing(
    ks: Keyshred,
) -> None:
    q = ks.jobs.queue
    job_id = q.enqueue("test.kind", {"thing": "t"})
    stale = q.claim(job_id=job_id)
    assert stale is not None
    assert q.claim(job_id=job_id) is None  # leased
    _set(ks, job_id, lease_until=0)  # its lease ran out (by the database's clock)
    taken = q.claim(job_id=job_id)
    assert taken is not None and taken.attempts == 2 and taken.lease_owner != stale.lease_owner
    assert not q.complete(stale)  # the stale holder's save is refused
    assert q.get(job_id).state == "running"
    assert q.complete(taken)


def test_a_dead_holder_on_this_machine_is_taken_over_at_once(ks: Keyshred) -> None:
    q = ks.jobs.queue
    job_id = q.enqueue("test.kind", {"thing": "t"})
    assert q.claim(job_id=job_id) is not None
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    _set(ks, job_id, lease_owner=f"{host()}:{gone}:dead")  # lease_until still far ahead
    taken = q.claim(job_id=job_id)
    assert taken is not None and taken.attempts == 2


def test_retries_back_off_with_full_jitter_then_dead_letter(
    catalog_url: str, tmp_path: Path
) -> None:
    with _store(
        catalog_url,
        tmp_path / "data",
        max_attempts=3,
        backoff_base_seconds=10.0,
        backoff_max_seconds=25.0,
    ) as ks:
        calls: list[str] = []

        def failing(job: Job, stop: Any) -> JobOutcome:
            calls.append(job.job_id)
            raise OSError("the vendor is down")

        ks.jobs.register("test.fail", failing)
        job_id = ks.jobs.queue.enqueue("test.fail", {"thing": "t"})
        for attempt, cap in ((1, 10.0), (2, 20.0)):
            assert ks.jobs.run_pending() == 1
            job = ks.jobs.queue.get(job_id)
            assert (job.state, job.attempts, job.last_error) == ("queued", attempt, "OSError")
            wait = job.run_after_us - job.updated_us
            assert -100_000 <= wait <= cap * 1_000_000 + 100_000  # within [0, cap]
            assert ks.jobs.run_pending() == 0  # backing off: not due
            _set(ks, job_id, run_after=0)  # as if the backoff had passed
        assert ks.jobs.run_pending() == 1
        job = ks.jobs.queue.get(job_id)
        assert (job.state, job.attempts, job.last_error) == ("manual_review", 3, "OSError")
        assert ks.jobs.run_pending() == 0  # dead-lettered jobs are not claimed
        assert len(calls) == 3
        # The jitter is full: many draws spread over [0, cap], not at the cap.
        draws = [ks.jobs.queue.backoff(3) for _ in range(200)]
        assert min(draws) >= 0 and max(draws) <= 25.0 and min(draws) < 12.5 < max(draws)


def test_a_non_retryable_error_dead_letters_at_once(ks: Keyshred) -> None:
    def bad(job: Job, stop: Any) -> JobOutcome:
        raise InvalidInput("a payload no run can fix")

    ks.jobs.register("test.bad", bad)
    job_id = ks.jobs.queue.enqueue("test.bad", {"thing": "t"})
    assert ks.jobs.run_pending() == 1
    job = ks.jobs.queue.get(job_id)
    assert (job.state, job.attempts, job.last_error) == ("manual_review", 1, "InvalidInput")
    unknown = ks.jobs.queue.enqueue("test.nobody", {"thing": "t"})
    assert ks.jobs.run_pending(["test.nobody"]) == 1
    assert ks.jobs.queue.get(unknown).state == "manual_review"


@pytest.mark.parametrize(
    "payload",
    [
        {"subject": VICTIM},
        {"subject": "Jane Doe"},
        {"request_id": 7},
        {"Bad-Key": "x"},
        {"value": "x" * 200},
    ],
)
def test_a_payload_holds_ids_only(payload: dict[str, Any]) -> None:
    with pytest.raises(InvalidInput) as err:
        check_payload(payload)
    assert VICTIM not in str(err.value) and "Jane" not in str(err.value)


def test_no_job_row_holds_a_subject_id_or_a_probe(catalog_url: str, tmp_path: Path) -> None:
    with _store(catalog_url, tmp_path / "data") as ks:
        ks.memories.put(VICTIM, ("m",), "k", f"{PROBE} note", index=True)
        ks.erasure.submit(VICTIM, requested_by="dpo", reason="scan", request_id="req-a")
        ks.erase(VICTIM, requested_by="dpo", reason="scan", probes=[PROBE])
        ks.jobs.queue.enqueue("test.kind", {"subject_ref": ks.subject_ref("bob")})
        Worker(ks).enqueue_periodic()
        with ks._catalog.engine.connect() as conn:
            rows = ["|".join(str(v) for v in r) for r in conn.execute(sa.select(jobs)).all()]
        assert len(rows) >= 3
        for row in rows:
            assert VICTIM not in row and PROBE not in row and "victim" not in row
        if ks._catalog.dialect == "sqlite":
            ks._catalog.scrub()
            folder = tmp_path / "data" / "catalog"
            for path in folder.iterdir():
                assert PROBE.encode() not in path.read_bytes(), path


def test_a_request_and_its_job_commit_together(ks: Keyshred) -> None:
    ref = ks.subject_ref(VICTIM)
    queue = ks._jobs.queue  # the coordinator's own
    real = queue.enqueue

    def failing(*args: Any, **kwargs: Any) -> str:
        real(*args, **kwargs)
        raise OSError("the connection dropped")

    queue.enqueue = failing  # type: ignore[method-assign]
    try:
        with pytest.raises(OSError):
            ks.erasure.request(ref, None, requested_by="dpo", reason="x", request_id="req-o")
    finally:
        queue.enqueue = real  # type: ignore[method-assign]
    with ks._catalog.engine.connect() as conn:
        rows = conn.execute(
            sa.select(sa.func.count()).where(deletion_requests.c.request_id == "req-o")
        ).scalar()
    assert rows == 0 and queue.find("erasure:req-o") is None  # neither was recorded
    req = ks.erasure.request(ref, None, requested_by="dpo", reason="x", request_id="req-o")
    job = queue.find("erasure:req-o")
    assert job is not None and job.payload == {"request_id": req.request_id}


def test_submitted_requests_run_in_process_and_erase_runs_its_own_job(ks: Keyshred) -> None:
    for subject in (VICTIM, "carol"):
        ks.memories.put(subject, ("m",), "k", "note")
    a = ks.erasure.submit(VICTIM, requested_by="dpo", reason="x")
    b = ks.erasure.submit("carol", scope="default", requested_by="dpo", reason="x")
    assert a.state == b.state == "requested"
    assert ks.jobs.run_pending() == 2
    assert ks.erasure.status(a.request_id).state == "completed"
    assert ks.erasure.status(b.request_id).state == "completed"
    assert ks.erasure.status(b.request_id).scope == "default"
    ks.memories.put("dave", ("m",), "k", "note")
    done = ks.erase("dave", requested_by="dpo", reason="x")
    assert done.state == "completed"
    job = ks.jobs.queue.find(f"erasure:{done.request_id}")
    assert job is not None and (job.state, job.attempts) == ("succeeded", 1)
    assert ks.jobs.run_pending() == 0
    # Consent withdrawal is a scope erasure request with its job.
    ks.memories.put("erin", ("m",), "k", "note")
    withdrawn = ks.consent.withdraw("erin", "default")
    assert withdrawn.state == "completed"
    wjob = ks.jobs.queue.find(f"erasure:{withdrawn.request_id}")
    assert wjob is not None and wjob.state == "succeeded"


def test_a_stop_between_steps_leaves_the_request_resumable(ks: Keyshred) -> None:
    ks.memories.put(VICTIM, ("m",), "k", "note")
    req = ks.erasure.submit(VICTIM, requested_by="dpo", reason="x", request_id="req-s")
    stop = threading.Event()
    ks.erasure.on_step = lambda step, r: stop.set() if step == "destroy_keys" else None
    assert ks.jobs.run_pending(stop=stop.is_set) == 1
    ks.erasure.on_step = None
    stopped = ks.erasure.status(req.request_id)
    assert stopped.steps_done == ["suppress", "destroy_keys"]
    job = ks.jobs.queue.find("erasure:req-s")
    assert job is not None and (job.state, job.attempts) == ("queued", 0)  # uncounted
    assert ks.jobs.run_pending() == 1
    assert ks.erasure.status(req.request_id).state == "completed"


class Recording:
    """A processor of today: takes the request id as its idempotency key."""

    name = "vendor-new"

    def __init__(self) -> None:
        self.keys: list[str] = []

    def delete(
        self, subject_ref: str, scope: str | None, *, idempotency_key: str
    ) -> ExternalAnswer:
        self.keys.append(idempotency_key)
        return ExternalAnswer(True, "deleted")


class Flaky:
    """A processor of an earlier release (two arguments) that fails ``fails`` times."""

    name = "vendor-old"

    def __init__(self, fails: int) -> None:
        self.fails = fails
        self.calls = 0

    def delete(self, subject_ref: str, scope: str | None) -> ExternalAnswer:
        self.calls += 1
        if self.calls <= self.fails:
            raise OSError("vendor timeout")
        return ExternalAnswer(True, "ok")


def test_external_calls_are_idempotent_and_retried_with_backoff(
    catalog_url: str, tmp_path: Path
) -> None:
    with _store(catalog_url, tmp_path / "data", backoff_base_seconds=0.0) as ks:
        new, old = Recording(), Flaky(fails=2)
        ks.erasure.register_processor(new)
        ks.erasure.register_processor(old)
        ks.memories.put(VICTIM, ("m",), "k", "note")
        req = ks.erasure.submit(VICTIM, requested_by="dpo", reason="x", request_id="req-x")
        assert ks.jobs.run_pending() == 3  # two failed runs, then the one that completes
        done: ErasureRequest = ks.erasure.status("req-x")
        assert done.state == "completed"
        # The processor that answered first was never asked again.
        assert new.keys == [req.request_id] and old.calls == 3
        calls = done.doc["details"]["external"]["calls"]
        assert [c["processor"] for c in calls] == ["vendor-new", "vendor-old"]
        job = ks.jobs.queue.find("erasure:req-x")
        assert job is not None and (job.state, job.attempts) == ("succeeded", 3)


def test_an_erasure_that_keeps_failing_is_dead_lettered(catalog_url: str, tmp_path: Path) -> None:
    with _store(catalog_url, tmp_path / "data", backoff_base_seconds=0.0, max_attempts=3) as ks:
        ks.erasure.register_processor(Flaky(fails=100))
        ks.memories.put(VICTIM, ("m",), "k", "note")
        ks.erasure.submit(VICTIM, requested_by="dpo", reason="x", request_id="req-f")
        assert ks.jobs.run_pending() == 3
        job = ks.jobs.queue.find("erasure:req-f")
        assert job is not None
        assert (job.state, job.attempts, job.last_error) == ("manual_review", 3, "OSError")
        # The request says it too: nothing will retry it (it was left
        # "retryable_failure" with its job dead-lettered).
        req = ks.erasure.status("req-f")
        assert req.state == "manual_review"
        assert ks.jobs.run_pending() == 0


def test_periodic_jobs_run_once_per_period_across_workers(ks: Keyshred) -> None:
    config: Config = ks.config.model_copy(
        update={
            "jobs": ks.config.jobs.model_copy(
                update={"retention_every_seconds": 3600, "backup_maintain_every_seconds": 0}
            )
        }
    )
    ks.config = config
    one, two = Worker(ks), Worker(ks)
    at = 1_800_000_000.0
    assert one.enqueue_periodic(at) == two.enqueue_periodic(at + 10)  # the same job
    assert len(ks.jobs.queue.list(kinds=["retention"])) == 1
    assert ks.jobs.run_pending() == 1
    (job,) = ks.jobs.queue.list(kinds=["retention"])
    assert job.state == "succeeded"
    assert len(ks.audit.events(event="retention.run")) == 1
    one.enqueue_periodic(at + 3600)  # the next period: a new job
    assert len(ks.jobs.queue.list(kinds=["retention"])) == 2


def test_store_metrics_report_queue_depth_and_age(ks: Keyshred) -> None:
    ks.erasure.submit(VICTIM, requested_by="dpo", reason="x")
    samples = StoreMetrics(ks.catalog, ks.keyring.store, ks.jobs.queue).samples()
    depth = {s["labels"]["state"]: s["value"] for s in samples if s["name"] == "keyshred_jobs"}
    assert depth == {"queued": 1.0, "running": 0.0, "succeeded": 0.0, "manual_review": 0.0}
    (age,) = [s for s in samples if s["name"] == "keyshred_jobs_oldest_queued_seconds"]
    assert float(age["value"]) >= 0  # type: ignore[arg-type]


def test_the_worker_metrics_endpoint_serves_process_and_queue_metrics(ks: Keyshred) -> None:
    import socket
    import urllib.request

    from keyshred.cli import _serve_metrics

    ks.erasure.submit(VICTIM, requested_by="dpo", reason="x")
    with socket.socket() as probe:  # a free loopback port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server, thread = _serve_metrics(ks, port)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
            text = resp.read().decode()
    finally:
        server.shutdown()
        thread.join(timeout=30)
    assert 'keyshred_jobs{state="queued"} 1.0' in text
    assert "keyshred_jobs_oldest_queued_seconds" in text
    assert 'keyshred_erasure_requests_total{state="requested"} 1.0' in text  # the process's
    assert VICTIM not in text and ks.subject_ref(VICTIM) not in text


def test_requests_an_earlier_release_left_unfinished_get_their_job(
    catalog_url: str, tmp_path: Path
) -> None:
    from keyshred.storage.schema import VERSION_TABLE

    data = tmp_path / "data"
    with _store(catalog_url, data) as ks:
        for subject in (VICTIM, "bob"):
            ks.memories.put(subject, ("m",), "k", "note")
        ks.erasure.submit(VICTIM, requested_by="dpo", reason="x", request_id="req-old")
        ks.erase("bob", requested_by="dpo", reason="x", request_id="req-done")
        config = ks.config
        url = str(ks._catalog.engine.url.render_as_string(hide_password=False))
    engine = sa.create_engine(url)
    try:  # the catalog as revision 0006 left it: no job table
        with engine.begin() as conn:
            conn.execute(sa.text("DROP TABLE ks_jobs"))
            conn.execute(sa.text(f"UPDATE {VERSION_TABLE} SET version_num = '0006'"))
    finally:
        engine.dispose()
    with Keyshred.open(data, config, embeddings=bag_of_words) as ks:
        job = ks.jobs.queue.find("erasure:req-old")
        assert job is not None and (job.state, job.payload) == ("queued", {"request_id": "req-old"})
        assert ks.jobs.queue.find("erasure:req-done") is None  # nothing left to do
        assert ks.jobs.run_pending() == 1
        assert ks.erasure.status("req-old").state == "completed"


def test_requests_0007_left_without_a_job_get_one(catalog_url: str, tmp_path: Path) -> None:
    """Ids with a space or an ``@`` (0007 could not give them a job) get theirs from
    0009; a request on legal hold gets its job when the hold is released."""
    from keyshred.storage.schema import VERSION_TABLE

    data = tmp_path / "data"
    with _store(catalog_url, data) as ks:
        for subject in (VICTIM, "bob"):
            ks.memories.put(subject, ("m",), "k", "note")
        odd = ks.erasure.submit(VICTIM, requested_by="dpo", reason="x", request_id="ticket 7@crm")
        assert ks.jobs.queue.find("erasure:ticket 7@crm") is not None  # today: a job at once
        hold = ks.erasure.place_hold("bob", reason="litigation", owner="legal")
        held = ks.erase("bob", requested_by="dpo", reason="x", request_id="req-held")
        assert held.state == "legal_hold"
        config = ks.config
        url = str(ks._catalog.engine.url.render_as_string(hide_password=False))
    engine = sa.create_engine(url)
    try:  # the catalog as 0008 left it after 0007: neither request has a job
        with engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM ks_jobs"))
            conn.execute(sa.text(f"UPDATE {VERSION_TABLE} SET version_num = '0008'"))
    finally:
        engine.dispose()
    with Keyshred.open(data, config, embeddings=bag_of_words) as ks:
        job = ks.jobs.queue.find("erasure:ticket 7@crm")
        assert job is not None and job.payload == {"request_id": odd.request_id}
        assert ks.jobs.queue.find("erasure:req-held") is None
        assert ks.jobs.run_pending() == 1
        assert ks.erasure.status(odd.request_id).state == "completed"
        ks.erasure.release_hold(hold.hold_id)
        assert ks.jobs.queue.find("erasure:req-held") is not None
        assert ks.jobs.run_pending() == 1
        assert ks.erasure.status("req-held").state == "completed"


def test_a_released_hold_queues_its_requests_again(ks: Keyshred) -> None:
    ks.memories.put(VICTIM, ("m",), "k", "note")
    hold = ks.erasure.place_hold(VICTIM, reason="case-7", owner="legal")
    req = ks.erasure.submit(VICTIM, requested_by="dpo", reason="x")
    assert ks.jobs.run_pending() == 1
    assert ks.erasure.status(req.request_id).state == "legal_hold"
    job = ks.jobs.queue.find(f"erasure:{req.request_id}")
    assert job is not None and job.state == "succeeded"
    ks.erasure.release_hold(hold.hold_id)
    job = ks.jobs.queue.find(f"erasure:{req.request_id}")
    assert job is not None and (job.state, job.attempts) == ("queued", 0)
    assert ks.jobs.run_pending() == 1
    assert ks.erasure.status(req.request_id).state == "completed"


def test_a_process_of_another_pid_namespace_is_never_known_dead_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two containers with one host name (an image's default) but their own pid
    namespaces: a pid in the other's lease is no process of ours, dead or alive."""
    import os

    from keyshred import leases

    ours = leases.host()
    real_readlink = os.readlink

    def other_namespace(path: Any) -> str:
        return "pid:[4026599999]" if str(path) == "/proc/self/ns/pid" else real_readlink(path)

    monkeypatch.setattr(os, "readlink", other_namespace)
    theirs = leases.host.__wrapped__()  # type: ignore[attr-defined]
    assert theirs != ours
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert leases.dead_here(f"{ours}:{gone.pid}:x")
    assert not leases.dead_here(f"{theirs}:{gone.pid}:x")


@pytest.mark.parametrize("catalog_url", ["sqlite"], indirect=True)
def test_close_waits_for_a_running_job_which_goes_back_to_the_queue(
    catalog_url: str, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    ks = _store(catalog_url, data)
    ks.memories.put(VICTIM, ("m",), "k", "note")
    req = ks.erasure.submit(VICTIM, requested_by="dpo", reason="x", request_id="req-c")
    inside, release = threading.Event(), threading.Event()

    def hold(step: str, _req: ErasureRequest) -> None:
        if step == "destroy_keys":
            inside.set()
            assert release.wait(30)

    ks._erasure.on_step = hold
    ran: list[int] = []
    worker = threading.Thread(target=lambda: ran.append(ks.jobs.run_pending()))
    worker.start()
    assert inside.wait(30)
    closer = threading.Thread(target=ks.close)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive()  # waiting for the job, not closing under it
    release.set()
    closer.join(30)
    worker.join(30)
    assert not closer.is_alive() and ran == [1]
    with Keyshred.open(data, ks.config, embeddings=bag_of_words) as again:
        job = again.jobs.queue.find("erasure:req-c")
        assert job is not None and (job.state, job.attempts) == ("queued", 0)
        stopped = again.erasure.status(req.request_id)
        assert "destroy_keys" in stopped.steps_done and stopped.attempts == 0
        assert again.jobs.run_pending() == 1
        assert again.erasure.status(req.request_id).state == "completed"


@pytest.mark.parametrize("catalog_url", ["sqlite"], indirect=True)
def test_two_requests_run_side_by_side_in_one_process(catalog_url: str, tmp_path: Path) -> None:
    with _store(catalog_url, tmp_path / "data") as ks:
        for subject in (VICTIM, "bob"):
            ks.memories.put(subject, ("m",), "k", "note")
        both_inside = threading.Barrier(2, timeout=30)

        def meet(step: str, _req: ErasureRequest) -> None:
            if step == "closure":
                both_inside.wait()  # a per-process lock would leave one waiting here

        ks._erasure.on_step = meet
        done: list[str] = []
        threads = [
            threading.Thread(
                target=lambda s=s: done.append(ks.erase(s, requested_by="dpo", reason="x").state)
            )
            for s in (VICTIM, "bob")
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert done == ["completed", "completed"]
