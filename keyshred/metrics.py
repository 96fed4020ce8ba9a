"""Prometheus metrics (text exposition format). Labels hold states, step names and
store names only: never a subject id, a subject_ref or any value."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

__all__ = ["BUCKETS", "Metrics"]

BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 300.0, 3600.0)


class Metrics:
    """One registry per store (tests and several stores in one process stay apart)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._states = Counter(
            "keyshred_erasure_requests",
            "Erasure requests entering each state",
            ["state"],
            registry=self.registry,
        )
        self._failures = Counter(
            "keyshred_erasure_step_failures",
            "Erasure steps that failed (retried on resume)",
            ["step"],
            registry=self.registry,
        )
        self._retries = Counter(
            "keyshred_erasure_retries",
            "Erasure runs that resumed a request which had stopped before",
            registry=self.registry,
        )
        self._stale = Counter(
            "keyshred_stale_jobs_skipped",
            "Writes refused because they carried an older deletion epoch",
            registry=self.registry,
        )
        self._token_flush = Counter(
            "keyshred_token_flush_failures",
            "Background flushes of group-committed tokens that failed (retried)",
            registry=self.registry,
        )
        self._online = Histogram(
            "keyshred_erasure_online_seconds",
            "Time from an erasure request to the subject's suppression",
            buckets=BUCKETS,
            registry=self.registry,
        )
        self._completion = Histogram(
            "keyshred_erasure_completion_seconds",
            "Time from an erasure request to its signed receipt",
            buckets=BUCKETS,
            registry=self.registry,
        )

    def state(self, state: str) -> None:
        self._states.labels(state=state).inc()

    def failure(self, step: str) -> None:
        self._failures.labels(step=step).inc()

    def retry(self) -> None:
        self._retries.inc()

    def stale_job(self) -> None:
        self._stale.inc()

    def token_flush_failure(self) -> None:
        self._token_flush.inc()

    def online_latency(self, seconds: float) -> None:
        self._online.observe(max(0.0, seconds))

    def completion_latency(self, seconds: float) -> None:
        self._completion.observe(max(0.0, seconds))

    def samples(self) -> list[dict[str, object]]:
        """Every sample (name, labels, value), for ``keyshred metrics --json``."""
        return [
            {"name": sample.name, "labels": dict(sample.labels), "value": sample.value}
            for family in self.registry.collect()
            for sample in family.samples
        ]

    def render(self) -> str:
        return generate_latest(self.registry).decode("utf-8")
