"""``ks.consent``: consent records per (subject, purpose, category), with history."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from keyshred.errors import InvalidInput
from keyshred.storage.catalog import Catalog, ConsentRecord
from keyshred.storage.policy import Policy

__all__ = ["ConsentApi"]


class ConsentApi:
    def __init__(self, catalog: Catalog, policy: Policy, subject_ref: Callable[[Any], str]) -> None:
        self._catalog = catalog
        self._policy = policy
        self._ref = subject_ref

    def _target(self, scope: str, category: str | None) -> tuple[str, str]:
        _, purpose, category = self._policy.resolve(scope, None, category)
        return purpose, category

    def grant(
        self,
        subject: Any,
        *,
        scope: str,
        category: str | None = None,
        actions: Sequence[str] = ("store", "use"),
        start_at: datetime | None = None,
        end_at: datetime | None = None,
        policy_version: str = "1",
    ) -> ConsentRecord:
        """Record consent for the scope's purpose and one of its categories."""
        purpose, category = self._target(scope, category)
        unknown = set(actions) - {"store", "use", "share", "train"}
        if unknown:
            raise InvalidInput(f"unknown consent actions {sorted(unknown)}")
        return self._catalog.grant_consent(
            self._ref(subject),
            purpose,
            category,
            actions=actions,
            start_at=start_at,
            end_at=end_at,
            policy_version=policy_version,
        )

    def revoke(self, subject: Any, *, scope: str, category: str | None = None) -> int:
        """Revoke: new writes for that purpose and category fail from now on."""
        purpose, category = self._target(scope, category)
        return self._catalog.revoke_consent(self._ref(subject), purpose, category)

    def list(self, subject: Any) -> list[ConsentRecord]:
        return self._catalog.consents(self._ref(subject))
