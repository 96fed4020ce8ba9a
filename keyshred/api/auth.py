"""Who is calling: Bearer tokens, as static API keys or OIDC JWTs.

- **API keys** (machines): the presented key's SHA-256 is compared with every
  configured hash in constant time (``hmac.compare_digest``, all of them, so the
  time says nothing of which matched); the actor is ``key:<name>``.
- **JWTs** (people, through the deployment's identity provider): verified by PyJWT
  against the configured JWKS (signature, ``iss``, ``aud``, ``exp``; the algorithms
  listed in the settings only, never ``none``). The actor is ``oidc:`` and a hash of
  ``iss`` and ``sub``: a ``sub`` may be an e-mail address, personal data that must
  not reach the audit log, while the hash still names one person consistently.

A token of three dot-separated parts is taken for a JWT when an identity provider is
configured (API keys are made without dots: ``secrets.token_urlsafe``). Anything
else (no header, another scheme, a bad or expired token) is ``Unauthenticated``
(401); the reason given never repeats the token.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keyshred._extras import require
from keyshred.api.settings import ROLES, ApiSettings, OidcSettings, Role
from keyshred.errors import ConfigError, KeyshredError

__all__ = ["Authenticator", "Principal", "Unauthenticated"]


class Unauthenticated(KeyshredError):
    """No valid credential: the call is answered 401."""


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller. ``actor`` is plain metadata (audit events,
    ``requested_by``); ``credential`` identifies the token for rate limiting."""

    actor: str
    role: Role
    verified: bool
    credential: str


class Authenticator:
    """Turns an ``Authorization`` header into a ``Principal``."""

    def __init__(self, settings: ApiSettings) -> None:
        self._keys = [(bytes.fromhex(k.sha256), k) for k in settings.api_keys]
        self._oidc = settings.oidc
        self._jwks: Any = None
        if self._oidc is not None:
            self._jwks = _jwks_source(self._oidc)

    def authenticate(self, header: str | None) -> Principal:
        if not header:
            raise Unauthenticated("a Bearer token is required")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("the Authorization header is 'Bearer <token>'")
        if token.count(".") == 2 and self._oidc is not None:
            return self._jwt(token)
        return self._api_key(token)

    def _api_key(self, token: str) -> Principal:
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        found = None
        for expected, key in self._keys:
            if hmac.compare_digest(digest, expected) and found is None:
                found = key
        if found is None:
            raise Unauthenticated("the token is not valid")
        return Principal(f"key:{found.name}", found.role, found.verified, f"key:{found.name}")

    def _jwt(self, token: str) -> Principal:
        jwt = require("jwt", extra="api", package="pyjwt")
        oidc = self._oidc
        if oidc is None:
            raise Unauthenticated("no identity provider is configured")
        try:
            key = self._jwks.get_signing_key_from_jwt(token)
            claims = jwt.decode(
                token,
                key.key,
                algorithms=oidc.algorithms,
                audience=oidc.audience,
                issuer=oidc.issuer,
                leeway=oidc.leeway_seconds,
                options={"require": ["exp", "iss", "aud", "sub"]},
            )
        except jwt.exceptions.PyJWKClientConnectionError:
            raise Unauthenticated("the identity provider's keys cannot be fetched") from None
        except (jwt.exceptions.PyJWTError, ValueError, TypeError, KeyError):
            raise Unauthenticated("the token is not valid") from None
        role = _role(claims.get(oidc.roles_claim))
        if role is None:
            raise Unauthenticated("the token grants no keyshred role")
        sub = str(claims["sub"])
        who = hashlib.sha256(f"{oidc.issuer}\x00{sub}".encode()).hexdigest()[:24]
        verified = claims.get(oidc.verified_claim) is True
        return Principal(f"oidc:{who}", role, verified, f"oidc:{who}")


def _role(value: Any) -> Role | None:
    values = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    for role in ROLES:
        if role in values:
            return role
    return None


class _FileJwks:
    """A JWKS read from a file once (PyJWKClient's interface for what we use)."""

    def __init__(self, path: str) -> None:
        jwt = require("jwt", extra="api", package="pyjwt")
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            self._set = jwt.PyJWKSet.from_dict(data)
        except (OSError, ValueError, jwt.exceptions.PyJWTError):
            raise ConfigError(f"oidc.jwks_file {path} is not a readable JWKS") from None

    def get_signing_key_from_jwt(self, token: str) -> Any:
        jwt = require("jwt", extra="api", package="pyjwt")
        kid = jwt.get_unverified_header(token).get("kid")
        for key in self._set.keys:
            if kid is None or key.key_id == kid:
                return key
        raise jwt.exceptions.PyJWKClientError("no key of that kid")


def _jwks_source(oidc: OidcSettings) -> Any:
    if (oidc.jwks_url is None) == (oidc.jwks_file is None):
        raise ConfigError("oidc needs exactly one of jwks_url and jwks_file")
    if oidc.jwks_file is not None:
        return _FileJwks(oidc.jwks_file)
    jwt = require("jwt", extra="api", package="pyjwt")
    return jwt.PyJWKClient(oidc.jwks_url, cache_keys=True, lifespan=300, timeout=5)
