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
from tests import zygote
from tests.vault.test_tokens import HOUR, VALUES, refusals
from tests.vault.unheard import suppress_unheard


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
        suppress_unheard(ks, ks.subject_ref("bo"))  # an erasure starts before the flush
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
    proc = zygote.run(
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


# -- review of the restored journal (issue 20) -----------------------------------------

_DIE_HOLDING = """
import os, sys
from datetime import timedelta
from keyshred import Config, Keyshred
cfg = Config.model_validate({"tokens": {"group_commit_ms": 10_000}})
ks = Keyshred.open(sys.argv[1], cfg)
ks.vault.sanitize("warm w@example.com", "ann", "support", timedelta(hours=1))
ks.vault.flush()
token = ks.vault.sanitize("mail bob.q7@example.com", "ann", "support", timedelta(hours=1)).tokens[0]
if sys.argv[2] == "fork":
    pid = os.fork()
    if pid == 0:  # a long-lived forked worker that never touches the vault
        import time
        devnull = os.open(os.devnull, os.O_RDWR)  # lets the test's pipe close
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        time.sleep(120)
        os._exit(0)
    print(token, pid, flush=True)
else:
    print(token, 0, flush=True)
os._exit(0)  # dies holding the token: no flush, no close
"""


def _die_holding(data: Path, mode: str) -> tuple[str, int]:
    import os
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = zygote.run(
        [sys.executable, "-c", _DIE_HOLDING, str(data), mode],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    ).stdout.split()
    return out[0], int(out[1])


def test_a_vault_without_group_commit_replays_a_dead_processes_journal(tmp_path: Path) -> None:
    """A process may open the folder with ``group_commit_ms = 0``: it still replays
    the journal a process with group commit left when it died (and its erasure
    still sees those rows)."""
    data = tmp_path / "d"
    Keyshred.init(data).close()
    token, _ = _die_holding(data, "plain")
    assert list((data / "tokens").glob("*.journal"))
    per_call = Config.model_validate({"tokens": {"group_commit_ms": 0}})
    with Keyshred.open(data, per_call) as ks:
        assert ks.vault.detokenize(token, "support", "t") == "bob.q7@example.com"
        assert ks.vault.count(ks.subject_ref("ann")) == 2
    assert not list((data / "tokens").glob("*.journal"))


def test_a_forked_child_does_not_keep_its_dead_parents_journal_locked(tmp_path: Path) -> None:
    """The child closes its copies of the parent's journal descriptors: a lock is the
    shared open file description's, so a child that outlived its parent would keep
    the dead parent's rows from being replayed for as long as it lives."""
    import os
    import signal

    data = tmp_path / "d"
    Keyshred.init(data).close()
    token, child = _die_holding(data, "fork")
    try:
        with Keyshred.open(data) as ks:  # the child still sleeps; opening replays
            assert ks.vault.count(ks.subject_ref("ann")) == 2
            assert ks.vault.detokenize(token, "support", "t") == "bob.q7@example.com"
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_flush_that_failed_part_way_stores_each_row_once_when_retried(tmp_path: Path) -> None:
    """The flush's batch is refused (a held subject was suppressed), so it stores
    subject by subject; a transient failure after the first subject's rows
    committed holds the whole batch again. The retry skips what is stored instead
    of failing on it forever."""
    from keyshred.errors import BackendUnavailable

    with _group(tmp_path / "d") as ks:
        v = ks._vault
        v.sanitize("warm w@example.com", "warm", "support", HOUR)
        v.flush()
        (ta,) = v.sanitize("mail anna.p@example.com", "anna", "support", HOUR).tokens
        v.sanitize("mail xavier.p@example.com", "xavier", "support", HOUR)
        (tb,) = v.sanitize("mail bert.p@example.com", "bert", "support", HOUR).tokens
        suppress_unheard(ks, ks.subject_ref("xavier"))
        real, calls = v._store.insert, []

        def flaky(rows: Any, guards: Any, **kwargs: Any) -> Any:
            calls.append(len(rows))
            if len(calls) == 3:  # the batch (refused), anna's (stored), then this
                raise BackendUnavailable("the catalog database cannot be reached")
            return real(rows, guards, **kwargs)

        v._store.insert = flaky  # type: ignore[method-assign]
        with pytest.raises(BackendUnavailable):
            v.flush()
        v._store.insert = real  # type: ignore[method-assign]
        v.flush()
        assert v.status().pending == 0
        for subject, token in (("anna", ta), ("bert", tb)):
            assert v.count(ks.subject_ref(subject)) == 1
            assert v.detokenize(token, "support", "t").endswith(".p@example.com")
        assert v.count(ks.subject_ref("xavier")) == 0


def test_a_text_of_many_gone_tokens_waits_one_window_in_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tokens of another process's group-commit block whose rows are gone may be
    pending, so resolution waits for them, but one call waits one window in all,
    not one per token (a fake clock counts the waiting, no real time is measured)."""
    import keyshred.vault.tokens as tokens_module

    a = _group(tmp_path / "d")
    texts = [f"mail gone{i}@example.com" for i in range(10)]
    sanitized = [a.vault.sanitize(t, "gus", "support", HOUR) for t in texts]
    a.vault.flush()
    a.vault.drop_subject(a.subject_ref("gus"))  # rows gone; gus not suppressed
    a.close()
    b = Keyshred.open(tmp_path / "d")
    try:
        now = [0.0]
        sleeps = []

        def fake_sleep(seconds: float) -> None:
            sleeps.append(seconds)
            now[0] += 0.05

        monkeypatch.setattr(tokens_module.time, "monotonic", lambda: now[0])
        monkeypatch.setattr(tokens_module.time, "sleep", fake_sleep)
        text = " ".join(s.text for s in sanitized)
        assert b.vault.restore(text, "support", "t") == text  # none resolves
        window = 10.0 + 0.5  # the issuer's interval plus the slack
        assert 0 < len(sleeps) <= window / 0.05 + 10
    finally:
        b.close()


def test_a_ttl_beyond_a_century_is_refused(tmp_path: Path) -> None:
    from keyshred.errors import InvalidInput

    with _group(tmp_path / "d") as ks:
        with pytest.raises(InvalidInput):
            ks.vault.sanitize("mail t@example.com", "t", "support", timedelta(days=200_000_000))
        assert ks.vault.sanitize("mail t@example.com", "t", "support", timedelta(days=36_525))


_KILLED_IN_A_FLUSH = """
import json, os, signal, sys
from datetime import timedelta
from keyshred import Config, Keyshred
from keyshred.storage import faults
cfg = Config.model_validate({"tokens": {"group_commit_ms": 10_000}})
ks = Keyshred.open(sys.argv[1], cfg)
hour = timedelta(hours=1)
for who in ("ann", "xavier", "bert"):
    ks.vault.sanitize(f"warm {who}.w@example.com", who, "support", hour)
ks.vault.flush()
issued = {}
for who in ("ann", "xavier", "bert"):
    for n in range(3):
        value = f"{who}.{n}.q@example.com"
        issued[ks.vault.sanitize(f"mail {value}", who, "support", hour).tokens[0]] = value
if sys.argv[2] == "vault.after_group":
    # The flush stores subject by subject; its eviction event unheard (see
    # tests/vault/unheard.py), or it would have flushed already.
    if ks._eviction._subscription is not None:
        ks._eviction._subscription.close()
        ks._eviction._subscription = None
    ks.catalog.suppress(ks.subject_ref("xavier"))
print(json.dumps(issued), flush=True)
def die(point):
    if point == sys.argv[2]:
        os.kill(os.getpid(), signal.SIGKILL)
faults.hook = die
ks.vault.flush()
"""


@pytest.mark.parametrize("point", ["vault.after_store", "vault.after_group"])
def test_killed_inside_a_flush_loses_nothing_and_stores_nothing_twice(
    tmp_path: Path, point: str
) -> None:
    """SIGKILL inside the flush (its rows committed, the journal not yet zeroed; or
    one subject's rows committed, the next not yet): the next open replays the
    journal, skips what is stored, drops the suppressed subject's rows, and every
    other token resolves, each stored once."""
    import os
    import sys

    data = tmp_path / "d"
    Keyshred.init(data).close()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = zygote.run(
        [sys.executable, "-c", _KILLED_IN_A_FLUSH, str(data), point],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]  # killed at the point
    issued: dict[str, str] = json.loads(proc.stdout)
    with Keyshred.open(data) as ks:
        for who in ("ann", "bert", "xavier"):
            stored = ks.vault.count(ks.subject_ref(who))
            dropped = who == "xavier" and point == "vault.after_group"
            assert stored == (1 if dropped else 4), who  # the warm-up one, plus 3 once each
        for token, value in issued.items():
            if point == "vault.after_group" and value.startswith("xavier."):
                with pytest.raises((UnknownToken, SubjectSuppressed)):
                    ks.vault.detokenize(token, "support", "t")
            else:
                assert ks.vault.detokenize(token, "support", "t") == value
    assert not list((data / "tokens").glob("*.journal"))
