"""An access package waiting for its download goes with its subject's erasure, a
scope erasure (consent withdrawal) included: the package holds every scope."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from keyshred import Config, Keyshred
from keyshred.api.access import Downloads
from keyshred.api.problems import Problem
from keyshred.config import ScopeSettings
from keyshred.schema import api_downloads
from tests.api.conftest import ApiServer, run_worker


def _package_kept(server: ApiServer, export_id: str) -> bool:
    engine = sa.create_engine(f"sqlite:///{server.data / 'catalog' / 'catalog.db'}")
    try:
        with engine.connect() as conn:
            return (
                conn.execute(
                    sa.select(api_downloads.c.package).where(api_downloads.c.export_id == export_id)
                ).scalar()
                is not None
            )
    finally:
        engine.dispose()


def _export(server: ApiServer, subject: str) -> tuple[str, str]:
    with server.client("operator") as op:
        op.post("/v1/consents", json={"subject": subject, "scope": "marketing/email"})
        made = op.post(
            "/v1/access-requests", json={"subject": subject, "passphrase": "a long passphrase"}
        )
    assert made.status_code == 201, made.text
    return made.json()["export_id"], made.json()["download"]


def test_an_erasure_drops_its_subjects_pending_package(server: ApiServer) -> None:
    subject = "export-then-erased-subject-q3"
    export_id, download = _export(server, subject)
    assert _package_kept(server, export_id)
    with server.client("operator") as op:
        rid = op.post(
            "/v1/erasure-requests", json={"subject": subject, "reason": "gdpr-art17", "block": True}
        ).json()["request_id"]
        run_worker(server.data)
        done = op.get(f"/v1/erasure-requests/{rid}").json()
        assert done["state"] == "completed", done
        gone = op.get(download)
        receipt = op.get(f"/v1/erasure-requests/{rid}/receipt").json()["receipt"]
    dropped = [s for s in receipt["stores"] if s["action"] == "access-packages-dropped"]
    assert [s["count"] for s in dropped] == [1]
    assert gone.status_code == 410
    assert gone.json()["title"] == "The package is no longer available"
    assert not _package_kept(server, export_id)


def test_a_consent_withdrawal_drops_the_pending_package_too(server: ApiServer) -> None:
    subject = "export-then-withdrawn-subject-w8"
    export_id, download = _export(server, subject)
    with server.client("operator") as op:
        withdrawn = op.post(
            "/v1/consents/withdrawals", json={"subject": subject, "scope": "marketing/email"}
        )
        assert withdrawn.status_code == 202, withdrawn.text
        run_worker(server.data)
        assert op.get(download).status_code == 410
    assert not _package_kept(server, export_id)


# -- the race the catalog step cannot see: an erasure between the export and the keep


def _store(tmp_path: Path) -> Keyshred:
    config = Config(
        scopes={"marketing/email": ScopeSettings(purpose="marketing", categories=["email"])}
    )
    ks = Keyshred.init(tmp_path / "data", config)
    ks.memories.put("race-subject", ("notes",), "fact", {"text": "probe-value-race-4411"})
    return ks


def test_a_package_exported_before_a_scope_erasure_ran_is_not_kept(tmp_path: Path) -> None:
    with _store(tmp_path) as ks:
        downloads = Downloads(ks.catalog, tmp_path / "scratch")
        began = datetime.now(UTC)
        ref = ks.subject_ref("race-subject")
        # The scope erasure runs to the end after the export began, before the keep.
        ks.erase("race-subject", "default", requested_by="t", reason="r")
        with pytest.raises(Problem) as info:
            downloads.keep("e1", "key:op", ref, b"sealed", began + timedelta(hours=1), since=began)
        assert info.value.status == 409
        with ks.catalog.transaction() as conn:
            assert conn.execute(sa.select(api_downloads)).all() == []
        # An export that began after it is kept.
        downloads.keep(
            "e2",
            "key:op",
            ref,
            b"sealed",
            datetime.now(UTC) + timedelta(hours=1),
            since=datetime.now(UTC),
        )
        assert downloads.take("e2", "key:op") == b"sealed"


def test_a_package_is_not_served_while_an_erasure_of_its_subject_is_pending(
    tmp_path: Path,
) -> None:
    with _store(tmp_path) as ks:
        downloads = Downloads(ks.catalog, tmp_path / "scratch")
        ref = ks.subject_ref("race-subject")
        now = datetime.now(UTC)
        downloads.keep("e3", "key:op", ref, b"sealed", now + timedelta(hours=1), since=now)
        ks.erasure.submit("race-subject", requested_by="t", reason="r")  # recorded, not run
        with pytest.raises(Problem) as info:
            downloads.take("e3", "key:op")
        assert (info.value.status, info.value.title) == (410, "The package is no longer available")
        with ks.catalog.transaction() as conn:
            left = conn.execute(sa.select(api_downloads.c.package)).scalar()
        assert left is None  # dropped, not only refused
