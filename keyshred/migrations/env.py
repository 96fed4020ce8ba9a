"""Alembic's entry point for the catalog database's revisions. ``keyshred.db.migrate``
passes the connection (in its transaction, under its lock) and the version table
in ``config.attributes``; nothing is read from an ini file."""

from __future__ import annotations

from alembic import context

from keyshred.migrations import target_metadata


def run() -> None:
    config = context.config
    connection = config.attributes["connection"]
    context.configure(
        connection=connection,
        target_metadata=target_metadata(),
        version_table=config.attributes["version_table"],
        # SQLite alters most of a table by copying it: revisions use batch mode.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


run()
