"""Cross-subject store operations answered from the catalog's namespace index (issue
#25 item 2): the same results as LangGraph's ``InMemoryStore`` (property-based), only
the matching subjects' partitions opened, the index kept through deletions, expiry,
suppression and erasure (no label in clear in the catalog, none left after), and a
store written before revision 0011 indexed lazily on its first cross-subject read."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from langgraph.store.memory import InMemoryStore

from keyshred import Keyshred
from keyshred.config import KeyringSettings
from keyshred.integrations.langgraph import KeyshredStore
from keyshred.storage.partition import Partition
from keyshred.storage.schema import memory_namespaces, memory_ns_pending, memory_ns_prefixes
from tests.storage.conftest import make_config


@pytest.fixture
def ks(catalog_url: str, tmp_path: Path) -> Iterator[Keyshred]:
    store = Keyshred.init(tmp_path / "data", make_config(catalog_url))
    yield store
    store.close()


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The subject_refs whose partitions are read (from the catalog and segments)."""
    seen: list[str] = []
    real = Partition._read_once

    def counted(self: Partition, **kwargs: Any) -> Any:
        seen.append(self.subject_ref)
        return real(self, **kwargs)

    monkeypatch.setattr(Partition, "_read_once", counted)
    return seen


def norm(result: list[Any]) -> list[Any]:
    return [(tuple(r.namespace), r.key, r.value) if hasattr(r, "key") else tuple(r) for r in result]


def index_rows(ks: Keyshred, ref: str | None = None) -> int:
    with ks.catalog.engine.connect() as conn:
        n = 0
        for table in (memory_namespaces, memory_ns_prefixes):
            query = sa.select(sa.func.count()).select_from(table)
            if ref is not None:
                query = query.where(table.c.subject_ref == ref)
            n += int(conn.execute(query).scalar() or 0)
        return n


# -- the same results as InMemoryStore ---------------------------------------------

LABELS = st.sampled_from(["a", "b", "c"])
USERS = st.sampled_from(["u1", "u2", "u3", "u4"])
PUT = st.tuples(
    st.just("put"),
    USERS,
    st.lists(LABELS, max_size=2),
    st.sampled_from(["k1", "k2"]),
    st.integers(0, 3),
)
# Deletions only of items that have a sibling left in their namespace: InMemoryStore
# keeps (and lists) a namespace emptied by deletions, keyshred does not
# (``test_an_emptied_namespace_leaves_the_index`` covers that case).
DELETE = st.tuples(st.just("delete"), USERS, st.lists(LABELS, max_size=2), st.just("k1"))
ACTIONS = st.lists(st.one_of(PUT, PUT, DELETE), min_size=1, max_size=14)
CONDITION = st.lists(st.sampled_from(["a", "b", "c", "*"]), max_size=2)


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    actions=ACTIONS,
    reads=st.fixed_dictionaries(
        {
            "extra": CONDITION,
            "suffix": st.one_of(
                st.none(), st.lists(st.sampled_from(["a", "b", "c", "*"]), min_size=1, max_size=2)
            ),
            "depth": st.one_of(st.none(), st.integers(1, 4)),
            "page": st.tuples(st.integers(1, 5), st.integers(0, 4)),
            "value": st.one_of(st.none(), st.integers(0, 3)),
        }
    ),
)
@pytest.mark.parametrize("paging", ["one page", "pages of 2", "pages of 2, walked"])
def test_cross_subject_reads_match_inmemorystore(
    ks: Keyshred,
    monkeypatch: pytest.MonkeyPatch,
    paging: str,
    actions: list[Any],
    reads: dict[str, Any],
) -> None:
    from keyshred.storage import namespaces

    if paging != "one page":
        ks.memories._ns.page_size = 2
    # "walked": every prefix counts as dense, so searches page through the
    # first-time index probing each row's prefix (NamespaceIndex._dense).
    monkeypatch.setattr(namespaces, "_SORTED_AT_MOST", 0 if "walked" in paging else 20_000)
    extra, suffix, depth = reads["extra"], reads["suffix"], reads["depth"]
    value = reads["value"]
    root = f"r{uuid.uuid4().hex[:8]}"  # this example's own namespaces in a shared store
    ours, reference = KeyshredStore(ks, subject_from=1), InMemoryStore()
    live: dict[tuple[str, ...], set[str]] = {}
    for action in actions:
        ns = (root, action[1], *action[2])
        if action[0] == "put":
            for store in (ours, reference):
                store.put(ns, action[3], {"v": action[4]})
            live.setdefault(ns, set()).add(action[3])
        elif live.get(ns, set()) - {action[3]} and action[3] in live[ns]:
            for store in (ours, reference):
                store.delete(ns, action[3])
            live[ns].discard(action[3])
    limit, offset = reads["page"]
    filt = None if value is None else {"v": value}
    calls: list[Any] = [
        lambda s: s.search((root,), limit=limit, offset=offset),
        lambda s: s.search((root,), filter=filt, limit=limit, offset=offset),
        lambda s: s.list_namespaces(prefix=(root, *extra)),
        lambda s: s.list_namespaces(
            prefix=(root, *extra), suffix=suffix, max_depth=depth, limit=limit, offset=offset
        ),
        lambda s: s.list_namespaces(prefix=(root, "*", *extra), max_depth=depth),
    ]
    for n, call in enumerate(calls):
        assert norm(call(ours)) == norm(call(reference)), f"call {n}"


def test_workload_of_two_users_across_subjects(ks: Keyshred) -> None:
    ours, reference = KeyshredStore(ks, subject_from=1), InMemoryStore()
    for store in (ours, reference):
        for i in range(5):
            for user in ("ann", "ben", "cy"):
                store.put(("users", user, "notes" if i % 2 else "prefs"), f"k{i}", {"i": i})
        store.put(("users", "ann", "notes"), "k1", {"i": 10})  # keeps its place
        store.delete(("users", "ben", "prefs"), "k0")
    for call in (
        lambda s: s.search(("users",), limit=4, offset=3),
        lambda s: s.search(("users",), filter={"i": {"$gte": 3}}, limit=20),
        lambda s: s.search((), limit=7),
        lambda s: s.list_namespaces(prefix=("users",), max_depth=2),
        lambda s: s.list_namespaces(suffix=("notes",)),
        lambda s: s.list_namespaces(prefix=("users", "*", "prefs")),
    ):
        assert norm(call(ours)) == norm(call(reference))


# -- a page at a time ---------------------------------------------------------------


def _paged_store(ks: Keyshred, users: int) -> tuple[KeyshredStore, InMemoryStore]:
    ours, reference = KeyshredStore(ks, subject_from=1), InMemoryStore()
    for store in (ours, reference):
        for u in range(users):
            for leaf in ("notes", "prefs"):
                store.put(("users", f"user-{u:02d}", leaf), "k", {"u": u, "leaf": leaf})
    return ours, reference


def test_a_listing_across_subjects_holds_a_page_and_fills_half_the_key_cache(
    catalog_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listing over every subject read and decrypted the whole index at once (3.2 GB
    of RSS at 1,000,000 subjects) and put every subject's key into the keyring's
    cache, pushing the hot keys out. It now holds a page of index rows and the
    namespaces it will answer with, and caches the keys it unwraps only while
    they fill half of the cache (here 8 of 16)."""
    config = make_config(catalog_url)
    config = config.model_copy(update={"keyring": KeyringSettings(cache_max_entries=16)})
    with Keyshred.init(tmp_path / "data", config) as ks:
        _listing_holds_a_page(ks, monkeypatch)


def _listing_holds_a_page(ks: Keyshred, monkeypatch: pytest.MonkeyPatch) -> None:
    ours, reference = _paged_store(ks, 30)
    index = ks.memories._ns
    index.page_size = 4
    real = index.open_labels
    held: list[int] = []

    def open_labels(rows: Any, *args: Any, **kwargs: Any) -> Any:
        held.append(len(rows))
        return real(rows, *args, **kwargs)

    monkeypatch.setattr(index, "open_labels", open_labels)
    ks.memories.evict_all()
    ks.keyring.evict_all()
    for call in (
        lambda s: s.list_namespaces(prefix=("users",), limit=5, offset=7),
        lambda s: s.list_namespaces(limit=3),
        lambda s: s.list_namespaces(prefix=("users",), max_depth=2, limit=4, offset=26),
        lambda s: s.list_namespaces(suffix=("prefs",), limit=100),
    ):
        held.clear()
        assert norm(call(ours)) == norm(call(reference))
        assert held and max(held) <= 4 and sum(held) == 60  # every row, 4 at a time
        assert len(ks.keyring.cache) <= 8


@pytest.mark.parametrize("walked", [False, True])
def test_a_search_across_subjects_reads_the_index_only_as_far_as_its_page(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch, loads: list[str], walked: bool
) -> None:
    """A search across subjects read every row of the index under its prefix and
    sorted them (21 s at 1,000,000 subjects for a page of 10). It reads the rows a
    page at a time in first-time order and stops once the rest sort after its
    page: here 5 subjects' partitions and a few pages, of 40 subjects."""
    from keyshred.storage import namespaces

    monkeypatch.setattr(namespaces, "_SORTED_AT_MOST", 0 if walked else 20_000)
    ours, reference = _paged_store(ks, 40)
    index = ks.memories._ns
    index.page_size = 4
    real = index.pages
    read: list[int] = []

    def pages(*args: Any, **kwargs: Any) -> Any:
        for rows in real(*args, **kwargs):
            read.append(len(rows))
            yield rows

    monkeypatch.setattr(index, "pages", pages)
    ks.memories.evict_all()
    loads.clear()
    assert norm(ours.search(("users",), limit=4, offset=6)) == norm(
        reference.search(("users",), limit=4, offset=6)
    )
    assert len(set(loads)) == 5  # items 7-10 of 80 (2 a user): users 0 to 4 read
    assert sum(read) <= 12, read  # of 80 index rows
    read.clear()
    assert norm(ours.search((), limit=2)) == norm(reference.search((), limit=2))
    assert sum(read) <= 8, read


# -- only the matching subjects -------------------------------------------------------


def test_cross_subject_reads_open_only_the_matching_subjects(
    ks: Keyshred, loads: list[str]
) -> None:
    # The subject is the third label: ("org", team) spans the team's people only.
    store = KeyshredStore(ks, subject_from=2)
    for n in range(24):
        team = "red" if n < 3 else "blue"
        store.put(("org", team, f"person-{n}", "notes"), "k", {"n": n})
    red = {ks.subject_ref(f"person-{n}") for n in range(3)}
    ks.memories.evict_all()
    loads.clear()
    assert len(store.search(("org", "red"), limit=10)) == 3
    assert set(loads) == red  # 3 partitions read, not 24
    loads.clear()
    assert len(store.list_namespaces(prefix=("org",))) == 24
    assert store.list_namespaces(prefix=("org", "red"), max_depth=3) == [
        ("org", "red", f"person-{n}") for n in range(3)
    ]
    assert loads == []  # listing decrypts index rows, opens no partition
    # A page of 2 over all 24 subjects reads the two subjects that come first.
    ks.memories.evict_all()
    assert [i.value["n"] for i in store.search(("org",), limit=2)] == [0, 1]
    assert sorted(set(loads)) == sorted({ks.subject_ref("person-0"), ks.subject_ref("person-1")})


# -- the index kept in step -----------------------------------------------------------


def test_an_emptied_namespace_leaves_the_index(ks: Keyshred) -> None:
    store = KeyshredStore(ks, subject_from=1)
    store.put(("u", "dee", "a"), "k1", {"v": 1})
    store.put(("u", "dee", "a"), "k2", {"v": 2})
    store.put(("u", "dee", "b"), "k1", {"v": 3})
    ref = ks.subject_ref("dee")
    rows = index_rows(ks, ref)
    store.put(("u", "dee", "a"), "k3", {"v": 4})  # an existing namespace: no index write
    assert index_rows(ks, ref) == rows
    store.delete(("u", "dee", "a"), "k1")
    assert store.list_namespaces(prefix=("u",)) == [("u", "dee", "a"), ("u", "dee", "b")]
    store.delete(("u", "dee", "a"), "k2")
    store.delete(("u", "dee", "a"), "k3")
    assert store.list_namespaces(prefix=("u",)) == [("u", "dee", "b")]
    assert [i.key for i in store.search(("u",))] == ["k1"]
    assert index_rows(ks, ref) == 4  # ("u", "dee", "b"): one row and three prefixes
    store.put(("u", "dee", "a"), "k9", {"v": 9})  # back, after "b" in insertion order
    assert [i.namespace for i in store.search(("u",))] == [("u", "dee", "b"), ("u", "dee", "a")]


def test_expired_and_suppressed_are_not_listed(ks: Keyshred) -> None:
    store = KeyshredStore(ks, subject_from=1, ttl={"default_ttl": 60})
    store.put(("u", "eve", "tmp"), "short", {"v": 1}, ttl=1)
    store.put(("u", "eve", "keep"), "long", {"v": 2})
    store.put(("u", "fay", "x"), "k", {"v": 3})
    real = ks.memories._clock
    ks.memories._clock = lambda: real() + timedelta(minutes=2)  # type: ignore[method-assign]
    try:
        assert store.list_namespaces(prefix=("u",)) == [("u", "eve", "keep"), ("u", "fay", "x")]
        assert [i.key for i in store.search(("u",))] == ["long", "k"]
    finally:
        ks.memories._clock = real  # type: ignore[method-assign]
    ks.catalog.suppress(ks.subject_ref("fay"))
    assert store.list_namespaces(prefix=("u",)) == [("u", "eve", "keep"), ("u", "eve", "tmp")]
    assert [i.key for i in store.search(("u",))] == ["short", "long"]


def test_erasure_removes_the_subjects_index_rows(
    ks: Keyshred, catalog_url: str, tmp_path: Path
) -> None:
    probe = f"zq{uuid.uuid4().hex[:10]}"  # a namespace label that is a person's id
    store = KeyshredStore(ks, subject_from=1)
    for i in range(3):
        store.put(("users", probe, f"topic{i}"), "k", {"v": i})
    store.put(("users", "gus", "notes"), "k", {"v": 9})
    ref = ks.subject_ref(probe)
    hashes = [ks.memories.namespace_hash(("users", probe, f"topic{i}")) for i in range(3)]
    hashes.append(ks.memories.namespace_hash(("users", probe)))
    assert index_rows(ks, ref) == 3 + 3 * 3  # three namespaces, three prefixes each
    assert len(store.list_namespaces(prefix=("users", probe))) == 3
    req = store.erase_subject(probe, requested_by="dpo", reason="art17", request_id="r1")
    assert req.state == "completed", req.error
    assert index_rows(ks, ref) == 0
    assert store.list_namespaces(prefix=("users",)) == [("users", "gus", "notes")]
    assert [i.value for i in store.search(("users",))] == [{"v": 9}]
    if catalog_url.startswith("sqlite"):
        ks.close()
        for path in tmp_path.rglob("catalog.db*"):
            data = path.read_bytes()
            assert probe.encode() not in data, path
            for h in hashes:
                assert h.encode() not in data, path


def test_no_label_in_clear_in_the_index(ks: Keyshred) -> None:
    probe = f"zq{uuid.uuid4().hex[:10]}"
    store = KeyshredStore(ks, subject_from=1)
    store.put(("users", probe, f"about-{probe}"), "k", {"v": 1})
    with ks.catalog.engine.connect() as conn:
        for table in (memory_namespaces, memory_ns_prefixes):
            for row in conn.execute(sa.select(table)):
                assert all(probe.encode() not in bytes(str(v), "utf-8") for v in row), table
                assert all(probe.encode() not in v for v in row if isinstance(v, bytes))


# -- stores written before revision 0011 ------------------------------------------------


def test_a_store_written_before_the_index_is_indexed_lazily(
    catalog_url: str, tmp_path: Path, loads: list[str]
) -> None:
    cfg = make_config(catalog_url)
    ks = Keyshred.init(tmp_path / "data", cfg)
    store = KeyshredStore(ks, subject_from=1)
    for user in ("hal", "ida", "jo"):
        store.put(("users", user, "notes"), "k1", {"u": user})
        store.put(("users", user, "prefs"), "k2", {"u": user})
    want_ns = store.list_namespaces(prefix=("users",))
    want_items = norm(store.search(("users",), limit=10))
    ks.close()
    # The catalog as revision 0010 left it: no index tables (the upgrade lists every
    # subject with memories as pending).
    engine = sa.create_engine(catalog_url)
    with engine.begin() as conn:
        for table in (memory_ns_pending, memory_ns_prefixes, memory_namespaces):
            conn.execute(sa.text(f"DROP TABLE {table.name}"))
        conn.execute(sa.text("UPDATE ks_alembic_catalog SET version_num = '0010'"))
    with engine.connect() as conn:
        pending = conn.execute(sa.text("SELECT count(*) FROM ks_mem_partitions")).scalar()
    engine.dispose()
    assert pending == 3
    ks = Keyshred.open(tmp_path / "data", cfg)
    try:
        with ks.catalog.engine.connect() as conn:
            assert (
                conn.execute(sa.select(sa.func.count()).select_from(memory_ns_pending)).scalar()
                == 3
            )
        store = KeyshredStore(ks, subject_from=1)
        loads.clear()
        assert store.list_namespaces(prefix=("users",)) == want_ns  # indexed now, once
        assert len(set(loads)) == 3
        loads.clear()
        ks.memories.evict_all()
        assert store.list_namespaces(prefix=("users",)) == want_ns
        assert loads == []
        assert norm(store.search(("users",), limit=10)) == want_items
        assert ks.memories._ns.pending() == []
    finally:
        ks.close()


def test_repair_rebuilds_an_index_a_killed_deletion_left_stale(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = KeyshredStore(ks, subject_from=1)
    store.put(("u", "kim", "a"), "k", {"v": 1})
    store.put(("u", "kim", "b"), "k", {"v": 2})
    with monkeypatch.context() as m:  # the deletion's last step never runs
        m.setattr(ks.memories._ns, "apply", lambda run: None)
        store.delete(("u", "kim", "a"), "k")
    # A superset: the emptied namespace is still listed, its search finds nothing.
    assert store.list_namespaces(prefix=("u",)) == [("u", "kim", "a"), ("u", "kim", "b")]
    assert [i.key for i in store.search(("u",))] == ["k"]
    assert ks.memories.repair(ks.subject_ref("kim"), apply=True).ok
    assert store.list_namespaces(prefix=("u",)) == [("u", "kim", "b")]


def test_a_subject_suppressed_during_a_listing_is_not_decrypted(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decide before decrypting, also across subjects: a suppression that lands
    between the index query and the decryption of its rows hides the subject."""
    from keyshred.storage import namespaces

    store = KeyshredStore(ks, subject_from=1)
    store.put(("u", "gil", "notes"), "k", {"v": 1})
    store.put(("u", "hal", "probe-label-hal-6c1"), "k", {"v": 2})
    hal = ks.subject_ref("hal")
    index = ks.memories._ns
    real_pages, real_place = index.pages, namespaces.labels_place
    opened: list[str] = []

    def pages(*args: Any, **kwargs: Any) -> Any:
        for rows in real_pages(*args, **kwargs):
            if not opened:
                ks.catalog.suppress(hal)  # an erasure of hal begins right after the query
            yield rows

    def place(ref: str, *args: Any) -> bytes:
        opened.append(ref)
        return real_place(ref, *args)

    monkeypatch.setattr(index, "pages", pages)
    monkeypatch.setattr(namespaces, "labels_place", place)
    assert store.list_namespaces(prefix=("u",)) == [("u", "gil", "notes")]
    assert hal not in opened and opened
