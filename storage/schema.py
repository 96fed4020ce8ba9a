"""The storage layer's tables in the catalog database (SQLAlchemy Core).

The asset index with its provenance and mention edges, registered identifiers,
consent records, the subject guard, and LangGraph threads and checkpoints. Only
pseudonymous values are stored: subject_refs, asset ids, scopes, purposes,
categories, keyed lookup hashes, timestamps, and ciphertext. Never a subject id, a
namespace, a key or a value in clear.

``metadata`` holds every table of the catalog database: the vault and the services
(``keyshred.schema``) define theirs on it too, so a snapshot copies them all and the
migrations (``keyshred.migrations``) compare one collection with the database.
Schema changes are Alembic revisions there, never edits here alone.
"""

from __future__ import annotations

import sqlalchemy as sa

__all__ = [
    "DECLARED",
    "DETECTED",
    "VERSION_TABLE",
    "asset_mentions",
    "asset_sources",
    "assets",
    "checkpoint_writes",
    "checkpoints",
    "consents",
    "identifier_key_version",
    "identifier_kinds",
    "identifiers",
    "memory_hot",
    "memory_namespaces",
    "memory_ns_pending",
    "memory_ns_prefixes",
    "memory_partitions",
    "memory_segments",
    "memory_vectors",
    "metadata",
    "subject_guard",
    "threads",
]

DECLARED = "declared"  # a mention the writer declared
DETECTED = "detected"  # a mention found in the value by a registered identifier

# The Alembic version table of the catalog database's revisions (keyshred.migrations).
VERSION_TABLE = "ks_alembic_catalog"

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
    # The few assets a deletion marked and has not finished (a crash stopped it):
    # a get that reads the catalog alone asks for them by subject (revision 0016).
    sa.Index(
        "ks_assets_deleting",
        "subject_ref",
        sqlite_where=sa.text("status = 'deleting'"),
        postgresql_where=sa.text("status = 'deleting'"),
    ),
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
    # "declared" by the writer, or "detected" in the value by a registered identifier
    # (keyshred.storage.mentions).
    sa.Column("how", sa.String(16), nullable=False, server_default=DECLARED),
    sa.Index("ks_asset_mentions_subject", "subject_ref"),
)

# Identifiers a subject registered (keyshred.storage.mentions): their keyed lookup
# hashes, and the normal form sealed under the subject's own key (``sealed``: so a
# new identifier key version can re-hash it; an erased subject's sealed values die
# with its keys), never the identifier in clear. The primary key leads with the
# hash, so it is the index the write path's lookup (``hash IN …``) probes; one hash
# may stand for several subjects (two people of one name), and each is a mention.
# Catalogs from before ``sealed`` gain it when migrated; their rows keep NULL (they cannot
# be re-hashed, see ``rehash_identifiers``).
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

# The identifier key version the hashes of ks_identifiers are under (one row, id 1;
# absent means version 1). Registration and re-hashing lock it, so a registration
# hashed under a version a concurrent re-hash replaced is refused and redone.
identifier_key_version = sa.Table(
    "ks_identifier_key",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("version", sa.Integer, nullable=False),
)

# The kinds of identifier ever registered (names as "name:<words>"), one row each,
# never deleted: the write path skips detection while there is none, and generates
# name n-grams only of the lengths registered.
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


# -- memory partitions (keyshred.storage.partition): the catalog is their truth -------
# A subject's partition is its row in ``ks_mem_partitions`` (the generation, bumped by
# every compaction, and the sequence range of its hot rows), the immutable segments
# named in ``ks_mem_segments`` and the sealed hot rows in ``ks_mem_hot``. A put adds
# hot rows in the transaction that registers its assets; a compaction publishes new
# segments, retires old ones and deletes the rows it folded, in one transaction.

memory_partitions = sa.Table(
    "ks_mem_partitions",
    metadata,
    sa.Column("subject_ref", sa.String(64), primary_key=True),
    sa.Column("gen", sa.BigInteger, nullable=False),  # bumped by every compaction
    sa.Column("base_seq", sa.BigInteger, nullable=False),  # the first hot row's sequence
    sa.Column("next_seq", sa.BigInteger, nullable=False),  # the next hot row's sequence
)

memory_hot = sa.Table(
    "ks_mem_hot",
    metadata,
    sa.Column("subject_ref", sa.String(64), primary_key=True),
    sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("scope", sa.String(128), nullable=False),
    # Sealed under the scope key, bound to (subject_ref, scope, "memhot", seq).
    sa.Column("record", sa.LargeBinary, nullable=False),
)

memory_segments = sa.Table(
    "ks_mem_segments",
    metadata,
    sa.Column("subject_ref", sa.String(64), primary_key=True),
    sa.Column("name", sa.String(128), primary_key=True),  # object name in the partition
    sa.Column("scope", sa.String(128), nullable=False),
    sa.Column("rows", sa.Integer, nullable=False),
    sa.Column("key_id", sa.String(64), nullable=False),
    # None: part of the partition; else when a compaction replaced it (its object
    # is deleted once no reader can still need it).
    sa.Column("retired_at", sa.BigInteger, nullable=True),
    # The object's size and SHA-256 (a backup copies it by them, never downloading
    # it to hash) and its rows' earliest retain-until in microseconds (the retention
    # scanner opens only segments with something expired). NULL: written before
    # revision 0005.
    sa.Column("size", sa.BigInteger, nullable=True),
    sa.Column("sha256", sa.String(64), nullable=True),
    sa.Column("retain_min", sa.BigInteger, nullable=True),
)

# -- vectors (keyshred.storage.vectors) --------------------------------------------------
# Every subject's vectors in one table, a row per vector: the plaintext columns are
# those the per-subject LanceDB datasets held in plaintext before revision 0013, the
# vector itself an envelope sealed under the memory's key and bound to (subject_ref,
# scope, "vectors", vec_id, "embedding"). Erasing a subject is one DELETE by
# subject_ref after its keys are destroyed; a subject costs no file.
memory_vectors = sa.Table(
    "ks_mem_vectors",
    metadata,
    sa.Column("subject_ref", sa.String(64), primary_key=True),
    # "<memory id>/<field number>[@<space tag>]": a memory's vectors are one key range.
    sa.Column("vec_id", sa.String(128), primary_key=True),
    sa.Column("memory_id", sa.String(64), nullable=False),
    sa.Column("scope", sa.String(128), nullable=False),
    sa.Column("field", sa.Text, nullable=False),  # the JSON path that was embedded
    sa.Column("updated_us", sa.BigInteger, nullable=False),
    sa.Column("vec", sa.LargeBinary, nullable=False),
)

# -- the namespace index (keyshred.storage.namespaces) ---------------------------------
# Which subjects hold memories under a namespace prefix, as keyed lookups: a cross-
# subject search or namespace listing reads these instead of opening every partition.
# A namespace is personal data (a user id is often one of its labels): it is here only
# as ``HMAC(namespace-lookup-key, labels)`` and sealed under the key its memories are
# sealed under (the subject's scope key, or the owner-set key of memories about other
# subjects), so the subject's erasure kills the labels with its keys, and drops the
# rows with its partition.

# One row per (subject, namespace, key sealing its memories): the labels sealed, and
# when the first memory under that key was created (the order of cross-subject search).
memory_namespaces = sa.Table(
    "ks_mem_namespaces",
    metadata,
    sa.Column("subject_ref", sa.String(64), primary_key=True),
    sa.Column("ns_hash", sa.String(64), primary_key=True),
    sa.Column("key_id", sa.String(64), primary_key=True),
    sa.Column("scope", sa.String(128), nullable=False),
    sa.Column("first_us", sa.BigInteger, nullable=False),
    sa.Column("labels", sa.LargeBinary, nullable=False),
    # A search across subjects pages through the rows in this order (revision 0015).
    sa.Index("ks_mem_namespaces_first", "first_us", "subject_ref", "ns_hash", "key_id"),
)

# Every prefix of every indexed namespace (its hash), so "which subjects hold
# namespaces under P" is one index range: the primary key leads with the hash.
memory_ns_prefixes = sa.Table(
    "ks_mem_ns_prefixes",
    metadata,
    sa.Column("prefix_hash", sa.String(64), primary_key=True),
    sa.Column("subject_ref", sa.String(64), primary_key=True),
    sa.Column("ns_hash", sa.String(64), primary_key=True),
    sa.Index("ks_mem_ns_prefixes_subject", "subject_ref", "ns_hash"),
)

# Subjects whose partition was written before the index existed (revision 0011 lists
# them): indexed from their partition before the next cross-subject read.
memory_ns_pending = sa.Table(
    "ks_mem_ns_pending",
    metadata,
    sa.Column("subject_ref", sa.String(64), primary_key=True),
)

# -- LangGraph threads and checkpoints (keyshred.storage.checkpoints) ----------------
# Thread ids are stored as keyed pseudonyms (and, sealed, for listing); checkpoints
# and writes as envelope ciphertext under the thread's own key, so deleting a thread
# is crypto-erasure too. Namespaces, checkpoint ids, run ids, task ids and channel
# names are graph structure, not personal data, and stay plaintext for the queries.

threads = sa.Table(
    "ks_threads",
    metadata,
    sa.Column("thread_ref", sa.String(64), primary_key=True),
    sa.Column("subject_ref", sa.String(64), nullable=False),
    sa.Column("scope", sa.String(128), nullable=False),  # the policy scope
    sa.Column("thread", sa.LargeBinary, nullable=False),  # sealed thread id
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
    sa.Column("data", sa.LargeBinary, nullable=False),  # sealed checkpoint + metadata
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
    sa.Column("data", sa.LargeBinary, nullable=False),  # sealed value
    sa.Index("ks_checkpoint_writes_subject", "subject_ref"),
)
