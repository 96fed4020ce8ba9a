"""What a token row is made of: the token's form, its kind's name, the sealed value
(bound to its place: subject, scope and the token itself), the ``Sanitized`` result,
and the checks of the vault's arguments. ``keyshred.vault.tokens`` builds rows from
these; ``keyshred.residue`` opens sealed values with ``place_template``."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from keyshred._validate import check_text
from keyshred.errors import InvalidInput
from keyshred.keyring.datakey import DataKey
from keyshred.keyring.envelope import PlaceTemplate
from keyshred.vault.detect import KINDS
from keyshred.vault.schema import TOKEN_COLUMNS

__all__ = [
    "KIND_NAMES",
    "TOKEN_RE",
    "MentionValue",
    "Sanitized",
    "check_purpose",
    "check_resolve",
    "kind_name",
    "place_template",
    "sanitized",
    "seal_values",
    "span_start",
]


@dataclass(frozen=True, slots=True)
class MentionValue:
    """A token's value as the mention finder reads an item (``scope=None``: no
    declared scope, always looked up)."""

    value: str
    scope: None = None
    namespace: tuple[str, ...] = ()
    key: str = ""


TOKEN_RE = re.compile(r"<([A-Z][A-Z0-9_]{0,30})_([0-9a-f]{10})>")
PURPOSE = re.compile(r"[A-Za-z0-9._:/-]{1,128}")
# ``TokenVault._sanitize`` builds token rows as tuples in the table's column order.
_ROW = (
    "number",
    "token",
    "subject_ref",
    "scope",
    "kind",
    "purpose",
    "deterministic",
    "lookup",
    "created_at",
    "expires_at",
    "value",
)
if _ROW != TOKEN_COLUMNS:  # pragma: no cover - a schema edit
    raise ImportError("keyshred.vault.rows does not match the ks_tokens columns")


@functools.lru_cache(maxsize=1024)
def kind_name(kind: str) -> str:
    """A finding's kind as it appears in a token (``<PHONE_…>``)."""
    return re.sub(r"[^A-Z0-9_]", "_", kind.upper())[:30] or "PII"


def span_start(span: tuple[Any, ...]) -> int:
    return int(span[2])


KIND_NAMES = {kind: kind for kind in KINDS}  # the default kinds are token-ready


@functools.lru_cache(maxsize=4096)
def place_template(subject_ref: str, scope: str) -> PlaceTemplate:
    return PlaceTemplate(subject_ref, scope, "tokens", "value")


def seal_values(
    key: DataKey,
    keys: list[DataKey] | None,
    items: list[tuple[str, bytes]],
    template: PlaceTemplate,
) -> list[bytes]:
    """Seal ``items`` under ``key``, or each under its own of ``keys`` (one
    ``seal_rows`` per key, results in the items' order)."""
    if keys is None:
        return key.seal_rows(items, template)
    groups: dict[bytes, tuple[DataKey, list[int]]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k.key_id, (k, []))[1].append(i)
    out: list[bytes] = [b""] * len(items)
    for k, at in groups.values():
        for i, ct in zip(at, k.seal_rows([items[i] for i in at], template), strict=True):
            out[i] = ct
    return out


class Sanitized(NamedTuple):
    """The sanitized text and the tokens it carries (never the values)."""

    text: str
    tokens: tuple[str, ...]

    def __repr__(self) -> str:
        return f"Sanitized(tokens={len(self.tokens)})"


def sanitized(fields: tuple[str, tuple[str, ...]]) -> Sanitized:
    # Without the named tuple's Python-level __new__ (one per sanitized text).
    return tuple.__new__(Sanitized, fields)


def check_resolve(text: Any, purpose: Any) -> None:
    """``detokenize``/``restore`` arguments: a token or a text, and a purpose (one
    that matches no token is refused and audited later, like any mismatch)."""
    check_text(text, "a token or text")
    check_text(purpose, "a purpose")


def check_purpose(purpose: str) -> str:
    if not isinstance(purpose, str) or not PURPOSE.fullmatch(purpose):
        raise InvalidInput("a purpose is 1-128 characters of letters, digits and ._:/-")
    return purpose
