"""The write path: ``put`` and ``put_many``, and ``_put_rows`` under them.

Every write of a memory goes through ``_put_rows`` (``update``, ``correct`` and an
erasure's ``rebuild`` too): guard and epoch, policy, consent and retention,
registered identifiers found in values, owner-set keys for rows about other
subjects, then under the subject lock the vectors and one catalog transaction that
holds both the rows (hot rows of the partition) and their assets: one commit.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from keyshred._validate import check_depth
from keyshred.errors import (
    ConsentRequired,
    InvalidInput,
    KeyNotFound,
    NotFound,
    SubjectErased,
    SubjectSuppressed,
    ValueTooLarge,
)
from keyshred.keyring.datakey import DataKey
from keyshred.keyring.keystore import owner_token
from keyshred.storage import faults
from keyshred.storage.embeddings import Embedder
from keyshred.storage.memory_index import IndexMixin
from keyshred.storage.memory_types import (
    _JSON,
    Changed,
    Made,
    Memory,
    ProducedBy,
    PutItem,
    _caller_namespace,
    _checked,
    _key,
    _memory,
    _namespace,
    _new_id,
    _vector_ids,
)
from keyshred.storage.partition import MemoryRow, Partition, row_key_id, seal_row, to_us
from keyshred.storage.vectors import DEFAULT_SPACE, VectorItem

__all__ = ["Kept", "WriteMixin"]

_NAMES_SOMEONE = (
    "this item names a registered person (their identifiers were found in it), and "
    "it is for a subject that belongs to nobody; store it under that person, or allow "
    "it explicitly (KeyshredStore.put_shared)"
)


@dataclass(frozen=True, slots=True)
class Kept:
    """What a rewritten row keeps of the row it rewrites, whatever its sources and
    mentions say now: the ``owners`` of the key the old row was sealed under (a
    source deleted since names none, yet the value still holds its text), and
    its ``retain_us`` (a superseded value, kept as a history version, lives no
    longer than it would have). ``while_gone``: the owners are kept only if a
    source of the new row is gone from the catalog; with every source there, the
    owners they give now are the whole truth (a source or mention the caller
    dropped no longer owns the row)."""

    owners: Collection[str] = ()
    retain_us: int | None = None
    while_gone: bool = False


class WriteMixin(IndexMixin):
    """``put``, ``put_many`` and the write path under them."""

    # -- validation --------------------------------------------------------------------

    def _encode(self, value: Any) -> bytes:
        check_depth(value, self._max_depth)
        try:
            raw = _JSON.encode(value).encode("utf-8")
        except (TypeError, ValueError):
            raise InvalidInput(
                "a memory value must be JSON (dict, list, str, number, bool, None)"
            ) from None
        if len(raw) > self._max_value:
            raise ValueTooLarge(
                f"the value is {len(raw)} bytes; storage.max_value_bytes is {self._max_value}"
            )
        return raw

    # -- writes ------------------------------------------------------------------------

    def put(
        self,
        subject: Any,
        namespace: Sequence[str] | str,
        key: str,
        value: Any,
        *,
        scope: str = "default",
        purpose: str | None = None,
        category: str | None = None,
        sources: Sequence[str] = (),
        mentions: Iterable[Any] = (),
        index: bool | Sequence[str] | None = None,
        epoch: int | None = None,
        embedder: Embedder | None = None,
    ) -> Memory:
        """Create or replace the memory at (namespace, key) of ``subject``.

        ``index`` embeds the value for semantic search: ``True`` the whole value,
        a list of JSON paths (``"text"``, ``"a.b"``, ``"$"``) those fields, ``False``
        nothing (removing earlier vectors); ``None`` keeps what an existing memory had.
        ``embedder``: an ``Embedder`` naming its own embedding space, to embed with
        instead of the handle's (search with the same one); the memory's vectors in
        other spaces are removed (they embed its previous value) and re-made by
        their space's next search.
        """
        if isinstance(mentions, str) or not isinstance(mentions, Iterable):
            raise InvalidInput("mentions is a list of subjects")
        item = PutItem(
            namespace, key, value, scope, purpose, category, sources, tuple(mentions), index
        )
        return self.put_many(subject, [item], epoch=epoch, embedder=embedder)[0]

    def put_many(
        self,
        subject: Any,
        items: Sequence[PutItem],
        *,
        epoch: int | None = None,
        embedder: Embedder | None = None,
        unmentioned: bool = False,
    ) -> list[Memory]:
        """Write a batch for one subject: one catalog transaction (its rows and their
        assets), one commit. All-or-nothing: a bad item fails the batch before
        anything is written. ``embedder`` as for ``put``. ``unmentioned``: an item
        that names a registered subject (its identifiers found in it) is refused
        (``InvalidInput``) instead of being co-owned by them: what a subject that
        belongs to nobody (``KeyshredStore``'s shared knowledge) keeps."""
        if not isinstance(items, Sequence):
            raise InvalidInput("put_many takes a list of PutItem")
        for item in items:
            _callers(item)
        ref = self._ref(subject)
        return self._put_rows(ref, items, epoch=epoch, embedder=embedder, unmentioned=unmentioned)

    def put_derived(self, subject: Any, item: PutItem, made: Made) -> Memory:
        """``put`` of a derived asset: ``made`` (kind, producer, producer version)
        goes into the catalog in the transaction that registers the row. Set after
        it, a crash between left a plain memory, which an erasure of a source drops
        instead of rebuilding."""
        _callers(item)
        return self._put_rows(self._ref(subject), [item], produced_by=made)[0]

    def check_put(self, item: PutItem, subject: Any = None, *, unmentioned: bool = False) -> None:
        """Refuse, as ``put_many`` would and writing nothing, an item it refuses on
        its own (its fields, keyshred's own namespaces, a value that is no JSON or
        too large, a ttl not positive) and, given the ``subject`` it is for, what it
        refuses for that subject: the subject or the item's scope suppressed, no
        consent its policy needs, a subject it names (declared or found by its
        registered identifiers) being erased. For a caller whose writes take
        several calls (``KeyshredStore.batch`` across subjects, or deletes then
        puts): each call is all or nothing, so the refusal must come before the
        first one. (A suppression between this check and the write is still
        refused by the write, after the calls before it.)"""
        _callers(item)
        _key(item.key)
        self._encode(item.value)
        if item.ttl is not None and item.ttl <= timedelta(0):
            raise InvalidInput("a ttl is positive")
        if subject is None:
            return
        ref = self._ref(subject)
        guard = self._catalog.guard(ref)
        self._catalog.enforce(ref, guard, None)
        scope = self._target(ref, item, self._clock())[0]
        if scope in guard.scopes:
            raise SubjectSuppressed(f"scope {scope!r} of subject_ref {ref} is suppressed")
        found = set().union(*self._mentions.find(ref, [item]))
        if unmentioned and found:
            raise InvalidInput(_NAMES_SOMEONE)
        named = found | {self._ref(m) for m in item.mentions}
        for owner in sorted(named - {ref}):
            self._check_owner(owner)

    def _put_rows(
        self,
        ref: str,
        items: Sequence[PutItem],
        *,
        epoch: int | None = None,
        mention_refs: Sequence[tuple[str, ...]] | None = None,
        produced_by: ProducedBy | None = None,
        carried_detected: frozenset[str] = frozenset(),
        kept_sources: Collection[str] = (),
        kept: Mapping[tuple[tuple[str, ...], str], Kept] | None = None,
        unchanged: Mapping[tuple[tuple[str, ...], str], MemoryRow] | None = None,
        embedder: Embedder | None = None,
        unmentioned: bool = False,
    ) -> list[Memory]:
        """``put_many`` by subject_ref (``unmentioned`` as there); ``mention_refs``
        (one tuple per item) gives mentions as refs already, ``produced_by`` the
        assets' (kind, producer, producer version) (rebuilding derived assets);
        ``carried_detected`` are mentions of ``mention_refs`` carried over from an
        earlier version that were detected there (they stay counted as detected);
        ``kept_sources`` are sources the memory had already (an update keeps them
        even once they are deleted); ``kept`` is what the rows at (namespace, key)
        keep of the rows they rewrite (``Kept``); ``unchanged`` the rows a rewrite
        read at those names, which must still be there under the lock (else
        ``Changed``, nothing written)."""
        guard = self._catalog.guard(ref)
        current_epoch = self._catalog.enforce(ref, guard, epoch)
        now = self._clock()
        now_us = to_us(now)
        prepared = []
        # (scope, purpose, category) -> (scope name, purpose, category, retain_until):
        # a batch usually has one, so policy and consent are looked up once.
        targets: dict[tuple[str, str | None, str | None], tuple[str, str, str, int]] = {}
        # Subjects whose registered identifiers are in each item (one catalog query),
        # and per (namespace, key) those of them no caller declared.
        found = self._mentions.find(ref, items)
        if unmentioned and any(found):
            raise InvalidInput(_NAMES_SOMEONE)
        detected: dict[tuple[tuple[str, ...], str], frozenset[str]] = {}
        if any(found) and not kept_sources:
            self._check_derived_names(ref, items)
        for n_item, item in enumerate(items):
            ns, k = _namespace(item.namespace), _key(item.key)
            raw = self._encode(item.value)
            target = targets.get((item.scope, item.purpose, item.category))
            if target is None:
                target = self._target(ref, item, now)
                if target[0] in guard.scopes:
                    raise SubjectSuppressed(
                        f"scope {target[0]!r} of subject_ref {ref} is suppressed"
                    )
                targets[(item.scope, item.purpose, item.category)] = target
            if mention_refs is not None:
                mentioned = tuple(sorted(set(mention_refs[n_item])))
            else:
                mentioned = (
                    tuple(sorted({self._ref(m) for m in item.mentions})) if item.mentions else ()
                )
            detected[(ns, k)] = found[n_item].difference(mentioned) | carried_detected.intersection(
                mentioned
            )
            if found[n_item]:
                mentioned = tuple(sorted(found[n_item].union(mentioned)))
            for source in item.sources:
                if not isinstance(source, str) or not source:
                    raise InvalidInput("sources are asset ids")
            if item.ttl is not None:
                if item.ttl <= timedelta(0):
                    raise InvalidInput("a ttl is positive")
                capped = min(target[3], now_us + int(item.ttl.total_seconds() * 1_000_000))
                target = (target[0], target[1], target[2], capped)
            keep = kept.get((ns, k)) if kept else None
            if keep is not None and keep.retain_us is not None:
                target = (target[0], target[1], target[2], min(target[3], keep.retain_us))
            prepared.append((ns, k, raw, *target, mentioned, item))
        if not prepared:
            return []
        # Who the sources are about (their holders and mentions, transitively): one
        # catalog query for the batch, before the lock. They become key owners.
        source_owners = (
            self._catalog.source_owners({s for *_, item in prepared for s in item.sources})
            if self._sealer.encrypted and any(item.sources for *_, item in prepared)
            else {}
        )
        if source_owners:
            for source, owners in self._sealed_owners(ref, source_owners).items():
                source_owners[source] |= owners
        if self._sealer.encrypted:
            # A new source the catalog does not hold gives no owner, so the value
            # derived from it would go under the holder's key alone: refused. It was
            # deleted or erased (a value read before its subject's erasure completed
            # would otherwise outlive it) or never registered.
            for *_, item in prepared:
                for source in item.sources:
                    if source not in source_owners and source not in kept_sources:
                        raise NotFound(
                            "a source asset is not in the catalog: deleted, erased or "
                            "never registered"
                        )

        part = self._partition(ref)
        # Embedding is slow: do it before taking the partition lock. The fields of an
        # existing memory (index=None) are read now; a concurrent change of them is
        # caught under the lock below and embedded there.
        part.ensure_loaded(refresh=False)  # caught up with others under the lock
        # Lookup hashes computed here (only if the index key exists: no key is created
        # before the lock) are reused under the lock while that key is unchanged.
        lookups: list[str | None] = [
            self._early_lookup(part, ns, k) if item.index is None else None
            for ns, k, _, *_, item in prepared
        ]
        index_key = part.lookup_key_id
        fields = [self._fields(part, lookups[n], item) for n, (*_, item) in enumerate(prepared)]
        # The space's embedder (the handle's unless the caller brought one).
        embed_with, space = self._space(embedder) if any(fields) else (None, DEFAULT_SPACE)
        vectors = self._embed_rows(prepared, fields, embed_with) if embed_with else []
        vectors += [[] for _ in range(len(prepared) - len(vectors))]
        with part.flocked():
            # Again under the lock: the erasure coordinator destroys keys and drops
            # partitions under this lock, after suppressing. A writer that gets here
            # after a suppression stops before touching (or creating) any key.
            self._catalog.enforce(ref, self._catalog.guard(ref), epoch)
            rows: list[MemoryRow] = []
            replaced = False
            seen: dict[str, MemoryRow] = {}
            for n, (ns, k, raw, scope, purpose, category, retain, mentioned, item) in enumerate(
                prepared
            ):
                early = lookups[n] if part.lookup_key_id == index_key else None
                lookup = early or part.lookup(ns, k)
                # An opaque row at this name (its shared key destroyed) is replaced
                # like any other: same asset, its vectors and catalog row renewed.
                old = seen.get(lookup) or part.rows.get(lookup) or part.opaque.get(lookup)
                if unchanged is not None and (ns, k) in unchanged and old != unchanged[(ns, k)]:
                    raise Changed  # nothing staged yet: the lock is left as it was
                replaced = replaced or old is not None
                if item.index is None and old is not None and old.index != fields[n]:
                    fields[n] = old.index
                    if embed_with is None:
                        embed_with, space = self._space(embedder)
                    vectors[n] = self._embed_one(raw, old.index, embed_with)
                row = MemoryRow(
                    memory_id=old.memory_id if old else _new_id(now_us),
                    namespace=ns,
                    key=k,
                    value=raw,
                    scope=scope,
                    purpose=purpose,
                    category=category,
                    # One microsecond per item of the batch: its items keep their
                    # order (LangGraph's insertion order) where a clock tick would tie.
                    created_us=old.created_us if old else now_us + n,
                    updated_us=now_us + n,
                    retain_us=retain,
                    lookup=lookup,
                    sources=tuple(dict.fromkeys(item.sources)),  # one edge per source
                    mentions=mentioned,
                    index=fields[n],
                )
                seen[lookup] = row
                rows.append(row)
            last = {r.lookup: i for i, r in enumerate(rows)}  # last write of a key wins
            if len(last) < len(rows):
                # A write the batch overwrites is not stored, but it is refused all the
                # same if it is about an erased subject: the batch is all-or-nothing,
                # as the same writes one by one would be.
                stored = set(last.values())
                for owner in {m for i, r in enumerate(rows) if i not in stored for m in r.mentions}:
                    if owner != ref:
                        self._check_owner(owner)
            vectors = [vectors[i] for i in last.values()]
            rows = [rows[i] for i in last.values()]
            if self._sealer.encrypted:
                rows = self._seal_shared(ref, rows, source_owners, kept or {})
            previous = {
                r.lookup: part.rows.get(r.lookup) or part.opaque.get(r.lookup) for r in rows
            }
            stale = [v for p in previous.values() if p is not None for v in _vector_ids(p)]
            vec_items = [
                # Stamped with the row's own version (``_repair`` compares them): a
                # batch's rows are a microsecond apart.
                VectorItem(r.memory_id, i, f, r.scope, r.updated_us, vec, row_key_id(r), space)
                for r, vecs in zip(rows, vectors, strict=True)
                for i, (f, vec) in enumerate(vecs)
            ]
            # The vectors are rows of the catalog too: sealed here, written in the
            # same transaction as the rows and their assets (one commit, nothing to
            # undo if it fails).
            staged = (
                self._vector_store().stage(
                    ref, vec_items, replace=[p.memory_id for p in previous.values() if p]
                )
                if vec_items or stale
                else None
            )
            # Namespaces new for the subject (or emptied: a key moved) are indexed
            # in the same transaction; an existing namespace costs nothing.
            ns_before = self._ns_before(
                part, [*rows, *(p for p in previous.values() if p is not None)]
            )
            # Staged: the hot rows go in with the assets, in one transaction.
            part.append_puts(rows, commit=False)
            ns_run = self._ns_change(ref, part, ns_before, rows, [previous[r.lookup] for r in rows])
            faults.reached("put.after_log")
            self._register_rows(
                ref,
                rows,
                expected_epoch=current_epoch,
                replace=replaced or bool(vec_items),
                remove=stale,
                produced_by=produced_by,
                detected=[(r.memory_id, m) for r in rows for m in detected[(r.namespace, r.key)]],
                also=_both(_both(part.take_staged(), ns_run), staged.run if staged else None),
            )
            part.committed()
            # Nothing of the rows or vectors committed if that raised; the partition
            # drops its cache as the exception leaves its lock.
            if staged is not None:
                staged.done()
            faults.reached("put.after_catalog")
            if part.log_records >= self._flush_records:
                part.flush()
        return [_memory(r) for r in rows]

    def _check_derived_names(self, ref: str, items: Sequence[PutItem]) -> None:
        """A derived asset's namespace and key stay readable under the holder's
        own key (its rebuild after an erasure needs them), so they may not carry
        another subject's registered identifier: that would outlive the subject's
        erasure in the rebuilt asset. Values are sealed under the owners' key."""
        derived = [
            PutItem(item.namespace, item.key, None, item.scope)
            for item in items
            if item.sources and isinstance(item.scope, str)
        ]
        if derived and any(self._mentions.find(ref, derived)):
            raise InvalidInput(
                "a derived asset's namespace and key stay readable after the erasure "
                "of the subjects it is about (its rebuild needs them): they may not "
                "hold another subject's registered identifier"
            )

    def _seal_shared(
        self,
        ref: str,
        rows: list[MemoryRow],
        source_owners: Mapping[str, set[str]],
        kept: Mapping[tuple[tuple[str, ...], str], Kept],
    ) -> list[MemoryRow]:
        """Seal every row whose owner set is more than its holder (the subjects it
        mentions, the owners of its sources) under the key of that owner set: one
        key per (holder, scope, owner set), shared by all its rows, created here
        under the partition lock like every first key of a subject."""
        keys: dict[tuple[str, tuple[str, ...]], DataKey] = {}
        checked: set[str] = set()
        out = []
        for r in rows:
            owners = set(r.mentions)
            for source in r.sources:
                owners |= source_owners.get(source, set())
            keep = kept.get((r.namespace, r.key))
            if keep is not None and (
                not keep.while_gone or any(s not in source_owners for s in r.sources)
            ):
                owners |= set(keep.owners)
            # The holder's own data of this scope is under the scope key already; of
            # another scope it stays an owner (withdrawing that scope kills this key).
            owners -= {ref, owner_token(ref, r.scope)}
            if not owners:
                out.append(r)
                continue
            for owner in owners - checked:
                # Data about a subject that is being erased (or was) is refused before
                # a key is created for it: a key made after the erasure destroyed the
                # subject's keys would carry the data past it. The catalog refuses the
                # mention again in the write transaction, and the erasure sweeps any
                # key created in between.
                self._check_owner(owner)
                checked.add(owner)
            wanted = (r.scope, tuple(sorted(owners)))
            key = keys.get(wanted)
            if key is None:
                key = keys[wanted] = self._keyring.data_key(ref, r.scope, owners=wanted[1])
            out.append(seal_row(key, ref, r))
        # Checked again once every key exists: a key made before a suppression is
        # one that erasure's destroy step finds, one made after is refused here.
        # Without this, a whole erasure (its verify sweep included) that ran between
        # the first check and the key's creation left the key alive, and the row the
        # catalog then refused stayed readable in the log and the vectors under it.
        for owner in checked:
            self._check_owner(owner)
        return out

    def _sealed_owners(self, ref: str, asset_ids: Iterable[str]) -> dict[str, set[str]]:
        """The other owners of the key each listed memory's row is sealed under.

        The catalog's walk (``source_owners``) finds a source's owners through the
        provenance it still holds, and a deleted memory leaves the catalog: a summary
        built from it still holds its text, under a key still owned by its subject,
        but the walk no longer reaches that subject. A value built from the summary
        then went under a key its subject did not own, and stayed readable after
        that subject's erasure. The key the summary was sealed under still names
        every owner it had when written: they own what is built from it too.

        Reading those key ids loads each holder's partition (its rows decrypted into
        this process's cache): a holder being erased is refused first, as the write
        would be once its owners are checked, so that its rows are not decrypted
        again after its suppression's eviction dropped them."""
        by_holder: dict[str, set[str]] = {}
        for asset_id in asset_ids:
            asset = self._catalog.asset(asset_id)
            if asset is not None:
                by_holder.setdefault(asset.subject_ref, set()).add(asset_id)
        key_of: dict[str, bytes] = {}
        for holder in by_holder:
            if holder != ref:  # (``ref``'s own guard was enforced by the caller)
                self._check_owner(holder)
        for holder, owned in by_holder.items():
            part = self._partition(holder)
            part.ensure_loaded()
            for row in part.all_rows():
                key_id = row_key_id(row) if row.memory_id in owned else None
                if key_id is not None:
                    key_of[row.memory_id] = key_id
        if not key_of:
            return {}
        owners = self._keyring.owners_of(set(key_of.values()))
        return {a: set(owners.get(k, ())) for a, k in key_of.items()}

    def _check_owner(self, owner: str) -> None:
        """Refuse data about an owner (``ref``, or ``ref@scope``: its data in that
        scope) whose subject, or that scope of it, is suppressed or erased."""
        subject, _, scope = owner.partition("@")
        try:
            self._catalog.check_guard(subject, scope=scope or None)
        except SubjectSuppressed:
            raise SubjectSuppressed(
                f"the memory is about subject_ref {subject}, which is being erased or was erased"
            ) from None

    @staticmethod
    def _early_lookup(part: Partition, ns: tuple[str, ...], key: str) -> str | None:
        if not part.rows:
            return None
        try:  # before the partition lock: never create a key here
            return part.lookup(ns, key, create=False)
        except (KeyNotFound, SubjectErased):
            return None

    def _fields(self, part: Partition, lookup: str | None, item: PutItem) -> tuple[str, ...]:
        if item.index is None:
            old = part.rows.get(lookup) if lookup is not None else None
            return old.index if old is not None else ()
        if item.index is False:
            return ()
        if item.index is True:
            return ("$",)
        if isinstance(item.index, str):
            return (item.index,)
        paths = tuple(dict.fromkeys(item.index))
        if not all(isinstance(p, str) and p for p in paths):
            raise InvalidInput("index paths are non-empty strings")
        return paths

    def _target(self, ref: str, item: PutItem, now: datetime) -> tuple[str, str, str, int]:
        """Resolve scope, purpose and category, check consent, compute retention."""
        rule, purpose, category = self._policy.resolve(item.scope, item.purpose, item.category)
        consent_end = None
        if rule.needs_consent:
            consent = self._catalog.active_consent(ref, purpose, category, "store", now)
            if consent is None:
                raise ConsentRequired(
                    f"no active consent of subject_ref {ref} for purpose {purpose!r}, "
                    f"category {category!r}"
                )
            consent_end = consent.end_at
        retain = to_us(self._policy.retain_until(rule, now, consent_end))
        return rule.name, purpose, category, retain


def _both(
    first: Callable[[Any], None] | None, then: Callable[[Any], None] | None
) -> Callable[[Any], None] | None:
    """Two sets of statements for one cursor, in order (either may be None)."""
    if first is None or then is None:
        return first or then

    def run(cur: Any) -> None:
        first(cur)
        then(cur)

    return run


def _callers(item: PutItem) -> None:
    """Refuse an item a caller may not write: bad fields, or keyshred's own
    namespaces (``~``)."""
    _caller_namespace(_checked(item).namespace)
