"""The facade against each real KEK backend, and the no-leak rules for ids."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from keyshred import Config, Keyshred, Subject, SubjectErased
from keyshred.config import AwsSettings, KekSettings, VaultSettings
from keyshred.keyring.envelope import Place
from tests.servers import Server


def test_subject_repr_hides_the_id() -> None:
    s = Subject("jane.doe@example.com", tenant="acme")
    assert "jane" not in repr(s) and "jane" not in str(s)


def _config(provider: str, request: pytest.FixtureRequest) -> Config:
    if provider == "vault":
        server: Server = request.getfixturevalue("openbao")
        return Config(kek=KekSettings(provider="vault", vault=VaultSettings(url=server.url)))
    if provider == "aws":
        server = request.getfixturevalue("moto")
        return Config(
            kek=KekSettings(
                provider="aws",
                aws=AwsSettings(
                    endpoint_url=server.url,
                    region="us-east-1",
                    alias_prefix=f"alias/facade-{uuid.uuid4().hex[:8]}",
                ),
            )
        )
    return Config()


@pytest.mark.parametrize("provider", ["local", "vault", "aws"])
def test_init_open_erase_on_every_backend(
    provider: str, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    if provider == "vault":
        monkeypatch.setenv("VAULT_TOKEN", request.getfixturevalue("openbao").token)
    cfg = _config(provider, request)
    with Keyshred.init(tmp_path / "d", cfg) as ks:
        ref = ks.subject_ref("alice")
        assert ref == ks.subject_ref(Subject("alice"))
        ct = ks.keyring.seal(b"secret", Place(ref, "default", "t", "1", "v"))
    with Keyshred.open(tmp_path / "d") as ks:
        assert ks.config.kek.provider == provider
        assert ks.subject_ref("alice") == ref
        assert ks.keyring.open(ct, Place(ref, "default", "t", "1", "v")) == b"secret"
        ks.keyring.destroy(ref)
    with Keyshred.open(tmp_path / "d") as ks, pytest.raises(SubjectErased):
        ks.keyring.open(ct, Place(ref, "default", "t", "1", "v"))
