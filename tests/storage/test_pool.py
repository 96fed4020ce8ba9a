"""Pooled connections survive a dropped network: a TCP forwarder (tests/tcp_proxy.py)
between this process and PostgreSQL is cut and restored. While it is cut, every
call raises ``BackendUnavailable`` (a ``KeyshredError``), never the driver's own
error; once it is restored, the next calls succeed without reopening anything (the
pools ping a connection at checkout and replace a dead one)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from keyshred import Config, Keyshred
from keyshred.config import KeyringSettings, StorageSettings
from keyshred.errors import BackendUnavailable, KeyshredError
from keyshred.keyring.pgstore import PostgresKeyStore
from tests.conftest import pg_schema
from tests.storage.conftest import make_config
from tests.tcp_proxy import TcpProxy


@pytest.fixture
def proxied_url() -> Iterator[tuple[TcpProxy, str]]:
    with pg_schema() as schema, TcpProxy("127.0.0.1", 5432) as proxy:
        yield (
            proxy,
            (
                f"postgresql+psycopg://postgres@127.0.0.1:{proxy.port}/test"
                f"?options=-csearch_path%3D{schema}&connect_timeout=5"
            ),
        )


def _all_refused(calls: list[Callable[[], Any]]) -> None:
    for call in calls:
        with pytest.raises(KeyshredError) as caught:
            call()
        assert isinstance(caught.value, BackendUnavailable), repr(caught.value)


def test_cut_and_restored_connection(tmp_path: Path, proxied_url: tuple[TcpProxy, str]) -> None:
    proxy, url = proxied_url
    base = make_config(None)
    cfg = Config(
        storage=StorageSettings(catalog_url=url),
        keyring=KeyringSettings(store_url=url),
        scopes=base.scopes,
    )
    with Keyshred.init(tmp_path / "data", cfg) as ks:
        ks.memories.put("ana", ("m",), "k0", {"n": 0})
        for round_no in range(2):  # survives a second cut as well
            proxy.cut()
            _all_refused(
                [
                    lambda: ks.memories.put("ana", ("m",), "k-cut", {"n": 1}),
                    lambda: ks.memories.get("ana", ("m",), "k0"),
                    lambda: ks.memories.put("bob", ("m",), "k-new", {"n": 2}),  # new key
                    lambda: ks.catalog.assets(ks.subject_ref("ana")),  # SQLAlchemy path
                    lambda: ks.catalog.suppress(ks.subject_ref("carl")),
                ]
            )
            proxy.restore()
            ks.memories.put("ana", ("m",), f"k{round_no + 1}", {"n": round_no + 1})
            got = ks.memories.get("ana", ("m",), "k0")
            assert got is not None and got.value == {"n": 0}
            assert ks.memories.get("ana", ("m",), "k-cut") is None  # nothing half-written
            ks.memories.put("dora", ("m",), f"k{round_no}", {"n": 3})  # a new subject's key
            assert len(ks.catalog.assets(ks.subject_ref("ana"))) == round_no + 2
        # Cut while idle (a server restart between two calls): the very next calls
        # succeed, on new connections in place of the pooled ones that were cut.
        proxy.cut()
        proxy.restore()
        assert ks.memories.get("ana", ("m",), "k1") is not None
        ks.memories.put("ana", ("m",), "k-after", {"n": 4})
        ks.memories.put("erin", ("m",), "k", {"n": 5})
        assert ks.catalog.assets(ks.subject_ref("erin"))


def test_key_store_cut_and_restored(proxied_url: tuple[TcpProxy, str]) -> None:
    proxy, url = proxied_url
    store = PostgresKeyStore(url)
    try:
        assert store.counts()["dek"] == 0
        proxy.cut()
        _all_refused([store.counts, store.tombstones, store.snapshot])
        proxy.restore()
        assert store.counts()["dek"] == 0
        assert store.snapshot()
        proxy.cut()  # while idle: the next call already succeeds
        proxy.restore()
        assert store.counts()["dek"] == 0
    finally:
        store.close()


def test_close_closes_every_component_when_the_vault_flush_fails(
    tmp_path: Path, proxied_url: tuple[TcpProxy, str]
) -> None:
    # Review of #18 items 1/8: ``close`` ran the components' closes in a row, so the
    # vault's final flush failing (database cut) skipped the memory store's close:
    # its partitions (open files, decrypted state) outlived the closed handle.
    from datetime import timedelta

    from keyshred.config import TokenSettings

    proxy, url = proxied_url
    cfg = Config(
        storage=StorageSettings(catalog_url=url),
        keyring=KeyringSettings(store_url=url),
        tokens=TokenSettings(group_commit_ms=10_000),  # tokens wait for close
        scopes=make_config(None).scopes,
    )
    ks = Keyshred.init(tmp_path / "data", cfg)
    ks.memories.put("ana", ("m",), "k", {"n": 1})
    ks.vault.sanitize("mail jane@example.com", "ana", "support", timedelta(hours=1))
    memories = ks._memories
    assert memories._partitions
    proxy.cut()
    try:
        with pytest.raises(BackendUnavailable):
            ks.close(flush=False)
        assert not memories._partitions
    finally:
        proxy.restore()
