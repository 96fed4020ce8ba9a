"""Attack: the audit hash chain under concurrent writers in two processes on
PostgreSQL (each process has its own AuditLog and its own threading.Lock; the
database serialises nothing: READ COMMITTED reads of the last hash race)."""

from __future__ import annotations

import threading

import pytest

from keyshred.audit import AuditLog
from keyshred.migrations import migrate_catalog
from keyshred.storage.catalog import Catalog


@pytest.mark.parametrize("catalog_url", ["postgresql"], indirect=True)
def test_audit_chain_survives_two_processes_recording(catalog_url: str) -> None:
    # Two catalogs on one database = two worker processes (separate pools and
    # separate AuditLog._lock objects).
    first = Catalog(catalog_url, migrate=migrate_catalog)
    second = Catalog(catalog_url, migrate=migrate_catalog)
    logs = [AuditLog(first), AuditLog(second)]
    start = threading.Barrier(2)

    def worker(log: AuditLog, n: int) -> None:
        start.wait()
        for i in range(40):
            if i % 2:
                log.record("memory.put", subject_ref=f"s{n}", asset_id=f"a{i}")
            else:
                log.record_many("memory.deleted", [{"asset_id": f"b{i}-{j}"} for j in range(5)])

    threads = [threading.Thread(target=worker, args=(log, n)) for n, log in enumerate(logs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert logs[0].verify() == 2 * (20 + 20 * 5)
    finally:
        first.close()
        second.close()
