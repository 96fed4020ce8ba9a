"""A new database built two ways, same run: replaying every Alembic revision (what
every new catalog and key store did before) against building it from the models
and stamping it at the newest revision (``keyshred.db.migrate(models=...)``).

Each round makes a fresh SQLite file and a fresh PostgreSQL schema for each way and
times only the migration of an engine that is already connected: the catalog
(``migrate_catalog(engine, replay=...)``) and the key store (``db.migrate`` of its
revisions, with and without its tables as ``models``). The ways alternate, the order
reversed every other round. Printed: median ms per new database and the ratio
models ÷ replay (below 1: faster).

Run: ``.venv/bin/python benchmarks/bench_new_database.py [--rounds 12]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import PgSchema, uptime
from sqlalchemy.engine import Engine

from keyshred import db
from keyshred.keyring import schema as keystore_schema
from keyshred.migrations import migrate_catalog


def _catalog(replay: bool) -> Callable[[Engine], None]:
    return lambda engine: migrate_catalog(engine, replay=replay)


def _keystore(replay: bool) -> Callable[[Engine], None]:
    def run(engine: Engine) -> None:
        tables = keystore_schema.tables(keystore_schema.prefix_for(engine.dialect.name))
        db.migrate(
            engine,
            keystore_schema.MIGRATIONS,
            keystore_schema.VERSION_TABLE,
            head=keystore_schema.HEAD,
            models=None if replay else tables.metadata,
        )

    return run


def _once(dialect: str, migrate: Callable[[Engine], None], tmp: Path, n: int) -> float:
    with PgSchema() if dialect == "postgresql" else _Nothing() as schema:
        url = schema.url if schema is not None else f"sqlite:///{tmp / f'{n}.db'}"
        engine = db.create_engine(url, what="catalog")
        try:
            with engine.connect():
                pass  # connected: the pool holds a live connection
            start = time.perf_counter()
            migrate(engine)
            return time.perf_counter() - start
        finally:
            engine.dispose()


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    print(f"uptime before: {uptime()}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="ks-bench-newdb-") as folder:
        tmp, n = Path(folder), 0
        for dialect in ("sqlite", "postgresql"):
            for what, make in (("catalog", _catalog), ("key store", _keystore)):
                times: dict[bool, list[float]] = {True: [], False: []}
                for r in range(args.rounds + 1):
                    for replay in (True, False) if r % 2 else (False, True):
                        n += 1
                        took = _once(dialect, make(replay), tmp, n)
                        if r:  # the first round warms imports and the server
                            times[replay].append(took)
                replay_ms = statistics.median(times[True]) * 1e3
                models_ms = statistics.median(times[False]) * 1e3
                rows.append((dialect, what, replay_ms, models_ms))
    print(f"\n{args.rounds} rounds; median ms per new database")
    print(f"{'database':<12}{'component':<12}{'replay':>10}{'models':>10}{'ratio':>8}")
    for dialect, what, replay_ms, models_ms in rows:
        ratio = models_ms / replay_ms
        print(f"{dialect:<12}{what:<12}{replay_ms:>10.1f}{models_ms:>10.1f}{ratio:>8.2f}")
    print(f"uptime after: {uptime()}")


if __name__ == "__main__":
    main()
