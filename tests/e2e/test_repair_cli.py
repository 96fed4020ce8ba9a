"""``keyshred repair`` as an operator runs it, on partitions a SIGKILL and an older
version's crash left behind: a dry run reports, ``--apply`` reconciles what is safe,
``--forget-lost`` the rest; exit codes 0 (clean), 1 (found or left), 2 (bad input)."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from keyshred import Keyshred
from keyshred.storage import faults
from tests import zygote
from tests.e2e.test_cli import run
from tests.erasure_worker import BYSTANDER, OWNER, TARGET
from tests.storage.conftest import make_config
from tests.storage.test_crash_points import CAROL, WORKER, populate
from tests.storage.test_vectors import bag_of_words


class Crash(Exception):
    """Stands for a process dying at a fault point (in this process)."""


def crash_at(point: str) -> None:
    def hook(reached: str) -> None:
        if reached == point:
            raise Crash(point)

    faults.hook = hook


def repair(data: Path, *args: str) -> tuple[int, dict[str, Any]]:
    proc = run("repair", "--json", "--path", str(data), *args)
    assert proc.returncode in (0, 1), proc.stderr
    assert "@example.org" not in proc.stdout + proc.stderr  # subject ids never printed
    return proc.returncode, json.loads(proc.stdout)


def by_ref(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["subject_ref"]: p for p in report["partitions"]}


def test_repair_reports_then_reconciles(tmp_path: Path) -> None:
    data = tmp_path / "data"
    written, target_id = populate(data)
    # A delete killed right after it marked its assets: the row is still there.
    killed = zygote.run(
        [sys.executable, str(WORKER), "store", str(data), "delete", "delete.after_mark"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    with Keyshred.open(data, make_config(None), embeddings=bag_of_words) as ks:
        refs = {s: ks.subject_ref(s) for s in (OWNER, BYSTANDER, CAROL)}
        # An older version's crash mid-delete: the row gone, the catalog row live.
        lost = ks.memories.get(BYSTANDER, ("m",), "k2")
        assert lost is not None
        crash_at("delete.after_rewrite")
        try:
            with pytest.raises(Crash):
                ks.memories.delete(BYSTANDER, ("m",), "k2")
        finally:
            faults.hook = None
        ks.catalog.update_assets([lost.memory_id], status="live")
        # A put killed before its catalog write: a row the catalog does not know.
        unknown = ks.memories.get(CAROL, ("m",), "k0")
        assert unknown is not None
        ks.catalog.delete([unknown.memory_id])

    broken = run("get", BYSTANDER, "m", "k0", "--path", str(data))
    assert broken.returncode == 2 and "lacks 1 memories" in broken.stderr
    assert len(broken.stderr.splitlines()) == 1

    code, dry = repair(data)
    assert code == 1 and dry["ok"] is False and dry["applied"] is False
    found = by_ref(dry)
    assert target_id in found[refs[OWNER]]["pending_deletes"]
    assert found[refs[BYSTANDER]]["lost"] == [lost.memory_id]
    assert found[refs[CAROL]]["unregistered"] == [unknown.memory_id]
    text = run("repair", "--path", str(data))
    assert text.returncode == 1 and "--apply" in text.stdout
    assert f"{refs[BYSTANDER]}: found: 1 lost" in text.stdout
    assert run("get", BYSTANDER, "m", "k0", "--path", str(data)).returncode == 2  # dry run

    code, applied = repair(data, "--apply")
    assert code == 1 and applied["applied"] is True  # lost rows wait for --forget-lost
    assert [p["subject_ref"] for p in applied["partitions"] if not p["ok"]] == [refs[BYSTANDER]]

    code, single = repair(data, refs[BYSTANDER], "--apply", "--forget-lost")
    assert code == 0 and single["ok"] is True
    assert single["partitions"][0]["forgot_lost"] is True
    code, clean = repair(data)
    assert code == 0 and clean["ok"] is True
    assert all(not v for p in clean["partitions"] for v in p.values() if isinstance(v, list))

    with Keyshred.open(data, make_config(None), embeddings=bag_of_words) as ks:
        assert ks.memories.get(OWNER, *TARGET) is None  # the started delete was finished
        assert ks.catalog.asset(unknown.memory_id) is not None  # registered, not dropped
        for (subject, ns, key), value in written.items():
            if (subject, key) in ((OWNER, TARGET[1]), (BYSTANDER, "k2")):
                continue
            got = ks.memories.get(subject, ns, key)
            assert got is not None and got.value == value, (subject, key)
        events = [e for e in ks.audit.events() if e.event == "memory.repaired"]
        assert {e.subject_ref for e in events} == set(refs.values())
        assert ks.audit.verify() > 0
        # An erased subject is never read again, not even to repair it.
        assert ks.erase(CAROL, requested_by="dpo", reason="test").state == "completed"
    erased = run("repair", refs[CAROL], "--apply", "--path", str(data))
    assert erased.returncode == 2 and "erased" in erased.stderr
    bad = run("repair", "../../etc", "--path", str(data))
    assert bad.returncode == 2 and bad.stderr.startswith("keyshred: error:")
