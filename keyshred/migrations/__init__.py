"""Schema changes of the catalog database: Alembic revisions of every table in it
(storage's, the vault's, the services'), with their own version table.

The script folder sits at the top layer because it assembles the tables of the
layers below (``target_metadata``); the storage layer never imports it. The facade
runs ``migrate_catalog`` before it opens the catalog (``Catalog(url,
migrate=migrate_catalog)``).

A catalog from before versioned migrations (keyshred main at fae494a and before:
``ks_assets`` but no ``ks_alembic_catalog``) is stamped at revision 0001, whose
schema it has, after ``_prepare_legacy`` brought the layouts of older development
builds to it (two columns added since, and tables a build did not have yet) or
refused the one layout that cannot be converted.
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from keyshred import db
from keyshred.errors import ConfigError
from keyshred.storage.schema import DECLARED, VERSION_TABLE, metadata

__all__ = [
    "BASELINE",
    "HEAD",
    "SCRIPT_LOCATION",
    "VERSION_TABLE",
    "migrate_catalog",
    "target_metadata",
]

SCRIPT_LOCATION = "keyshred:migrations"
BASELINE = "0001"  # the schema of the last release without versioned migrations
# The newest revision in versions/: an open that finds it in the version table needs
# neither the lock nor Alembic (``keyshred.db.migrate``; a test compares it with
# Alembic's head, so a new revision cannot be added without it).
HEAD = "0016"
_LEGACY_TABLE = "ks_assets"
# The modules that define the catalog database's tables: storage's, the vault's
# (its tokens) and the services' (erasure requests, holds, the audit chain).
_TABLE_MODULES = ("keyshred.storage.schema", "keyshred.vault.schema", "keyshred.schema")


def target_metadata() -> sa.MetaData:
    """Every table of the catalog database as the code defines it now: what the
    newest revision must have built (``env.py``; the tests compare the two)."""
    # Every module that defines tables on the catalog's metadata, imported for that.
    for module in _TABLE_MODULES:
        importlib.import_module(module)
    return metadata


def migrate_catalog(engine: Engine, *, replay: bool = False) -> None:
    """Bring the catalog database at ``engine`` to the newest revision (in one
    transaction, one process at a time). A new catalog is built from the models and
    stamped; ``replay`` builds it by running every revision instead (the tests
    compare the two)."""
    db.migrate(
        engine,
        SCRIPT_LOCATION,
        VERSION_TABLE,
        legacy_table=_LEGACY_TABLE,
        legacy_revision=BASELINE,
        prepare_legacy=_prepare_legacy,
        head=HEAD,
        models=None if replay else target_metadata(),
        what="catalog",
    )


def _prepare_legacy(conn: Connection) -> None:
    """An unversioned catalog, made to have revision 0001's schema before it is
    stamped so. Development builds before it differ in three ways that can be
    converted or told: ``ks_asset_mentions.how`` (every existing mention was
    declared) and ``ks_identifiers.sealed`` (NULL: such rows cannot be re-hashed,
    see ``Catalog.rehash_identifiers``) came later; so did some tables (created
    empty). A ``ks_tokens`` table from before token numbers and integer times cannot
    be converted (its tokens' ids do not encipher row numbers) and is refused. This
    runs inside the migration's transaction and lock, so a concurrent open waits
    for it instead of racing it."""
    from keyshred.migrations.baseline import metadata as baseline

    inspector = sa.inspect(conn)
    names = set(inspector.get_table_names())
    if "ks_tokens" in names:
        token_cols = {c["name"]: c["type"] for c in inspector.get_columns("ks_tokens")}
        if "number" not in token_cols or not isinstance(token_cols.get("created_at"), sa.Integer):
            raise ConfigError(
                "this catalog's ks_tokens table predates token numbers and integer "
                "times (keyshred 0.1 development builds); export what you need and "
                "start a new folder"
            )
    blob = "BYTEA" if conn.dialect.name == "postgresql" else "BLOB"
    added = {
        "ks_asset_mentions": ("how", f"VARCHAR(16) NOT NULL DEFAULT '{DECLARED}'"),
        "ks_identifiers": ("sealed", blob),
        # A catalog that ``Catalog`` alone created with today's token blocks (no
        # group-commit column, which revision 0002 drops) gets it back for the stamp.
        "ks_token_blocks": ("group_commit_ms", "FLOAT NOT NULL DEFAULT 0"),
    }
    for table, (column, ddl) in added.items():
        if table in names and column not in {c["name"] for c in inspector.get_columns(table)}:
            conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN {column} {ddl}")
    baseline.create_all(conn, checkfirst=True)
