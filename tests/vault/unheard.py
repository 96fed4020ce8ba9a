"""Suppress a subject without this handle hearing of it: its eviction event (on
SQLite delivered in the suppressing thread) would flush the vault's held tokens
at once, and the flush's own refusal of a suppressed subject's rows, what these
tests are about, would never be reached. A process whose listener missed the
event (a reconnection gap) is in exactly this position."""

from __future__ import annotations

from keyshred import Keyshred

__all__ = ["suppress_unheard"]


def suppress_unheard(ks: Keyshred, subject_ref: str) -> int:
    subscription = ks._eviction._subscription
    if subscription is not None:
        subscription.close()
    ks._eviction._subscription = None
    return ks.catalog.suppress(subject_ref)
