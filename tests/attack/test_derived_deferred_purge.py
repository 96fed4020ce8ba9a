"""Attacks on the derived step's drops (keyshred/erasure/derived.py), written by a
review of its first version, which deferred every drop's rewrite of the holder's
partition to one purge per holder at the step's end (best effort when the step
stopped on ``ProducerUnknown`` / ``RebuildFailed``). Now a readable row's drop (a
retention request destroys no key) rewrites at once; an opaque row's (its shared
key destroyed) waits for the end-of-step purge, which also runs, best effort and
keeping the step's own error, however the step fails. And the
``keyshred.rebuilders`` entry points, listed once per step.

Each test's docstring states the property and, for those that failed on the first
version, the defect."""

from __future__ import annotations

import errno
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from keyshred import Keyshred
from keyshred.storage import faults
from tests import zygote
from tests.scenarios import (
    PROBE,
    VICTIM,
    clean_rebuild,
    derive,
    expiring_probe_memory,
    install_rebuilder_package,
)
from tests.storage.conftest import make_config, parquet_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def ks(tmp_path: Path) -> Iterator[Keyshred]:
    """The embedded default (SQLite catalog), as tests/conftest.py's ``ks``: not the
    both-catalogs ``ks`` of tests/attack/conftest.py."""
    store = Keyshred.init(tmp_path / "data", make_config(None))
    yield store
    store.close()


def _derive(ks: Keyshred, holder: str, key: str, sources: list[str], **kw: Any) -> str:
    return str(derive(ks, holder, key, sources, **kw).memory_id)


def _retention_run(ks: Keyshred) -> dict[str, Any]:
    report = ks.retention.run(now=datetime.now(UTC) + timedelta(seconds=30))
    [req] = report.requests
    return req


def _request(ks: Keyshred, kind: str) -> tuple[str, str]:
    """Run a retention request for the victim's expired memory, an erasure of the
    victim's "default" scope, or of the whole victim: (state, request id)."""
    if kind == "retention":
        req = _retention_run(ks)
        return req["state"], req["request_id"]
    scope = "default" if kind == "scope" else None
    r = ks.erase(VICTIM, scope, requested_by="dpo", reason="art17")
    return r.state, r.request_id


def _hits(ks: Keyshred) -> list[Any]:
    """Every place the probe is found, raw or decrypted with a live key: Parquet
    segments, the catalog (hot records, vectors), LanceDB."""
    return list(ks.erasure.residue_scan([PROBE], [ks.path]).hits)


def _hits_of(ks: Keyshred, subject: str) -> list[Any]:
    """The hits in the subject's partition files."""
    prefix = f"subject={ks.memories._ref(subject)}/"
    return [h for h in _hits(ks) if prefix in h.path]


def _bob_drop_then_carol(
    ks: Keyshred,
    *,
    carol_rebuild: Any = clean_rebuild,
    carol_value: str = f"summary of {PROBE} text",
) -> tuple[str, str]:
    """The victim's expiring memory (the probe); Bob's digest made from it alone
    (dropped by its retention: no source remains); Carol's summary made from Bob's
    digest and her own memory (rebuilt from hers), acted on after Bob's digest
    (sources first). Returns (Bob's digest id, Carol's summary id)."""
    v = expiring_probe_memory(ks)
    d = _derive(ks, "bob", "d", [v], value=f"digest of {PROBE} text", producer="dg")
    ks.memories.put("bob", ("m",), "own", "bob's own text")
    own = ks.memories.put("carol", ("m",), "own", "carol text").memory_id
    c = _derive(
        ks,
        "carol",
        "sum",
        [d, own],
        value=carol_value,
        producer="sum",
        rebuild=carol_rebuild,
    )
    return d, c


def _failing_at(point: str, exc: BaseException) -> Any:
    def hook(reached: str) -> None:
        if reached == point:
            raise exc

    return hook


# -- a step that stops on any other failure -----------------------------------------------


def _fail_after_the_drop(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch, kind: str, flushed: bool
) -> tuple[list[Any], list[Any]]:
    """Bob's digest dropped, then every attempt fails on Carol's summary (disk
    full at its write) until the request waits in ``manual_review``. Returns the
    probe's hits while it is ``retryable_failure`` and once in ``manual_review``."""
    _bob_drop_then_carol(ks, carol_value="carol's summary of bob's digest")
    if flushed:
        ks.memories.flush()  # the digest in Bob's segment, as after any restart
    assert _hits(ks), "the probe is planted in Bob's files"
    monkeypatch.setattr(
        faults, "hook", _failing_at("put.after_log", OSError(errno.ENOSPC, "No space left"))
    )
    state, rid = _request(ks, kind)
    assert state == "retryable_failure"
    assert ks.memories.get("bob", ("s",), "d") is None  # dropped before the failure
    retrying = _hits(ks)
    for _ in range(8):  # the disk stays full: the request ends in manual_review
        state = ks.erasure.resume(rid).state
        if state == "manual_review":
            break
    assert state == "manual_review"
    assert ks.memories.get("bob", ("s",), "d") is None
    return retrying, _hits(ks)


@pytest.mark.parametrize("flushed", [True, False], ids=["segment", "hot-records"])
def test_a_retention_drop_leaves_the_holders_files_when_the_step_fails_after_it(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch, flushed: bool
) -> None:
    """Failed on the change's first version (module docstring). A retention request
    drops Bob's digest of the victim's expired memory (made from it alone), then the
    next asset fails (disk full while Carol's summary is rebuilt; equally any
    ``OSError``, ``SQLAlchemyError`` or ``KeyshredError`` other than ``ProducerUnknown``
    / ``RebuildFailed``: a KEK outage, a locked catalog, a corrupt bystander partition).
    The request is ``retryable_failure``; the failure persisting, it ends in
    ``manual_review`` ("too many attempts", which ``resume`` no longer runs). Bob's
    digest is gone for every read, yet its text stays decryptable with Bob's live key in
    Bob's Parquet segment (or, never flushed, in the catalog's hot records) all along:
    retention destroys no key, and no purge ever comes.

    Cause: the drop is ``delete_by_id(..., purge=False)``, and
    ``DerivedStore.erase`` purges the holders only at the step's end or on
    ``(ProducerUnknown, RebuildFailed)``; any other exception leaves ``rounds()``
    without ``_purge``. Before the change each drop compacted Bob's partition at
    once (``purge=True``), so nothing of it survived the failure."""
    retrying, waiting = _fail_after_the_drop(ks, monkeypatch, "retention", flushed)
    assert not (retrying or waiting), (
        "a dropped digest's text is decryptable while the request retries "
        f"({retrying}) and while it waits in manual_review ({waiting})"
    )


@pytest.mark.parametrize("kind", ["scope", "subject"])
@pytest.mark.parametrize("flushed", [True, False], ids=["segment", "hot-records"])
def test_an_erasure_drop_is_undecryptable_when_the_step_fails_after_it(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch, flushed: bool, kind: str
) -> None:
    """Holds on the change. The same failure after the drop in an erasure of the
    victim's scope or of the whole victim: the digest is sealed under a key the
    victim co-owns, destroyed before the derived step, so the unpurged bytes
    open with no live key. (The defect above is a retention request's.)"""
    retrying, waiting = _fail_after_the_drop(ks, monkeypatch, kind, flushed)
    assert not retrying and not waiting


def test_a_failed_best_effort_purge_keeps_the_wait_for_the_producer(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failed on the change's first version (module docstring). A retention request
    drops Bob's digest, then meets Carol's summary whose producer nobody registered: it
    must wait in ``manual_review`` for the producer (README: it completes on ``resume``
    once one is registered). The new best-effort purge of the holders acted on so far
    raises ``OSError`` (disk full writing Bob's compacted segment): the request is
    ``retryable_failure`` ("derived: OSError") instead, ``review`` is not set, every
    later attempt counts, and after ``MAX_ATTEMPTS`` it lands in ``manual_review`` "too
    many attempts", which ``resume`` no longer runs even after the producer is
    registered.

    Cause: ``DerivedStore._purge(best_effort=True)`` swallows only
    ``KeyshredError``; an ``OSError`` or ``SQLAlchemyError`` from the purge
    replaces the ``ProducerUnknown`` it runs under (``raise`` never reached)."""
    from keyshred.storage.memories import MemoryStore

    _bob_drop_then_carol(ks, carol_rebuild=None)
    ks.memories.flush()

    def full(self: Any, ref: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(MemoryStore, "purge_superseded", full)
    req = _retention_run(ks)
    assert req["state"] == "manual_review", (req["state"], req.get("error"))


# -- a kill between a drop and the purge ---------------------------------------------------

_KILLED_WORKER = """
import os, signal, sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from keyshred import Keyshred
from keyshred.storage import faults
from tests.storage.conftest import make_config
from tests.scenarios import clean_rebuild

data, point = Path(sys.argv[2]), sys.argv[3]
ks = Keyshred.open(data, make_config(None))
ks.derived.register_producer("sum", "1", clean_rebuild)
armed = []

def hook(reached):
    if reached == "erase.memories":
        armed.append(1)  # the derived step comes after the memories' own drop
    elif armed and reached == point:
        os.kill(os.getpid(), signal.SIGKILL)

faults.hook = hook
ks.retention.run(now=datetime.now(UTC) + timedelta(seconds=30))
print("finished without crashing")
"""


def _killed_retention(tmp_path: Path, point: str) -> Path:
    """Bob holds two digests made from the victim's expiring memory alone (both
    dropped) and his own memory; Carol a summary of Bob's first digest and her
    own memory (rebuilt). A worker runs the retention request and is SIGKILLed at
    ``point`` inside the derived step."""
    data = tmp_path / "data"
    with Keyshred.init(data, make_config(None)) as ks:
        d, _ = _bob_drop_then_carol(ks, carol_value="carol's summary of bob's digest")
        v = ks.catalog.asset(d).sources[0]  # type: ignore[union-attr]
        _derive(ks, "bob", "d2", [v], value=f"second digest of {PROBE} text", producer="dg")
    worker = tmp_path / "killed_worker.py"
    worker.write_text(_KILLED_WORKER)
    proc = zygote.run(
        [sys.executable, str(worker), str(ROOT), str(data), point],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr[-3000:]
    return data


KILL_POINTS = [
    "delete.after_mark",
    "delete.after_log",
    "delete.after_rewrite",
    "delete.after_vectors",
    "erase.derived",
    "derived.after_first_purge",
]


@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_kill_between_a_drop_and_the_purge_opens_and_resumes_clean(
    tmp_path: Path, point: str
) -> None:
    """Holds on the change. A retention request SIGKILLed inside the derived step
    (inside a drop that no longer compacts, after a drop recorded, or after the
    first holder's purge): the folder opens without ``IntegrityError``, the
    bystanders' own memories are intact, a drop that reached the log is not
    readable, and the resumed request completes with nothing of the dropped
    digests decryptable anywhere (the resumed step purges the holders its
    recorded drops and intents name)."""
    data = _killed_retention(tmp_path, point)
    with Keyshred.open(data, make_config(None)) as ks:
        ks.derived.register_producer("sum", "1", clean_rebuild)
        bob = ks.memories.get("bob", ("m",), "own")
        assert bob is not None and bob.value == "bob's own text"
        carol = ks.memories.get("carol", ("m",), "own")
        assert carol is not None and carol.value == "carol text"
        if point != "delete.after_mark":
            assert ks.memories.get("bob", ("s",), "d") is None
        if point != "delete.after_mark":
            values = [m.value for m in ks.memories.search("bob", ("s",))]
            assert f"digest of {PROBE} text" not in values
        [req] = ks.erasure.requests()
        assert req.state != "completed"
        done = ks.erasure.resume(req.request_id)
        assert done.state == "completed", done.error
        assert ks.memories.get("bob", ("s",), "d") is None
        assert ks.memories.get("bob", ("s",), "d2") is None
        summary = ks.memories.get("carol", ("s",), "sum")
        assert summary is not None and PROBE not in str(summary.value)
        assert all(r.clean for r in ks.memories.repair_all())
        hits = _hits(ks)
        assert not hits, f"dropped text decryptable after the resumed request completed: {hits}"


# -- reads between a drop and the purge ----------------------------------------------------

_READER = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from keyshred import Keyshred
from tests.storage.conftest import make_config

ks = Keyshred.open(Path(sys.argv[2]), make_config(None))

def reads():
    got = ks.memories.get("bob", ("s",), "d")
    return {
        "get": None if got is None else got.value,
        "search": [m.value for m in ks.memories.search("bob", ("s",))],
        "history": [h["value"] for h in ks.memories.history("bob", ("s",), "d")],
    }

print(json.dumps(reads()), flush=True)  # Bob's partition loaded, the digest cached
if sys.argv[3:] == ["once"]:
    ks.close()
    sys.exit(0)
sys.stdin.readline()
print(json.dumps(reads()), flush=True)
sys.stdin.readline()
ks.close()
"""


def test_no_read_returns_a_dropped_asset_before_the_purge(
    ks: Keyshred, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Holds on the change. Between Bob's digest's drop (logged, vectors and
    catalog rows gone, files not rewritten) and the step's purge, neither this
    process (get, search, history, export), nor another process that had Bob's
    partition loaded with the digest in its cache, nor a process opening the
    folder then returns the digest."""
    import json

    _bob_drop_then_carol(ks, carol_value="carol's summary of bob's digest")
    ks.memories.flush()
    worker = tmp_path / "reader.py"
    worker.write_text(_READER)
    reader = zygote.Popen(
        [sys.executable, str(worker), str(ROOT), str(ks.path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert reader.stdin is not None and reader.stdout is not None
    try:
        before = json.loads(reader.stdout.readline())
        assert before["get"] == f"digest of {PROBE} text"
        seen: list[Any] = []

        def hook(point: str) -> None:
            if point != "erase.derived" or seen:
                return
            got = ks.memories.get("bob", ("s",), "d")
            package = ks.open_export(
                (
                    ks.export("bob", tmp_path / "bob.ksx", passphrase="a long passphrase 123"),
                    (tmp_path / "bob.ksx").read_bytes(),
                )[1],
                passphrase="a long passphrase 123",
            )
            reader.stdin.write("\n")  # type: ignore[union-attr]
            reader.stdin.flush()  # type: ignore[union-attr]
            seen.append(
                {
                    "here": {
                        "get": None if got is None else got.value,
                        "search": [m.value for m in ks.memories.search("bob", ("s",))],
                        "history": [h["value"] for h in ks.memories.history("bob", ("s",), "d")],
                        "export": [m["value"] for m in package["memories.json"]],
                    },
                    "there": json.loads(reader.stdout.readline()),  # type: ignore[union-attr]
                    "fresh": json.loads(
                        zygote.run(
                            [sys.executable, str(worker), str(ROOT), str(ks.path), "once"],
                            capture_output=True,
                            text=True,
                            check=True,
                            cwd=ROOT,
                            timeout=120,
                        ).stdout
                    ),
                }
            )

        monkeypatch.setattr(faults, "hook", hook)
        assert _retention_run(ks)["state"] == "completed"
        reader.stdin.write("\n")
        reader.stdin.flush()
        assert reader.wait(timeout=120) == 0
    finally:
        if reader.poll() is None:
            reader.kill()
    [reads] = seen
    for where in ("here", "there", "fresh"):
        assert reads[where]["get"] is None, reads
        assert PROBE not in json.dumps(reads[where]), reads
    assert not _hits(ks)


# -- the entry points, listed once per step ------------------------------------------------


def test_an_entry_point_installed_after_the_step_listed_them_completes_the_resume(
    ks: Keyshred, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Holds on the change. One erasure rebuilds Bob's summary with an installed
    entry point ("epa:1": the step lists the entry points, without "epb:1"), then
    stops in ``manual_review`` on Carol's summary ("epb:1" installed nowhere).
    The package providing "epb:1" is installed into the same site folder while
    the request waits: the resumed request (a new step, a new listing) finds it
    and completes; nothing of the first listing is kept, not even its miss."""
    import importlib

    from keyshred.erasure import derived as derived_module

    monkeypatch.setattr(derived_module, "_registry", {})
    site = tmp_path / "site"
    site.mkdir()
    install_rebuilder_package(site, "ks_attack_epa", "epa:1")
    monkeypatch.syspath_prepend(str(site))
    v = ks.memories.put(VICTIM, ("m",), "k", f"{PROBE} text").memory_id
    for holder, producer in (("bob", "epa"), ("carol", "epb")):
        own = ks.memories.put(holder, ("m",), "own", f"{holder} text").memory_id
        _derive(ks, holder, "sum", [v, own], value=f"summary of {PROBE}", producer=producer)
    req = ks.erase(VICTIM, requested_by="dpo", reason="art17")
    assert req.state == "manual_review", req.error
    assert "epb" in str(req.error)
    install_rebuilder_package(site, "ks_attack_epb", "epb:1")
    importlib.invalidate_caches()  # as after any install into a running interpreter
    done = ks.erasure.resume(req.request_id)
    assert done.state == "completed", done.error
    for holder in ("bob", "carol"):
        got = ks.memories.get(holder, ("s",), "sum")
        assert got is not None and got.value == "1 sources left (entry point)"


def test_a_corrupt_bystander_partition_keeps_a_dropped_digest_on_disk_in_manual_review(
    tmp_path: Path,
) -> None:
    """Failed on the change's first version (module docstring). The same without any
    injected fault: Carol's partition has a damaged segment (bit rot; every load raises
    ``IntegrityError``). The retention request drops Bob's digest, then fails on Carol's
    summary at every attempt and ends in ``manual_review`` ("too many attempts"): Bob's
    dropped digest, gone for every read, stays decryptable in Bob's segment with Bob's
    live key for as long as Carol's partition is broken. Before the change the drop had
    compacted Bob's partition at once."""
    data = tmp_path / "data"
    # Carol's partition in a segment to damage (``parquet_config``).
    with Keyshred.init(data, parquet_config(None)) as ks:
        _bob_drop_then_carol(ks, carol_value="carol's summary of bob's digest")
        carol = ks.memories._ref("carol")
    [segment] = (data / "memories" / f"subject={carol}").glob("seg-*.parquet")
    raw = bytearray(segment.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    segment.write_bytes(bytes(raw))
    with Keyshred.open(data, parquet_config(None)) as ks:
        ks.derived.register_producer("sum", "1", clean_rebuild)
        state, rid = _request(ks, "retention")
        for _ in range(8):
            if state == "manual_review":
                break
            state = ks.erasure.resume(rid).state
        assert state == "manual_review"
        assert ks.memories.get("bob", ("s",), "d") is None
        hits = _hits_of(ks, "bob")
        assert not hits, f"Bob's dropped digest is decryptable in manual_review: {hits}"


def test_a_transient_failure_of_the_best_effort_purge_leaves_the_drop_on_disk_for_the_wait(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failed on the change's first version (module docstring). A retention request
    drops Bob's digest, then stops on Carol's summary (producer unknown). Its
    best-effort purge of Bob's partition meets a transient backend failure (a KEK outage
    while the compacted segment is written: ``BackendUnavailable``, a
    ``KeyshredError``), which is swallowed: the request settles in ``manual_review``
    waiting for a human, with no retry scheduled, and Bob's dropped digest stays
    decryptable in his segment for the whole wait (days, by the change's own comment).
    Before the change the drop's own compaction failing failed the step, which was
    retried.

    Cause: ``DerivedStore._purge(best_effort=True)`` drops ``KeyshredError``
    silently and nothing records that the purge still owes a rewrite."""
    from keyshred.errors import BackendUnavailable
    from keyshred.storage.memories import MemoryStore

    _bob_drop_then_carol(ks, carol_rebuild=None, carol_value="carol's summary of bob's digest")
    ks.memories.flush()
    purge = MemoryStore.purge_superseded
    bob = ks.memories._ref("bob")
    failures = [BackendUnavailable("KEK unreachable")]

    def flaky(self: Any, ref: str) -> None:
        if ref == bob and failures:
            raise failures.pop()
        purge(self, ref)

    monkeypatch.setattr(MemoryStore, "purge_superseded", flaky)
    req = _retention_run(ks)
    assert req["state"] == "manual_review"
    assert ks.memories.get("bob", ("s",), "d") is None
    hits = _hits_of(ks, "bob")
    assert not hits, f"Bob's dropped digest is decryptable during the wait: {hits}"


# -- a holder erased meanwhile -------------------------------------------------------------


@pytest.mark.parametrize("until", ["suppress", "destroy_keys", "drop_memories", None])
def test_a_holder_erased_between_the_drop_and_the_purge(
    ks: Keyshred, monkeypatch: pytest.MonkeyPatch, until: str | None
) -> None:
    """Holds on the change. Right after the retention request dropped Bob's
    digest (files not rewritten yet), Bob's own erasure starts and runs up to
    ``until`` (suppressed with keys live, keys destroyed, partition dropped) or to
    completion. The retention request still completes, and nothing of the
    dropped digest is decryptable in Bob's files (the purge of a suppressed
    holder with live keys still rewrites; one whose keys are gone holds nothing
    decryptable); Bob's erasure then completes too."""
    _bob_drop_then_carol(ks, carol_value="carol's summary of bob's digest")
    ks.memories.flush()
    bobs: list[str] = []
    steps: list[str] = []

    def hook(point: str) -> None:
        if point != "erase.derived" or bobs:
            return
        r = ks.erasure.submit("bob", requested_by="dpo", reason="art17")
        bobs.append(r.request_id)
        monkeypatch.setattr(ks.erasure, "on_step", lambda step, req: steps.append(step))
        stop = (lambda: until in steps) if until else None
        ks.erasure.run(r.request_id, stop=stop)
        monkeypatch.setattr(ks.erasure, "on_step", None)

    monkeypatch.setattr(faults, "hook", hook)
    req = _retention_run(ks)
    assert bobs, "the hook ran"
    assert req["state"] == "completed", req
    hits = _hits_of(ks, "bob")
    assert not hits, f"Bob's dropped digest is decryptable after the retention request: {hits}"
    bob_state = ks.erasure.status(bobs[0]).state
    assert (bob_state == "completed") == (until is None), (until, bob_state, steps)
    monkeypatch.setattr(faults, "hook", None)
    assert ks.erasure.resume(bobs[0]).state == "completed"
    assert not _hits(ks)
