"""The identity-verification hook: may a request for this subject go ahead?

Erasure requests from end users must prove who they are. The deployment names a
function (``identity_hook = "module:function"`` in the API settings) that is asked
before an erasure, a consent withdrawal, an access request or a consent grant is
recorded. It receives the caller and the action (never needing the subject's data)
and returns a ``Decision``; a refusal is a 403. The decision's ``metadata()`` is kept
in the erasure request and stated in its receipt, so it must be plain metadata
(letters, digits and ``._:@/+()#,-``), never the evidence itself.

The default (``default_hook``): an operator is trusted (``operator-attested``); a
requester must carry the verified flag (its API key's ``verified = true``, or the
JWT's ``verified_claim``); an auditor never files requests.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from keyshred.api.auth import Principal
from keyshred.errors import ConfigError
from keyshred.ids import Subject

__all__ = ["Decision", "IdentityHook", "default_hook", "load_hook"]


@dataclass(frozen=True, slots=True)
class Decision:
    """The hook's answer: whether to go ahead and how identity was established."""

    allowed: bool
    method: str
    detail: str = "none"

    def metadata(self, actor: str) -> dict[str, str]:
        return {
            "decision": "allowed" if self.allowed else "refused",
            "method": self.method,
            "detail": self.detail,
            "decided_for": actor,
        }


IdentityHook = Callable[[Principal, Subject, str], Decision]
"""``hook(principal, subject, action) -> Decision``; ``action`` is the operation
(``erasure.create``, ``consent.withdraw``, ``access.create``, ``consent.grant``)."""


def default_hook(principal: Principal, subject: Subject, action: str) -> Decision:
    del subject, action  # the default judges the caller only
    if principal.role == "operator":
        return Decision(True, "operator-attested")
    if principal.role == "requester" and principal.verified:
        return Decision(True, "requester-verified")
    return Decision(False, "unverified", "the caller's identity flag is not set")


def load_hook(path: str) -> IdentityHook:
    """The function ``module:function`` names (``ConfigError`` if there is none)."""
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ConfigError("identity_hook is 'module:function'")
    try:
        found: Any = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise ConfigError(f"identity_hook {path} cannot be imported") from None
    if not callable(found):
        raise ConfigError(f"identity_hook {path} is not callable")
    hook: IdentityHook = found
    return hook
