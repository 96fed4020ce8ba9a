"""The tests' zygote (``tests.zygote``) runs a Python program as ``subprocess`` does:
each program here is run both ways and must give the same exit status and output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import zygote

PROGRAMS = {
    "exit code and both streams": (
        "import sys; print('out', sys.argv[1:]); print('err', file=sys.stderr); sys.exit(3)"
    ),
    "an exception": "raise ValueError('boom')",
    "a message as exit": "raise SystemExit('bye')",
    "killed by a signal": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
    "a SIGTERM handler": (
        "import os, signal, sys\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "import time; time.sleep(5)"
    ),
    "non-daemon threads are joined, atexit runs": (
        "import atexit, threading, time\n"
        "atexit.register(lambda: print('atexit'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()"
    ),
    "environment, folder and __main__": (
        "import os, sys; print(os.environ.get('KS_ZYGOTE_PROBE'), os.getcwd(), __name__,"
        " sys.modules['__main__'].__dict__ is globals(), repr(sys.path[0]))"
    ),
    "standard input": "import sys; print(sys.stdin.read().upper())",
    "unbuffered bytes and text in order": (
        "import sys; sys.stdout.write('a'); sys.stdout.flush();"
        " sys.stdout.buffer.write(b'b'); print('c')"
    ),
}


def _both(
    code: str, tmp_path: Path, **kwargs: object
) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    args = [sys.executable, "-c", code, "x", "y"]
    env = {**os.environ, "KS_ZYGOTE_PROBE": "probe"}
    common = {"capture_output": True, "text": True, "timeout": 60, "env": env, "cwd": tmp_path}
    common.update(kwargs)
    real = subprocess.run(args, check=False, **common)  # type: ignore[call-overload]
    return real, zygote.run(args, **common)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_a_program_runs_as_under_subprocess(name: str, tmp_path: Path) -> None:
    extra = {"input": "typed"} if name == "standard input" else {}
    real, forked = _both(PROGRAMS[name], tmp_path, **extra)
    assert forked.returncode == real.returncode, (forked.stderr, real.stderr)
    assert forked.stdout == real.stdout
    assert forked.stderr == real.stderr


def test_a_script_and_a_module_get_their_argv_and_path(tmp_path: Path) -> None:
    script = tmp_path / "prog.py"
    script.write_text("import sys\nprint(sys.argv, sys.path[0])\n")
    for args in (
        [sys.executable, str(script), "a"],
        [sys.executable, "-m", "json.tool", "--help"],
        [zygote.KEYSHRED, "--version"],
    ):
        real = subprocess.run(
            args, capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False
        )
        forked = zygote.run(args, capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert (forked.returncode, forked.stdout) == (real.returncode, real.stdout), args


def test_popen_streams_lines_and_the_test_kills_it(tmp_path: Path) -> None:
    code = "import time\nprint('ready', flush=True)\ntime.sleep(60)"
    with zygote.Popen([sys.executable, "-c", code], stdout=zygote.PIPE, text=True) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
        os.kill(proc.pid, signal.SIGKILL)  # by pid, as a test kills a worker
        assert proc.wait(timeout=30) == -signal.SIGKILL


def test_a_timeout_kills_the_program() -> None:
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5)
    assert time.monotonic() - start < 30


def test_what_is_not_a_python_program_runs_under_subprocess() -> None:
    done = zygote.run(["true"], check=True)
    assert done.returncode == 0
    with pytest.raises(ValueError):
        zygote.Popen(["true"])
