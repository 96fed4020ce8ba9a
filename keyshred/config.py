"""Configuration: ``keyshred.toml`` in the data folder, the environment, arguments.

Precedence, highest first: explicit arguments (``load_config(..., overrides=...)``),
environment variables, ``keyshred.toml``, the defaults below. A variable
``KEYSHRED_<SECTION>__<FIELD>`` (double underscore between levels, any case) sets one
setting, e.g. ``KEYSHRED_KEK__PROVIDER=vault``, ``KEYSHRED_KEK__VAULT__URL=https://…``,
``KEYSHRED_SCOPES__SUPPORT__PURPOSE=support``; a list, a table or a whole section is
given as JSON, e.g. ``KEYSHRED_BACKUP__RETENTION='{"daily": 3}'``. Sections (and each
scope) merge setting by setting across the sources; a setting's value, a table such as
``backup.retention`` included, replaces the lower source's whole. Other ``KEYSHRED_``
variables (``KEYSHRED_PATH``, ``KEYSHRED_VAULT_TOKEN``) are not settings.

Secrets are never written to the file: the Vault token comes from
``KEYSHRED_VAULT_TOKEN`` or ``VAULT_TOKEN``, AWS credentials from boto3's usual chain,
a webhook's signing secret best from the variable its ``secret_env`` names (one
given inline is a ``SecretStr``: ``**********`` in every repr and in
``redacted_dump``). A password inside a URL setting is masked in every repr, and no
error message echoes a value.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import os
import re
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeGuard, cast, get_args, get_origin
from urllib.parse import urlsplit

import tomli_w
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from keyshred.errors import ConfigError

if TYPE_CHECKING:
    from pydantic_settings import EnvSettingsSource

__all__ = [
    "CONFIG_FILE",
    "WEBHOOK_EVENTS",
    "AuditSettings",
    "AwsSettings",
    "BackupSettings",
    "Config",
    "JobSettings",
    "KekSettings",
    "KeyringSettings",
    "RetentionSettings",
    "S3Settings",
    "ScopeSettings",
    "StorageSettings",
    "TokenSettings",
    "VaultSettings",
    "VectorSettings",
    "WebhookSettings",
    "load_config",
    "redacted_dump",
    "save_config",
]

CONFIG_FILE = "keyshred.toml"
_BARE = re.compile(r"[A-Za-z0-9_-]+")
ENV_PREFIX = "KEYSHRED_"
_NESTED = "__"


# A URL's password (``scheme://user:PASSWORD@host``) and secret-named query parameters.
_URL_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*:)[^@\s]*(?=@)")
_QUERY_SECRET = re.compile(
    r"(?i)(?P<head>[?&](?:password|passwd|pwd|token|secret|sslpassword)=)[^&#\s]*"
)


def _redact(text: str) -> str:
    """``text`` with any URL password or secret query parameter replaced by ``***``."""
    return _QUERY_SECRET.sub(r"\g<head>***", _URL_PASSWORD.sub(r"\g<head>***", text))


def redacted_dump(config: BaseModel) -> dict[str, Any]:
    """``config`` as JSON-ready data with every URL password and secret query
    parameter masked: what a copy that must not carry credentials (a backup
    manifest) records."""

    def walk(value: Any) -> Any:
        if isinstance(value, str):
            return _redact(value)
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    data = cast(dict[str, Any], walk(config.model_dump(mode="json")))
    for hook in data.get("webhooks") or ():
        # A webhook URL's path and query are often its credential (a Slack-style
        # path token, an ``api_key`` or a SAS ``sig``): only its origin is recorded.
        if isinstance(hook, dict) and isinstance(hook.get("url"), str):
            hook["url"] = _origin_only(hook["url"])
    return data


def _origin_only(url: str) -> str:
    """``scheme://host[:port]/...`` of ``url``: no user info, path or query."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}/..."


class _Model(BaseModel):
    # hide_input_in_errors: a ValidationError's text never repeats the value it
    # refused (a webhook secret, a URL with a password), whoever prints it.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        # A URL setting may carry a database password (postgresql://user:pw@host/db);
        # repr, str and rich's pretty printer (all built from these) show it masked.
        # model_dump() keeps it: the file and the backends need the real URL.
        for name, value in super().__repr_args__():
            yield name, _redact(value) if isinstance(value, str) else value


# What an environment variable may say for a bool (pydantic's own words).
_BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True}
_BOOL_WORDS |= {"false": False, "0": False, "no": False, "off": False}


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

    @field_validator("verify", mode="before")
    @classmethod
    def _verify(cls, value: object) -> object:
        # Every environment value is a string: KEYSHRED_KEK__VAULT__VERIFY=false turns
        # verification off; it is not a CA bundle at a path named "false".
        if isinstance(value, str) and value.strip().lower() in _BOOL_WORDS:
            return _BOOL_WORDS[value.strip().lower()]
        return value


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
    # Calls to the KEK provider (keyring/kek/resilient.py): a transient failure (the
    # service unreachable, sealed, restarting) is retried this many times with
    # exponential backoff and full jitter from ``kek_retry_initial_seconds`` up to
    # ``kek_retry_cap_seconds`` a wait, never past ``kek_retry_max_seconds`` from the
    # first attempt; after ``kek_circuit_failures`` failures in a row calls fail fast
    # (KekCircuitOpen) for ``kek_circuit_reset_seconds``, then one trial call goes.
    kek_retries: int = Field(3, ge=0, le=100)
    kek_retry_max_seconds: float = Field(5.0, ge=0, le=600)
    kek_retry_initial_seconds: float = Field(0.05, gt=0, le=60)
    kek_retry_cap_seconds: float = Field(1.0, gt=0, le=600)
    kek_circuit_failures: int = Field(5, ge=1, le=10_000)
    kek_circuit_reset_seconds: float = Field(10.0, gt=0, le=3600)


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


class S3Settings(_Model):
    """The one S3 (or S3-compatible) service of memory partitions, vector datasets
    and backups. Credentials come from the usual AWS chain (environment, shared
    config and credentials files, instance or task role): never from this file."""

    endpoint_url: str | None = None  # None: AWS itself; http(s)://host:port otherwise
    region: str | None = None  # None: the chain's (AWS_REGION, config file), else us-east-1
    addressing_style: Literal["path", "virtual"] = "path"


class StorageSettings(_Model):
    catalog_url: str | None = None
    # Where memory partitions' segments live: a folder (default <data>/memories) or
    # s3://bucket/prefix (the [s3] section says how to reach it).
    uri: str | None = None
    max_value_bytes: int = Field(1024 * 1024, ge=1)
    # How deeply lists and dicts of a memory value may nest (ValueTooLarge beyond).
    max_value_depth: int = Field(100, ge=1, le=500)
    flush_records: int = Field(1000, ge=1)
    # A compaction of a partition of at most this many memories (and 256 KiB of
    # values) writes them back into the catalog, one sealed record per scope,
    # instead of a Parquet segment; 0: every compaction writes segments.
    inline_max_rows: int = Field(32, ge=0, le=1000)
    # How long a segment a compaction replaced stays in the partition store: a
    # reader in another process that listed it, or a backup copying what its
    # catalog snapshot lists, may still need it. Deletions and erasures do not wait.
    retired_grace_seconds: float = Field(300.0, ge=0, le=86_400)
    durability: Literal["fsync", "flush"] = "fsync"
    max_open_partitions: int = Field(256, ge=1)
    # How long a subject's decrypted rows (an open partition) and decrypted vectors
    # stay in memory unused; the janitor drops them every ``cache_sweep_seconds``
    # whether or not anyone asks again (unwrapped keys: keyring.cache_ttl_seconds).
    # An erasure elsewhere evicts them at once (its eviction event); these bound
    # what a missed event would leave.
    cache_ttl_seconds: float = Field(300.0, gt=0)
    cache_sweep_seconds: float = Field(5.0, gt=0, le=3600)
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


class ErasureSettings(_Model):
    """Erasure requests (``ks.erase``, ``keyshred erase``/``resume``)."""

    # A worker runs a request under a lease in the catalog, renewed every third of
    # this while it runs; another worker takes the request over once it runs out
    # (a killed worker of the same machine: at once). A run that finds the request
    # leased waits up to this long for it before returning it as it stands.
    lease_seconds: float = Field(60.0, ge=1, le=3600)


class JobSettings(_Model):
    """Jobs in the catalog (``keyshred.jobs``) and the workers that run them
    (``keyshred worker``)."""

    # A worker holds a job under a lease renewed every third of this while it runs;
    # a killed worker's job is taken by another once it runs out (same machine: at once).
    lease_seconds: float = Field(60.0, ge=1, le=3600)
    # Runs of a job before it goes to manual_review (dead letter).
    max_attempts: int = Field(5, ge=1, le=100)
    # A failed run waits a random time in [0, min(max, base * 2**(attempts-1))]
    # (exponential backoff, full jitter) before the job is due again.
    backoff_base_seconds: float = Field(2.0, ge=0, le=3600)
    backoff_max_seconds: float = Field(300.0, ge=0, le=86_400)
    # How long an idle worker sleeps before it looks for due jobs again.
    poll_seconds: float = Field(1.0, gt=0, le=60)
    # Periodic jobs the workers enqueue, one per period across all workers (0: off).
    retention_every_seconds: float = Field(3600.0, ge=0)
    backup_maintain_every_seconds: float = Field(300.0, ge=0)


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

    # > 0: group commit. ``sanitize`` journals its tokens (one copy into a file of
    # this process mapped into memory, as crash-safe as the embedded catalog's own
    # commit) and they are written to the catalog at most this many milliseconds
    # later, many texts per transaction (keyshred.vault.group). 0: every sanitize
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


# The events a completion webhook is sent for (``keyshred.erasure.callbacks``): a
# subject or scope erasure, or the scope erasure of a consent withdrawal, that
# completed (its receipt signed), stopped in manual_review (a human must look: a
# failed verification, an unknown producer, attempts used up) or was rejected.
# Retention runs and tombstone replays send none.
WebhookEvent = Literal[
    "erasure.completed",
    "erasure.manual_review",
    "erasure.rejected",
    "consent.withdrawal.completed",
    "consent.withdrawal.manual_review",
    "consent.withdrawal.rejected",
]
WEBHOOK_EVENTS: tuple[WebhookEvent, ...] = get_args(WebhookEvent)
_WEBHOOK_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,23}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_MIN_WEBHOOK_KEY_BYTES = 16  # as keyshred.webhooks


class WebhookSettings(_Model):
    """One endpoint of completion webhooks (``[[webhooks]]``): signed after the
    Standard Webhooks convention, each delivery a ``webhook`` job with its own
    attempts and backoff. The secret (``whsec_`` and base64, as
    ``keyshred.webhooks.new_secret`` makes it) is given inline (``secret``: shown as
    ``**********`` in every repr and dump) or, better, named by ``secret_env``: an
    environment variable read by the worker at each delivery."""

    # The endpoint's name in job rows and audit events (the URL never is: it may
    # carry a token); default ``u`` and 12 hex digits of the URL's SHA-256. Naming
    # it lets its URL change without orphaning queued deliveries.
    name: str | None = None
    url: str
    secret: SecretStr | None = None
    secret_env: str | None = None
    events: list[WebhookEvent] = Field(default_factory=lambda: list(WEBHOOK_EVENTS), min_length=1)
    timeout_seconds: float = Field(10.0, gt=0, le=300)
    # Runs of a delivery (the job's max_attempts) before it goes to manual_review;
    # a failed one waits a random time in [0, min(backoff_max_seconds,
    # backoff_seconds * 2**(attempts-1))].
    attempts: int = Field(8, ge=1, le=100)
    backoff_seconds: float = Field(10.0, ge=0, le=3600)
    backoff_max_seconds: float = Field(3600.0, ge=0, le=86_400)

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        for name, value in super().__repr_args__():
            yield name, _origin_only(value) if name == "url" and isinstance(value, str) else value

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not _WEBHOOK_NAME.fullmatch(value):
            raise ValueError("a webhook name is 1-24 lower-case letters, digits, _ and -")
        return value

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018 - raises ValueError for a port out of range
        except ValueError:
            raise ValueError("a webhook URL is http:// or https:// with a host") from None
        if (
            parts.scheme not in ("http", "https")
            or not parts.hostname
            or not value.isascii()
            or not value.isprintable()
            or " " in value
        ):
            raise ValueError("a webhook URL is http:// or https:// with a host")
        return value

    @field_validator("secret")
    @classmethod
    def _secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            encoded = value.get_secret_value().removeprefix("whsec_")
            try:
                key = base64.b64decode(encoded, validate=True)
            except (binascii.Error, ValueError):
                key = b""
            if len(key) < _MIN_WEBHOOK_KEY_BYTES:
                raise ValueError(
                    "a webhook secret is whsec_ and the base64 of at least 16 random bytes"
                )
        return value

    @field_validator("secret_env")
    @classmethod
    def _secret_env(cls, value: str | None) -> str | None:
        if value is not None and not _ENV_NAME.fullmatch(value):
            raise ValueError("secret_env is the name of an environment variable")
        return value

    @field_validator("events")
    @classmethod
    def _events(cls, value: list[str]) -> list[str]:
        return list(dict.fromkeys(value))

    @model_validator(mode="after")
    def _one_secret(self) -> WebhookSettings:
        if (self.secret is None) == (self.secret_env is None):
            raise ValueError("a webhook has either secret or secret_env")
        return self

    @property
    def endpoint(self) -> str:
        """The name job rows and audit events know this endpoint by."""
        if self.name is not None:
            return self.name
        return "u" + hashlib.sha256(self.url.encode()).hexdigest()[:12]


class Config(_Model):
    """Every setting keyshred reads; the README lists them."""

    profile: Literal["embedded", "distributed"] = "embedded"
    tenant: str = Field("default", min_length=1, max_length=256)
    kek: KekSettings = KekSettings()
    keyring: KeyringSettings = KeyringSettings()
    storage: StorageSettings = StorageSettings()
    s3: S3Settings = S3Settings()
    vectors: VectorSettings = VectorSettings()
    audit: AuditSettings = AuditSettings()
    erasure: ErasureSettings = ErasureSettings()
    jobs: JobSettings = JobSettings()
    backup: BackupSettings = BackupSettings()
    retention: RetentionSettings = RetentionSettings()
    tokens: TokenSettings = TokenSettings()
    scopes: dict[str, ScopeSettings] = Field(default_factory=lambda: {"default": DEFAULT_SCOPE})
    # Completion webhooks (``[[webhooks]]``); a restored copy has none.
    webhooks: list[WebhookSettings] = Field(default_factory=list, max_length=32)

    @field_validator("webhooks")
    @classmethod
    def _webhooks(cls, value: list[WebhookSettings]) -> list[WebhookSettings]:
        names = [w.endpoint for w in value]
        if len(set(names)) != len(names):
            raise ValueError("webhook endpoints need distinct names (and URLs, unnamed)")
        return value

    @field_validator("scopes")
    @classmethod
    def _scopes(cls, value: dict[str, ScopeSettings]) -> dict[str, ScopeSettings]:
        for name in value:
            if not name or name.startswith("~") or len(name) > 128:
                raise ValueError("scope names are 1-128 characters, not starting with '~'")
        return {"default": DEFAULT_SCOPE, **value}


# --- Loading ------------------------------------------------------------------------


@functools.cache
def _environment_source() -> Callable[[Mapping[str, str]], EnvSettingsSource]:
    """pydantic-settings' environment source (prefix, nesting, JSON values) for
    ``Config``. Built on first use: pydantic-settings loads asyncio and argparse,
    ~0.1 s that a process using only the storage layer's ``ScopeSettings`` skips."""
    from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

    class EnvironmentSchema(BaseSettings, Config):
        """``Config``'s fields as pydantic-settings reads them from the environment.

        Only a template for the source, never instantiated: ``Config`` itself stays a
        plain model, so one built in code (``Config(...)``, the ``config`` given to
        ``Keyshred.open``, a backup's settings) means exactly what it says and never
        picks up a variable of whatever process it runs in."""

        model_config = SettingsConfigDict(
            env_prefix=ENV_PREFIX, env_nested_delimiter=_NESTED, case_sensitive=False
        )

    class MappingEnvSource(EnvSettingsSource):
        """The environment source reading a given mapping instead of ``os.environ``."""

        def __init__(self, env: Mapping[str, str]) -> None:
            self._env = env  # before super().__init__, which loads the variables
            super().__init__(EnvironmentSchema)

        def _load_env_vars(self) -> Mapping[str, str | None]:
            # Case-insensitive, as pydantic-settings reads os.environ.
            return {name.lower(): value for name, value in self._env.items()}

    return MappingEnvSource


def _is_model(annotation: Any) -> TypeGuard[type[BaseModel]]:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _is_complex(annotation: Any) -> bool:
    """A setting whose environment value is JSON (a section, a table, a list)."""
    return _is_model(annotation) or get_origin(annotation) in (dict, list)


def _annotation_at(path: Sequence[str]) -> Any:
    """The type of the setting at ``path`` (``("kek", "vault", "url")``), or None."""
    node: Any = Config
    for part in path:
        if _is_model(node):
            field = node.model_fields.get(part)
            if field is None:
                return None
            node = field.annotation
        elif get_origin(node) is dict:
            node = get_args(node)[1]
        else:
            return None
    return node


def _merge(base: Any, over: Any, annotation: Any) -> Any:
    """``over`` on top of ``base``. Sections (models) and the scopes (a table of
    models) merge key by key; any other value (a number, a string, a list, a table
    such as ``backup.retention``) replaces the lower one whole, so that
    ``KEYSHRED_BACKUP__RETENTION='{"daily": 3}'`` means exactly one class."""
    if not (isinstance(base, dict) and isinstance(over, dict)):
        return over
    if _is_model(annotation):
        fields = annotation.model_fields
        children = {name: field.annotation for name, field in fields.items()}
    elif get_origin(annotation) is dict and _is_model(get_args(annotation)[1]):
        children = {name: get_args(annotation)[1] for name in over}
    else:
        return over
    merged = dict(base)
    for key, value in over.items():
        merged[key] = _merge(merged[key], value, children.get(key)) if key in merged else value
    return merged


def _setting_variables(env: Mapping[str, str]) -> dict[tuple[str, ...], str]:
    """The variables that name a setting: their path (lower case) -> their name."""
    found: dict[tuple[str, ...], str] = {}
    for name in env:
        if name.upper().startswith(ENV_PREFIX):
            path = tuple(name[len(ENV_PREFIX) :].lower().split(_NESTED))
            if path[0] in Config.model_fields:
                found[path] = name
    return found


def _read_environment(env: Mapping[str, str]) -> dict[str, Any]:
    from pydantic_settings import SettingsError

    try:
        return _environment_source()(env)()
    except SettingsError:
        # A JSON value that does not parse; name the variable, never its value.
        for path, name in _setting_variables(env).items():
            if _is_complex(_annotation_at(path)):
                try:
                    json.loads(env[name])
                except ValueError:
                    raise ConfigError(
                        f"{name} is not valid JSON (the setting {'.'.join(path)} takes a "
                        "JSON value)"
                    ) from None
        raise ConfigError("a KEYSHRED_ environment variable could not be read") from None


def _read_file(file: Path) -> dict[str, Any]:
    try:
        text = file.read_text("utf-8")
    except (FileNotFoundError, NotADirectoryError):
        # No file (or no folder: ``keyshred init`` on a path that cannot be one
        # says so itself).
        return {}
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{file} is not valid TOML: {exc.reason}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {file}: {exc.strerror or type(exc).__name__}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{file} is not valid TOML: {exc}") from None


def _depth(doc: Any, loc: Sequence[str]) -> int:
    """How many leading parts of ``loc`` the nested dict ``doc`` holds."""
    depth = 0
    for part in loc:
        if not isinstance(doc, dict) or part not in doc:
            break
        doc, depth = doc[part], depth + 1
    return depth


def _describe(
    exc: ValidationError,
    file: Path,
    doc: dict[str, Any],
    env: Mapping[str, str],
    overrides: Mapping[str, Any],
) -> str:
    """Every error as ``setting: what is wrong (where it was set)``. Never the value
    (``input``): a setting may be a URL with a password in it."""
    variables = _setting_variables(env)
    parts = []
    for error in exc.errors():
        loc = [str(p) for p in error["loc"]]
        # The source that set the deepest part of this setting; ties go to the
        # higher-precedence source, the one whose value was used.
        candidates: list[tuple[int, str]] = [(_depth(dict(overrides), loc), "an argument")]
        for path, name in variables.items():
            common = 0
            while common < min(len(path), len(loc)) and path[common] == loc[common]:
                common += 1
            candidates.append((common, name))
        candidates.append((_depth(doc, loc), str(file)))
        depth, origin = max(candidates, key=lambda c: c[0])
        where = f" (from {origin})" if depth else ""
        parts.append(f"{'.'.join(loc) or 'configuration'}: {error['msg']}{where}")
    return "invalid setting " + "; ".join(parts)


def load_config(
    path: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """The configuration of the folder ``path``: ``overrides`` (nested dicts, e.g.
    ``{"kek": {"provider": "vault"}}``) over the environment (``env``, default
    ``os.environ``) over ``<path>/keyshred.toml`` (a missing file: none) over the
    defaults. Anything invalid is a ``ConfigError`` naming the setting and where it
    was set, never its value."""
    file = Path(path) / CONFIG_FILE
    doc = _read_file(file)
    environ = os.environ if env is None else env
    given = dict(overrides or {})
    merged = _merge(_merge(doc, _read_environment(environ), Config), given, Config)
    try:
        return Config.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, file, doc, environ, given)) from None


# --- Writing ------------------------------------------------------------------------

_HEADER = "# keyshred configuration; every setting is listed in the README.\n"


def _without_none(value: Any) -> Any:
    """TOML has no null: an unset optional setting is left out (its default). A
    webhook's inline secret is written as given (the file is the owner's only):
    its operator put it in the configuration."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    return value


def save_config(path: str | os.PathLike[str], config: Config) -> Path:
    """Write ``<path>/keyshred.toml``: every setting (no secret is a setting but a
    webhook's inline ``secret``, which the configuration given holds already).

    Written to a temporary file and renamed over the old one, so a crash leaves one
    of the two whole; readable by the owner only, as a URL setting may hold a
    database password."""
    text = _HEADER + tomli_w.dumps(_without_none(config.model_dump(mode="python")))
    file = Path(path) / CONFIG_FILE
    tmp = file.with_name(f".{CONFIG_FILE}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, file)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return file
