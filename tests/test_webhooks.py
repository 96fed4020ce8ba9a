"""Signed webhooks (keyshred.webhooks) against the official ``standardwebhooks``
package both ways, and delivered over HTTP to a real server on loopback that fails
before it accepts (5xx, a cut connection, a stall), every attempt's signature checked."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from keyshred import webhooks
from keyshred.errors import (
    IntegrityError,
    InvalidInput,
    WebhookDeliveryFailed,
    WebhookRefused,
    WebhookTimestampInvalid,
)

PROBE = "probe-webhook-9f3c"  # stands for anything that must not leak
BODY = json.dumps({"request_id": "req-1", "state": "completed", "note": PROBE}).encode()

# The Standard Webhooks specification's example (its README and test suites).
SPEC_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SPEC_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
SPEC_TIMESTAMP = 1614265330
SPEC_BODY = b'{"test": 2432232314}'
SPEC_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_the_specification_example() -> None:
    headers = webhooks.sign(SPEC_SECRET, SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY)
    assert headers == {
        "webhook-id": SPEC_ID,
        "webhook-timestamp": str(SPEC_TIMESTAMP),
        "webhook-signature": SPEC_SIGNATURE,
    }
    webhooks.verify(SPEC_SECRET, headers, SPEC_BODY, now=SPEC_TIMESTAMP + 299)


def test_our_signatures_verify_with_standardwebhooks() -> None:
    secret = webhooks.new_secret()
    msg_id = webhooks.new_message_id()
    headers = webhooks.sign(secret, msg_id, int(time.time()), BODY)
    assert Webhook(secret).verify(BODY, headers) == json.loads(BODY)
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(BODY + b" ", headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(webhooks.new_secret()).verify(BODY, headers)


def test_standardwebhooks_signatures_verify_with_ours() -> None:
    secret = webhooks.new_secret()
    now = datetime.now(UTC)
    msg_id = webhooks.new_message_id()
    signature = Webhook(secret).sign(msg_id, now, BODY.decode())
    headers = {
        "Webhook-Id": msg_id,  # any case, as HTTP headers go
        "Webhook-Timestamp": str(int(now.timestamp())),
        "Webhook-Signature": signature,
    }
    webhooks.verify(secret, headers, BODY)
    with pytest.raises(WebhookRefused):
        webhooks.verify(secret, headers, BODY.replace(b"completed", b"completes"))
    with pytest.raises(WebhookRefused):
        webhooks.verify(webhooks.new_secret(), headers, BODY)


def test_verify_refuses_with_typed_errors() -> None:
    secret = webhooks.new_secret()
    stamp = 1_800_000_000
    good = webhooks.sign(secret, "msg_1", stamp, BODY)
    webhooks.verify(secret, good, BODY, now=stamp)
    # Another signer rotating in: several signatures, one of ours, is accepted.
    other = webhooks.sign(webhooks.new_secret(), "msg_1", stamp, BODY)["webhook-signature"]
    both = {**good, "webhook-signature": f"{other} v1a,ignored {good['webhook-signature']}"}
    webhooks.verify(secret, both, BODY, now=stamp)

    cases: list[tuple[dict[str, str], type[IntegrityError]]] = [
        ({**good, "webhook-signature": other}, WebhookRefused),
        ({**good, "webhook-id": "msg_2"}, WebhookRefused),  # the id is signed
        ({**good, "webhook-timestamp": str(stamp + 1)}, WebhookRefused),  # so is the time
        (
            {**good, "webhook-signature": good["webhook-signature"].replace("v1,", "v2,")},
            WebhookRefused,
        ),
        ({**good, "webhook-timestamp": "1.8e9"}, WebhookRefused),
        ({k: v for k, v in good.items() if k != "webhook-signature"}, WebhookRefused),
        ({k: v for k, v in good.items() if k != "webhook-id"}, WebhookRefused),
        ({}, WebhookRefused),
    ]
    for headers, error in cases:
        with pytest.raises(error) as caught:
            webhooks.verify(secret, headers, BODY, now=stamp)
        assert type(caught.value) is error, headers
    with pytest.raises(WebhookRefused):
        webhooks.verify(secret, good, BODY + b"\n", now=stamp)
    # Outside the tolerance either way: a replay, or a clock far ahead.
    for now in (stamp + 301, stamp - 301):
        with pytest.raises(WebhookTimestampInvalid):
            webhooks.verify(secret, good, BODY, now=now)
    webhooks.verify(secret, good, BODY, tolerance=10, now=stamp + 10)
    with pytest.raises(WebhookTimestampInvalid):
        webhooks.verify(secret, good, BODY, tolerance=10, now=stamp + 11)
    # Malformed inputs are the caller's error, never a silent refusal.
    for bad_secret in ("whsec_not base64!", "whsec_" + "QUJD", 42):
        with pytest.raises(InvalidInput):
            webhooks.verify(bad_secret, good, BODY, now=stamp)  # type: ignore[arg-type]
    for bad_id in ("", "a.b", "a b", "ü"):
        with pytest.raises(InvalidInput):
            webhooks.sign(secret, bad_id, stamp, BODY)


# -- delivery to a real HTTP server ---------------------------------------------------


@dataclass
class Receiver:
    """What the loopback server saw and how it answers: one behaviour per attempt
    ('cut': close the connection without answering; an int: that status)."""

    secret: str
    plan: list[str | int]
    retry_after: str | None = None
    attempts: list[dict[str, str]] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    checked: list[bool] = field(default_factory=list)
    url: str = ""


@pytest.fixture
def receiver() -> Iterator[Callable[[list[str | int]], Receiver]]:
    servers: list[http.server.ThreadingHTTPServer] = []

    def start(plan: list[str | int], retry_after: str | None = None) -> Receiver:
        state = Receiver(webhooks.new_secret(), list(plan), retry_after)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                headers = {k.lower(): v for k, v in self.headers.items()}
                state.attempts.append(headers)
                state.bodies.append(body)
                # Every attempt is checked with the official package, as a receiver does.
                try:
                    Webhook(state.secret).verify(body, headers)
                    state.checked.append(True)
                except WebhookVerificationError:
                    state.checked.append(False)
                action = state.plan.pop(0) if state.plan else 200
                if action == "cut":
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                assert isinstance(action, int)
                self.send_response(action)
                if state.retry_after is not None:
                    self.send_header("retry-after", state.retry_after)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        servers.append(server)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        state.url = f"http://127.0.0.1:{server.server_address[1]}/hook?tenant=t1"
        return state

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


class Sleeps:
    def __init__(self) -> None:
        self.delays: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)  # recorded, not slept: the schedule is checked, not timed


def test_deliver_retries_until_accepted_same_id_signed_each_time(
    receiver: Callable[[list[str | int]], Receiver],
) -> None:
    r = receiver([500, 503])
    sleeps = Sleeps()
    result = webhooks.deliver(
        r.url, BODY, r.secret, backoff=1.0, max_backoff=30.0, sleep=sleeps, jitter=lambda: 1.0
    )
    assert result.attempts == 3 and result.status == 200
    assert len(r.attempts) == 3 and r.checked == [True, True, True]
    assert {a["webhook-id"] for a in r.attempts} == {result.msg_id}
    assert result.msg_id.startswith("msg_")
    assert r.bodies == [BODY] * 3
    assert all(a["content-type"] == "application/json" for a in r.attempts)
    for headers in r.attempts:  # and with keyshred's own verify
        webhooks.verify(r.secret, headers, BODY)
    assert sleeps.delays == [1.0, 2.0]  # exponential; jitter pinned to its maximum


def test_deliver_survives_a_cut_connection(
    receiver: Callable[[list[str | int]], Receiver],
) -> None:
    r = receiver(["cut", 502, "cut"])
    result = webhooks.deliver(r.url, BODY, r.secret, msg_id="msg_fixed", sleep=Sleeps())
    assert (result.msg_id, result.attempts) == ("msg_fixed", 4)
    assert [a["webhook-id"] for a in r.attempts] == ["msg_fixed"] * 4
    assert r.checked == [True] * 4


def test_deliver_jitter_and_cap_bound_every_wait(
    receiver: Callable[[list[str | int]], Receiver],
) -> None:
    r = receiver([500] * 9)
    sleeps = Sleeps()
    draws = iter([0.5, 0.25, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    with pytest.raises(WebhookDeliveryFailed) as caught:
        webhooks.deliver(
            r.url, BODY, r.secret, max_attempts=9, backoff=0.5, max_backoff=4.0,
            sleep=sleeps, jitter=lambda: next(draws),
        )  # fmt: skip
    assert (caught.value.attempts, caught.value.status) == (9, 500)
    assert len(r.attempts) == 9  # bounded: never a tenth
    assert sleeps.delays == [0.25, 0.25, 2.0, 0.0, 4.0, 4.0, 4.0, 4.0]
    assert PROBE not in str(caught.value) and r.secret not in str(caught.value)


def test_deliver_honours_retry_after_within_the_cap(
    receiver: Callable[..., Receiver],
) -> None:
    r = receiver([429, 503], retry_after="7")
    sleeps = Sleeps()
    result = webhooks.deliver(
        r.url, BODY, r.secret, backoff=0.1, max_backoff=5.0, sleep=sleeps, jitter=lambda: 0.0
    )
    assert result.attempts == 3
    assert sleeps.delays == [5.0, 5.0]


def test_deliver_does_not_retry_a_refusal(
    receiver: Callable[[list[str | int]], Receiver],
) -> None:
    for status in (400, 401, 404, 410, 301):
        r = receiver([status])
        sleeps = Sleeps()
        with pytest.raises(WebhookDeliveryFailed) as caught:
            webhooks.deliver(r.url, BODY, r.secret, sleep=sleeps)
        assert (caught.value.attempts, caught.value.status) == (1, status)
        assert len(r.attempts) == 1 and sleeps.delays == []


def test_deliver_to_nobody_fails_after_the_bounded_attempts() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    sleeps = Sleeps()
    with pytest.raises(WebhookDeliveryFailed) as caught:
        webhooks.deliver(
            f"http://127.0.0.1:{port}/", BODY, webhooks.new_secret(), max_attempts=3, sleep=sleeps
        )
    assert (caught.value.attempts, caught.value.status) == (3, None)
    assert len(sleeps.delays) == 2


def test_deliver_gives_up_on_a_receiver_that_never_answers() -> None:
    """A receiver that accepts the connection and stalls: each attempt times out."""
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        port = listener.getsockname()[1]
        with pytest.raises(WebhookDeliveryFailed) as caught:
            webhooks.deliver(
                f"http://127.0.0.1:{port}/", BODY, webhooks.new_secret(),
                max_attempts=2, timeout=0.3, sleep=Sleeps(),
            )  # fmt: skip
        assert (caught.value.attempts, caught.value.status) == (2, None)
    finally:
        listener.close()


def test_deliver_refuses_bad_arguments_before_sending() -> None:
    secret = webhooks.new_secret()
    for url in ("file:///etc/passwd", "ftp://127.0.0.1/", "127.0.0.1:80"):
        with pytest.raises(InvalidInput):
            webhooks.deliver(url, BODY, secret)
    with pytest.raises(InvalidInput):
        webhooks.deliver("http://127.0.0.1:9/", BODY, "whsec_short")
    with pytest.raises(InvalidInput):
        webhooks.deliver("http://127.0.0.1:9/", BODY, secret, max_attempts=0)
