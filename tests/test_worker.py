"""``keyshred worker`` processes running erasure jobs (``keyshred.worker``): a worker
SIGKILLed inside each erasure step leaves the request to another worker, which
completes it with one receipt and one ``erasure.completed`` event; racing workers
run each step once; SIGTERM finishes the step in progress and exits 0, leaving the
request resumable; ``keyshred requests list --state`` shows requests with their
jobs. On SQLite and PostgreSQL, and on the shared profile (PostgreSQL catalog and
key store, OpenBao Transit, moto's S3)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from keyshred import Config, Keyshred
from keyshred.cli import app
from keyshred.erasure import STEPS
from keyshred.errors import SubjectErased, SubjectSuppressed
from keyshred.receipts import verify_receipt
from keyshred.schema import deletion_requests
from tests import zygote
from tests.conftest import pg_schema, pg_url
from tests.erasure_worker import register_producers
from tests.servers import Server, new_bucket
from tests.storage.conftest import make_config
from tests.storage.test_vectors import bag_of_words

WORKER = Path(__file__).with_name("jobs_worker.py")
VICTIM = "victim@example.org"
PROBE = "zqjobprobe-5c19"
NO_PERIODIC = {"retention_every_seconds": 0, "backup_maintain_every_seconds": 0}


def _config(catalog_url: str | None, **jobs: Any) -> Config:
    config = make_config(catalog_url, flush_records=4)
    return config.model_copy(
        update={"jobs": config.jobs.model_copy(update={**NO_PERIODIC, **jobs})}
    )


def _url(catalog_url: str) -> str | None:
    return catalog_url if catalog_url.startswith("postgresql") else None


def populate(ks: Keyshred, subjects: tuple[str, ...] = (VICTIM,)) -> None:
    """The victim's memories (indexed), a bystander's, and derived assets built from
    both (one rebuilt by the erasure, one dropped)."""
    register_producers(ks)
    for subject in subjects:
        for i in range(6):
            ks.memories.put(subject, ("m",), f"k{i}", f"{PROBE} {subject} {i}", index=True)
    src = ks.memories.put("bob", ("m",), "b", "bob likes chess", index=True)
    victim_src = ks.memories.get(subjects[0], ("m",), "k0")
    assert victim_src is not None
    for name, producer in (("summary", "concat"), ("digest", "digest")):
        ks.derived.register(
            name,
            subject="bob",
            namespace=("s",),
            key=name,
            value=f"{PROBE} {name}",
            produced_from=[victim_src.memory_id, src.memory_id],
            producer=producer,
            producer_version="1",
            index=name == "digest",
        )


def run_worker(
    data: Path, config: Config, mode: str, arg: str = "", *, killed: bool = False
) -> str:
    proc = zygote.run(
        [sys.executable, str(WORKER), str(data), config.model_dump_json(), mode, arg],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    expected = -signal.SIGKILL if killed else 0
    assert proc.returncode == expected, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def events(ks: Keyshred, request_id: str) -> tuple[int, dict[str, int]]:
    """``erasure.completed`` events of the request, and state events per step."""
    completed = ks.audit.events(request_id=request_id, event="erasure.completed")
    steps: dict[str, int] = {}
    for e in ks.audit.events(request_id=request_id, event="erasure.state"):
        step = e.data.get("step")
        if step is not None:
            steps[step] = steps.get(step, 0) + 1
    return len(completed), steps


def check_completed_once(ks: Keyshred, request_id: str, subject: str = VICTIM) -> None:
    req = ks.erasure.status(request_id)
    assert req.state == "completed", (req.state, req.error)
    completed, steps = events(ks, request_id)
    assert completed == 1
    assert steps and all(n == 1 for n in steps.values()), steps
    receipt = ks.erasure.receipt(request_id)
    assert receipt is not None
    verify_receipt(receipt, ks.keyring.signer().public_key)
    assert all(c.passed for c in receipt.verification)
    job = ks.jobs.queue.find(f"erasure:{request_id}")
    assert job is not None and job.state == "succeeded"
    for call in (
        lambda: ks.memories.get(subject, ("m",), "k1"),
        lambda: ks.memories.put(subject, ("m",), "new", 1),
    ):
        with pytest.raises((SubjectSuppressed, SubjectErased)):
            call()
    assert ks.memories.get("bob", ("m",), "b") is not None
    rebuilt = ks.memories.get("bob", ("s",), "digest")
    assert rebuilt is not None and rebuilt.value == "digest of 1 memories"


def no_probe_in_files(data: Path) -> None:
    for path in (p for p in data.rglob("*") if p.is_file()):
        assert PROBE.encode() not in path.read_bytes(), path


# On one data folder (SQLite and PostgreSQL catalogs) the kill lands in a sample of
# the steps: the first, the key destruction, a drop, the rebuild, the backups and the
# receipt. Every step is killed in on the shared profile below, and every step's crash
# safety on one machine is tests/test_erasure_faults.py's: all 15 × 3 here cost
# several minutes of the suite for no other path.
_SAMPLED = ("suppress", "destroy_keys", "drop_memories", "derived", "backups", "receipt")


@pytest.mark.parametrize("step", [s for s in STEPS if s in _SAMPLED])
def test_worker_killed_inside_a_step_and_another_completes(
    step: str, catalog_url: str, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    config = _config(_url(catalog_url))
    with Keyshred.init(data, config, embeddings=bag_of_words) as ks:
        populate(ks)
        ks.erasure.submit(VICTIM, requested_by="dpo", reason="job-kill", request_id="req-kill")
    run_worker(data, config, "kill", step, killed=True)
    with Keyshred.open(data, config, embeddings=bag_of_words) as ks:
        req = ks.erasure.status("req-kill")
        assert step not in req.steps_done  # killed inside it: not recorded
        job = ks.jobs.queue.find("erasure:req-kill")
        assert job is not None and job.state == "running"  # the dead worker's lease
    out = run_worker(data, config, "drain")
    assert json.loads(out.splitlines()[-1])["ran"] == 1
    with Keyshred.open(data, config, embeddings=bag_of_words) as ks:
        register_producers(ks)
        check_completed_once(ks, "req-kill")
        job = ks.jobs.queue.find("erasure:req-kill")
        assert job is not None and job.attempts == 2  # the killed run counted
    no_probe_in_files(data)


def test_two_workers_racing_run_each_step_once(catalog_url: str, tmp_path: Path) -> None:
    data = tmp_path / "data"
    config = _config(_url(catalog_url))
    subjects = (VICTIM, "carol@example.org", "dave@example.org")
    with Keyshred.init(data, config, embeddings=bag_of_words) as ks:
        populate(ks, subjects)
        for n, subject in enumerate(subjects):
            ks.erasure.submit(subject, requested_by="dpo", reason="race", request_id=f"req-{n}")
    racers = [
        zygote.Popen(
            [sys.executable, str(WORKER), str(data), config.model_dump_json(), "race"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for p in racers:
        assert p.stdout is not None and p.stdout.readline().strip() == "READY"
    for p in racers:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [p.communicate(timeout=600) for p in racers]
    assert all(p.returncode == 0 for p in racers), [e[-2000:] for _, e in outs]
    ran = sum(json.loads(o.splitlines()[-1])["ran"] for o, _ in outs)
    assert ran == len(subjects)  # each job ran once, by one of them
    with Keyshred.open(data, config, embeddings=bag_of_words) as ks:
        register_producers(ks)
        for n, subject in enumerate(subjects):
            req = ks.erasure.status(f"req-{n}")
            assert req.state == "completed", req.error
            completed, steps = events(ks, f"req-{n}")
            assert completed == 1 and all(v == 1 for v in steps.values()), steps
            with pytest.raises((SubjectSuppressed, SubjectErased)):
                ks.memories.get(subject, ("m",), "k1")


def test_sigterm_finishes_the_step_and_exits_0(catalog_url: str, tmp_path: Path) -> None:
    data = tmp_path / "data"
    config = _config(_url(catalog_url))
    with Keyshred.init(data, config, embeddings=bag_of_words) as ks:
        populate(ks)
        ks.erasure.submit(VICTIM, requested_by="dpo", reason="term", request_id="req-term")
    proc = zygote.Popen(
        [sys.executable, str(WORKER), str(data), config.model_dump_json(), "term", "drop_vectors"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "IN STEP", proc.stderr.read() if proc.stderr else ""
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    with Keyshred.open(data, config, embeddings=bag_of_words) as ks:
        req = ks.erasure.status("req-term")
        # The step in progress finished and was recorded; the next did not start.
        assert "drop_vectors" in req.steps_done
        assert "drop_vault" not in req.steps_done
        assert req.state == "propagating"
        with ks._catalog.engine.connect() as conn:
            owner = conn.execute(
                sa.select(deletion_requests.c.lease_owner).where(
                    deletion_requests.c.request_id == "req-term"
                )
            ).scalar()
        assert owner is None  # the request's lease was released
        job = ks.jobs.queue.find("erasure:req-term")
        assert job is not None and job.state == "queued" and job.attempts == 0
    run_worker(data, config, "drain")
    with Keyshred.open(data, config, embeddings=bag_of_words) as ks:
        register_producers(ks)
        check_completed_once(ks, "req-term")


def test_requests_list_by_state_through_the_cli(tmp_path: Path) -> None:
    data = tmp_path / "data"
    config = _config(None)
    with Keyshred.init(data, config, embeddings=bag_of_words) as ks:
        ks.memories.put(VICTIM, ("m",), "k", "note")
        ks.memories.put("bob", ("m",), "k", "note")
        waiting = ks.erasure.submit(VICTIM, requested_by="dpo", reason="x", request_id="req-w")
        done = ks.erase("bob", requested_by="dpo", reason="x", request_id="req-d")
        assert done.state == "completed" and waiting.state == "requested"
        victim_ref = ks.subject_ref(VICTIM)
    runner = CliRunner()
    result = runner.invoke(
        app, ["requests", "list", "--path", str(data), "--state", "requested", "--json"]
    )
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output)["requests"]
    assert row["request_id"] == "req-w"
    assert row["subject_ref"] == victim_ref
    assert (row["state"], row["step"], row["job_state"]) == ("requested", "suppress", "queued")
    assert VICTIM not in result.output
    states = ["--state", "requested", "--state", "completed"]
    both = runner.invoke(app, ["requests", "list", "-p", str(data), *states, "--json"])
    assert both.exit_code == 0, both.output
    listed = {r["request_id"]: r["job_state"] for r in json.loads(both.output)["requests"]}
    assert listed == {"req-w": "queued", "req-d": "succeeded"}
    table = runner.invoke(app, ["requests", "list", "-p", str(data)], env={"COLUMNS": "200"})
    assert table.exit_code == 0 and "req-w" in table.output and "succeeded" in table.output
    jobs = runner.invoke(app, ["jobs", "list", "-p", str(data), "--state", "queued", "--json"])
    assert jobs.exit_code == 0, jobs.output
    (job,) = json.loads(jobs.output)["jobs"]
    assert job["payload"] == {"request_id": "req-w"} and job["kind"] == "erasure"
    # A misspelt state says so (it listed nothing before, as if none were stuck).
    for group in ("requests", "jobs"):
        bad = runner.invoke(app, [group, "list", "-p", str(data), "--state", "propagatin"])
        assert bad.exit_code == 2, bad.output
        assert "unknown state propagatin" in bad.output


# -- the shared profile: PostgreSQL catalog and key store, OpenBao, moto's S3 --------


@pytest.fixture
def shared_config(
    openbao: Server, moto: Server, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Config]:
    with pg_schema() as schema:
        options = f"options=-csearch_path%3D{schema}"
        bucket = new_bucket(moto)
        monkeypatch.setenv("VAULT_TOKEN", openbao.token)  # the workers inherit it
        base = _config(pg_url(schema))
        config = Config.model_validate(
            {
                **base.model_dump(),
                "profile": "distributed",
                "storage": {
                    **base.storage.model_dump(),
                    "uri": f"s3://{bucket}/parts",
                },
                "keyring": {"store_url": f"postgresql://postgres@127.0.0.1:5432/test?{options}"},
                "kek": {
                    "provider": "vault",
                    "vault": {"url": openbao.url, "key": f"ks-jobs-{uuid.uuid4().hex[:10]}"},
                },
                "vectors": {"uri": f"s3://{bucket}/vectors"},
                "s3": {"endpoint_url": moto.url, "region": "us-east-1"},
            }
        )
        yield config


@pytest.mark.parametrize("step", STEPS)
def test_shared_profile_worker_killed_inside_each_step(
    step: str, shared_config: Config, tmp_path: Path
) -> None:
    """Three machines' folders: one records the request, one worker is killed inside
    the step, a third worker completes it."""
    folders = [tmp_path / f"w{i}" for i in range(3)]
    with Keyshred.init(folders[0], shared_config, embeddings=bag_of_words) as ks:
        populate(ks)
        ks.erasure.submit(VICTIM, requested_by="dpo", reason="shared", request_id="req-shared")
    for folder in folders[1:]:
        Keyshred.init(folder, shared_config, embeddings=bag_of_words).close()
    run_worker(folders[1], shared_config, "kill", step, killed=True)
    run_worker(folders[2], shared_config, "drain")
    with Keyshred.open(folders[0], shared_config, embeddings=bag_of_words) as ks:
        register_producers(ks)
        check_completed_once(ks, "req-shared")
