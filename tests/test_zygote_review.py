"""Where ``tests.zygote`` does not do what ``subprocess`` does (a review): each test
runs one program both ways and compares what a test would see."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests import zygote

PY = sys.executable


def _both(args: list[str], **kwargs: Any) -> tuple[Any, Any]:
    common: dict[str, Any] = {"capture_output": True, "text": True, "timeout": 60}
    common.update(kwargs)
    return subprocess.run(args, check=False, **common), zygote.run(args, **common)


def _same(real: Any, forked: Any) -> None:
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        real.returncode,
        real.stdout,
        real.stderr,
    )


def test_output_written_before_a_kill_survives_under_pythonunbuffered() -> None:
    # PYTHONUNBUFFERED=1 (set in this very environment) makes the interpreter's stdout
    # unbuffered: what a worker printed before it SIGKILLed itself reaches the test.
    code = "import os; print('acknowledged k1'); os.kill(os.getpid(), 9)"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    real, forked = _both([PY, "-c", code], env=env)
    assert real.stdout == "acknowledged k1\n"
    _same(real, forked)


def test_environment_read_at_interpreter_start_is_honoured(tmp_path: Path) -> None:
    (tmp_path / "helper_mod_xyz.py").write_text("VALUE = 'from PYTHONPATH'\n")
    code = "import time, helper_mod_xyz; print(helper_mod_xyz.VALUE, time.tzname)"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "TZ": "Asia/Tokyo"}
    real, forked = _both([PY, "-c", code], env=env, cwd="/")
    assert real.returncode == 0, real.stderr
    _same(real, forked)


def test_stdio_errors_and_newlines_as_the_interpreter_sets_them() -> None:
    code = (
        "import os, sys; print(os.fsdecode(b'caf\\xe9'));"
        " print(repr(sys.stdin.read()), sys.stdout.errors)"
    )
    real, forked = _both([PY, "-c", code], input=b"a\r\nb", text=False)
    assert real.stdout == b"caf\xe9\n'a\\r\\nb' surrogateescape\n"
    _same(real, forked)


def test_interpreter_finalization_runs(tmp_path: Path) -> None:
    # At exit the interpreter tears down __main__: finalizers run, an unclosed
    # file's buffer is written. A program forked and ended by os._exit does neither.
    code = (
        "import sys\n"
        "class Noisy:\n"
        "    def __del__(self): print('finalized', file=sys.stderr)\n"
        "n = Noisy()\n"
        "f = open(sys.argv[1], 'w'); f.write('buffered')\n"
    )
    for how in ("real", "forked"):
        out = tmp_path / how
        run = subprocess.run if how == "real" else zygote.run
        done = run([PY, "-c", code, str(out)], capture_output=True, text=True, timeout=60)
        assert (how, done.returncode, done.stderr, out.read_text()) == (
            how,
            0,
            "finalized\n",
            "buffered",
        )


def test_a_program_that_closes_its_stdout_exits_0() -> None:
    _same(*_both([PY, "-c", "import sys; print('x'); sys.stdout.close()"]))


def test_an_uncaught_keyboard_interrupt_is_the_signal() -> None:
    real, forked = _both([PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGINT)"])
    assert real.returncode == -signal.SIGINT
    _same(real, forked)


def test_the_programs_excepthook_prints_its_uncaught_exception() -> None:
    code = "import sys; sys.excepthook = lambda *a: print('hooked', file=sys.stderr); 1/0"
    _same(*_both([PY, "-c", code]))


def test_main_stays_the_script_for_threads_and_atexit(tmp_path: Path) -> None:
    script = tmp_path / "prog.py"
    script.write_text(
        "import atexit, threading, time\n"
        "X = 'main module'\n"
        "def late():\n"
        "    import __main__\n"
        "    print('atexit', getattr(__main__, 'X', None))\n"
        "atexit.register(late)\n"
        "def later():\n"
        "    time.sleep(0.2)\n"
        "    import __main__\n"
        "    print('thread', getattr(__main__, 'X', None))\n"
        "threading.Thread(target=later).start()\n"
    )
    real, forked = _both([PY, str(script)])
    assert real.stdout == "thread main module\natexit main module\n"
    _same(real, forked)


@pytest.mark.parametrize("how", ["real", "forked"])
def test_a_dead_program_is_a_zombie_until_the_test_waits(how: str) -> None:
    # keyshred.leases.dead_here asks os.kill(pid, 0): a worker the test killed but
    # has not waited for is still "alive" under subprocess (a zombie); the zygote's
    # supervisor reaps it at once, so a lease takeover a test expects to happen only
    # after wait() (or never) happens early.
    popen = subprocess.Popen if how == "real" else zygote.Popen
    proc = popen([PY, "-c", "import os; os.kill(os.getpid(), 9)"])
    time.sleep(1.0)
    os.kill(proc.pid, 0)  # still there: ProcessLookupError under the zygote
    assert proc.wait(timeout=30) == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)


@pytest.mark.parametrize("how", ["real", "forked"])
def test_communicate_again_after_a_timeout_returns_all_output(how: str) -> None:
    # The pattern subprocess documents: on TimeoutExpired, kill and communicate again.
    popen = subprocess.Popen if how == "real" else zygote.Popen
    code = "import time; print('early', flush=True); time.sleep(1.5); print('late')"
    proc = popen([PY, "-c", code], stdout=subprocess.PIPE, text=True)
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        proc.communicate(timeout=0.5)
    assert timed_out.value.stdout == b"early\n"
    out, _ = proc.communicate(timeout=30)
    assert (out, proc.returncode) == ("early\nlate\n", 0)


@pytest.mark.parametrize("how", ["real", "forked"])
def test_a_timeout_is_on_time_when_a_grandchild_holds_the_pipe(how: str) -> None:
    run = subprocess.run if how == "real" else zygote.run
    code = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(15)'])\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    caught: list[BaseException] = []

    def go() -> None:
        try:
            run([PY, "-c", code], capture_output=True, timeout=1)
        except BaseException as exc:  # noqa: BLE001
            caught.append(exc)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(20)
    assert caught and isinstance(caught[0], subprocess.TimeoutExpired)
    assert time.monotonic() - start < 8  # the zygote's run hangs until the grandchild ends
