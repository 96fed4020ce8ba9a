"""The HTTP API's settings: credentials, roles, the identity hook, rate limits.

Kept in a TOML file of their own (``keyshred serve --api-config FILE``), apart from
the data folder's ``keyshred.toml``: they hold credential hashes and the identity
provider, which are the deployment's, not the store's. A static API key is never
stored, only its SHA-256 (hex); ``keyshred serve`` compares in constant time::

    [[api_keys]]
    name = "privacy-tool"          # the actor its calls are recorded as: key:privacy-tool
    sha256 = "9f86d08…"            # sha256 of the key (printf %s KEY | sha256sum)
    role = "requester"             # requester, operator or auditor
    verified = true                # it verifies the people it asks for (identity hook)

    [oidc]
    issuer = "https://idp.example"
    audience = "keyshred"
    jwks_url = "https://idp.example/.well-known/jwks.json"   # or jwks_file = "…"
    roles_claim = "keyshred_roles"
    verified_claim = "identity_verified"
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from keyshred.errors import ConfigError

__all__ = [
    "ROLES",
    "ApiKey",
    "ApiSettings",
    "OidcSettings",
    "RateLimitSettings",
    "Role",
    "load_settings",
]

Role = Literal["requester", "operator", "auditor"]
ROLES: tuple[Role, ...] = ("requester", "operator", "auditor")
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ApiKey(_Model):
    """A machine's static API key: its name (the actor ``key:<name>``), the SHA-256
    of the key in hex (the key itself is never configured), its role, and whether
    the caller verifies the identity of the people it files requests for."""

    name: str
    sha256: str
    role: Role
    verified: bool = False

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME.fullmatch(value):
            raise ValueError("an API key's name is 1-64 of A-Z a-z 0-9 . _ -")
        return value

    @field_validator("sha256")
    @classmethod
    def _hash(cls, value: str) -> str:
        value = value.lower()
        if not _HEX64.fullmatch(value):
            raise ValueError("sha256 is the key's SHA-256 digest in hex (64 characters)")
        return value

    def __repr__(self) -> str:
        return f"ApiKey(name={self.name!r}, role={self.role!r})"


class OidcSettings(_Model):
    """Bearer JWTs of an identity provider, verified against its JWKS (a URL,
    fetched and cached, or a file). The token's role is the first of
    ``roles_claim``'s values that is a keyshred role; ``verified_claim`` true says
    the person was identified (the identity hook's input)."""

    issuer: str
    audience: str
    jwks_url: str | None = None
    jwks_file: str | None = None
    algorithms: list[str] = Field(default_factory=lambda: ["EdDSA", "RS256", "ES256"])
    roles_claim: str = "keyshred_roles"
    verified_claim: str = "identity_verified"
    leeway_seconds: int = Field(default=30, ge=0, le=300)


class RateLimitSettings(_Model):
    """A token bucket per credential: ``burst`` calls at once, refilled at
    ``per_second``. In this process only (each uvicorn worker has its own)."""

    per_second: float = Field(default=20.0, gt=0)
    burst: int = Field(default=40, ge=1)


class ApiSettings(_Model):
    """Everything ``keyshred.api.create_app`` needs besides the data folder."""

    api_keys: list[ApiKey] = Field(default_factory=list)
    oidc: OidcSettings | None = None
    rate_limit: RateLimitSettings = Field(default_factory=RateLimitSettings)
    # "module:function" deciding whether a request for a subject may go ahead
    # (keyshred.api.identity); the default allows operators and verified requesters.
    identity_hook: str = "keyshred.api.identity:default_hook"
    # How long an Idempotency-Key's record (and its response) is kept.
    idempotency_hours: int = Field(default=24, ge=1, le=24 * 30)
    # An access request's package: downloadable once, within this many hours.
    export_hours: int = Field(default=24, ge=1, le=24 * 30)
    # Largest request body accepted (bytes).
    max_body_bytes: int = Field(default=64 * 1024, ge=1024, le=16 * 1024 * 1024)


def load_settings(path: str | os.PathLike[str] | None) -> ApiSettings:
    """The settings in the TOML file at ``path`` (None: the defaults: no credential,
    every /v1 call is refused with 401). Errors name the setting, never a value."""
    if path is None:
        return ApiSettings()
    file = Path(path)
    try:
        data = tomllib.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read the API settings {file}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        raise ConfigError(f"the API settings {file} are not valid TOML") from None
    try:
        return ApiSettings.model_validate(data)
    except ValidationError as exc:
        where = "; ".join(
            ".".join(str(p) for p in e["loc"]) + ": " + e["msg"] for e in exc.errors()
        )
        raise ConfigError(f"the API settings {file} are invalid: {where}") from None
