"""The services' tables in the catalog database: erasure requests, legal holds,
the audit log, jobs, eviction acknowledgements and the HTTP API's idempotency
records, rate-limit buckets and export downloads (``keyshred.erasure``, ``keyshred.audit``,
``keyshred.jobs``, ``keyshred.api``).

They are defined on the catalog database's ``metadata`` (``keyshred.storage.schema``),
so snapshots and the migrations see them with the storage and vault tables; schema
changes are Alembic revisions in ``keyshred.migrations``.
"""

from __future__ import annotations

import sqlalchemy as sa

from keyshred.db import Micros
from keyshred.storage.schema import metadata

__all__ = [
    "api_downloads",
    "api_idempotency",
    "api_rate",
    "audit_anchor",
    "audit_events",
    "deletion_requests",
    "erasure_items",
    "eviction_acks",
    "jobs",
    "legal_holds",
]

deletion_requests = sa.Table(
    "ks_deletion_requests",
    metadata,
    sa.Column("request_id", sa.String(64), primary_key=True),
    sa.Column("subject_ref", sa.String(64), nullable=False),
    sa.Column("scope", sa.String(128), nullable=True),
    sa.Column("state", sa.String(32), nullable=False),
    sa.Column("requested_by", sa.String(128), nullable=False),
    sa.Column("reason", sa.String(256), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("doc", sa.Text, nullable=False),  # JSON: steps done, per-store details
    sa.Column("receipt", sa.Text, nullable=True),
    # The worker running the request and until when (keyshred.erasure.lease): one
    # worker at a time, a killed one's lease runs out. NULL: nobody runs it.
    sa.Column("lease_owner", sa.String(64), nullable=True),
    sa.Column("lease_until", Micros, nullable=True),
    sa.Index("ks_deletion_requests_subject", "subject_ref"),
)

# A request's long lists, out of its JSON document (which every step's record
# rewrites whole): its own asset ids and the closure's ("own", "closure"), written
# once by the closure step, and a long step's per-item progress ("progress:<step>",
# one row per item, written as the item is done). ``pos`` keeps each list's order.
erasure_items = sa.Table(
    "ks_erasure_items",
    metadata,
    sa.Column("request_id", sa.String(64), primary_key=True),
    sa.Column("list", sa.String(64), primary_key=True),
    sa.Column("item", sa.String(128), primary_key=True),
    sa.Column("pos", sa.BigInteger, nullable=False),
    sa.Column("entry", sa.Text, nullable=True),  # JSON (progress entries only)
)

audit_events = sa.Table(
    "ks_audit",
    metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("event", sa.String(64), nullable=False),
    sa.Column("subject_ref", sa.String(64), nullable=True),
    sa.Column("request_id", sa.String(64), nullable=True),
    sa.Column("data", sa.Text, nullable=False),
    sa.Column("prev_hash", sa.String(64), nullable=False),
    sa.Column("hash", sa.String(64), nullable=False),
)

audit_anchor = sa.Table(
    "ks_audit_anchor",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("pruned_through", sa.Integer, nullable=False),
    sa.Column("last_hash", sa.String(64), nullable=False),
    sa.Column("pruned_at", sa.DateTime(timezone=True), nullable=False),
)

legal_holds = sa.Table(
    "ks_legal_holds",
    metadata,
    sa.Column("hold_id", sa.String(64), primary_key=True),
    sa.Column("subject_ref", sa.String(64), nullable=False),
    sa.Column("scope", sa.String(128), nullable=True),
    sa.Column("reason", sa.String(256), nullable=False),
    sa.Column("owner", sa.String(128), nullable=False),
    sa.Column("placed_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("released_at", sa.DateTime(timezone=True), nullable=True),
    sa.Index("ks_legal_holds_subject", "subject_ref"),
)

# Work that outlives a call (keyshred.jobs). Times are integer microseconds by the
# database's clock (keyshred.leases), so every worker reads "due" and "expired" alike.
jobs = sa.Table(
    "ks_jobs",
    metadata,
    sa.Column("job_id", sa.String(64), primary_key=True),
    sa.Column("kind", sa.String(64), nullable=False),
    sa.Column("payload", sa.Text, nullable=False),  # JSON: ids and subject_refs only
    sa.Column("state", sa.String(32), nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("max_attempts", sa.Integer, nullable=False),
    sa.Column("run_after", sa.BigInteger, nullable=False),
    sa.Column("lease_owner", sa.String(64), nullable=True),
    sa.Column("lease_until", sa.BigInteger, nullable=True),
    sa.Column("last_error", sa.String(128), nullable=True),  # an exception class name
    # One job per key (one retention run per period, one job per erasure request).
    sa.Column("dedupe_key", sa.String(200), nullable=True, unique=True),
    sa.Column("created_at", sa.BigInteger, nullable=False),
    sa.Column("updated_at", sa.BigInteger, nullable=False),
    sa.Index("ks_jobs_due", "state", "run_after"),
)

# One row per (eviction event, process) that acted on it (``keyshred.erasure.
# eviction``): both times by the database's clock, so the receipt's latency from
# the suppression's commit to the last process's eviction needs no synchronised
# hosts. ``process_id`` is random per process (no host name or pid in clear).
eviction_acks = sa.Table(
    "ks_eviction_acks",
    metadata,
    sa.Column("event_id", sa.String(32), primary_key=True),
    sa.Column("process_id", sa.String(32), primary_key=True),
    sa.Column("subject_ref", sa.String(64), nullable=False),
    sa.Column("epoch", sa.BigInteger, nullable=False),
    sa.Column("published_at", Micros, nullable=False),
    sa.Column("evicted_at", Micros, nullable=False),
    sa.Index("ks_eviction_acks_subject", "subject_ref", "epoch"),
)

# The HTTP API's ``Idempotency-Key`` records (``keyshred.api.idempotency``): per
# credential and key, a keyed hash of the request (never the body itself) and the
# response first given, returned again to a retry with the same body.
api_idempotency = sa.Table(
    "ks_api_idempotency",
    metadata,
    sa.Column("actor", sa.String(128), primary_key=True),
    sa.Column("idem_key", sa.String(128), primary_key=True),
    sa.Column("body_hash", sa.String(64), nullable=False),
    sa.Column("status", sa.Integer, nullable=True),  # NULL: the first call is running
    sa.Column("response", sa.Text, nullable=True),  # JSON: ids, states, subject_refs
    sa.Column("location", sa.String(256), nullable=True),
    sa.Column("created_at", Micros, nullable=False),
    sa.Column("expires_at", Micros, nullable=False),
)

# Access requests' export packages waiting for their one download
# (``keyshred.api.access``): the sealed package (ciphertext under the export's DEK
# and the requester's passphrase or public key), dropped when it is downloaded or
# expires. ``actor`` is who may download it.
api_downloads = sa.Table(
    "ks_api_downloads",
    metadata,
    sa.Column("export_id", sa.String(64), primary_key=True),
    sa.Column("actor", sa.String(128), nullable=False),
    sa.Column("subject_ref", sa.String(64), nullable=False),
    sa.Column("created_at", Micros, nullable=False),
    sa.Column("expires_at", Micros, nullable=False),
    sa.Column("downloaded_at", Micros, nullable=True),
    sa.Column("package", sa.LargeBinary, nullable=True),
)

# The HTTP API's rate-limit buckets when several processes share the catalog
# (``keyshred.api.ratelimit.SharedBuckets``, PostgreSQL): one row per credential,
# named by a keyed hash of it (never the token or the actor). ``at`` is the
# database's clock (epoch seconds), so processes on several machines agree;
# ``allowed`` is whether the last call that updated the row was let through.
# Losing the rows loses nothing that matters: the buckets refill.
api_rate = sa.Table(
    "ks_api_rate",
    metadata,
    sa.Column("credential", sa.String(64), primary_key=True),
    sa.Column("tokens", sa.Float, nullable=False),
    sa.Column("at", sa.Float, nullable=False),
    sa.Column("allowed", sa.Boolean, nullable=False),
)
