"""The JSON bodies of the HTTP API (pydantic models; the OpenAPI schemas are theirs).

Subjects travel only in request bodies (``subject``, with an optional ``tenant``);
every response names them by ``subject_ref``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "AccessRequestCreate",
    "AccessRequestView",
    "AuditEventView",
    "AuditEventsView",
    "AuditVerifyView",
    "ConsentGrant",
    "ConsentView",
    "ConsentWithdraw",
    "ErasureRequestCreate",
    "ErasureRequestList",
    "ErasureRequestView",
    "HealthView",
    "HoldCreate",
    "HoldList",
    "HoldQuery",
    "HoldView",
    "ReceiptView",
]

ConsentAction = Literal["store", "use", "share", "train"]


def _default_actions() -> list[ConsentAction]:
    return ["store", "use"]


_TEXT = r"^[A-Za-z0-9 ._:@/+()#,-]{1,128}$"
# A declared scope (``[scopes]``): never one of keyshred's internal key scopes ("~…").
_SCOPE = r"^[^~]"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def __repr__(self) -> str:  # a body names a subject: never print its fields
        return f"{type(self).__name__}(<redacted>)"

    __str__ = __repr__


class _SubjectBody(_Body):
    subject: str = Field(min_length=1, max_length=512, description="The subject id.")
    tenant: str | None = Field(
        default=None, min_length=1, max_length=256, description="Default: the store's tenant."
    )


def _example(**fields: Any) -> ConfigDict:
    """A body's documented example (the OpenAPI ``examples``, which schemathesis
    sends too): placeholders, never anyone's data."""
    return ConfigDict(json_schema_extra={"examples": [{"subject": "alice@example.com", **fields}]})


class ErasureRequestCreate(_SubjectBody):
    model_config = _example(reason="gdpr-art17")

    scope: str | None = Field(
        default=None, max_length=128, pattern=_SCOPE, description="Only this scope."
    )
    reason: str = Field(pattern=_TEXT, description="Why, as a short code (gdpr-art17).")
    block: bool = Field(default=False, description="Keep the id erased even if nothing is found.")


class HoldCreate(_SubjectBody):
    model_config = _example(reason="case-4711")

    scope: str | None = Field(default=None, max_length=128, pattern=_SCOPE)
    reason: str = Field(pattern=_TEXT)


class HoldQuery(_SubjectBody):
    model_config = _example()

    scope: str | None = Field(default=None, max_length=128, pattern=_SCOPE)


class ConsentGrant(_SubjectBody):
    model_config = _example(scope="marketing/email", actions=["store", "use"])

    scope: str = Field(max_length=128, pattern=_SCOPE)
    category: str | None = Field(default=None, max_length=128)
    actions: list[ConsentAction] = Field(default_factory=_default_actions, min_length=1)
    end_at: datetime | None = None
    policy_version: str = Field(default="1", pattern=_TEXT)


class ConsentWithdraw(_SubjectBody):
    model_config = _example(scope="marketing/email")

    scope: str = Field(max_length=128, pattern=_SCOPE)
    category: str | None = Field(default=None, max_length=128)


class AccessRequestCreate(_SubjectBody):
    """Seal the package to exactly one of a passphrase and an X25519 public key."""

    # The documented example's placeholder, not a credential of anything.
    model_config = _example(passphrase="<8 or more characters>")  # noqa: S106

    passphrase: str | None = Field(default=None, min_length=8, max_length=1024)
    recipient_public_key: str | None = Field(default=None, max_length=256)

    def __repr__(self) -> str:
        return "AccessRequestCreate(<redacted>)"


class ErasureRequestView(BaseModel):
    request_id: str
    subject_ref: str
    scope: str | None
    kind: str
    state: str
    requested_by: str
    reason: str
    created_at: datetime
    updated_at: datetime
    attempts: int
    steps_done: list[str]
    step_times: dict[str, str] = Field(description="When each step done was recorded.")
    step: str | None = Field(description="The step it is at (None once completed).")
    error: str | None = Field(description="The last failure: the step and its class.")
    error_class: str | None = Field(description="The exception class of the last failure.")
    found_data: bool | None
    identity: dict[str, str] | None
    receipt_available: bool


class ErasureRequestList(BaseModel):
    requests: list[ErasureRequestView]


class ReceiptView(BaseModel):
    request_id: str
    form: Literal["jws", "json", "unsigned"]
    jws: str | None = Field(description="The compact JWS as issued (None: the older JSON form).")
    receipt: dict[str, Any] = Field(description="The receipt's fields (its JWS payload).")
    kid: str | None


class HoldView(BaseModel):
    hold_id: str
    subject_ref: str
    scope: str | None
    reason: str
    owner: str
    placed_at: datetime
    released_at: datetime | None


class HoldList(BaseModel):
    holds: list[HoldView]


class ConsentView(BaseModel):
    subject_ref: str
    purpose: str
    category: str
    actions: list[str]
    status: str
    policy_version: str
    start_at: datetime | None
    end_at: datetime | None


class AccessRequestView(BaseModel):
    export_id: str
    subject_ref: str
    expires_at: datetime
    counts: dict[str, int]
    download: str = Field(description="Where to GET the package, once.")


class AuditEventView(BaseModel):
    seq: int
    at: datetime
    event: str
    subject_ref: str | None
    request_id: str | None
    data: dict[str, Any]
    hash: str


class AuditEventsView(BaseModel):
    events: list[AuditEventView]


class AuditVerifyView(BaseModel):
    intact: bool
    events_checked: int
    detail: str | None


class HealthView(BaseModel):
    status: Literal["ok", "unavailable"]
    components: dict[str, str] = Field(default_factory=dict)
