"""Issue #22 item 3: keyshred while its KEK service (OpenBao Transit) is down.

A real OpenBao server with storage on disk (``tests.servers.OpenBaoFileServer``) is
SIGKILLed and restarted: its transit keys survive, as a production server's do.

- A process opens while OpenBao is down. It serves what needs no key: the erasure
  requests and their status, guard checks by subject_ref, and an erasure up to and
  including crypto-erasure (suppression and destroying the keys need no KEK). What
  needs the KEK fails fast with ``KekCircuitOpen`` once the circuit is open, and the
  erasure stops retryably (never "completed", never verified by mistake); once
  OpenBao is back the same process serves everything, without a restart.
- Several worker processes of the shared profile (PostgreSQL catalog and key store,
  OpenBao, moto's S3) run a workload while OpenBao is killed and restarted, and a
  fresh process starts in the middle of the outage: every acknowledged write reads
  back, every error seen in between is a typed ``KekUnavailable`` with a clear
  message, and no process crashes.

Run as a script, this file is that worker (``python test_kek_outage.py FOLDER
CONFIG_JSON COMMAND ...``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402

from keyshred import Config, Keyshred  # noqa: E402
from keyshred.errors import (  # noqa: E402
    KekCircuitOpen,
    KekUnavailable,
    KeyshredError,
    SubjectSuppressed,
)
from tests import zygote  # noqa: E402
from tests.servers import OpenBaoFileServer, Server, openbao_file_server  # noqa: E402
from tests.storage.test_vectors import bag_of_words  # noqa: E402

NS = ("notes",)
PG = "postgres@127.0.0.1:5432/test"


# -- the worker (run as a script) ------------------------------------------------------


def _worker() -> None:
    """``write PREFIX STOPFILE``: new subjects ``PREFIX-<n>``, one memory each, until
    the stop file exists; ``ACK <subject>`` per acknowledged write, ``ERR <type>
    <message>`` per refused one. ``read-all SUBJECTS_JSON``: ``READ`` the subjects
    whose memory reads back. ``first-write SUBJECT``: opened while OpenBao is down,
    tries one write every 0.1 s until it is acknowledged."""
    folder, raw, command, *args = sys.argv[1:]
    config = Config.model_validate_json(raw)
    path = Path(folder)
    if (path / "keyshred.toml").exists():
        ks = Keyshred.open(path, config, embeddings=bag_of_words)
    else:
        ks = Keyshred.init(path, config, embeddings=bag_of_words)
    print("OPEN", flush=True)
    try:
        if command == "write":
            prefix, stop = args[0], Path(args[1])
            n = 0
            while not stop.exists():
                subject = f"{prefix}-{n}"
                try:
                    ks.memories.put(subject, NS, "k0", {"text": f"note of {subject}", "n": n})
                    got = ks.memories.get(subject, NS, "k0")  # read back in this process
                    assert got is not None and got.value["n"] == n
                    print(f"ACK {subject}", flush=True)
                    n += 1
                except KeyshredError as exc:
                    print(f"ERR {type(exc).__name__} {exc}", flush=True)
                    time.sleep(0.05)
        elif command == "first-write":
            subject = args[0]
            while True:
                try:
                    ks.memories.put(subject, NS, "k0", {"text": "first", "n": 0})
                    print(f"ACK {subject}", flush=True)
                    break
                except KeyshredError as exc:
                    print(f"ERR {type(exc).__name__} {exc}", flush=True)
                    time.sleep(0.1)
        elif command == "read-all":
            found = []
            for subject in json.loads(args[0]):
                m = ks.memories.get(subject, NS, "k0")
                if m is not None and m.value["text"] in (f"note of {subject}", "first"):
                    found.append(subject)
            print("READ " + json.dumps(found), flush=True)
        else:
            raise SystemExit(f"unknown command {command}")
    finally:
        ks.close()


if __name__ == "__main__":
    _worker()
    raise SystemExit(0)


# -- the tests -------------------------------------------------------------------------


@pytest.fixture
def bao(tmp_path: Path) -> Iterator[OpenBaoFileServer]:
    with openbao_file_server(tmp_path / "openbao") as server:
        yield server


def _vault_config(bao: OpenBaoFileServer, store_url: str | None = None, **extra: Any) -> Config:
    return Config.model_validate(
        {
            "kek": {
                "provider": "vault",
                "vault": {
                    "url": bao.url,
                    "key": f"ks-{uuid.uuid4().hex[:10]}",
                    "timeout_seconds": 5,
                },
            },
            # Small numbers so the test sees the circuit open without waiting long.
            "keyring": {
                "store_url": store_url,
                "kek_retries": 2,
                "kek_retry_max_seconds": 1.0,
                "kek_circuit_failures": 3,
                "kek_circuit_reset_seconds": 0.5,
            },
            **extra,
        }
    )


def _until(fn: Any, what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except KekUnavailable:
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: the KEK never came back") from None
            time.sleep(0.2)


def _resume(ks: Keyshred, request_id: str) -> Any:
    """Resume until the request no longer stops on the KEK (the circuit may still
    be open for its cool-down right after OpenBao is back)."""
    deadline = time.monotonic() + 60
    while True:
        req = ks.erasure.resume(request_id)
        if req.state != "retryable_failure" or "Kek" not in (req.error or ""):
            return req
        if time.monotonic() > deadline:
            raise AssertionError(f"the request kept failing on the KEK: {req.error}")
        time.sleep(0.2)


def test_a_process_opens_while_openbao_is_down_and_serves_what_needs_no_key(
    bao: OpenBaoFileServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VAULT_TOKEN", bao.token)
    config = _vault_config(bao)
    folder = tmp_path / "data"
    with Keyshred.init(folder, config, embeddings=bag_of_words) as ks:
        ks.memories.put("alice", NS, "k0", {"text": "alice likes kayaks"})
        ks.memories.put("bob", NS, "k0", {"text": "bob likes hiking"})
        alice, bob = ks.subject_ref("alice"), ks.subject_ref("bob")
        assert ks.keyring.store.for_subject(alice, None)
    bao.kill()

    ks = Keyshred.open(folder, config, embeddings=bag_of_words)  # OpenBao is down
    try:
        kek = ks._keyring.kek
        # What needs no key: the guard by subject_ref, the requests and their status.
        assert ks.catalog.check_guard(alice) >= 0
        assert ks.erasure.requests(subject_ref=alice) == []
        # What needs the KEK (the ref key, the epoch key) fails with a clear,
        # typed error; once the circuit is open, at once and saying so.
        errors: list[KekUnavailable] = []
        for _ in range(3):
            with pytest.raises(KekUnavailable) as info:
                ks.memories.get("bob", NS, "k0")
            errors.append(info.value)
        assert any(isinstance(e, KekCircuitOpen) for e in errors)
        opened = next(e for e in errors if isinstance(e, KekCircuitOpen))
        assert "KEK service (vault) is down" in str(opened) and "tried again at" in str(opened)
        assert all("alice" not in str(e) and "bob" not in str(e) for e in errors)
        assert kek.circuit_opened >= 1

        # An erasure by subject_ref runs up to crypto-erasure: suppression and
        # destroying the keys need no KEK. It stops retryably, never completed.
        req = ks.erasure.request(alice, None, requested_by="dpo", reason="art17")
        req = ks.erasure.run(req.request_id)
        assert req.state == "retryable_failure", req
        assert req.error is not None and "Kek" in req.error
        assert "destroy_keys" in req.steps_done
        assert ks.keyring.store.for_subject(alice, None) == []
        assert ks.catalog.check_guard(bob) >= 0
        with pytest.raises(SubjectSuppressed):
            ks.catalog.check_guard(alice)
        assert [r.state for r in ks.erasure.requests(subject_ref=alice)] == ["retryable_failure"]
        assert ks.erasure.status(req.request_id).state == "retryable_failure"

        bao.start()  # back, same keys: the same process is served again, no restart
        got = _until(lambda: ks.memories.get("bob", NS, "k0"), "read")
        assert got is not None and got.value == {"text": "bob likes hiking"}
        assert ks.subject_ref("bob") == bob
        done = _resume(ks, req.request_id)
        assert done.state == "completed", done
        assert ks.erasure.receipt(req.request_id) is not None
        with pytest.raises(SubjectSuppressed):
            ks.memories.get("alice", NS, "k0")
        assert kek.circuit.state == "closed"
    finally:
        ks.close()


def test_a_warm_process_erases_to_the_end_while_openbao_is_down(
    bao: OpenBaoFileServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that holds the live epoch key needs no provider call for a new
    subject, a read or a whole erasure (keys, verification, receipt): it keeps
    serving through the outage; counted, not assumed."""
    monkeypatch.setenv("VAULT_TOKEN", bao.token)
    ks = Keyshred.init(tmp_path / "data", _vault_config(bao), embeddings=bag_of_words)
    try:
        ks.memories.put("carol", NS, "k0", {"text": "carol PROBE-7Q"}, index=True)
        ks.memories.put("dan", NS, "k0", {"text": "dan likes rowing"}, index=True)
        kek = ks._keyring.kek
        bao.kill()
        kek.reset_counts()
        ks.memories.put("erin", NS, "k0", {"text": "erin is new"})
        assert ks.memories.get("dan", NS, "k0") is not None
        req = ks.erase("carol", requested_by="dpo", reason="art17", probes=["PROBE-7Q"])
        assert req.state == "completed", req
        assert ks.erasure.receipt(req.request_id) is not None
        assert kek.total_calls() == 0, kek.counts()
    finally:
        ks.close()


def test_an_outage_during_verify_fails_the_step_retryably(
    bao: OpenBaoFileServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Verification's "keys fail to unwrap" check asks the keyring for every key
    the erasure destroyed: a destroyed key is answered by its tombstone, with no
    KEK call (an erasure verifies while OpenBao is down). A key that survived
    (the fault the check exists for, planted here) does need the KEK: if OpenBao
    is down then, the step fails retryably; it is never taken for "fails to
    unwrap". Once OpenBao is back, the surviving key is found: manual review."""
    from keyshred.erasure import coordinator

    monkeypatch.setenv("VAULT_TOKEN", bao.token)
    ks = Keyshred.init(tmp_path / "data", _vault_config(bao), embeddings=bag_of_words)
    real = coordinator.verify
    planted: list[str] = []

    def verify_after_outage(w: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        if not planted:
            planted.append(ks._keyring.data_key(ks.subject_ref("dan"), "default").key_id.hex())
            req.doc["details"]["destroy_keys"]["key_ids"].append(planted[0])
            bao.kill()
            ks._keyring.cache.clear()  # as an eviction or another process's rotation
            ks._keyring.live.forget()
        return real(w, req, *args, **kwargs)

    monkeypatch.setattr(coordinator, "verify", verify_after_outage)
    try:
        ks.memories.put("carol", NS, "k0", {"text": "carol likes kayaks"})
        ks.memories.put("dan", NS, "k0", {"text": "dan likes rowing"})
        req = ks.erase("carol", requested_by="dpo", reason="art17")
        assert planted, "the verify step never ran"
        assert req.state == "retryable_failure", req
        assert (req.error or "").startswith("verify: Kek"), req.error
        assert "verify" not in req.steps_done and "destroy_keys" in req.steps_done
        assert ks.erasure.receipt(req.request_id) is None
        bao.start()
        done = _resume(ks, req.request_id)
        assert done.state == "manual_review", done
        assert "keys fail to unwrap" in (done.error or ""), done.error
    finally:
        if not bao.running:
            bao.start()
        ks.close()


def test_a_warm_process_verifies_an_erasure_with_no_kek_call(
    bao: OpenBaoFileServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same erasure without the planted key, OpenBao killed as verify starts
    and the key caches dropped: verification needs no KEK call and completes."""
    from keyshred.erasure import coordinator

    monkeypatch.setenv("VAULT_TOKEN", bao.token)
    ks = Keyshred.init(tmp_path / "data", _vault_config(bao), embeddings=bag_of_words)
    real = coordinator.verify
    calls: list[int] = []

    def verify_after_outage(*args: Any, **kwargs: Any) -> Any:
        bao.kill()
        ks._keyring.cache.clear()
        ks._keyring.live.forget()
        ks._keyring.kek.reset_counts()
        out = real(*args, **kwargs)
        calls.append(ks._keyring.kek.total_calls())
        return out

    monkeypatch.setattr(coordinator, "verify", verify_after_outage)
    try:
        ks.memories.put("carol", NS, "k0", {"text": "carol PROBE-7Q"}, index=True)
        req = ks.erase("carol", requested_by="dpo", reason="art17", probes=["PROBE-7Q"])
        assert calls == [0]
        assert req.state == "completed", req
    finally:
        bao.start()
        ks.close()


def test_a_cold_process_resuming_an_erasure_stops_where_the_kek_is_needed(
    bao: OpenBaoFileServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request resumed by a process that opened while OpenBao is down runs the
    steps that need no key and stops retryably at the first that signs (the
    backup tombstone journal needs the receipt key): never completed unverified."""
    from keyshred.erasure.requests import ExternalAnswer

    class Vendor:
        name = "crm"
        calls = 0

        def delete(self, subject_ref: str, scope: str | None) -> ExternalAnswer:
            Vendor.calls += 1
            if Vendor.calls == 1:
                raise OSError("vendor timeout")
            return ExternalAnswer(True, "ok")

    monkeypatch.setenv("VAULT_TOKEN", bao.token)
    folder = tmp_path / "data"
    config = _vault_config(bao)
    with Keyshred.init(folder, config, embeddings=bag_of_words) as ks:
        ks.memories.put("carol", NS, "k0", {"text": "carol PROBE-7Q"}, index=True)
        ks.erasure.register_processor(Vendor())
        req = ks.erase("carol", requested_by="dpo", reason="art17", probes=["PROBE-7Q"])
        assert req.state == "retryable_failure" and "external" in (req.error or "")
    bao.kill()
    ks = Keyshred.open(folder, config, embeddings=bag_of_words)
    try:
        ks.erasure.register_processor(Vendor())
        stopped = ks.erasure.resume(req.request_id)
        assert stopped.state == "retryable_failure", stopped
        assert (stopped.error or "").startswith("backups: Kek"), stopped.error
        assert "external" in stopped.steps_done and "verify" not in stopped.steps_done
        bao.start()
        done = _resume(ks, req.request_id)
        assert done.state == "completed", done
    finally:
        ks.close()


# -- several processes of the shared profile ----------------------------------------------


def _start(script_args: list[str]) -> zygote.Popen:
    return zygote.Popen(
        [sys.executable, str(Path(__file__).resolve()), *script_args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _acks(lines: list[str]) -> list[str]:
    return [x.split(" ", 1)[1] for x in lines if x.startswith("ACK ")]


def test_openbao_killed_and_restarted_during_a_shared_workload(
    bao: OpenBaoFileServer,
    moto: Server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import boto3

    from tests.conftest import pg_schema, pg_url

    monkeypatch.setenv("VAULT_TOKEN", bao.token)
    with pg_schema() as schema:
        bucket = f"ks-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=moto.url, region_name="us-east-1").create_bucket(
            Bucket=bucket
        )
        options = f"options=-csearch_path%3D{schema}"
        config = _vault_config(
            bao,
            f"postgresql://{PG}?{options}",
            profile="distributed",
            storage={
                "catalog_url": pg_url(schema),
                "uri": f"s3://{bucket}/parts",
                "flush_records": 20,
            },
            vectors={"uri": f"s3://{bucket}/vectors"},
            s3={"endpoint_url": moto.url, "region": "us-east-1"},
        )
        raw = config.model_dump_json()
        stop = tmp_path / "stop"
        procs: list[zygote.Popen] = []

        def worker(n: int, *args: str) -> zygote.Popen:
            proc = _start([str(tmp_path / f"w{n}"), raw, *args])
            procs.append(proc)
            return proc

        try:
            # The first worker makes the key store (ref key, live epoch) before the others.
            first = zygote.run(
                [sys.executable, __file__, str(tmp_path / "w0"), raw, "first-write", "w0-0"],
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            assert first.returncode == 0, first.stderr[-3000:]
            writers = [worker(i, "write", f"w{i}", str(stop)) for i in (1, 2, 3)]
            out: dict[int, list[str]] = {i: [] for i in range(len(writers))}
            # Each writer acknowledges writes before the outage.
            for i, proc in enumerate(writers):
                assert proc.stdout is not None
                while len(_acks(out[i])) < 5:
                    line = proc.stdout.readline()
                    assert line, proc.stderr.read() if proc.stderr else ""
                    out[i].append(line.strip())

            bao.kill()
            # A fresh process starts while OpenBao is down: it opens, and its first write
            # (a new subject: it needs the live epoch key, so the KEK) is refused with a
            # clear error until OpenBao is back, then acknowledged without a restart.
            late = worker(9, "first-write", "late-0")
            assert late.stdout is not None
            late_lines = [late.stdout.readline().strip() for _ in range(3)]
            assert late_lines[0] == "OPEN", late_lines
            assert all(x.startswith("ERR Kek") for x in late_lines[1:]), late_lines
            bao.start()
            late_out, late_err = late.communicate(timeout=300)
            late_lines += late_out.splitlines()
            assert late.returncode == 0, late_err[-3000:]
            assert _acks(late_lines) == ["late-0"]

            # The warm writers kept going through the outage (0 provider calls for a
            # new subject once the live epoch key is unwrapped); stop them.
            stop.touch()
            results = []
            for i, proc in enumerate(writers):
                rest, err = proc.communicate(timeout=300)
                assert proc.returncode == 0, err[-3000:]
                out[i] += rest.splitlines()
                results.append(out[i])
            lines = [x for r in results for x in r] + late_lines
            errors = [x for x in lines if x.startswith("ERR ")]
            for e in errors:  # typed, clear, and never a subject id
                kind, message = e.split(" ", 2)[1:]
                assert kind in {"KekUnavailable", "KekCircuitOpen"}, e
                assert "Vault/OpenBao" in message or "KEK service (vault) is down" in message, e
                assert "w1-" not in message and "late-" not in message, e
            acked = [s for r in results for s in _acks(r)] + ["w0-0", "late-0"]
            assert len(acked) >= 17

            reader = zygote.run(
                [sys.executable, __file__, str(tmp_path / "r"), raw, "read-all", json.dumps(acked)],
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
            assert reader.returncode == 0, reader.stderr[-3000:]
            (line,) = [x for x in reader.stdout.splitlines() if x.startswith("READ ")]
            assert sorted(json.loads(line.removeprefix("READ "))) == sorted(acked)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
