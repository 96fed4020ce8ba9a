"""The read path: ``get``, ``search`` (with LangGraph's filter language), ``history``,
``count``, and the reads by subject_ref of the erasure coordinator and exports.

Every read by subject is guard-checked; suppressed scopes and memories past their
retention are invisible, as if already gone.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, TypeAlias, TypeVar

from keyshred._validate import check_count, check_filter, check_text
from keyshred.errors import (
    BackendUnavailable,
    InvalidInput,
    KeyNotFound,
    SubjectErased,
    SubjectSuppressed,
)
from keyshred.storage.catalog_base import ACTIVE, ERASED, GuardState
from keyshred.storage.embeddings import Embedder
from keyshred.storage.memory_index import IndexMixin
from keyshred.storage.memory_types import (
    _VERSION_SEP,
    HISTORY,
    MEMORY_KIND,
    Memory,
    _key,
    _memory,
    _namespace,
    _newest_first,
    _prefix,
    _storage_key,
    _version_of,
)
from keyshred.storage.namespaces import Listed
from keyshred.storage.partition import (
    MemoryRow,
    Partition,
    from_us,
    lookup_hash,
    lookup_key_of,
    namespace_part,
    newest_row,
    row_key_id,
    to_us,
)
from keyshred.storage.vectors import DEFAULT_SPACE

__all__ = ["ReadMixin", "compile_filter"]

T = TypeVar("T")
# The first time of a namespace as the namespace index knows it (None: unknown).
NamespaceFirst: TypeAlias = Callable[[tuple[str, ...]], int | None]
# One read's partition (None: it read the catalog alone, ``_keyed``), how often it
# had been closed when handed out, and its answer.
Read: TypeAlias = tuple[Partition | None, int, T]
_ATTEMPTS = 3
# A get of a subject whose partition is not loaded reads it from the catalog alone
# if it is at most this many hot rows and no segment (``newest_row``); else it loads.
_KEYED_RECORDS = 32


class ReadMixin(IndexMixin):
    """Reads of memories, by subject and by subject_ref."""

    # -- reads -------------------------------------------------------------------------

    def _row(
        self, subject: Any, namespace: Sequence[str] | str, key: str, *, keyed: bool = False
    ) -> MemoryRow | None:
        ref = self._ref(subject)
        ns, k = _namespace(namespace), _key(key)
        once = self._get_once if keyed else self._row_once
        return self._settled(ref, lambda: once(ref, ns, k))

    def _get_once(self, ref: str, ns: tuple[str, ...], k: str) -> Read[MemoryRow | None]:
        """``_row_once``, from the catalog alone where that decides (``_keyed``)."""
        guard = self._catalog.guard(ref)
        self._catalog.enforce(ref, guard, None)
        found = self._keyed(ref, ns, k, guard.scopes)
        if found is None:
            return self._row_once(ref, ns, k, guard)
        row = found[0]
        if row is not None and row.retain_us <= to_us(self._clock()):
            row = None  # past its retain-until: gone for every read
        return None, 0, row

    def _row_once(
        self, ref: str, ns: tuple[str, ...], k: str, guard: GuardState | None = None
    ) -> tuple[Partition, int, MemoryRow | None]:
        if guard is None:  # (else the caller read and enforced it)
            guard = self._catalog.guard(ref)
            self._catalog.enforce(ref, guard, None)
        part, closes = self._reading(ref)
        if not part.rows:  # no lookup key is created just to read nothing
            return part, closes, None
        row = part.rows.get(part.lookup(ns, k))
        if row is not None and row.scope in guard.scopes:
            raise SubjectSuppressed(f"scope {row.scope!r} of subject_ref {ref} is suppressed")
        if row is not None and row.retain_us <= to_us(self._clock()):
            return part, closes, None  # past its retain-until: gone for every read
        return part, closes, row

    def _keyed(
        self, ref: str, ns: tuple[str, ...], k: str, hidden: Collection[str]
    ) -> tuple[MemoryRow | None] | None:
        """A get of a subject whose partition is not loaded here, from the catalog's
        newest hot records alone (one statement; ``newest_row``): a spread of gets
        over many subjects loads no partition, decodes one row, and leaves nothing
        decrypted in the cache. ``(row,)`` or ``(None,)`` when they decide, None
        when the partition must be loaded (and then decides). The guard was read
        first; an eviction overlapping the read is ``_settled``'s, as for any read.
        No key is created for a read: a subject without a lookup key goes the
        load's way (which finds nothing)."""
        part = self._partitions.get(ref)
        if part is not None and part.loaded:
            return None  # its cache answers
        try:
            lookup_key = lookup_key_of(self._keyring, self._sealer, ref, create=False)
        except (KeyNotFound, SubjectErased):
            return None
        lookup = lookup_hash(lookup_key, namespace_part(ns), k)
        decided, row = newest_row(
            self._hot,
            self._sealer,
            ref,
            lookup,
            storage_key=_storage_key(ref),
            limit=_KEYED_RECORDS,
            hidden=hidden,
        )
        return (row,) if decided else None

    def _reading(self, ref: str) -> tuple[Partition, int]:
        """The subject's partition, loaded, and how often it had been closed when
        it was handed out (``_settled`` compares)."""
        part = self._partition(ref)
        closes = part.closes
        part.ensure_loaded()
        return part, closes

    def _settled(self, ref: str, read: Callable[[], Read[T]]) -> T:
        """``read`` once more, guard check included, when the partition it used was
        closed while it read (an eviction, or the open-partition limit: a closed
        partition's rows are gone, and its answer may be short), or when an eviction
        of its subject overlapped it (what it cached goes first). After an
        erasure's eviction the next attempt is refused by the guard."""
        for _ in range(_ATTEMPTS):
            seq = self._eviction_seq
            part, closes, out = read()
            if self.evicted_since(seq, ref):
                # Its guard passed before a suppression whose eviction overlapped
                # the read: what the read cached after the eviction goes now.
                self.drop_cached(ref)
                continue
            if part is None or part.closes == closes:
                return out
        raise BackendUnavailable(
            f"the partition of subject_ref {ref} kept being evicted while it was read"
        )

    def get(self, subject: Any, namespace: Sequence[str] | str, key: str) -> Memory | None:
        row = self._row(subject, namespace, key, keyed=True)
        return None if row is None else _memory(row)

    def search(
        self,
        subject: Any,
        namespace_prefix: Sequence[str] | str = (),
        *,
        query: str | None = None,
        filter: Mapping[str, Any] | None = None,
        scope: str | None = None,
        purpose: str | None = None,
        category: str | None = None,
        limit: int = 10,
        offset: int = 0,
        embedder: Embedder | None = None,
    ) -> list[Memory]:
        """Memories under a namespace prefix, with metadata filters (scope, purpose,
        category) and value filters (``{"field": value}`` or ``{"field": {"$gt": 3}}``)
        applied first. Without ``query``: newest first. With ``query``: ranked by
        cosine similarity inside this subject's own vectors (only indexed memories
        match), each result carrying its ``score``; ``embedder`` searches the
        vectors of its embedding space (see ``put``) instead of the handle's."""
        return self.search_ref(
            self._ref(subject),
            namespace_prefix,
            query=query,
            filter=filter,
            scope=scope,
            purpose=purpose,
            category=category,
            limit=limit,
            offset=offset,
            embedder=embedder,
        )

    def search_ref(
        self,
        ref: str,
        namespace_prefix: Sequence[str] | str = (),
        *,
        query: str | None = None,
        filter: Mapping[str, Any] | None = None,
        scope: str | None = None,
        purpose: str | None = None,
        category: str | None = None,
        limit: int = 10,
        offset: int = 0,
        order: str = "newest",
        embedder: Embedder | None = None,
        unscored: bool = False,
        namespace_first: NamespaceFirst | None = None,
    ) -> list[Memory]:
        """``search`` by subject_ref (guard-checked); ``order="insertion"`` lists
        without a query oldest first, namespace by namespace (namespaces ordered by
        ``namespace_first``, the index's first time of each, where it knows one;
        else by their oldest match). With a query and
        ``unscored``, candidates without a vector in the space (not indexed, or
        nothing to embed) fill what the ranked ones leave of ``limit``, in insertion
        order with no score (LangGraph's ``InMemoryStore`` does so)."""
        check_count(limit, "limit")
        check_count(offset, "offset")
        check_filter(filter)
        if query is not None:
            check_text(query, "a query")
        prefix = _prefix(namespace_prefix)
        return self._settled(
            ref,
            lambda: self._search_once(
                ref,
                prefix,
                query=query,
                filter=filter,
                scope=scope,
                purpose=purpose,
                category=category,
                limit=limit,
                offset=offset,
                order=order,
                embedder=embedder,
                unscored=unscored,
                namespace_first=namespace_first,
            ),
        )

    def _search_once(
        self,
        ref: str,
        prefix: tuple[str, ...],
        *,
        query: str | None,
        filter: Mapping[str, Any] | None,
        scope: str | None,
        purpose: str | None,
        category: str | None,
        limit: int,
        offset: int,
        order: str,
        embedder: Embedder | None,
        unscored: bool,
        namespace_first: NamespaceFirst | None = None,
    ) -> Read[list[Memory]]:
        guard = self._catalog.guard(ref)
        self._catalog.enforce(ref, guard, None)
        part, closes = self._reading(ref)
        n = len(prefix)
        hidden = guard.scopes  # suppressed scopes: invisible, as if already erased
        now_us = to_us(self._clock())
        test = compile_filter(filter) if filter else None
        own = bool(prefix) and prefix[0].startswith("~")  # keyshred's own namespaces asked for

        def wanted(row: MemoryRow) -> bool:
            if row.namespace[:n] != prefix or row.scope in hidden or row.retain_us <= now_us:
                return False
            if not own and row.namespace[0].startswith("~"):
                return False  # history versions are not search results
            if scope is not None and row.scope != scope:
                return False
            if purpose is not None and row.purpose != purpose:
                return False
            if category is not None and row.category != category:
                return False
            return test is None or bool(test(part.parsed_value(row)))

        if query is not None:
            found = self._semantic(
                ref,
                part,
                wanted,
                query,
                hidden=hidden,
                limit=limit,
                offset=offset,
                embedder=embedder,
                unscored=unscored,
                namespace_first=namespace_first,
            )
            return part, closes, found
        hits = [row for row in list(part.rows.values()) if wanted(row)]
        if order == "insertion":
            # Oldest first, namespaces in the order they first appeared (LangGraph's
            # InMemoryStore order); only the slice asked for becomes Memory objects.
            ordered = _insertion_order(hits, offset + limit, first_of=namespace_first)[offset:]
            return part, closes, [_memory(r) for r in ordered]
        # Only the first offset + limit are wanted: a bounded heap, not a full sort.
        top = heapq.nlargest(offset + limit, hits, key=_newest_first)
        return part, closes, [_memory(r) for r in top[offset:]]

    def _semantic(
        self,
        ref: str,
        part: Partition,
        wanted: Callable[[MemoryRow], bool],
        query: str,
        *,
        hidden: frozenset[str],
        limit: int,
        offset: int,
        embedder: Embedder | None = None,
        unscored: bool = False,
        namespace_first: NamespaceFirst | None = None,
    ) -> list[Memory]:
        """Rank the subject's vectors in the space, then keep the rows ``wanted``
        as they come up in rank order: the filter costs what the ranking reaches,
        not a pass over every memory of the subject (issue 25). The ``unscored``
        fill orders namespaces as ``namespace_first`` tells where it knows them."""
        if not isinstance(query, str):
            raise InvalidInput("a query is a string")
        if limit == 0:
            return []
        vectors = self._vector_store()
        if part.take_foreign_change():
            # Another worker wrote this subject: its vectors are not in our cache.
            vectors.evict(ref)
        embed_with, space = self._space(embedder)
        self._fresh_vectors(ref, part, vectors, embedder=embed_with, space=space, hidden=hidden)
        out: list[Memory] = []
        by_id = part.by_id
        if vectors.count(ref, space):

            def accept(memory_id: str) -> bool:
                row = by_id.get(memory_id)
                return row is not None and bool(row.index) and wanted(row)

            q = embed_with.embed_query(query)
            # LangGraph's store (``unscored``) orders equal scores as InMemoryStore
            # does, by namespace and insertion: it gets every memory tied with the
            # last one asked for, scored in float64, and cuts itself (Hypothesis
            # found the two keeping different ones of two equal texts at a limit).
            # A search of the memory store's own ranks in float32 and leaves equal
            # scores in the vectors' order: the ties' window and the rescoring cost
            # 30-60 us on a 1,000-vector subject, as much as the ranking itself.
            ranked = vectors.search(
                ref, q, offset + limit, space=space, accept=accept, ties=unscored
            )
            # ``by_id`` is live: a memory deleted by another thread since it was
            # ranked is no result (not a KeyError).
            found = [(by_id.get(mid), score) for mid, score in ranked[offset:]]
            out = [Memory(row, score) for row, score in found if row is not None]
        if unscored and len(out) < limit:
            # Fewer ranked results than asked: every wanted memory with vectors is
            # in ``out`` already, the rest fill up in insertion order.
            candidates = [r for r in part.rows.values() if wanted(r)]
            have = vectors.memory_ids(ref, space)
            rest = [r for r in candidates if r.memory_id not in have]
            # Namespaces ordered by when they first held a memory (the index's
            # time; InMemoryStore's order), else by their first candidate, ranked
            # or not: a filter can leave out a namespace's older items.
            picked = _insertion_order(
                rest, limit - len(out), among=candidates, first_of=namespace_first
            )
            out += [Memory(r) for r in picked]
        return out

    def count(self, subject: Any) -> int:
        ref = self._ref(subject)

        def once() -> Read[int]:
            self._catalog.check_guard(ref)
            part, closes = self._reading(ref)
            return part, closes, len(part.rows)

        return self._settled(ref, once)

    # -- history (written by ``correct``) ----------------------------------------------

    @staticmethod
    def _history_ns(ns: tuple[str, ...]) -> tuple[str, ...]:
        return (HISTORY, *ns)

    def _history_rows(self, part: Partition, ns: tuple[str, ...], k: str) -> list[MemoryRow]:
        """The readable history versions of (``ns``, ``k``)."""
        hns = self._history_ns(ns)
        return [
            r
            for r in part.rows.values()
            if r.namespace == hns and (v := _version_of(r.key)) is not None and v[0] == k
        ]

    def _next_version(self, part: Partition, ns: tuple[str, ...], k: str) -> int:
        """One past the highest version kept. Not the count: an erasure removes the
        versions about the erased subject, and a count then named the next version
        after one still kept, overwriting it. Nor a number an unreadable version
        holds (its key destroyed by an erasure still under way: its name is sealed,
        its lookup hash is not): a correction written there would replace it under
        its asset id, which that erasure then deletes."""
        n = 1 + max(
            (v[1] for r in self._history_rows(part, ns, k) if (v := _version_of(r.key))),
            default=0,
        )
        if part.opaque:
            hns = self._history_ns(ns)
            try:
                while part.lookup(hns, f"{k}{_VERSION_SEP}{n:08d}", create=False) in part.opaque:
                    n += 1
            except (KeyNotFound, SubjectErased):
                pass  # no index key: no row at any name
        return n

    def history(
        self, subject: Any, namespace: Sequence[str] | str, key: str
    ) -> list[dict[str, Any]]:
        """Every superseded version (oldest first), then the current value:
        ``{"value", "valid_from", "valid_to", "reason", "version"}``. As every read:
        nothing of a suppressed scope (``SubjectSuppressed`` if the current value is
        in one; its versions are left out) and nothing past its retain-until."""
        ref = self._ref(subject)
        ns, k = _namespace(namespace), _key(key)

        def once() -> Read[list[dict[str, Any]]]:
            part, closes, current = self._row_once(ref, ns, k)
            hidden = self._catalog.guard(ref).scopes  # (read again: cached, and no laxer)
            now_us = to_us(self._clock())
            versions = [
                r
                for r in self._history_rows(part, ns, k)
                if r.scope not in hidden and r.retain_us > now_us
            ]
            versions.sort(key=lambda r: r.key)
            out = [json.loads(r.value) for r in versions]
            if current is not None:
                out.append(
                    {
                        "value": json.loads(current.value),
                        "valid_from": from_us(current.updated_us).isoformat(),
                        "valid_to": None,
                        "reason": None,
                        "version": self._next_version(part, ns, k),
                    }
                )
            return part, closes, out

        return self._settled(ref, once)

    # -- by subject_ref: the erasure coordinator's and exports' entry points -----------

    def expired(self, row: MemoryRow) -> bool:
        """Whether ``row`` is past its retain-until (gone for every read)."""
        return row.retain_us <= to_us(self._clock())

    def rows_by_id(
        self, ref: str, memory_ids: Iterable[str], *, opaque: bool = False, live: bool = False
    ) -> dict[str, MemoryRow]:
        """Rows of ``ref`` by memory id (no guard check: the coordinator decides);
        with ``opaque`` also those whose shared key is destroyed (``row.opaque``:
        no value; a derived asset keeps its namespace and key, for its rebuild);
        with ``live`` only those within their retain-until, as every read."""
        wanted = set(memory_ids)
        part = self._partition(ref)
        part.ensure_loaded()
        rows = part.all_rows() if opaque else part.rows.values()
        if live:
            now = to_us(self._clock())
            return {r.memory_id: r for r in rows if r.memory_id in wanted and r.retain_us > now}
        return {r.memory_id: r for r in rows if r.memory_id in wanted}

    def namespaces_ref(self, ref: str, prefix: Sequence[str] = ()) -> set[tuple[str, ...]]:
        """The namespaces of ``ref``'s live memories under ``prefix`` (guard-checked)."""
        p = tuple(prefix)

        def once() -> Read[set[tuple[str, ...]]]:
            guard = self._catalog.guard(ref)
            self._catalog.enforce(ref, guard, None)
            part, closes = self._reading(ref)
            now = to_us(self._clock())
            if part.earliest_retain_us > now:
                # No row is past its retention: the namespaces counted, not every row.
                found = {
                    ns
                    for ns, scope, _ in list(part.ns_counts)
                    if ns[: len(p)] == p and scope not in guard.scopes and not ns[0].startswith("~")
                }
                return part, closes, found
            found = {
                r.namespace
                for r in list(part.rows.values())
                if r.namespace[: len(p)] == p
                and r.scope not in guard.scopes
                and r.retain_us > now
                and not r.namespace[0].startswith("~")
            }
            return part, closes, found

        return self._settled(ref, once)

    # -- across subjects: answered from the namespace index ----------------------------

    def namespace_hash(self, namespace: Sequence[str]) -> str:
        """The namespace index's keyed hash of a namespace or prefix."""
        return self._ns.hash(tuple(namespace))

    def index_pending(self) -> int:
        """Index the namespaces of partitions written before the index existed
        (revision 0011 lists them), each from its partition under its lock; runs
        before every read across subjects, so the first one after an upgrade pays
        for it once. Returns how many subjects were indexed."""
        n = 0
        for ref in self._ns.pending():
            status = self._catalog.guard(ref).status
            if status == ERASED:
                self._ns.drop(ref)  # nothing of it to list, ever
                continue
            if status != ACTIVE:
                continue  # an erasure in progress: its drop takes the mark
            part = self._partition(ref)
            try:
                with part.flocked():
                    self._ns.replace(ref, self._ns_entries(ref, part))
            except (SubjectSuppressed, SubjectErased):
                continue  # suppressed meanwhile
            n += 1
        return n

    def subjects_under(self, prefix: Sequence[str] = ()) -> list[str]:
        """The subjects (refs) holding namespaces under ``prefix``, from the index:
        neither suppressed nor erased, and without those of only suppressed scopes."""
        self.index_pending()
        return sorted({r.subject_ref for r in self._ns.listed(_prefix(prefix))})

    def namespaces_across(
        self,
        prefix: Sequence[str] = (),
        *,
        select: Callable[[tuple[str, ...]], tuple[str, ...] | None] | None = None,
        first: int | None = None,
    ) -> list[tuple[str, ...]]:
        """The namespaces of live memories under ``prefix`` of every subject, sorted
        and distinct, each as ``select`` maps it (None leaves it out: LangGraph's
        match conditions and ``max_depth``), only the ``first`` of them if given.

        Read from the index a page at a time (``NamespaceIndex.pages``): what is
        held is one page and the ``first`` namespaces found so far, however many
        subjects the catalog holds; only the visible rows are decrypted. The order
        is the labels' own, which only their plaintext tells, so every row under
        the prefix is read. Subjects holding memories past their retention that the
        sweep has not deleted yet are read from their partitions (the index cannot
        tell whether such a namespace still has a live memory)."""
        p = _prefix(prefix)
        if first is not None:
            check_count(first, "first")
        self.index_pending()
        seq = self._eviction_seq
        expired = self._catalog.expired(MEMORY_KIND, self._clock())
        stale: set[str] = set()
        found: set[tuple[str, ...]] = set()

        def keep(namespaces: Iterable[tuple[str, ...]]) -> None:
            nonlocal found
            for ns in namespaces:
                if ns[: len(p)] != p:
                    continue
                out = ns if select is None else select(ns)
                if out is not None:
                    found.add(out)
            if first is not None and len(found) > 2 * first + self._ns.page_size:
                found = set(heapq.nsmallest(first, found))

        def visible(rows: Sequence[Listed]) -> list[Listed]:
            # Decided again before decrypting, for the page at once: a suppression
            # since the index query (its guard, or its eviction heard here) hides
            # the subject or scope.
            guards = self._catalog.guards({r.subject_ref for r in rows})
            return [
                r
                for r in rows
                if guards[r.subject_ref].status == ACTIVE
                and r.scope not in guards[r.subject_ref].scopes
                and not self.evicted_since(seq, r.subject_ref)
            ]

        # The keys unwrapped go into the keyring's cache while they fill at most
        # half of it (a store that small stays warm for the next listing); past
        # that, a listing of every subject would push the hot keys out.
        room = self._keyring.cache.capacity // 2
        for page in self._ns.pages(p, labels=True):
            stale.update(r.subject_ref for r in page if r.subject_ref in expired)
            live = [r for r in page if r.subject_ref not in expired]
            room -= len({r.key_id for r in live})
            keep(self._ns.open_labels(live, visible, cache=room >= 0).values())
        for ref in sorted(stale):
            try:
                keep(self.namespaces_ref(ref, p))
            except (SubjectSuppressed, SubjectErased):
                continue  # suppressed meanwhile
        ordered = sorted(found)
        return ordered if first is None else ordered[:first]

    def namespace_first(self, ref: str, prefix: Sequence[str] = ()) -> NamespaceFirst:
        """The namespace index's first time of each of ``ref``'s namespaces under
        ``prefix`` (when the namespace first held a memory: LangGraph's order of
        namespaces), read with one query at the first question; ``_insertion_order``
        asks only when the hits span two namespaces or more. A namespace the index
        does not know (a partition not indexed yet) gets None: its oldest hit."""
        firsts: dict[str, int] | None = None
        p = _prefix(prefix)

        def first_of(ns: tuple[str, ...]) -> int | None:
            nonlocal firsts
            if firsts is None:
                firsts = {}
                for r in self._ns.listed(p, refs=[ref]):
                    firsts[r.ns_hash] = min(firsts.get(r.ns_hash, r.first_us), r.first_us)
            return firsts.get(self._ns.hash(ns))

        return first_of

    def search_across(
        self,
        prefix: Sequence[str] = (),
        *,
        filter: Mapping[str, Any] | None = None,
        limit: int = 10,
        offset: int = 0,
    ) -> list[Memory]:
        """Memories under ``prefix`` of every subject in LangGraph's insertion order
        (namespaces by the index's first time, then oldest first), opening only the
        subjects the index lists under the prefix, in the order of their namespaces,
        and no further than the page asked for needs: a subject whose namespaces all
        come after the last memory of the page is never opened."""
        check_count(limit, "limit")
        check_count(offset, "offset")
        check_filter(filter)
        p = _prefix(prefix)
        self.index_pending()
        want = offset + limit
        if limit == 0:
            return []
        pool: list[tuple[tuple[int, int, str], Memory]] = []
        bound: tuple[int, int, str] | None = None  # the order of the page's last memory
        opened: set[str] = set()
        # The index a page at a time in the order of the namespaces' first times: a
        # subject comes up at its earliest namespace, and once a namespace sorts
        # after the page's last memory, so does every later one: no further page
        # is read (the whole index was read and sorted before: 21 s over 1,000,000
        # subjects for a page of 10).
        seen: dict[tuple[str, str], int] = {}  # (ref, namespace hash) -> first time
        for rows in self._ns.pages(p, by_first=True, first_size=4 * want):
            if bound is not None and rows and rows[0].first_us > bound[0]:
                break
            for r in rows:  # in first-time order: the first row of each is its first
                seen.setdefault((r.subject_ref, r.ns_hash), r.first_us)
            for r in rows:
                if bound is not None and r.first_us > bound[0]:
                    return _page_of(pool, offset, want)
                if r.subject_ref in opened:
                    continue
                opened.add(r.subject_ref)
                # A namespace of the subject first used after the rows read so far
                # is asked of the index (one keyed query, only then).
                later = self.namespace_first(r.subject_ref, p)

                def first_of(
                    ns: tuple[str, ...], ref: str = r.subject_ref, later: NamespaceFirst = later
                ) -> int | None:
                    known = seen.get((ref, self._ns.hash(ns)))
                    return known if known is not None else later(ns)

                try:
                    found = self.search_ref(
                        r.subject_ref,
                        p,
                        filter=filter,
                        limit=want,
                        order="insertion",
                        namespace_first=first_of,
                    )
                except (SubjectSuppressed, SubjectErased):
                    continue  # suppressed since the index was read: skipped
                for m in found:
                    created = to_us(m.created_at)
                    ns_first = first_of(tuple(m.namespace))
                    pool.append(((created if ns_first is None else ns_first, created, m.key), m))
                if len(pool) >= want:
                    pool = heapq.nsmallest(want, pool, key=lambda t: t[0])
                    bound = pool[-1][0]
        return _page_of(pool, offset, want)

    def count_ref(self, ref: str) -> int:
        """How many memories ``ref``'s partition holds (loads it; no guard check)."""
        part = self._partition(ref)
        part.ensure_loaded()
        return len(part.rows)

    def memory(self, row: MemoryRow) -> Memory:
        return Memory(row)

    def live_rows(self, ref: str) -> list[MemoryRow]:
        """The live rows of ``ref`` (loads the partition; no guard check). Under
        ``locked(ref)`` they are one point in time (an export)."""
        part = self._partition(ref)
        part.ensure_loaded()
        return list(part.rows.values())

    def key_ids_of(self, ref: str, memory_ids: Iterable[str]) -> dict[str, bytes | None]:
        """The key id each listed row of ``ref`` is sealed under, opaque rows too
        (read from the rows; no key is needed)."""
        rows = self.rows_by_id(ref, memory_ids, opaque=True)
        return {asset_id: row_key_id(row) for asset_id, row in rows.items()}

    def sealed_under(self, ref: str, key_ids: Collection[bytes]) -> list[str]:
        """The ids of ``ref``'s rows sealed under any of ``key_ids``, opaque rows too
        (read from the rows; no key is needed)."""
        part = self._partition(ref)
        part.ensure_loaded()
        return sorted(r.memory_id for r in part.all_rows() if row_key_id(r) in key_ids)

    def probe_hits(self, ref: str, probes: Sequence[str]) -> int:
        """How often the probe strings are found in ``ref``'s memories, by value and
        by meaning (semantic search of its indexed memories). No guard check."""
        rows = self.live_rows(ref)
        hits = sum(1 for r in rows for p in probes if p.encode() in r.value)
        indexed = [r for r in rows if r.index]
        if not indexed or self._vectors is None:
            return hits
        # Every space ``ref`` has vectors in whose embedder this process knows (the
        # handle's, and those stores wrote or searched with); by value above for all.
        for space in sorted(self._vectors.spaces(ref)):
            embedder = self.embedder if space == DEFAULT_SPACE else self._spaces.get(space)
            if embedder is None:
                continue
            for probe in probes:
                q = embedder.embed_query(probe)
                for mid, _ in self._vectors.search(ref, q, 5, space=space):
                    row = next((r for r in indexed if r.memory_id == mid), None)
                    if row is not None and any(p.encode() in row.value for p in probes):
                        hits += 1
        return hits


def _page_of(
    pool: list[tuple[tuple[int, int, str], Memory]], offset: int, want: int
) -> list[Memory]:
    pool.sort(key=lambda t: t[0])
    return [m for _, m in pool[offset:want]]


def _insertion_order(
    rows: list[MemoryRow],
    n: int,
    *,
    among: list[MemoryRow] | None = None,
    first_of: NamespaceFirst | None = None,
) -> list[MemoryRow]:
    """The first ``n`` rows oldest first, namespaces in the order they first
    appeared (LangGraph's ``InMemoryStore`` order) among ``among`` (default: ``rows``),
    or as ``first_of`` tells for the namespaces it knows."""
    source = rows if among is None else among
    if first_of is not None and len({r.namespace for r in source}) < 2:
        first_of = None  # one namespace: no order between namespaces to ask about
    first: dict[tuple[str, ...], int] = {}
    known: set[tuple[str, ...]] = set()
    for r in source:
        if r.namespace in known:
            continue
        if first_of is not None and r.namespace not in first:
            told = first_of(r.namespace)
            if told is not None:
                first[r.namespace] = told
                known.add(r.namespace)
                continue
        ns_first = first.get(r.namespace)
        if ns_first is None or r.created_us < ns_first:
            first[r.namespace] = r.created_us
    return heapq.nsmallest(n, rows, key=lambda r: (first[r.namespace], r.created_us, r.key))


_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "$eq": lambda a, b: bool(a == b),
    "$ne": lambda a, b: bool(a != b),
    "$gt": lambda a, b: float(a) > float(b),
    "$gte": lambda a, b: float(a) >= float(b),
    "$lt": lambda a, b: float(a) < float(b),
    "$lte": lambda a, b: float(a) <= float(b),
}


Predicate = Callable[[Any], bool]


def compile_filter(filter: Mapping[str, Any]) -> Predicate:
    """LangGraph's store filter semantics, compiled once per search: ``{"field":
    value}`` equality (nested dicts and lists compared structurally) and
    ``{"field": {"$gt": 3}}`` operators (``$eq $ne $gt $gte $lt $lte``; an unknown
    operator is ``InvalidInput`` at once, not at the first row)."""
    fields = [(name, _compile(expected)) for name, expected in filter.items()]

    def match(value: Any) -> bool:
        if type(value) is not dict:
            return False
        for name, test in fields:  # noqa: SIM110 - no generator per row (hot path)
            if not test(value.get(name)):
                return False
        return True

    return match


def _compile(expected: Any) -> Predicate:
    if isinstance(expected, Mapping):
        if expected and str(next(iter(expected))).startswith("$"):
            ops = []
            for op, operand in expected.items():
                fn = _OPS.get(op)
                if fn is None:
                    raise InvalidInput(f"unknown filter operator {op!r}")
                ops.append((fn, operand))

            def by_ops(actual: Any) -> bool:
                try:
                    for fn, operand in ops:
                        if not fn(actual, operand):
                            return False
                except (TypeError, ValueError):
                    return False
                return True

            return by_ops
        return compile_filter(expected)
    if isinstance(expected, list | tuple):
        items = [_compile(e) for e in expected]

        def by_items(actual: Any) -> bool:
            if not isinstance(actual, list | tuple) or len(actual) != len(items):
                return False
            return all(test(a) for test, a in zip(items, actual, strict=True))

        return by_items
    return lambda actual: bool(actual == expected)
