"""Attack (open finding): a registered identifier of one subject, tokenized in
another subject's text, stays resolvable after the first subject's erasure: the
vault seals token values under the key of the subject whose text it was, and runs
no mention detection (issue 19's item 3 covers memories and, on this branch, agent
threads; tokens expire, which bounds it, but the erasure does not)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from keyshred import Keyshred
from keyshred.errors import KeyshredError
from tests.storage.conftest import make_config

PHONE = "+49 30 1234567"


@pytest.fixture
def ks(tmp_path: Path) -> Iterator[Keyshred]:
    store = Keyshred.init(tmp_path / "data", make_config(None))
    yield store
    store.close()


@pytest.mark.xfail(
    strict=True,
    reason="open: tokens are sealed under the text's subject's key only (see the report)",
)
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
