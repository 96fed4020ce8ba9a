"""A database's schema as the database itself reports it, for tests that build one
database two ways (replaying every revision, or from the models and stamped) and
require the same result."""

from __future__ import annotations

import sqlalchemy as sa

__all__ = ["schema_report"]


def schema_report(engine: sa.Engine) -> dict[str, object]:
    """A database's schema (on PostgreSQL: the current schema's) as the database
    reports it, in more detail than autogenerate compares: every column's declared
    type, nullability and default, every index (partial ones with their predicate),
    every constraint, and what autogenerate does not see (SQLite's AUTOINCREMENT,
    PostgreSQL's sequences). Column order is left out: no statement of keyshred's
    depends on it (none selects ``*`` or inserts without naming its columns)."""
    report: dict[str, object] = {}
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            q = conn.exec_driver_sql
            objects = q("SELECT type, name, tbl_name, sql FROM sqlite_master").all()
            for kind, name, table, sql in objects:
                if kind == "table":
                    cols = q(f"PRAGMA table_xinfo('{name}')").all()
                    report[f"table {name}"] = {
                        "columns": sorted(tuple(c)[1:] for c in cols),
                        "foreign keys": sorted(
                            tuple(f)[2:] for f in q(f"PRAGMA foreign_key_list('{name}')")
                        ),
                        "autoincrement": "AUTOINCREMENT" in sql.upper(),
                        "without rowid": "WITHOUT ROWID" in sql.upper(),
                        "checks": sorted(
                            " ".join(c["sqltext"].split())
                            for c in sa.inspect(conn).get_check_constraints(name)
                        ),
                    }
                    for _, index, unique, origin, partial in q(f"PRAGMA index_list('{name}')"):
                        columns = [r[2] for r in q(f"PRAGMA index_info('{index}')")]
                        # Automatic indexes (a primary key's, a UNIQUE's) are named by
                        # their order in the table's DDL: told apart by their columns.
                        label = f"{origin} index on {table} {columns}" if origin != "c" else index
                        report[f"index {label}"] = (name, columns, unique, origin, partial)
                elif kind == "index" and sql is not None:
                    report[f"index sql {name}"] = " ".join(sql.split())
        else:
            q = conn.exec_driver_sql
            for table, column, dtype, length, precision, nullable, default in q(
                "SELECT table_name, column_name, data_type, character_maximum_length, "
                "numeric_precision, is_nullable, column_default FROM information_schema.columns "
                "WHERE table_schema = current_schema()"
            ):
                report[f"column {table}.{column}"] = (dtype, length, precision, nullable, default)
            for table, index, definition in q(
                "SELECT tablename, indexname, indexdef FROM pg_indexes "
                "WHERE schemaname = current_schema()"
            ):
                report[f"index {index}"] = (table, definition.replace(_prefix(conn), "S"))
            for table, name, definition in q(
                "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) "
                "FROM pg_constraint WHERE connamespace = current_schema()::regnamespace"
            ):
                report[f"constraint {name}"] = (table, definition)
            for (name,) in q(
                "SELECT sequence_name FROM information_schema.sequences "
                "WHERE sequence_schema = current_schema()"
            ):
                report[f"sequence {name}"] = True
    return report


def _prefix(conn: sa.Connection) -> str:
    return str(conn.exec_driver_sql("SELECT current_schema()").scalar_one()) + "."
