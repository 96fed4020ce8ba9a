-- The catalog's schema as keyshred main@fae494a creates it on PostgreSQL (metadata.create_all).
CREATE TABLE ks_assets (
	asset_id VARCHAR(64) NOT NULL, 
	subject_ref VARCHAR(64) NOT NULL, 
	scope VARCHAR(128) NOT NULL, 
	kind VARCHAR(32) NOT NULL, 
	storage_system VARCHAR(32) NOT NULL, 
	storage_key VARCHAR(512) NOT NULL, 
	purpose VARCHAR(128) NOT NULL, 
	category VARCHAR(128) NOT NULL, 
	created_at TIMESTAMP WITH TIME ZONE NOT NULL, 
	retain_until TIMESTAMP WITH TIME ZONE, 
	status VARCHAR(16) NOT NULL, 
	lookup VARCHAR(64), 
	producer VARCHAR(128), 
	producer_version VARCHAR(64), 
	PRIMARY KEY (asset_id)
);

CREATE INDEX ks_assets_retain ON ks_assets (retain_until);

CREATE INDEX ks_assets_subject ON ks_assets (subject_ref, scope, kind);

CREATE TABLE ks_asset_sources (
	asset_id VARCHAR(64) NOT NULL, 
	source_id VARCHAR(64) NOT NULL, 
	PRIMARY KEY (asset_id, source_id)
);

CREATE INDEX ks_asset_sources_source ON ks_asset_sources (source_id);

CREATE TABLE ks_asset_mentions (
	asset_id VARCHAR(64) NOT NULL, 
	subject_ref VARCHAR(64) NOT NULL, 
	how VARCHAR(16) DEFAULT 'declared' NOT NULL, 
	PRIMARY KEY (asset_id, subject_ref)
);

CREATE INDEX ks_asset_mentions_subject ON ks_asset_mentions (subject_ref);

CREATE TABLE ks_identifiers (
	hash VARCHAR(64) NOT NULL, 
	subject_ref VARCHAR(64) NOT NULL, 
	kind VARCHAR(16) NOT NULL, 
	created_at TIMESTAMP WITH TIME ZONE NOT NULL, 
	sealed BYTEA, 
	PRIMARY KEY (hash, subject_ref)
);

CREATE INDEX ks_identifiers_subject ON ks_identifiers (subject_ref);

CREATE TABLE ks_identifier_key (
	id INTEGER NOT NULL, 
	version INTEGER NOT NULL, 
	PRIMARY KEY (id)
);

CREATE TABLE ks_identifier_kinds (
	kind VARCHAR(16) NOT NULL, 
	PRIMARY KEY (kind)
);

CREATE TABLE ks_consents (
	consent_id VARCHAR(64) NOT NULL, 
	subject_ref VARCHAR(64) NOT NULL, 
	purpose VARCHAR(128) NOT NULL, 
	category VARCHAR(128) NOT NULL, 
	actions VARCHAR(256) NOT NULL, 
	start_at TIMESTAMP WITH TIME ZONE NOT NULL, 
	end_at TIMESTAMP WITH TIME ZONE, 
	policy_version VARCHAR(64) NOT NULL, 
	status VARCHAR(16) NOT NULL, 
	created_at TIMESTAMP WITH TIME ZONE NOT NULL, 
	revoked_at TIMESTAMP WITH TIME ZONE, 
	PRIMARY KEY (consent_id)
);

CREATE INDEX ks_consents_subject ON ks_consents (subject_ref, purpose, category);

CREATE TABLE ks_subject_guard (
	subject_ref VARCHAR(64) NOT NULL, 
	status VARCHAR(16) NOT NULL, 
	deletion_epoch INTEGER NOT NULL, 
	suppressed_scopes TEXT DEFAULT '[]' NOT NULL, 
	updated_at TIMESTAMP WITH TIME ZONE NOT NULL, 
	PRIMARY KEY (subject_ref)
);

CREATE TABLE ks_deletion_requests (
	request_id VARCHAR(64) NOT NULL, 
	subject_ref VARCHAR(64) NOT NULL, 
	scope VARCHAR(128), 
	state VARCHAR(32) NOT NULL, 
	requested_by VARCHAR(128) NOT NULL, 
	reason VARCHAR(256) NOT NULL, 
	created_at TIMESTAMP WITH TIME ZONE NOT NULL, 
	updated_at TIMESTAMP WITH TIME ZONE NOT NULL, 
	attempts INTEGER NOT NULL, 
	doc TEXT NOT NULL, 
	receipt TEXT, 
	PRIMARY KEY (request_id)
);

CREATE INDEX ks_deletion_requests_subject ON ks_deletion_requests (subject_ref);

CREATE TABLE ks_audit (
	seq SERIAL NOT NULL, 
	at TIMESTAMP WITH TIME ZONE NOT NULL, 
	event VARCHAR(64) NOT NULL, 
	subject_ref VARCHAR(64), 
	request_id VARCHAR(64), 
	data TEXT NOT NULL, 
	prev_hash VARCHAR(64) NOT NULL, 
	hash VARCHAR(64) NOT NULL, 
	PRIMARY KEY (seq)
);

CREATE TABLE ks_audit_anchor (
	id SERIAL NOT NULL, 
	pruned_through INTEGER NOT NULL, 
	last_hash VARCHAR(64) NOT NULL, 
	pruned_at TIMESTAMP WITH TIME ZONE NOT NULL, 
	PRIMARY KEY (id)
);

CREATE TABLE ks_tokens (
	number BIGINT NOT NULL, 
	token VARCHAR(64) NOT NULL, 
	subject_ref VARCHAR(64) NOT NULL, 
	scope VARCHAR(128) NOT NULL, 
	kind VARCHAR(32) NOT NULL, 
	purpose VARCHAR(128) NOT NULL, 
	deterministic BOOLEAN NOT NULL, 
	lookup BYTEA, 
	created_at BIGINT NOT NULL, 
	expires_at BIGINT NOT NULL, 
	value BYTEA NOT NULL, 
	PRIMARY KEY (number)
);

CREATE INDEX ks_tokens_lookup ON ks_tokens (lookup) WHERE lookup IS NOT NULL;

CREATE INDEX ks_tokens_subject ON ks_tokens (subject_ref, scope);

CREATE TABLE ks_token_blocks (
	block SERIAL NOT NULL, 
	taken_at TIMESTAMP WITH TIME ZONE NOT NULL, 
	group_commit_ms FLOAT DEFAULT '0' NOT NULL, 
	PRIMARY KEY (block)
);

CREATE TABLE ks_legal_holds (
	hold_id VARCHAR(64) NOT NULL, 
	subject_ref VARCHAR(64) NOT NULL, 
	scope VARCHAR(128), 
	reason VARCHAR(256) NOT NULL, 
	owner VARCHAR(128) NOT NULL, 
	placed_at TIMESTAMP WITH TIME ZONE NOT NULL, 
	released_at TIMESTAMP WITH TIME ZONE, 
	PRIMARY KEY (hold_id)
);

CREATE INDEX ks_legal_holds_subject ON ks_legal_holds (subject_ref);

CREATE TABLE ks_threads (
	thread_ref VARCHAR(64) NOT NULL, 
	subject_ref VARCHAR(64) NOT NULL, 
	scope VARCHAR(128) NOT NULL, 
	thread BYTEA NOT NULL, 
	created_at TIMESTAMP WITH TIME ZONE NOT NULL, 
	PRIMARY KEY (thread_ref)
);

CREATE INDEX ks_threads_subject ON ks_threads (subject_ref);

CREATE TABLE ks_checkpoints (
	thread_ref VARCHAR(64) NOT NULL, 
	checkpoint_ns VARCHAR(512) NOT NULL, 
	checkpoint_id VARCHAR(64) NOT NULL, 
	parent_checkpoint_id VARCHAR(64), 
	subject_ref VARCHAR(64) NOT NULL, 
	run_id VARCHAR(128), 
	data BYTEA NOT NULL, 
	PRIMARY KEY (thread_ref, checkpoint_ns, checkpoint_id)
);

CREATE INDEX ks_checkpoints_subject ON ks_checkpoints (subject_ref);

CREATE INDEX ks_checkpoints_run ON ks_checkpoints (run_id);

CREATE TABLE ks_checkpoint_writes (
	thread_ref VARCHAR(64) NOT NULL, 
	checkpoint_ns VARCHAR(512) NOT NULL, 
	checkpoint_id VARCHAR(64) NOT NULL, 
	task_id VARCHAR(128) NOT NULL, 
	idx INTEGER NOT NULL, 
	subject_ref VARCHAR(64) NOT NULL, 
	channel VARCHAR(256) NOT NULL, 
	task_path VARCHAR(512) NOT NULL, 
	data BYTEA NOT NULL, 
	PRIMARY KEY (thread_ref, checkpoint_ns, checkpoint_id, task_id, idx)
);

CREATE INDEX ks_checkpoint_writes_subject ON ks_checkpoint_writes (subject_ref);

