"""Attack (fixed: leases are dated by the database's clock now): leases were dated
by each worker's own clock (``lease.now()``): a worker whose clock ran ahead by more
than the lease took over a request another worker held and renewed (its heartbeat
running), and both ran steps until the first one's next save."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from keyshred import Keyshred
from keyshred.erasure import lease as lease_mod
from tests.storage.conftest import make_config


@pytest.mark.parametrize("catalog_url", ["sqlite"], indirect=True)
def test_a_live_lease_is_not_taken_by_a_worker_with_a_clock_ahead(
    catalog_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Keyshred.init(tmp_path / "data", make_config(catalog_url)) as ks:
        ks.memories.put("v", ("m",), "k", "note")
        ks.erasure.request(ks.subject_ref("v"), None, requested_by="d", reason="r", request_id="q")
        held = lease_mod.claim(ks._catalog, "q", 60.0)  # alive, heartbeat running
        assert held is not None
        try:
            # This worker's clock runs 90 s ahead (leases are dated by the database's).
            from keyshred.erasure import requests

            real = requests.now
            monkeypatch.setattr(requests, "now", lambda: real() + timedelta(seconds=90))
            monkeypatch.setattr(lease_mod, "now", requests.now, raising=False)
            thief = lease_mod.claim(ks._catalog, "q", 60.0)
            if thief is not None:
                thief.release()
            assert thief is None, "a live lease was taken by a worker whose clock is ahead"
        finally:
            monkeypatch.undo()
            held.release()
