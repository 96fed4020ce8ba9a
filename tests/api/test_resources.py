"""Holds, consent and access requests over HTTP against the real server."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from keyshred import Keyshred
from keyshred.schema import api_downloads
from tests.api.conftest import ApiServer, run_worker


def test_a_held_subjects_erasure_waits_until_the_hold_is_released(server: ApiServer) -> None:
    subject = server.subjects[2]
    with server.client("operator") as op:
        hold = op.post("/v1/holds", json={"subject": subject, "reason": "case-42"})
        assert hold.status_code == 201
        hold_id = hold.json()["hold_id"]
        assert hold.json()["owner"] == "key:operator"
        found = op.post("/v1/holds/search", json={"subject": subject}).json()["holds"]
        assert [h["hold_id"] for h in found] == [hold_id]
        rid = op.post(
            "/v1/erasure-requests", json={"subject": subject, "reason": "gdpr-art17"}
        ).json()["request_id"]
        run_worker(server.data)
        assert op.get(f"/v1/erasure-requests/{rid}").json()["state"] == "legal_hold"
        assert op.post(f"/v1/holds/{hold_id}/release").status_code == 204
        assert op.post(f"/v1/holds/{hold_id}/release").status_code == 404
        assert op.post("/v1/holds/search", json={"subject": subject}).json()["holds"] == []
        run_worker(server.data)
        done = op.get(f"/v1/erasure-requests/{rid}").json()
        assert done["state"] == "completed"
        receipt = op.get(f"/v1/erasure-requests/{rid}/receipt").json()["receipt"]
        assert receipt["legal_hold_history"] is True


def test_consent_grant_then_withdrawal_is_a_scope_erasure(server: ApiServer) -> None:
    subject = "consent-subject-k7"
    with server.client("requester") as rq:
        granted = rq.post("/v1/consents", json={"subject": subject, "scope": "marketing/email"})
        assert granted.status_code == 201, granted.text
        assert granted.json()["status"] == "active"
        assert subject not in granted.text
        withdrawn = rq.post(
            "/v1/consents/withdrawals", json={"subject": subject, "scope": "marketing/email"}
        )
        assert withdrawn.status_code == 202
        view = withdrawn.json()
        assert view["kind"] == "consent-withdrawal"
        assert view["scope"] == "marketing/email"
        assert withdrawn.headers["location"] == f"/v1/erasure-requests/{view['request_id']}"
        assert view["identity"]["method"] == "requester-verified"
        run_worker(server.data)
        done = rq.get(withdrawn.headers["location"]).json()
        assert done["state"] == "completed"
        unknown = rq.post("/v1/consents", json={"subject": subject, "scope": "nope/nope"})
        assert unknown.status_code == 422


def test_an_access_package_downloads_once(server: ApiServer) -> None:
    subject = server.subjects[3]
    passphrase = "correct horse battery staple"
    with server.client("requester") as rq:
        made = rq.post("/v1/access-requests", json={"subject": subject, "passphrase": passphrase})
        assert made.status_code == 201, made.text
        view = made.json()
        assert view["counts"]["memories"] == 1
        assert made.headers["location"] == view["download"]
        with server.client("requester-2") as other:
            assert other.get(view["download"]).status_code == 403
        package = rq.get(view["download"])
        assert package.status_code == 200
        assert package.headers["content-type"] == "application/octet-stream"
        assert rq.get(view["download"]).status_code == 410
        neither = rq.post("/v1/access-requests", json={"subject": subject})
        assert neither.status_code == 422
    with Keyshred.open(server.data) as ks:
        files = ks.open_export(package.content, passphrase=passphrase)
    assert files["manifest.json"]["export_id"] == view["export_id"]
    assert files["memories.json"][0]["value"]["text"].startswith("probe-value-")


def test_an_expired_package_is_gone_and_dropped(server: ApiServer) -> None:
    with server.client("operator") as op:
        made = op.post(
            "/v1/access-requests",
            json={"subject": "expiring-export-subject", "passphrase": "a long passphrase"},
        )
        assert made.status_code == 201
        export_id = made.json()["export_id"]
        engine = sa.create_engine(f"sqlite:///{server.data / 'catalog' / 'catalog.db'}")
        try:
            where = api_downloads.c.export_id == export_id
            with engine.begin() as conn:
                assert conn.execute(sa.select(api_downloads.c.package).where(where)).scalar()
                past = datetime.now(UTC) - timedelta(seconds=1)
                conn.execute(api_downloads.update().where(where).values(expires_at=past))
            gone = op.get(made.json()["download"])
            assert gone.status_code == 410
            assert gone.json()["title"] == "The package has expired"
            with engine.connect() as conn:
                left = conn.execute(sa.select(api_downloads.c.package).where(where)).scalar()
            assert left is None
        finally:
            engine.dispose()


def test_consent_for_an_erased_subject_is_a_409(server: ApiServer) -> None:
    subject = "erased-then-consenting-subject"
    with server.client("operator") as op:
        rid = op.post(
            "/v1/erasure-requests", json={"subject": subject, "reason": "r", "block": True}
        ).json()["request_id"]
        run_worker(server.data)
        assert op.get(f"/v1/erasure-requests/{rid}").json()["state"] == "completed"
        refused = op.post("/v1/consents", json={"subject": subject, "scope": "marketing/email"})
        exported = op.post(
            "/v1/access-requests", json={"subject": subject, "passphrase": "a long passphrase"}
        )
    assert refused.status_code == 409, refused.text
    assert exported.status_code == 409, exported.text
    assert subject not in refused.text + exported.text
