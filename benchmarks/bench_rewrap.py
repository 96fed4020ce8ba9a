"""Live KEK rotation benchmark: re-wrap N DEKs under a new live epoch key.

For each KEK provider (local key file; OpenBao Transit on a dev server and AWS KMS on
moto's server, both started here on loopback) and each key store (SQLite file;
PostgreSQL at 127.0.0.1:5432 db ``test``, a fresh schema), the store is filled with N
DEKs wrapped under the current live epoch key exactly as the keyring wraps them
(bulk-inserted: filling is not what is measured), then ``Keyring.rotate_kek()`` is
timed: one provider ``rotate`` and one ``wrap`` of the new epoch key, then every DEK
re-wrapped locally (AES-256-GCM) page by page, each page one transaction. Provider
calls inside the rotation are counted by a wrapper around the provider; the old epoch
is then destroyed (``destroy_kek_epochs_before``) and timed too. For contrast, the
table shows the provider requests the single-lineage design needed for the same
rotation (an unwrap and a wrap per DEK; Transit batches 200 per request, KMS has no
batch API), computed from N, not measured.

Run: ``.venv/bin/python benchmarks/bench_rewrap.py [--sizes 100000,1000000]
[--providers local,vault,aws] [--stores sqlite,postgres]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import PgSchema

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

from keyshred.keyring import _primitives as prim
from keyshred.keyring import schema as ks_schema
from keyshred.keyring.kek import Context, DestroyedEpoch, EpochInfo, KekProvider, WrappedKey
from keyshred.keyring.kek.local import LocalKek
from keyshred.keyring.keyring import Keyring, _dek_context
from keyshred.keyring.keystore import KeyStore, SQLiteKeyStore, SqlKeyStore
from tests.servers import Server, moto_server, openbao_dev_server

CHUNK = 50_000


class CountingKek(KekProvider):
    """Forwards to a real provider and counts every call that reaches it."""

    def __init__(self, inner: KekProvider) -> None:
        self.inner = inner
        self.name = inner.name
        self.calls = 0

    def current_epoch(self) -> int:
        return self.inner.current_epoch()

    def epochs(self) -> list[EpochInfo]:
        self.calls += 1
        return self.inner.epochs()

    def wrap(self, key: bytes, context: Context) -> WrappedKey:
        self.calls += 1
        return self.inner.wrap(key, context)

    def unwrap(self, wrapped: WrappedKey, context: Context) -> bytes:
        self.calls += 1
        return self.inner.unwrap(wrapped, context)

    def wrap_many(self, items: Sequence[tuple[bytes, Context]]) -> list[WrappedKey]:
        self.calls += len(items)
        return self.inner.wrap_many(items)

    def unwrap_many(self, items: Sequence[tuple[WrappedKey, Context]]) -> list[bytes]:
        self.calls += len(items)
        return self.inner.unwrap_many(items)

    def rotate(self) -> int:
        self.calls += 1
        return self.inner.rotate()

    def destroy_epochs_before(self, epoch: int) -> list[DestroyedEpoch]:
        self.calls += 1
        return self.inner.destroy_epochs_before(epoch)

    def close(self) -> None:
        self.inner.close()


def provider_factory(name: str, servers: dict[str, Server], tmp: Path) -> Callable[[], KekProvider]:
    unique = uuid.uuid4().hex[:10]
    if name == "local":
        return lambda: LocalKek(tmp / f"kek-{unique}.json", create=True)
    if name == "vault":
        from keyshred.keyring.kek.vault import VaultKek

        s = servers["vault"]
        return lambda: VaultKek(s.url, s.token, key_name=f"bench-{unique}")
    from keyshred.keyring.kek.aws import AwsKmsKek

    s = servers["aws"]
    return lambda: AwsKmsKek(
        alias_prefix=f"alias/bench-{unique}", region="us-east-1", endpoint_url=s.url
    )


@contextmanager
def key_store(kind: str, tmp: Path) -> Iterator[KeyStore]:
    if kind == "sqlite":
        store = SQLiteKeyStore(tmp / f"ks-{uuid.uuid4().hex[:8]}.db")
        try:
            yield store
        finally:
            store.close()
        return
    from keyshred.keyring.pgstore import PostgresKeyStore

    with PgSchema(prefix="bench") as schema:
        pg = PostgresKeyStore(schema.uri)
        try:
            yield pg
        finally:
            pg.close()


def fill(ring: Keyring, store: KeyStore, kind: str, n: int) -> None:
    """N DEKs wrapped under the current live epoch key, as ``Keyring`` makes them."""
    epoch = ring.live.current().epoch
    marker = ring.live.marker
    now = datetime.now(UTC)
    for start in range(0, n, CHUNK):
        rows = []
        for i in range(start, min(n, start + CHUNK)):
            key_id, ref = prim.random_bytes(16), f"s{i:09d}"
            context = _dek_context(key_id, ring.tenant, ref, "default")
            wrapped = ring.live.wrap(prim.random_key(), context, epoch)
            rows.append((key_id, ring.tenant, ref, "default", marker, epoch, wrapped, now, ""))
        # Rows straight into the table through the store's own engine (a raw DBAPI
        # connection: executemany on SQLite, COPY on PostgreSQL), as fast as a
        # bulk load gets; the keyring's put path would dominate the fill.
        assert isinstance(store, SqlKeyStore)
        raw = store.engine.raw_connection()
        try:
            if kind == "sqlite":
                raw.cursor().executemany(
                    "INSERT INTO dek (key_id, tenant, subject_ref, scope, kek_provider, "
                    "kek_epoch, wrapped, created_at, owner_tag) VALUES (?,?,?,?,?,?,?,?,?)",
                    [(*r[:7], ks_schema.timestamp(r[7]), r[8]) for r in rows],
                )
            else:
                columns = (
                    "key_id, tenant, subject_ref, scope, kek_provider, kek_epoch, wrapped, "
                    "created_at, owner_tag"
                )
                with (
                    raw.driver_connection.cursor() as cur,  # type: ignore[union-attr]
                    cur.copy(f"COPY ks_dek ({columns}) FROM STDIN") as copy,
                ):
                    for r in rows:
                        copy.write_row(r)
            raw.commit()
        finally:
            raw.close()
    if kind == "postgres":
        assert isinstance(store, SqlKeyStore)
        with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM ANALYZE ks_dek")


def single_lineage_requests(provider: str, n: int) -> int:
    """Provider requests the old design needed to re-wrap N DEKs (unwrap + wrap each)."""
    if provider == "vault":
        return 2 * -(-n // 200)
    return 2 * n  # local: in-process per DEK; KMS: one request per DEK each way


def run(provider: str, kind: str, n: int, servers: dict[str, Server], tmp: Path) -> dict[str, str]:
    counting = CountingKek(provider_factory(provider, servers, tmp)())
    with key_store(kind, tmp) as store:
        ring = Keyring(store, counting)
        t0 = time.perf_counter()
        fill(ring, store, kind, n)
        filled = time.perf_counter() - t0
        counting.calls = 0
        ring.live.forget()  # a process that has not unwrapped the old epoch key yet
        t0 = time.perf_counter()
        result = ring.rotate_kek()
        rotate_s = time.perf_counter() - t0
        rotate_calls = counting.calls
        counting.calls = 0
        t0 = time.perf_counter()
        ring.destroy_kek_epochs_before(result.new_epoch)
        destroy_s = time.perf_counter() - t0
        destroy_calls = counting.calls
        assert result.keys_rewrapped == n, (result.keys_rewrapped, n)
        ring.cache.clear()
        counting.close()
    return {
        "provider": provider,
        "store": kind,
        "DEKs": f"{n:,}",
        "fill s": f"{filled:.1f}",
        "rotate s": f"{rotate_s:.1f}",
        "DEKs/s": f"{n / rotate_s:,.0f}",
        "provider calls": str(rotate_calls),
        "destroy s": f"{destroy_s:.2f}",
        "destroy calls": str(destroy_calls),
        "old design requests": f"{single_lineage_requests(provider, n):,}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100000,1000000")
    parser.add_argument("--providers", default="local,vault,aws")
    parser.add_argument("--stores", default="sqlite,postgres")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    providers = args.providers.split(",")
    stores = args.stores.split(",")
    rows = []
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmpdir:
        servers: dict[str, Server] = {}
        if "vault" in providers:
            servers["vault"] = stack.enter_context(openbao_dev_server())
        if "aws" in providers:
            servers["aws"] = stack.enter_context(moto_server())
        for n in sizes:
            for kind in stores:
                for provider in providers:
                    row = run(provider, kind, n, servers, Path(tmpdir))
                    rows.append(row)
                    print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in columns}
    print()
    print(" | ".join(c.ljust(widths[c]) for c in columns))
    print("-|-".join("-" * widths[c] for c in columns))
    for r in rows:
        print(" | ".join(r[c].rjust(widths[c]) for c in columns))


if __name__ == "__main__":
    main()
