"""Access requests: the subject's export package, downloadable once, expiring.

``POST /v1/access-requests`` runs the export now (``ks.export``: one consistent
read, sealed to the caller's passphrase or X25519 public key *and* to an export
DEK of the subject) and keeps the sealed package in the catalog database (table
``ks_api_downloads``) until the one ``GET …/package`` by the caller that asked for
it, or its expiry: then the row's package is dropped. Every process of a shared
deployment serves the download; the package is ciphertext, and erasing the subject
destroys its DEK (every copy is unreadable from then on).
"""

from __future__ import annotations

import shutil
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

import sqlalchemy as sa

from keyshred.api.common import subject_of, verify_identity
from keyshred.api.models import AccessRequestCreate, AccessRequestView
from keyshred.api.operations import Call, Operation, Reply
from keyshred.api.problems import Problem
from keyshred.db import utc
from keyshred.erasure.requests import COMPLETED, LEGAL_HOLD, REJECTED
from keyshred.errors import InvalidInput, NotFound
from keyshred.schema import api_downloads, deletion_requests
from keyshred.storage.catalog import Catalog

__all__ = ["OPERATIONS", "Downloads"]

BASE = "/v1/access-requests"


class Downloads:
    """Export packages waiting for their one download."""

    def __init__(self, catalog: Catalog, scratch: Path) -> None:
        self._catalog = catalog
        self._scratch = scratch

    def scratch_dir(self) -> str:
        """A private folder for ``ks.export`` to write into (removed after)."""
        self._scratch.mkdir(mode=0o700, parents=True, exist_ok=True)
        return tempfile.mkdtemp(dir=self._scratch)

    def keep(
        self,
        export_id: str,
        actor: str,
        subject_ref: str,
        package: bytes,
        expires_at: datetime,
        *,
        since: datetime,
    ) -> None:
        """Keep the package of an export that began at ``since``; refused (409) when an
        erasure of the subject may have run meanwhile: its catalog step drops only
        the packages already kept, and a scope erasure leaves the export DEK alive."""
        now = datetime.now(UTC)
        with self._catalog.transaction() as conn:
            if _erasure_since(conn, subject_ref, since):
                raise Problem(
                    409, "erasure-pending", "An erasure of this subject is pending or ran"
                )
            # Expired packages leave now; their rows (no package) after a month.
            conn.execute(
                api_downloads.update()
                .where(api_downloads.c.expires_at < now, api_downloads.c.package.is_not(None))
                .values(package=None)
            )
            conn.execute(
                api_downloads.delete().where(api_downloads.c.created_at < now - timedelta(days=31))
            )
            conn.execute(
                api_downloads.insert().values(
                    export_id=export_id,
                    actor=actor,
                    subject_ref=subject_ref,
                    created_at=now,
                    expires_at=expires_at,
                    downloaded_at=None,
                    package=package,
                )
            )

    def take(self, export_id: str, actor: str) -> bytes:
        """The package, once: 403 for another caller, 410 once downloaded, expired or
        dropped by an erasure of its subject."""
        now = datetime.now(UTC)
        with self._catalog.transaction() as conn:
            row = conn.execute(
                sa.select(api_downloads).where(api_downloads.c.export_id == export_id)
            ).first()
            if row is None:
                raise NotFound(f"no access request {export_id}")
            if row.actor != actor:
                raise Problem(403, "forbidden", "This access request was made by another caller")
            if row.downloaded_at is not None:
                raise Problem(410, "gone", "The package was downloaded already")
            # Decided before the package leaves: an erasure pending, or run since the
            # package was kept (one that began while it was being kept), drops it.
            withdrawn = row.package is None or _erasure_since(
                conn, row.subject_ref, utc(row.created_at) or now
            )
            expired = not withdrawn and row.expires_at <= now
            # Taken (or dropped) by exactly one caller: the row's update, committed
            # before any answer (a dropped package stays dropped).
            taken = conn.execute(
                api_downloads.update()
                .where(
                    api_downloads.c.export_id == export_id,
                    api_downloads.c.downloaded_at.is_(None),
                    api_downloads.c.package.is_not(None),
                )
                .values(downloaded_at=None if expired or withdrawn else now, package=None)
            ).rowcount
        if withdrawn:
            raise Problem(410, "gone", "The package is no longer available")
        if expired:
            raise Problem(410, "gone", "The package has expired")
        if taken != 1:
            raise Problem(410, "gone", "The package was downloaded already")
        return bytes(row.package)


def create(call: Call) -> Reply:
    body: AccessRequestCreate = call.body
    if (body.passphrase is None) == (body.recipient_public_key is None):
        raise InvalidInput("give exactly one of passphrase and recipient_public_key")
    subject = subject_of(call)
    verify_identity(call, subject, "access.create")
    downloads = call.services.downloads
    hours = call.services.settings.export_hours
    folder = downloads.scratch_dir()
    began = datetime.now(UTC)
    try:
        result = call.ks.export(
            subject,
            Path(folder) / "package",
            passphrase=body.passphrase,
            recipient_public_key=body.recipient_public_key,
            expires_in=timedelta(hours=hours),
        )
        package = Path(result.path).read_bytes()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    ref = call.ks.subject_ref(subject)
    downloads.keep(
        result.export_id, call.principal.actor, ref, package, result.expires_at, since=began
    )
    location = f"{BASE}/{result.export_id}/package"
    view = {
        "export_id": result.export_id,
        "subject_ref": ref,
        "expires_at": result.expires_at.isoformat(),
        "counts": result.counts,
        "download": location,
    }
    return Reply(201, view, {"Location": location}, request_id=result.export_id)


def download(call: Call) -> Reply:
    export_id = call.params["export_id"]
    package = call.services.downloads.take(export_id, call.principal.actor)
    return Reply(
        200,
        content=package,
        media_type="application/octet-stream",
        headers={"Content-Disposition": f'attachment; filename="{export_id}.ksexport"'},
        request_id=export_id,
    )


OPERATIONS = (
    Operation(
        "POST",
        BASE,
        "access.create",
        "Export the subject's data as a sealed package (downloadable once, expiring)",
        frozenset({"requester", "operator"}),
        create,
        status=201,
        body=AccessRequestCreate,
        response=AccessRequestView,
        errors=(403, 409, 422),
        tag="access",
    ),
    Operation(
        "GET",
        BASE + "/{export_id}/package",
        "access.download",
        "The sealed package, once, by the caller that asked for it (410 after)",
        frozenset({"requester", "operator"}),
        download,
        errors=(403, 404, 410),
        media_type="application/octet-stream",
        tag="access",
    ),
)


def _erasure_since(conn: sa.Connection, subject_ref: str, since: datetime) -> bool:
    """Whether an erasure of the subject (any scope) may have run since ``since``: a
    request not settled yet, or one that settled at or after it. A held or rejected
    request erased nothing."""
    rows = conn.execute(
        sa.select(deletion_requests.c.state, deletion_requests.c.updated_at).where(
            deletion_requests.c.subject_ref == subject_ref
        )
    ).all()
    for state, updated_at in rows:
        if state in (REJECTED, LEGAL_HOLD):
            continue
        at = utc(updated_at)
        if state != COMPLETED or at is None or at >= since:
            return True
    return False
