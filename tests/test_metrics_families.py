"""Issue 22's metric families: erasure latency to suppressed / crypto-erased /
completed (observed once per request, when the step is recorded), job retries, KEK
calls by outcome, cache evictions; label values are names, never data; ``serve``
exposes registries over HTTP on loopback."""

from __future__ import annotations

import socket
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from keyshred import Keyshred
from keyshred.errors import InvalidInput
from keyshred.metrics import Metrics, serve
from keyshred.store_metrics import StoreMetrics
from tests.storage.conftest import make_config
from tests.storage.test_vectors import bag_of_words

NS = ("memories",)
LATENCIES = (
    "keyshred_erasure_suppressed_seconds",
    "keyshred_erasure_crypto_erased_seconds",
    "keyshred_erasure_completed_seconds",
)


@pytest.fixture
def ks(catalog_url: str, tmp_path: Path) -> Iterator[Keyshred]:
    store = Keyshred.init(tmp_path / "data", make_config(catalog_url), embeddings=bag_of_words)
    yield store
    store.close()


def value(metrics: Metrics, name: str, **labels: str) -> float | None:
    for sample in metrics.samples():
        if sample["name"] == name and sample["labels"] == labels:
            return float(sample["value"])  # type: ignore[arg-type]
    return None


def test_erasure_latencies_observed_once_each_and_no_probe_in_the_text(ks: Keyshred) -> None:
    probe = f"zq{uuid.uuid4().hex[:12]}"
    subject = f"subject-{probe}@example.org"
    ks.memories.put(subject, NS, "k", {"text": f"{probe} likes kayaks"}, index=["text"])
    assert ks.memories.search(subject, NS, query=f"{probe} kayaks")
    req = ks.erase(subject, requested_by="dpo", reason="gdpr-art17", probes=[probe])
    assert req.state == "completed"
    for name in LATENCIES:
        assert value(ks.metrics, f"{name}_count", kind="erasure") == 1.0, name
        total = value(ks.metrics, f"{name}_sum", kind="erasure")
        assert total is not None and total >= 0.0
    # Ordered as the steps are: suppressed, then crypto-erased, then completed.
    sums = [value(ks.metrics, f"{n}_sum", kind="erasure") for n in LATENCIES]
    assert sums == sorted(sums)  # type: ignore[type-var]
    text = ks.metrics.render()
    for secret in (probe, subject, ks.subject_ref(subject), req.subject_ref):
        assert secret not in text
        assert secret.lower() not in text.lower()


def test_a_step_killed_after_its_work_is_observed_once(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run dies after the keys are destroyed but before the step is recorded: the
    resumed run does the step again, and crypto-erasure is still observed once."""
    ks.memories.put("ann", NS, "k", "a value")
    coordinator: Any = ks._erasure
    real = coordinator._step_destroy_keys

    def destroy_then_fail(req: Any) -> Any:
        real(req)
        raise OSError("the worker died here")

    monkeypatch.setattr(coordinator, "_step_destroy_keys", destroy_then_fail)
    req = ks.erase("ann", requested_by="dpo", reason="request")
    assert req.state == "retryable_failure"
    assert value(ks.metrics, "keyshred_erasure_suppressed_seconds_count", kind="erasure") == 1.0
    assert value(ks.metrics, "keyshred_erasure_crypto_erased_seconds_count", kind="erasure") in (
        None,
        0.0,
    )
    monkeypatch.setattr(coordinator, "_step_destroy_keys", real)
    assert ks.erasure.resume(req.request_id).state == "completed"
    for name in LATENCIES:
        assert value(ks.metrics, f"{name}_count", kind="erasure") == 1.0, name


def test_retries_kek_calls_and_evictions() -> None:
    m = Metrics()
    m.job_retry("erasure")
    m.job_retry("erasure")
    m.job_retry("retention")
    m.kek_call("wrap_many", "ok")
    m.kek_call("unwrap", "retry")
    m.kek_call("unwrap", "error")
    m.kek_call("unwrap", "open")
    m.evicted("dek", 3)
    m.evicted("vectors")
    assert value(m, "keyshred_job_retries_total", kind="erasure") == 2.0
    assert value(m, "keyshred_job_retries_total", kind="retention") == 1.0
    assert value(m, "keyshred_kek_calls_total", op="wrap_many", outcome="ok") == 1.0
    for outcome in ("retry", "error", "open"):
        assert value(m, "keyshred_kek_calls_total", op="unwrap", outcome=outcome) == 1.0
    assert value(m, "keyshred_cache_evictions_total", cache="dek") == 3.0
    assert value(m, "keyshred_cache_evictions_total", cache="vectors") == 1.0
    m.erasure_step_recorded("closure", "erasure", 1.0)  # not a milestone: nothing
    assert value(m, "keyshred_erasure_suppressed_seconds_count", kind="erasure") is None


@pytest.mark.parametrize(
    "bad",
    [
        "alice@example.org",  # an e-mail address
        "ABCDEFGHIJKLMNOPQRSTUVWXYZ",  # upper case
        "mfrggzdfmztwq2lknnwg23tpoa",  # a subject_ref's shape (26 lowercase base32)
        "Alice Smith",
        "x" * 49,
        "",
    ],
)
def test_label_values_that_could_be_data_are_refused(bad: str) -> None:
    m = Metrics()
    for call in (
        lambda: m.job_retry(bad),
        lambda: m.kek_call(bad, "ok"),
        lambda: m.evicted(bad),
        lambda: m.erasure_step_recorded("suppress", bad, 1.0),
    ):
        with pytest.raises(InvalidInput) as info:
            call()
        assert not bad or bad not in str(info.value)
    assert not bad or bad not in m.render()


def test_a_real_subject_ref_is_refused_as_a_label(tmp_path: Path) -> None:
    with Keyshred.init(tmp_path / "d", make_config(), embeddings=bag_of_words) as ks:
        ref = ks.subject_ref("alice")
        with pytest.raises(InvalidInput):
            ks.metrics.evicted(ref)


def test_a_kek_outcome_is_one_of_four() -> None:
    with pytest.raises(InvalidInput):
        Metrics().kek_call("wrap", "timeout")
    with pytest.raises(InvalidInput):
        Metrics().evicted("dek", -1)


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - loopback
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        return str(response.read().decode("utf-8"))


def test_serve_scrapes_over_http_and_closes(ks: Keyshred) -> None:
    ks.memories.put("dan", NS, "k", "v")
    ks.erase("dan", requested_by="dpo", reason="request")
    ks.metrics.job_retry("erasure")
    store = StoreMetrics(ks.catalog, ks.keyring.store)
    with serve(ks.metrics.registry, store.registry, port=0) as server:
        assert server.host == "127.0.0.1"
        text = scrape(server.url)
        assert 'keyshred_erasure_completed_seconds_count{kind="erasure"} 1.0' in text
        assert 'keyshred_job_retries_total{kind="erasure"} 1.0' in text
        # The store's computed families beside the process's own.
        assert 'keyshred_erasure_requests_current{state="completed"} 1.0' in text
        # One family both define is served once (from the first registry named).
        assert text.count("# TYPE keyshred_erasure_completion_seconds histogram") == 1
        assert ks.subject_ref("dan") not in text and "dan" not in text
        port = server.port
    with socket.socket() as probe, pytest.raises(OSError):
        probe.settimeout(5)
        probe.connect(("127.0.0.1", port))


def test_serve_reads_each_registry_at_each_scrape() -> None:
    registry = CollectorRegistry()
    hits = Counter("probe_hits", "Scrapes seen", registry=registry)
    with serve(registry, port=0) as server:
        assert "probe_hits_total 0.0" in scrape(server.url)
        hits.inc(5)
        assert "probe_hits_total 5.0" in scrape(server.url)
    server.close()  # closing twice is a no-op


def test_serve_needs_a_registry() -> None:
    with pytest.raises(InvalidInput):
        serve(port=0)


def test_the_handle_feeds_kek_eviction_and_job_retry_counters(ks: Keyshred) -> None:
    """The families are wired: the handle's KEK provider reports its calls, its
    eviction service the caches it dropped, its job runner the retries."""
    from keyshred.jobs import Job, JobOutcome

    ks.keyring.rotate_kek()  # at least one provider call through the handle's KEK
    kek = sum(
        float(s["value"])  # type: ignore[arg-type]
        for s in ks.metrics.samples()
        if s["name"] == "keyshred_kek_calls_total" and s["labels"].get("outcome") == "ok"  # type: ignore[union-attr]
    )
    assert kek >= 1
    ks.memories.put("alice", NS, "k", {"text": "green tea"}, index=["text"])
    assert ks.erase("alice", requested_by="dpo", reason="gdpr-art17").state == "completed"
    # The SQLite bus delivers in-process, PostgreSQL's NOTIFY through the listener.
    for _ in range(200):
        if value(ks.metrics, "keyshred_cache_evictions_total", cache="keys"):
            break
        time.sleep(0.05)
    assert (value(ks.metrics, "keyshred_cache_evictions_total", cache="keys") or 0) >= 1

    def failing(job: Job, stop: Any) -> JobOutcome:
        del job, stop
        raise OSError("the vendor is down")

    ks.jobs.register("test.fail", failing)
    ks.jobs.queue.enqueue("test.fail", {"thing": "t"})
    ks.jobs.run_pending(kinds=["test.fail"])
    assert value(ks.metrics, "keyshred_job_retries_total", kind="test.fail") == 1.0
