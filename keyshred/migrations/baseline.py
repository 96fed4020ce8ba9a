"""The catalog database's schema at revision 0001: every table as keyshred main at
commit fae494a (the release before versioned migrations) created it, frozen here.

Revision 0001 creates these tables; a catalog from before versioned migrations has
them already and is stamped at 0001 (``keyshred.migrations.migrate_catalog``). Never
edit this module: a schema change is a new revision.
"""

from __future__ import annotations

import sqlalchemy as sa

__all__ = ["metadata"]

metadata = sa.MetaData()

assets = sa.Table(
    "ks_assets",
    metadata,
    sa.Column("asset_id", sa.String(64), primary_key=True),
    sa.Column("subject_ref", sa.String(64), nullable=False),
    sa.Column("scope", sa.String(128), nullable=False),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("storage_system", sa.String(32), nullable=False),
    sa.Column("storage_key", sa.String(512), nullable=False),
    sa.Column("purpose", sa.String(128), nullable=False),
    sa.Column("category", sa.String(128), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("retain_until", sa.DateTime(timezone=True), nullable=True),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("lookup", sa.String(64), nullable=True),
    sa.Column("producer", sa.String(128), nullable=True),
    sa.Column("producer_version", sa.String(64), nullable=True),
    sa.Index("ks_assets_subject", "subject_ref", "scope", "kind"),
    sa.Index("ks_assets_retain", "retain_until"),
)

asset_sources = sa.Table(
    "ks_asset_sources",
    metadata,
    sa.Column("asset_id", sa.String(64), primary_key=True),
    sa.Column("source_id", sa.String(64), primary_key=True),
    sa.Index("ks_asset_sources_source", "source_id"),
)

asset_mentions = sa.Table(
    "ks_asset_mentions",
    metadata,
    sa.Column("asset_id", sa.String(64), primary_key=True),
    sa.Column("subject_ref", sa.String(64), primary_key=True),
    sa.Column("how", sa.String(16), nullable=False, server_default="declared"),
    sa.Index("ks_asset_mentions_subject", "subject_ref"),
)

identifiers = sa.Table(
    "ks_identifiers",
    metadata,
    sa.Column("hash", sa.String(64), primary_key=True),
    sa.Column("subject_ref", sa.String(64), primary_key=True),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("sealed", sa.LargeBinary, nullable=True),
    sa.Index("ks_identifiers_subject", "subject_ref"),
)

identifier_key_version = sa.Table(
    "ks_identifier_key",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("version", sa.Integer, nullable=False),
)

identifier_kinds = sa.Table(
    "ks_identifier_kinds",
    metadata,
    sa.Column("kind", sa.String(16), primary_key=True),
)

consents = sa.Table(
    "ks_consents",
    metadata,
    sa.Column("consent_id", sa.String(64), primary_key=True),
    sa.Column("subject_ref", sa.String(64), nullable=False),
    sa.Column("purpose", sa.String(128), nullable=False),
    sa.Column("category", sa.String(128), nullable=False),
    sa.Column("actions", sa.String(256), nullable=False),
    sa.Column("start_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("end_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("policy_version", sa.String(64), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
    sa.Index("ks_consents_subject", "subject_ref", "purpose", "category"),
)

subject_guard = sa.Table(
    "ks_subject_guard",
    metadata,
    sa.Column("subject_ref", sa.String(64), primary_key=True),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("deletion_epoch", sa.Integer, nullable=False),
    sa.Column("suppressed_scopes", sa.Text, nullable=False, server_default="[]"),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
)

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
    sa.Column("doc", sa.Text, nullable=False),
    sa.Column("receipt", sa.Text, nullable=True),
    sa.Index("ks_deletion_requests_subject", "subject_ref"),
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

tokens = sa.Table(
    "ks_tokens",
    metadata,
    sa.Column(
        "number",
        sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
        primary_key=True,
        autoincrement=False,
    ),
    sa.Column("token", sa.String(64), nullable=False),
    sa.Column("subject_ref", sa.String(64), nullable=False),
    sa.Column("scope", sa.String(128), nullable=False),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("purpose", sa.String(128), nullable=False),
    sa.Column("deterministic", sa.Boolean, nullable=False),
    sa.Column("lookup", sa.LargeBinary(32), nullable=True),
    sa.Column("created_at", sa.BigInteger, nullable=False),
    sa.Column("expires_at", sa.BigInteger, nullable=False),
    sa.Column("value", sa.LargeBinary, nullable=False),
    sa.Index("ks_tokens_subject", "subject_ref", "scope"),
)

sa.Index(
    "ks_tokens_lookup",
    tokens.c.lookup,
    sqlite_where=tokens.c.lookup.is_not(None),
    postgresql_where=tokens.c.lookup.is_not(None),
)

token_blocks = sa.Table(
    "ks_token_blocks",
    metadata,
    sa.Column("block", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("taken_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("group_commit_ms", sa.Float, nullable=False, server_default="0"),
    sqlite_autoincrement=True,
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

threads = sa.Table(
    "ks_threads",
    metadata,
    sa.Column("thread_ref", sa.String(64), primary_key=True),
    sa.Column("subject_ref", sa.String(64), nullable=False),
    sa.Column("scope", sa.String(128), nullable=False),
    sa.Column("thread", sa.LargeBinary, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Index("ks_threads_subject", "subject_ref"),
)

checkpoints = sa.Table(
    "ks_checkpoints",
    metadata,
    sa.Column("thread_ref", sa.String(64), primary_key=True),
    sa.Column("checkpoint_ns", sa.String(512), primary_key=True),
    sa.Column("checkpoint_id", sa.String(64), primary_key=True),
    sa.Column("parent_checkpoint_id", sa.String(64), nullable=True),
    sa.Column("subject_ref", sa.String(64), nullable=False),
    sa.Column("run_id", sa.String(128), nullable=True),
    sa.Column("data", sa.LargeBinary, nullable=False),
    sa.Index("ks_checkpoints_subject", "subject_ref"),
    sa.Index("ks_checkpoints_run", "run_id"),
)

checkpoint_writes = sa.Table(
    "ks_checkpoint_writes",
    metadata,
    sa.Column("thread_ref", sa.String(64), primary_key=True),
    sa.Column("checkpoint_ns", sa.String(512), primary_key=True),
    sa.Column("checkpoint_id", sa.String(64), primary_key=True),
    sa.Column("task_id", sa.String(128), primary_key=True),
    sa.Column("idx", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("subject_ref", sa.String(64), nullable=False),
    sa.Column("channel", sa.String(256), nullable=False),
    sa.Column("task_path", sa.String(512), nullable=False),
    sa.Column("data", sa.LargeBinary, nullable=False),
    sa.Index("ks_checkpoint_writes_subject", "subject_ref"),
)
