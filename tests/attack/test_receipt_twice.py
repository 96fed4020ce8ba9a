"""Attack: the receipt step saves the signed receipt, logs ``erasure.completed``,
and only then (back in ``_run_leased``) saves the step as done. A worker killed (or
one that lost its lease) between the two leaves a request whose receipt exists but
whose ``receipt`` step is not done: the next run signs a second receipt and logs
``erasure.completed`` a second time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from keyshred import Keyshred
from tests.storage.conftest import make_config

VICTIM = "victim@example.org"


class _Killed(BaseException):
    """The worker dies right here (SIGKILL would do the same, less conveniently)."""


@pytest.mark.parametrize("catalog_url", ["sqlite"], indirect=True)
def test_a_worker_killed_after_logging_completion_does_not_complete_twice(
    catalog_url: str, tmp_path: Path
) -> None:
    with Keyshred.init(tmp_path / "data", make_config(catalog_url)) as ks:
        ks.memories.put(VICTIM, ("m",), "k", "note")
        ref = ks.subject_ref(VICTIM)
        ks.erasure.request(ref, None, requested_by="dpo", reason="t", request_id="req-kill")
        audit = ks._erasure._audit
        original = audit.record

        def record(event: str, **data: Any) -> Any:
            out = original(event, **data)
            if event == "erasure.completed":
                raise _Killed()
            return out

        audit.record = record  # type: ignore[method-assign]
        with pytest.raises(_Killed):
            ks.erasure.resume("req-kill")
        audit.record = original  # type: ignore[method-assign]
        first = ks.erasure.receipt("req-kill")
        assert first is not None  # the receipt was saved before the kill
        req = ks.erasure.resume("req-kill")
        assert req.state == "completed"
        events = ks.audit.events(request_id="req-kill", event="erasure.completed")
        assert len(events) == 1, f"erasure.completed logged {len(events)} times"
        second = ks.erasure.receipt("req-kill")
        assert second is not None
        assert second.to_json() == first.to_json(), "a second, different receipt was signed"
