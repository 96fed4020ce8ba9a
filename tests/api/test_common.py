"""The request view: the current step, step times and the last failure's class."""

from __future__ import annotations

from datetime import UTC, datetime

from keyshred.api.common import request_view
from keyshred.api.models import ErasureRequestView
from keyshred.erasure import STEPS, ErasureRequest


def _request(state: str, doc: dict[str, object]) -> ErasureRequest:
    at = datetime(2026, 12, 3, tzinfo=UTC)
    return ErasureRequest("r1", "ref", None, state, "key:ops", "gdpr", at, at, 1, doc)


def test_a_failed_step_names_its_class_and_the_step_it_stopped_at() -> None:
    doc = {
        "done": ["suppress"],
        "details": {"suppress": {"at": "2026-12-03T00:00:01+00:00"}},
        "error": "destroy_keys: KekUnavailable",
    }
    view = request_view(_request("retryable_failure", doc), STEPS, False)
    ErasureRequestView.model_validate(view)
    assert view["step"] == "destroy_keys"
    assert view["error_class"] == "KekUnavailable"
    assert view["step_times"] == {"suppress": "2026-12-03T00:00:01+00:00"}


def test_manual_review_names_verification_or_an_unknown_producer() -> None:
    failed = {"done": [], "details": {}, "error": "probe found in the vectors store"}
    assert request_view(_request("manual_review", failed), STEPS, False)["error_class"] == (
        "VerificationFailed"
    )
    producer = {**failed, "error": "no rebuild function for summary 1", "review": "producer"}
    assert request_view(_request("manual_review", producer), STEPS, False)["error_class"] == (
        "ProducerUnknown"
    )
    done = request_view(_request("completed", {"done": list(STEPS), "details": {}}), STEPS, True)
    assert done["step"] is None and done["error_class"] is None
