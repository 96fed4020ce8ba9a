"""Completion webhooks through the real API server process: an erasure request
created over HTTP is run by a ``keyshred worker`` process, whose completion
callback reaches a loopback receiver that checks its signature with the
independent ``standardwebhooks`` package; the callback's receipt digest is that of
the receipt the API serves, and neither the subject id nor the secret appears in
the server's output or the callback."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest
from standardwebhooks.webhooks import Webhook

from keyshred.config import WebhookSettings, load_config, save_config
from tests.api.conftest import run_worker, seed, start_server, stop_server, write_settings
from tests.test_completion_webhooks import start_receiver

SECRET_VARIABLE = "KS_TEST_COMPLETION_HOOK_SECRET"  # not KEYSHRED_: the servers keep it


def test_an_erasure_requested_over_http_calls_back_signed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    r, receiver = start_receiver()
    data = tmp_path / "data"
    subject = seed(data)[0]
    config = load_config(data, {})
    endpoint = WebhookSettings(url=r.url, secret_env=SECRET_VARIABLE, name="dpo-desk")
    save_config(data, config.model_copy(update={"webhooks": [endpoint]}))
    # The server and the worker read the secret from their environment.
    monkeypatch.setenv(SECRET_VARIABLE, r.secret)
    tokens, _ = write_settings(tmp_path)
    process, base, out, err = start_server(tmp_path, data, settings=tmp_path / "api.toml")
    try:
        auth = {"Authorization": f"Bearer {tokens['operator']}"}
        with httpx.Client(base_url=base, headers=auth, timeout=30) as op:
            created = op.post(
                "/v1/erasure-requests", json={"subject": subject, "reason": "gdpr-art17"}
            )
            assert created.status_code == 202, created.text
            rid = created.json()["request_id"]
            assert r.bodies == []  # recorded, not run: nothing to announce yet

            run_worker(data)  # runs the erasure, then the delivery it enqueued

            view = op.get(f"/v1/erasure-requests/{rid}").json()
            assert view["state"] == "completed"
            [(msg_id, message)] = r.accepted()
            assert r.verified == [True]
            assert Webhook(r.secret).verify(r.bodies[0], r.headers[0]) == message
            assert msg_id.startswith("msg_")
            assert message["type"] == "erasure.completed"
            data_ = message["data"]
            assert data_["request_id"] == rid and data_["state"] == "completed"
            assert data_["subject_ref"] == view["subject_ref"]
            # The callback points at the receipt the API serves, by its digest.
            receipt = op.get(data_["receipt"]["path"])
            assert receipt.status_code == 200
            jws = receipt.json()["jws"]
            assert hashlib.sha256(jws.encode()).hexdigest() == data_["receipt"]["sha256"]
    finally:
        stop_server(process)
        receiver.shutdown()
        receiver.server_close()
    logs = out.read_text(errors="replace") + err.read_text(errors="replace")
    for text in (logs, r.bodies[0].decode(), str(r.headers)):
        assert subject not in text
        assert r.secret not in text and r.secret.removeprefix("whsec_") not in text
