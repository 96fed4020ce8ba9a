"""Probe strings (issue 22 follow-up, found by attacking the first version): they
live only in the memory of the process that recorded the request, so

- ``ks.erase(probes=…)`` leases its request's job in the transaction that records
  it: a worker cannot start the request (and verify it without the probes) first;
- a request finished by another process says in its receipt that the probe
  search was not run, instead of leaving it out;
- nothing keeps a probe once its request is settled here (completed, rejected)
  or, failing that, after an hour."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from keyshred import Keyshred
from tests.test_jobs import _store

PROBE = "zqprobe-4c1d-kayak"


def _checks(ks: Keyshred, request_id: str) -> dict[str, Any]:
    receipt = ks.erasure.receipt(request_id)
    assert receipt is not None
    return {c.name: c for c in receipt.verification}


def test_erase_leases_its_job_at_once_so_no_worker_takes_its_probes(
    catalog_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _store(catalog_url, tmp_path / "a") as ks:
        worker = (
            Keyshred.open(tmp_path / "a", ks.config) if catalog_url.startswith("sqlite") else None
        )
        other = worker or _store(catalog_url, tmp_path / "b")
        try:
            ks.memories.put("alice", ("m",), "k", {"text": f"{PROBE} alice"})
            original = ks._erasure.take_claimed
            raced: list[int] = []

            def race(request_id: str) -> Any:
                # A worker polls between the request's commit and this call's run.
                raced.append(other.jobs.run_pending())
                return original(request_id)

            monkeypatch.setattr(ks._erasure, "take_claimed", race)
            req = ks.erase("alice", requested_by="dpo", reason="gdpr", probes=[PROBE])
            assert raced == [0]  # the worker found nothing it could claim
            assert req.state == "completed"
            checks = _checks(ks, req.request_id)
            probe = checks["probes found nowhere (key and semantic search)"]
            assert probe.passed and probe.detail == "0 hits"
            assert len(ks._erasure._probes) == 0  # settled here: gone from memory
            job = ks.jobs.queue.find(f"erasure:{req.request_id}")
            assert job is not None and (job.state, job.attempts) == ("succeeded", 1)
        finally:
            other.close()


def test_a_request_finished_elsewhere_says_its_probes_were_not_searched(
    catalog_url: str, tmp_path: Path
) -> None:
    with _store(catalog_url, tmp_path / "a") as ks:
        ks.memories.put("bob", ("m",), "k", {"text": f"{PROBE} bob"})
        req = ks.erasure.request(
            ks.subject_ref("bob"), None, requested_by="dpo", reason="gdpr", probes=[PROBE]
        )
        # Another process (nothing of this one's memory) runs it: simulated by
        # forgetting the probes, as that process never had them.
        ks._erasure._probes.drop(req.request_id)
        assert ks.jobs.run_pending() == 1
        done = ks.erasure.status(req.request_id)
        assert done.state == "completed"
        check = _checks(ks, req.request_id)["probe search not run"]
        assert check.passed and "1 probes given" in check.detail
        assert PROBE not in check.detail


@pytest.mark.parametrize("catalog_url", ["sqlite"], indirect=True)
def test_no_probe_is_kept_for_a_rejected_or_an_expired_request(
    catalog_url: str, tmp_path: Path
) -> None:
    with _store(catalog_url, tmp_path / "a") as ks:
        ks.memories.put("carol", ("m",), "k", {"text": "carol"})
        # Metadata that is not plain (it could be personal data): recorded as
        # rejected, and its probes are not kept.
        req = ks.erase(
            "carol", requested_by="Carol Smith <carol@example.org>", reason="x", probes=[PROBE]
        )
        assert req.state == "rejected"
        assert len(ks._erasure._probes) == 0
        probes = ks._erasure._probes
        probes._ttl = 0.0
        probes.keep("r1", [PROBE])
        assert len(probes) == 0 and probes.get("r1") == []
        assert PROBE not in repr(probes)
