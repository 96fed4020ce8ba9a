"""Configuration: file, environment overrides, typed errors, no secrets written."""

from __future__ import annotations

import json
import stat
import tomllib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import SecretStr
from rich.pretty import pretty_repr

from keyshred import Config, ConfigError, Keyshred, MissingExtraError
from keyshred._extras import require
from keyshred.config import (
    AuditSettings,
    AwsSettings,
    BackupSettings,
    ErasureSettings,
    JobSettings,
    KekSettings,
    KeyringSettings,
    RetentionSettings,
    S3Settings,
    ScopeSettings,
    StorageSettings,
    TokenSettings,
    VaultSettings,
    VectorSettings,
    WebhookSettings,
    load_config,
    save_config,
)


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


def test_environment_reaches_every_level(tmp_path: Path) -> None:
    env = {
        "KEYSHRED_TENANT": "acme",
        "KEYSHRED_PROFILE": "distributed",
        "KEYSHRED_STORAGE__CATALOG_URL": "postgresql+psycopg://ks@db/ks",
        "KEYSHRED_KEK__VAULT__URL": "https://vault.internal:8200",
        "KEYSHRED_KEK__VAULT__WORKERS": "9",
        "KEYSHRED_KEK__AWS__PENDING_WINDOW_DAYS": "30",
        "keyshred_keyring__pool_pre_ping": "true",  # names are case-insensitive
        "KEYSHRED_SCOPES__SUPPORT__PURPOSE": "customer support",
        "KEYSHRED_SCOPES__SUPPORT__MAX_RETENTION_DAYS": "30",
        "KEYSHRED_TOKENS__GROUP_COMMIT_MS": "0",
    }
    cfg = load_config(tmp_path, env=env)
    assert (cfg.tenant, cfg.profile) == ("acme", "distributed")
    assert cfg.storage.catalog_url == "postgresql+psycopg://ks@db/ks"
    assert cfg.kek.vault.url == "https://vault.internal:8200"
    assert cfg.kek.vault.workers == 9
    assert cfg.kek.aws.pending_window_days == 30
    assert cfg.keyring.pool_pre_ping is True
    assert cfg.scopes["support"] == ScopeSettings(purpose="customer support", max_retention_days=30)
    assert cfg.scopes["default"].purpose == "default"  # always there
    assert cfg.tokens.group_commit_ms == 0


def test_json_values_in_the_environment(tmp_path: Path) -> None:
    save_config(tmp_path, Config())  # retention {daily 7, monthly 90} in the file
    env = {
        "KEYSHRED_BACKUP__RETENTION": '{"daily": 3}',
        "KEYSHRED_SCOPES__DEFAULT__CATEGORIES": '["general", "health"]',
        "KEYSHRED_SCOPES__BILLING": '{"purpose": "billing", "basis": "contract"}',
        "KEYSHRED_KEK__AWS": '{"region": "eu-west-1", "workers": 2}',
    }
    cfg = load_config(tmp_path, env=env)
    # A table given as JSON is the whole value: the file's monthly class is gone.
    assert cfg.backup.retention == {"daily": 3}
    assert cfg.scopes["default"].categories == ["general", "health"]
    assert cfg.scopes["billing"] == ScopeSettings(purpose="billing", basis="contract")
    assert (cfg.kek.aws.region, cfg.kek.aws.workers) == ("eu-west-1", 2)
    # JSON and nested names for the same table combine.
    both = {
        "KEYSHRED_BACKUP__RETENTION": '{"daily": 3}',
        "KEYSHRED_BACKUP__RETENTION__WEEKLY": "30",
    }
    assert load_config(tmp_path, env=both).backup.retention == {"daily": 3, "weekly": 30}


@pytest.mark.parametrize("layers", range(4))
def test_precedence_arguments_environment_file_defaults(tmp_path: Path, layers: int) -> None:
    """Each source set adds one layer; the highest one wins."""
    expected = "default"
    env: dict[str, str] = {}
    overrides: dict[str, Any] = {}
    if layers >= 1:
        (tmp_path / "keyshred.toml").write_text('tenant = "from-file"\n')
        expected = "from-file"
    if layers >= 2:
        env["KEYSHRED_TENANT"] = expected = "from-env"
    if layers >= 3:
        overrides["tenant"] = expected = "from-argument"
    assert load_config(tmp_path, env=env, overrides=overrides).tenant == expected


def test_sections_merge_setting_by_setting(tmp_path: Path) -> None:
    (tmp_path / "keyshred.toml").write_text(
        '[kek]\nprovider = "vault"\n[kek.vault]\nurl = "https://v:8200"\nworkers = 2\n'
        '[scopes.support]\npurpose = "support"\ncategories = ["contact", "orders"]\n'
    )
    env = {"KEYSHRED_KEK__VAULT__WORKERS": "6", "KEYSHRED_SCOPES__SUPPORT__BASIS": "contract"}
    cfg = load_config(tmp_path, env=env, overrides={"kek": {"vault": {"mount": "kv"}}})
    assert cfg.kek.provider == "vault"
    assert (cfg.kek.vault.url, cfg.kek.vault.workers, cfg.kek.vault.mount) == (
        "https://v:8200",
        6,
        "kv",
    )
    assert cfg.scopes["support"] == ScopeSettings(
        purpose="support", categories=["contact", "orders"], basis="contract"
    )
    # What the file and environment set is known (the CLI refuses options contradicting it).
    assert cfg.kek.model_fields_set == {"provider", "vault"}
    assert "provider" not in load_config(tmp_path / "none", env={}).kek.model_fields_set


def test_config_built_in_code_ignores_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEYSHRED_TENANT", "from-env")
    assert Config().tenant == "default"
    assert Config.model_validate({}).tenant == "default"


@pytest.mark.parametrize(
    ("value", "expected"),
    [("false", False), ("TRUE", True), ("0", False), ("/etc/ssl/ca.pem", "/etc/ssl/ca.pem")],
)
def test_vault_verify_from_the_environment(tmp_path: Path, value: str, expected: object) -> None:
    cfg = load_config(tmp_path, env={"KEYSHRED_KEK__VAULT__VERIFY": value})
    assert cfg.kek.vault.verify == expected


# --- The file: round trip ------------------------------------------------------------


def _everything_changed() -> Config:
    """A configuration with a non-default value in every section and sub-section."""
    return Config(
        profile="distributed",
        tenant="acme corp",
        kek=KekSettings(
            provider="aws",
            local_path="/srv/keys/kek.json",
            archive_local_path="/srv/keys/archive.json",
            vault=VaultSettings(
                url="https://vault.internal:8200",
                mount="transit-2",
                key="k",
                archive_key="k-old",
                namespace="team/a",
                verify="/etc/ssl/ca.pem",
                timeout_seconds=2.5,
                batch_size=50,
                workers=2,
            ),
            aws=AwsSettings(
                region="eu-west-1",
                endpoint_url="http://127.0.0.1:5000",
                alias_prefix="alias/x",
                archive_alias_prefix="alias/x-arch",
                pending_window_days=30,
                workers=3,
            ),
        ),
        keyring=KeyringSettings(
            store_url="postgresql://ks:pw@db/ks",
            cache_max_entries=5,
            cache_ttl_seconds=1.5,
            pool_size=3,
            pool_max_overflow=0,
            pool_timeout_seconds=4.0,
            pool_pre_ping=True,
            live_rotate_minutes=30.0,
            maintain_every_minutes=1.0,
        ),
        storage=StorageSettings(
            catalog_url="sqlite:////tmp/c.db",
            max_value_bytes=10,
            max_value_depth=5,
            flush_records=7,
            retired_grace_seconds=7.0,
            durability="flush",
            max_open_partitions=3,
            default_max_retention_days=10,
            pool_size=2,
            pool_max_overflow=1,
            pool_timeout_seconds=2.0,
            pool_pre_ping=True,
            uri="s3://bucket/parts",
        ),
        s3=S3Settings(
            endpoint_url="http://127.0.0.1:9000", region="eu-west-1", addressing_style="virtual"
        ),
        vectors=VectorSettings(uri="s3://bucket/v", cache_max_vectors=0, compact_every=4),
        audit=AuditSettings(retention_days=30),
        backup=BackupSettings(
            target="s3://bucket/b",
            s3_endpoint_url="http://127.0.0.1:5001",
            s3_region="us-east-1",
            multipart_mb=8,
            durability="flush",
            retention={"hourly": 1, "yearly-keep": 365},
            default_class="hourly",
            rotate_kek_every_days=7,
            workers=1,
        ),
        retention=RetentionSettings(tokens_grace_days=2, checkpoints_days=9, interval_minutes=5.0),
        erasure=ErasureSettings(lease_seconds=5.0),
        jobs=JobSettings(
            lease_seconds=7.0,
            max_attempts=2,
            backoff_base_seconds=0.5,
            backoff_max_seconds=9.0,
            poll_seconds=0.2,
            retention_every_seconds=0,
            backup_maintain_every_seconds=0,
        ),
        tokens=TokenSettings(group_commit_ms=0, max_text_bytes=100),
        scopes={
            "support": ScopeSettings(
                purpose='say "hi"\\ and\nbye',
                categories=["contact", "orders"],
                basis="legitimate_interest",
                max_retention_days=30,
                purpose_end=datetime(2027, 1, 2, 3, 4, 5, 678, tzinfo=UTC),
                legal_max_days=60,
                detect_mentions=False,
            ),
            "name with spaces.and dots": ScopeSettings(
                purpose="x", purpose_end=datetime(2030, 1, 1)
            ),
        },
        webhooks=[
            WebhookSettings(
                name="dpo",
                url="https://hooks.example/keyshred",
                secret=SecretStr("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"),
                events=["erasure.completed"],
                timeout_seconds=3.5,
                attempts=4,
                backoff_seconds=1.5,
                backoff_max_seconds=60.0,
            ),
            WebhookSettings(url="http://127.0.0.1:9/h?x=1", secret_env="HOOK_SECRET"),
        ],
    )


def test_every_section_roundtrips_through_the_file(tmp_path: Path) -> None:
    cfg = _everything_changed()
    default = Config()
    # The sample covers every section and every setting of the nested ones, so a new
    # section or setting cannot skip this test.
    for name in Config.model_fields:
        assert getattr(cfg, name) != getattr(default, name), name
    for section, model in (("vault", VaultSettings), ("aws", AwsSettings)):
        for name in model.model_fields:
            assert getattr(getattr(cfg.kek, section), name) != getattr(model(), name), name
    file = save_config(tmp_path, cfg)
    assert stat.S_IMODE(file.stat().st_mode) == 0o600
    assert not list(tmp_path.glob(".keyshred.toml.*"))  # the temporary file is renamed
    text = file.read_text("utf-8")
    assert text.startswith("# keyshred configuration")
    doc = tomllib.loads(text)
    assert doc["scopes"]["support"]["purpose_end"] == cfg.scopes["support"].purpose_end
    assert load_config(tmp_path, env={}) == cfg
    # Writing what was read gives the same file.
    save_config(tmp_path, load_config(tmp_path, env={}))
    assert file.read_text("utf-8") == text


_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
_scope_names = _text.filter(lambda n: 0 < len(n) <= 128 and not n.startswith("~"))
_scopes = st.builds(
    ScopeSettings,
    purpose=_text.filter(lambda p: 0 < len(p) <= 128),
    categories=st.lists(_text, min_size=1, max_size=3),
    basis=st.sampled_from(["consent", "contract", "legitimate_interest", "legal_obligation"]),
    max_retention_days=st.none() | st.integers(1, 10**9),
    purpose_end=st.none() | st.datetimes(),
    detect_mentions=st.booleans(),
)


_configs = st.builds(
    lambda tenant, url, ttl, verify, retention, scopes: Config(
        tenant=tenant,
        storage=StorageSettings(catalog_url=url),
        keyring=KeyringSettings(cache_ttl_seconds=ttl),
        kek=KekSettings(vault=VaultSettings(verify=verify)),
        backup=BackupSettings(retention=retention),
        scopes=scopes,
    ),
    tenant=_text.filter(lambda t: 0 < len(t) <= 256),
    url=st.none() | _text,
    ttl=st.floats(min_value=1e-9, allow_nan=False),  # inf included: TOML has it
    # Strings that are not a bool word (those the environment's "false" turns into bools).
    verify=st.booleans()
    | _text.filter(
        lambda v: v.strip().lower() not in {"true", "false", "1", "0", "yes", "no", "on", "off"}
    ),
    retention=st.dictionaries(
        st.from_regex(r"[A-Za-z0-9_-]+", fullmatch=True),
        st.integers(1, 2**62),
        min_size=1,
        max_size=4,
    ),
    scopes=st.dictionaries(_scope_names, _scopes, max_size=3),
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cfg=_configs)
def test_any_config_roundtrips_through_the_file(tmp_path: Path, cfg: Config) -> None:
    save_config(tmp_path, cfg)
    assert load_config(tmp_path, env={}) == cfg


# --- Errors and secrets --------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "fragments"),
    [
        ({"KEYSHRED_KEK__PROVIDER": "hsm"}, ["kek.provider", "KEYSHRED_KEK__PROVIDER"]),
        ({"KEYSHRED_STORAGE__POOL_SIZE": "0"}, ["storage.pool_size", "greater than or equal"]),
        ({"KEYSHRED_BACKUP__RETENTION": '{"daily": 0}'}, ["backup.retention", "days >= 1"]),
        (
            {"KEYSHRED_BACKUP__RETENTION": "daily=3"},
            ["KEYSHRED_BACKUP__RETENTION", "not valid JSON"],
        ),
        ({"KEYSHRED_KEK__VAULT__TOKEN": "x"}, ["kek.vault.token", "Extra inputs"]),
        (
            {"KEYSHRED_SCOPES__SUPPORT__BASIS": "contract"},
            ["scopes.support.purpose", "Field required"],
        ),
        ({"KEYSHRED_SCOPES": '{"~x": {"purpose": "p"}}'}, ["scopes", "not starting with '~'"]),
    ],
)
def test_invalid_environment_is_a_config_error(
    tmp_path: Path, env: dict[str, str], fragments: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path, env=env)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_error_names_the_file_and_lists_every_error(tmp_path: Path) -> None:
    (tmp_path / "keyshred.toml").write_text('tenant = ""\n[storage]\npool_size = 0\n')
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path, env={"KEYSHRED_KEK__PROVIDER": "hsm"})
    text = str(info.value)
    assert (
        f"tenant: String should have at least 1 character (from {tmp_path / 'keyshred.toml'})"
        in text
    )
    assert "storage.pool_size" in text
    assert (
        "kek.provider: Input should be 'local', 'vault' or 'aws' (from KEYSHRED_KEK__PROVIDER)"
        in text
    )


def test_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "keyshred.toml").mkdir()
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path, env={})


SECRET = "Pa55-w0rd.7f3a"  # what must never show


@pytest.mark.parametrize(
    ("env", "file"),
    [
        ({"KEYSHRED_KEK__VAULT__TOKEN": SECRET}, ""),
        ({"KEYSHRED_KEK__PROVIDER": SECRET}, ""),
        ({"KEYSHRED_STORAGE__POOL_SIZE": f"postgresql://u:{SECRET}@db/x"}, ""),
        ({"KEYSHRED_BACKUP__RETENTION": f"{{{SECRET}"}, ""),
        ({"KEYSHRED_BACKUP__RETENTION": json.dumps({SECRET: 0})}, ""),
        ({"KEYSHRED_SCOPES__DEFAULT__CATEGORIES": json.dumps(SECRET)}, ""),
        ({}, f'[storage]\ncatalog_url = 5\npool_size = "postgresql://u:{SECRET}@db/x"\n'),
        ({}, f'[kek]\nprovider = "{SECRET}"\n'),
        ({}, f'token = "{SECRET}\n'),  # a TOML syntax error on the secret's line
    ],
)
def test_a_secret_is_never_in_the_error(tmp_path: Path, env: dict[str, str], file: str) -> None:
    if file:
        (tmp_path / "keyshred.toml").write_text(file)
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path, env=env)
    assert SECRET not in str(info.value)
    assert SECRET not in repr(info.value)
    # Nothing chained that a traceback would print.
    assert info.value.__cause__ is None
    assert info.value.__suppress_context__


def test_url_passwords_are_masked_in_reprs() -> None:
    cfg = Config(
        storage=StorageSettings(catalog_url=f"postgresql+psycopg://ks:{SECRET}@db:5432/ks"),
        keyring=KeyringSettings(store_url=f"postgresql://db/ks?user=ks&password={SECRET}"),
        backup=BackupSettings(s3_endpoint_url=f"https://key:{SECRET}@s3.internal"),
    )
    for shown in (repr(cfg), str(cfg), pretty_repr(cfg), repr(cfg.storage), f"{cfg.keyring}"):
        assert SECRET not in shown
    assert "postgresql+psycopg://ks:***@db:5432/ks" in repr(cfg)
    assert "password=***" in repr(cfg)
    # The real URL is still there for the backends and the file.
    assert SECRET in cfg.storage.catalog_url
    assert cfg.model_dump()["storage"]["catalog_url"] == cfg.storage.catalog_url
