"""An identity-verification hook a deployment might configure (the tests name it
in the API settings): a requester's request goes ahead only for subjects in a
tenant it vouches for, stating its method."""

from __future__ import annotations

from keyshred.api.auth import Principal
from keyshred.api.identity import Decision
from keyshred.ids import Subject


def tenant_checked(principal: Principal, subject: Subject, action: str) -> Decision:
    if subject.tenant == "verified-tenant":
        return Decision(True, "document-check", f"{action}-by-hook")
    return Decision(False, "document-check")
