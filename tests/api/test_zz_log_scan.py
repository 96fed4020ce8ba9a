"""The server's output (uvicorn's access log and its own log) and the audit log hold
no probe subject id or value, after every route was called with them. Named to run
last in tests/api, so it also scans what the other files' calls left; it makes its
own calls first, so it stands alone too."""

from __future__ import annotations

import json
import re
import uuid

import sqlalchemy as sa

from keyshred.schema import api_downloads, api_idempotency, audit_events
from tests.api.conftest import PROBE_SUBJECTS, PROBE_VALUES, ApiServer, run_worker

SCAN_SUBJECT = "scan-probe-subject-hq55@example.com"


def _every_route(server: ApiServer) -> None:
    subject = {"subject": SCAN_SUBJECT}
    idem = {"Idempotency-Key": uuid.uuid4().hex}
    with server.client("operator") as op:
        op.post("/v1/consents", json={**subject, "scope": "marketing/email"})
        hold = op.post("/v1/holds", json={**subject, "reason": "scan-case"}).json()
        op.post("/v1/holds/search", json=subject)
        op.post(f"/v1/holds/{hold['hold_id']}/release")
        made = op.post("/v1/erasure-requests", json={**subject, "reason": "scan"}, headers=idem)
        op.post("/v1/erasure-requests", json={**subject, "reason": "scan"}, headers=idem)
        op.post("/v1/erasure-requests", json={**subject, "reason": "other"}, headers=idem)
        # Bad input that holds the subject: refused without echoing it.
        bad = op.post("/v1/erasure-requests", json={**subject, "reason": SCAN_SUBJECT + "\n"})
        assert bad.status_code == 422 and SCAN_SUBJECT not in bad.text
        unknown_scope = op.post(
            "/v1/erasure-requests", json={**subject, "reason": "r", "scope": PROBE_VALUES[0]}
        )
        assert unknown_scope.status_code == 422 and PROBE_VALUES[0] not in unknown_scope.text
        op.post("/v1/consents/withdrawals", json={**subject, "scope": "marketing/email"})
        rid = made.json()["request_id"]
        run_worker(server.data)
        op.get(f"/v1/erasure-requests/{rid}")
        op.get(f"/v1/erasure-requests/{rid}/receipt")
        op.get("/v1/erasure-requests", params={"state": "completed"})
    with server.client("requester") as rq:
        access = rq.post("/v1/access-requests", json={**subject, "passphrase": "a long passphrase"})
        if access.status_code == 201:
            rq.get(access.json()["download"])
    with server.client(token=server.jwt("requester", sub=SCAN_SUBJECT)) as end_user:
        end_user.post("/v1/erasure-requests", json={**subject, "reason": "self"})
    with server.client("auditor") as au:
        au.get("/v1/audit/events", params={"limit": 1000})
        au.get("/v1/audit/verify")


def test_no_probe_subject_or_value_in_the_access_log_or_the_audit_log(
    server: ApiServer,
) -> None:
    _every_route(server)
    probes = [*PROBE_SUBJECTS, SCAN_SUBJECT, *PROBE_VALUES]
    logs = server.logs()
    # The access log is there (the scan would pass on an empty file).
    assert '"POST /v1/erasure-requests HTTP/1.1" 202' in logs
    assert '"GET /v1/audit/verify HTTP/1.1" 200' in logs
    # Every call of the run, bad input and forbidden ones included: never a 5xx.
    assert not re.search(r'HTTP/1\.1" 5\d\d', logs), "a 5xx in the access log"
    assert "Traceback" not in logs
    engine = sa.create_engine(f"sqlite:///{server.data / 'catalog' / 'catalog.db'}")
    try:
        with engine.connect() as conn:
            audit = conn.execute(sa.select(audit_events)).all()
            idem = conn.execute(sa.select(api_idempotency)).all()
            downloads = conn.execute(
                sa.select(
                    api_downloads.c.export_id, api_downloads.c.actor, api_downloads.c.subject_ref
                )
            ).all()
    finally:
        engine.dispose()
    calls = [r for r in audit if r.event == "api.call"]
    assert len(calls) >= 18
    assert {json.loads(r.data)["action"] for r in calls} >= {
        "erasure.create",
        "erasure.get",
        "erasure.receipt",
        "erasure.list",
        "hold.place",
        "hold.release",
        "hold.list",
        "consent.grant",
        "consent.withdraw",
        "access.create",
        "audit.events",
        "audit.verify",
    }
    audit_text = "\n".join(f"{r.event} {r.subject_ref} {r.request_id} {r.data}" for r in audit)
    stored = "\n".join(f"{r.actor} {r.body_hash} {r.response}" for r in idem)
    stored += "\n".join(" ".join(map(str, r)) for r in downloads)
    for probe in probes:
        for form in {probe, probe.lower(), probe.upper(), json.dumps(probe)[1:-1]}:
            assert form not in logs, f"probe #{probes.index(probe)} in the server's output"
            assert form not in audit_text, f"probe #{probes.index(probe)} in the audit log"
            assert form not in stored, f"probe #{probes.index(probe)} in the API's tables"
