"""Durability of ``sanitize``: a token it returned is held and journaled (group
commit, the embedded default) or in the catalog, so a process that dies right after
loses none: its journal is replayed by the next vault; a forked child issues its own
numbers and keeps a journal of its own."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest

from keyshred import Keyshred
from keyshred.errors import UnknownToken
from tests import zygote

HOUR = timedelta(hours=1)
ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import json, os, sys
    from datetime import timedelta
    from pathlib import Path
    from keyshred import Keyshred
    ks = Keyshred.open(Path(sys.argv[1]))
    out = {}
    for who, text in (("alice", "call 13812345678"), ("bob", "mail bob.probe@example.com")):
        out[who] = ks.vault.sanitize(text, who, "support", timedelta(hours=1)).tokens[0]
    print(json.dumps(out), flush=True)
    os._exit(0)  # dies at once: no close, no atexit, nothing written after this
    """
)


def _crashed_child(data: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = zygote.run(
        [sys.executable, "-c", CHILD, str(data)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    return dict(json.loads(done.stdout))


def test_tokens_of_a_process_that_died_resolve(tmp_path: Path) -> None:
    data = tmp_path / "d"
    Keyshred.init(data).close()
    tokens = _crashed_child(data)
    with Keyshred.open(data) as ks:
        assert ks.vault.detokenize(tokens["alice"], "support", "t") == "13812345678"
        assert ks.vault.detokenize(tokens["bob"], "support", "t") == "bob.probe@example.com"
        assert ks.vault.count(ks.subject_ref("alice")) == 1
    # Replayed, then retired: no journal segment with rows is left behind.
    assert not list((data / "tokens").glob("*.journal"))


def test_a_running_process_resolves_a_dead_ones_tokens_and_erasure_removes_them(
    tmp_path: Path,
) -> None:
    data = tmp_path / "d"
    with Keyshred.init(data) as ks:
        tokens = _crashed_child(data)  # dies while this process runs
        assert ks.vault.detokenize(tokens["bob"], "support", "t") == "bob.probe@example.com"
        tokens = _crashed_child(data)
        req = ks.erase("alice", requested_by="dpo", reason="request")
        assert req.state == "completed", req.error
        assert ks.vault.count(ks.subject_ref("alice")) == 0
        with pytest.raises(UnknownToken):
            ks.vault.detokenize(tokens["alice"], "support", "t")
        assert ks.vault.detokenize(tokens["bob"], "support", "t") == "bob.probe@example.com"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_issues_its_own_numbers(tmp_path: Path) -> None:
    ks = Keyshred.init(tmp_path / "d")
    try:
        ks.vault.sanitize("bob@example.com", "bob", "support", HOUR)  # bob's key exists
        (parent,) = ks.vault.sanitize("call 13812345678", "alice", "support", HOUR).tokens
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            try:
                (mine,) = ks.vault.sanitize("call 13912345678", "bob", "support", HOUR).tokens
                os.write(write, mine.encode())
            finally:
                os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        child = os.read(read, 200).decode()
        os.close(read)
        (later,) = ks.vault.sanitize("call 13712345678", "alice", "support", HOUR).tokens
        numbers = {ks.vault.number_of(t) for t in (parent, child, later)}
        assert len(numbers) == 3  # the child took a block of its own
        assert ks.vault.detokenize(child, "support", "t") == "13912345678"
        assert ks.vault.detokenize(parent, "support", "t") == "13812345678"
        assert ks.vault.detokenize(later, "support", "t") == "13712345678"
    finally:
        ks.close()
