"""Fresh-eyes review of issue #24 items 3 and 4 (2026-12-07): ``KeyshredStore``
namespaces (subject rule, shared namespaces that belong to nobody) and erasure
numbers.

Tests named ``test_sanity_*`` checked behaviour that held at the review. Every other
test failed on the reviewed code (f3a44c6) and passes since the fixes; its docstring
says what was wrong and why it matters.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from langgraph.store.base import ListNamespacesOp
from langgraph.store.memory import InMemoryStore

from keyshred import Keyshred
from keyshred.errors import InvalidInput, KeyshredError, SubjectSuppressed
from keyshred.integrations.langgraph import KeyshredSaver, KeyshredStore
from keyshred.integrations.langgraph.store import SHARED_SUBJECT
from tests.integrations.test_langgraph_saver import _config, _graph

PROBE = "zqprobe7731"


@pytest.fixture
def store(ks: Keyshred) -> KeyshredStore:
    return KeyshredStore(ks, subject_from=1, shared=[("faq",)])


def _keys(store: KeyshredStore, prefix: tuple[str, ...]) -> set[str]:
    return {i.key for i in store.search(prefix, limit=100)}


# -- shared namespaces: what gets in -------------------------------------------------


def test_registered_name_in_shared_namespace_is_refused_without_override(
    ks: Keyshred, store: KeyshredStore
) -> None:
    """DEFECT (high). A shared put is checked only with the pattern detector
    (``vault.detect``: e-mail, phone, ids...), while the memory store's mention finder
    also matches *registered names*. A FAQ item naming a registered subject
    ("ask Carol Danvers about refunds") is therefore accepted with no override and no
    audit, silently becomes co-owned by Carol, and Carol's erasure deletes it: a
    person's erasure touches a shared namespace (README: "no person's erasure touches
    them"), and personal data entered shared knowledge without the audited override.
    Cause: ``KeyshredStore._refuse_personal`` (store.py ~624) uses ``detect`` only,
    not the registered identifiers (``ks.subjects``/``MentionFinder.find``)."""
    ks.subjects.register_identifiers("carol-7", names=["Carol Danvers"])
    store.put(("memories", "carol-7"), "diet", {"text": "vegetarian"})
    with pytest.raises(InvalidInput):
        store.put(("faq",), "refunds", {"text": "ask Carol Danvers about refunds"})


def test_numeric_phone_in_shared_value_is_refused(ks: Keyshred, store: KeyshredStore) -> None:
    """DEFECT (medium). A phone number stored as a JSON number passes the shared
    check (``_strings`` yields strings only), although the same digits as a string
    are refused. The mention finder ignores numbers too, so a registered subject's
    phone kept as ``{"phone": 13812345678}`` in a shared namespace is accepted without
    override and still readable after that subject's erasure.
    Cause: store.py ``_strings`` / ``_refuse_personal`` skip int/float values."""
    ks.subjects.register_identifiers("dan", phones=["13812345678"])
    with pytest.raises(InvalidInput):
        store.put(("faq",), "s", {"n": "13812345678"})  # control: refused as text
    try:
        store.put(("faq",), "hotline", {"phone": 13812345678})
    except InvalidInput:
        return  # the correct behaviour
    ks.erase("dan", requested_by="dpo", reason="art17")
    left = [i.value for i in store.search(("faq",))]
    assert left == [], f"the erased subject's phone is still in shared knowledge: {left}"


@pytest.mark.parametrize("shape", ["deep", "cyclic"])
def test_deep_or_cyclic_value_in_shared_namespace_raises_keyshred_error(
    store: KeyshredStore, shape: str
) -> None:
    """DEFECT (low). Only ``KeyshredError`` may come out for bad input. A value nested
    deeper than ``storage.max_value_depth`` (or referring to itself) raises
    ``ValueTooLarge``/``InvalidInput`` under a personal namespace, but
    ``RecursionError`` under a shared one: ``_refuse_personal`` walks the value with
    the recursive ``_strings`` (store.py ~742) before the store's own checks run."""
    value: dict[str, Any] = {}
    if shape == "deep":
        cur = value
        for _ in range(3000):
            cur["a"] = {}
            cur = cur["a"]
    else:
        value["a"] = [value]
    with pytest.raises(InvalidInput):  # control: a personal namespace
        store.put(("memories", "u1"), "k", value)
    with pytest.raises(KeyshredError):
        store.put(("faq",), "k", value)


def test_concurrent_plain_put_during_put_shared_is_still_refused(ks: Keyshred) -> None:
    """DEFECT (medium). ``put_shared`` records its override as ``(namespace, key)`` in
    the store instance's ``self._allowed`` set for the whole duration of its put
    (store.py ~661). Any other thread's plain ``put`` to that key meanwhile skips the
    detector: here a value with a phone number is stored in shared knowledge with no
    override of its own, and the only audit event is the admin's, about another
    value. One store instance serves all of a LangGraph server's concurrent runs."""
    main_done = threading.Event()
    result: dict[str, str] = {}
    holder: dict[str, Any] = {}

    def intruder() -> None:
        try:
            holder["store"].put(("faq",), "contact", {"t": "mallory on 13812345670"})
            result["intruder"] = "stored"
        except InvalidInput:
            result["intruder"] = "refused"

    def embed(texts: list[str]) -> list[list[float]]:
        if threading.current_thread() is threading.main_thread():
            if "thread" not in holder:
                holder["thread"] = threading.Thread(target=intruder)
                holder["thread"].start()
                holder["thread"].join(1.0)  # it passes its check while we embed
        else:
            main_done.wait(10)  # the intruder's write lands after put_shared returned
        return [[1.0, 0.0] for _ in texts]

    store = KeyshredStore(
        ks, subject_from=1, shared=[("faq",)], index={"dims": 2, "embed": embed, "fields": ["t"]}
    )
    holder["store"] = store
    store.put_shared(
        ("faq",), "contact", {"t": "support: help@example.com"}, allowed_by="ops", reason="r"
    )
    main_done.set()
    holder["thread"].join(10)
    assert result == {"intruder": "refused"}, (result, store.get(("faq",), "contact"))


def test_put_shared_that_stores_nothing_audits_no_allowance(
    ks: Keyshred, store: KeyshredStore
) -> None:
    """DEFECT (low). ``put_shared`` writes the ``store.shared_personal_allowed`` audit
    event before its put (store.py ~657): a put that is then refused (here a NaN value)
    leaves an audit trail saying personal data was allowed into shared knowledge when
    nothing was stored. (The event also names no item, so an auditor cannot tell which
    shared item the allowance was for.)"""
    with pytest.raises(InvalidInput):
        store.put_shared(
            ("faq",), "bad", {"t": float("nan")}, allowed_by="ops", reason="nothing stored"
        )
    allowed = [e.data for e in ks.audit.events() if e.event == "store.shared_personal_allowed"]
    assert allowed == []


# -- shared namespaces: who owns them ------------------------------------------------


def test_a_user_whose_id_is_the_shared_subject_cannot_erase_shared_knowledge(
    ks: Keyshred, store: KeyshredStore
) -> None:
    """DEFECT (high). Shared namespaces are filed under the ordinary subject id
    ``"keyshred.shared-knowledge"`` (store.py:60, ``SHARED_SUBJECT``). The comment says
    no label can produce it (LangGraph forbids '.'), but subject ids come from many
    other places: a saver thread's ``user_id``/``subject_id`` (ids like "jo.smith" are
    common), ``ks.erase``, the HTTP API. A user who signs up as
    "keyshred.shared-knowledge" has their threads stored under the FAQ's subject, an
    export of "them" contains all shared knowledge, and their erasure request wipes
    every shared item and leaves the shared namespaces ``erased`` for good (every FAQ
    read and write then raises ``SubjectSuppressed``). The shared subject must not be
    reachable as a person's id (reserved/refused, or a subject_ref no id maps to)."""
    store.put(("faq",), "hours", {"t": "open 9 to 5"})
    graph = _graph(KeyshredSaver(ks), interrupt=False)
    with pytest.raises(KeyshredError):  # such a user id is refused
        graph.invoke({"notes": ["hello"]}, _config("m-1", SHARED_SUBJECT))
    with pytest.raises(KeyshredError):  # so is erasing "nobody"
        ks.erase(SHARED_SUBJECT, requested_by="mallory", reason="gdpr-art17")
    item = store.get(("faq",), "hours")
    assert item is not None and item.value == {"t": "open 9 to 5"}
    store.put(("faq",), "returns", {"t": "30 days"})


def test_shared_namespace_does_not_need_a_persons_consent(ks: Keyshred) -> None:
    """DEFECT (medium). Shared items are written in the *store's* scope, the one its
    users' items use, not a non-personal scope of their own. A store of a consent-based
    scope (here ``support/health``) cannot write shared knowledge at all: the put
    raises ``ConsentRequired`` for the pseudo-subject "nobody". The shared items also
    take that personal scope's retention and are erased by a scope erasure/consent
    withdrawal of the pseudo-subject. Cause: ``_apply_puts`` builds every ``PutItem``
    with ``scope=self._scope`` (store.py ~590), shared or not."""
    store = KeyshredStore(ks, subject_from=1, shared=[("faq",)], scope="support/health")
    store.put(("faq",), "hours", {"t": "open 9 to 5"})
    assert store.get(("faq",), "hours") is not None


def test_shared_prefix_below_the_subject_label_is_searched_and_listed(ks: Keyshred) -> None:
    """DEFECT (low). With ``subject_from=1`` and a shared prefix
    ``("memories", "team", "faq")``, a search or listing of ``("memories", "team")``
    is taken as the person "team"'s and misses the shared items under it, where
    ``InMemoryStore`` (which the README says it answers as) returns both. Cause:
    ``_refs``/``_across`` (store.py ~179-198) only ask whether the prefix names a
    subject, not whether a shared prefix extends it."""
    shared = KeyshredStore(ks, subject_from=1, shared=[("memories", "team", "faq")])
    ref = InMemoryStore()
    answers = []
    for s in (shared, ref):
        s.put(("memories", "team", "faq"), "hours", {"t": "9-5"})
        s.put(("memories", "team"), "own", {"t": "x"})
        answers.append(
            (
                sorted((tuple(i.namespace), i.key) for i in s.search(("memories", "team"))),
                s.list_namespaces(prefix=("memories", "team")),
            )
        )
    assert answers[0] == answers[1]


# -- the subject rule ----------------------------------------------------------------


@pytest.mark.parametrize("rule", ["user", None, 1.0])
def test_invalid_subject_from_raises_keyshred_error(ks: Keyshred, rule: Any) -> None:
    """DEFECT (low). ``subject_from`` is not checked by the constructor; a string,
    None or float raises ``TypeError`` at the first put (store.py ``subject_of`` ~164:
    ``len(namespace) <= self._subject_from``). Only ``KeyshredError`` may come out."""
    with pytest.raises(KeyshredError):
        KeyshredStore(ks, subject_from=rule).put(("memories", "u1"), "k", {"a": 1})


def test_negative_subject_from_is_refused_or_correct(ks: Keyshred) -> None:
    """DEFECT (low). ``subject_from=-1`` ("the last label is the user") is accepted,
    but it is applied to search *prefixes* too: ``search(("memories",))`` takes
    "memories" for the subject and returns nothing although ("memories", "u9") holds
    an item (``list_namespaces`` too). Either refuse negative positions
    (``InvalidInput``) or answer correctly."""
    try:
        store = KeyshredStore(ks, subject_from=-1)
    except InvalidInput:
        return
    store.put(("memories", "u9"), "k", {"t": 1})
    assert [i.key for i in store.search(("memories",))] == ["k"]


def test_callable_subject_rule_on_a_short_prefix(ks: Keyshred) -> None:
    """DEFECT (low). A callable ``subject_from`` is documented as a namespace's rule,
    but the store also calls it on search/list prefixes. A natural rule
    (``lambda ns: ns[1]``) raises ``IndexError`` out of ``search(("memories",))``, a
    valid cross-subject search; ``_subject_or_none`` (store.py ~173) catches only
    ``InvalidInput``."""
    store = KeyshredStore(ks, subject_from=lambda ns: ns[1])
    store.put(("memories", "u1"), "k", {"t": 1})
    assert [i.key for i in store.search(("memories",))] == ["k"]


# -- other public entry points: typed errors only, no label in the chain --------------


def test_delete_prefix_of_wrong_type_raises_keyshred_error(store: KeyshredStore) -> None:
    """DEFECT (low). ``delete_prefix(5)`` raises ``TypeError`` (``tuple(5)``,
    store.py ~672); a string is silently split into one-letter labels
    (``delete_prefix("faq")`` deletes ``("f", "a", "q")``)."""
    with pytest.raises(KeyshredError):
        store.delete_prefix(5)  # type: ignore[arg-type]
    with pytest.raises(KeyshredError):
        store.delete_prefix("faq")  # type: ignore[arg-type]


def test_list_namespaces_op_with_malformed_conditions_raises_keyshred_error(
    store: KeyshredStore,
) -> None:
    """DEFECT (low). ``batch([ListNamespacesOp(match_conditions="x")])`` raises
    ``AttributeError`` ('str' object has no attribute 'path'): ``_checked_op``
    (store.py ~805) iterates the conditions without checking they are
    ``MatchCondition``s."""
    with pytest.raises(KeyshredError):
        store.batch([ListNamespacesOp(match_conditions="x")])  # type: ignore[arg-type]


def test_abatch_of_none_raises_keyshred_error(store: KeyshredStore) -> None:
    """DEFECT (low). ``batch(None)`` raises ``InvalidInput`` but ``abatch(None)`` raises
    ``TypeError``: ``abatch`` calls ``list(ops)`` (store.py ~347) before ``batch``'s
    check."""
    with pytest.raises(KeyshredError):
        asyncio.run(store.abatch(None))  # type: ignore[arg-type]


def test_invalid_label_error_does_not_carry_the_label(store: KeyshredStore) -> None:
    """DEFECT (low). A label LangGraph refuses (here a user id with a dot, which the
    README itself says people will try) raises ``InvalidInput`` ``from None``, but
    inside the ``except`` block of ``_langgraph_rules`` (store.py ~779): its
    ``__context__`` keeps LangGraph's ``InvalidNamespaceError``, whose message quotes
    the label and the whole namespace (a subject id). Error reporters that walk
    ``__context__`` (and ``keyshred._handle``'s own chain walk) see it; the project's
    rule (erasure/derived.py ``_run``) is to raise outside the ``except`` block."""
    with pytest.raises(InvalidInput) as info:
        store.put(("memories", f"jo.{PROBE}"), "k", {"a": 1})
    chain: list[BaseException] = []
    exc: BaseException | None = info.value
    while exc is not None and len(chain) < 10:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    assert not any(PROBE in str(e) or PROBE in repr(e) for e in chain), chain


# -- erasure numbers (item 4) ----------------------------------------------------------


def test_a_later_erasure_does_not_unblock_a_blocked_id(ks: Keyshred, store: KeyshredStore) -> None:
    """DEFECT (medium). ``ks.erase(id, block=True)`` on an id that holds nothing keeps
    it ``erased``; a second erasure request of the same id without ``block`` (a
    duplicate request, a retry through another channel) finds nothing and sets the
    guard back to ``active``: the block is silently lifted and new data is accepted
    under an id the controller chose to block. An erasure must never re-admit an id.
    Cause: ``Extent.finish`` (erasure/extent.py ~274) sets ``ACTIVE`` whenever
    ``found`` is False, whatever the guard was before the request."""
    req = ks.erase("blocked-u", requested_by="dpo", reason="art17", block=True)
    assert req.state == "completed" and req.found_data is False
    with pytest.raises(SubjectSuppressed):
        store.put(("memories", "blocked-u"), "k", {"t": 1})
    again = ks.erase("blocked-u", requested_by="dpo", reason="duplicate request")
    assert again.state == "completed"
    with pytest.raises(SubjectSuppressed):
        store.put(("memories", "blocked-u"), "k", {"t": 1})


def test_store_erase_subject_takes_block(ks: Keyshred, store: KeyshredStore) -> None:
    """DEFECT (low). ``KeyshredStore.erase_subject`` is the store's erasure entry point
    but has no ``block`` option (store.py ~686), so a LangGraph app cannot block an id
    that holds nothing through it (``TypeError`` for ``block=True``)."""
    req = store.erase_subject("nobody-yet", requested_by="dpo", reason="art17", block=True)  # type: ignore[call-arg]
    assert req.found_data is False
    with pytest.raises(SubjectSuppressed):
        store.put(("memories", "nobody-yet"), "k", {"t": 1})


# -- sanity checks (these pass) ---------------------------------------------------------


def test_sanity_shared_items_survive_an_erasure_and_searches_show_nothing_of_it(
    ks: Keyshred, store: KeyshredStore
) -> None:
    """SANITY (passes): clean shared items survive a person's erasure; refused shared
    puts (e-mail in value, key, nested, dict key, phone label, batch) write nothing;
    an override mentioning a registered subject is audited without the value and goes
    with that subject (co-owned); searches and listings after the erasure show
    nothing of the subject; receipt/audit carry no probe."""
    from langgraph.store.base import PutOp

    ks.subjects.register_identifiers(f"{PROBE}-u", emails=[f"{PROBE}@example.com"])
    store.put(("memories", f"{PROBE}-u"), "k", {"t": f"{PROBE} value"})
    store.put(("faq",), "hours", {"t": "9 to 5"})
    for ns, key, value in [
        (("faq",), "a", {"t": f"mail {PROBE}@example.com"}),
        (("faq",), f"{PROBE}@example.com", {"t": "x"}),
        (("faq",), "b", {"x": [{"y": {"z": f"{PROBE}@example.com"}}]}),
        (("faq",), "c", {f"{PROBE}@example.com": 1}),
        (("faq", "13812345678"), "d", {"t": "x"}),
    ]:
        with pytest.raises(InvalidInput) as info:
            store.put(ns, key, value)
        assert PROBE not in str(info.value)
    with pytest.raises(InvalidInput):
        store.batch(
            [
                PutOp(("memories", "eve"), "k", {"t": "ok"}),
                PutOp(("faq",), "e", {"t": "mail eve@example.com"}),
            ]
        )
    assert store.get(("memories", "eve"), "k") is None
    store.put_shared(
        ("faq",), "contact", {"t": f"write to {PROBE}@example.com"}, allowed_by="ops", reason="r"
    )
    req = store.erase_subject(f"{PROBE}-u", requested_by="dpo", reason="art17")
    assert req.state == "completed" and req.found_data is True
    assert _keys(store, ("faq",)) == {"hours"}
    assert _keys(store, ()) == {"hours"}
    assert store.list_namespaces() == [("faq",)]
    receipt = ks.erasure.receipt(req.request_id)
    assert receipt is not None and PROBE not in receipt.model_dump_json()
    events = [(e.event, e.data) for e in ks.audit.events()]
    assert PROBE not in repr(events)
    allowed = [d for e, d in events if e == "store.shared_personal_allowed"]
    assert len(allowed) == 1 and allowed[0]["allowed_by"] == "ops" and allowed[0]["reason"] == "r"
    assert allowed[0]["namespace"] == ks.memories.namespace_hash(("faq",))


def test_sanity_erasure_numbers(ks: Keyshred, store: KeyshredStore) -> None:
    """SANITY (passes): threads counted as threads; an id never stored completes with
    found_data False and stays free; an id with only threads is found; erasing twice
    keeps the id erased."""
    graph = _graph(KeyshredSaver(ks), interrupt=False)
    for t in ("t1", "t2", "t3"):
        graph.invoke({"notes": ["hi"]}, _config(t, "tom"))
    req = ks.erase("tom", requested_by="dpo", reason="art17")
    assert req.found_data is True
    receipt = ks.erasure.receipt(req.request_id)
    assert receipt is not None
    counts = {(s.store, s.action): s.count for s in receipt.stores}
    assert counts[("checkpoints", "threads-deleted")] == 3
    nobody = ks.erase("never-stored", requested_by="dpo", reason="art17")
    assert nobody.found_data is False
    assert ks.erasure.receipt(nobody.request_id).found_data is False  # type: ignore[union-attr]
    store.put(("memories", "never-stored"), "k", {"t": 1})
    assert store.get(("memories", "never-stored"), "k") is not None
    store.put(("memories", "twice"), "k", {"t": 1})
    ks.erase("twice", requested_by="dpo", reason="art17")
    ks.erase("twice", requested_by="dpo", reason="again")
    with pytest.raises(SubjectSuppressed):
        store.put(("memories", "twice"), "k", {"t": 1})
