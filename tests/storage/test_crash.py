"""Kill -9 a writer at random points: every acknowledged put is readable afterwards."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from keyshred import Keyshred
from tests import zygote
from tests.storage.conftest import make_config

WRITER = Path(__file__).with_name("crash_writer.py")


def test_acknowledged_puts_survive_sigkill(tmp_path: Path) -> None:
    data = tmp_path / "data"
    rng = random.Random(1234)
    acked: dict[tuple[str, str], bool] = {}
    for round_no in range(6):
        proc = zygote.Popen(
            [sys.executable, str(WRITER), str(data), str(round_no)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # Let it get going (past start-up), then kill it mid-stream.
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("ACK"), proc.stderr.read() if proc.stderr else ""
        time.sleep(rng.uniform(0.05, 0.8))
        os.kill(proc.pid, signal.SIGKILL)
        rest, err = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL, err
        for line in [first, *rest.splitlines()]:
            parts = line.split()
            if len(parts) == 3 and parts[0] == "ACK":
                acked[(parts[1], parts[2])] = True
    assert len(acked) > 50
    with Keyshred.open(data, make_config(None, flush_records=20)) as ks:
        for subject, key in acked:
            got = ks.memories.get(subject, ("crash",), key)
            assert got is not None, (subject, key)
            assert got.value == {"k": key}
        total = sum(ks.memories.count(f"crash-subject-{i}") for i in range(3))
        assert total >= len(acked)
