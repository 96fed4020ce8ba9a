"""``keyshred.vault``: the tokenization vault.

Built so far: detection (``keyshred.vault.detect``): recognizers for email, phone,
mainland resident ID, cards, IBAN and IP addresses, correct next to Chinese text, and
an adapter for Presidio results. Not built yet (issue #6): tokens (sanitize, restore,
detokenize with purposes and expiry), the logging filter and the prompt helper.
"""

from __future__ import annotations

from keyshred.vault.detect import Finding, Recognizer, RegexRecognizer, default_recognizers, detect

__all__ = ["Finding", "Recognizer", "RegexRecognizer", "default_recognizers", "detect"]
