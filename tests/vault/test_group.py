"""Group commit (``keyshred.vault.group``, the embedded default): held tokens resolve
at once in their process and are waited for by another, a suppression drops them,
close and the flusher store them, a failing background flush is counted, logged
without content, audited once per run and shown. The journal behind it has its own
tests (test_journal.py)."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from keyshred import Config, Keyshred
from keyshred.errors import SubjectSuppressed, TokenPurposeMismatch, UnknownToken
from keyshred.vault.group import FLUSHER_NAME
from tests.vault.test_tokens import HOUR, VALUES, refusals


def _group(path: Path) -> Keyshred:
    cfg = Config.model_validate({"tokens": {"group_commit_ms": 10_000}})  # flush by hand
    return Keyshred.init(path, cfg, exist_ok=True)


def test_group_commit_resolves_at_once_and_survives_close(tmp_path: Path) -> None:
    from keyshred import Config, Keyshred

    cfg = Config.model_validate({"tokens": {"group_commit_ms": 50}})
    with Keyshred.init(tmp_path / "g", cfg) as ks:
        s = ks.vault.sanitize("mail ann@example.org", "ann", "support", timedelta(hours=1))
        # Resolves at once in this process, from the pending buffer.
        assert ks.vault.restore(s.text, "support", caller="t") == "mail ann@example.org"
        with pytest.raises(TokenPurposeMismatch):
            ks.vault.detokenize(s.tokens[0], "analytics", caller="t")
        ks.vault.flush()
        assert ks.vault.count(ks.subject_ref("ann")) == 1
        t = ks.vault.sanitize("call 13812345678", "ann", "support", timedelta(hours=1))
    # close() flushed what was pending: another process (a fresh open) resolves it.
    with Keyshred.open(tmp_path / "g") as again:
        assert again.vault.restore(t.text, "support", caller="t") == "call 13812345678"


def test_group_commit_never_stores_tokens_of_a_suppressed_subject(tmp_path: Path) -> None:
    from keyshred import Config, Keyshred

    cfg = Config.model_validate({"tokens": {"group_commit_ms": 10_000}})  # flush by hand
    with Keyshred.init(tmp_path / "g", cfg) as ks:
        a = ks.vault.sanitize("mail bo@example.org", "bo", "support", timedelta(hours=1))
        ks.vault.sanitize("mail cy@example.org", "cy", "support", timedelta(hours=1))
        ks.catalog.suppress(ks.subject_ref("bo"))  # an erasure starts before the flush
        assert ks.vault.flush() == 1  # cy's token stored; bo's dropped, never written
        assert ks.vault.count(ks.subject_ref("bo")) == 0
        assert ks.vault.count(ks.subject_ref("cy")) == 1
        with pytest.raises((UnknownToken, SubjectSuppressed)):
            ks.vault.detokenize(a.tokens[0], "support", caller="t")


def test_deterministic_tokens_while_pending_and_stored(tmp_path: Path) -> None:
    store = _group(tmp_path / "g")
    try:
        mail = "mail dora.probe@example.com"
        first = store.vault.sanitize(mail, "dora", "join", HOUR, deterministic=True).tokens
        assert store.vault.sanitize(mail, "dora", "join", HOUR, deterministic=True).tokens == first
        store.vault.flush()
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


def test_another_process_waits_for_a_pending_token_instead_of_refusing(tmp_path: Path) -> None:
    import threading

    a = _group(tmp_path / "d")
    b = Keyshred.open(tmp_path / "d")
    try:
        (pending,) = a.vault.sanitize("call 13812345678", "ivy", "support", HOUR).tokens
        number = a.vault.number_of(pending)
        assert (
            number is not None
            and b.vault._store.pending_window(number, 0.5, datetime.now(UTC)) == 10.5
        )
        flusher = threading.Timer(0.2, a.vault.flush)
        flusher.start()
        assert b.vault.detokenize(pending, "support", "t") == "13812345678"
        flusher.join()
        assert "UnknownToken" not in refusals(b)
        # Stored now: resolved at once.
        (later,) = a.vault.sanitize("call 13912345678", "jo", "support", HOUR).tokens
        a.vault.flush()
        assert b.vault.detokenize(later, "support", "t") == "13912345678"
        # Deleted, with a later number of its block stored: it may only be pending
        # while that later number is younger than the interval (another thread of
        # the issuer may have overtaken it); after that it is refused at once.
        a.vault.drop_subject(a.subject_ref("ivy"))
        soon = datetime.now(UTC) + timedelta(seconds=1)
        assert b.vault._store.pending_window(number, 0.5, soon) == 10.5
        later_on = datetime.now(UTC) + timedelta(seconds=11)
        assert b.vault._store.pending_window(number, 0.5, later_on) == 0
        b.vault._clock = lambda: datetime.now(UTC) + timedelta(seconds=11)
        with pytest.raises(UnknownToken):
            b.vault.detokenize(pending, "support", "t")
        # A forged number (its block was never handed out) is refused at once too, and
        # so is a number of a vault that commits per call (never pending).
        from keyshred import Config

        per_call = Config.model_validate({"tokens": {"group_commit_ms": 0}})
        with Keyshred.open(tmp_path / "d", per_call) as c:
            (direct,) = c.vault.sanitize("call 13712345678", "kay", "support", HOUR).tokens
            c_number = c.vault.number_of(direct)
        assert (
            c_number is not None
            and a.vault._store.pending_window(c_number, 0.5, datetime.now(UTC)) == 0
        )
        assert b.vault._store.pending_window(2**39, 0.5, datetime.now(UTC)) == 0
        with pytest.raises(UnknownToken):
            b.vault.detokenize(
                "<PHONE_" + a.keyring.token_ids().encode(2**39) + ">", "support", "t"
            )
    finally:
        a.close()
        b.close()


def _wait_for(condition: Any, what: str) -> None:
    """Poll a background thread's effect (a generous deadline, not a timing claim)."""
    import time

    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def test_a_failing_background_flush_is_counted_logged_audited_and_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import os
    import subprocess
    import sys
    import threading

    from keyshred import Config, Keyshred

    cfg = Config.model_validate({"tokens": {"group_commit_ms": 50}})
    caplog.set_level(logging.WARNING, logger="keyshred.vault")
    with Keyshred.init(tmp_path / "g", cfg) as ks:
        real = ks._vault._store.insert

        def failing(rows: Any, *args: Any, **kwargs: Any) -> Any:
            if threading.current_thread().name != FLUSHER_NAME:
                return real(rows, *args, **kwargs)  # a caller's inline flush works
            # A database error's message quotes the statement's parameters.
            raise RuntimeError(f"insert failed: {rows!r}")

        monkeypatch.setattr(ks._vault._store, "insert", failing)
        while True:  # until a token is left to the background flusher
            ks.vault.flush()
            s = ks.vault.sanitize(f"mail {VALUES[1]}", "ann", "support", HOUR)
            if ks.vault.status().pending:
                break
        _wait_for(lambda: ks.vault.status().flush_failures >= 3, "three failed flushes")
        status = ks.vault.status()
        assert status.pending == 1 and status.consecutive_failures >= 3
        assert status.last_failure == "RuntimeError" and status.last_failure_at is not None
        metric = next(
            line
            for line in ks.metrics.render().splitlines()
            if line.startswith("keyshred_token_flush_failures_total ")
        )
        assert float(metric.split()[1]) >= 3
        logged = [r for r in caplog.records if r.name == "keyshred.vault"]
        # Logged at the 1st, 2nd, 4th... failure of a run, not at every interval.
        runs = {int(r.getMessage().split(", ")[1].split()[0]) for r in logged}
        assert {1, 2} <= runs and 3 not in runs
        for record in logged:
            text = record.getMessage()
            assert "RuntimeError" in text and record.exc_info is None
            assert s.tokens[0] not in text and VALUES[1] not in text and "insert failed" not in text
        audited = [e.data for e in ks.audit.events() if e.event == "vault.flush_failed"]
        assert audited == [{"error": "RuntimeError"}]  # once per run of failures
        # The token still resolves here (held), and is stored once the catalog works.
        assert ks.vault.restore(s.text, "support", caller="t") == f"mail {VALUES[1]}"
        monkeypatch.setattr(ks._vault._store, "insert", real)
        _wait_for(lambda: ks.vault.status().pending == 0, "the retried flush")
        after = ks.vault.status()
        assert after.consecutive_failures == 0 and after.flush_failures >= 3
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "keyshred"), "keys", "status", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KEYSHRED_PATH": str(tmp_path / "g")},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)["token_flush"]
    assert shown["failure_runs_audited"] == 1 and shown["last_audited_failure_at"]
    with Keyshred.open(tmp_path / "g") as again:
        assert again.vault.restore(s.text, "support", caller="t") == f"mail {VALUES[1]}"
