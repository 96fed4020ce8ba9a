"""keyshred: erasable-by-design storage for AI-agent memory.

Every record is sealed under a data key that belongs to one data subject; erasing
the subject destroys the key, and with it every copy. See ``Keyshred`` to start.
"""

from __future__ import annotations

from keyshred.config import Config
from keyshred.errors import (
    ConfigError,
    ConsentRequired,
    IntegrityError,
    InvalidInput,
    KekEpochDestroyed,
    KekError,
    KekUnavailable,
    KeyNotFound,
    KeyshredError,
    MissingExtraError,
    NotFound,
    StaleEpoch,
    SubjectErased,
    SubjectSuppressed,
    UnknownScope,
    ValueTooLarge,
)
from keyshred.facade import Keyshred
from keyshred.ids import Subject

__all__ = [
    "Config",
    "ConfigError",
    "ConsentRequired",
    "IntegrityError",
    "InvalidInput",
    "KekEpochDestroyed",
    "KekError",
    "KekUnavailable",
    "KeyNotFound",
    "Keyshred",
    "KeyshredError",
    "MissingExtraError",
    "NotFound",
    "StaleEpoch",
    "Subject",
    "SubjectErased",
    "SubjectSuppressed",
    "UnknownScope",
    "ValueTooLarge",
]

__version__ = "0.1.0"
