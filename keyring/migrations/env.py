"""Alembic environment of the key store: runs on the connection ``keyshred.db.migrate``
hands over (``config.attributes``), inside its transaction and lock; the version
table is ``ks_alembic_keys``. Offline (SQL script) mode is not supported."""

from __future__ import annotations

from alembic import context

from keyshred.keyring.schema import prefix_for, tables

config = context.config
connection = config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=tables(prefix_for(connection.dialect.name)).metadata,
    version_table=config.attributes["version_table"],
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
