"""The keyshred error tree.

Every error keyshred raises on purpose is a ``KeyshredError``; callers catch that one
class (or a branch of it) and never see a backend's own exception type::

    KeyshredError
    ├── ConfigError                 bad or missing configuration, unknown profile/backend
    │   └── KekMismatch             this KEK cannot unwrap the key store (another KEK made it,
    │                               or it was altered: also an IntegrityError)
    ├── MissingExtraError           an optional backend's package is not installed
    │                               (also an ImportError; names the extra to install)
    ├── InvalidInput                a caller passed something malformed (also a ValueError)
    │   ├── UnknownScope            the scope is not declared in the configuration
    │   └── ValueTooLarge           a value exceeds a configured size or depth limit
    │                               (``storage.max_value_bytes``, ``storage.max_value_depth``,
    │                               ``tokens.max_text_bytes``)
    ├── IntegrityError              a ciphertext, file or signature failed authentication:
    │   │                           unknown format, truncated, flipped, or moved elsewhere.
    │   │                           Deliberately opaque: it never says which check failed
    │   ├── UntrustedSigner         a well-formed receipt (JWS or JSON) whose signing key is
    │   │                           not one the verifier trusts (unknown or altered kid)
    │   └── WebhookRefused          a webhook's signature headers are missing or malformed,
    │       │                       or its signature is not by the shared secret
    │       └── WebhookTimestampInvalid  its timestamp is outside the tolerance (a replay)
    ├── SubjectErased               the subject's key was destroyed; nothing is decrypted
    ├── KeyNotFound                 no key of that id/subject/scope exists (never erased)
    ├── NotFound                    no memory (or other record) under that name
    ├── ConsentRequired             no active consent covers this purpose and category
    ├── TokenError                  a token does not resolve (each refusal is audited)
    │   ├── UnknownToken            not a token this store issued (forged, or removed)
    │   ├── TokenExpired            past its expiry
    │   ├── TokenPurposeMismatch    issued for another purpose
    │   └── TokenSubjectMismatch    issued for another subject than the caller expects
    ├── BackendUnavailable          the catalog or key store database cannot be reached
    │                               (connection refused or dropped, server restarting,
    │                               pool exhausted, SQLite locked too long); nothing was
    │                               changed, the next call may succeed
    ├── DatabaseError               a catalog or key store statement failed otherwise: the
    │                               database was damaged or altered by hand (a table or
    │                               column missing); names the driver's error class only
    ├── SubjectSuppressed           the subject is suppressed or erased: nothing is read
    │   └── StaleEpoch              or written; a job carrying an older deletion epoch
    │                               is refused with StaleEpoch
    ├── EpochInUse                  a KEK epoch to destroy still seals retained backups
    ├── KekError                    the KEK provider failed
    │   ├── KekUnavailable          the provider cannot be reached (server down, auth)
    │   │   └── KekCircuitOpen      too many calls in a row failed: calls fail fast until
    │   │                           ``retry_at``, then one trial call is let through
    │   └── KekEpochDestroyed       the KEK epoch that wrapped the key was destroyed
    ├── HandleClosed                the ``Keyshred`` handle was closed; nothing was done
    ├── WebhookDeliveryFailed       a webhook was not accepted: every bounded attempt failed
    │                               (5xx, timeout, connection) or the receiver answered 4xx
    └── StorageFull                 the disk, a quota or a file size limit is full (ENOSPC,
                                    EDQUOT, EFBIG, SQLITE_FULL): the call failed, data
                                    acknowledged before it is intact

Messages carry ids that are safe to log (key ids, subject_refs, epochs) and never a
subject id, plaintext or key material; exceptions raised while handling secret data
are raised ``from None`` so the chain cannot leak it either.
"""

from __future__ import annotations

from datetime import datetime

__all__ = [
    "BackendUnavailable",
    "ConfigError",
    "ConsentRequired",
    "DatabaseError",
    "EpochInUse",
    "HandleClosed",
    "IntegrityError",
    "InvalidInput",
    "KekCircuitOpen",
    "KekEpochDestroyed",
    "KekError",
    "KekMismatch",
    "KekUnavailable",
    "KeyNotFound",
    "KeyshredError",
    "MissingExtraError",
    "NotFound",
    "StaleEpoch",
    "StorageFull",
    "SubjectErased",
    "SubjectSuppressed",
    "TokenError",
    "TokenExpired",
    "TokenPurposeMismatch",
    "TokenSubjectMismatch",
    "UnknownScope",
    "UnknownToken",
    "UntrustedSigner",
    "ValueTooLarge",
    "WebhookDeliveryFailed",
    "WebhookRefused",
    "WebhookTimestampInvalid",
]


class KeyshredError(Exception):
    """Base class of every error keyshred raises on purpose."""


class ConfigError(KeyshredError):
    """The configuration is missing, malformed or names an unknown backend."""


class EpochInUse(KeyshredError):
    """KEK epochs were not destroyed: unexpired backup generations are sealed under
    them (``generations``) and would become unrestorable."""

    def __init__(self, message: str, generations: tuple[str, ...]) -> None:
        super().__init__(message)
        self.generations = generations


class MissingExtraError(KeyshredError, ImportError):
    """An optional backend needs a package that is not installed."""

    def __init__(self, extra: str, package: str) -> None:
        super().__init__(
            f"this feature needs the {package!r} package: pip install 'keyshred[{extra}]'"
        )
        self.extra = extra
        self.package = package


class InvalidInput(KeyshredError, ValueError):
    """The caller passed a malformed argument; nothing was changed."""


class IntegrityError(KeyshredError):
    """Authentication failed: the data was not produced by keyshred for this place."""

    def __init__(self, message: str = "ciphertext failed authentication") -> None:
        super().__init__(message)


class UntrustedSigner(IntegrityError):
    """The signature is well formed but by a key the verifier does not trust: the
    ``kid`` names no trusted key (another issuer, a rotated-out key, or an edit)."""


class WebhookRefused(IntegrityError):
    """A webhook's ``webhook-id``/``webhook-timestamp``/``webhook-signature`` headers
    are missing or malformed, or no signature in them is by the shared secret."""


class WebhookTimestampInvalid(WebhookRefused):
    """The webhook's timestamp is too far from now (a replayed or delayed message)."""


class KekMismatch(ConfigError, IntegrityError):
    """This process's KEK cannot unwrap the key store: it was created with another
    KEK (another provider, key file, transit key or alias), or the store was altered.
    Both a configuration error and an integrity error: which one cannot be told."""


class SubjectErased(KeyshredError):
    """The key needed for this data was destroyed by an erasure."""


class KeyNotFound(KeyshredError):
    """No key exists for that id, subject or scope."""


class KekError(KeyshredError):
    """The key-encryption-key provider failed."""


class KekUnavailable(KekError):
    """The KEK provider cannot be reached or refused our credentials."""


class KekCircuitOpen(KekUnavailable):
    """The KEK service is down: the last calls failed in a row, so calls fail fast
    (no network round trip) until ``retry_at`` (UTC); then one trial call is sent
    and, if it succeeds, calls flow again. Nothing was changed; retry after it."""

    def __init__(self, message: str, retry_at: datetime) -> None:
        super().__init__(message)
        self.retry_at = retry_at


class KekEpochDestroyed(KekError):
    """The KEK epoch that wrapped this key has been destroyed."""


class UnknownScope(InvalidInput):
    """The scope is not declared (``[scopes]`` in the configuration)."""


class ValueTooLarge(InvalidInput):
    """A value is larger or deeper than a configured limit (``storage.max_value_bytes``,
    ``storage.max_value_depth``, ``tokens.max_text_bytes``)."""


class NotFound(KeyshredError):
    """No memory (or other record) exists under that name."""


class ConsentRequired(KeyshredError):
    """No active consent covers this subject, purpose, category and action."""


class BackendUnavailable(KeyshredError):
    """The catalog or key store database cannot be reached right now (connection
    refused or dropped, server restarting, every pooled connection busy, SQLite
    locked too long). The operation did not happen; retrying later may succeed."""


class DatabaseError(KeyshredError):
    """A statement on the catalog or key store database failed for another reason than
    an unreachable server or a full disk: the database was damaged or altered by hand
    (a table or column missing, a constraint broken). The message names the driver's
    error class only (its text can quote a statement); the call did not complete.
    Public calls raise it for any driver error that reaches them."""


class SubjectSuppressed(KeyshredError):
    """The subject is suppressed or erased; reads and writes are refused."""


class StaleEpoch(SubjectSuppressed):
    """The operation carries a deletion epoch older than the subject's current one."""


class TokenError(KeyshredError):
    """A token did not resolve."""


class UnknownToken(TokenError):
    """Not a token this store issued (forged, mistyped, or removed by erasure)."""


class TokenExpired(TokenError):
    """The token is past its expiry."""


class TokenPurposeMismatch(TokenError):
    """The token was issued for another purpose."""


class TokenSubjectMismatch(TokenError):
    """The token belongs to another subject than the one the caller expects."""


class HandleClosed(KeyshredError):
    """The ``Keyshred`` handle was closed; the call was refused before doing anything."""


class WebhookDeliveryFailed(KeyshredError):
    """A webhook was not accepted: the receiver answered 4xx (not retried), or every
    one of the bounded attempts failed with 5xx, a timeout or a connection error.
    ``attempts`` says how many were made, ``status`` the last HTTP status (None:
    no answer)."""

    def __init__(self, message: str, attempts: int, status: int | None) -> None:
        super().__init__(message)
        self.attempts = attempts
        self.status = status


class StorageFull(KeyshredError):
    """The disk (or a quota, or a file size limit) is full; what was stored before is
    intact and the call can be retried once there is space."""
