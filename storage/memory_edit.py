"""Changes of memories that exist: ``update``, ``correct`` (supersede and keep the
old value as a history version), ``touch`` (a new retention) and ``rebuild`` (an
erasure replacing a derived memory's value). All but ``touch`` write through
``_put_rows``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any

from keyshred.errors import BackendUnavailable, InvalidInput, NotFound
from keyshred.storage.memory_read import ReadMixin
from keyshred.storage.memory_types import (
    _VERSION_SEP,
    Changed,
    Made,
    Memory,
    PutItem,
    _caller_namespace,
    _checked,
    _key,
)
from keyshred.storage.memory_write import Kept, WriteMixin
from keyshred.storage.partition import MemoryRow, Partition, from_us, row_key_id, to_us

__all__ = ["EditMixin"]

_ATTEMPTS = 50  # corrections of one key racing each other: each round, one wins


class EditMixin(WriteMixin, ReadMixin):
    """``update``, ``correct``, ``touch`` and ``rebuild``."""

    def update(
        self,
        subject: Any,
        namespace: Sequence[str] | str,
        key: str,
        value: Any,
        *,
        sources: Sequence[str] | None = None,
        mentions: Iterable[Any] | None = None,
        epoch: int | None = None,
    ) -> Memory:
        """Replace the value of an existing memory (``NotFound`` if there is none);
        scope, purpose, category and provenance stay as they are, unless ``sources``
        or ``mentions`` (subjects) are given: those replace the old ones. Dropping a
        mention silently would take the memory out of that subject's erasure."""
        existing = self._row(subject, _caller_namespace(namespace), key)
        if existing is None:
            raise NotFound("no memory at that namespace and key")
        if mentions is not None and (
            isinstance(mentions, str) or not isinstance(mentions, Iterable)
        ):
            raise InvalidInput("mentions is a list of subjects")
        refs = existing.mentions if mentions is None else tuple({self._ref(m) for m in mentions})
        # Kept mentions keep how they came (found in the value, or declared).
        carried = (
            self._catalog.detected_mentions(existing.memory_id)
            if mentions is None and refs
            else frozenset()
        )
        item = PutItem(
            existing.namespace,
            existing.key,
            value,
            existing.scope,
            existing.purpose,
            existing.category,
            existing.sources if sources is None else sources,
        )
        # A new value derived from a source deleted since stays owned by whom the old
        # value was: the deleted source names no owner, yet the value may still hold
        # its text. Which owners came through it is not known any more, so all are
        # kept (a mention dropped too): passing sources without it sheds them.
        kept = None
        if existing.sources:
            kept = {
                (existing.namespace, existing.key): Kept(
                    self._key_owners(existing), while_gone=True
                )
            }
        return self._put_rows(
            self._ref(subject),
            [_checked(item)],
            epoch=epoch,
            mention_refs=[refs],
            produced_by=self._produced_by(existing),
            carried_detected=carried,
            kept_sources=existing.sources,
            kept=kept,
        )[0]

    def _key_owners(self, row: MemoryRow) -> tuple[str, ...]:
        """The other owners of the key ``row`` is sealed under (none: its holder's
        scope key)."""
        key_id = row_key_id(row)
        if key_id is None:
            return ()
        return self._keyring.owners_of([key_id]).get(key_id, ())

    def _produced_by(self, row: MemoryRow) -> Made | None:
        """A derived memory's (kind, producer, producer version), for a rewrite that
        keeps its provenance: without it the rewrite registered the asset as a plain
        memory, and the erasure of a source dropped it instead of rebuilding it (or
        waiting in ``manual_review`` for an unknown producer)."""
        if not row.sources:
            return None
        asset = self._catalog.asset(row.memory_id)
        if asset is None or asset.producer is None:
            return None
        return (asset.kind, asset.producer, asset.producer_version)

    # -- correction (supersede, keep history) ------------------------------------------

    def correct(
        self,
        subject: Any,
        namespace: Sequence[str] | str,
        key: str,
        value: Any,
        *,
        reason: str,
    ) -> Memory:
        """Supersede a memory's value and keep the old one as a history version
        (valid from its last write until now), for "what was true when". Not a
        deletion: ``delete`` and erasure remove the value *and* its history."""
        if not isinstance(reason, str) or not 0 < len(reason) <= 128:
            raise InvalidInput("a correction has a short reason (it is audited)")
        ref = self._ref(subject)
        ns, k = _caller_namespace(namespace), _key(key)
        part = self._partition(ref)
        for _ in range(_ATTEMPTS):
            try:
                memory, version = self._correct_once(ref, part, ns, k, value=value, reason=reason)
                break
            except Changed:
                # Another write of this key (a correction) landed between this one's
                # read and its lock: read and number again (each round one of the
                # racing writers wins). Reading under the lock instead would hold it
                # while other subjects' partitions are loaded (the owners of the
                # sources), in whatever order two writers take theirs.
                continue
        else:
            raise BackendUnavailable("the memory kept changing while it was corrected")
        if self._audit is not None:
            self._audit.record(
                "memory.corrected", subject_ref=ref, asset_id=memory.memory_id, version=version
            )
        return memory

    def _correct_once(
        self, ref: str, part: Partition, ns: tuple[str, ...], k: str, *, value: Any, reason: str
    ) -> tuple[Memory, int]:
        old = self._settled(ref, lambda: self._row_once(ref, ns, k))
        if old is None:
            raise NotFound("no memory to correct at that namespace and key")
        version = self._next_version(part, ns, k)
        now = self._clock()
        record = {
            "value": json.loads(old.value),
            "valid_from": from_us(old.updated_us).isoformat(),
            "valid_to": now.isoformat(),
            "reason": reason,
            "version": version,
        }
        items = [
            PutItem(
                self._history_ns(ns),
                f"{k}{_VERSION_SEP}{version:08d}",
                record,
                old.scope,
                old.purpose,
                old.category,
                old.sources,  # the old value is about the same subjects: same owners
                index=False,
            ),
            PutItem(ns, k, value, old.scope, old.purpose, old.category, old.sources, (), None),
        ]
        carried = self._catalog.detected_mentions(old.memory_id) if old.mentions else frozenset()
        made = self._produced_by(old)
        # Both stay owned by whom the old value was: its sources may be gone from the
        # catalog (deleted) while it, and a value corrected from it, hold their text.
        # The old value, now a version, keeps its retention too.
        owners = self._key_owners(old)
        memory = self._put_rows(
            ref,
            items,
            mention_refs=[old.mentions, old.mentions],
            # The new value keeps its producer; the old version is a plain memory.
            produced_by={(ns, k): made} if made is not None else None,
            carried_detected=carried,
            kept_sources=old.sources,
            kept={
                (self._history_ns(ns), items[0].key): Kept(owners, old.retain_us),
                (ns, k): Kept(owners, while_gone=True),
            },
            # Numbered from the value read: written only if it is still the value.
            unchanged={(ns, k): old},
        )[1]
        return memory, version

    # -- retention and rebuilds --------------------------------------------------------

    def touch(
        self, subject: Any, keys: Sequence[tuple[tuple[str, ...], str]], ttl: timedelta
    ) -> int:
        """Give memories a new retention of ``ttl`` from now (never beyond the
        policy's maximum): a TTL refreshed on read. Returns how many."""
        if not isinstance(ttl, timedelta) or ttl <= timedelta(0):
            raise InvalidInput("a ttl is a positive timedelta")
        if isinstance(keys, str) or not isinstance(keys, Sequence):
            raise InvalidInput("keys is a list of (namespace, key) pairs")
        names = []
        for pair in keys:
            if isinstance(pair, str) or not isinstance(pair, Sequence) or len(pair) != 2:
                raise InvalidInput("keys is a list of (namespace, key) pairs")
            # A history version's retention is its superseded value's, not a caller's.
            names.append((_caller_namespace(pair[0]), _key(pair[1])))
        ref = self._ref(subject)
        self._catalog.check_guard(ref)
        part = self._partition(ref)
        now = self._clock()
        new_us = to_us(now) + int(ttl.total_seconds() * 1_000_000)
        with part.flocked():
            changed: dict[str, MemoryRow] = {}  # by lookup: a key listed twice counts once
            # Never past what a put now would keep it: the policy's maximum, and the
            # end of the consent it is stored under (none active: ConsentRequired).
            limits: dict[tuple[str, str | None, str | None], int] = {}
            for ns, k in names:
                row = part.rows.get(part.lookup(ns, k)) if part.rows else None
                if row is None or row.retain_us <= to_us(now):
                    continue  # past its retain-until, it is gone for every read already
                at = (row.scope, row.purpose, row.category)
                if at not in limits:
                    limits[at] = self._target(ref, PutItem(ns, k, None, *at), now)[3]
                changed[row.lookup] = replace(row, retain_us=min(new_us, limits[at]))
            if not changed:
                return 0
            part.append_puts(list(changed.values()))
            for row in changed.values():
                self._catalog.update_assets([row.memory_id], retain_until=from_us(row.retain_us))
        return len(changed)

    def rebuild(
        self,
        ref: str,
        row: MemoryRow,
        value: Any,
        *,
        sources: Sequence[str],
        mentions: Sequence[str],
        produced_by: tuple[str, str | None, str | None] | None = None,
    ) -> Memory:
        """Replace a derived memory's value and provenance (erasure rebuild), and
        with ``produced_by`` its (kind, producer, producer version) in the same
        catalog transaction: a crash leaves the old asset or the new, never one
        that has forgotten how it is rebuilt. ``Changed`` if ``row`` is no longer
        the row at its name."""
        item = PutItem(
            row.namespace,
            row.key,
            value,
            row.scope,
            row.purpose,
            row.category,
            tuple(sources),
            (),
            None,
        )
        memory = self._put_rows(
            ref,
            [item],
            mention_refs=[tuple(mentions)],
            produced_by=produced_by,
            kept_sources=row.sources,
            # No longer than the value it replaces was kept (a touch may have
            # shortened it), and only over that value: a holder's write since is
            # theirs (``Changed``: the erasure decides again).
            kept={(row.namespace, row.key): Kept((), row.retain_us)},
            unchanged={(row.namespace, row.key): row},
        )[0]
        # The previous value stays in the partition's log or an old segment until the
        # erasure's derived step purges the holder's partition, once per holder at
        # its end (``purge_superseded``): a flush per rebuilt asset rewrote the whole
        # partition as many times as it held assets to rebuild.
        return memory
