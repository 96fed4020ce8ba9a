"""Storage fixtures. ``catalog_url`` (tests/conftest.py) runs every catalog test on
SQLite and on the real PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa

from keyshred import Config, Keyshred
from keyshred.config import ScopeSettings, StorageSettings
from keyshred.storage.partition import hot_place
from keyshred.storage.rowcodec import decode_record
from keyshred.storage.schema import memory_hot
from keyshred.storage.sealer import KeyringSealer


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


def parquet_config(catalog_url: str | None = None, **kwargs: object) -> Config:
    """``make_config`` whose compactions always write Parquet segments
    (``storage.inline_max_rows = 0``): for tests of segments, their objects and
    their bytes, which a small partition would otherwise keep in the catalog."""
    return make_config(catalog_url, inline_max_rows=0, **kwargs)  # type: ignore[arg-type]


def stored_rows(ks: Keyshred, ref: str) -> list[tuple[str, bytes]]:
    """(memory id, value as stored: a sealed row's ciphertext) of every row the
    subject's partition stores, in either layout: its segment objects' rows, then
    its hot records' puts (opened with the live keyring) in sequence order, so a
    later version of a memory comes after an earlier one."""
    pme = ks.memories._pme
    assert pme is not None
    out: list[tuple[str, bytes]] = []
    for path in sorted(ks.memories.partition_path(ref).glob("seg-*.parquet")):
        table = pq.ParquetFile(path, decryption_properties=pme.decryption()).read()
        ids, values = table.column("memory_id").to_pylist(), table.column("value").to_pylist()
        out += zip(ids, values, strict=True)
    sealer = KeyringSealer(ks.keyring)
    with ks.catalog.engine.connect() as conn:
        hot = conn.execute(
            sa.select(memory_hot).where(memory_hot.c.subject_ref == ref).order_by(memory_hot.c.seq)
        ).all()
    for r in hot:
        op, rows = decode_record(sealer.open(bytes(r.record), hot_place(ref, r.scope, int(r.seq))))
        if op == "put":
            out += [(row.memory_id, row.value) for row in rows]
    return out


@pytest.fixture
def ks(catalog_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Keyshred]:
    """A store on the test's catalog; ``SEGMENTS`` (indirect ``"segments"``): one
    whose compactions always write Parquet segments (``parquet_config``)."""
    config = parquet_config if getattr(request, "param", "") == "segments" else make_config
    store = Keyshred.init(tmp_path / "data", config(catalog_url))
    yield store
    store.close()


# A test of segment objects (a partition this small otherwise compacts into the
# catalog): ``@SEGMENTS`` runs it on a ``ks`` whose compactions write segments.
SEGMENTS = pytest.mark.parametrize("ks", ["segments"], indirect=True)
