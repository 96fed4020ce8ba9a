"""Bad input gets a typed error (issue #18, item 9), property-based.

Hypothesis drives the public API with arbitrary values: wrong types, lone
surrogates, values nested far deeper than the recursion limit, huge numbers, NaN.
Every call either works or raises a ``KeyshredError``; nothing else comes out, and
the store still opens afterwards with what was stored before intact."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keyshred import Keyshred
from keyshred.errors import KeyshredError
from keyshred.storage.memories import PutItem
from tests.storage.conftest import make_config
from tests.storage.test_vectors import bag_of_words

pytest.importorskip("langgraph")

from keyshred.integrations.langgraph import KeyshredSaver, KeyshredStore

SEED = ("seed-subject", ("seed",), "k", {"text": "stored before the fuzzing"})
SETTINGS = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class _Deep(list[Any]):
    """A list nested ``depth`` levels deep, with a short repr (for reports)."""

    def __repr__(self) -> str:
        return f"<list nested {self.depth} deep>"

    depth = 0


def _nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth - 1):
        value = [value]
    deep = _Deep([value])
    deep.depth = depth
    return deep


# Text with lone surrogates and every other code point.
wild_text = st.text(st.characters(exclude_categories=()), max_size=40)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(),
    wild_text,
    st.binary(max_size=20),
    st.just(timedelta(hours=1)),
    st.just(object()),
    st.sampled_from(["", "5", "default", "support", "~keyshred", "$.text", "a" * 600]),
)
anything = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(st.one_of(wild_text, st.integers()), inner, max_size=4),
    ),
    max_leaves=12,
) | st.sampled_from([100_000, sys.getrecursionlimit() + 10, 200]).map(_nested)

subjects = st.one_of(st.sampled_from(["alice", "bob", "carol"]), anything)
namespaces = st.one_of(st.just(("notes",)), st.lists(wild_text, max_size=3), anything)
keys = st.one_of(st.just("k1"), wild_text, anything)
values = st.one_of(st.just({"text": "likes tea"}), anything)


def _only_typed_errors(call: Callable[[], object]) -> None:
    with contextlib.suppress(KeyshredError):  # anything else fails the test
        call()


def _seeded(tmp_path: Path) -> Keyshred:
    ks = Keyshred.init(tmp_path / "data", make_config(None), embeddings=bag_of_words)
    ks.memories.put(*SEED[:3], SEED[3], index=True)
    return ks


def _still_intact(ks: Keyshred, tmp_path: Path) -> None:
    m = ks.memories.get(*SEED[:3])
    assert m is not None and m.value == SEED[3]
    ks.close()
    with Keyshred.open(tmp_path / "data", embeddings=bag_of_words) as again:
        m = again.memories.get(*SEED[:3])
        assert m is not None and m.value == SEED[3]


def test_memories_take_anything_and_raise_only_keyshred_errors(tmp_path: Path) -> None:
    ks = _seeded(tmp_path)
    calls: list[Callable[..., Callable[[], object]]] = [
        lambda s, n, k, v, x: lambda: ks.memories.put(s, n, k, v, index=x),
        lambda s, n, k, v, x: lambda: ks.memories.put(s, n, k, v, scope=x, mentions=v),
        lambda s, n, k, v, x: lambda: ks.memories.put(s, n, k, v, purpose=x, sources=v),
        lambda s, n, k, v, x: lambda: ks.memories.get(s, n, k),
        lambda s, n, k, v, x: lambda: ks.memories.update(s, n, k, v),
        lambda s, n, k, v, x: lambda: ks.memories.delete(s, n, k),
        lambda s, n, k, v, x: lambda: ks.memories.search(s, n, filter=v, limit=x),
        lambda s, n, k, v, x: lambda: ks.memories.search(s, n, query=x, offset=v),
        lambda s, n, k, v, x: lambda: ks.memories.put_many(s, [PutItem(n, k, v, index=x)]),
        lambda s, n, k, v, x: lambda: ks.memories.put_many(s, v),
        lambda s, n, k, v, x: lambda: ks.memories.count(s),
    ]

    @SETTINGS
    @given(
        st.sampled_from(calls), subjects, namespaces, keys, values, st.one_of(anything, st.just(5))
    )
    def run(make: Any, s: Any, n: Any, k: Any, v: Any, x: Any) -> None:  # noqa: PLR0917
        _only_typed_errors(make(s, n, k, v, x))

    run()
    _still_intact(ks, tmp_path)


def test_vault_consent_erase_export_take_anything(tmp_path: Path) -> None:
    ks = _seeded(tmp_path)
    out = tmp_path / "exports"
    out.mkdir()
    hour = timedelta(hours=1)
    calls: list[Callable[..., Callable[[], object]]] = [
        lambda s, t, x: lambda: ks.vault.sanitize(t, s, "support", hour),
        lambda s, t, x: lambda: ks.vault.sanitize(t, s, x, x),
        lambda s, t, x: lambda: ks.vault.sanitize("mail a@b.example.com", s, "support", x),
        lambda s, t, x: lambda: ks.vault.sanitize_many(x, s, "support", hour, scope=t),
        lambda s, t, x: lambda: ks.vault.restore(t, "support", x),
        lambda s, t, x: lambda: ks.vault.restore(x, x, "caller"),
        lambda s, t, x: lambda: ks.vault.detokenize(t, x, "caller", subject=s),
        lambda s, t, x: lambda: ks.consent.grant(s, scope=t, category=x),
        lambda s, t, x: lambda: ks.consent.revoke(s, scope=x),
        lambda s, t, x: lambda: ks.consent.list(s),
        lambda s, t, x: lambda: ks.erase(s, x, requested_by=t, reason=x),
        lambda s, t, x: lambda: ks.erase(s, requested_by="test", reason="r", probes=x),
        lambda s, t, x: lambda: ks.export(s, out / "x.ksx", passphrase=x),
        lambda s, t, x: lambda: ks.export(s, x, passphrase="pass" * 4),
    ]

    @SETTINGS
    @given(st.sampled_from(calls), subjects, st.one_of(wild_text, anything), anything)
    def run(make: Any, s: Any, t: Any, x: Any) -> None:
        if isinstance(x, str | bytes):  # an export path is a test folder, not the cwd
            x = out / "named.ksx"
        _only_typed_errors(make(s, t, x))

    run()
    _still_intact(ks, tmp_path)


def test_langgraph_store_and_saver_take_anything(tmp_path: Path) -> None:
    ks = _seeded(tmp_path)
    store = KeyshredStore(ks)
    saver = KeyshredSaver(ks)
    calls: list[Callable[..., Callable[[], object]]] = [
        lambda n, k, v: lambda: store.put(n, k, v),
        lambda n, k, v: lambda: store.get(n, k),
        lambda n, k, v: lambda: store.delete(n, k),
        lambda n, k, v: lambda: store.search(n, query=k, filter=v),
        lambda n, k, v: lambda: store.search(n, limit=v, offset=k),
        lambda n, k, v: lambda: store.list_namespaces(prefix=n, limit=v),
        lambda n, k, v: lambda: saver.get_tuple(v),
        lambda n, k, v: lambda: saver.get_tuple({"configurable": {"thread_id": k, "subject": n}}),
        lambda n, k, v: lambda: list(saver.list(v)),
        lambda n, k, v: lambda: saver.delete_thread(k),
    ]

    @SETTINGS
    @given(
        st.sampled_from(calls),
        st.one_of(st.tuples(st.sampled_from(["alice", "bob"]), wild_text), namespaces),
        keys,
        values,
    )
    def run(make: Any, n: Any, k: Any, v: Any) -> None:
        _only_typed_errors(make(n, k, v))

    run()
    _still_intact(ks, tmp_path)
