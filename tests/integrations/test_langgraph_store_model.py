"""``KeyshredStore`` against LangGraph's ``InMemoryStore`` as a model, on random
sequences of operations (Hypothesis stateful): put (new and overwrite), delete, get,
search without a query (prefix, filter, limit, offset), list_namespaces (prefix,
suffix, max_depth, limit, offset), batch with mixed operations, closing and
reopening the handle, and a user's erasure. Every answer is compared. The machine
runs three ways: on the embedded default, with the catalog and the key store in
PostgreSQL, and through the async twins (``aput``, ``abatch``, ...).

The model is ``InMemoryStore`` itself, with keyshred's documented differences made
explicit here (each one named where it is applied):

* the subject is the namespace's second label (``subject_from=1``, as the README);
  namespaces under ``("faq",)`` are shared and belong to nobody, and a put there
  that the vault's detector finds personal data in is refused (``InvalidInput``);
* LangGraph's label rules (no ".", no empty label, no "langgraph" root) are refused
  with ``InvalidInput`` where ``InMemoryStore`` raises ``InvalidNamespaceError``;
* ``list_namespaces`` lists namespaces that hold items (``InMemoryStore`` also lists
  the empty ones a lookup or a deletion left behind), and a read creates no
  namespace (``InMemoryStore``'s ``get`` of a missing namespace creates it);
* after an erasure that found data (``req.found_data``: the user ever had an item)
  the user's items are gone and every read or write naming the user raises
  ``SubjectSuppressed``; reads across users skip them. An erasure that found
  nothing leaves the id free for later writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from langgraph.store.base import (
    GetOp,
    InvalidNamespaceError,
    Item,
    ListNamespacesOp,
    MatchCondition,
    Op,
    PutOp,
    SearchOp,
)
from langgraph.store.memory import InMemoryStore, _compare_values

from keyshred import Config, Keyshred
from keyshred.errors import InvalidInput, KeyshredError, SubjectSuppressed
from keyshred.integrations.langgraph import KeyshredStore
from keyshred.integrations.langgraph.store import SHARED_SUBJECT
from keyshred.vault.detect import detect
from tests.conftest import pg_schema, pg_url
from tests.integrations.test_langgraph_index import DIMS, hash_embed
from tests.model_machine import MODEL_TIMEOUT, model_settings

pytestmark = pytest.mark.timeout(MODEL_TIMEOUT)

SHARED = ("faq",)

# Small alphabets, so that keys, namespaces and values collide. Users: plain, an
# e-mail-like id (LangGraph allows "@" but no "." in a label), unicode; "a.b" is a
# label LangGraph refuses (through its methods; batch() does not check labels).
USERS = ("ann", "bob@example", "zoë", "用户")
BAD_USERS = ("a.b",)
KEYS = ("k", "k.1", "bob@example.com", "ключ", "a b")
LEAVES: tuple[tuple[str, ...], ...] = (("notes",), ("prefs",), ("notes", "deep"))
TOPICS: tuple[tuple[str, ...], ...] = ((), ("topic",), ("topic", "ünï"))


def user_ns(user: str, leaf: tuple[str, ...]) -> tuple[str, ...]:
    return ("users", user, *leaf)


users = st.sampled_from(USERS)
any_users = st.sampled_from(USERS + BAD_USERS)
keys = st.sampled_from(KEYS)
personal_ns = st.builds(user_ns, any_users, st.sampled_from(LEAVES))
shared_ns = st.sampled_from(TOPICS).map(lambda t: SHARED + t)
namespaces = st.one_of(personal_ns, personal_ns, shared_ns)
values = st.fixed_dictionaries(
    {},
    optional={
        "a": st.integers(0, 2),
        "b": st.sampled_from(("x", "y", "Ωmega", "bob@example.com")),
        "c": st.sampled_from(({"d": [1]}, {"d": [2]})),
    },
)
prefixes = st.one_of(
    st.just(()),
    st.just(("users",)),
    st.just(SHARED),
    st.builds(lambda u: ("users", u), any_users),
    personal_ns,
    shared_ns,
    st.just(("nobody",)),
)
filters = st.one_of(
    st.none(),
    st.fixed_dictionaries({"a": st.integers(0, 2)}),
    st.fixed_dictionaries({"b": st.sampled_from(("x", "y"))}),
    st.fixed_dictionaries({"a": st.sampled_from(({"$gte": 1}, {"$ne": 0}, {"$lt": 2}))}),
    st.fixed_dictionaries({"c": st.sampled_from(({"d": [1]}, {"d": [2]}))}),
)
limits = st.integers(0, 6)
offsets = st.integers(0, 4)
paths = st.one_of(
    st.none(),
    st.just(("users",)),
    st.just(("users", "*", "notes")),
    st.builds(lambda u: ("users", u), users),
    st.just(("notes",)),
    st.just(("deep",)),
    st.just(("*", "deep")),
    st.just(SHARED),
    st.just(("topic",)),
)
depths = st.one_of(st.none(), st.integers(1, 4))


def put_ops(ns: tuple[str, ...], key: str, value: dict[str, Any] | None) -> PutOp:
    return PutOp(ns, key, value, index=False)


batch_ops = st.one_of(
    st.builds(GetOp, namespaces, keys),
    st.builds(put_ops, namespaces, keys, st.one_of(st.none(), values)),
    st.builds(put_ops, namespaces, keys, values),
    st.builds(
        SearchOp,
        prefixes,
        filters,
        limits,
        offsets,
    ),
    st.builds(
        lambda pre, suf, d, lim, off: ListNamespacesOp(
            tuple(
                MatchCondition(match_type=kind, path=path)  # type: ignore[arg-type]
                for kind, path in (("prefix", pre), ("suffix", suf))
                if path is not None
            )
            or None,
            d,
            lim,
            off,
        ),
        paths,
        paths,
        depths,
        limits,
        offsets,
    ),
)


def norm(result: Any) -> Any:
    """An answer as comparable data (timestamps differ by nature)."""
    if result is None or isinstance(result, tuple):
        return result
    if isinstance(result, list):
        return [norm(r) for r in result]
    return (tuple(result.namespace), result.key, result.value)


def outcome(call: Any) -> tuple[str, Any]:
    """("ok", answer) or ("error", the keyshred error class it maps to)."""
    try:
        return "ok", norm(call())
    except InvalidNamespaceError:
        return "error", InvalidInput
    except KeyshredError as exc:
        return "error", type(exc)


def is_personal(ns: tuple[str, ...], key: str, value: Any) -> bool:
    """What keyshred's shared namespaces refuse: the vault's detector (the README)."""
    texts = [*ns, key]
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            texts.append(v)
        elif isinstance(v, dict):
            texts += [k for k in v if isinstance(k, str)]
            stack += list(v.values())
        elif isinstance(v, list):
            stack += v
    return any(detect(t) for t in texts)


def bad_label(ns: tuple[str, ...]) -> bool:
    return not ns or any(not label or "." in label for label in ns) or ns[0] == "langgraph"


class Model(InMemoryStore):
    """``InMemoryStore``, but a put replaces the item's vectors; a comparison
    (``$gt`` ...) on a field an item lacks matches nothing where ``InMemoryStore``
    raises ``TypeError`` (float(None)); keyshred, as LangGraph's SQL stores, matches
    nothing. And a batch's reads and deletes create no namespace."""

    def _filter_items(self, op: SearchOp) -> list[tuple[Item, list[list[float]]]]:
        if not op.filter:
            return super()._filter_items(op)
        every = SearchOp(op.namespace_prefix, None, 1 << 30, 0, op.query)
        return [
            (item, vectors)
            for item, vectors in super()._filter_items(every)
            if all(matches(item.value.get(k), want) for k, want in op.filter.items())
        ]

    def _extract_texts(
        self, put_ops: dict[tuple[tuple[str, ...], str], PutOp]
    ) -> dict[str, list[tuple[tuple[str, ...], str, str]]]:
        # A put replaces all of the item's vectors (README, "deliberate differences"):
        # ``InMemoryStore`` keeps an earlier value's vectors of paths the new put does
        # not embed, which then rank the new value by the old text. Dropped before the
        # new ones are inserted (``batch`` extracts, inserts, then applies).
        for (ns, key), op in put_ops.items():
            if op.value is not None:
                self._vectors[ns].pop(key, None)
        return super()._extract_texts(put_ops)

    def _handle_list_namespaces(self, op: ListNamespacesOp) -> list[tuple[str, ...]]:
        # A GetOp earlier in the same batch created its namespace (a defaultdict),
        # which a ListNamespacesOp after it listed: a read creates nothing
        # (Hypothesis found ``[GetOp(("faq",), "k"), ListNamespacesOp()]``).
        for ns in [ns for ns, items in self._data.items() if not items]:
            del self._data[ns]
        return super()._handle_list_namespaces(op)

    def _apply_put_ops(self, put_ops: dict[tuple[tuple[str, ...], str], PutOp]) -> None:
        # A batch's GetOp created its namespace before the batch's puts, in the
        # search order; a read creates nothing (see ``StoreModel.drop_empty``).
        for ns in [ns for ns, items in self._data.items() if not items]:
            del self._data[ns]
        # Nor does a delete: ``InMemoryStore``'s defaultdict made the namespace of a
        # delete that found nothing, and a later put of the batch into it then
        # sorted it by the delete's place instead of its first item's. And one a
        # delete empties is forgotten at once: a later put of the same batch sorts
        # it by its new first item, as keyshred does (``StoreModel.drop_empty``).
        for at, op in put_ops.items():
            if op.value is None and at[0] not in self._data:
                continue
            super()._apply_put_ops({at: op})
            if not self._data[at[0]]:
                del self._data[at[0]]


def matches(value: Any, want: Any) -> bool:
    try:
        return bool(_compare_values(value, want))
    except TypeError:
        return False


class StoreModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="ks-store-model-"))
        self.ks = Keyshred.init(self.dir / "data", self.config())
        self.store = self.make_store()
        self.model = self.make_model()
        self.written: set[str] = set()  # users holding keys: an item written since any erasure
        self.erased: set[str] = set()  # users erased with data found

    def config(self) -> Config | None:
        return None  # the embedded default

    def make_store(self) -> Any:
        # Pages of two index rows: listings and searches across users cross pages.
        self.ks.memories._ns.page_size = 2
        return KeyshredStore(self.ks, subject_from=1, shared=[SHARED])

    def make_model(self) -> Model:
        return Model()

    def teardown(self) -> None:
        try:
            self.ks.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- the model's side ------------------------------------------------------

    def user_of(self, ns: tuple[str, ...]) -> str | None:
        """The user a namespace or prefix names (None: shared, or spans users)."""
        if ns[:1] == SHARED or len(ns) < 2:
            return None
        return ns[1]

    def refused(self, ns: tuple[str, ...]) -> bool:
        return self.user_of(ns) in self.erased

    def drop_empty(self) -> None:
        """Namespaces that hold nothing are forgotten: ``InMemoryStore`` creates one
        on a lookup (a read creates nothing in keyshred) and keeps an emptied one's
        place in its search order, which keyshred does not (a namespace filled again
        sorts by its new first item; README.md, LangGraph section)."""
        for ns in [ns for ns, items in self.model._data.items() if not items]:
            del self.model._data[ns]

    def expect_write(self, ns: tuple[str, ...], key: str, value: Any) -> type | None:
        """The error keyshred must raise for one put/delete (None: it applies)."""
        if bad_label(ns):
            return InvalidInput
        if self.refused(ns):
            return SubjectSuppressed
        if ns[:1] == SHARED and value is not None and is_personal(ns, key, value):
            return InvalidInput
        return None

    def applied(self, ns: tuple[str, ...], value: Any) -> None:
        if value is not None:
            user = self.user_of(ns)
            if user is not None:
                self.written.add(user)

    def compare(self, got: tuple[str, Any], want: tuple[str, Any], what: str) -> None:
        assert got == want, f"{what}: keyshred {got!r} != model {want!r}"

    # -- rules -----------------------------------------------------------------

    @rule(ns=namespaces, key=keys, value=values)
    def put(self, ns: tuple[str, ...], key: str, value: dict[str, Any]) -> None:
        error = self.expect_write(ns, key, value)
        got = outcome(lambda: self.store.put(ns, key, value))
        if error is None:
            self.model.put(ns, key, value)
            self.applied(ns, value)
            self.compare(got, ("ok", None), f"put {ns} {key!r}")
        else:
            self.compare(got, ("error", error), f"put {ns} {key!r}")

    @rule(ns=namespaces, key=keys)
    def delete(self, ns: tuple[str, ...], key: str) -> None:
        error = self.expect_write(ns, key, None)
        got = outcome(lambda: self.store.delete(ns, key))
        if error is None:
            self.model.delete(ns, key)
            self.drop_empty()
            self.compare(got, ("ok", None), f"delete {ns} {key!r}")
        else:
            self.compare(got, ("error", error), f"delete {ns} {key!r}")

    @rule(ns=namespaces, key=keys)
    def get(self, ns: tuple[str, ...], key: str) -> None:
        got = outcome(lambda: self.store.get(ns, key))
        if not bad_label(ns) and self.refused(ns):
            want: tuple[str, Any] = ("error", SubjectSuppressed)
        else:
            want = outcome(lambda: self.model.get(ns, key))
            self.drop_empty()
        self.compare(got, want, f"get {ns} {key!r}")

    @rule(prefix=prefixes, filter=filters, limit=limits, offset=offsets)
    def search(
        self, prefix: tuple[str, ...], filter: dict[str, Any] | None, limit: int, offset: int
    ) -> None:
        def call(store: Any) -> Any:
            return store.search(prefix, filter=filter, limit=limit, offset=offset)

        got = outcome(lambda: call(self.store))
        if not bad_label(prefix) and self.refused(prefix):
            want: tuple[str, Any] = ("error", SubjectSuppressed)
        else:
            want = outcome(lambda: call(self.model))
        self.compare(got, want, f"search {prefix} {filter} limit={limit} offset={offset}")

    @rule(prefix=paths, suffix=paths, max_depth=depths, limit=limits, offset=offsets)
    def list_namespaces(
        self,
        prefix: tuple[str, ...] | None,
        suffix: tuple[str, ...] | None,
        max_depth: int | None,
        limit: int,
        offset: int,
    ) -> None:
        def call(store: Any) -> Any:
            return store.list_namespaces(
                prefix=prefix, suffix=suffix, max_depth=max_depth, limit=limit, offset=offset
            )

        got = outcome(lambda: call(self.store))
        want = outcome(lambda: call(self.model))
        self.compare(got, want, f"list_namespaces {prefix} {suffix} {max_depth} {limit} {offset}")

    def expect_batch(self, ops: list[Op]) -> type | None:
        """The error keyshred must raise for a batch, in its order: labels LangGraph
        forbids (every op checked first; ``InMemoryStore.batch`` checks none, its
        methods and its SQL stores do), then reads naming an erased user (reads run
        before writes), then writes (the last of each key; a personal shared item first, then an
        erased user: refused before any write is applied)."""
        for op in ops:
            ns = op.namespace_prefix if isinstance(op, SearchOp) else getattr(op, "namespace", ())
            if isinstance(op, GetOp | PutOp | SearchOp) and any(
                not label or "." in label for label in ns
            ):
                return InvalidInput
        for op in ops:
            if isinstance(op, GetOp) and self.refused(op.namespace):
                return SubjectSuppressed
            if isinstance(op, SearchOp) and self.refused(op.namespace_prefix):
                return SubjectSuppressed
        last = {(op.namespace, op.key): op for op in ops if isinstance(op, PutOp)}
        errors = {self.expect_write(op.namespace, op.key, op.value) for op in last.values()}
        # (a personal shared item is looked for before the users' guards)
        for error in (InvalidInput, SubjectSuppressed):
            if error in errors:
                return error
        return None

    @rule(ops=st.lists(batch_ops, min_size=1, max_size=5))
    def batch(self, ops: list[Op]) -> None:
        error = self.expect_batch(ops)
        got = outcome(lambda: self.store.batch(ops))
        if error is not None:
            self.compare(got, ("error", error), f"batch {ops}")
            return
        want = outcome(lambda: self.model.batch(ops))
        for op in ops:
            if isinstance(op, PutOp):
                self.applied(op.namespace, op.value)
        self.drop_empty()
        self.compare(got, want, f"batch {ops}")

    @rule()
    def reopen(self) -> None:
        self.ks.close()
        self.ks = Keyshred.open(self.dir / "data")
        self.store = self.make_store()

    @rule(user=users)
    def erase(self, user: str) -> None:
        req = self.ks.erase(user, requested_by="dpo", reason="gdpr-art17")
        assert req.state == "completed", (req.state, req.error)
        # What this request found: an earlier erasure's keys are not its own.
        assert req.found_data == (user in self.written), (user, req.found_data)
        if user in self.written:
            self.erased.add(user)
            self.written.discard(user)  # its keys are destroyed; it stays erased
            for item in self.model.search(("users", user), limit=10_000):
                self.model.delete(item.namespace, item.key)
            self.drop_empty()

    @invariant()
    def everything_listed(self) -> None:
        """The whole store, searched and listed, is the model's."""
        got = outcome(lambda: self.store.search((), limit=10_000))
        want = outcome(lambda: self.model.search((), limit=10_000))
        self.compare(got, want, "search everything")


StoreModel.TestCase.settings = model_settings(max_examples=50, stateful_step_count=30)
TestStoreModel = StoreModel.TestCase


class PostgresStoreModel(StoreModel):
    """The same machine with the catalog and the key store in PostgreSQL (a fresh
    schema per example, dropped after it)."""

    def __init__(self) -> None:
        with contextlib.ExitStack() as stack:
            self.schema = stack.enter_context(pg_schema("ks_model"))
            super().__init__()
            self._drop_schema = stack.pop_all()  # closed by teardown

    def config(self) -> Config:
        url = pg_url(self.schema)
        return Config.model_validate(
            {"storage": {"catalog_url": url}, "keyring": {"store_url": url}}
        )

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            self._drop_schema.close()


class AsyncTwins:
    """``KeyshredStore`` driven through its async twins (``aput``, ``aget``,
    ``asearch``, ``alist_namespaces``, ``abatch``, ``adelete``), each on an event
    loop of its own, so that the machine checks them against the same model."""

    def __init__(self, store: KeyshredStore) -> None:
        self._store = store

    def put(self, *args: Any, **kwargs: Any) -> Any:
        return asyncio.run(self._store.aput(*args, **kwargs))

    def delete(self, *args: Any, **kwargs: Any) -> Any:
        return asyncio.run(self._store.adelete(*args, **kwargs))

    def get(self, *args: Any, **kwargs: Any) -> Any:
        return asyncio.run(self._store.aget(*args, **kwargs))

    def search(self, *args: Any, **kwargs: Any) -> Any:
        return asyncio.run(self._store.asearch(*args, **kwargs))

    def list_namespaces(self, *args: Any, **kwargs: Any) -> Any:
        return asyncio.run(self._store.alist_namespaces(*args, **kwargs))

    def batch(self, ops: list[Op]) -> Any:
        return asyncio.run(self._store.abatch(ops))


class AsyncStoreModel(StoreModel):
    """The same machine through the async API."""

    def make_store(self) -> Any:
        self.ks.memories._ns.page_size = 2
        return AsyncTwins(KeyshredStore(self.ks, subject_from=1, shared=[SHARED]))


# A few words, so that texts repeat (equal scores: ties) and queries hit them.
WORDS = ("sail", "boat", "wind", "tea", "rain")
texts = st.lists(st.sampled_from(WORDS), min_size=1, max_size=3).map(" ".join)
INDEX = {"dims": DIMS, "embed": hash_embed, "fields": ["text", "b"]}


class SemanticStoreModel(StoreModel):
    """The same machine with LangGraph's ``index`` on both sides (the same custom
    embedding function, two fields: max pooling), puts with and without text (and
    the batch's ``index=False`` puts: unscored items) and searches with a query:
    the same items in the same order (best score first, ties and unscored items in
    insertion order, as ``InMemoryStore``), with the same scores."""

    def make_store(self) -> Any:
        return KeyshredStore(self.ks, subject_from=1, shared=[SHARED], index=INDEX)  # type: ignore[arg-type]

    def make_model(self) -> Model:
        return Model(index=INDEX)  # type: ignore[arg-type]

    @initialize(
        seed=st.lists(st.tuples(st.sampled_from(USERS), keys, texts), min_size=2, max_size=6)
    )
    def seeded(self, seed: list[tuple[str, str, str]]) -> None:
        """Items with text first, so that most searches rank something."""
        for user, key, text in seed:
            self.put_text(user_ns(user, ("notes",)), key, {}, text, None)

    @rule(
        ns=namespaces,
        key=keys,
        value=values,
        text=st.one_of(st.none(), texts),
        index=st.sampled_from([None, None, False, ["text"]]),
    )
    def put_text(
        self,
        ns: tuple[str, ...],
        key: str,
        value: dict[str, Any],
        text: str | None,
        index: Any,
    ) -> None:
        value = value if text is None else {**value, "text": text}
        error = self.expect_write(ns, key, value)
        got = outcome(lambda: self.store.put(ns, key, value, index=index))
        if error is None:
            self.model.put(ns, key, value, index=index)
            self.applied(ns, value)
            self.compare(got, ("ok", None), f"put {ns} {key!r} index={index}")
        else:
            self.compare(got, ("error", error), f"put {ns} {key!r} index={index}")

    @rule(
        prefix=st.one_of(st.sampled_from([(), ("users",), SHARED]), prefixes),
        query=texts,
        filter=st.one_of(st.none(), filters),
        limit=limits,
        offset=offsets,
    )
    def semantic_search(
        self,
        prefix: tuple[str, ...],
        query: str,
        filter: dict[str, Any] | None,
        limit: int,
        offset: int,
    ) -> None:
        def call(store: Any) -> Any:
            found = store.search(prefix, query=query, filter=filter, limit=limit, offset=offset)
            return [(*norm(item), item.score) for item in found]

        what = f"search {prefix} {query!r} {filter} limit={limit} offset={offset}"
        got = outcome(lambda: call(self.store))
        if not bad_label(prefix) and self.refused(prefix):
            self.compare(got, ("error", SubjectSuppressed), what)
            return
        want = outcome(lambda: call(self.model))
        # float32 vectors on one side, float64 on the other: scores agree to 1e-5.
        self.compare(strip_scores(got), strip_scores(want), what)
        if got[0] == "ok":
            for (*_, mine), (*_, theirs) in zip(got[1], want[1], strict=True):
                assert (mine is None) == (theirs is None), (what, mine, theirs)
                if mine is not None:
                    assert abs(mine - theirs) < 1e-5, (what, mine, theirs)


def strip_scores(answer: tuple[str, Any]) -> tuple[str, Any]:
    if answer[0] != "ok":
        return answer
    return "ok", [found[:3] for found in answer[1]]


# Fewer examples for the variants: the rules are the same, the backend or the
# calling convention is what they add (about 10 s each here).
_VARIANT = model_settings(max_examples=12, stateful_step_count=30)
PostgresStoreModel.TestCase.settings = _VARIANT
AsyncStoreModel.TestCase.settings = _VARIANT
SemanticStoreModel.TestCase.settings = model_settings(max_examples=25, stateful_step_count=30)
TestPostgresStoreModel = PostgresStoreModel.TestCase
TestAsyncStoreModel = AsyncStoreModel.TestCase
TestSemanticStoreModel = SemanticStoreModel.TestCase


# -- minimal reproductions of what the machine found ------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Iterator[KeyshredStore]:
    ks = Keyshred.init(tmp_path / "data")
    yield KeyshredStore(ks, subject_from=1, shared=[SHARED])
    ks.close()


def test_batch_refuses_labels_langgraph_forbids(store: KeyshredStore) -> None:
    # batch() checked no label rule (LangGraph's methods check before batching, its
    # SQL stores in batch): a "." label reached subject_of, and one spelling the
    # shared subject's name filed a person's item under the shared subject, past the
    # detector that keeps personal data out of it.
    with pytest.raises(InvalidInput):
        store.batch([PutOp(("users", "a.b", "notes"), "k", {"v": 1})])
    with pytest.raises(InvalidInput):
        store.batch([PutOp(("users", SHARED_SUBJECT, "notes"), "k", {"mail": "bob@example.com"})])
    with pytest.raises(InvalidInput):
        store.batch([GetOp(("users", "a.b"), "k")])
    assert store.search(()) == []


def test_a_refused_batch_writes_nothing(store: KeyshredStore) -> None:
    # A batch's writes were refused subject by subject: ann's item was written, then
    # the shared item was refused (InvalidInput, which says nothing changed).
    with pytest.raises(InvalidInput):
        store.batch(
            [
                PutOp(("users", "ann", "notes"), "k", {"v": 1}),
                PutOp(SHARED, "bob@example.com", {}),
            ]
        )
    store.put(("users", "eve", "notes"), "k", {"v": 1})
    store.erase_subject("eve", requested_by="dpo", reason="art17")
    with pytest.raises(SubjectSuppressed):
        store.batch(
            [
                PutOp(("users", "ann", "notes"), "k", {"v": 1}),
                PutOp(("users", "eve", "notes"), "k", {"v": 2}),
            ]
        )
    assert store.search(()) == []


def test_a_batch_across_subjects_keeps_its_order(store: KeyshredStore) -> None:
    # Writes were grouped by subject, in the order each subject first came up: the
    # shared item (its subject first named by a deletion) was created before ann's.
    ops = [
        PutOp(SHARED, "k", None),
        PutOp(("users", "ann", "notes"), "k", {}),
        PutOp((*SHARED, "topic"), "k", {}),
    ]
    model = InMemoryStore()
    for s in (store, model):
        s.batch(ops)
    assert norm(store.search(())) == norm(model.search(()))


@pytest.mark.parametrize("case", ["filter", "deleted-first-item"])
def test_one_users_search_orders_namespaces_as_inmemorystore(
    store: KeyshredStore, case: str
) -> None:
    model = InMemoryStore()
    for s in (store, model):
        s.put(("users", "ann", "A"), "a1", {"a": 0})
        s.put(("users", "ann", "B"), "b1", {"a": 1})
        s.put(("users", "ann", "A"), "a2", {"a": 1})
        if case == "deleted-first-item":
            s.delete(("users", "ann", "A"), "a1")
    found = store.search(("users", "ann"), filter={"a": 1})
    assert norm(found) == norm(model.search(("users", "ann"), filter={"a": 1}))
    assert norm(found) == norm(store.search(("users",), filter={"a": 1}))


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.aget(("users", "a.b"), "k"),
        lambda s: s.asearch(("users", "a.b")),
        lambda s: s.aput(("users", "a.b"), "k", {"v": 1}),
        lambda s: s.aput(("langgraph", "ann"), "k", {"v": 1}),
        lambda s: s.adelete(("users", ""), "k"),
        lambda s: s.alist_namespaces(prefix=("users", "a.b")),
        lambda s: s.aget(("users", "ann"), 5),
    ],
    ids=["aget", "asearch", "aput", "aput-root", "adelete", "alist_namespaces", "aget-key"],
)
def test_async_twins_refuse_as_the_sync_methods(store: KeyshredStore, call: Any) -> None:
    # The async twins were LangGraph's own: InvalidNamespaceError, whose message
    # repeats the label (a subject id, here), where the sync methods raise
    # InvalidInput without it; and a key that is no string was str()-ed.
    with pytest.raises(InvalidInput) as caught:
        asyncio.run(call(store))
    assert "a.b" not in str(caught.value)
    assert store.search(()) == []


@pytest.mark.parametrize(
    "bad",
    [
        PutOp(("users", "bob", "notes"), "k", {"v": 2}, ttl=-1.0),
        PutOp(("users", "bob", "notes"), "k", {"v": 2}, ttl=1e300),
        PutOp(("users", "bob", "notes"), "k", {"v": 2}, ttl=float("nan")),
        PutOp(("users", "bob", "notes"), "k", {1: "not a JSON object key"}),
        PutOp(("users", "bob", "notes"), "k", {"v": "x" * (2 << 20)}),
        PutOp(("~own", "bob"), "k", {"v": 2}),
        PutOp(("users", "ann", "notes"), "k2", {"v": 2}, ttl=-1.0),
    ],
    ids=["ttl-negative", "ttl-huge", "ttl-nan", "key-not-str", "too-large", "own-ns", "same"],
)
def test_a_batch_refused_by_a_later_write_writes_nothing(store: KeyshredStore, bad: PutOp) -> None:
    # Each subject's writes were refused by its own delete_many/put_many, in turn: a
    # refusal of bob's (or of ann's puts, after ann's deletes) left the writes made
    # before it applied, and a ttl no timedelta holds raised OverflowError/ValueError.
    store.put(("users", "ann", "notes"), "old", {"v": 0})
    before = norm(store.search(()))
    with pytest.raises(InvalidInput):
        store.batch(
            [
                PutOp(("users", "ann", "notes"), "old", None),
                PutOp(("users", "ann", "notes"), "k", {"v": 1}),
                bad,
            ]
        )
    assert norm(store.search(())) == before
