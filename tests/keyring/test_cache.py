"""The key cache's holder and co-owner indexes answer what a pass over its entries
would (the erasure's evictions read the indexes, not every cached key)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from keyshred.keyring.cache import KeyCache
from keyshred.keyring.datakey import DataKey

SUBJECTS = ["a", "b", "c", "d"]


def _key(n: int, holder: str, shared: bool) -> DataKey:
    return DataKey(
        n.to_bytes(16, "big"),
        holder,
        "default",
        bytes([n % 256]) * 32,
        owner_tag="t" if shared else "",
    )


def _scan(cache: KeyCache, subject: str) -> tuple[set[bytes], set[str], set[bytes]]:
    """evict_owner's answer by a pass over every entry (the cache before indexes)."""
    doomed, holders, unknown = set(), set(), set()
    for kid, (key, _) in cache._by_id.items():
        if key.subject_ref == subject:
            doomed.add(kid)
        elif key.owner_tag:
            owners = cache._owners.get(kid)
            if owners is None:
                unknown.add(kid)
            elif subject in owners:
                doomed.add(kid)
                holders.add(key.subject_ref)
    return doomed, holders, unknown


_ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("put"),
            st.integers(0, 30),
            st.sampled_from(SUBJECTS),
            st.booleans(),
            st.none() | st.sets(st.sampled_from(SUBJECTS)),
        ),
        st.tuples(st.just("learn"), st.integers(0, 30), st.sets(st.sampled_from(SUBJECTS))),
        st.tuples(st.just("evict"), st.sets(st.integers(0, 30))),
        st.tuples(st.just("evict_subject"), st.sampled_from(SUBJECTS)),
        st.tuples(st.just("evict_owner"), st.sampled_from(SUBJECTS)),
        st.tuples(st.just("clear")),
    ),
    max_size=60,
)


@settings(max_examples=500, deadline=None)
@given(_ops)
def test_indexed_evictions_match_a_scan_of_every_entry(ops: list[tuple[Any, ...]]) -> None:
    cache = KeyCache(max_entries=12, ttl_seconds=60)
    holders_of: dict[int, tuple[str, bool]] = {}  # a key id keeps its holder
    for op in ops:
        if op[0] == "put":
            _, n, holder, shared, owners = op
            holder, shared = holders_of.setdefault(n, (holder, shared))
            cache.put(_key(n, holder, shared), owners)
        elif op[0] == "learn":
            cache.learn_owners(op[1].to_bytes(16, "big"), op[2])
        elif op[0] == "evict":
            cache.evict(n.to_bytes(16, "big") for n in op[1])
        elif op[0] == "evict_subject":
            expected = {k for k, (key, _) in cache._by_id.items() if key.subject_ref == op[1]}
            assert cache.evict_subject(op[1]) == len(expected)
            assert not expected & set(cache._by_id)
        elif op[0] == "evict_owner":
            doomed, holders, unknown = _scan(cache, op[1])
            assert cache.held(op[1]) == len(doomed)
            got_holders, got_unknown = cache.evict_owner(op[1])
            assert (got_holders, set(got_unknown)) == (holders, unknown)
            assert not doomed & set(cache._by_id)
        else:
            cache.clear()
        for s in SUBJECTS:  # the indexes hold exactly the cached keys
            assert cache._held.get(s, set()) == {
                k for k, (key, _) in cache._by_id.items() if key.subject_ref == s
            }
            assert cache._co.get(s, set()) == {
                k for k, o in cache._owners.items() if s in o and k in cache._by_id
            }
        assert cache._unknown == {
            k for k, (key, _) in cache._by_id.items() if key.owner_tag and k not in cache._owners
        }
