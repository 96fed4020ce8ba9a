"""Attack (fixed): a registered identifier of one subject, tokenized in another
subject's text, stayed resolvable after the first subject's erasure: the vault sealed
token values under the key of the subject whose text it was, and ran no mention
detection (issue 19's item 3 covers memories and agent threads). Such a value is now
sealed under the key its holder shares with the subjects it identifies, which their
erasure destroys; tokens expire too, but that only bounds the leak."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from keyshred import Keyshred
from keyshred.errors import KeyshredError, SubjectSuppressed, UnknownToken
from keyshred.keyring.envelope import key_id_of
from keyshred.vault.schema import tokens
from tests.storage.conftest import make_config

PHONE = "+49 30 1234567"


@pytest.fixture
def ks(tmp_path: Path) -> Iterator[Keyshred]:
    store = Keyshred.init(tmp_path / "data", make_config(None))
    yield store
    store.close()


def test_a_token_of_the_victims_phone_in_bobs_text_dies_with_the_victim(ks: Keyshred) -> None:
    victim = "victim@example.org"
    ks.subjects.register_identifiers(victim, phones=[PHONE])
    ks.memories.put(victim, ("notes",), "own", "the victim's own note")
    token = ks.vault.sanitize(f"call {PHONE}", "bob", "support", timedelta(days=30)).tokens[0]
    req = ks.erase(victim, requested_by="dpo", reason="gdpr-art17")
    assert req.state == "completed", req.error
    try:
        value = ks.vault.detokenize(token, "support", "attack", subject="bob")
    except KeyshredError:
        value = None
    assert value != PHONE


def test_a_live_co_owner_leaves_the_token_resolvable(ks: Keyshred) -> None:
    victim = "victim@example.org"
    ks.subjects.register_identifiers(victim, phones=[PHONE])
    token = ks.vault.sanitize(f"call {PHONE}", "bob", "support", timedelta(days=30)).tokens[0]
    ks.vault.flush()
    assert ks.vault.detokenize(token, "support", "agent", subject="bob") == PHONE
    # Sealed under the key bob shares with the victim, not under bob's scope key.
    with ks.catalog.engine.connect() as conn:
        value = conn.execute(sa.select(tokens.c.value).where(tokens.c.token == token)).scalar_one()
    scope_key = ks.keyring.data_key(ks.subject_ref("bob"), "default", create=False)
    assert key_id_of(bytes(value)) != scope_key.key_id


def test_the_holders_own_tokens_are_unaffected(ks: Keyshred) -> None:
    victim = "victim@example.org"
    own = "+49 30 7654321"
    ks.subjects.register_identifiers(victim, phones=[PHONE])
    ks.subjects.register_identifiers("bob", phones=[own])
    ks.memories.put(victim, ("notes",), "own", "the victim's own note")
    text = f"call {PHONE} or {own} or mail bob@example.org"
    out = ks.vault.sanitize(text, "bob", "support", timedelta(days=30))
    assert len(out.tokens) == 3
    shared, mine, mail = out.tokens
    ks.vault.flush()
    with ks.catalog.engine.connect() as conn:
        values = dict(
            conn.execute(
                sa.select(tokens.c.token, tokens.c.value).where(tokens.c.token.in_(out.tokens))
            ).all()
        )
    scope_key = ks.keyring.data_key(ks.subject_ref("bob"), "default", create=False)
    assert key_id_of(bytes(values[mine])) == scope_key.key_id
    assert key_id_of(bytes(values[mail])) == scope_key.key_id
    assert key_id_of(bytes(values[shared])) != scope_key.key_id
    assert ks.erase(victim, requested_by="dpo", reason="gdpr-art17").state == "completed"
    with pytest.raises(UnknownToken):
        ks.vault.detokenize(shared, "support", "attack", subject="bob")
    assert ks.vault.detokenize(mine, "support", "agent", subject="bob") == own
    assert ks.vault.detokenize(mail, "support", "agent", subject="bob") == "bob@example.org"
    restored = ks.vault.restore(out.text, "support", "agent", subject="bob")
    assert restored == f"call {shared} or {own} or mail bob@example.org"


def test_deterministic_tokens_do_not_merge_shared_and_scope_keys(ks: Keyshred) -> None:
    victim = "victim@example.org"
    ttl = timedelta(days=30)
    before = ks.vault.sanitize(f"call {PHONE}", "bob", "support", ttl, deterministic=True)
    ks.subjects.register_identifiers(victim, phones=[PHONE])
    ks.memories.put(victim, ("notes",), "own", "the victim's own note")
    after = ks.vault.sanitize(f"ring {PHONE}", "bob", "support", ttl, deterministic=True)
    again = ks.vault.sanitize(f"dial {PHONE}", "bob", "support", ttl, deterministic=True)
    ks.vault.flush()
    # The scope key's token (issued before the registration) is not reused for the
    # value now co-owned, and the co-owned one is stable while its key lives.
    assert after.tokens != before.tokens
    assert again.tokens == after.tokens
    assert ks.erase(victim, requested_by="dpo", reason="gdpr-art17").state == "completed"
    with pytest.raises(UnknownToken):
        ks.vault.detokenize(after.tokens[0], "support", "attack", subject="bob")
    # The token from before the registration is the finding registration does not
    # reach (not retroactive), and it is untouched.
    assert ks.vault.detokenize(before.tokens[0], "support", "agent", subject="bob") == PHONE


def test_a_suppressed_co_owner_refuses_the_sanitize(ks: Keyshred) -> None:
    victim = "victim@example.org"
    ks.subjects.register_identifiers(victim, phones=[PHONE])
    ks.catalog.suppress(ks.subject_ref(victim))
    with pytest.raises(SubjectSuppressed) as caught:
        ks.vault.sanitize(f"call {PHONE}", "bob", "support", timedelta(days=30))
    assert PHONE not in str(caught.value)
    assert ks.vault.count(ks.subject_ref("bob")) == 0
    # No shared key was made for the suppressed subject.
    with pytest.raises(KeyshredError):
        ks.keyring.data_key(
            ks.subject_ref("bob"), "default", create=False, owners=[ks.subject_ref(victim)]
        )
    # Text without the victim's identifier is sanitized as before.
    out = ks.vault.sanitize("mail bob@example.org", "bob", "support", timedelta(days=30))
    assert len(out.tokens) == 1


def test_nothing_registered_looks_nothing_up(ks: Keyshred, monkeypatch: pytest.MonkeyPatch) -> None:
    looked_up: list[object] = []
    real = ks.catalog.identifier_subjects

    def spy(*args: object) -> object:
        looked_up.append(args)
        return real(*args)

    monkeypatch.setattr(ks.catalog, "identifier_subjects", spy)
    out = ks.vault.sanitize(f"call {PHONE}", "bob", "support", timedelta(days=30))
    assert ks.vault.detokenize(out.tokens[0], "support", "agent", subject="bob") == PHONE
    assert looked_up == []
    ks.subjects.register_identifiers("victim@example.org", phones=[PHONE])
    ks.vault.sanitize(f"call {PHONE}", "bob", "support", timedelta(days=30))
    assert len(looked_up) == 1  # the spy sees the lookup once something is registered
