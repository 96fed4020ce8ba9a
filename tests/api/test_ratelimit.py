"""Rate limits per credential: one bucket per credential shared by every process
on a PostgreSQL catalog (``SharedBuckets``), this process's own on SQLite."""

from __future__ import annotations

import hashlib
import hmac

import pytest
import sqlalchemy as sa

from keyshred.api.ratelimit import SharedBuckets, TokenBuckets, buckets_for
from keyshred.schema import api_rate
from keyshred.storage.catalog import Catalog

CREDENTIAL = "oidc:probe-person-ratelimit-5m2q@example.com"


def _keyed(plain: str, tenant: str) -> str:
    return hmac.new(b"k" * 32, f"{tenant}\0{plain}".encode(), hashlib.sha256).hexdigest()[:26]


@pytest.mark.postgres
@pytest.mark.parametrize("catalog_url", ["postgres"], indirect=True)
def test_two_processes_spend_one_bucket(catalog_url: str) -> None:
    # Two limiters over their own engines stand for two uvicorn worker processes.
    first, second = Catalog(catalog_url), Catalog(catalog_url)
    try:
        a = buckets_for(first, _keyed, per_second=0.001, burst=5)
        b = buckets_for(second, _keyed, per_second=0.001, burst=5)
        assert isinstance(a, SharedBuckets) and isinstance(b, SharedBuckets)
        waits = [(a if i % 2 else b).take(CREDENTIAL) for i in range(10)]
        # Per-process buckets would have let 10 through (5 each).
        assert waits[:5] == [0.0] * 5
        assert all(w > 0 for w in waits[5:])
        assert a.take("key:someone-else") == 0.0  # a bucket per credential
        with first.transaction() as conn:
            rows = conn.execute(sa.select(api_rate)).all()
            assert len(rows) == 2
            assert CREDENTIAL not in repr(rows)
            # Half an hour later (by the database's clock) tokens are back.
            conn.execute(api_rate.update().values(at=api_rate.c.at - 1800.0))
        assert b.take(CREDENTIAL) == 0.0
    finally:
        first.close()
        second.close()


@pytest.mark.postgres
def test_a_catalog_that_cannot_be_reached_falls_back_to_this_process() -> None:
    dead = Catalog("postgresql+psycopg://postgres@127.0.0.1:9/test?connect_timeout=2", create=False)
    try:
        buckets = SharedBuckets(dead, _keyed, per_second=0.001, burst=2)
        assert [buckets.take(CREDENTIAL) for _ in range(3)][:2] == [0.0, 0.0]
        assert buckets.take(CREDENTIAL) > 0
    finally:
        dead.close()


def test_sqlite_keeps_the_buckets_in_the_process(tmp_path: object) -> None:
    catalog = Catalog(f"sqlite:///{tmp_path}/catalog.db")
    try:
        assert isinstance(buckets_for(catalog, _keyed, 1.0, 2), TokenBuckets)
    finally:
        catalog.close()
