"""Scenarios several test modules build: a victim's memory and another holder's
summary of it (a derived asset sealed under a key both own)."""

from __future__ import annotations

from typing import Any

from keyshred import Keyshred

__all__ = ["VICTIM", "victim_summary"]

VICTIM = "victim@example.org"


def victim_summary(
    ks: Keyshred, *, producer: str = "dg", rebuild: Any = None, **register: Any
) -> tuple[str, str, str]:
    """The victim's memory, Bob's memory, and Bob's summary of both at ("s",) "d"
    (producer version "1"; ``register``: more arguments of ``ks.derived.register``,
    a scope): their ids."""
    v = ks.memories.put(VICTIM, ("m",), "k", "victim text")
    b = ks.memories.put("bob", ("m",), "b", "bob text")
    s = ks.derived.register(
        "digest",
        subject="bob",
        namespace=("s",),
        key="d",
        value="summary of victim text",
        produced_from=[v.memory_id, b.memory_id],
        producer=producer,
        producer_version="1",
        rebuild=rebuild,
        **register,
    )
    return v.memory_id, b.memory_id, s.memory_id
