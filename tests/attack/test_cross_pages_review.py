"""Review of 536d7a0: cross-subject paging, semantic ties, against InMemoryStore."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from langgraph.store.memory import InMemoryStore

from keyshred import Keyshred
from keyshred.integrations.langgraph import KeyshredStore
from tests.integrations.test_langgraph_index import DIMS, hash_embed
from tests.storage.conftest import make_config


def norm(result: list[Any]) -> list[Any]:
    return [(tuple(r.namespace), r.key, r.value) if hasattr(r, "key") else tuple(r) for r in result]


def keys(result: list[Any]) -> list[Any]:
    return [(tuple(i.namespace), i.key) for i in result]


# -- (4) semantic ties: namespace order ------------------------------------------------


@pytest.mark.parametrize(
    ("prefix", "other"),
    [
        (("u", "ann"), "ann"),
        (("u",), "ann"),
        (("u",), "bob"),  # across subjects: float32 scored them apart (now float64)
        ((), "bob"),
    ],
)
def test_semantic_ties_follow_namespace_creation_order(
    ks: Keyshred, prefix: Any, other: str
) -> None:
    """n1 is created first (a, a different text), then n2 (b), then n1 gets c with
    b's text: b and c tie. InMemoryStore's stable sort over its namespaces keeps
    n1's c first; keyshred orders the namespaces by their oldest *ranked* hit."""
    index = {"dims": DIMS, "embed": hash_embed, "fields": ["text"]}
    stores = [KeyshredStore(ks, subject_from=1, index=index), InMemoryStore(index=index)]  # type: ignore[arg-type]
    for s in stores:
        s.put(("u", "ann", "n1"), "a", {"text": "sail"})
        s.put(("u", other, "n2"), "b", {"text": "boat"})
        s.put(("u", "ann", "n1"), "c", {"text": "boat"})
    for limit in (1, 2):
        got, want = (s.search(prefix, query="boat", limit=limit) for s in stores)
        assert keys(got) == keys(want), limit


def test_public_semantic_search_keeps_its_limit(catalog_url: str, tmp_path: Path) -> None:
    from tests.storage.test_vectors import bag_of_words

    with Keyshred.init(tmp_path / "d", make_config(catalog_url), embeddings=bag_of_words) as ks:
        for i in range(6):
            ks.memories.put("ann", ("n", str(i % 3)), f"k{i}", {"text": "same text"}, index=True)
        for limit, offset in [(1, 0), (2, 1), (3, 2)]:
            got = ks.memories.search("ann", query="same text", limit=limit, offset=offset)
            assert len(got) <= limit


# -- (1) listings and searches across subjects, small pages -------------------------------


def _workload(stores: list[Any]) -> None:
    for s in stores:
        for i in range(4):
            for user in ("ann", "ben", "cy", "dot"):
                leaf = ("notes", "prefs", "x")[(i + len(user)) % 3]
                s.put(("users", user, leaf), f"k{i}", {"i": i, "u": user})
                s.put(("users", user, leaf, "deep"), f"d{i}", {"i": i})
        s.put(("users", "ann", "notes"), "k1", {"i": 10})
        s.put(("other", "ann"), "o", {"i": 1})


@pytest.mark.parametrize("page", [1, 2, 3])
@pytest.mark.parametrize("walked", [False, True])
def test_small_pages_match_inmemorystore(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch, page: int, walked: bool
) -> None:
    from keyshred.storage import namespaces

    monkeypatch.setattr(namespaces, "_SORTED_AT_MOST", 0 if walked else 20_000)
    ks.memories._ns.page_size = page
    ours, ref = KeyshredStore(ks, subject_from=1), InMemoryStore()
    _workload([ours, ref])
    calls = []
    for lim, off in [(1, 0), (2, 1), (3, 4), (5, 7), (100, 0), (4, 30)]:
        calls += [
            lambda s, lim=lim, off=off: s.search(("users",), limit=lim, offset=off),
            lambda s, lim=lim, off=off: s.search((), limit=lim, offset=off),
            lambda s, lim=lim, off=off: s.search(
                ("users",), filter={"i": 2}, limit=lim, offset=off
            ),
            lambda s, lim=lim, off=off: s.list_namespaces(limit=lim, offset=off),
            lambda s, lim=lim, off=off: s.list_namespaces(prefix=("users",), limit=lim, offset=off),
            lambda s, lim=lim, off=off: s.list_namespaces(max_depth=2, limit=lim, offset=off),
            lambda s, lim=lim, off=off: s.list_namespaces(
                prefix=("users",), max_depth=3, limit=lim, offset=off
            ),
            lambda s, lim=lim, off=off: s.list_namespaces(suffix=("deep",), limit=lim, offset=off),
            lambda s, lim=lim, off=off: s.list_namespaces(
                prefix=("users", "*", "notes"), limit=lim, offset=off
            ),
        ]
    for n, call in enumerate(calls):
        assert norm(call(ours)) == norm(call(ref)), f"call {n}"


def _two_scopes(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch, page: int, walked: bool
) -> tuple[KeyshredStore, KeyshredStore, InMemoryStore]:
    """Pages of ``page`` rows, walked or sorted; a store per scope and the reference."""
    from keyshred.storage import namespaces

    monkeypatch.setattr(namespaces, "_SORTED_AT_MOST", 0 if walked else 20_000)
    ks.memories._ns.page_size = page
    a = KeyshredStore(ks, subject_from=1)
    b = KeyshredStore(ks, subject_from=1, scope="marketing")
    return a, b, InMemoryStore()


@pytest.mark.parametrize("page", [1, 2, 3])
@pytest.mark.parametrize("walked", [False, True])
def test_several_key_rows_of_one_namespace(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch, page: int, walked: bool
) -> None:
    """Two stores of different scopes write the same namespaces: one namespace of a
    subject has a row per scope key, with different first times."""
    a, b, ref = _two_scopes(ks, monkeypatch, page, walked)
    seq = [
        (a, ("u", "ann", "n"), "k1"),
        (b, ("u", "bob", "m"), "k1"),
        (b, ("u", "ann", "n"), "k2"),
        (a, ("u", "cy", "z"), "k1"),
        (b, ("u", "ann", "p"), "k1"),
        (a, ("u", "bob", "m"), "k2"),
        (a, ("u", "ann", "n"), "k3"),
    ]
    for i, (s, ns, k) in enumerate(seq):
        s.put(ns, k, {"i": i})
        ref.put(ns, k, {"i": i})
    for lim, off in [(1, 0), (1, 1), (2, 1), (3, 3), (10, 0), (2, 5)]:
        for store in (a, b):
            assert norm(store.search(("u",), limit=lim, offset=off)) == norm(
                ref.search(("u",), limit=lim, offset=off)
            ), (lim, off)
            assert norm(store.list_namespaces(prefix=("u",), limit=lim, offset=off)) == norm(
                ref.list_namespaces(prefix=("u",), limit=lim, offset=off)
            )


@pytest.mark.parametrize("page", [1, 2, 3])
@pytest.mark.parametrize("walked", [False, True])
def test_hidden_scope_rows_across_pages(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch, page: int, walked: bool
) -> None:
    """A suppressed scope of ann: its rows are hidden, the namespace's default-scope
    row still lists it; the answer is InMemoryStore's without the hidden puts."""
    a, b, ref = _two_scopes(ks, monkeypatch, page, walked)
    seq = [
        (b, ("u", "ann", "n"), "k0"),
        (a, ("u", "bob", "m"), "k1"),
        (b, ("u", "ann", "p"), "k2"),
        (a, ("u", "ann", "n"), "k3"),
        (b, ("u", "bob", "m"), "k4"),
        (a, ("u", "cy", "z"), "k5"),
        (a, ("u", "ann", "q"), "k6"),
    ]
    for i, (s, ns, k) in enumerate(seq):
        s.put(ns, k, {"i": i})
        if not (s is b and ns[1] == "ann"):
            ref.put(ns, k, {"i": i})
    ks.catalog.suppress(ks.subject_ref("ann"), scope="marketing")
    for lim, off in [(1, 0), (1, 1), (2, 1), (3, 3), (10, 0), (2, 4)]:
        assert norm(a.search(("u",), limit=lim, offset=off)) == norm(
            ref.search(("u",), limit=lim, offset=off)
        ), (lim, off)
        assert norm(a.list_namespaces(prefix=("u",), limit=lim, offset=off)) == norm(
            ref.list_namespaces(prefix=("u",), limit=lim, offset=off)
        ), (lim, off)


def test_no_key_of_an_erased_subject_stays_cached_after_a_listing(ks: Keyshred) -> None:
    store = KeyshredStore(ks, subject_from=1)
    for u in ("ann", "ben", "cy"):
        store.put(("u", u, "n"), "k", {"u": u})
    ks.memories._ns.page_size = 1
    ks.keyring.evict_all()
    assert len(store.list_namespaces(prefix=("u",))) == 3
    ben = ks.subject_ref("ben")
    assert any(v[0].subject_ref == ben for v in ks.keyring.cache._by_id.values())
    req = store.erase_subject("ben", requested_by="dpo", reason="art17", request_id="r1")
    assert req.state == "completed", req.error
    cached = [v for v in ks.keyring.cache._by_id.values() if v[0].subject_ref == ben]
    assert cached == []
    assert store.list_namespaces(prefix=("u",)) == [("u", "ann", "n"), ("u", "cy", "n")]
