"""The command line as a user runs it: subprocesses, JSON output, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

KEYSHRED = str(Path(sys.executable).parent / "keyshred")


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [KEYSHRED, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        check=False,
    )


def test_drill_passes_every_check(tmp_path: Path) -> None:
    proc = run("drill", "--json", "--path", str(tmp_path / "drill"), "--subjects", "3")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["passed"] is True
    assert len(report["checks"]) >= 8
    assert all(c["passed"] for c in report["checks"])


def test_drill_prints_a_table() -> None:
    proc = run("drill", "--subjects", "2", "--records", "3")
    assert proc.returncode == 0, proc.stderr
    assert "all checks passed" in proc.stdout
    assert "byte scan" in proc.stdout


def test_init_and_keys_commands(tmp_path: Path) -> None:
    data = tmp_path / "d"
    init = json.loads(run("init", str(data), "--json").stdout)
    assert init == {"path": str(data), "kek": "local", "kek_epoch": 1}
    status = json.loads(run("keys", "status", "--path", str(data), "--json").stdout)
    assert status["current_epoch"] == 1 and status["keys"] == 0
    rotated = json.loads(run("keys", "rotate-kek", "--path", str(data), "--json").stdout)
    assert rotated["new_epoch"] == 2
    gone = json.loads(
        run("keys", "destroy-epochs", "--before", "2", "--path", str(data), "--json").stdout
    )
    assert [d["epoch"] for d in gone["destroyed"]] == [1]
    status = json.loads(run("keys", "status", "--path", str(data), "--json").stdout)
    assert [e["epoch"] for e in status["epochs"]] == [2]


def test_user_errors_are_one_line_without_traceback(tmp_path: Path) -> None:
    for args in (
        ("keys", "status", "--path", str(tmp_path / "missing")),
        ("init", str(tmp_path / "x"), "--kek", "hsm"),
    ):
        proc = run(*args)
        assert proc.returncode == 2, proc
        assert "Traceback" not in proc.stderr
        assert proc.stderr.strip().count("\n") == 0
        assert proc.stderr.startswith("keyshred: error:")


def test_server_down_is_one_line(tmp_path: Path) -> None:
    proc = run(
        "init",
        str(tmp_path / "v"),
        "--kek",
        "vault",
        env={"VAULT_TOKEN": "x", "KEYSHRED_KEK__VAULT__URL": "http://127.0.0.1:9"},
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "cannot reach" in proc.stderr
