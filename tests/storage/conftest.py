"""Storage fixtures: every catalog test runs on SQLite and on the real PostgreSQL.

PostgreSQL is the server this machine kind runs on 127.0.0.1:5432 (database
``test``, trust auth; ``make test`` checks it). Each test gets its own schema through
``search_path``, dropped afterwards.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from keyshred import Config, Keyshred
from keyshred.config import ScopeSettings, StorageSettings

PG_DSN = "host=127.0.0.1 port=5432 dbname=test user=postgres"
BACKENDS = ["sqlite", "postgres"]


@pytest.fixture(params=BACKENDS)
def catalog_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'catalog.db'}"
        return
    psycopg = pytest.importorskip("psycopg")
    schema = f"ks_{uuid.uuid4().hex[:12]}"
    try:
        conn = psycopg.connect(PG_DSN, autocommit=True)
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL on 127.0.0.1:5432 is not reachable: {exc}")
    conn.execute(f"CREATE SCHEMA {schema}")
    try:
        yield (
            f"postgresql+psycopg://postgres@127.0.0.1:5432/test?options=-csearch_path%3D{schema}"
        )
    finally:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")
        conn.close()


def make_config(
    catalog_url: str | None = None,
    *,
    flush_records: int = 1000,
    purpose_end: datetime | None = None,
    **storage: object,
) -> Config:
    return Config(
        storage=StorageSettings(catalog_url=catalog_url, flush_records=flush_records, **storage),  # type: ignore[arg-type]
        scopes={
            "support/health": ScopeSettings(
                purpose="support", categories=["health", "contact"], max_retention_days=90
            ),
            "marketing": ScopeSettings(
                purpose="marketing",
                categories=["preference"],
                basis="legitimate_interest",
                max_retention_days=365,
                legal_max_days=30,
                purpose_end=purpose_end,
            ),
        },
    )


@pytest.fixture
def ks(catalog_url: str, tmp_path: Path) -> Iterator[Keyshred]:
    store = Keyshred.init(tmp_path / "data", make_config(catalog_url))
    yield store
    store.close()
