"""Scopes and retention: what a write may carry and how long it may live.

``retain_until`` is never taken from a caller: it is the minimum of the purpose end,
the consent end, now + the scope's policy maximum (or the store's default maximum)
and now + the scope's legal maximum.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from keyshred.config import ScopeSettings
from keyshred.errors import InvalidInput, UnknownScope

__all__ = ["INDEX_SCOPE", "Policy", "ScopeRule"]

INDEX_SCOPE = "~index"
"""Reserved key scope whose DEK keys a subject's lookup hashes (namespace, key)."""


@dataclass(frozen=True, slots=True)
class ScopeRule:
    name: str
    purpose: str
    categories: tuple[str, ...]
    basis: str
    max_retention: timedelta
    purpose_end: datetime | None
    legal_max: timedelta | None
    detect_mentions: bool = True

    @property
    def needs_consent(self) -> bool:
        return self.basis == "consent"


class Policy:
    """The declared scopes, with defaults resolved."""

    def __init__(self, scopes: Mapping[str, ScopeSettings], default_max_days: int) -> None:
        self._rules = {
            name: ScopeRule(
                name=name,
                purpose=s.purpose,
                categories=tuple(s.categories),
                basis=s.basis,
                max_retention=timedelta(days=s.max_retention_days or default_max_days),
                purpose_end=(
                    None
                    if s.purpose_end is None
                    else (
                        s.purpose_end.replace(tzinfo=UTC)
                        if s.purpose_end.tzinfo is None
                        else s.purpose_end.astimezone(UTC)
                    )
                ),
                legal_max=None if s.legal_max_days is None else timedelta(days=s.legal_max_days),
                detect_mentions=s.detect_mentions,
            )
            for name, s in scopes.items()
        }

    def scope(self, name: str) -> ScopeRule:
        if not isinstance(name, str):
            raise InvalidInput("a scope is a name (a string)")
        rule = self._rules.get(name)
        if rule is None:
            raise UnknownScope(f"scope {name!r} is not declared in the configuration")
        return rule

    def resolve(
        self, scope: str, purpose: str | None, category: str | None
    ) -> tuple[ScopeRule, str, str]:
        """Check (scope, purpose, category) against the declaration; fill defaults."""
        rule = self.scope(scope)
        purpose = rule.purpose if purpose is None else purpose
        category = rule.categories[0] if category is None else category
        if purpose != rule.purpose:
            raise InvalidInput(f"scope {scope!r} is for purpose {rule.purpose!r}, not {purpose!r}")
        if category not in rule.categories:
            raise InvalidInput(f"category {category!r} is not in scope {scope!r}")
        return rule, purpose, category

    def retain_until(
        self, rule: ScopeRule, now: datetime, consent_end: datetime | None
    ) -> datetime:
        candidates = [now + rule.max_retention]
        if rule.purpose_end is not None:
            candidates.append(rule.purpose_end)
        if consent_end is not None:
            candidates.append(consent_end)
        if rule.legal_max is not None:
            candidates.append(now + rule.legal_max)
        return min(candidates)

    @property
    def names(self) -> list[str]:
        return sorted(self._rules)
