"""Configuration: ``keyshred.toml`` in the data folder, overridden by environment.

Environment variables ``KEYSHRED_<SECTION>__<FIELD>`` (double underscore between
levels) override the file, e.g. ``KEYSHRED_KEK__PROVIDER=vault`` or
``KEYSHRED_KEK__VAULT__URL=http://127.0.0.1:8200``. Secrets are never written to the
file: the Vault token comes from ``KEYSHRED_VAULT_TOKEN`` or ``VAULT_TOKEN``, AWS
credentials from boto3's usual chain.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from keyshred.errors import ConfigError

__all__ = [
    "CONFIG_FILE",
    "AuditSettings",
    "AwsSettings",
    "BackupSettings",
    "Config",
    "KekSettings",
    "KeyringSettings",
    "RetentionSettings",
    "ScopeSettings",
    "StorageSettings",
    "TokenSettings",
    "VaultSettings",
    "VectorSettings",
    "load_config",
    "save_config",
]

CONFIG_FILE = "keyshred.toml"
_BARE = re.compile(r"[A-Za-z0-9_-]+")
ENV_PREFIX = "KEYSHRED_"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class VaultSettings(_Model):
    url: str = "http://127.0.0.1:8200"
    mount: str = "transit"
    key: str = "keyshred-kek"
    # The archive lineage's transit key (backup generations); default ``<key>-archive``.
    archive_key: str | None = None
    namespace: str | None = None
    verify: bool | str = True
    timeout_seconds: float = 10.0
    batch_size: int = Field(200, ge=1, le=10_000)
    workers: int = Field(4, ge=1, le=64)


class AwsSettings(_Model):
    region: str | None = None
    endpoint_url: str | None = None
    alias_prefix: str = "alias/keyshred/kek"
    # The archive lineage's aliases (one KMS key per archive epoch, i.e. per backup
    # generation); default ``<alias_prefix>-archive``.
    archive_alias_prefix: str | None = None
    pending_window_days: int = Field(7, ge=7, le=30)
    workers: int = Field(8, ge=1, le=64)


class KekSettings(_Model):
    provider: Literal["local", "vault", "aws"] = "local"
    # The local KEK file; default ``<data>/keys/kek.local.json``. A restored folder
    # points here at the live file: backups never carry the KEK.
    local_path: str | None = None
    # The archive lineage's key file (backup generations); default
    # ``<data>/keys/kek.archive.json``. Like the live file, never in a backup.
    archive_local_path: str | None = None
    vault: VaultSettings = VaultSettings()
    aws: AwsSettings = AwsSettings()


class KeyringSettings(_Model):
    # None: the SQLite key store in the folder; a postgresql:// URL: the distributed
    # profile's shared key store (keyshred[postgres]).
    store_url: str | None = None
    cache_max_entries: int = Field(10_000, ge=0)
    cache_ttl_seconds: float = Field(300.0, gt=0)
    # The PostgreSQL key store's connection pool (per process): kept open, extra
    # ones opened under load and closed when returned, seconds to wait for one.
    pool_size: int = Field(2, ge=1, le=1000)
    pool_max_overflow: int = Field(8, ge=0, le=1000)
    pool_timeout_seconds: float = Field(30.0, gt=0)
    # Also ping each connection at checkout (a round trip): for networks that drop
    # idle connections silently; a server's hang-up is detected without it.
    pool_pre_ping: bool = False
    # The live KEK lineage's period: the maintenance run (``keyshred maintain``)
    # rotates the live epoch this often and then destroys the previous one, so a
    # wrapped key left in database pages, WAL or replicas is useless after this long.
    live_rotate_minutes: float = Field(60.0, gt=0)
    # How often ``keyshred maintain`` is scheduled. A live epoch is rotated (and the
    # previous one destroyed) at the first run within this much of its end, so an
    # epoch never outlives ``live_rotate_minutes`` while the job keeps its schedule
    # (rotating only once it is a full period old, a run a few seconds early would
    # leave it for one more interval, past the date a receipt states).
    # (Capped at the period.)
    maintain_every_minutes: float = Field(5.0, gt=0)


Basis = Literal["consent", "contract", "legitimate_interest", "legal_obligation"]


class ScopeSettings(_Model):
    """A scope: one purpose, its data categories, its lawful basis and retention.

    Only the ``consent`` basis needs a consent record before a write; the others
    (contract, legitimate interest, legal obligation) are recorded and enforced by
    retention alone. ``retain_until`` of every write is the minimum of the purpose
    end, the consent end, now + ``max_retention_days`` and now + ``legal_max_days``.
    """

    purpose: str = Field(min_length=1, max_length=128)
    categories: list[str] = Field(default_factory=lambda: ["general"], min_length=1)
    basis: Basis = "consent"
    max_retention_days: int | None = Field(None, ge=1)
    purpose_end: datetime | None = None
    legal_max_days: int | None = Field(None, ge=1)
    # Add the subjects whose registered identifiers (``ks.subjects``) appear in a
    # value written under this scope to its mentions (so erasing them reaches it);
    # False: only the mentions the caller declares.
    detect_mentions: bool = True


# The vault's group-commit interval on the embedded catalog (``tokens.group_commit_ms``).
DEFAULT_GROUP_COMMIT_MS = 50.0
DEFAULT_SCOPE = ScopeSettings(purpose="default", categories=["general"], basis="contract")


class StorageSettings(_Model):
    catalog_url: str | None = None
    max_value_bytes: int = Field(1024 * 1024, ge=1)
    # How deeply lists and dicts of a memory value may nest (ValueTooLarge beyond).
    max_value_depth: int = Field(100, ge=1, le=500)
    flush_records: int = Field(1000, ge=1)
    durability: Literal["fsync", "flush"] = "fsync"
    max_open_partitions: int = Field(256, ge=1)
    default_max_retention_days: int = Field(3650, ge=1)
    # The catalog's connection pool (per process; SQLite files and PostgreSQL): kept
    # open, extra ones opened under load and closed when returned, seconds to wait
    # for a free one before BackendUnavailable; pre-ping as in KeyringSettings.
    pool_size: int = Field(5, ge=1, le=1000)
    pool_max_overflow: int = Field(10, ge=0, le=1000)
    pool_timeout_seconds: float = Field(30.0, gt=0)
    pool_pre_ping: bool = False


class VectorSettings(_Model):
    uri: str | None = None
    cache_max_vectors: int = Field(500_000, ge=0)
    compact_every: int = Field(32, ge=1)
    model: Literal["all-MiniLM-L6-v2"] = "all-MiniLM-L6-v2"


class AuditSettings(_Model):
    retention_days: int = Field(2190, ge=1)  # six years, a common record-keeping period


class BackupSettings(_Model):
    """Backups: where they go and how long each class of generation is kept. Each
    generation has its own archive KEK epoch, destroyed once it and every earlier
    generation have expired (``prune``/``maintain``). ``rotate_kek_every_days`` only
    governs generations made before the archive lineage existed (sealed under a
    live epoch): the live schedule is ``keyring.live_rotate_minutes``."""

    target: str | None = None  # a folder or s3://bucket/prefix; default <data>/backups
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    multipart_mb: int = Field(16, ge=5, le=5120)
    # "fsync": each object is on disk before the manifest names it (a local target);
    # "flush": leave it to the OS (faster; a crash can lose the newest generation).
    durability: Literal["fsync", "flush"] = "fsync"
    retention: dict[str, int] = Field(
        default_factory=lambda: {"daily": 7, "monthly": 90}, min_length=1
    )
    default_class: str = "daily"
    rotate_kek_every_days: int = Field(30, ge=1)
    workers: int = Field(4, ge=1, le=64)

    @field_validator("retention")
    @classmethod
    def _retention(cls, value: dict[str, int]) -> dict[str, int]:
        for name, days in value.items():
            if not _BARE.fullmatch(name) or days < 1:
                raise ValueError("retention classes are names with a number of days >= 1")
        return value


class RetentionSettings(_Model):
    """The retention scanner (``keyshred retention run``); per-scope retention of
    memories is in ``scopes``, of audit events in ``audit``, of backups in ``backup``."""

    tokens_grace_days: int = Field(0, ge=0)
    # Agent threads whose newest checkpoint is older than this are deleted (their key
    # destroyed) by the retention run; None keeps them until deleted or erased.
    checkpoints_days: int | None = Field(None, ge=1)
    interval_minutes: float = Field(60.0, gt=0)


class TokenSettings(_Model):
    """The tokenization vault (``ks.vault``)."""

    # > 0: group commit. ``sanitize`` journals its tokens (one append to a file of
    # this process, as crash-safe as the embedded catalog's own commit) and they are
    # written to the catalog at most this many milliseconds later, many texts per
    # transaction (see keyshred.vault.tokens and .journal). 0: every sanitize
    # commits its tokens in its own catalog transaction before it returns. None
    # (default): 50 on the embedded catalog; 0 on PostgreSQL, whose commit is
    # fsync'd by the server, which a journal in the page cache would weaken.
    group_commit_ms: float | None = Field(None, ge=0, le=10_000)
    # The largest text ``sanitize`` accepts (UTF-8 bytes); detection is linear but
    # not free, and one huge text would hold a worker for minutes.
    max_text_bytes: int = Field(1024 * 1024, ge=1)

    def commit_ms(self, dialect: str) -> float:
        """The group-commit interval in effect on a catalog of ``dialect``."""
        if self.group_commit_ms is not None:
            return self.group_commit_ms
        return DEFAULT_GROUP_COMMIT_MS if dialect == "sqlite" else 0.0


class Config(_Model):
    """Every setting keyshred reads; the README lists them."""

    profile: Literal["embedded", "distributed"] = "embedded"
    tenant: str = Field("default", min_length=1, max_length=256)
    kek: KekSettings = KekSettings()
    keyring: KeyringSettings = KeyringSettings()
    storage: StorageSettings = StorageSettings()
    vectors: VectorSettings = VectorSettings()
    audit: AuditSettings = AuditSettings()
    backup: BackupSettings = BackupSettings()
    retention: RetentionSettings = RetentionSettings()
    tokens: TokenSettings = TokenSettings()
    scopes: dict[str, ScopeSettings] = Field(default_factory=lambda: {"default": DEFAULT_SCOPE})

    @field_validator("scopes")
    @classmethod
    def _scopes(cls, value: dict[str, ScopeSettings]) -> dict[str, ScopeSettings]:
        for name in value:
            if not name or name.startswith("~") or len(name) > 128:
                raise ValueError("scope names are 1-128 characters, not starting with '~'")
        return {"default": DEFAULT_SCOPE, **value}


def _apply_env(doc: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    known = set(Config.model_fields)
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        path = name[len(ENV_PREFIX) :].lower().split("__")
        if path[0] not in known:  # e.g. KEYSHRED_VAULT_TOKEN, a secret, not a setting
            continue
        node = doc
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                break
            node = child
        else:
            node[path[-1]] = value
    return doc


def load_config(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> Config:
    """Read ``<path>/keyshred.toml`` (missing file: defaults), then the environment."""
    file = Path(path) / CONFIG_FILE
    doc: dict[str, Any] = {}
    if file.exists():
        try:
            doc = tomllib.loads(file.read_text("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{file} is not valid TOML: {exc}") from None
    doc = _apply_env(doc, os.environ if env is None else env)
    try:
        return Config.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"invalid setting {where}: {first['msg']}") from None


def _toml_value(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def _toml_table(prefix: str, doc: Mapping[str, Any], out: list[str]) -> None:
    scalars = {k: v for k, v in doc.items() if not isinstance(v, Mapping) and v is not None}
    tables = {k: v for k, v in doc.items() if isinstance(v, Mapping)}
    if prefix and scalars:
        out.append(f"\n[{prefix}]")
    out.extend(f"{k} = {_toml_value(v)}" for k, v in scalars.items())
    for name, table in tables.items():
        key = name if _BARE.fullmatch(name) else _toml_value(name)
        _toml_table(f"{prefix}.{key}" if prefix else key, table, out)


def save_config(path: str | os.PathLike[str], config: Config) -> Path:
    """Write ``<path>/keyshred.toml`` (only settings, never secrets)."""
    out = ["# keyshred configuration; every setting is listed in the README."]
    _toml_table("", config.model_dump(mode="json"), out)
    file = Path(path) / CONFIG_FILE
    file.write_text("\n".join(out) + "\n", "utf-8")
    return file
