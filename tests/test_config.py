"""Configuration: file, environment overrides, typed errors, no secrets written."""

from __future__ import annotations

from pathlib import Path

import pytest

from keyshred import Config, ConfigError, Keyshred, MissingExtraError
from keyshred._extras import require
from keyshred.config import KekSettings, load_config, save_config


def test_defaults_roundtrip_through_the_file(tmp_path: Path) -> None:
    cfg = Config(tenant="acme", kek=KekSettings(provider="vault"))
    save_config(tmp_path, cfg)
    assert load_config(tmp_path, env={}) == cfg


def test_environment_overrides_the_file(tmp_path: Path) -> None:
    save_config(tmp_path, Config())
    env = {
        "KEYSHRED_KEK__PROVIDER": "aws",
        "KEYSHRED_KEK__AWS__ENDPOINT_URL": "http://127.0.0.1:1",
        "KEYSHRED_VAULT_TOKEN": "not-a-setting",
        "KEYSHRED_PATH": "/also/not/a/setting",
    }
    cfg = load_config(tmp_path, env=env)
    assert cfg.kek.provider == "aws"
    assert cfg.kek.aws.endpoint_url == "http://127.0.0.1:1"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("kek = [", "not valid TOML"),
        ('[kek]\nprovider = "hsm"\n', "kek.provider"),
        ("unknown = 1\n", "unknown"),
        ("[keyring]\ncache_ttl_seconds = -1\n", "keyring.cache_ttl_seconds"),
    ],
)
def test_bad_config_is_a_config_error(tmp_path: Path, text: str, fragment: str) -> None:
    (tmp_path / "keyshred.toml").write_text(text)
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        load_config(tmp_path, env={})


def test_vault_token_is_never_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "hvs.probe-token-7f3a"
    monkeypatch.setenv("VAULT_TOKEN", secret)
    monkeypatch.setenv("KEYSHRED_VAULT_TOKEN", secret)
    save_config(
        tmp_path, load_config(tmp_path).model_copy(update={"kek": KekSettings(provider="vault")})
    )
    text = (tmp_path / "keyshred.toml").read_text()
    assert secret not in text
    # No setting named like a credential exists to be written.
    keys = [line.split("=")[0].strip().lower() for line in text.splitlines() if "=" in line]
    assert not [k for k in keys if k in ("token", "vault_token", "secret", "password")]


def test_open_needs_an_initialized_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="keyshred init"):
        Keyshred.open(tmp_path)
    Keyshred.init(tmp_path).close()
    with pytest.raises(ConfigError, match="already"):
        Keyshred.init(tmp_path)
    with Keyshred.open(tmp_path) as ks:
        assert "embedded" in repr(ks)


def test_vault_provider_without_token_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VAULT_TOKEN", raising=False)
    monkeypatch.delenv("KEYSHRED_VAULT_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="VAULT_TOKEN"):
        Keyshred.init(tmp_path, Config(kek=KekSettings(provider="vault")))


def test_missing_extra_names_the_extra() -> None:
    with pytest.raises(MissingExtraError, match=r"keyshred\[langgraph\]") as info:
        require("not_installed_module_xyz", extra="langgraph")
    assert isinstance(info.value, ImportError)


def test_group_commit_defaults_to_the_catalog() -> None:
    """Group commit (journaled) on the embedded catalog; a commit per call on
    PostgreSQL, whose commits the server fsyncs; an explicit setting wins."""
    from keyshred.config import DEFAULT_GROUP_COMMIT_MS, TokenSettings

    assert TokenSettings().commit_ms("sqlite") == DEFAULT_GROUP_COMMIT_MS > 0
    assert TokenSettings().commit_ms("postgresql") == 0
    assert TokenSettings(group_commit_ms=0).commit_ms("sqlite") == 0
    assert TokenSettings(group_commit_ms=5).commit_ms("postgresql") == 5
