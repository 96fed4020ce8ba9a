"""The API's operations as data: method, path, roles, bodies, handler.

Every route is one ``Operation``; the app (``keyshred.api.app``) serves them all the
same way (authenticate, rate limit, check the role, parse the body, idempotency,
run the handler in a thread, audit, answer), and the OpenAPI document
(``keyshred.api.openapi``) is built from the same list, so the two cannot drift.
Handlers are plain synchronous functions of a ``Call``: keyshred's calls block on
the catalog database.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from keyshred.api.auth import Principal
from keyshred.api.identity import IdentityHook
from keyshred.api.settings import ApiSettings, Role

if TYPE_CHECKING:
    from keyshred.api.access import Downloads
    from keyshred.facade import Keyshred

__all__ = ["Call", "Handler", "Operation", "Reply", "Services"]


@dataclass(frozen=True, slots=True)
class Services:
    """What handlers use: the open store and the API's own parts."""

    ks: Keyshred
    settings: ApiSettings
    identity: IdentityHook
    downloads: Downloads


@dataclass(frozen=True, slots=True)
class Call:
    services: Services
    principal: Principal
    body: Any  # the operation's body model, parsed (None without one)
    params: Mapping[str, str]
    query: Mapping[str, list[str]]

    @property
    def ks(self) -> Keyshred:
        return self.services.ks


@dataclass(slots=True)
class Reply:
    """A handler's answer: JSON (``body``) or bytes (``content``)."""

    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    content: bytes | None = None
    media_type: str = "application/json"
    # What the call is about, for its audit event (an erasure request, a hold ...).
    request_id: str | None = None


Handler = Callable[[Call], Reply]


@dataclass(frozen=True, slots=True)
class Operation:
    method: str
    path: str
    name: str  # the operationId and the audit event's action
    summary: str
    roles: frozenset[Role]
    handler: Handler
    status: int = 200
    body: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    errors: tuple[int, ...] = ()
    query: tuple[tuple[str, str], ...] = ()  # (name, description)
    media_type: str = "application/json"
    tag: str = "erasure"
