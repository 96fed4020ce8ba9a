"""Completion webhooks (``keyshred.erasure.callbacks``) end to end: an erasure that
settles writes its ``webhook`` jobs in the transaction that records the state, the
job runner delivers them to a real HTTP receiver on loopback that checks every
signature with the independent ``standardwebhooks`` package; retries keep the
``webhook-id``, an unreachable receiver ends in the dead letter while the request
stays completed, a 4xx is final, several workers on PostgreSQL deliver each once,
a restored copy calls nobody, and no secret, subject id or value reaches a job
row, a body, a log line or an audit event."""

from __future__ import annotations

import hashlib
import http.server
import json
import logging
import socket
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import SecretStr, ValidationError
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from keyshred import Config, Keyshred, webhooks
from keyshred.config import WebhookSettings, load_config, redacted_dump
from keyshred.erasure.callbacks import JOB_KIND, message_id
from keyshred.errors import BackendUnavailable, ConfigError, WebhookDeliveryFailed
from keyshred.schema import audit_events, jobs
from keyshred.worker import Worker
from tests.storage.conftest import make_config
from tests.storage.test_vectors import bag_of_words

README = Path(__file__).parents[1] / "README.md"
VICTIM = "probe-victim-hook-4q7w@example.org"
PROBE = "probe-value-hook-lantern-5521"


@dataclass
class Receiver:
    """A loopback HTTP receiver: what it saw, and how it answers each POST in turn
    (an int: that status; 'cut': close without answering); 200 once the plan is out."""

    secret: str
    plan: list[int | str]
    delay: float = 0.0
    headers: list[dict[str, str]] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    verified: list[bool] = field(default_factory=list)
    answers: list[int | str] = field(default_factory=list)
    url: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def accepted(self) -> list[tuple[str, dict[str, Any]]]:
        """(webhook-id, message) of every POST answered 2xx."""
        return [
            (h["webhook-id"], json.loads(b))
            for h, b, a in zip(self.headers, self.bodies, self.answers, strict=True)
            if isinstance(a, int) and 200 <= a < 300
        ]


def start_receiver(
    plan: list[int | str] | None = None, delay: float = 0.0
) -> tuple[Receiver, http.server.ThreadingHTTPServer]:
    """A receiver with a fresh secret, serving on a loopback port in a thread (the
    caller shuts the server down)."""
    state = Receiver(webhooks.new_secret(), list(plan or []), delay)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}/hooks/keyshred"
    return state, server


def _handler(state: Receiver) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            headers = {k.lower(): v for k, v in self.headers.items()}
            try:  # as a receiver does: the official package checks the signature
                Webhook(state.secret).verify(body, headers)
                ok = True
            except WebhookVerificationError:
                ok = False
            with state.lock:
                action = state.plan.pop(0) if state.plan else 200
                state.headers.append(headers)
                state.bodies.append(body)
                state.verified.append(ok)
                state.answers.append(action)
            if state.delay:
                time.sleep(state.delay)  # widens the window two claimers would race in
            if action == "cut":
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            assert isinstance(action, int)
            self.send_response(action)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


@pytest.fixture
def receiver() -> Iterator[Callable[..., Receiver]]:
    servers: list[http.server.ThreadingHTTPServer] = []

    def start(plan: list[int | str] | None = None, delay: float = 0.0) -> Receiver:
        state, server = start_receiver(plan, delay)
        servers.append(server)
        return state

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _endpoint(url: str, secret: str | None = None, **settings: Any) -> WebhookSettings:
    values: dict[str, Any] = {"url": url, "backoff_seconds": 0.0, **settings}
    if secret is not None:
        values["secret"] = SecretStr(secret)
    return WebhookSettings(**values)


def _store(
    path: Path, endpoints: list[WebhookSettings], catalog_url: str | None = None
) -> Keyshred:
    config = make_config(
        catalog_url if catalog_url and catalog_url.startswith("postgres") else None
    )
    jobs_settings = config.jobs.model_copy(
        update={"retention_every_seconds": 0, "backup_maintain_every_seconds": 0}
    )
    config = config.model_copy(update={"jobs": jobs_settings, "webhooks": endpoints})
    return Keyshred.init(path, config, embeddings=bag_of_words)


def _webhook_jobs(ks: Keyshred) -> list[Any]:
    return ks.jobs.queue.list(kinds=[JOB_KIND])


def _table(ks: Keyshred, table: sa.Table) -> str:
    with ks._catalog.engine.connect() as conn:
        return "\n".join("|".join(str(v) for v in r) for r in conn.execute(sa.select(table)))


def _events(ks: Keyshred, name: str) -> list[dict[str, Any]]:
    with ks._catalog.engine.connect() as conn:
        rows = conn.execute(
            sa.select(audit_events.c.data).where(audit_events.c.event == name)
        ).scalars()
        return [json.loads(r) for r in rows]


def test_a_completed_erasure_sends_one_signed_webhook(
    tmp_path: Path, receiver: Callable[..., Receiver]
) -> None:
    r = receiver()
    with _store(tmp_path / "data", [_endpoint(r.url, r.secret, name="dpo-desk")]) as ks:
        ks.memories.put(VICTIM, ("m",), "k", f"{PROBE} note")
        req = ks.erase(VICTIM, requested_by="dpo", reason="art17")
        assert req.state == "completed"
        # Recorded with the state, delivered by the runner (nothing sent before).
        [job] = _webhook_jobs(ks)
        assert job.state == "queued" and job.max_attempts == 8
        assert job.payload["request_id"] == req.request_id
        assert job.payload["event"] == "erasure.completed"
        assert job.payload["endpoint"] == "dpo-desk"
        assert r.bodies == []
        assert ks.jobs.run_pending() == 1
        assert ks.jobs.queue.get(job.job_id).state == "succeeded"
        assert r.verified == [True]
        [(msg_id, message)] = r.accepted()
        assert msg_id == message_id(req.request_id, "erasure.completed", "dpo-desk")
        assert message["type"] == "erasure.completed"
        assert message["timestamp"].endswith("Z")
        receipt = ks.erasure.receipt(req.request_id)
        assert receipt is not None
        assert message["data"] == {
            "request_id": req.request_id,
            "kind": "erasure",
            "state": "completed",
            "subject_ref": ks.subject_ref(VICTIM),
            "scope": None,
            "receipt": {
                "path": f"/v1/erasure-requests/{req.request_id}/receipt",
                "sha256": hashlib.sha256(receipt.serialize().encode()).hexdigest(),
            },
        }
        # The README's example message has exactly these fields.
        documented = json.loads(_readme_block("json"))
        assert set(documented) == set(message)
        assert set(documented["data"]) == set(message["data"])
        assert set(documented["data"]["receipt"]) == set(message["data"]["receipt"])
        assert r.headers[0]["content-type"] == "application/json"
        # Our own verifier agrees, and a body changed by one byte fails both.
        webhooks.verify(r.secret, r.headers[0], r.bodies[0])
        with pytest.raises(WebhookVerificationError):
            Webhook(r.secret).verify(r.bodies[0] + b" ", r.headers[0])
        [delivered] = _events(ks, "webhook.delivered")
        assert delivered["endpoint"] == "dpo-desk" and delivered["status"] == 200
        # Resuming the settled request sends nothing again.
        ks.erasure.resume(req.request_id)
        assert ks.jobs.run_pending() == 0 and len(_webhook_jobs(ks)) == 1


def test_a_500_then_a_200_is_retried_with_the_same_webhook_id(
    tmp_path: Path, receiver: Callable[..., Receiver]
) -> None:
    r = receiver([500, "cut", 200])
    with _store(tmp_path / "data", [_endpoint(r.url, r.secret)]) as ks:
        ks.memories.put(VICTIM, ("m",), "k", "note")
        req = ks.erase(VICTIM, requested_by="dpo", reason="art17")
        ks.jobs.run_pending()  # backoff 0: each retry is due at once
        assert r.answers == [500, "cut", 200]
        assert r.verified == [True, True, True]  # each attempt signed anew
        ids = {h["webhook-id"] for h in r.headers}
        [endpoint] = ks.config.webhooks
        assert ids == {message_id(req.request_id, "erasure.completed", endpoint.endpoint)}
        assert len(set(r.bodies)) == 1  # the same message every time
        [job] = _webhook_jobs(ks)
        assert job.state == "succeeded" and job.attempts == 3
        assert _events(ks, "webhook.delivered")[0]["attempts"] == 3


def test_a_receiver_that_stays_down_is_dead_lettered_and_the_request_stays_completed(
    tmp_path: Path,
) -> None:
    url = f"http://127.0.0.1:{_closed_port()}/hook"
    endpoint = _endpoint(url, webhooks.new_secret(), attempts=3, timeout_seconds=2.0)
    with _store(tmp_path / "data", [endpoint]) as ks:
        ks.memories.put(VICTIM, ("m",), "k", "note")
        req = ks.erase(VICTIM, requested_by="dpo", reason="art17")
        assert ks.jobs.run_pending() == 3  # three runs, then the dead letter
        [job] = _webhook_jobs(ks)
        assert job.state == "manual_review" and job.attempts == 3
        assert job.last_error == "WebhookDeliveryFailed.NoAnswer"
        assert ks.erasure.status(req.request_id).state == "completed"
        assert ks.erasure.receipt(req.request_id) is not None
        [failed] = _events(ks, "webhook.failed")
        assert failed["attempts"] == 3 and failed["error"] == "WebhookDeliveryFailed.NoAnswer"
        assert ks.jobs.run_pending() == 0  # nothing left to run


def test_a_backoff_delays_the_next_attempt(
    tmp_path: Path, receiver: Callable[..., Receiver]
) -> None:
    r = receiver([503])
    endpoint = _endpoint(r.url, r.secret, backoff_seconds=3600.0)
    with _store(tmp_path / "data", [endpoint]) as ks:
        ks.memories.put(VICTIM, ("m",), "k", "note")
        ks.erase(VICTIM, requested_by="dpo", reason="art17")
        assert ks.jobs.run_pending() == 1
        [job] = _webhook_jobs(ks)
        # Not due again until its backoff (up to an hour, full jitter) has passed.
        assert job.state == "queued" and job.last_error == "WebhookDeliveryFailed.HTTP503"
        assert job.run_after_us >= job.updated_us
        assert job.run_after_us - job.updated_us <= 3600 * 1_000_000


@pytest.mark.parametrize("status", [400, 410, 302])
def test_a_4xx_or_a_redirect_is_final(
    tmp_path: Path, receiver: Callable[..., Receiver], status: int
) -> None:
    r = receiver([status])
    with _store(tmp_path / "data", [_endpoint(r.url, r.secret)]) as ks:
        ks.memories.put(VICTIM, ("m",), "k", "note")
        req = ks.erase(VICTIM, requested_by="dpo", reason="art17")
        assert ks.jobs.run_pending() == 1
        assert r.answers == [status]
        [job] = _webhook_jobs(ks)
        assert job.state == "manual_review" and job.attempts == 1
        assert job.last_error == f"WebhookRefused.HTTP{status}"
        assert ks.erasure.status(req.request_id).state == "completed"


def test_events_per_endpoint_consent_withdrawal_and_rejection(
    tmp_path: Path, receiver: Callable[..., Receiver]
) -> None:
    every, completions = receiver(), receiver()
    endpoints = [
        _endpoint(every.url, every.secret, name="every"),
        _endpoint(
            completions.url,
            completions.secret,
            name="completions",
            events=["erasure.completed", "consent.withdrawal.completed"],
        ),
    ]
    with _store(tmp_path / "data", endpoints) as ks:
        ks.consent.grant(VICTIM, scope="support/health", category="health")
        ks.memories.put(VICTIM, ("m",), "k", "note", scope="support/health", category="health")
        withdrawn = ks.consent.withdraw(VICTIM, "support/health")
        assert withdrawn.state == "completed"
        # Not plain metadata: a rejected request (no data touched).
        rejected = ks.erasure.submit("bob", requested_by="dpo\n", reason="art17")
        assert rejected.state == "rejected"
        ks.jobs.run_pending()
        got = {m["type"]: m for _, m in every.accepted()}
        assert set(got) == {"consent.withdrawal.completed", "erasure.rejected"}
        assert got["consent.withdrawal.completed"]["data"]["scope"] == "support/health"
        assert got["consent.withdrawal.completed"]["data"]["kind"] == "consent-withdrawal"
        assert "receipt" not in got["erasure.rejected"]["data"]
        assert [m["type"] for _, m in completions.accepted()] == ["consent.withdrawal.completed"]
        assert all(every.verified) and all(completions.verified)


class _VendorDown:
    name = "vendor"

    def delete(self, subject_ref: str, scope: str | None) -> Any:
        raise BackendUnavailable("the vendor's API is down")


def test_a_request_sent_to_manual_review_says_so(
    tmp_path: Path, receiver: Callable[..., Receiver]
) -> None:
    r = receiver()
    with _store(tmp_path / "data", [_endpoint(r.url, r.secret, name="desk")]) as ks:
        ks.memories.put(VICTIM, ("m",), "k", "note")
        ks.erasure.register_processor(_VendorDown())
        req = ks.erasure.submit(VICTIM, requested_by="dpo", reason="art17")
        erasure_job = ks.jobs.queue.find(f"erasure:{req.request_id}")
        assert erasure_job is not None
        with ks._catalog.transaction() as conn:  # its last run: the next failure is final
            conn.execute(
                jobs.update().where(jobs.c.job_id == erasure_job.job_id).values(max_attempts=1)
            )
        ks.jobs.run_pending()
        assert ks.erasure.status(req.request_id).state == "manual_review"
        [(msg_id, message)] = r.accepted()
        assert msg_id == message_id(req.request_id, "erasure.manual_review", "desk")
        assert message["type"] == "erasure.manual_review"
        assert message["data"]["state"] == "manual_review" and "receipt" not in message["data"]


def test_the_state_and_its_webhook_commit_together(
    tmp_path: Path, receiver: Callable[..., Receiver]
) -> None:
    r = receiver()
    with _store(tmp_path / "data", [_endpoint(r.url, r.secret)]) as ks:
        ks.memories.put(VICTIM, ("m",), "k", "note")
        queue = ks._jobs.queue
        real = queue.enqueue

        def crash(kind: str, *args: Any, **kwargs: Any) -> str:
            job_id = real(kind, *args, **kwargs)
            if kind == JOB_KIND:
                raise OSError("the connection dropped")  # after the insert, before the commit
            return job_id

        queue.enqueue = crash  # type: ignore[method-assign]
        try:
            req = ks.erasure.submit(VICTIM, requested_by="dpo", reason="art17")
            ks.jobs.run_pending(["erasure"])
        finally:
            queue.enqueue = real  # type: ignore[method-assign]
        # Neither the completed state nor its webhook job was recorded...
        assert ks.erasure.status(req.request_id).state != "completed"
        assert _webhook_jobs(ks) == []
        # ...and the next run (every step is done) records both: the state, then
        # one delivery.
        assert "receipt" in ks.erasure.status(req.request_id).steps_done
        assert ks.erasure.resume(req.request_id).state == "completed"
        ks.jobs.run_pending()
        assert ks.erasure.status(req.request_id).state == "completed"
        assert [m["type"] for _, m in r.accepted()] == ["erasure.completed"]
        assert len(_webhook_jobs(ks)) == 1


def test_an_endpoint_removed_from_the_configuration_is_dead_lettered(
    tmp_path: Path, receiver: Callable[..., Receiver]
) -> None:
    r = receiver()
    with _store(tmp_path / "data", [_endpoint(r.url, r.secret, name="old")]) as ks:
        ks.memories.put(VICTIM, ("m",), "k", "note")
        ks.erase(VICTIM, requested_by="dpo", reason="art17")
        config = ks.config
    with Keyshred.open(
        tmp_path / "data", config.model_copy(update={"webhooks": []}), embeddings=bag_of_words
    ) as ks:
        assert ks.jobs.run_pending() == 1
        [job] = _webhook_jobs(ks)
        assert job.state == "manual_review" and job.last_error == "WebhookEndpointUnknown"
    assert r.bodies == []


def test_no_secret_subject_or_value_in_job_rows_bodies_logs_or_audit(
    tmp_path: Path,
    receiver: Callable[..., Receiver],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.DEBUG)
    inline, from_env = receiver([500]), receiver(["cut"])
    monkeypatch.setenv("HOOK_TEST_SECRET", from_env.secret)
    # A URL token is the endpoint's business: never in a job row or audit event.
    token_url = inline.url + "?token=probe-url-token-77a1"
    endpoints = [
        _endpoint(token_url, inline.secret, name="inline"),
        _endpoint(from_env.url, secret_env="HOOK_TEST_SECRET", name="from-env"),
    ]
    with _store(tmp_path / "data", endpoints) as ks:
        ks.memories.put(VICTIM, ("m",), "k", f"{PROBE} note", index=True)
        ks.erase(VICTIM, requested_by="dpo", reason="art17", probes=[PROBE])
        ks.jobs.run_pending()
        assert len(inline.accepted()) == 1 and len(from_env.accepted()) == 1
        assert all(inline.verified) and all(from_env.verified)
        secrets_ = [inline.secret, from_env.secret]
        keys = [s.removeprefix("whsec_") for s in secrets_]
        signatures = [h["webhook-signature"] for h in inline.headers + from_env.headers]
        forbidden = [VICTIM, PROBE, *secrets_, *keys, *signatures]
        texts = {
            "jobs": _table(ks, jobs),
            "audit": _table(ks, audit_events),
            "bodies": b"\n".join(inline.bodies + from_env.bodies).decode(),
            "logs": "\n".join(r.getMessage() for r in caplog.records),
            "config repr": repr(ks.config) + str(ks.config.webhooks),
            "redacted dump": json.dumps(redacted_dump(ks.config)),
            "job reprs": repr(_webhook_jobs(ks)),
        }
        for where, text in texts.items():
            for probe in forbidden:
                assert probe not in text, (where, probe[:12])
        for where in ("jobs", "audit", "bodies", "config repr", "redacted dump", "job reprs"):
            assert "probe-url-token-77a1" not in texts[where], where
        # urllib3's own DEBUG line names the URL's path and query (not keyshred's
        # log: the README says a URL carries no secret; the signature authenticates).
        urls = [r for r in caplog.records if "probe-url-token-77a1" in r.getMessage()]
        assert urls and all(
            r.name.startswith("urllib3") and r.levelno == logging.DEBUG for r in urls
        )
        assert "**********" in texts["config repr"] and "**********" in texts["redacted dump"]
        # The URL shows as its origin only (its path and query may be its credential).
        assert "/..." in texts["config repr"] and "/..." in texts["redacted dump"]


def test_webhook_settings_are_checked_without_echoing_a_secret(tmp_path: Path) -> None:
    secret = webhooks.new_secret()
    ok = WebhookSettings(url="https://hooks.example/k", secret=SecretStr(secret))
    assert ok.endpoint.startswith("u") and len(ok.endpoint) == 13
    assert ok.events == [
        "erasure.completed",
        "erasure.manual_review",
        "erasure.rejected",
        "consent.withdrawal.completed",
        "consent.withdrawal.manual_review",
        "consent.withdrawal.rejected",
    ]
    bad: list[dict[str, Any]] = [
        {"url": "ftp://hooks.example/k", "secret": secret},
        {"url": "file:///etc/passwd", "secret": secret},
        {"url": "https://", "secret": secret},
        {"url": "https://hooks.example/k"},  # no secret at all
        {"url": "https://hooks.example/k", "secret": secret, "secret_env": "X"},
        {"url": "https://hooks.example/k", "secret": secret[:-12] + "!!!!"},
        {"url": "https://hooks.example/k", "secret": "whsec_QUJD"},  # 3 bytes
        {"url": "https://hooks.example/k", "secret_env": "NOT A NAME"},
        {"url": "https://hooks.example/k", "secret": secret, "events": ["erasure.started"]},
        {"url": "https://hooks.example/k", "secret": secret, "name": "Bad Name"},
        {"url": "https://hooks.example/k", "secret": secret, "attempts": 0},
    ]
    for values in bad:
        with pytest.raises(ValidationError) as caught:
            WebhookSettings(**values)
        assert secret not in str(caught.value)
        assert secret not in repr(caught.value.errors(include_input=False))
    with pytest.raises(ValidationError):
        Config(webhooks=[ok, ok])  # one name twice
    # From the environment (JSON) and the file: errors name the setting, never the value.
    env = {"KEYSHRED_WEBHOOKS": json.dumps([{"url": "https://h.example/", "secret": "whsec_x"}])}
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path, env)
    assert "webhooks.0.secret" in str(err.value) and "whsec_x" not in str(err.value)
    env = {"KEYSHRED_WEBHOOKS": json.dumps([{"url": "https://h.example/", "secret_env": "S"}])}
    assert load_config(tmp_path, env).webhooks[0].secret_env == "S"
    # An inline secret written by init is read back as it was given.
    with Keyshred.init(tmp_path / "data", Config(webhooks=[ok]), embeddings=bag_of_words) as ks:
        assert ks.config.webhooks == [ok]
    reread = load_config(tmp_path / "data", {})
    assert reread.webhooks[0].secret is not None
    assert reread.webhooks[0].secret.get_secret_value() == secret


def test_a_restored_copy_calls_no_endpoint(
    tmp_path: Path, receiver: Callable[..., Receiver]
) -> None:
    r = receiver()
    with _store(tmp_path / "data", [_endpoint(r.url, r.secret)]) as ks:
        ks.memories.put(VICTIM, ("m",), "k", "note")
        ks.memories.put("bob", ("m",), "k", "bob's note")
        ks.erase(VICTIM, requested_by="dpo", reason="art17")
        # The backup holds the delivery still queued.
        generation = ks.backup.create().generation
        ks.jobs.run_pending()
        assert len(r.accepted()) == 1
        ks.backup.restore(generation, tmp_path / "restored")
    assert load_config(tmp_path / "restored", {}).webhooks == []
    with Keyshred.open(tmp_path / "restored", embeddings=bag_of_words) as copy:
        assert copy.config.webhooks == []
        copy.jobs.run_pending()
        [job] = _webhook_jobs(copy)
        assert job.state == "manual_review" and job.last_error == "WebhookEndpointUnknown"
    assert len(r.bodies) == 1  # the live delivery only


@pytest.mark.parametrize("catalog_url", ["postgres"], indirect=True)
def test_several_workers_on_postgresql_deliver_each_webhook_once(
    tmp_path: Path, receiver: Callable[..., Receiver], catalog_url: str
) -> None:
    r = receiver([503, 500], delay=0.05)  # two failures on the way, each retried
    subjects = [f"probe-pg-subject-{i}@example.org" for i in range(4)]
    with _store(tmp_path / "data", [_endpoint(r.url, r.secret)], catalog_url) as ks:
        for s in subjects:
            ks.memories.put(s, ("m",), "k", "note")
        ids = [
            ks.erasure.submit(s, requested_by="dpo", reason="art17").request_id for s in subjects
        ]
        with Keyshred.open(tmp_path / "data", embeddings=bag_of_words) as other:
            stop = threading.Event()
            workers = [Worker(ks, concurrency=3), Worker(other, concurrency=3)]
            threads = [threading.Thread(target=w.run, args=(stop,)) for w in workers]
            for t in threads:
                t.start()
            try:
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    done = [j for j in _webhook_jobs(ks) if j.state == "succeeded"]
                    if len(done) == len(ids):
                        break
                    time.sleep(0.2)
            finally:
                stop.set()
                for t in threads:
                    t.join()
        assert all(ks.erasure.status(i).state == "completed" for i in ids)
        accepted = r.accepted()
        [endpoint] = ks.config.webhooks
        expected = {message_id(i, "erasure.completed", endpoint.endpoint) for i in ids}
        assert sorted(m for m, _ in accepted) == sorted(expected)  # each once
        assert all(r.verified) and len(r.bodies) == len(ids) + 2
        assert {m["data"]["request_id"] for _, m in accepted} == set(ids)
        assert len(_events(ks, "webhook.delivered")) == len(ids)


def _readme_block(language: str) -> str:
    section = README.read_text("utf-8").split("## Completion webhooks")[1].split("\n## ")[0]
    return section.split(f"```{language}")[1].split("```")[0]


def test_the_readme_configuration_and_receiver_work(monkeypatch: pytest.MonkeyPatch) -> None:
    config = Config.model_validate(tomllib.loads(_readme_block("toml")))
    [endpoint] = config.webhooks
    assert endpoint.secret_env == "DPO_HOOK_SECRET" and endpoint.endpoint == "dpo-desk"
    # The receiver as written, on a free port instead of 8090.
    code = _readme_block("python")
    serve = 'HTTPServer(("127.0.0.1", 8090), Receiver).serve_forever()'
    assert serve in code
    secret = webhooks.new_secret()
    scope: dict[str, Any] = {"SECRET": secret, "__name__": "readme_receiver"}
    exec(code.replace(serve, ""), scope)  # noqa: S102 - the README's own example
    server = http.server.HTTPServer(("127.0.0.1", 0), scope["Receiver"])
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    body = json.dumps({"type": "erasure.completed", "data": {"request_id": "r-1"}}).encode()
    try:
        sent = webhooks.deliver(url, body, secret, max_attempts=2, backoff=0)
        assert sent.status == 204
        again = webhooks.deliver(url, body, secret, msg_id=sent.msg_id, max_attempts=1)
        assert again.status == 204 and scope["seen"] == {sent.msg_id}  # handled once
        with pytest.raises(WebhookDeliveryFailed) as refused:
            webhooks.deliver(url, body, webhooks.new_secret(), max_attempts=3, backoff=0)
        assert refused.value.status == 400 and refused.value.attempts == 1
    finally:
        server.shutdown()
        server.server_close()


def test_a_webhook_urls_path_and_query_stay_out_of_reprs_and_dumps() -> None:
    """A backup manifest records ``redacted_dump(config)``: a webhook URL's path and
    query (a Slack-style path token, an ``api_key``, a SAS ``sig``) are its
    credential, so only its origin is recorded, and shown by repr."""
    url = "https://hooks.example.com:8443/services/T0/B0/PATHTOKEN7?api_key=QKEY7&sig=SASSIG7"
    config = Config(webhooks=[WebhookSettings(url=url, secret=webhooks.new_secret())])
    shown = json.dumps(redacted_dump(config)) + repr(config) + str(config.webhooks[0])
    for part in ("PATHTOKEN7", "QKEY7", "SASSIG7", "/services"):
        assert part not in shown
    assert "https://hooks.example.com:8443/" in shown
    assert config.webhooks[0].url == url  # the setting itself is intact
