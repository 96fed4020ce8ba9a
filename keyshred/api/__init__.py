"""``keyshred.api``: the key-destruction HTTP API (``keyshred[api]``).

An ASGI app (Starlette) that records erasure, consent and access requests and
reports them, with their signed receipts; workers run the requests. Build it with
``create_app(path_or_handle, settings)``; ``keyshred serve`` runs it under uvicorn.

- ``settings``: ``ApiSettings`` (credentials, OIDC, rate limits, the identity hook);
- ``auth``: Bearer API keys (stored as SHA-256) and OIDC JWTs; ``Principal``;
- ``identity``: the identity-verification hook and its ``Decision``;
- ``operations``: the routes as data; ``erasure``, ``holds``, ``consent``,
  ``access``, ``chain`` (audit) hold the handlers;
- ``idempotency``, ``ratelimit``, ``problems``, ``health``, ``openapi``: one job each;
- ``app``: the Starlette app; ``server``: uvicorn.

The names load on first use, so importing this package needs no extra until an app
is built (then ``MissingExtraError`` names ``keyshred[api]``).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keyshred.api.app import create_app
    from keyshred.api.auth import Principal
    from keyshred.api.identity import Decision, default_hook
    from keyshred.api.settings import (
        ApiKey,
        ApiSettings,
        OidcSettings,
        RateLimitSettings,
        load_settings,
    )

__all__ = [
    "ApiKey",
    "ApiSettings",
    "Decision",
    "OidcSettings",
    "Principal",
    "RateLimitSettings",
    "create_app",
    "default_hook",
    "load_settings",
]

_LAZY = {
    "create_app": "keyshred.api.app",
    "Principal": "keyshred.api.auth",
    "Decision": "keyshred.api.identity",
    "default_hook": "keyshred.api.identity",
    "ApiKey": "keyshred.api.settings",
    "ApiSettings": "keyshred.api.settings",
    "OidcSettings": "keyshred.api.settings",
    "RateLimitSettings": "keyshred.api.settings",
    "load_settings": "keyshred.api.settings",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
