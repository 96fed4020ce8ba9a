"""``Erasable``: the one interface every store holding personal data implements.

The erasure coordinator (``keyshred.erasure``) knows stores only through it: it
suppresses the subject, destroys its keys, then calls each store's ``erase`` in its
own persisted step (``drop_<name>`` before the catalog rows go, ``<name>`` after them
for stores in the ``rebuild`` phase, such as derived assets, which rebuild from what
remains), ``verify`` once every store is done, and ``evict`` around suppression and
key destruction. The receipt lists what each store's ``erase`` returned, unchanged.

Everything a store returns lands in receipts and audit events: counts, actions,
asset ids and check names, never a value, a key or a probe.

A store's ``erase`` is idempotent: a process killed inside it leaves a state that
a second call (the resumed request) finishes, and a second call after a finished
one returns 0 (what went is recorded in the request, not recounted).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, Protocol, runtime_checkable

__all__ = [
    "DROP",
    "REBUILD",
    "Erasable",
    "ErasureTarget",
    "Phase",
    "ScopedKeys",
    "StoreCheck",
    "StoreErasure",
]

Phase = Literal["drop", "rebuild"]
DROP: Phase = "drop"  # before the catalog rows go: the store removes the subject's data
REBUILD: Phase = "rebuild"  # after them: the store rebuilds from what remains


@dataclass(frozen=True, slots=True)
class ErasureTarget:
    """What one request erases, as the stores see it.

    ``scope=None`` is the whole subject. ``assets`` narrows a request to exactly
    those memory assets (the retention scanner's requests: no key destroyed, the
    subject stays active). ``erased`` are the request's own asset ids and
    ``closure`` the other holders' assets derived from (or mentioning) them, found
    by the coordinator before any store acts. ``done`` is what a killed earlier
    run of the same step recorded through ``record`` (per-item progress of a long
    step, such as the derived rebuilds), so a resumed step does not repeat it:
    ``record(item, entry)`` records the item's entry (replacing its earlier one,
    ordered after every other), ``record(item, None)`` forgets it."""

    subject_ref: str
    scope: str | None = None
    assets: tuple[str, ...] | None = None
    erased: tuple[str, ...] = ()
    closure: tuple[str, ...] = ()
    done: tuple[Mapping[str, Any], ...] = ()
    record: Callable[[str, Mapping[str, Any] | None], None] | None = field(
        default=None, compare=False, repr=False
    )

    @property
    def whole_subject(self) -> bool:
        """The subject itself goes (its threads, tokens, exports and mentions too)."""
        return self.scope is None and self.assets is None

    @property
    def listed(self) -> bool:
        """Exactly the listed memories (``assets``) go, nothing else of the subject."""
        return self.assets is not None


@dataclass(frozen=True, slots=True)
class StoreErasure:
    """What one store's ``erase`` did: the receipt's line for the store (``action``,
    ``count``, ``at``) and, for stores acting per asset, one entry per asset
    (``items``: the derived rebuilds in the receipt's ``derived`` section)."""

    store: str
    action: str
    count: int
    at: datetime
    items: tuple[Mapping[str, Any], ...] = ()
    # Whether this shows the subject had data here (the receipt's ``found_data``):
    # rows, tokens, threads, rebuilt assets. A count of files does not tell (a
    # partition folder may hold nothing but its lock file): such stores say False
    # and the keys and catalog assets found tell instead.
    found: bool = False

    def to_doc(self) -> dict[str, Any]:
        """JSON for the persisted request (read back by ``from_doc``)."""
        return {
            "store": self.store,
            "action": self.action,
            "count": self.count,
            "at": self.at.astimezone(UTC).isoformat(),
            "actions": [dict(i) for i in self.items],
            "found": self.found,
        }

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> StoreErasure:
        return cls(
            str(doc["store"]),
            str(doc["action"]),
            int(doc["count"]),
            datetime.fromisoformat(doc["at"]),
            tuple(doc.get("actions", ())),
            bool(doc.get("found", False)),
        )


@dataclass(frozen=True, slots=True)
class StoreCheck:
    """One verification result; ``detail`` is safe text (counts), never data."""

    name: str
    passed: bool
    detail: str

    def to_doc(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "detail": self.detail}


@runtime_checkable
class ScopedKeys(Protocol):
    """A store whose data in a policy scope is sealed under keys of other key scopes
    as well (an agent thread's own key, ``~thread:<ref>``): a scope's erasure
    destroys those with the scope's own keys."""

    def key_scopes(self, subject_ref: str, scope: str) -> Sequence[str]:
        """The other key scopes of the subject's data in ``scope``."""
        ...


@runtime_checkable
class Erasable(Protocol):
    """A store that holds personal data and can erase a subject (or scope) from it."""

    @property
    def name(self) -> str:
        """The store's name in steps (``drop_<name>``) and receipts."""
        ...

    @property
    def phase(self) -> Phase:
        """``DROP`` (before the catalog rows go) or ``REBUILD`` (after them)."""
        ...

    def erase(self, target: ErasureTarget) -> StoreErasure:
        """Remove what the store holds of ``target`` and say what it did."""
        ...

    def verify(self, target: ErasureTarget) -> Sequence[StoreCheck]:
        """Check that nothing of ``target`` is left in the store."""
        ...

    def evict(self, subject_ref: str) -> None:
        """Drop what this process holds of the subject in memory: unwrapped keys,
        decrypted rows or vectors, cached file keys, pending writes."""
        ...
