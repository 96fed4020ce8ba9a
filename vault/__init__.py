"""``keyshred.vault``: the tokenization vault.

- ``keyshred.vault.detect``: recognizers for email, phone, mainland resident ID,
  cards, IBAN and IP addresses, correct next to Chinese text; ``detect``, ``redact``
  and an adapter for Presidio results.
- ``keyshred.vault.tokens``: ``TokenVault`` (``ks.vault``): purpose-bound, expiring
  tokens; ``sanitize``/``sanitize_many``, ``restore``, ``detokenize``.
- ``keyshred.vault.rows``: what a token row is made of (form, kind, sealed value).
- ``keyshred.vault.store``: the token rows on the catalog's engine;
  ``keyshred.vault.schema``: the vault's tables.
- ``keyshred.vault.group``: group commit (rows held, flushed many calls per
  transaction); ``keyshred.vault.journal``: the crash-safe file it copies them into.
- ``keyshred.vault.sanitizers``: the logging filter and the prompt guard.

Only ``detect`` is imported here, eagerly: it is a leaf (standard library only) that
any use of the vault loads anyway, and the function ``detect`` must win over the
submodule of the same name whichever is imported first. ``tokens`` (SQLAlchemy,
the keyring) loads only when imported.
"""

from __future__ import annotations

from keyshred.vault.detect import (
    Finding,
    Recognizer,
    RegexRecognizer,
    default_recognizers,
    detect,
    redact,
)

__all__ = ["Finding", "Recognizer", "RegexRecognizer", "default_recognizers", "detect", "redact"]
