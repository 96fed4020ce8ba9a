"""Attack: two callers submitting the same request id at once (an HTTP client that
retries its POST, two API processes behind a balancer) are not idempotent.

``ErasureCoordinator.request`` reads the id (``_load``), finds nothing, and inserts
the request and its job; it does not expect the insert to find the id taken. Two
callers between the read and the insert: the second's insert hits the primary key
and ``sqlalchemy.exc.IntegrityError`` (no KeyshredError) comes out of
``ks.erasure.submit`` — for a call documented as "idempotent by request_id"."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from keyshred.errors import KeyshredError
from tests.test_eviction import _config, _open


@pytest.mark.parametrize("catalog_url", ["postgres"], indirect=True)
def test_concurrent_submits_of_one_request_id_are_idempotent(
    catalog_url: str, tmp_path: Path
) -> None:
    config = _config(catalog_url, tmp_path)
    handles = [_open(tmp_path / "a", config), _open(tmp_path / "b", config)]
    try:
        handles[0].memories.put("alice", ("m",), "k", {"text": "note"})
        barrier = threading.Barrier(2, timeout=10)
        for ks in handles:
            coordinator = ks._erasure
            original = coordinator._load

            def load(request_id: str, original=original, state={"first": True}):  # type: ignore[no-untyped-def]  # noqa: B006 - one per handle
                try:
                    return original(request_id)
                except KeyshredError:
                    if state["first"]:
                        state["first"] = False
                        barrier.wait()  # both callers found no request
                    raise

            coordinator._load = load  # type: ignore[method-assign]
        results: list[object] = []

        def submit(ks: object) -> None:
            try:
                results.append(
                    ks.erasure.submit(  # type: ignore[attr-defined]
                        "alice", requested_by="dpo", reason="gdpr", request_id="req-twice"
                    ).request_id
                )
            except BaseException as exc:  # noqa: BLE001
                results.append(exc)

        threads = [threading.Thread(target=submit, args=(ks,)) for ks in handles]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert results == ["req-twice", "req-twice"], results
    finally:
        for ks in handles:
            ks.close()
