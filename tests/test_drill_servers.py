"""How the drill starts and stops processes (keyshred.drill_servers): a signal while a
process is being started is held until the process is registered for stopping, and
stopping a group waits for every live process in it, not only its leader."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keyshred.drill_servers import signals_held, stop_process


def test_a_signal_inside_signals_held_is_delivered_after_it() -> None:
    reached = []
    with pytest.raises(KeyboardInterrupt), signals_held():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler would have run by now
        reached.append("end of the block")
    assert reached == ["end of the block"]


def test_signals_held_restores_the_handlers_in_place() -> None:
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with signals_held():
        pass
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_a_sigterm_inside_signals_held_goes_to_the_handler_that_was_in_place() -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            assert seen == []
        time.sleep(0.05)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _leader_with_child(tmp_path: Path, child: str) -> tuple[subprocess.Popen[bytes], int]:
    """A group leader that starts ``child`` (Python source) and sleeps; the leader and
    the child's pid, once the child runs its code."""
    pidfile = tmp_path / "child.pid"
    leader = (
        "import subprocess, sys, time\n"
        f"c = subprocess.Popen([sys.executable, '-c', {child!r}])\n"
        f"open({str(pidfile)!r}, 'w').write(str(c.pid))\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", leader], start_new_session=True)
    deadline = time.monotonic() + 30
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.3)  # the child's signal handler is installed
    return proc, int(pidfile.read_text())


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_stop_process_waits_for_a_child_that_outlives_its_leader(tmp_path: Path) -> None:
    """A leader that exits at once on SIGTERM, and its child that takes a second: the
    drill returned while such a child still ran (a CI run found one left)."""
    proc, child_pid = _leader_with_child(
        tmp_path,
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.0), sys.exit(0)))\n"
        "time.sleep(60)\n",
    )
    stop_process(proc, timeout=10)
    assert proc.poll() is not None
    assert not _alive(child_pid)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_stop_process_kills_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    proc, child_pid = _leader_with_child(
        tmp_path,
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n",
    )
    stop_process(proc, timeout=1)
    assert not _alive(child_pid)
