"""The KEK provider contract, run against local, OpenBao Transit and moto's KMS."""

from __future__ import annotations

import os
import uuid
from datetime import timedelta
from pathlib import Path

import pytest

from keyshred.config import AwsSettings, Config, KekSettings, VaultSettings
from keyshred.errors import ConfigError, IntegrityError, KekEpochDestroyed, KekError
from keyshred.keyring.kek import KekProvider, WrappedKey

CTX = {"keyshred:key_id": "00ff", "keyshred:subject_ref": "abc", "keyshred:scope": "default"}


def test_wrap_unwrap_roundtrip(kek: KekProvider) -> None:
    dek = os.urandom(32)
    wrapped = kek.wrap(dek, CTX)
    assert wrapped.epoch == kek.current_epoch()
    assert dek not in wrapped.blob
    assert kek.unwrap(wrapped, CTX) == dek


def test_context_is_bound(kek: KekProvider) -> None:
    wrapped = kek.wrap(os.urandom(32), CTX)
    with pytest.raises(IntegrityError):
        kek.unwrap(wrapped, {**CTX, "keyshred:subject_ref": "abd"})


def test_tampered_blob_raises_integrity_error(kek: KekProvider) -> None:
    wrapped = kek.wrap(os.urandom(32), CTX)
    blob = bytearray(wrapped.blob)
    blob[len(blob) // 2 + 3] ^= 0x01
    with pytest.raises(IntegrityError):
        kek.unwrap(WrappedKey(wrapped.epoch, bytes(blob)), CTX)


def test_batch_roundtrip_spans_several_server_batches(kek: KekProvider) -> None:
    deks = [os.urandom(32) for _ in range(150)]
    contexts = [{**CTX, "keyshred:key_id": f"{i:04x}"} for i in range(len(deks))]
    wrapped = kek.wrap_many(list(zip(deks, contexts, strict=True)))
    assert len(wrapped) == len(deks)
    assert kek.unwrap_many(list(zip(wrapped, contexts, strict=True))) == deks


def test_batch_unwrap_is_all_or_nothing(kek: KekProvider) -> None:
    wrapped = kek.wrap_many([(os.urandom(32), CTX) for _ in range(3)])
    items = [(w, CTX) for w in wrapped]
    items[1] = (items[1][0], {**CTX, "keyshred:scope": "other"})
    with pytest.raises(IntegrityError):
        kek.unwrap_many(items)


def test_rotate_then_destroy_old_epochs(kek: KekProvider, kek_factory: object) -> None:
    first = kek.current_epoch()
    dek_old = os.urandom(32)
    old = kek.wrap(dek_old, CTX)
    new_epoch = kek.rotate()
    assert new_epoch == first + 1 == kek.current_epoch()
    dek_new = os.urandom(32)
    new = kek.wrap(dek_new, CTX)
    assert new.epoch == new_epoch
    assert kek.unwrap(old, CTX) == dek_old  # old epochs keep unwrapping until destroyed
    rewrapped = kek.rewrap_many([(old, CTX)])[0]
    assert rewrapped.epoch == new_epoch

    destroyed = kek.destroy_epochs_before(new_epoch)
    assert [d.epoch for d in destroyed] == [first]
    with pytest.raises(KekEpochDestroyed):
        kek.unwrap(old, CTX)
    assert kek.unwrap(new, CTX) == dek_new
    assert kek.unwrap(rewrapped, CTX) == dek_old
    assert [e.epoch for e in kek.epochs()] == [new_epoch]
    # Idempotent, and a second provider instance (another process) agrees.
    assert kek.destroy_epochs_before(new_epoch) == []
    other = kek_factory()  # type: ignore[operator]
    with pytest.raises(KekEpochDestroyed):
        other.unwrap(old, CTX)
    assert other.unwrap(new, CTX) == dek_new


def test_destroy_needs_a_live_epoch(kek: KekProvider) -> None:
    with pytest.raises(ConfigError):
        kek.destroy_epochs_before(kek.current_epoch() + 5)


def test_repr_holds_no_secret(kek: KekProvider) -> None:
    wrapped = kek.wrap(os.urandom(32), CTX)
    assert wrapped.blob.hex() not in repr(wrapped)
    assert "token" not in repr(kek).lower()


def test_unreachable_servers_raise_kek_unavailable(tmp_path: object) -> None:
    from keyshred.errors import KekUnavailable
    from keyshred.keyring.kek.aws import AwsKmsKek
    from keyshred.keyring.kek.vault import VaultKek
    from tests.servers import free_port

    # Built without a call (a process opens while its KEK is down); the first
    # call says the service cannot be reached.
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(KekUnavailable):
        VaultKek(dead, "token", timeout=2).current_epoch()
    with pytest.raises(KekUnavailable):
        AwsKmsKek(endpoint_url=dead, region="us-east-1").current_epoch()


def test_vault_wrong_token_is_unavailable_not_integrity(openbao: object) -> None:
    from keyshred.errors import KekUnavailable
    from keyshred.keyring.kek.vault import VaultKek

    with pytest.raises(KekUnavailable):
        VaultKek(openbao.url, "wrong-token").current_epoch()  # type: ignore[attr-defined]


def test_vault_destroy_trims_key_material_on_the_server(openbao: object) -> None:
    import hvac

    from keyshred.keyring.kek.vault import VaultKek

    kek = VaultKek(openbao.url, openbao.token, key_name="trim-check")  # type: ignore[attr-defined]
    kek.rotate()
    kek.rotate()
    kek.destroy_epochs_before(3)
    client = hvac.Client(url=openbao.url, token=openbao.token)  # type: ignore[attr-defined]
    data = client.secrets.transit.read_key("trim-check")["data"]
    assert data["min_available_version"] == 3
    assert sorted(data["keys"]) == ["3"]


def test_aws_destroy_disables_and_schedules_deletion(moto: object) -> None:
    import boto3

    from keyshred.keyring.kek.aws import AwsKmsKek

    url = moto.url  # type: ignore[attr-defined]
    kek = AwsKmsKek(alias_prefix="alias/keyshred-test/sched", region="us-east-1", endpoint_url=url)
    assert kek.current_epoch() == 1  # the first use makes epoch 1
    client = boto3.client("kms", region_name="us-east-1", endpoint_url=url)
    aliases = {a["AliasName"]: a["TargetKeyId"] for a in client.list_aliases()["Aliases"]}
    first = aliases["alias/keyshred-test/sched/epoch-000001"]
    kek.rotate()
    (destroyed,) = kek.destroy_epochs_before(2)
    meta = client.describe_key(KeyId=first)["KeyMetadata"]
    assert meta["KeyState"] == "PendingDeletion"
    assert destroyed.effective_at > meta["CreationDate"]


def _kek_settings(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> KekSettings:
    unique = uuid.uuid4().hex[:10]
    if name == "local":
        return KekSettings(provider="local")
    if name == "vault":
        server = request.getfixturevalue("openbao")
        request.getfixturevalue("monkeypatch").setenv("VAULT_TOKEN", server.token)
        return KekSettings(provider="vault", vault=VaultSettings(url=server.url, key=f"k-{unique}"))
    server = request.getfixturevalue("moto")
    return KekSettings(
        provider="aws",
        aws=AwsSettings(
            endpoint_url=server.url, region="us-east-1", alias_prefix=f"alias/lin-{unique}"
        ),
    )


@pytest.mark.parametrize("name", ["local", "vault", "aws"])
def test_archive_lineage_is_a_second_key_independent_of_the_live_one(
    name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The archive provider of each profile is a second key (file, transit key
    ``<key>-archive``, alias prefix ``<prefix>-archive``): a backup copy costs two
    archive calls (rotate, wrap) whatever the number of keys, opens with one, does
    not depend on the live lineage at all, and ends when its archive epoch does."""
    from keyshred._backends import make_archive_kek, make_kek
    from keyshred.keyring.epochs import epoch_key_context
    from keyshred.keyring.keyring import Keyring
    from keyshred.keyring.keystore import SQLiteKeyStore
    from tests.keyring.test_epochs import CountingKek

    config = Config(kek=_kek_settings(name, request, tmp_path))
    live = CountingKek(make_kek(config, tmp_path, create=True))
    archive = CountingKek(make_archive_kek(config, tmp_path))
    assert archive.name == live.name
    if name == "local":
        assert (tmp_path / "keys" / "kek.archive.json").exists()
    ring = Keyring(SQLiteKeyStore(tmp_path / "ks.db"), live, archive_kek=archive)
    try:
        refs = [ring.subject_ref(f"s{i}") for i in range(30)]
        for r in refs:
            ring.data_key(r, "default")
        live.calls.clear()
        copy = ring.archive_copy(ring.store.snapshot(), "backup:g1")
        assert archive.calls == {"rotate": 1, "wrap": 1} and live.calls == {}
        assert copy.keys == 30
        # The live provider cannot open the archive epoch key: another key.
        with pytest.raises((IntegrityError, KekEpochDestroyed, KekError)):
            live.inner.unwrap(copy.wrapped, epoch_key_context("archive", copy.epoch))
        archive.calls.clear()
        image = ring.open_archive(copy.epoch, copy.wrapped, copy.sealed, "backup:g1")
        assert archive.calls == {"unwrap": 1}
        # Destroying every live epoch the copy was made under changes nothing for it.
        ring.maintain_live(timedelta(0))
        assert ring.open_archive(copy.epoch, copy.wrapped, copy.sealed, "backup:g1") == image
        # Destroying its archive epoch ends it.
        archive.inner.destroy_epochs_before(archive.inner.rotate())
        with pytest.raises(KekEpochDestroyed):
            ring.open_archive(copy.epoch, copy.wrapped, copy.sealed, "backup:g1")
    finally:
        ring.close()


def test_vault_follows_a_standby_redirect_to_the_active_node(openbao: object) -> None:
    """An HA standby answers 307 with the active node's address; every call (key
    management and the batch data path) follows it, method and body kept."""
    import http.server
    import threading

    from keyshred.keyring.kek.vault import VaultKek

    active = openbao.url.rstrip("/")  # type: ignore[attr-defined]

    class Standby(http.server.BaseHTTPRequestHandler):
        def _redirect(self) -> None:
            self.send_response(307)
            self.send_header("Location", active + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_POST = do_PUT = _redirect

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Standby)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        standby = f"http://127.0.0.1:{server.server_address[1]}"
        kek = VaultKek(standby, openbao.token, key_name="via-standby")  # type: ignore[attr-defined]
        keys = [os.urandom(32), os.urandom(32)]
        wrapped = kek.wrap_many([(k, CTX) for k in keys])
        assert kek.unwrap_many(list(zip(wrapped, [CTX, CTX], strict=True))) == keys
    finally:
        server.shutdown()
