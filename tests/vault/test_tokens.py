"""Tokens: purpose, expiry, erasure, forgery, subjects; every outcome audited; the
logging filter and the prompt guard leak nothing."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from keyshred import Config, Keyshred
from keyshred.config import TokenSettings
from keyshred.errors import (
    IntegrityError,
    SubjectSuppressed,
    TokenExpired,
    TokenPurposeMismatch,
    TokenSubjectMismatch,
    UnknownToken,
)
from keyshred.vault.sanitizers import PromptGuard, RedactingFilter
from keyshred.vault.schema import tokens
from tests.storage.conftest import make_config

HOUR = timedelta(hours=1)
TEXT = "请联系13812345678或alice.probe@example.com，卡号4111111111111111谢谢"
VALUES = ["13812345678", "alice.probe@example.com", "4111111111111111"]


@pytest.fixture
def ks(catalog_url: str, tmp_path: Path) -> Iterator[Keyshred]:
    store = Keyshred.init(tmp_path / "data", make_config(catalog_url))
    yield store
    store.close()


@pytest.fixture
def per_call(catalog_url: str, tmp_path: Path) -> Iterator[Keyshred]:
    """A vault that commits every call's tokens before it returns (the PostgreSQL
    default; ``tokens.group_commit_ms = 0`` on the embedded catalog)."""
    cfg = make_config(catalog_url).model_copy(update={"tokens": TokenSettings(group_commit_ms=0)})
    store = Keyshred.init(tmp_path / "data", cfg)
    yield store
    store.close()


def refusals(ks: Keyshred) -> list[str]:
    return [e.data["reason"] for e in ks.audit.events() if e.event == "vault.refused"]


def test_sanitize_restore_roundtrip_and_assets(ks: Keyshred) -> None:
    s = ks.vault.sanitize(TEXT, "alice", "support", HOUR)
    assert len(s.tokens) == 3 and all(v not in s.text for v in VALUES)
    assert s.text.startswith("请联系<PHONE_") and "谢谢" in s.text
    assert ks.vault.restore(s.text, "support", "agent-7") == TEXT
    assert ks.vault.detokenize(s.tokens[1], "support", "agent-7") == "alice.probe@example.com"
    ref = ks.subject_ref("alice")
    kinds = {a.asset_id: a.kind for a in ks.catalog.assets(ref)}
    assert set(s.tokens) <= set(kinds) and {kinds[t] for t in s.tokens} == {"token"}
    events = [e for e in ks.audit.events() if e.event == "vault.resolved"]
    assert events and all(not any(v in json.dumps(e.data) for v in VALUES) for e in events)
    assert "probe" not in repr(s)


def test_modes(ks: Keyshred) -> None:
    a = ks.vault.sanitize("mail alice.probe@example.com", "alice", "join", HOUR, deterministic=True)
    b = ks.vault.sanitize(
        "again alice.probe@example.com!", "alice", "join", HOUR, deterministic=True
    )
    c = ks.vault.sanitize(
        "mail alice.probe@example.com", "alice", "other", HOUR, deterministic=True
    )
    d = ks.vault.sanitize("mail alice.probe@example.com", "bob", "join", HOUR, deterministic=True)
    assert a.tokens == b.tokens and a.tokens not in (c.tokens, d.tokens)
    r1 = ks.vault.sanitize("mail alice.probe@example.com", "alice", "join", HOUR)
    r2 = ks.vault.sanitize("mail alice.probe@example.com", "alice", "join", HOUR)
    assert r1.tokens != r2.tokens
    assert ks.vault.sanitize("nothing personal here", "alice", "join", HOUR).tokens == ()


def test_every_refusal_is_typed_and_audited(ks: Keyshred, monkeypatch: pytest.MonkeyPatch) -> None:
    s = ks.vault.sanitize(TEXT, "alice", "support", HOUR)
    token = s.tokens[0]
    with pytest.raises(TokenPurposeMismatch):
        ks.vault.detokenize(token, "marketing", "agent")
    with pytest.raises(TokenSubjectMismatch):
        ks.vault.detokenize(token, "support", "agent", subject="bob")
    with pytest.raises(UnknownToken):
        ks.vault.detokenize("<PHONE_0123456789>", "support", "agent")  # forged
    with pytest.raises(UnknownToken):
        ks.vault.detokenize("13812345678", "support", "agent")  # not a token at all
    later = datetime.now(UTC) + timedelta(hours=2)
    monkeypatch.setattr(ks.vault, "_clock", lambda: later)
    with pytest.raises(TokenExpired):
        ks.vault.detokenize(token, "support", "agent")
    monkeypatch.undo()
    # Stored first: a token still held for group commit is dropped by the flush its
    # suppression's eviction runs, and then is no token at all (UnknownToken).
    ks.vault.flush()
    ks.catalog.suppress(ks.subject_ref("alice"))
    with pytest.raises(SubjectSuppressed):
        ks.vault.detokenize(token, "support", "agent")
    assert refusals(ks) == [
        "TokenPurposeMismatch",
        "TokenSubjectMismatch",
        "UnknownToken",
        "UnknownToken",
        "TokenExpired",
        "SubjectSuppressed",
    ]
    with pytest.raises(SubjectSuppressed):
        ks.vault.sanitize(TEXT, "alice", "support", HOUR)  # no new tokens either


def test_erasure_makes_tokens_unresolvable_and_removes_them(ks: Keyshred) -> None:
    s = ks.vault.sanitize(TEXT, "alice", "support", HOUR)
    keep = ks.vault.sanitize(TEXT, "bob", "support", HOUR)
    req = ks.erase("alice", requested_by="dpo", reason="request")
    assert req.state == "completed", req.error
    for token in s.tokens:
        with pytest.raises(UnknownToken):
            ks.vault.detokenize(token, "support", "agent")
    assert ks.vault.count(ks.subject_ref("alice")) == 0
    assert ks.vault.restore(keep.text, "support", "agent") == TEXT
    receipt = ks.erasure.receipt(req.request_id)
    assert {(s.store, s.count) for s in receipt.stores} >= {("vault", 3)}  # type: ignore[union-attr]


def test_swapped_token_values_raise(ks: Keyshred) -> None:
    s = ks.vault.sanitize(TEXT, "alice", "support", HOUR)
    ks.vault.flush()  # group commit (the embedded default): store them now
    with ks.catalog.transaction() as conn:
        a, b = (
            conn.execute(tokens.select().where(tokens.c.token == t)).first() for t in s.tokens[:2]
        )
        conn.execute(tokens.update().where(tokens.c.token == a.token).values(value=b.value))  # type: ignore[union-attr]
    with pytest.raises(IntegrityError):
        ks.vault.detokenize(s.tokens[0], "support", "agent")


def test_no_value_or_key_in_any_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No value, and no raw key (DEKs, the token-id key), in any file of the folder."""
    from keyshred.keyring import _primitives as prim

    made: list[bytes] = []
    real = prim.random_key

    def recording() -> bytes:
        made.append(real())
        return made[-1]

    monkeypatch.setattr(prim, "random_key", recording)

    def scan() -> None:
        files = [p for p in (tmp_path / "data").rglob("*") if p.is_file()]
        for path in files:
            data = path.read_bytes()
            for value in VALUES:
                assert value.encode() not in data, path
            if path.name != "kek.local.json":  # the local KEK file holds the KEK, by design
                for key in made:
                    for form in (key, key.hex().encode(), base64.b64encode(key)):
                        assert form not in data, path

    with Keyshred.init(tmp_path / "data") as ks:
        for i in range(20):
            ks.vault.sanitize(TEXT, f"subject-{i}", "support", HOUR, deterministic=i % 2 == 0)
        scan()  # while open: the tokens are in the catalog, sealed only
        ks.vault.restore(ks.vault.sanitize(TEXT, "x", "support", HOUR).text, "support", "t")
    assert len(made) >= 22  # the KEK epoch, the token-id key, a DEK per subject
    scan()


def test_debug_logging_through_the_filter_leaks_nothing(tmp_path: Path) -> None:
    log_file = tmp_path / "app.log"
    with Keyshred.init(tmp_path / "data") as ks:
        logger = logging.getLogger("keyshred-test-app")
        logger.setLevel(logging.DEBUG)
        handler = logging.FileHandler(log_file)
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        handler.addFilter(RedactingFilter(ks.vault))
        logger.addHandler(handler)
        try:
            for i in range(50):
                logger.debug(
                    "user %s called from %s about card %s", VALUES[1], VALUES[0], VALUES[2]
                )
                logger.info("tokenized for a subject: %s", VALUES[1], extra={"subject": "alice"})
                logger.warning(f"inline f-string with 192.168.7.{i} and {VALUES[0]}")
            try:
                raise ValueError(f"bad input {VALUES[1]}")
            except ValueError:
                logger.exception("failed for %s", VALUES[0])
        finally:
            logger.removeHandler(handler)
            handler.close()
    text = log_file.read_text("utf-8")
    assert "<EMAIL>" in text and "<EMAIL_" in text and "<IP>" in text
    for value in [*VALUES, "192.168.7."]:
        assert value not in text


def test_prompt_guard_restores_only_for_the_tool_purpose(ks: Keyshred) -> None:
    guard = PromptGuard(ks.vault, "alice", purpose="booking-tool", ttl=HOUR)
    messages = guard.sanitize_messages(
        [{"role": "system", "content": "You book tables."}, {"role": "user", "content": TEXT}]
    )
    assert messages[0]["content"] == "You book tables."
    assert all(v not in messages[1]["content"] for v in VALUES)
    answer = "I will call " + messages[1]["content"].split("请联系")[1].split("或")[0]
    assert guard.restore_answer(answer, caller="booking", purpose="booking-tool") == (
        "I will call 13812345678"
    )
    assert guard.restore_answer(answer, caller="chat", purpose="chat") == answer
    # Another subject's token for the same tool purpose, repeated by the model: it
    # stays a token (and the refusal is audited).
    other = ks.vault.sanitize("call 13912345678", "bob", "booking-tool", HOUR).tokens[0]
    mixed = f"{answer} and {other}"
    assert guard.restore_answer(mixed, caller="booking", purpose="booking-tool") == (
        f"I will call 13812345678 and {other}"
    )
    assert "TokenSubjectMismatch" in refusals(ks)


def test_sanitize_many_is_one_batch_with_the_same_rules(ks: Keyshred) -> None:
    texts = [TEXT, "nothing here", f"again {VALUES[1]}"]
    out = ks.vault.sanitize_many(texts, "alice", "support", HOUR, deterministic=True)
    assert [len(s.tokens) for s in out] == [3, 0, 1]
    assert out[0].tokens[1] == out[2].tokens[0]  # deterministic across the batch
    assert [ks.vault.restore(s.text, "support", "t") for s in out] == texts
    ks.catalog.suppress(ks.subject_ref("alice"))
    with pytest.raises(SubjectSuppressed):
        ks.vault.sanitize_many(texts, "alice", "support", HOUR)


def test_a_token_is_stored_before_sanitize_returns(tmp_path: Path) -> None:
    """One transaction per call (``group_commit_ms = 0``): what ``sanitize`` returned
    is in the catalog, and another process resolves it while this one is still open."""
    cfg = Config.model_validate({"tokens": {"group_commit_ms": 0}})
    with Keyshred.init(tmp_path / "g", cfg) as ks:
        s = ks.vault.sanitize("mail ann@example.org", "ann", "support", HOUR)
        assert ks.vault.count(ks.subject_ref("ann")) == 1
        assert ks.vault.flush() == 0  # nothing is ever pending
        with Keyshred.open(tmp_path / "g") as other:
            assert other.vault.restore(s.text, "support", caller="t") == "mail ann@example.org"
            with pytest.raises(TokenPurposeMismatch):
                other.vault.detokenize(s.tokens[0], "analytics", caller="t")


def test_the_insert_rereads_the_guard_a_suppression_meanwhile_stores_nothing(
    per_call: Keyshred, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The subject is suppressed after the call's guard check (its key exists): the
    insert's transaction reads the guard again and stores nothing. (Group commit
    drops such rows at its flush: test_group.py.)"""
    ks = per_call
    ks.vault.sanitize("mail bo@example.org", "bo", "support", HOUR)
    ref = ks.subject_ref("bo")
    real = ks.catalog.check_guard
    calls = []

    def then_suppress(subject_ref: str, *args: object, **kwargs: object) -> int:
        epoch = real(subject_ref, *args, **kwargs)  # type: ignore[arg-type]
        calls.append(subject_ref)
        if len(calls) == 1:  # the call's own check passed; the insert's comes later
            ks.catalog.suppress(subject_ref)
        return epoch

    monkeypatch.setattr(ks.catalog, "check_guard", then_suppress)
    with pytest.raises(SubjectSuppressed):
        ks.vault.sanitize("mail bo.again@example.org", "bo", "support", HOUR)
    ks.vault.sanitize("mail cy@example.org", "cy", "support", HOUR)
    assert ks.vault.count(ref) == 1  # the first call's token only
    assert ks.vault.count(ks.subject_ref("cy")) == 1


def test_a_failed_insert_hands_out_no_token(
    per_call: Keyshred, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rows are stored before the text goes out: a failing catalog fails the call."""
    ks = per_call
    from keyshred.vault.store import TokenStore

    def failing(self: TokenStore, *args: Any) -> None:
        raise RuntimeError("the catalog is down")

    monkeypatch.setattr(TokenStore, "insert", failing)
    with pytest.raises(RuntimeError):
        ks.vault.sanitize(TEXT, "ann", "support", HOUR)
    monkeypatch.undo()
    assert ks.vault.count(ks.subject_ref("ann")) == 0


def test_no_key_is_created_for_a_subject_suppressed_after_the_first_check(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race of a first sanitize with an erasure: the guard passes, then the
    subject is suppressed before the key exists. The key is made under the
    partition lock with the guard read again, so none is created."""
    ref = ks.subject_ref("dora")
    real = ks.catalog.check_guard
    calls = []

    def then_suppress(subject_ref: str, *args: object, **kwargs: object) -> int:
        epoch = real(subject_ref, *args, **kwargs)  # type: ignore[arg-type]
        calls.append(subject_ref)
        if len(calls) == 1:
            ks.catalog.suppress(subject_ref)
        return epoch

    monkeypatch.setattr(ks.catalog, "check_guard", then_suppress)
    with pytest.raises(SubjectSuppressed):
        ks.vault.sanitize("mail dora@example.com", "dora", "support", HOUR)
    assert ks.keyring.store.find(ref, "default") is None
    assert ks.vault.count(ref) == 0


def _open(path: Path) -> Keyshred:
    return Keyshred.init(path, exist_ok=True)


def test_token_ids_encipher_unique_numbers(ks: Keyshred) -> None:
    """Every id is FF1 of a fresh row number: all distinct, in no visible order, and
    the number finds the row."""
    # 2,401 tokens: one call spans three blocks of 1,024 numbers.
    texts = [f"call 139{n:08d} or mail u{n}@example.com" for n in range(1200)]
    issued = [t for s in ks.vault.sanitize_many(texts, "alice", "support", HOUR) for t in s.tokens]
    issued += ks.vault.sanitize("call 13812345678", "bob", "support", HOUR).tokens
    numbers = [ks.vault.number_of(t) for t in issued]
    assert len(set(issued)) == len(issued) == 2401 and len(set(numbers)) == 2401
    ids = [t.rsplit("_", 1)[1][:-1] for t in issued]
    assert ids != sorted(ids) and len({i[:3] for i in ids}) > 100  # no shared prefix, no order
    ks.vault.flush()
    with ks.catalog.engine.connect() as conn:
        stored = dict(conn.execute(sa.select(tokens.c.token, tokens.c.number)).all())
    assert {t: stored[t] for t in issued} == dict(zip(issued, numbers, strict=True))
    assert ks.vault.number_of("<PHONE_zz>") is None and ks.vault.number_of("13812345678") is None


def test_an_id_under_another_kind_is_forged(ks: Keyshred) -> None:
    (token,) = ks.vault.sanitize("call 13812345678", "alice", "support", HOUR).tokens
    forged = "<EMAIL_" + token.rsplit("_", 1)[1]
    with pytest.raises(UnknownToken):
        ks.vault.detokenize(forged, "support", "t")
    assert refusals(ks) == ["UnknownToken"]
    assert ks.catalog.asset(forged) is None and ks.catalog.asset(token) is not None


def test_two_vaults_on_one_catalog_never_share_a_number(tmp_path: Path) -> None:
    """Two processes' vaults (here two instances) take disjoint blocks of numbers."""
    a = _open(tmp_path / "d")
    b = Keyshred.open(tmp_path / "d")
    try:
        out: list[tuple[str, str]] = []
        for n in range(50):
            for store in (a, b):
                value = f"13{n % 10}{n:08d}"
                (t,) = store.vault.sanitize(f"call {value}", f"s{n}", "support", HOUR).tokens
                out.append((t, value))
        assert len({t for t, _ in out}) == 100
        for store in (a, b):
            for t, value in out:
                assert store.vault.detokenize(t, "support", "t") == value
    finally:
        a.close()
        b.close()


def test_deterministic_tokens_are_found_again(tmp_path: Path) -> None:
    store = _open(tmp_path / "g")
    try:
        mail = "mail dora.probe@example.com"
        first = store.vault.sanitize(mail, "dora", "join", HOUR, deterministic=True).tokens
        assert store.vault.sanitize(mail, "dora", "join", HOUR, deterministic=True).tokens == first
        # Other subject, scope or purpose: another token.
        for subject, purpose, scope in (("erin", "join", "default"), ("dora", "other", "default")):
            other = store.vault.sanitize(
                mail, subject, purpose, HOUR, deterministic=True, scope=scope
            )
            assert other.tokens != first
        assert store.vault.detokenize(first[0], "join", "t") == "dora.probe@example.com"
    finally:
        store.close()


def test_racing_deterministic_issuers_both_resolve_and_the_first_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes issue the same deterministic value at once (the second looked
    before the first committed): both tokens resolve; afterwards everyone gets the
    lower-numbered one."""
    a = _open(tmp_path / "d")
    b = Keyshred.open(tmp_path / "d")
    try:
        mail = "mail dora.probe@example.com"
        (ta,) = a.vault.sanitize(mail, "dora", "join", HOUR, deterministic=True).tokens
        with monkeypatch.context() as race:
            race.setattr(b.vault._store, "lookups", lambda *args: {})  # a's not seen yet
            (tb,) = b.vault.sanitize(mail, "dora", "join", HOUR, deterministic=True).tokens
        assert ta != tb
        first = min((ta, tb), key=lambda t: a.vault.number_of(t) or 0)
        for store in (a, b):
            for t in (ta, tb):
                assert store.vault.detokenize(t, "join", "x") == "dora.probe@example.com"
            again = store.vault.sanitize(mail, "dora", "join", HOUR, deterministic=True).tokens
            assert again == (first,)
    finally:
        a.close()
        b.close()


def test_a_token_of_another_process_resolves_at_once_and_a_forged_number_never(
    tmp_path: Path,
) -> None:
    a = _open(tmp_path / "d")
    b = Keyshred.open(tmp_path / "d")
    try:
        (issued,) = a.vault.sanitize("call 13812345678", "ivy", "support", HOUR).tokens
        assert b.vault.detokenize(issued, "support", "t") == "13812345678"
        # A number no block ever held, enciphered like a real id.
        with pytest.raises(UnknownToken):
            b.vault.detokenize(
                "<PHONE_" + a.keyring.token_ids().encode(2**39) + ">", "support", "t"
            )
        assert refusals(b) == ["UnknownToken"]
    finally:
        a.close()
        b.close()


def test_the_vault_of_a_migrated_catalog_does_not_create_or_reflect_its_tables(
    catalog_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The catalog's migrations made the vault's tables (and refuse a token table from
    before token numbers): an open leaves them to it, new or existing folder."""
    from keyshred.vault import store as token_store

    def refuse(engine: object) -> None:
        raise AssertionError("the vault created or reflected its tables itself")

    monkeypatch.setattr(token_store, "create", refuse)
    Keyshred.init(tmp_path / "data", make_config(catalog_url)).close()
    ks = Keyshred.open(tmp_path / "data")
    try:
        s = ks.vault.sanitize(TEXT, "alice", "support", HOUR)
        assert ks.vault.restore(s.text, "support", "agent-7") == TEXT
    finally:
        ks.close()
