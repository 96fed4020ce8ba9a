"""The worked examples in ``examples/`` run as CI would run them, and do what they
say: the model never sees a personal value, users get theirs back, the erasure
completes with a receipt, and no file of the data folder holds a value in clear."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBES = ("ann.example7@example.com", "13812345678", "bo.example7@example.com")


def test_the_agent_example_runs_offline_and_leaks_nothing(tmp_path: Path) -> None:
    pytest.importorskip("langgraph", reason="the example needs keyshred[langgraph]")
    folder = tmp_path / "agent-data"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "agent_memory.py"), str(folder)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    seen = "\n".join(out["model_saw"])
    assert seen and not any(probe in seen for probe in PROBES)  # tokens only
    assert "<EMAIL_" in seen and "<PHONE_" in seen
    assert out["ann_got"] == "I will write to you at ann.example7@example.com."
    assert out["bo_still_has"] == "I will write to you at bo.example7@example.com."
    assert out["erasure"] == "completed"
    stores = {(store, action): count for store, action, count in out["receipt_stores"]}
    assert stores[("checkpoints", "threads-deleted")] == 1
    assert stores[("memories", "partition-dropped")] >= 1
    for path in folder.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            for probe in PROBES:
                assert probe.encode() not in data, path
