"""``keyshred drill --profile shared`` as a user runs it: a subprocess that starts
OpenBao and moto itself, uses the machine's PostgreSQL, erases through worker
processes and SIGKILLs one inside an erasure step.

Every process the drill starts (servers, workers, the holder) inherits its
environment, so a marker variable finds any of them left running afterwards."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from keyshred.receipts import load_receipt
from tests.conftest import PG_DSN

KEYSHRED = str(Path(sys.executable).parent / "keyshred")
# Cross-process eviction (issue #22 item 2) in this tree: every process's caches
# must then be empty after the erasures.
EVICTION = importlib.util.find_spec("keyshred.erasure.eviction") is not None
psycopg = pytest.importorskip("psycopg")

CHECKS = (
    "caches warm in the holder and the drill process",
    "a worker SIGKILLed inside an erasure step",
    "the request finished by another worker",
    "exactly one receipt and one erasure.completed",
    "every process's caches evicted",
    "erased keys no longer unwrap",
    "no object version left in the bucket",
    "catalog clean",
    "key and semantic search find nothing, mentions dropped",
    "tokens no longer resolve",
    "other subjects intact",
    "byte scan of every folder, log and catalog table",
    "residue scan (S3 versions, live catalog)",
    "audit chain verifies",
)


def _drill(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], str]:
    marker = uuid.uuid4().hex
    proc = subprocess.run(
        [KEYSHRED, "drill", "--profile", "shared", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "KEYSHRED_TEST_DRILL_MARK": marker},
        check=False,
    )
    return proc, marker


def _left_running(marker: str) -> list[int]:
    """Processes still running with the run's marker in their environment."""
    found = []
    needle = f"KEYSHRED_TEST_DRILL_MARK={marker}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _drill_schemas() -> set[str]:
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT schema_name FROM information_schema.schemata "
            "WHERE schema_name LIKE 'ks_drill_%'"
        ).fetchall()
    return {r[0] for r in rows}


def test_shared_drill_kills_a_worker_mid_erasure_and_every_check_passes(tmp_path: Path) -> None:
    schemas = _drill_schemas()
    proc, marker = _drill(
        tmp_path, "--json", "--workers", "3", "--subjects", "4", "--memories", "6",
        "--receipt-dir", str(tmp_path),
    )  # fmt: skip
    # Nothing of the run is left, whatever its checks found: no process, no schema.
    assert _left_running(marker) == []
    assert _drill_schemas() - schemas == set()  # others' drills may come and go meanwhile
    assert proc.stdout, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert set(CHECKS) <= set(checks)
    failed = {n: c["detail"] for n, c in checks.items() if not c["passed"]}
    if not EVICTION:
        # Without issue #22 item 2 only the erasing process evicts: the holder and
        # the drill process still hold the erased subjects' keys, rows and vectors.
        # The drill must say exactly that (and fail), and nothing else.
        assert list(failed) == ["every process's caches evicted"], failed
        assert "still holds" in failed["every process's caches evicted"]
        assert proc.returncode == 1
        pytest.xfail("cross-process eviction (keyshred.erasure.eviction) is not in this tree")
    assert not failed, failed
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report["passed"] is True
    # The kill happened inside the request, and someone else finished it.
    killed = checks["a worker SIGKILLed inside an erasure step"]["detail"]
    assert "SIGKILLed worker pid" in killed and "'destroy_keys'" in killed
    finished = checks["the request finished by another worker"]["detail"]
    assert "completed by worker pid(s)" in finished and "taken over" in finished
    assert "acknowledged the eviction" in checks["every process's caches evicted"]["detail"]
    receipt = Path(report["receipt_file"])
    assert receipt.parent == tmp_path and receipt.exists()
    assert load_receipt(receipt.read_text()).request_id == report["request_id"]


def test_shared_drill_stops_its_servers_when_postgres_is_unreachable(tmp_path: Path) -> None:
    """OpenBao and moto start before the database is tried: a refused connection
    exits 2 with one line naming the cause, and leaves no server running."""
    proc, marker = _drill(tmp_path, "--postgres-url", "postgresql+psycopg://postgres@127.0.0.1:1/x")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "PostgreSQL" in proc.stderr and "Traceback" not in proc.stderr
    assert _left_running(marker) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_shared_drill_leaves_no_process_or_schema(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """Ctrl-C (SIGINT) or SIGTERM while the workers run: every server, worker and
    the holder are stopped and the schema dropped before the drill exits."""
    schemas = _drill_schemas()
    marker = uuid.uuid4().hex
    proc = subprocess.Popen(
        # A workload long enough that the signal lands while the workers run: at 4
        # subjects of 2 memories the run was over (11 s in all) by the time a busy
        # machine's scan had seen every process, and the drill exited 0.
        [KEYSHRED, "drill", "--profile", "shared", "--json", "--subjects", "30", "--memories", "9"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
        env={**os.environ, "KEYSHRED_TEST_DRILL_MARK": marker},
    )
    try:
        # OpenBao, moto, the holder and 3 workers, besides the drill itself.
        deadline = time.monotonic() + 120
        while len(_left_running(marker)) < 7:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the drill's processes did not all start"
            time.sleep(0.2)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "Traceback" not in err.decode(), err.decode()[-3000:]
    assert _left_running(marker) == []
    assert _drill_schemas() - schemas == set()  # others' drills may come and go meanwhile
