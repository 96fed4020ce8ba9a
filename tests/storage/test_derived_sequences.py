"""A stateful model test of derived memories and detected mentions under erasures
(Hypothesis ``RuleBasedStateMachine``), on the embedded store (SQLite catalog,
folder segments, ``flush_records`` 2 or 3: partitions compact all the time).

Random sequences of plain puts (some declaring mentions, some holding another
subject's registered e-mail), derived memories registered from 1-3 live source
memories of any subjects (derived ones too) with a producer, identifier
registrations and forgets, updates, corrections and deletes of any memory, flushes,
reopened stores, subject and scope erasures run against a plain model; after every
step each subject's memories read back as the model says.

What the store promises, as the model encodes it:

- a derived asset is sealed under a key owned by its holder and by every owner of
  its sources, transitively; a mention (declared, or found by a registered
  identifier) is owned by the person (README.md "Keys and their owners", capability
  rows "keys owned by every subject the data is about", "mentions found");
- the erasure of S (or of S's scope) "rebuilds every derived asset whose provenance or
  mentions include the subject with its producer's function from the remaining
  sources" (README.md "Erasure"), dropped when the function returns ``None`` or no
  source remains (``keyshred/erasure/derived.py``).
  A memory about S with no producer (a mention, a corrected version) is dropped; a
  scope erasure reaches what was derived from that scope, not mentions. "About S" is
  what its key says (owners at the time of writing, even of a source deleted since),
  or built from an asset the erasure removes (a memory moved into the erased scope),
  or from one the erasure rebuilds ("derived from derived", by the provenance edges
  as they are now); an asset is rebuilt after the sources it is built from;
- "update and correct keep mentions and sources" (README.md), and "provenance"
  (``MemoryStore.update``): the producer too; and, while one of its sources is
  deleted, a derived memory's owners (those of the key its old value was under);
- a value written under another subject that holds a registered identifier of S
  mentions S; not retroactive; ``forget_identifiers``: later writes no longer find it,
  mentions found before stay; an erasure deletes the identifiers;
- a producer nobody registered (here: one registered only on the handle that made the
  asset, then the store reopened) stops the erasure in ``manual_review`` with
  ``ProducerUnknown``; ``resume`` completes it once registered (README.md ``ks.derived``);
- no readable value ever holds a value an erased subject (scope) wrote.

Not modelled: vectors and semantic search, retention, PostgreSQL, vault tokens,
LangGraph checkpoints, names and phones as identifiers (e-mails only), producer
versions, process-wide and entry-point rebuilders. The machine found the bugs whose
reproductions close this file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from keyshred import Keyshred
from keyshred.errors import NotFound, SubjectSuppressed
from keyshred.storage.memories import Memory
from tests.model_machine import MODEL_TIMEOUT, StoreMachine, model_settings
from tests.storage.conftest import make_config

pytestmark = pytest.mark.timeout(MODEL_TIMEOUT)

SUBJECTS = ("A", "B", "C", "D")
KEYS = ("k0", "k1", "k2")  # plain memories
DKEYS = ("d0", "d1")  # derived memories
NS = ("n",)
SCOPES = ("default", "marketing")  # make_config's "marketing": no consent needed
REQUESTED_BY, REASON = "dpo", "art17"


def email(subject: str) -> str:
    return f"{subject.lower()}.mail@example.org"


def _scope_args(scope: str) -> dict[str, Any]:
    return {"scope": scope, "category": "preference"} if scope == "marketing" else {}


# -- producers: deterministic, order-free (the store passes sources in any order) ----


def join(values: list[str]) -> str | None:
    """A value even of no source: the store must not ask it then (nothing remains)."""
    return " + ".join(sorted(values))


def keep2(values: list[str]) -> str | None:
    """Drops its asset once fewer than two sources are left."""
    return " + ".join(sorted(values)) if len(values) >= 2 else None


PRODUCERS: dict[str, Callable[[list[str]], str | None]] = {
    "join": join,
    "keep2": keep2,
    "ephemeral": join,  # registered only on the handle that made the asset
}
STARTUP = ("join", "keep2")  # registered on every handle the test opens


def rebuilder(name: str) -> Callable[[list[Memory]], Any]:
    return lambda sources: PRODUCERS[name]([m.value for m in sources])


@dataclass(frozen=True)
class Mem:
    mid: str
    value: str
    scope: str
    mentions: frozenset[str]  # subjects
    sources: tuple[str, ...]  # memory ids
    producer: str | None
    owners: frozenset[str]  # "S" (a person mentioned) or "S@scope" (data of S's scope)


@dataclass
class Model:
    mems: dict[tuple[str, str], Mem] = field(default_factory=dict)
    history: dict[tuple[str, str], list[Mem]] = field(default_factory=dict)
    erased: set[str] = field(default_factory=set)
    registered: set[str] = field(default_factory=set)  # subjects with their e-mail
    known: set[str] = field(default_factory=lambda: set(STARTUP))  # producers
    # values written by a subject in a scope: dead once it (or the scope) is erased
    written: dict[str, tuple[str, str]] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)

    def live(self) -> list[str]:
        return [s for s in SUBJECTS if s not in self.erased]

    def by_id(self, mid: str) -> tuple[str, str] | None:
        return next((sk for sk, m in self.mems.items() if m.mid == mid), None)

    def detect(self, holder: str, value: str) -> frozenset[str]:
        return frozenset(s for s in self.registered if s != holder and email(s) in value)

    def owners(
        self, holder: str, scope: str, mentions: Iterable[str], sources: Iterable[str]
    ) -> frozenset[str]:
        out = {f"{holder}@{scope}", *mentions}
        for sid in sources:
            at = self.by_id(sid)
            if at is not None:
                out |= self.mems[at].owners
        return frozenset(out)

    def gone_source(self, mem: Mem) -> bool:
        """Whether a source of ``mem`` was deleted (its owners are then only known
        from the key ``mem`` was sealed under)."""
        return any(self.by_id(sid) is None for sid in mem.sources)

    def depends_on(self, mem: Mem, mid: str) -> bool:
        """Whether ``mem`` is ``mid`` or built from it, transitively."""
        if mem.mid == mid:
            return True
        for sid in mem.sources:
            at = self.by_id(sid)
            if at is not None and self.depends_on(self.mems[at], mid):
                return True
        return False

    def count(self, subject: str) -> int:
        live = sum(1 for s, _ in self.mems if s == subject)
        return live + sum(len(v) for (s, _), v in self.history.items() if s == subject)

    def erase(self, subject: str, scope: str | None) -> set[str]:
        """Apply an erasure; returns the producers an asset waited for (those no
        handle knows, of an asset with a source left)."""

        def own(s: str, m: Mem) -> bool:
            return s == subject and (scope is None or m.scope == scope)

        def about(m: Mem) -> bool:
            if scope is not None:
                return f"{subject}@{scope}" in m.owners
            return any(o == subject or o.startswith(f"{subject}@") for o in m.owners)

        self.dead |= {
            v for v, (s, sc) in self.written.items() if s == subject and scope in (None, sc)
        }
        gone = set()
        for (s, k), m in list(self.mems.items()):
            if own(s, m):
                gone.add(m.mid)
                del self.mems[(s, k)]
        for (s, k), versions in list(self.history.items()):
            left = [v for v in versions if not own(s, v) and not about(v)]
            if left:
                self.history[(s, k)] = left
            else:
                del self.history[(s, k)]
        if scope is None:
            self.registered.discard(subject)
        # About the subject (its scope), or built from an asset erased here (a memory
        # that moved into the erased scope after the summary was made of it).
        pending = {sk for sk, m in self.mems.items() if about(m) or gone & set(m.sources)}
        # and whatever names one of those as a source now ("derived from derived"),
        # even if it was made from that source's earlier value (an id keeps its
        # provenance edges across an overwrite).
        grew = True
        while grew:
            more = {
                sk
                for sk, m in self.mems.items()
                if sk not in pending and any(self.by_id(sid) in pending for sid in m.sources)
            }
            pending |= more
            grew = bool(more)
        # A kept version keeps its provenance edges: one built from an asset this
        # erasure removes or rebuilds goes with it (no producer rebuilds a version).
        touched = gone | {self.mems[sk].mid for sk in pending}
        for sk, versions in list(self.history.items()):
            kept = [v for v in versions if not touched & set(v.sources)]
            if kept:
                self.history[sk] = kept
            else:
                del self.history[sk]
        waited: set[str] = set()
        while pending:
            # Sources first: an asset is rebuilt from its sources' rebuilt values.
            ready = sorted(
                sk
                for sk in pending
                if not any(self.by_id(sid) in pending for sid in self.mems[sk].sources)
            )
            assert ready, "a provenance cycle"  # the rules make none
            for sk in ready:
                pending.discard(sk)
                m = self.mems[sk]
                left = [sid for sid in m.sources if self.by_id(sid) not in (None, *pending)]
                # a source being rebuilt is not in pending any more (sources first)
                values = [self.mems[at].value for sid in left if (at := self.by_id(sid))]
                value = None
                if m.producer is not None and left:
                    if m.producer not in self.known:
                        waited.add(m.producer)
                    value = PRODUCERS[m.producer](values)
                if value is None:
                    del self.mems[sk]
                    continue
                mentions = (m.mentions - {subject} if scope is None else m.mentions) | (
                    self.detect(sk[0], value)
                )
                self.mems[sk] = replace(
                    m,
                    value=value,
                    mentions=mentions,
                    sources=tuple(left),
                    owners=self.owners(sk[0], m.scope, mentions, left),
                )
        return waited


class DerivedSequences(StoreMachine):
    TOKEN = "[{}]"

    def __init__(self) -> None:
        super().__init__()
        self.model = Model()

    # -- setup ----------------------------------------------------------------------

    def opened(self) -> None:
        self._startup()
        for subject in SUBJECTS:  # something to derive from at the first step
            self._put(subject, KEYS[0], SCOPES[0], frozenset(), None)

    def _startup(self) -> None:
        for name in STARTUP:
            self.store.derived.register_producer(name, "1", rebuilder(name))
        self.model.known = set(STARTUP)

    # -- plain writes ---------------------------------------------------------------

    @rule(
        data=st.data(),
        key=st.sampled_from(KEYS),
        scope=st.sampled_from(SCOPES),
        cite=st.sampled_from((None, *SUBJECTS)),
    )
    def put(self, data: st.DataObject, key: str, scope: str, cite: str | None) -> None:
        """A memory of ``subject``, declaring mentions or holding ``cite``'s e-mail."""
        subject = data.draw(st.sampled_from(SUBJECTS), label="subject")
        declared = frozenset(
            data.draw(st.lists(st.sampled_from([s for s in SUBJECTS if s != subject]), max_size=1))
        )
        self._put(subject, key, scope, declared, cite)

    def _put(
        self, subject: str, key: str, scope: str, declared: frozenset[str], cite: str | None
    ) -> None:
        m = self.model
        token = self.token()
        value = token if cite is None else f"{token} mail {email(cite)}"
        put = self.store.memories.put
        if subject in m.erased or declared & m.erased:
            with pytest.raises(SubjectSuppressed):
                put(subject, NS, key, value, mentions=sorted(declared), **_scope_args(scope))
            return
        got = put(subject, NS, key, value, mentions=sorted(declared), **_scope_args(scope))
        mentions = declared | m.detect(subject, value)
        m.written[token] = (subject, scope)
        m.mems[(subject, key)] = Mem(
            got.memory_id, value, scope, mentions, (), None, m.owners(subject, scope, mentions, ())
        )

    @rule(data=st.data(), key=st.sampled_from(DKEYS), producer=st.sampled_from(sorted(PRODUCERS)))
    def derive(self, data: st.DataObject, key: str, producer: str) -> None:
        """A derived memory of ``owner`` from 1-3 live memories of any subjects."""
        m = self.model
        owner = data.draw(st.sampled_from(SUBJECTS), label="owner")
        old = m.mems.get((owner, key))
        candidates = sorted(
            sk for sk, mem in m.mems.items() if old is None or not m.depends_on(mem, old.mid)
        )
        if not candidates:
            return
        picked = data.draw(
            st.lists(st.sampled_from(candidates), min_size=1, max_size=3, unique=True),
            label="sources",
        )
        sources = [m.mems[sk].mid for sk in picked]
        value = PRODUCERS[producer]([m.mems[sk].value for sk in picked]) or "nothing"
        register = self.store.derived.register
        args: dict[str, Any] = {
            "subject": owner,
            "namespace": NS,
            "key": key,
            "value": value,
            "produced_from": sources,
            "producer": producer,
            "producer_version": "1",
        }
        if producer == "ephemeral":
            args["rebuild"] = rebuilder(producer)
        if owner in m.erased:
            with pytest.raises(SubjectSuppressed):
                register("summary", **args)
            return
        got = register("summary", **args)
        if producer == "ephemeral":
            m.known.add(producer)
        mentions = m.detect(owner, value)
        m.mems[(owner, key)] = Mem(
            got.memory_id,
            value,
            "default",
            mentions,
            tuple(sources),
            producer,
            m.owners(owner, "default", mentions, sources),
        )

    @rule(data=st.data(), key=st.sampled_from(KEYS + DKEYS), cite=st.sampled_from((None, "A")))
    def update(self, data: st.DataObject, key: str, cite: str | None) -> None:
        self._update(data.draw(st.sampled_from(SUBJECTS), label="subject"), key, cite)

    def _update(self, subject: str, key: str, cite: str | None) -> None:
        m = self.model
        token = self.token()
        value = token if cite is None else f"{token} mail {email(cite)}"
        old = m.mems.get((subject, key))
        if subject in m.erased:
            with pytest.raises(SubjectSuppressed):
                self.store.memories.update(subject, NS, key, value)
            return
        if old is None:
            with pytest.raises(NotFound):
                self.store.memories.update(subject, NS, key, value)
            return
        self.store.memories.update(subject, NS, key, value)
        m.written[token] = (subject, old.scope)
        mentions = old.mentions | m.detect(subject, value)
        # Derived from a source deleted since: owned by whom the old value was.
        kept = old.owners if m.gone_source(old) else frozenset()
        m.mems[(subject, key)] = replace(
            old,
            value=value,
            mentions=mentions,
            owners=m.owners(subject, old.scope, mentions, old.sources) | kept,
        )

    @rule(data=st.data(), key=st.sampled_from(KEYS + DKEYS))
    def correct(self, data: st.DataObject, key: str) -> None:
        self._correct(data.draw(st.sampled_from(SUBJECTS), label="subject"), key)

    def _correct(self, subject: str, key: str) -> None:
        m = self.model
        token = self.token()
        old = m.mems.get((subject, key))
        if subject in m.erased:
            with pytest.raises(SubjectSuppressed):
                self.store.memories.correct(subject, NS, key, token, reason="fix")
            return
        if old is None:
            with pytest.raises(NotFound):
                self.store.memories.correct(subject, NS, key, token, reason="fix")
            return
        self.store.memories.correct(subject, NS, key, token, reason="fix")
        m.written[token] = (subject, old.scope)
        # The old value stays as a version about the same subjects (same owners).
        seen = old.mentions | m.detect(subject, old.value)
        version = replace(
            old,
            producer=None,
            mentions=seen,
            owners=m.owners(subject, old.scope, seen, old.sources) | old.owners,
        )
        m.history.setdefault((subject, key), []).append(version)
        m.mems[(subject, key)] = replace(
            old,
            value=token,
            owners=m.owners(subject, old.scope, old.mentions, old.sources)
            | (old.owners if m.gone_source(old) else frozenset()),
        )

    @rule(data=st.data(), key=st.sampled_from(KEYS + DKEYS))
    def delete(self, data: st.DataObject, key: str) -> None:
        m = self.model
        subject = data.draw(st.sampled_from(SUBJECTS), label="subject")
        if subject in m.erased:
            with pytest.raises(SubjectSuppressed):
                self.store.memories.delete(subject, NS, key)
            return
        there = (subject, key) in m.mems
        assert self.store.memories.delete(subject, NS, key) is there
        if there:
            del m.mems[(subject, key)]
            m.history.pop((subject, key), None)

    # Sequences that matter most made likelier: a source deleted while derived
    # memories still name it, a derived memory rewritten by its holder.

    def _sources_in_use(self) -> list[tuple[str, str]]:
        m = self.model
        used = {sid for mem in m.mems.values() for sid in mem.sources}
        return sorted(sk for sk, mem in m.mems.items() if mem.mid in used)

    @precondition(lambda self: bool(self._sources_in_use()))
    @rule(data=st.data())
    def delete_a_source(self, data: st.DataObject) -> None:
        subject, key = data.draw(st.sampled_from(self._sources_in_use()), label="source")
        assert self.store.memories.delete(subject, NS, key)
        del self.model.mems[(subject, key)]
        self.model.history.pop((subject, key), None)

    @precondition(lambda self: any(k in DKEYS for _, k in self.model.mems))
    @rule(data=st.data(), how=st.sampled_from(["update", "correct"]))
    def rewrite_derived(self, data: st.DataObject, how: str) -> None:
        subject, key = data.draw(
            st.sampled_from(sorted(sk for sk in self.model.mems if sk[1] in DKEYS)),
            label="derived",
        )
        if how == "update":
            self._update(subject, key, None)
        else:
            self._correct(subject, key)

    # -- identifiers ----------------------------------------------------------------

    @rule(subject=st.sampled_from(SUBJECTS))
    def register_identifier(self, subject: str) -> None:
        m = self.model
        register = self.store.subjects.register_identifiers
        if subject in m.erased:
            with pytest.raises(SubjectSuppressed):
                register(subject, emails=[email(subject)])
            return
        assert register(subject, emails=[email(subject).upper()]) == int(
            subject not in m.registered
        )
        m.registered.add(subject)

    @rule(subject=st.sampled_from(SUBJECTS))
    def forget_identifier(self, subject: str) -> None:
        m = self.model
        if subject in m.erased:
            return
        assert self.store.subjects.forget_identifiers(subject) == int(subject in m.registered)
        m.registered.discard(subject)

    # -- compactions, reloads -------------------------------------------------------

    @rule(data=st.data())
    def flush(self, data: st.DataObject) -> None:
        subject = data.draw(st.sampled_from(self.model.live()), label="subject")
        self.store.memories.flush(subject)

    @rule(flush=st.booleans())
    def reopen(self, flush: bool) -> None:
        """A restarted process: the start-up producers only."""
        self.store.close(flush=flush)
        self.ks = None
        self.ks = Keyshred.open(self.path, self.cfg)
        self._startup()

    # -- erasures -------------------------------------------------------------------

    @precondition(lambda self: len(self.model.live()) > 1)
    @rule(data=st.data(), scope=st.sampled_from((None, *SCOPES)))
    def erase(self, data: st.DataObject, scope: str | None) -> None:
        self._erase(data.draw(st.sampled_from(self.model.live()), label="subject"), scope)

    def _sources_of_derived(self) -> list[tuple[str, str]]:
        """(subject, scope) of every source of a derived memory of another live
        subject, while another subject stays live."""
        m = self.model
        if len(m.live()) < 2:
            return []
        return sorted(
            {
                (at[0], m.mems[at].scope)
                for (owner, _), mem in m.mems.items()
                for sid in mem.sources
                if (at := m.by_id(sid)) is not None and at[0] != owner
            }
        )

    @precondition(lambda self: bool(self._sources_of_derived()))
    @rule(data=st.data(), whole=st.booleans())
    def erase_a_source(self, data: st.DataObject, whole: bool) -> None:
        """The erasure (of the subject, or of the scope) of a derived memory's source."""
        subject, scope = data.draw(st.sampled_from(self._sources_of_derived()), label="source")
        self._erase(subject, None if whole else scope)

    def _erase(self, subject: str, scope: str | None) -> None:
        m = self.model
        waited = m.erase(subject, scope)
        if scope is None:
            m.erased.add(subject)
        req = self.store.erase(
            subject, scope, requested_by=REQUESTED_BY, reason=REASON, block=scope is None
        )
        if waited:
            assert req.state == "manual_review", (req.state, waited)
            assert req.error is not None and "producer ephemeral version 1" in req.error
            for name in waited:
                self.store.derived.register_producer(name, "1", rebuilder(name))
                m.known.add(name)
            req = self.store.erasure.resume(req.request_id)
        assert req.state == "completed", req.error

    # -- what every step leaves -----------------------------------------------------

    @invariant()
    def reads_match_the_model(self) -> None:
        m = self.model
        self.check_reads(
            NS, SUBJECTS, KEYS + DKEYS, current=m.mems, erased=m.erased, count=m.count, dead=m.dead
        )

    @invariant()
    def history_matches_the_model(self) -> None:
        self.check_history(NS, self.model.mems, self.model.history)


DerivedSequences.TestCase.settings = model_settings(max_examples=30, stateful_step_count=40)
TestDerivedSequences = DerivedSequences.TestCase


# -- minimal reproductions of what the machine above found ------------------------------


def _c_sums_up_a_and_b(ks: Keyshred) -> tuple[Memory, Memory, Memory]:
    """A's "[1]" and B's "[2]" (both at k0), and C's summary of them at d0."""
    a = ks.memories.put("A", NS, "k0", "[1]")
    b = ks.memories.put("B", NS, "k0", "[2]")
    return a, b, _summary(ks, "C", "d0", [a, b], "[1] + [2]")


def _summary(ks: Keyshred, owner: str, key: str, sources: list[Memory], value: str) -> Memory:
    return ks.derived.register(
        "summary",
        subject=owner,
        namespace=NS,
        key=key,
        value=value,
        produced_from=[s.memory_id for s in sources],
        producer="join",
        producer_version="1",
        rebuild=rebuilder("join"),
    )


@pytest.mark.parametrize("how", ["update", "correct"])
def test_found_by_sequences_a_rewritten_derived_memory_is_still_rebuilt(
    tmp_path: Path, how: str
) -> None:
    # Found by DerivedSequences (fixed in the commit that added this test): update and
    # correct registered the new value as a plain memory, forgetting its producer, so
    # the erasure of a source's subject dropped C's summary instead of rebuilding it
    # from B's memory (or waiting in manual_review for an unknown producer).
    with Keyshred.init(tmp_path / "data", make_config(None)) as ks:
        _, _, summary = _c_sums_up_a_and_b(ks)
        if how == "update":
            ks.memories.update("C", NS, "d0", "[3]")
        else:
            ks.memories.correct("C", NS, "d0", "[3]", reason="fix")
        req = ks.erase("A", requested_by=REQUESTED_BY, reason=REASON)
        assert req.state == "completed", req.error
        receipt = ks.erasure.receipt(req.request_id)
        assert receipt is not None
        assert (summary.memory_id, "rebuilt") in {(d.asset_id, d.action) for d in receipt.derived}
        rebuilt = ks.memories.get("C", NS, "d0")
        assert rebuilt is not None and rebuilt.value == "[2]"


def test_found_by_sequences_a_summary_of_a_deleted_source_is_rebuilt_not_lost(
    tmp_path: Path,
) -> None:
    # Found by DerivedSequences (fixed in the commit that added this test): A deletes
    # the memory C's summary was built from. The summary's key is still co-owned by
    # A, but the catalog's closure joins on A's assets it still holds, so A's
    # erasure destroyed the key and never rebuilt the summary: it was left opaque,
    # gone from C's reads, instead of rebuilt from B's memory.
    with Keyshred.init(tmp_path / "data", make_config(None)) as ks:
        _c_sums_up_a_and_b(ks)
        assert ks.memories.delete("A", NS, "k0")
        req = ks.erase("A", requested_by=REQUESTED_BY, reason=REASON)
        assert req.state == "completed", req.error
        rebuilt = ks.memories.get("C", NS, "d0")
        assert rebuilt is not None and rebuilt.value == "[2]"
        assert ks.memories.count("C") == 1


def test_found_by_sequences_erased_text_in_what_was_built_from_a_deleted_sources_summary(
    tmp_path: Path,
) -> None:
    # Found by DerivedSequences (fixed in the commit that added this test): once A's
    # memory is deleted the catalog no longer knows C's summary holds A's text, so a
    # summary D built from C's summary, and the old version C's correction keeps,
    # were sealed under keys A did not own: both read "[1]" after A's erasure.
    with Keyshred.init(tmp_path / "data", make_config(None)) as ks:
        _, _, c = _c_sums_up_a_and_b(ks)
        assert ks.memories.delete("A", NS, "k0")
        _summary(ks, "D", "d0", [c], "[1] + [2]")
        ks.memories.correct("C", NS, "d0", "[3]", reason="fix")
        req = ks.erase("A", requested_by=REQUESTED_BY, reason=REASON)
        assert req.state == "completed", req.error
        values = [h["value"] for h in ks.memories.history("C", NS, "d0")]
        d = ks.memories.get("D", NS, "d0")
        values += [d.value] if d is not None else []
        # C's correction keeps its provenance (A's memory among it) and so its owners:
        # rebuilt from what remains (B's "[2]"), and D rebuilt from that.
        assert values == ["[2]", "[2]"]
        assert ks.memories.count("C") == 1


def test_found_by_sequences_a_correction_after_an_erasure_keeps_every_version(
    tmp_path: Path,
) -> None:
    # Found by DerivedSequences (fixed in the commit that added this test): C's
    # summary of A's and B's memories, both deleted since, corrected: the first
    # version holds A's text. C then writes a value of its own (an update dropping
    # the provenance) and corrects it: the second version is C's own. A's erasure
    # removes the first; the next correction numbered its version by the count of
    # those kept (2) and overwrote C's second version.
    with Keyshred.init(tmp_path / "data", make_config(None)) as ks:
        _c_sums_up_a_and_b(ks)
        assert ks.memories.delete("A", NS, "k0") and ks.memories.delete("B", NS, "k0")
        ks.memories.correct("C", NS, "d0", "[3]", reason="fix")
        ks.memories.update("C", NS, "d0", "[4]", sources=[])
        ks.memories.correct("C", NS, "d0", "[5]", reason="fix")
        req = ks.erase("A", requested_by=REQUESTED_BY, reason=REASON)
        assert req.state == "completed", req.error
        ks.memories.correct("C", NS, "d0", "[6]", reason="fix")
        history = ks.memories.history("C", NS, "d0")
        assert [(h["value"], h["version"]) for h in history] == [
            ("[4]", 2),
            ("[5]", 3),
            ("[6]", 4),
        ]
        assert ks.memories.count("C") == 3


def test_found_by_sequences_a_refused_register_registers_no_producer(tmp_path: Path) -> None:
    # Found by DerivedSequences (fixed in the commit that added this test): a
    # register refused for an erased owner had registered its rebuild function
    # first, so a later erasure rebuilt with a producer the handle should not have
    # known (it completed where it must wait in manual_review).
    data = tmp_path / "data"
    with Keyshred.init(data, make_config(None)) as ks:
        a = ks.memories.put("A", NS, "k0", "[1]")
        b = ks.memories.put("B", NS, "k0", "[2]")
        ks.memories.put("D", NS, "k0", "[3]")
        summary = ks.derived.register(
            "summary",
            subject="C",
            namespace=NS,
            key="d0",
            value="[1] + [2]",
            produced_from=[a.memory_id, b.memory_id],
            producer="join",
            producer_version="1",
        )
        assert ks.erase("D", requested_by=REQUESTED_BY, reason=REASON).state == "completed"
        with pytest.raises(SubjectSuppressed):
            ks.derived.register(
                "summary",
                subject="D",
                namespace=NS,
                key="d0",
                value="[2]",
                produced_from=[b.memory_id],
                producer="join",
                producer_version="1",
                rebuild=rebuilder("join"),
            )
        assert ks.derived.rebuilder("join", "1") is None
        req = ks.erase("A", requested_by=REQUESTED_BY, reason=REASON)
        assert req.state == "manual_review", req.error
        assert ks.catalog.asset(summary.memory_id) is not None


def test_found_by_sequences_a_version_built_from_a_source_now_about_the_subject_goes(
    tmp_path: Path,
) -> None:
    # Found by DerivedSequences, the store right and the model wrong: a kept version
    # of A's summary names A's memory as its source; A rewrote that memory since to
    # mention C. C's erasure drops the memory (about C), the summary (no source
    # left) and the version too: provenance is taken as it is now, and no producer
    # rebuilds a version.
    with Keyshred.init(tmp_path / "data", make_config(None)) as ks:
        a = ks.memories.put("A", NS, "k0", "[1]")
        ks.memories.put("C", NS, "k0", "[2]")
        _summary(ks, "A", "d0", [a], "[1]")
        ks.memories.correct("A", NS, "d0", "[3]", reason="fix")
        ks.memories.put("A", NS, "k0", "[4]", mentions=["C"])
        req = ks.erase("C", requested_by=REQUESTED_BY, reason=REASON)
        assert req.state == "completed", req.error
        assert ks.memories.history("A", NS, "d0") == []
        assert ks.memories.count("A") == 0


def test_an_unknown_producer_waits_in_manual_review_then_resume_rebuilds(tmp_path: Path) -> None:
    """The machine's rule, once deterministically: a producer registered only on the
    handle that made the asset is unknown after a restart; the erasure of a source
    (here found by a registered e-mail, not declared) waits, never drops it."""
    data = tmp_path / "data"
    with Keyshred.init(data, make_config(None)) as ks:
        ks.subjects.register_identifiers("A", emails=[email("A")])
        a = ks.memories.put("B", NS, "k0", f"[1] mail {email('A')}")  # mentions A
        b = ks.memories.put("B", NS, "k1", "[2]")
        assert a.mentions == (ks.subject_ref("A"),)
        summary = _summary(ks, "C", "d0", [a, b], join([a.value, b.value]) or "")
        assert set(summary.mentions) == {ks.subject_ref("A")}  # found in its value
    with Keyshred.open(data, make_config(None)) as ks:
        req = ks.erase("A", requested_by=REQUESTED_BY, reason=REASON)
        assert req.state == "manual_review"
        assert req.error is not None and "producer join version 1" in req.error
        assert ks.catalog.asset(summary.memory_id) is not None
        ks.derived.register_producer("join", "1", rebuilder("join"))
        done = ks.erasure.resume(req.request_id)
        assert done.state == "completed", done.error
        assert ks.memories.get("B", NS, "k0") is None  # the mention: dropped
        rebuilt = ks.memories.get("C", NS, "d0")
        assert rebuilt is not None and (rebuilt.value, rebuilt.mentions) == ("[2]", ())


def test_found_by_sequences_a_summary_whose_sources_are_all_gone_is_dropped(
    tmp_path: Path,
) -> None:
    # Found by DerivedSequences (fixed in the commit that added this test): B's
    # erasure took one source of A's summary, and D had deleted the other. The
    # deleted one counted as remaining, so the rebuild function ran on no source
    # and the summary was "rebuilt" as "" instead of dropped ("no source remains").
    with Keyshred.init(tmp_path / "data", make_config(None)) as ks:
        b = ks.memories.put("B", NS, "k0", "[1]")
        d = ks.memories.put("D", NS, "k0", "[2]")
        summary = _summary(ks, "A", "d0", [b, d], "[1] + [2]")
        assert ks.memories.delete("D", NS, "k0")
        req = ks.erase("B", requested_by=REQUESTED_BY, reason=REASON)
        assert req.state == "completed", req.error
        receipt = ks.erasure.receipt(req.request_id)
        assert receipt is not None
        assert [(x.asset_id, x.action) for x in receipt.derived] == [(summary.memory_id, "dropped")]
        assert ks.memories.get("A", NS, "d0") is None


def test_found_by_sequences_a_summary_is_rebuilt_after_the_summaries_it_was_built_from(
    tmp_path: Path,
) -> None:
    # Found by DerivedSequences (fixed in the commit that added this test): D's and
    # C's summaries are both built from A's memory, D's from C's too; the closure
    # listed D's first (by asset id: D's memory id predates C's), so D's was
    # rebuilt while C's was still unreadable: from nothing ("") instead of from C's
    # rebuilt value.
    with Keyshred.init(tmp_path / "data", make_config(None)) as ks:
        a = ks.memories.put("A", NS, "k0", "[1]")
        b = ks.memories.put("B", NS, "k0", "[2]")
        first = _summary(ks, "D", "d0", [b], "[2]")  # D's summary gets the older id
        c = _summary(ks, "C", "d0", [a, b], "[1] + [2]")
        again = _summary(ks, "D", "d0", [a, c], "[1] + [1] + [2]")
        assert again.memory_id == first.memory_id < c.memory_id
        req = ks.erase("A", requested_by=REQUESTED_BY, reason=REASON)
        assert req.state == "completed", req.error
        for owner in ("C", "D"):
            rebuilt = ks.memories.get(owner, NS, "d0")
            assert rebuilt is not None and rebuilt.value == "[2]", owner
