"""Import optional backends with an error that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

from keyshred.errors import MissingExtraError

__all__ = ["require"]


def require(module: str, *, extra: str, package: str | None = None) -> ModuleType:
    """Import ``module`` or raise ``MissingExtraError`` naming ``keyshred[extra]``."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtraError(extra, package or module.split(".", maxsplit=1)[0]) from None
