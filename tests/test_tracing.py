"""OpenTelemetry spans (keyshred.tracing): every erasure step, the run, ``erase``,
the memory store's operations and KEK calls get a span once the application
configured a tracer provider, and no span carries personal data (names,
attributes, events, status descriptions and resource are scanned for probes).
Without a provider, or without OpenTelemetry at all, nothing is recorded and
nothing fails."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from keyshred import Keyshred, tracing
from keyshred.errors import KeyshredError
from tests.storage.conftest import make_config
from tests.storage.test_vectors import bag_of_words

NS = ("memories",)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """An SDK tracer provider exporting to memory, set as the global one for this
    test only. ``trace.set_tracer_provider`` works once per process, so the global
    is patched and restored as OpenTelemetry's own test helpers do."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "keyshred-test"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    yield exporter
    provider.shutdown()


@pytest.fixture
def ks(catalog_url: str, tmp_path: Path) -> Iterator[Keyshred]:
    store = Keyshred.init(tmp_path / "data", make_config(catalog_url), embeddings=bag_of_words)
    yield store
    store.close()


def serialized(finished: tuple[ReadableSpan, ...]) -> str:
    # to_json holds name, context, parent, attributes, events, links, status
    # (code and description) and resource.
    return "\n".join(s.to_json() for s in finished)


def by_name(finished: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in finished if s.name == name]


def test_no_probe_in_any_span_and_every_step_has_one(
    spans: InMemorySpanExporter, ks: Keyshred
) -> None:
    probe = f"zq{uuid.uuid4().hex[:12]}"
    subject = f"subject-{probe}@example.org"
    other = f"other-{probe}"
    text = f"{probe} prefers the window seat"
    ks.memories.put(subject, NS, "seat", {"text": text}, index=["text"])
    ks.memories.put(other, NS, "seat", {"text": f"{probe} aisle"}, index=["text"])
    ks.memories.flush()
    assert ks.memories.get(subject, NS, "seat") is not None
    assert ks.memories.search(subject, NS, query=f"{probe} window")
    assert ks.memories.delete(other, NS, "seat")
    ks.keyring.rotate_kek()  # a provider call (DEKs are wrapped locally by the epoch key)
    req = ks.erase(subject, requested_by="dpo", reason="gdpr-art17", probes=[probe])
    assert req.state == "completed"

    finished = spans.get_finished_spans()
    dump = serialized(finished)
    for secret in (probe, subject, other, text, ks.subject_ref(subject), ks.subject_ref(other)):
        assert secret not in dump
        assert secret.lower() not in dump.lower()

    for op in ("put", "get", "search", "delete"):
        assert by_name(finished, f"keyshred.memories.{op}"), op
    kek_calls = {s.name for s in finished if s.name.startswith("keyshred.kek.")}
    assert "keyshred.kek.rotate" in kek_calls
    assert kek_calls & {"keyshred.kek.wrap", "keyshred.kek.wrap_many"}  # init's epoch key
    (erase,) = by_name(finished, "keyshred.erase")
    (run,) = by_name(finished, "keyshred.erasure.run")
    assert erase.attributes == {
        "keyshred.request_id": req.request_id,
        "keyshred.state": "completed",
    }
    assert run.attributes == {"keyshred.request_id": req.request_id, "keyshred.state": "completed"}
    assert run.parent is not None and run.parent.span_id == erase.context.span_id
    for step in ks.erasure.steps:
        (s,) = by_name(finished, f"keyshred.erasure.{step}")
        assert s.parent is not None and s.parent.span_id == run.context.span_id, step
        assert s.status.status_code == StatusCode.UNSET
        attrs = dict(s.attributes or {})
        assert attrs.pop("keyshred.state")  # the state the step started from
        assert attrs == {
            "keyshred.request_id": req.request_id,
            "keyshred.kind": "erasure",
            "keyshred.step": step,
        }
    # Every span came from keyshred's tracer.
    assert {s.instrumentation_scope.name for s in finished} == {"keyshred"}  # type: ignore[union-attr]


def test_a_failed_step_says_its_error_class_never_its_message(
    ks: Keyshred, spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = f"zq{uuid.uuid4().hex[:12]}"
    ks.memories.put("eve", NS, "k", "a value")
    coordinator: Any = ks._erasure

    def fail(req: Any) -> Any:
        raise OSError(f"cannot reach {probe}")  # a message that carries data

    monkeypatch.setattr(coordinator, "_step_closure", fail)
    req = ks.erase("eve", requested_by="dpo", reason="request")
    assert req.state == "retryable_failure"
    finished = spans.get_finished_spans()
    (failed,) = by_name(finished, "keyshred.erasure.closure")
    assert failed.status.status_code == StatusCode.ERROR
    assert failed.status.description == "OSError"
    assert failed.attributes is not None
    assert failed.attributes["error.type"] == "builtins.OSError"
    assert not failed.events  # no exception event: it would hold the message
    assert probe not in serialized(finished)
    (run,) = by_name(finished, "keyshred.erasure.run")
    assert run.attributes is not None and run.attributes["keyshred.state"] == "retryable_failure"


def test_an_error_raised_through_a_store_call_is_typed_not_described(
    ks: Keyshred, spans: InMemorySpanExporter
) -> None:
    probe = f"zq{uuid.uuid4().hex[:12]}"
    with pytest.raises(KeyshredError):
        ks.memories.put(probe, NS, "k", "v", scope=f"no-such-scope-{probe}")
    (put,) = by_name(spans.get_finished_spans(), "keyshred.memories.put")
    assert put.status.status_code == StatusCode.ERROR
    assert put.status.description is not None
    assert put.attributes is not None
    error_type = str(put.attributes["error.type"])
    assert error_type.startswith("keyshred.errors.")
    assert put.status.description == error_type.rsplit(".", 1)[1]
    assert probe not in serialized(spans.get_finished_spans())


def test_nothing_is_recorded_without_a_configured_provider(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The API's placeholder: what an application that never configured tracing has.
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", None)
    assert not tracing.enabled()
    assert tracing.span("keyshred.anything") is tracing.span("keyshred.other")  # one no-op
    ks.memories.put("fay", NS, "k", "v")
    assert ks.erase("fay", requested_by="dpo", reason="request").state == "completed"
    # A provider set later is used from then on (checked at each call).
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    assert tracing.enabled()
    ks.memories.get("gil", NS, "k")
    assert [s.name for s in exporter.get_finished_spans()] == ["keyshred.memories.get"]


def test_without_opentelemetry_installed_everything_works(tmp_path: Path) -> None:
    """A fresh interpreter where every ``opentelemetry`` import fails: keyshred
    imports, stores, searches and erases, and never tried to import it."""
    code = f"""
import sys

class NoOtel:
    tried = []
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "opentelemetry":
            self.tried.append(name)
            raise ImportError(name)
        return None

blocker = NoOtel()
sys.meta_path.insert(0, blocker)
from keyshred import Keyshred, tracing
from tests.storage.test_vectors import bag_of_words
ks = Keyshred.init({str(tmp_path / "data")!r}, embeddings=bag_of_words)
ks.memories.put("gus", ("m",), "k", {{"text": "gus rows a kayak"}}, index=["text"])
assert ks.memories.search("gus", ("m",), query="kayak")
assert ks.erase("gus", requested_by="dpo", reason="request").state == "completed"
assert not tracing.enabled()
ks.close()
assert not blocker.tried, blocker.tried
assert not any(m.startswith("opentelemetry") for m in sys.modules)
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "ok"


@pytest.mark.parametrize("catalog_url", ["sqlite"], indirect=True)
def test_a_string_attribute_that_is_not_plain_metadata_is_recorded_as_invalid(
    ks: Keyshred, spans: InMemorySpanExporter
) -> None:
    probe = "Ana Lima <ana.lima@example.org>"
    with tracing.span("keyshred.test", {"keyshred.request_id": probe, "n": 3}) as s:
        s.set("keyshred.state", "Zoë's note")
        s.set("keyshred.step", "suppress")
    (done,) = by_name(spans.get_finished_spans(), "keyshred.test")
    assert dict(done.attributes or {}) == {
        "keyshred.request_id": "invalid",
        "n": 3,
        "keyshred.state": "invalid",
        "keyshred.step": "suppress",
    }
    assert "ana.lima" not in serialized(spans.get_finished_spans())


def test_spans_serialize_as_json(ks: Keyshred, spans: InMemorySpanExporter) -> None:
    """The scan above reads what an exporter would send: each span as JSON."""
    ks.memories.put("hal", NS, "k", "v")
    for s in spans.get_finished_spans():
        doc = json.loads(s.to_json())
        assert doc["name"].startswith("keyshred.")
        assert doc["resource"]["attributes"]["service.name"] == "keyshred-test"


@pytest.mark.parametrize("provider", ["vault", "aws"])
def test_kek_calls_on_the_real_servers_get_spans_without_data(
    provider: str,
    spans: InMemorySpanExporter,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OpenBao Transit and moto's KMS: init, a put, a rotation and an erasure make
    ``keyshred.kek.*`` spans (the provider's class, swapped for the traced one, is
    still the provider's), with no subject or value in any span."""
    from tests.test_facade import _config

    if provider == "vault":
        monkeypatch.setenv("VAULT_TOKEN", request.getfixturevalue("openbao").token)
    cfg = _config(provider, request)
    probe = f"zq{uuid.uuid4().hex[:12]}"
    with Keyshred.init(tmp_path / "d", cfg, embeddings=bag_of_words) as ks:
        kek = ks.keyring.kek
        # The provider sits behind the retrying wrapper (keyring/kek/resilient.py).
        kek = getattr(kek, "inner", kek)
        assert type(kek).__name__ == {"vault": "VaultKek", "aws": "AwsKmsKek"}[provider]
        ks.memories.put(f"{probe}@example.org", NS, "k", {"text": f"{probe} ski"}, index=["text"])
        ks.keyring.rotate_kek()
        ref = ks.subject_ref(f"{probe}@example.org")
        req = ks.erase(f"{probe}@example.org", requested_by="dpo", reason="r", probes=[probe])
        assert req.state == "completed"
    finished = spans.get_finished_spans()
    names = {s.name for s in finished}
    assert "keyshred.kek.rotate" in names
    assert names & {"keyshred.kek.wrap", "keyshred.kek.wrap_many"}
    dump = serialized(finished)
    assert probe not in dump and ref not in dump
