"""On PostgreSQL a warm put is one transaction with one commit, and a warm get opens
none (issue #21: "one transaction and one commit per put").

Counted at the driver: every statement that psycopg sends on an idle connection
outside autocommit makes it send a ``BEGIN`` first, and every ``commit()`` is a
``COMMIT``. Reads (the subject guard, the partition head, the subject lock) used to
run each in a transaction of its own: five BEGIN/COMMIT pairs per put, four of them
around a single SELECT, two round trips each for nothing."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.pq import TransactionStatus

from keyshred import Config, Keyshred
from keyshred.config import KeyringSettings, StorageSettings

NS = ("notes",)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """BEGINs and COMMITs psycopg sends, counted where it decides to send them."""
    counts: Counter[str] = Counter()

    def starts_transaction(conn: Any) -> bool:
        return not conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE

    for method in ("execute", "executemany"):
        real = getattr(psycopg.Cursor, method)

        def wrapped(self: Any, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            if starts_transaction(self.connection):
                counts["BEGIN"] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(psycopg.Cursor, method, wrapped)
    real_commit = psycopg.Connection.commit

    def commit(self: Any) -> None:
        if self.info.transaction_status != TransactionStatus.IDLE:
            counts["COMMIT"] += 1
        real_commit(self)

    monkeypatch.setattr(psycopg.Connection, "commit", commit)
    return counts


@pytest.mark.parametrize("catalog_url", ["postgres"], indirect=True)
def test_a_warm_put_is_one_transaction_and_a_warm_get_none(
    catalog_url: str, tmp_path: Path, counted: Counter[str]
) -> None:
    # The shared fixture's PostgreSQL case: a schema of its own.
    config = Config(
        storage=StorageSettings(catalog_url=catalog_url),
        keyring=KeyringSettings(store_url=catalog_url),
    )
    with Keyshred.init(tmp_path / "data", config) as ks:
        for i in range(3):  # the subject, its keys and its partition exist: warm
            ks.memories.put("ana", NS, f"warm{i}", {"i": i})
            assert ks.memories.get("ana", NS, f"warm{i}") is not None
        counted.clear()
        n = 10
        for i in range(n):
            ks.memories.put("ana", NS, f"k{i}", {"i": i})
        assert counted == {"BEGIN": n, "COMMIT": n}
        counted.clear()
        for i in range(n):
            got = ks.memories.get("ana", NS, f"k{i}")
            assert got is not None and got.value == {"i": i}
        assert counted == {}
        # Pooled connections went back out of autocommit: SQLAlchemy's own
        # transactions (the catalog's asset listing) still commit and roll back.
        assert len(ks.catalog.assets(ks.subject_ref("ana"))) == n + 3
