"""Checks of caller input at the public API boundary, shared by every component.

Each check either returns its argument (so it reads inline) or raises
``InvalidInput``/``ValueTooLarge`` with a message that names what was expected,
never the value itself (it may be personal data).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from keyshred.errors import InvalidInput, ValueTooLarge

__all__ = [
    "DEFAULT_MAX_DEPTH",
    "check_count",
    "check_depth",
    "check_filter",
    "check_index",
    "check_text",
    "check_text_size",
]

# Deep enough for any document an agent stores; far below the interpreter's
# recursion limit, which json.dumps/loads would hit first.
DEFAULT_MAX_DEPTH = 100


def check_text(value: Any, what: str) -> str:
    """``value`` if it is a ``str`` that UTF-8 can encode (no lone surrogates)."""
    if not isinstance(value, str):
        raise InvalidInput(f"{what} is a string")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidInput(f"{what} is valid Unicode text (no lone surrogates)") from None
    return value


def check_text_size(text: str, limit: int, setting: str) -> str:
    """``text`` if its UTF-8 form is at most ``limit`` bytes (``setting`` names the limit)."""
    # A character is at most 4 bytes: most texts are decided without encoding.
    if len(text) * 4 > limit and len(text.encode("utf-8", "surrogatepass")) > limit:
        raise ValueTooLarge(f"the text is longer than {setting} ({limit} bytes)")
    return text


def check_count(value: Any, what: str) -> int:
    """``value`` if it is a non-negative ``int`` (``bool`` is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInput(f"{what} is a non-negative integer")
    return int(value)


def check_filter(value: Any) -> Mapping[str, Any] | None:
    """A search filter: ``None`` or a mapping of field names to expected values."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidInput('a filter is a mapping such as {"field": value}')
    for name in value:
        check_text(name, "a filter field")
    return value


def check_index(value: Any) -> bool | tuple[str, ...] | None:
    """``index=``: ``None``, a bool, or a sequence of JSON paths (strings)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
        raise InvalidInput("index is True, False, None or a list of JSON paths")
    return tuple(check_text(path, "an index path") for path in value)


def check_depth(value: Any, max_depth: int, setting: str = "storage.max_value_depth") -> Any:
    """``value`` if its lists and dicts nest at most ``max_depth`` levels and every
    dict key is a string.

    Iterative, so a value nested far deeper than the interpreter's recursion limit
    is refused here instead of blowing up inside ``json.dumps``. It runs on every
    put before the value is encoded, so the loop is plain: a tuple of types for
    ``isinstance`` (cheaper than a union) and no generator per node.
    """
    if not isinstance(value, _NESTED):
        return value
    stack: list[tuple[Any, int]] = [(value, 1)]
    pop, push = stack.pop, stack.append
    while stack:
        node, depth = pop()
        if depth > max_depth:
            raise ValueTooLarge(f"the value nests deeper than {setting} ({max_depth} levels)")
        if isinstance(node, dict):
            _check_keys(node)
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, _NESTED):
                push((child, depth + 1))
    return value


_NESTED = (dict, list, tuple)


def _check_keys(node: dict[Any, Any]) -> None:
    # JSON turns the key 1 into "1": {"1": a, 1: b} would be stored as {"1": b},
    # one value lost without a word.
    for key in node:
        if not isinstance(key, str):
            raise InvalidInput("the keys of a JSON object in a memory value are strings")
