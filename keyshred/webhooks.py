"""Signed webhooks after the Standard Webhooks specification (standardwebhooks.com).

Every message carries three headers:

- ``webhook-id``: the message id, the same on every attempt to deliver it, so the
  receiver can drop a duplicate;
- ``webhook-timestamp``: the attempt's time, integer seconds since the epoch (each
  attempt is signed anew, so a receiver's replay window holds for retries too);
- ``webhook-signature``: ``v1,<base64 HMAC-SHA256(key, "<id>.<timestamp>.<body>")>``
  (space-separated when several keys sign during a secret rotation).

The secret is ``whsec_<base64 key>``. ``sign`` makes the headers, ``verify`` checks
them (``WebhookRefused``, ``WebhookTimestampInvalid``: never a bool), ``deliver``
POSTs a body with bounded retries: on a 5xx, 408 or 429 answer, a timeout or a
connection error it waits ``backoff * 2**n`` capped at ``max_backoff``, with full
jitter (a random fraction of it, so retries of many senders do not line up), or
what a 429/503's ``Retry-After`` asks within the same cap; any other answer
outside 2xx (a 4xx, a redirect) is final. It raises ``WebhookDeliveryFailed``
when no attempt was accepted.

A message should hold ids and subject_refs only, like every other record that
leaves the store; nothing here logs or echoes a body, a secret or a signature.
Completion webhooks (``keyshred.erasure.callbacks``) call ``deliver`` with one
attempt per job run: the job queue retries them.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import random
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import urllib3

from keyshred.errors import (
    InvalidInput,
    WebhookDeliveryFailed,
    WebhookRefused,
    WebhookTimestampInvalid,
)

__all__ = [
    "DEFAULT_TOLERANCE_SECONDS",
    "Delivery",
    "deliver",
    "is_retryable",
    "new_message_id",
    "new_secret",
    "sign",
    "verify",
]

SECRET_PREFIX = "whsec_"  # noqa: S105 - the format's prefix, not a secret
DEFAULT_TOLERANCE_SECONDS = 300  # the specification's 5 minutes
_MIN_SECRET_BYTES = 16
_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_RETRY_STATUS_FLOOR = 500  # and every other 5xx


def is_retryable(status: int | None) -> bool:
    """Whether a failed attempt that got ``status`` (None: no answer: refused, reset,
    timed out) is worth another: a 5xx, 408 or 429 is; any other status is final."""
    return status is None or status in _RETRY_STATUS or status >= _RETRY_STATUS_FLOOR


def new_secret(nbytes: int = 32) -> str:
    """A fresh signing secret, ``whsec_`` and the base64 of ``nbytes`` random bytes."""
    if nbytes < _MIN_SECRET_BYTES:
        raise InvalidInput(f"a webhook secret needs at least {_MIN_SECRET_BYTES} bytes")
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(nbytes)).decode("ascii")


def new_message_id() -> str:
    """A random message id (``msg_`` and 128 random bits, base32)."""
    return "msg_" + base64.b32encode(secrets.token_bytes(16)).decode("ascii").rstrip("=").lower()


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The three Standard Webhooks headers for ``body`` sent as ``msg_id`` at
    ``timestamp`` (seconds since the epoch)."""
    _check_id(msg_id)
    if isinstance(timestamp, bool) or not isinstance(timestamp, int) or timestamp < 0:
        raise InvalidInput("a webhook timestamp is whole seconds since the epoch")
    signature = _signature(_key(secret), msg_id, str(timestamp), body)
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": f"v1,{signature}",
    }


def verify(
    secret: str,
    headers: Mapping[str, str],
    body: bytes,
    tolerance: float = DEFAULT_TOLERANCE_SECONDS,
    *,
    now: float | None = None,
) -> None:
    """Raise unless ``headers`` carry a valid ``v1`` signature of ``body`` by
    ``secret`` with a timestamp within ``tolerance`` seconds of ``now`` (either
    way: a clock ahead is as suspect as a replay). Header names are matched
    case-insensitively, as HTTP does."""
    key = _key(secret)
    lower = {k.lower(): v for k, v in headers.items()}
    msg_id = lower.get("webhook-id")
    stamp = lower.get("webhook-timestamp")
    given = lower.get("webhook-signature")
    if not msg_id or not stamp or not given:
        raise WebhookRefused(
            "the webhook-id, webhook-timestamp or webhook-signature header is missing"
        )
    # At most 20 digits: a longer number is no time (and int() of thousands of
    # digits raises, float arithmetic on it overflows).
    if not stamp.isascii() or not stamp.isdigit() or len(stamp) > 20:
        raise WebhookRefused("the webhook-timestamp header is not whole seconds")
    if not msg_id.isascii() or not msg_id.isprintable():
        raise WebhookRefused("the webhook-id header is not printable ASCII")
    current = time.time() if now is None else now
    if abs(current - int(stamp)) > tolerance:
        raise WebhookTimestampInvalid("the webhook's timestamp is outside the tolerance")
    expected = _signature(key, msg_id, stamp, body).encode("ascii")
    for item in given.split(" "):
        version, _, value = item.partition(",")
        # Every listed signature is compared in constant time; other versions
        # (v1a: asymmetric) are not ours to check.
        if version == "v1" and hmac.compare_digest(value.encode("ascii", "replace"), expected):
            return
    raise WebhookRefused("no webhook signature verifies with this secret")


@dataclass(frozen=True)
class Delivery:
    """A delivered message: its id, the attempts it took and the accepting status."""

    msg_id: str
    attempts: int
    status: int


def deliver(
    url: str,
    body: bytes,
    secret: str,
    *,
    msg_id: str | None = None,
    content_type: str = "application/json",
    max_attempts: int = 5,
    backoff: float = 0.5,
    max_backoff: float = 30.0,
    timeout: float = 10.0,
    pool: urllib3.PoolManager | None = None,
    sleep: Callable[[float], None] = time.sleep,
    jitter: Callable[[], float] = random.random,
    clock: Callable[[], float] = time.time,
) -> Delivery:
    """POST ``body`` to ``url``, signed, until a 2xx answer or ``max_attempts``.

    The message id (``msg_id``, a new one if not given) is the same on every
    attempt; each attempt is signed with its own timestamp. Redirects are not
    followed. Raises ``WebhookDeliveryFailed`` (with the attempts made and the last
    status) when no attempt was accepted."""
    try:
        scheme = urlsplit(url).scheme if isinstance(url, str) else ""
    except ValueError:  # an unclosed IPv6 bracket, a bad port
        scheme = ""
    if scheme not in ("http", "https"):
        raise InvalidInput("a webhook URL is http:// or https://")
    if max_attempts < 1 or backoff < 0 or max_backoff < 0 or timeout <= 0:
        raise InvalidInput("max_attempts >= 1, backoff >= 0, max_backoff >= 0, timeout > 0")
    msg_id = new_message_id() if msg_id is None else msg_id
    _key(secret)  # a malformed secret fails before anything is sent
    http = pool if pool is not None else urllib3.PoolManager()
    status: int | None = None
    for attempt in range(1, max_attempts + 1):
        headers = sign(secret, msg_id, int(clock()), body)
        headers["content-type"] = content_type
        headers["user-agent"] = "keyshred-webhooks"
        retry_after: float | None = None
        try:
            response = http.request(
                "POST",
                url,
                body=body,
                headers=headers,
                redirect=False,
                retries=False,
                timeout=urllib3.Timeout(total=timeout),
                preload_content=True,
            )
        except urllib3.exceptions.HTTPError:
            status = None  # refused, reset, timed out: retried
        else:
            status = response.status
            if 200 <= status < 300:
                return Delivery(msg_id, attempt, status)
            if not is_retryable(status):
                raise WebhookDeliveryFailed(
                    f"webhook {msg_id} refused with HTTP {status}", attempt, status
                )
            retry_after = _retry_after(response.headers.get("retry-after"))
        if attempt < max_attempts:
            delay = min(max_backoff, backoff * 2 ** (attempt - 1)) * jitter()
            if retry_after is not None:
                delay = max(delay, min(max_backoff, retry_after))
            sleep(delay)
    answer = "no answer" if status is None else f"HTTP {status}"
    raise WebhookDeliveryFailed(
        f"webhook {msg_id} not accepted after {max_attempts} attempts ({answer})",
        max_attempts,
        status,
    )


def _key(secret: str) -> bytes:
    if not isinstance(secret, str):
        raise InvalidInput("a webhook secret is a whsec_<base64> string")
    encoded = secret.removeprefix(SECRET_PREFIX)
    try:
        key = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput("a webhook secret is whsec_ and base64") from None
    if len(key) < _MIN_SECRET_BYTES:
        raise InvalidInput(f"a webhook secret needs at least {_MIN_SECRET_BYTES} bytes")
    return key


def _signature(key: bytes, msg_id: str, stamp: str, body: bytes) -> str:
    content = f"{msg_id}.{stamp}.".encode() + body
    return base64.b64encode(hmac.new(key, content, hashlib.sha256).digest()).decode("ascii")


def _check_id(msg_id: str) -> None:
    # The id is part of the signed content, delimited by "."; header-safe ASCII only.
    if (
        not isinstance(msg_id, str)
        or not msg_id
        or not msg_id.isascii()
        or not msg_id.isprintable()
    ):
        raise InvalidInput("a webhook message id is non-empty printable ASCII")
    if "." in msg_id or " " in msg_id or "," in msg_id:
        raise InvalidInput("a webhook message id holds no '.', ',' or space")


def _retry_after(value: str | None) -> float | None:
    # Seconds only; an HTTP-date is rare from webhook receivers and is ignored.
    if value is None or not value.strip().isdigit():
        return None
    return float(value.strip())
