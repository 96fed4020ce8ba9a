"""Attack: arbitrary inputs to the new public API must raise KeyshredError only."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from keyshred.errors import KeyshredError
from keyshred.receipts import load_receipt
from keyshred.webhooks import new_secret, verify


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


@pytest.mark.parametrize(
    "stamp",
    ["9" * 400, "9" * 5000],
    ids=["overflow-float", "int-digit-limit"],
)
def test_webhook_verify_huge_timestamp_is_refused(stamp: str) -> None:
    headers = {"webhook-id": "msg_1", "webhook-timestamp": stamp, "webhook-signature": "v1,x"}
    with pytest.raises(KeyshredError):
        verify(new_secret(), headers, b"{}")


def test_webhook_verify_unencodable_id_is_refused() -> None:
    import time

    headers = {
        "webhook-id": "msg_\ud800",
        "webhook-timestamp": str(int(time.time())),
        "webhook-signature": "v1,x",
    }
    with pytest.raises(KeyshredError):
        verify(new_secret(), headers, b"{}")


def test_load_receipt_deeply_nested_header_is_refused() -> None:
    token = ".".join([_b64url(b"[" * 100_000 + b"]" * 100_000), _b64url(b"{}"), _b64url(b"s" * 64)])
    with pytest.raises(KeyshredError):
        load_receipt(token)


def test_webhook_deliver_malformed_url_is_refused() -> None:
    from keyshred.webhooks import deliver

    with pytest.raises(KeyshredError):
        deliver("http://[::1", b"{}", new_secret(), max_attempts=1)


@pytest.mark.parametrize("delay", [float("inf"), 1e300, None, "1"])
@pytest.mark.parametrize("catalog_url", ["sqlite"], indirect=True)
def test_enqueue_with_an_absurd_delay_is_refused(
    catalog_url: str, tmp_path: Path, delay: float
) -> None:
    from keyshred import Keyshred
    from tests.storage.conftest import make_config

    with (
        Keyshred.init(tmp_path / "data", make_config(catalog_url)) as ks,
        pytest.raises(KeyshredError),
    ):
        ks.jobs.queue.enqueue("retention", {"period": "1"}, delay=delay)


@pytest.mark.parametrize("catalog_url", ["sqlite"], indirect=True)
def test_enqueue_with_a_dedupe_key_that_is_no_string_is_refused(
    catalog_url: str, tmp_path: Path
) -> None:
    from keyshred import Keyshred
    from tests.storage.conftest import make_config

    with (
        Keyshred.init(tmp_path / "data", make_config(catalog_url)) as ks,
        pytest.raises(KeyshredError),
    ):
        ks.jobs.queue.enqueue("retention", {"period": "1"}, dedupe_key=5)  # type: ignore[arg-type]
