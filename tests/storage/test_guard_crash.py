"""The guard cache cannot serve a suppressed subject after a crash: a process that
is SIGKILLed right after its suppression committed, before it told the other
processes, still leaves every other process refusing the subject's reads and
writes, though they held its ACTIVE guard in their cache."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from keyshred import Keyshred
from keyshred.errors import SubjectSuppressed
from keyshred.storage.catalog import ACTIVE
from tests import zygote
from tests.storage.conftest import make_config

WORKER = Path(__file__).with_name("guard_crash_worker.py")


def test_killed_between_commit_and_notice(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with Keyshred.init(data, make_config(None)) as ks:
        ks.memories.put("ana", ("m",), "k", {"n": 1})
        ks.memories.put("bob", ("m",), "k", {"n": 2})
        assert ks.memories.get("ana", ("m",), "k") is not None
        # The premise: this process serves ana's guard from its cache.
        cached = ks.catalog._guards.get(ks.subject_ref("ana"))
        assert cached is not None and cached[1].status == ACTIVE

        proc = zygote.run(
            [sys.executable, str(WORKER), str(data), "ana"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == -9, proc.stdout + proc.stderr[-2000:]

        with pytest.raises(SubjectSuppressed):
            ks.memories.get("ana", ("m",), "k")
        with pytest.raises(SubjectSuppressed):
            ks.memories.put("ana", ("m",), "k2", {"n": 3})
        got = ks.memories.get("bob", ("m",), "k")
        assert got is not None and got.value == {"n": 2}

    # A process opened afterwards refuses too, and guards settle: caching resumes.
    with Keyshred.open(data, make_config(None)) as ks:
        with pytest.raises(SubjectSuppressed):
            ks.memories.get("ana", ("m",), "k")
        assert ks.memories.get("bob", ("m",), "k") is not None
        assert ks.catalog._guards.get(ks.subject_ref("bob")) is not None
