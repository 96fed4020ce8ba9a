"""Scenarios several test modules build: a victim's memory and another holder's
summary of it (a derived asset sealed under a key both own); the victim's expiring
memory holding a probe, and a rebuild function that never keeps it; a package that
provides a rebuild function as an entry point."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from keyshred import Keyshred, PutItem

__all__ = [
    "PROBE",
    "VICTIM",
    "clean_rebuild",
    "derive",
    "expiring_probe_memory",
    "install_rebuilder_package",
    "victim_summary",
]

VICTIM = "victim@example.org"
PROBE = "victimsecretxyz"  # planted in the victim's text; searched for in the files


def derive(
    store: Keyshred,
    subject: str,
    key: str,
    sources: list[str],
    *,
    value: Any,
    producer: str,
    rebuild: Any = None,
    kind: str = "digest",
    namespace: tuple[str, ...] = ("s",),
) -> Any:
    """``ks.derived.register`` at producer version "1" (the stored ``Memory``)."""
    return store.derived.register(
        kind,
        subject=subject,
        namespace=namespace,
        key=key,
        value=value,
        produced_from=sources,
        producer=producer,
        producer_version="1",
        rebuild=rebuild,
    )


def clean_rebuild(sources: list[Any]) -> str:
    """A rebuild function: what remains, never the probe."""
    return "rebuilt: " + " | ".join(str(m.value) for m in sources if PROBE not in str(m.value))


def expiring_probe_memory(ks: Keyshred) -> str:
    """The victim's memory ("m",) "k", holding the probe, expiring in 5 s: its id."""
    [v] = ks.memories.put_many(
        VICTIM, [PutItem(("m",), "k", f"{PROBE} text", ttl=timedelta(seconds=5))]
    )
    return v.memory_id


def install_rebuilder_package(site: Path, module: str, entry: str) -> None:
    """A distribution whose ``keyshred.rebuilders`` entry point ``entry`` is its
    module's ``rebuild``, installed as pip would (a ``.dist-info`` in ``site``, a
    folder the caller puts on ``sys.path``)."""
    (site / f"{module}.py").write_text(
        "def rebuild(sources):\n    return f'{len(sources)} sources left (entry point)'\n"
    )
    dist = site / f"{module}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[keyshred.rebuilders]\n{entry} = {module}:rebuild\n")


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
