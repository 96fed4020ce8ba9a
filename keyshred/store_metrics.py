"""Metrics read from what the store keeps, not from one process's counters.

``keyshred metrics`` runs in a fresh process: its own counters (``keyshred.metrics``)
are all zero, which told an operator nothing. These families are computed at each
scrape from the catalog and the key store, so any process reports the same numbers:

- ``keyshred_erasure_requests_current{state}``: requests in each state now;
- ``keyshred_erasure_completion_seconds``: request to signed receipt, for every
  completed request (a histogram over the stored requests' times);
- ``keyshred_audit_events{event}``: audit events recorded, by event name;
- ``keyshred_keys{kind}``: data keys (``dek``, of which ``shared``), tombstones and
  secrets in the key store;
- ``keyshred_tokens_stored``: vault tokens in the catalog;
- ``keyshred_jobs{state}``: jobs in each state now (``keyshred.jobs``);
- ``keyshred_jobs_oldest_queued_seconds``: how long the oldest queued job has
  waited (the database's clock), 0 with none queued.

Labels are state, event and kind names only: never a subject id, a subject_ref or
a value. The completion histogram reads two timestamps per completed request; at
millions of requests, scrape the workers' endpoints instead (issue 22).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from keyshred.db import utc
from keyshred.jobs import JobQueue
from keyshred.metrics import BUCKETS
from keyshred.schema import audit_events, deletion_requests
from keyshred.storage.catalog import Catalog
from keyshred.vault.schema import tokens

__all__ = ["StoreMetrics"]


class StoreMetrics:
    """The store's persisted state as Prometheus families (see the module docstring)."""

    def __init__(self, catalog: Catalog, keystore: Any, jobs: JobQueue | None = None) -> None:
        self._catalog = catalog
        self._keystore = keystore
        self._jobs = jobs
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)  # a collector: it has collect()

    def collect(self) -> Iterator[Metric]:
        with self._catalog.engine.connect() as conn:
            states = conn.execute(
                sa.select(deletion_requests.c.state, sa.func.count()).group_by(
                    deletion_requests.c.state
                )
            ).all()
            times = conn.execute(
                sa.select(deletion_requests.c.created_at, deletion_requests.c.updated_at).where(
                    deletion_requests.c.state == "completed"
                )
            ).all()
            events = conn.execute(
                sa.select(audit_events.c.event, sa.func.count()).group_by(audit_events.c.event)
            ).all()
            stored_tokens = conn.execute(sa.select(sa.func.count()).select_from(tokens)).scalar()
        current = GaugeMetricFamily(
            "keyshred_erasure_requests_current", "Erasure requests in each state", labels=["state"]
        )
        for state, n in sorted(states):
            current.add_metric([str(state)], float(n))
        yield current
        yield _histogram(
            "keyshred_erasure_completion_seconds",
            "Time from an erasure request to its signed receipt (completed requests)",
            [
                (utc(done) - utc(created)).total_seconds()  # type: ignore[operator]
                for created, done in times
            ],
        )
        audited = CounterMetricFamily(
            "keyshred_audit_events", "Audit events recorded, by event", labels=["event"]
        )
        for event, n in sorted(events):
            audited.add_metric([str(event)], float(n))
        yield audited
        keys = GaugeMetricFamily(
            "keyshred_keys", "Keys, tombstones and secrets in the key store", labels=["kind"]
        )
        for kind, n in sorted(self._keystore.counts().items()):
            keys.add_metric([str(kind)], float(n))
        yield keys
        yield GaugeMetricFamily(
            "keyshred_tokens_stored", "Vault tokens stored in the catalog", value=stored_tokens or 0
        )
        if self._jobs is not None:
            depth = GaugeMetricFamily("keyshred_jobs", "Jobs in each state", labels=["state"])
            for state, n in self._jobs.depth().items():
                depth.add_metric([state], float(n))
            yield depth
            yield GaugeMetricFamily(
                "keyshred_jobs_oldest_queued_seconds",
                "How long the oldest queued job has waited since it was enqueued",
                value=self._jobs.oldest_queued_age_seconds(),
            )

    def samples(self) -> list[dict[str, object]]:
        """Every sample (name, labels, value), for ``keyshred metrics --json``."""
        return [
            {"name": sample.name, "labels": dict(sample.labels), "value": sample.value}
            for family in self.registry.collect()
            for sample in family.samples
        ]

    def render(self) -> str:
        return generate_latest(self.registry).decode("utf-8")


def _histogram(name: str, documentation: str, values: list[float]) -> HistogramMetricFamily:
    buckets: list[tuple[str, float]] = []
    for bound in BUCKETS:
        buckets.append((repr(bound), float(sum(1 for v in values if v <= bound))))
    buckets.append(("+Inf", float(len(values))))
    return HistogramMetricFamily(
        name, documentation, buckets=buckets, sum_value=float(sum(max(0.0, v) for v in values))
    )
