"""Keep the KEK providers' client libraries from logging key material.

At DEBUG, botocore logs every request's parameters and body (``botocore.endpoint``)
and every response body (``botocore.parsers``): for KMS ``Encrypt`` that is the
plaintext DEK, for ``Decrypt`` the plaintext answer. keyshred cannot keep the
application from turning DEBUG on, and the application may reconfigure logging at
any time (new handlers, ``dictConfig``, levels), so the protection sits where no
handler or level can route around it: a filter on every logger of those libraries,
checked by ``Logger.handle`` before any handler runs or the record propagates.

The filter drops only what the libraries log below WARNING *while a key operation
runs in the same thread* (``key_operation()``): metadata calls (list aliases,
read a transit key) and warnings stay visible, as the operator expects.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["LIBRARIES", "key_operation"]

LIBRARIES = ("botocore", "boto3", "s3transfer", "urllib3", "requests", "hvac")
"""Top-level logger names of the libraries a provider sends key material through."""

_IN_KEY_OPERATION: ContextVar[bool] = ContextVar("keyshred_in_key_operation", default=False)


class _KeyOperationFilter(logging.Filter):
    """Drops library records below WARNING emitted during a key operation."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not _IN_KEY_OPERATION.get()


_FILTER = _KeyOperationFilter("keyshred.key-operations")
_lock = threading.Lock()
_covered = -1  # size of the logger registry when every library logger was last covered


def _cover_library_loggers() -> None:
    """Attach the filter to every library logger, including ones created since the
    last call (a library module imported lazily creates its logger then)."""
    global _covered  # noqa: PLW0603 - one registry per process, so one mark
    registry = logging.Logger.manager.loggerDict
    if len(registry) == _covered:
        return
    with _lock:
        for name in LIBRARIES:
            logging.getLogger(name)  # a placeholder becomes a real, filtered logger
        for name, logger in list(registry.items()):
            if (
                isinstance(logger, logging.Logger)
                and name.split(".", 1)[0] in LIBRARIES
                and _FILTER not in logger.filters
            ):
                logger.addFilter(_FILTER)
        _covered = len(registry)


@contextlib.contextmanager
def key_operation() -> Iterator[None]:
    """Run a provider call that carries key material (a request or an answer)."""
    _cover_library_loggers()
    token = _IN_KEY_OPERATION.set(True)
    try:
        yield
    finally:
        _IN_KEY_OPERATION.reset(token)
