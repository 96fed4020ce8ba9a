"""Prometheus metrics (text exposition format). Labels hold states, step names and
store names only: never a subject id, a subject_ref or any value.

The families a worker's endpoint serves (``serve``; issue 22):

- ``keyshred_erasure_suppressed_seconds{kind}``, ``..._crypto_erased_seconds{kind}``,
  ``..._completed_seconds{kind}``: from a request's creation to its ``suppress``,
  ``destroy_keys`` and ``receipt`` step being recorded (``erasure_step_recorded``),
  by request kind (``erasure``, ``retention``, ``consent-withdrawal`` ...);
- ``keyshred_job_retries_total{kind}``: jobs retried, by job kind (``job_retry``);
- ``keyshred_kek_calls_total{op, outcome}``: KEK provider calls by operation and
  outcome ``ok``/``error``/``retry``/``open`` (the circuit refused it) (``kek_call``);
- ``keyshred_cache_evictions_total{cache}``: entries evicted, by cache (``evicted``).

Their label values are checked names (``_name``): a value that is not a short
lowercase identifier is refused, so no id or value can become a label by mistake.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import Final
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, make_wsgi_app
from prometheus_client.core import Metric

from keyshred.errors import InvalidInput

__all__ = ["BUCKETS", "KEK_OUTCOMES", "MILESTONES", "Metrics", "MetricsServer", "serve"]

BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 300.0, 3600.0)

MILESTONES: Final = {
    "suppress": "suppressed",
    "destroy_keys": "crypto_erased",
    "receipt": "completed",
}
"""The erasure steps whose recording is a latency milestone -> the histogram's word."""

KEK_OUTCOMES: Final = frozenset({"ok", "error", "retry", "open"})

# A label value is a name from the code (a state, a step, a job kind, a cache), never
# data: short, lowercase, no room for an e-mail address, and not a subject_ref's shape
# (26 characters of lowercase base32, keyshred.keyring.Keyring.subject_ref).
_NAME = re.compile(r"[a-z][a-z0-9_.:-]{0,47}")
_REF_SHAPE = re.compile(r"[a-z2-7]{26}")


def _name(what: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value) or _REF_SHAPE.fullmatch(value):
        raise InvalidInput(f"a metric's {what} label is a short lowercase name")
    return value


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
        self._milestones = {
            step: Histogram(
                f"keyshred_erasure_{word}_seconds",
                f"Time from an erasure request's creation to its {step} step recorded",
                ["kind"],
                buckets=BUCKETS,
                registry=self.registry,
            )
            for step, word in MILESTONES.items()
        }
        self._job_retries = Counter(
            "keyshred_job_retries",
            "Jobs retried after a failed attempt, by job kind",
            ["kind"],
            registry=self.registry,
        )
        self._kek_calls = Counter(
            "keyshred_kek_calls",
            "KEK provider calls by operation and outcome (ok, error, retry, open circuit)",
            ["op", "outcome"],
            registry=self.registry,
        )
        self._evictions = Counter(
            "keyshred_cache_evictions",
            "Entries evicted from a cache of keys or decrypted data, by cache",
            ["cache"],
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

    def erasure_step_recorded(self, step: str, kind: str, seconds: float) -> None:
        """A request's ``step`` was recorded ``seconds`` after the request was
        created: observed if the step is a milestone (``MILESTONES``), else nothing."""
        histogram = self._milestones.get(step)
        if histogram is not None:
            histogram.labels(kind=_name("kind", kind)).observe(max(0.0, seconds))

    def job_retry(self, kind: str) -> None:
        self._job_retries.labels(kind=_name("kind", kind)).inc()

    def kek_call(self, op: str, outcome: str) -> None:
        if outcome not in KEK_OUTCOMES:
            raise InvalidInput(f"a KEK call's outcome is one of {sorted(KEK_OUTCOMES)}")
        self._kek_calls.labels(op=_name("op", op), outcome=outcome).inc()

    def evicted(self, cache: str, count: int = 1) -> None:
        if count < 0:
            raise InvalidInput("an eviction count is not negative")
        self._evictions.labels(cache=_name("cache", cache)).inc(count)

    def samples(self) -> list[dict[str, object]]:
        """Every sample (name, labels, value), for ``keyshred metrics --json``."""
        return [
            {"name": sample.name, "labels": dict(sample.labels), "value": sample.value}
            for family in self.registry.collect()
            for sample in family.samples
        ]

    def render(self) -> str:
        return generate_latest(self.registry).decode("utf-8")


class _Union:
    """One collector over several registries (the process's counters and the
    store's computed families share one endpoint). A family that an earlier
    registry already served is left out of a later one: two ``TYPE`` lines for one
    name make a scrape Prometheus rejects whole."""

    def __init__(self, registries: tuple[CollectorRegistry, ...]) -> None:
        self._registries = registries

    def collect(self) -> Iterator[Metric]:
        served: set[str] = set()
        for registry in self._registries:
            for family in registry.collect():
                if family.name not in served:
                    served.add(family.name)
                    yield family


class _QuietHandler(WSGIRequestHandler):
    # The default handler writes one stderr line per scrape.
    def log_message(self, format: str, *args: object) -> None:
        pass


class MetricsServer:
    """The text-exposition endpoint ``serve`` started: ``url``, ``port``, ``close()``."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.host: str = str(server.server_address[0])
        self.port: int = int(server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(*registries: CollectorRegistry, port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve ``registries`` in the text exposition format on ``host:port`` (loopback
    by default: binding elsewhere is the caller's explicit choice; port 0 picks a
    free one, read it from the result) from a daemon thread, until ``close()``.

    A family defined in two registries is served from the first one named (the
    process's ``keyshred_erasure_completion_seconds`` and ``StoreMetrics``' one share a
    name: name the process registry first to serve the worker's own observations)."""
    if not registries:
        raise InvalidInput("serve needs at least one registry")
    union = CollectorRegistry(auto_describe=False)
    union.register(_Union(registries))
    server = make_server(host, port, make_wsgi_app(union), handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="keyshred-metrics", daemon=True)
    thread.start()
    return MetricsServer(server, thread)
