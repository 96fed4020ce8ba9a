"""``tests/xdist_text.py``: a failure whose report holds a lone surrogate reaches the
xdist controller as a failure, and the worker goes on with the next test (before,
the worker died with INTERNALERROR and the run ended with exit status 3)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.xdist_text import sendable

REPO = Path(__file__).resolve().parents[1]

FAILING = """
def test_fails_with_a_surrogate():
    print("captured \\ud800")
    assert "\\udcff" == "x"


def test_after():
    pass
"""


def test_sendable_escapes_only_what_utf8_cannot_carry() -> None:
    assert sendable("plain é ✓") == "plain é ✓"
    assert sendable("a\ud800b") == "a\\ud800b"


def test_a_surrogate_in_a_failure_leaves_the_worker_running(tmp_path: Path) -> None:
    (tmp_path / "test_surrogate.py").write_text(FAILING)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = ["-q", "-n", "1", "-p", "no:cacheprovider", "-p", "tests.xdist_text"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "test_surrogate.py"],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert "INTERNALERROR" not in out, out[-3000:]
    assert proc.returncode == 1, out[-3000:]  # tests failed: not 3, an internal error
    assert "1 failed, 1 passed" in out, out[-3000:]
    assert "\\udcff" in out  # the failure's message, escaped
