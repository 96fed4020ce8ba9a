"""Sanitizers where plaintext leaks: log records and model prompts."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from keyshred.errors import KeyshredError
from keyshred.vault.detect import Recognizer, detect, redact_findings
from keyshred.vault.tokens import TokenVault

__all__ = ["PromptGuard", "RedactingFilter"]


class RedactingFilter(logging.Filter):
    """A ``logging.Filter`` that removes personal data from every record.

    The message is formatted with its arguments first (``%s`` arguments are where
    values usually hide), then each detected value is replaced: by a token when a
    vault and a subject are known (``extra={"subject": ...}`` on the record, or
    ``subject_of(record)``), otherwise by a ``<KIND>`` placeholder. Exception text
    is sanitized as well. The record never keeps the original arguments.
    """

    def __init__(
        self,
        vault: TokenVault | None = None,
        *,
        purpose: str = "logs",
        ttl: timedelta = timedelta(days=30),
        subject_of: Callable[[logging.LogRecord], Any] | None = None,
        recognizers: Sequence[Recognizer] | None = None,
    ) -> None:
        super().__init__()
        self._vault = vault
        self._purpose = purpose
        self._ttl = ttl
        self._subject_of = subject_of or (lambda r: getattr(r, "subject", None))
        self._recognizers = recognizers

    def _clean(self, text: str, subject: Any) -> str:
        found = detect(text, self._recognizers)
        if not found:
            return text
        if self._vault is not None and subject is not None:
            try:
                return self._vault.sanitize(
                    text, subject, self._purpose, self._ttl, findings=found
                ).text
            except KeyshredError:
                pass  # suppressed subject, …: fall back to redaction, never to plaintext
        return redact_findings(text, found)

    def filter(self, record: logging.LogRecord) -> bool:
        subject = self._subject_of(record)
        record.msg = self._clean(record.getMessage(), subject)
        record.args = None
        if record.exc_info and record.exc_info[1] is not None:
            record.exc_text = self._clean(
                logging.Formatter().formatException(record.exc_info), subject
            )
            record.exc_info = None
        if hasattr(record, "subject"):
            record.subject = "<subject>"
        return True


class PromptGuard:
    """Sanitize the messages of a model call; restore tokens in its answer only for
    the tool purpose the tokens were issued for."""

    def __init__(self, vault: TokenVault, subject: Any, *, purpose: str, ttl: timedelta) -> None:
        self._vault = vault
        self._subject = subject
        self._purpose = purpose
        self._ttl = ttl

    def sanitize_messages(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Chat messages (``{"role", "content"}``) with personal values tokenized."""
        texts = [m["content"] for m in messages if isinstance(m.get("content"), str)]
        clean = iter(
            s.text
            for s in self._vault.sanitize_many(texts, self._subject, self._purpose, self._ttl)
        )
        return [
            {**m, "content": next(clean)} if isinstance(m.get("content"), str) else dict(m)
            for m in messages
        ]

    def restore_answer(self, text: str, *, caller: str, purpose: str) -> str:
        """Resolve the answer's tokens for ``purpose`` (an authorized tool purpose)
        and this guard's subject only: tokens issued for another purpose, and tokens
        of other subjects that a model may repeat from elsewhere (or make up), stay
        tokens."""
        return self._vault.restore(text, purpose, caller, subject=self._subject)
