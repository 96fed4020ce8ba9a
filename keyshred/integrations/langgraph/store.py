"""``KeyshredStore``: LangGraph's ``BaseStore`` on keyshred memories (see the package
docstring, ``keyshred.integrations.langgraph``)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal

from keyshred._extras import require
from keyshred._validate import check_count, check_filter, check_text
from keyshred.errors import InvalidInput, KeyshredError, SubjectErased, SubjectSuppressed
from keyshred.ids import SHARED_KNOWLEDGE, OwnSubject, Subject

require("langgraph.store.base", extra="langgraph", package="langgraph")

from langgraph.store.base import (  # noqa: E402
    NOT_PROVIDED,
    BaseStore,
    GetOp,
    IndexConfig,
    InvalidNamespaceError,
    Item,
    ListNamespacesOp,
    MatchCondition,
    NamespacePath,
    NotProvided,
    Op,
    PutOp,
    Result,
    SearchItem,
    SearchOp,
    TTLConfig,
)
from langgraph.store.base import _ensure_ttl as ensure_ttl  # noqa: E402

from keyshred.integrations.langgraph.embed import (  # noqa: E402
    StoreIndex,
    embed_ahead,
    langgraph_texts,
    precomputed,
    store_index,
)

if TYPE_CHECKING:
    from keyshred.config import Config
    from keyshred.erasure import ErasureRequest
    from keyshred.facade import Keyshred
    from keyshred.storage.memories import Memory, PutItem

__all__ = ["AsyncKeyshredStore", "KeyshredStore"]

SubjectFrom = int | Callable[[tuple[str, ...]], str | None]

# The subject id of namespaces that belong to nobody (shared knowledge, FAQ): one of
# keyshred's reserved ids (``keyshred.ids.RESERVED_IDS``), which no person's id may
# be (a namespace label, a LangGraph config's user id, an erasure request naming it
# is refused), so its items get keys of their own, in no person's closure.
SHARED_SUBJECT = SHARED_KNOWLEDGE

# The one shared put ``put_shared`` allows, in the calling context only: another
# thread's put to the same key meanwhile is checked as any put is.
_ALLOWED: contextvars.ContextVar[tuple[tuple[str, ...], str] | None] = contextvars.ContextVar(
    "keyshred_shared_allowed", default=None
)


class KeyshredStore(BaseStore):
    """A LangGraph ``BaseStore`` over ``ks.memories``; see the module docstring.

    ``subject_from``: which label of a namespace is its subject's id (a position,
    default 0), or a function of the namespace returning the id. The function is
    asked about search and listing prefixes too: for a prefix that names no subject
    it returns None or raises, and the call then spans subjects.

    ``shared``: namespace prefixes that belong to nobody (``[("faq",), ("global",)]``):
    their items are kept under a subject of their own (``SHARED_SUBJECT``, an id no
    person may have) with its own keys, in ``shared_scope`` (a declared scope that
    needs no consent; default ``"default"``), so no person's erasure touches them.
    A put whose namespace, key or value the vault's detector finds personal data in,
    or that names a person registered in ``ks.subjects`` (their e-mail, phone, id or
    name, numbers included), is refused (``InvalidInput``) unless made through
    ``put_shared(..., allowed_by=..., reason=...)``, which audits who allowed it. A
    shared item so allowed that names a registered person is co-owned by that person,
    as any memory is: their erasure removes it.

    ``index``: LangGraph's ``IndexConfig`` (``dims``, ``embed``, ``fields``), as
    ``InMemoryStore`` takes it: ``embed`` is a function on a list of texts (sync or
    async), a LangChain ``Embeddings`` or a ``"provider:model"`` string; items are
    embedded with it and searched with it, in an embedding space of the store's own
    (``embedding_space`` names it, else the function does: see
    ``keyshred.integrations.langgraph.embed``), never compared with vectors of
    another function. Without ``embed`` (or with the very function the ``Keyshred``
    was opened with) the store uses the handle's embedder. ``ttl``: a ``TTLConfig``
    (minutes); a TTL shortens the item's retention (never beyond policy), expired
    items are invisible at once and deleted by ``sweep_ttl`` (or the sweeper thread
    ``start_ttl_sweeper`` runs every ``sweep_interval_minutes``).
    """

    supports_ttl: bool = True

    def __init__(
        self,
        ks: Keyshred,
        *,
        subject_from: SubjectFrom = 0,
        index: IndexConfig | None = None,
        ttl: TTLConfig | None = None,
        scope: str = "default",
        shared: Sequence[Sequence[str]] = (),
        shared_scope: str = "default",
        embedding_space: str | None = None,
    ) -> None:
        self._ks = ks
        if not callable(subject_from) and (
            type(subject_from) is not int or subject_from < 0  # (bool is no position)
        ):
            raise InvalidInput("subject_from is a label position (0 or more) or a function")
        self._subject_from = subject_from
        if isinstance(shared, str | bytes) or not isinstance(shared, Sequence):
            raise InvalidInput("shared is a list of namespace prefixes")
        self._shared = [_ns(p) for p in shared]
        self._shared_subject = OwnSubject(SHARED_KNOWLEDGE, ks.config.tenant)
        self._shared_scope = shared_scope
        if self._shared and ks.policy.scope(shared_scope).needs_consent:
            # Shared knowledge belongs to nobody: there is no one to consent.
            raise InvalidInput("shared_scope must be a scope that needs no consent")
        self._scope = scope
        self.ttl_config = ttl
        self.index_config = index
        self._index: StoreIndex | None = store_index(ks, index, embedding_space=embedding_space)
        self._embedder = self._index.embedder if self._index is not None else None
        if self._index is not None and self._index.embeddings is not None:
            self.embeddings = self._index.embeddings
        self._sweeper: threading.Thread | None = None
        self._stop = threading.Event()

    @classmethod
    @contextlib.contextmanager
    def from_conn_string(
        cls,
        conn_string: str | os.PathLike[str],
        *,
        path: str | os.PathLike[str] | None = None,
        config: Config | None = None,
        **kwargs: Any,
    ) -> Iterator[KeyshredStore]:
        """A store on a keyshred handle of its own, closed on exit, as LangGraph's
        ``PostgresStore.from_conn_string``: ``conn_string`` is a PostgreSQL URL or a
        data folder (``keyshred.integrations.langgraph.connect``); ``kwargs`` go to
        the store (``index``, ``ttl``, ``subject_from``, ``scope``,
        ``embedding_space``)."""
        from keyshred.integrations.langgraph.connect import open_conn_string

        ks = open_conn_string(conn_string, path=path, config=config)
        try:
            store = cls(ks, **kwargs)
            try:
                yield store
            finally:
                store.stop_ttl_sweeper()
        finally:
            ks.close()

    def setup(self) -> None:
        """LangGraph's setup: nothing left to do (opening the folder created or
        migrated every table); kept so that code written for ``PostgresStore`` runs."""

    async def asetup(self) -> None:
        """``setup`` (nothing to do)."""

    # -- subjects ------------------------------------------------------------------

    def is_shared(self, namespace: tuple[str, ...]) -> bool:
        """Whether the namespace belongs to nobody (under a ``shared`` prefix)."""
        return any(namespace[: len(p)] == p for p in self._shared)

    def subject_of(self, namespace: tuple[str, ...]) -> str | Subject:
        """The subject id a namespace belongs to (``InvalidInput`` if it names none);
        the shared subject (``SHARED_SUBJECT``, as an ``OwnSubject``) for a namespace
        under a ``shared`` prefix."""
        if self.is_shared(namespace):
            return self._shared_subject
        if callable(self._subject_from):
            subject = _rule(self._subject_from, namespace)
        else:
            if len(namespace) <= self._subject_from:
                raise InvalidInput(
                    f"namespace has no subject label at position {self._subject_from}"
                )
            subject = namespace[self._subject_from]
        if not isinstance(subject, str) or not subject:
            raise InvalidInput("the namespace's subject label is empty")
        return subject

    def _subject_or_none(self, prefix: tuple[str, ...]) -> str | Subject | None:
        try:
            return self.subject_of(prefix)
        except InvalidInput:
            return None

    def _refs(self, prefix: tuple[str, ...]) -> list[str]:
        """The subjects a prefix reaches: its own subject (and the shared subject if a
        shared prefix lies below it), else those the catalog's namespace index lists
        under it (keyed lookups; no partition is opened)."""
        subject = self._subject_or_none(prefix)
        if subject is not None:
            refs = [self._ks.subject_ref(subject)]
            if subject != self._shared_subject and any(
                len(p) > len(prefix) and p[: len(prefix)] == prefix for p in self._shared
            ):
                refs.append(self._ks.subject_ref(self._shared_subject))
            return refs
        if prefix and prefix[0].startswith("~"):
            # keyshred's own namespaces (history versions) are in no index.
            return self._ks.catalog.subjects_with("memory")
        return self._ks.memories.subjects_under(prefix)

    def _across(self, prefix: tuple[str, ...]) -> bool:
        """Whether a prefix spans subjects (it names none) and the namespace index
        holds what it asks for (keyshred's own namespaces are not indexed)."""
        own = bool(prefix) and prefix[0].startswith("~")
        return not own and self._subject_or_none(prefix) is None

    # -- batch ---------------------------------------------------------------------

    # LangGraph's own helpers check namespaces before ``batch`` and raise their own
    # errors (or a TypeError): keyshred checks first and raises InvalidInput.

    def get(
        self, namespace: tuple[str, ...], key: str, *, refresh_ttl: bool | None = None
    ) -> Item | None:
        with _langgraph_rules():
            return super().get(_ns(namespace), _text(key), refresh_ttl=refresh_ttl)

    def search(
        self,
        namespace_prefix: tuple[str, ...],
        /,
        *,
        query: str | None = None,
        filter: dict[str, Any] | None = None,
        limit: int = 10,
        offset: int = 0,
        refresh_ttl: bool | None = None,
    ) -> list[SearchItem]:
        with _langgraph_rules():
            return super().search(
                _ns(namespace_prefix, prefix=True),
                query=query,
                filter=filter,
                limit=limit,
                offset=offset,
                refresh_ttl=refresh_ttl,
            )

    def put(
        self,
        namespace: tuple[str, ...],
        key: str,
        value: Mapping[str, Any],
        index: Literal[False] | list[str] | None = None,
        *,
        ttl: float | NotProvided | None = NOT_PROVIDED,
    ) -> None:
        ns = _put_namespace(namespace)
        with _langgraph_rules():
            super().put(ns, _text(key), value, index, ttl=ttl)

    def delete(self, namespace: tuple[str, ...], key: str) -> None:
        with _langgraph_rules():
            super().delete(_ns(namespace), _text(key))

    def list_namespaces(
        self,
        *,
        prefix: NamespacePath | None = None,
        suffix: NamespacePath | None = None,
        max_depth: int | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> list[tuple[str, ...]]:
        _check_paths(prefix, suffix)
        with _langgraph_rules():
            return super().list_namespaces(
                prefix=prefix, suffix=suffix, max_depth=max_depth, limit=limit, offset=offset
            )

    # The async twins check as the sync methods do: BaseStore's own raise
    # InvalidNamespaceError, whose message repeats the label (a subject id), and
    # str() a key that is no string where the sync methods raise InvalidInput.

    async def aget(
        self, namespace: tuple[str, ...], key: str, *, refresh_ttl: bool | None = None
    ) -> Item | None:
        with _langgraph_rules():
            return await super().aget(_ns(namespace), _text(key), refresh_ttl=refresh_ttl)

    async def asearch(
        self,
        namespace_prefix: tuple[str, ...],
        /,
        *,
        query: str | None = None,
        filter: dict[str, Any] | None = None,
        limit: int = 10,
        offset: int = 0,
        refresh_ttl: bool | None = None,
    ) -> list[SearchItem]:
        with _langgraph_rules():
            return await super().asearch(
                _ns(namespace_prefix, prefix=True),
                query=query,
                filter=filter,
                limit=limit,
                offset=offset,
                refresh_ttl=refresh_ttl,
            )

    async def aput(
        self,
        namespace: tuple[str, ...],
        key: str,
        value: Mapping[str, Any],
        index: Literal[False] | list[str] | None = None,
        *,
        ttl: float | NotProvided | None = NOT_PROVIDED,
    ) -> None:
        ns = _put_namespace(namespace)
        with _langgraph_rules():
            await super().aput(ns, _text(key), value, index, ttl=ttl)

    async def adelete(self, namespace: tuple[str, ...], key: str) -> None:
        with _langgraph_rules():
            await super().adelete(_ns(namespace), _text(key))

    async def alist_namespaces(
        self,
        *,
        prefix: NamespacePath | None = None,
        suffix: NamespacePath | None = None,
        max_depth: int | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> list[tuple[str, ...]]:
        _check_paths(prefix, suffix)
        with _langgraph_rules():
            return await super().alist_namespaces(
                prefix=prefix, suffix=suffix, max_depth=max_depth, limit=limit, offset=offset
            )

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        """Reads see the state before the batch's writes (as ``InMemoryStore``);
        writes apply in order, the last write of a key winning."""
        if isinstance(ops, str | bytes) or not isinstance(ops, Iterable):
            raise InvalidInput("batch takes a list of store operations")
        ops = [_checked_op(op) for op in ops]
        results: list[Result] = [None] * len(ops)
        puts: dict[tuple[tuple[str, ...], str], PutOp] = {}
        for i, op in enumerate(ops):
            if isinstance(op, GetOp):
                results[i] = self._get(op)
            elif isinstance(op, SearchOp):
                results[i] = self._search(op)
            elif isinstance(op, ListNamespacesOp):
                results[i] = self._list_namespaces(op)
            elif isinstance(op, PutOp):
                puts[(tuple(op.namespace), op.key)] = op
            else:
                raise InvalidInput(f"unknown store operation {type(op).__name__}")
        if puts:
            self._apply_puts(list(puts.values()))
        return results

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        """``batch`` in a worker thread; the embeddings of its puts and queries are
        awaited first on this loop (``aembed_*``, as ``InMemoryStore.abatch``)."""
        if isinstance(ops, str | bytes) or not isinstance(ops, Iterable):
            raise InvalidInput("batch takes a list of store operations")
        ops = list(ops)
        embeddings = self._index.embeddings if self._index is not None else None
        if embeddings is None:
            return await asyncio.to_thread(self.batch, ops)
        texts, queries = self._texts_of(ops)
        ahead = await embed_ahead(embeddings, texts, queries) if texts or queries else {}
        with precomputed(ahead):  # (to_thread runs in a copy of this context)
            return await asyncio.to_thread(self.batch, ops)

    def _texts_of(self, ops: Sequence[Op]) -> tuple[list[str], list[str]]:
        """The texts a batch will embed and the queries it will embed (malformed
        operations are left to ``batch`` to refuse)."""
        texts: list[str] = []
        queries: list[str] = []
        last: dict[tuple[tuple[str, ...], str], PutOp] = {}
        for op in ops:
            if isinstance(op, SearchOp) and isinstance(op.query, str) and op.query:
                queries.append(op.query)
            elif isinstance(op, PutOp) and isinstance(op.namespace, tuple):
                last[(op.namespace, str(op.key))] = op
        for op in last.values():
            if not isinstance(op.value, dict):
                continue
            for path in self._index_for(op) or ():
                if isinstance(path, str):
                    texts += langgraph_texts(op.value, path)
        return texts, queries

    # -- operations ----------------------------------------------------------------

    def _now(self) -> datetime:
        return datetime.now(UTC)

    def _item(self, m: Memory, namespace: tuple[str, ...] | None = None) -> Item:
        return Item(
            value=m.value,
            key=m.key,
            namespace=namespace or tuple(m.namespace),
            created_at=m.created_at,
            updated_at=m.updated_at,
        )

    def _get(self, op: GetOp) -> Item | None:
        ns = tuple(op.namespace)
        subject = self.subject_of(ns)
        m = self._ks.memories.get(subject, ns, op.key)
        if m is None:  # (an item past its TTL is already hidden by the memory store)
            return None
        if op.refresh_ttl and self._refresh_enabled():
            self._refresh(subject, [m])
        return self._item(m, ns)

    def _refresh_enabled(self) -> bool:
        cfg = self.ttl_config
        return bool(cfg and cfg.get("refresh_on_read", True) and cfg.get("default_ttl"))

    def _refresh(self, subject: str | Subject, memories: Sequence[Memory]) -> None:
        """Refresh on read: items with a TTL get ``default_ttl`` from now."""
        cfg = self.ttl_config
        assert cfg is not None  # noqa: S101 - checked by _refresh_enabled
        minutes = float(cfg.get("default_ttl") or 0)
        self._ks.memories.touch(
            subject,
            [(tuple(m.namespace), m.key) for m in memories],
            timedelta(minutes=minutes),
        )

    def _search(self, op: SearchOp) -> list[SearchItem]:
        prefix = tuple(op.namespace_prefix)
        out: list[tuple[float | None, tuple[int, int, str], Memory]] = []
        want = op.offset + op.limit
        semantic = bool(op.query and self._index is not None)
        if not semantic and self._across(prefix):
            # Across subjects: the namespace index orders the namespaces and says
            # which subjects to open, and how few suffice for the page.
            found = self._ks.memories.search_across(
                prefix, filter=op.filter, limit=op.limit, offset=op.offset
            )
            return [_search_item(m) for m in found]
        refs = self._refs(prefix)
        ref_of: dict[int, str] = {}  # id(memory) -> its subject_ref
        firsts: dict[str, Any] = {}  # subject_ref -> its namespaces' first times (lazy)
        if len(refs) == 1 and not semantic:
            # One subject: the memory store already returns insertion order; no merge.
            # Namespaces by when they first held a memory (the namespace index, asked
            # only if the hits span several), as across subjects and InMemoryStore:
            # not by their oldest hit (a filter or a deletion moved that later).
            found = self._ks.memories.search_ref(
                refs[0],
                prefix,
                filter=op.filter,
                limit=op.limit,
                offset=op.offset,
                order="insertion",
                namespace_first=self._ks.memories.namespace_first(refs[0], prefix),
            )
            return [_search_item(m) for m in found]
        for ref in refs:
            firsts[ref] = self._ks.memories.namespace_first(ref, prefix)
            try:
                found = self._ks.memories.search_ref(
                    ref,
                    prefix,
                    query=op.query if semantic else None,
                    filter=op.filter,
                    limit=want,
                    offset=0,
                    order="insertion",
                    embedder=self._embedder,
                    # Items with no vector fill what the ranked leave (InMemoryStore).
                    unscored=semantic,
                    namespace_first=firsts[ref],
                )
            except (SubjectSuppressed, SubjectErased):
                if len(prefix) > (self._subject_from if isinstance(self._subject_from, int) else 0):
                    raise
                continue  # a search across subjects skips those being erased
            first: dict[tuple[str, ...], int] = {}
            for m in found:
                ns = tuple(m.namespace)
                created = int(m.created_at.timestamp() * 1e6)
                first[ns] = min(first.get(ns, created), created)
            for m in found:
                ns = tuple(m.namespace)
                order = (first[ns], int(m.created_at.timestamp() * 1e6), m.key)
                out.append((m.score, order, m))
                ref_of[id(m)] = ref
        if semantic:
            # Best score first, ties in insertion order (InMemoryStore's stable sort).
            scored = [t for t in out if t[0] is not None]
            scored.sort(key=lambda t: (-(t[0] or 0.0), t[1]))
            scored = self._ties_in_namespace_order(scored, ref_of, firsts)
            # Unscored items after them, in InMemoryStore's order too: one run of
            # equal (no) scores, by namespace first (the memory store gives one
            # subject's in insertion order across its namespaces).
            rest = sorted((t for t in out if t[0] is None), key=lambda t: t[1])
            rest = self._ties_in_namespace_order(rest, ref_of, firsts)
            picked = scored[op.offset : op.offset + op.limit]
            if len(picked) < op.limit:
                picked += rest[: op.limit - len(picked)]
        else:
            out.sort(key=lambda t: t[1])
            picked = out[op.offset : op.offset + op.limit]
        return [_search_item(m, score) for score, _, m in picked]

    def _ties_in_namespace_order(
        self,
        scored: list[tuple[float | None, tuple[int, int, str], Memory]],
        ref_of: dict[int, str],
        firsts: dict[str, Any],
    ) -> list[tuple[float | None, tuple[int, int, str], Memory]]:
        """Equal scores of several namespaces in InMemoryStore's order: namespaces
        by when they first held an item, which the namespace index knows (the
        oldest *hit* of a namespace can be younger than the namespace: a helper's
        review found ``c`` of an older namespace after ``b`` at ``limit=1``).
        ``firsts``: each subject's ``namespace_first``, which reads the index at its
        first question: asked only for a run of equal scores that spans namespaces."""

        def first_of(m: Memory, cheap: tuple[int, int, str]) -> int:
            known = firsts[ref_of[id(m)]](tuple(m.namespace))
            return cheap[0] if known is None else int(known)

        out: list[tuple[float | None, tuple[int, int, str], Memory]] = []
        i = 0
        while i < len(scored):
            j = i + 1
            while j < len(scored) and scored[j][0] == scored[i][0]:
                j += 1
            run = scored[i:j]
            if len({(ref_of[id(t[2])], tuple(t[2].namespace)) for t in run}) > 1:
                run.sort(key=lambda t: (first_of(t[2], t[1]), *t[1][1:]))
            out += run
            i = j
        return out

    def _list_namespaces(self, op: ListNamespacesOp) -> list[tuple[str, ...]]:
        prefix: tuple[str, ...] = ()
        for cond in op.match_conditions or ():
            if cond.match_type == "prefix":
                # The literal labels before the first wildcard: an index lookup.
                path = tuple(cond.path)
                literal = path[: path.index("*")] if "*" in path else path
                prefix = max(prefix, literal, key=len)
        conditions = op.match_conditions or ()
        depth = op.max_depth

        def select(ns: tuple[str, ...]) -> tuple[str, ...] | None:
            if not all(_does_match(cond, ns) for cond in conditions):
                return None
            return ns if depth is None else ns[:depth]

        if self._across(prefix):
            # From the catalog's namespace index, a page at a time: only the rows
            # under the prefix's literal part are decrypted, no partition is opened,
            # and what is kept is the page asked for.
            found = self._ks.memories.namespaces_across(
                prefix, select=select, first=op.offset + op.limit
            )
        else:
            # One subject (the prefix names it): its partition's rows, which a
            # subject's own reads keep open, cost less than the index's query and
            # label decryption (0.66 against ~0.08 ms a call in bench_scale.py).
            namespaces: set[tuple[str, ...]] = set()
            for ref in self._refs(prefix):
                try:
                    namespaces |= self._ks.memories.namespaces_ref(ref, prefix)
                except (SubjectSuppressed, SubjectErased):
                    continue  # as across subjects: a subject being erased lists nothing
            found = sorted({s for ns in namespaces if (s := select(ns)) is not None})
        return found[op.offset : op.offset + op.limit]

    def _apply_puts(self, puts: Sequence[PutOp]) -> None:
        subjects = [self.subject_of(tuple(op.namespace)) for op in puts]  # once per op
        by_subject: dict[str | Subject, list[PutOp]] = {}
        for subject, op in zip(subjects, puts, strict=True):
            by_subject.setdefault(subject, []).append(op)
        shared = self._shared_subject
        # Shared puts are checked, but for the one ``put_shared`` allowed (in this
        # context only), if any: it skips the detector, and a registered person it
        # names co-owns it.
        allowed = _ALLOWED.get()
        checked = [
            op for op in by_subject.get(shared, ()) if (tuple(op.namespace), op.key) != allowed
        ]
        unmentioned = bool(checked)
        # What is refused is refused before anything is written: each subject's writes
        # are one put_many (all or nothing), but a batch spans subjects, and a refusal
        # of a later subject's writes left the earlier ones applied.
        for op in checked:
            if op.value is not None:
                self._refuse_personal(op)
        if len(by_subject) > 1:
            for subject in by_subject:
                self._ks.catalog.check_guard(
                    self._ks.subject_ref(subject), scope=self._scope_of(subject)
                )
        # Items are written in the batch's order, a run of one subject's at a time:
        # across subjects the order of a search is the items' creation times, which
        # must follow the batch as InMemoryStore's order does (one put_many a subject
        # wrote a later subject's items first when an earlier one came back). Built
        # before any write: building one may refuse it (its index, its ttl).
        runs: list[tuple[str | Subject, list[PutItem]]] = []
        for subject, op in zip(subjects, puts, strict=True):
            if op.value is None:
                continue
            if not runs or runs[-1][0] != subject:
                runs.append((subject, []))
            runs[-1][1].append(self._put_item(op, subject))
        deletes = {
            subject: [(tuple(op.namespace), op.key) for op in ops if op.value is None]
            for subject, ops in by_subject.items()
        }
        calls = len(runs) + sum(1 for d in deletes.values() if d)
        if calls > 1:
            # Each call is all or nothing, the batch is several: an item a later
            # put_many would refuse (its value, its namespace, its ttl) left the
            # writes of the calls before it applied. Asked of every item first.
            for subject, items in runs:
                for item in items:
                    self._ks.memories.check_put(
                        item, subject, unmentioned=unmentioned and subject == shared
                    )
        for subject, keys in deletes.items():
            if keys:  # one rewrite for all of them: linear in their number
                self._ks.memories.delete_many(subject, keys)
        for subject, items in runs:
            self._ks.memories.put_many(
                subject,
                items,
                embedder=self._embedder,
                unmentioned=unmentioned and subject == shared,
            )

    def _scope_of(self, subject: str | Subject) -> str:
        """The scope a subject's items go in: shared knowledge has its own."""
        return self._shared_scope if subject == self._shared_subject else self._scope

    def _put_item(self, op: PutOp, subject: str | Subject) -> PutItem:
        from keyshred.storage.memories import PutItem

        return PutItem(
            tuple(op.namespace),
            op.key,
            dict(op.value or {}),
            scope=self._scope_of(subject),
            index=self._index_for(op),
            ttl=_ttl(op.ttl),
        )

    def _index_for(self, op: PutOp) -> Literal[False] | list[str]:
        """The paths a put embeds: its own ``index``, else the config's ``fields``;
        nothing without an index config (``InMemoryStore`` ignores ``index`` then)."""
        if self._index is None or op.index is False:
            return False
        if op.index is None:
            return list(self._index.fields)
        if isinstance(op.index, str) or not isinstance(op.index, list | tuple):
            raise InvalidInput("a put's index is False or a list of JSON paths")
        return list(op.index)

    def _refuse_personal(self, op: PutOp) -> None:
        """A shared item must hold no personal data (the vault's detector: e-mail,
        phones, resident ids, cards, IBANs, IPs); registered persons it names are
        refused by the write itself (``unmentioned``)."""
        from keyshred.storage.mentions import walk_texts
        from keyshred.vault.detect import detect

        texts = [*op.namespace, op.key, *walk_texts(op.value)]
        if any(detect(text) for text in texts):
            raise InvalidInput(
                "this shared namespace holds no personal data, and the item looks personal "
                "(the vault's detector found some); store it under its subject, or use "
                "put_shared(..., allowed_by=..., reason=...) to record who allowed it"
            )

    def put_shared(
        self,
        namespace: tuple[str, ...],
        key: str,
        value: Mapping[str, Any],
        *,
        allowed_by: str,
        reason: str,
        index: Literal[False] | list[str] | None = None,
    ) -> None:
        """Put into a shared namespace what the detector would refuse (or what names a
        registered person, who then co-owns it), and audit who allowed it and why
        (``store.shared_personal_allowed``: the caller, the reason and the item's
        namespace as the namespace index's keyed hash, never the value). The item is
        checked as the put will check it before the audit: a put refused for what it
        is leaves no allowance behind."""
        ns = _ns(namespace)
        k = _text(key)
        if not self.is_shared(ns):
            raise InvalidInput("put_shared is for namespaces under a shared prefix")
        check_text(allowed_by, "allowed_by")
        check_text(reason, "a reason")
        _put_namespace(ns)
        op = PutOp(ns, k, value, index=index, ttl=ensure_ttl(self.ttl_config, NOT_PROVIDED))
        _checked_op(op)
        self._ks.memories.check_put(self._put_item(op, self._shared_subject), self._shared_subject)
        self._ks.audit.record(
            "store.shared_personal_allowed",
            allowed_by=allowed_by[:128],
            reason=reason[:256],
            namespace=self._ks.memories.namespace_hash(ns),
        )
        token = _ALLOWED.set((ns, k))
        try:
            self.batch([op])
        finally:
            _ALLOWED.reset(token)

    # -- what LangGraph's stores lack ----------------------------------------------

    def delete_prefix(self, namespace_prefix: Sequence[str]) -> int:
        """Delete every item under a namespace prefix (physically, vectors too) in
        one call; returns how many."""
        prefix = _ns(namespace_prefix, prefix=True)
        subject = self._subject_or_none(prefix)
        # Across subjects every partition is asked: a deletion must also reach rows
        # the index does not list (opaque rows whose namespace has no readable one).
        refs = (
            [self._ks.subject_ref(subject)]
            if subject is not None
            else self._ks.catalog.subjects_with("memory")
        )
        n = 0
        for ref in refs:
            n += self._ks.memories.delete_prefix_ref(ref, prefix)
        return n

    def erase_subject(
        self,
        subject: str,
        *,
        requested_by: str,
        reason: str,
        request_id: str | None = None,
        block: bool = False,
    ) -> ErasureRequest:
        """Erase a subject everywhere (store items, vectors, threads, tokens, backups)
        through the erasure coordinator; the receipt is ``ks.erasure.receipt(id)``.
        ``block``: the id stays erased even if nothing of it was found."""
        return self._ks.erase(
            subject, requested_by=requested_by, reason=reason, request_id=request_id, block=block
        )

    # -- TTL -----------------------------------------------------------------------

    def sweep_ttl(self) -> int:
        """Delete every item whose TTL (retention) has passed; returns how many."""
        return self._ks.memories.sweep_expired(self._now())

    def start_ttl_sweeper(self, sweep_interval_minutes: float | None = None) -> threading.Thread:
        minutes = sweep_interval_minutes or float(
            (self.ttl_config or {}).get("sweep_interval_minutes") or 60
        )

        def loop() -> None:
            while not self._stop.wait(minutes * 60):
                try:
                    self.sweep_ttl()
                except KeyshredError:
                    continue  # retried at the next interval

        self._stop.clear()
        self._sweeper = threading.Thread(target=loop, name="keyshred-ttl-sweeper", daemon=True)
        self._sweeper.start()
        return self._sweeper

    def stop_ttl_sweeper(self, timeout: float | None = None) -> bool:
        self._stop.set()
        if self._sweeper is not None:
            self._sweeper.join(timeout)
            return not self._sweeper.is_alive()
        return True


def _ttl(minutes: float | None) -> timedelta | None:
    """A put's ttl (minutes) as the memory store's: InvalidInput for one no
    ``timedelta`` holds (NaN, infinite, beyond its range), which ``timedelta`` would
    raise as ValueError or OverflowError."""
    if minutes is None:
        return None
    try:
        return timedelta(minutes=float(minutes))
    except (OverflowError, ValueError):
        raise InvalidInput("a ttl is a finite number of minutes") from None


def _text(value: Any) -> str:
    return check_text(value, "a store key")


def _rule(rule: Callable[[tuple[str, ...]], str | None], namespace: tuple[str, ...]) -> str:
    """A function ``subject_from``'s answer for a namespace or prefix: None, or any
    error it raises, is ``InvalidInput`` (it names no subject), raised outside the
    handler so that no error of the rule, which may quote a label, is chained."""
    failed = False
    try:
        subject = rule(namespace)
    except KeyshredError:
        raise
    except Exception:  # noqa: BLE001 - a caller's rule: any error means "no subject here"
        failed = True
    if failed or subject is None:
        raise InvalidInput("the subject rule names no subject in this namespace")
    return subject


def _check_paths(*paths: NamespacePath | None) -> None:
    """``list_namespaces``' prefix and suffix as prefixes (``*`` allowed)."""
    for path in paths:
        if path is not None:
            _ns(path, prefix=True)


def _ns(namespace: Any, *, prefix: bool = False) -> tuple[str, ...]:
    """A namespace as a tuple of strings (a prefix may be empty)."""
    if isinstance(namespace, str | bytes) or not isinstance(namespace, tuple | list):
        raise InvalidInput("a namespace is a tuple of strings")
    labels = tuple(check_text(label, "a namespace label") for label in namespace)
    if not labels and not prefix:
        raise InvalidInput("a namespace has at least one label")
    return labels


@contextlib.contextmanager
def _langgraph_rules() -> Iterator[None]:
    """LangGraph's namespace rules (no empty label, no '.') as ``InvalidInput``; its
    message would repeat the label, which may be a subject id (raised outside the
    handler: not even as ``__context__`` does it travel with ours)."""
    refused = False
    try:
        yield
    except InvalidNamespaceError:
        refused = True
    if refused:
        raise InvalidInput(
            "namespace labels are non-empty, contain no '.' and do not start with 'langgraph'"
        )


def _checked_op(op: Any) -> Op:
    """The fields of one store operation, typed (their values are checked where used)."""
    if isinstance(op, GetOp | PutOp):
        _ns(op.namespace)
        _text(op.key)
        if isinstance(op, PutOp) and op.value is not None and not isinstance(op.value, dict):
            raise InvalidInput("a store value is a dict")
        if isinstance(op, PutOp) and op.ttl is not None and not isinstance(op.ttl, int | float):
            raise InvalidInput("a ttl is a number of minutes")
    elif isinstance(op, SearchOp):
        _ns(op.namespace_prefix, prefix=True)
        check_count(op.limit, "limit")
        check_count(op.offset, "offset")
        check_filter(op.filter)
        if op.query is not None:
            check_text(op.query, "a query")
    elif isinstance(op, ListNamespacesOp):
        check_count(op.limit, "limit")
        check_count(op.offset, "offset")
        if op.max_depth is not None:
            check_count(op.max_depth, "max_depth")
        conditions = op.match_conditions or ()
        if not isinstance(conditions, tuple | list) or not all(
            isinstance(c, MatchCondition) and c.match_type in ("prefix", "suffix")
            for c in conditions
        ):
            raise InvalidInput("match_conditions is a list of MatchCondition")
        for cond in conditions:
            _ns(cond.path, prefix=True)
    # LangGraph's label rules, which its methods check before batching and its SQL
    # stores check in batch too (validate_op_namespace, in recent versions only): a
    # label with "." must not reach subject_of (the shared subject's name has one, so
    # such a label would file a person's item under it, unchecked).
    if isinstance(op, GetOp | PutOp):
        _labels(op.namespace)
    elif isinstance(op, SearchOp):
        _labels(op.namespace_prefix)
    elif isinstance(op, ListNamespacesOp):
        for cond in op.match_conditions or ():
            _labels(cond.path)
    return op  # type: ignore[no-any-return]


def _put_namespace(namespace: Any) -> tuple[str, ...]:
    """A put's namespace, checked by LangGraph's rules here, as ``InvalidInput``:
    LangGraph's own check (``_validate_namespace``) raises an error that quotes the
    label, which the conversion in ``_langgraph_rules`` could only chain."""
    ns = _ns(namespace)
    _labels(ns)
    if ns[0] == "langgraph":
        raise InvalidInput("a namespace's root label is not 'langgraph'")
    return ns


def _labels(namespace: Sequence[str]) -> None:
    """LangGraph's label rules: no empty label, none with "." or NUL."""
    if any(not label or "." in label or "\x00" in label for label in namespace):
        raise InvalidInput("namespace labels are non-empty and contain no '.' or NUL")


def _search_item(m: Memory, score: float | None = None) -> SearchItem:
    return SearchItem(
        namespace=tuple(m.namespace),
        key=m.key,
        value=m.value,
        created_at=m.created_at,
        updated_at=m.updated_at,
        score=score,
    )


def _does_match(cond: MatchCondition, ns: tuple[str, ...]) -> bool:
    path = tuple(cond.path)
    if len(path) > len(ns):
        return False
    part = ns[: len(path)] if cond.match_type == "prefix" else ns[len(ns) - len(path) :]
    return all(p in ("*", n) for p, n in zip(path, part, strict=True))


class AsyncKeyshredStore(KeyshredStore):
    """``KeyshredStore`` under the name LangGraph's async users look for
    (``AsyncPostgresStore``): the same store (its async methods run the sync ones in
    a worker thread) with an async ``from_conn_string``."""

    @classmethod
    @contextlib.asynccontextmanager
    async def from_conn_string(  # type: ignore[override]
        cls,
        conn_string: str | os.PathLike[str],
        *,
        path: str | os.PathLike[str] | None = None,
        config: Config | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[AsyncKeyshredStore]:
        """``KeyshredStore.from_conn_string`` as an async context manager."""
        from keyshred.integrations.langgraph.connect import open_conn_string

        ks = await asyncio.to_thread(open_conn_string, conn_string, path=path, config=config)
        try:
            store = cls(ks, **kwargs)
            try:
                yield store
            finally:
                store.stop_ttl_sweeper()
        finally:
            await asyncio.to_thread(ks.close)
