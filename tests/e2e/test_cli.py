"""The command line as a user runs it: subprocesses, JSON output, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

from tests import zygote

KEYSHRED = str(Path(sys.executable).parent / "keyshred")


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return zygote.run(
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
    assert report["passed"] is True, report
    assert len(report["checks"]) >= 14
    assert all(c["passed"] for c in report["checks"])
    receipt = Path(report["receipt_file"])
    assert receipt.exists()
    ok = run("receipt", "verify", str(receipt), "--path", str(tmp_path / "drill"), "--json")
    assert json.loads(ok.stdout)["valid"] is True


def test_drill_prints_a_table_and_keeps_the_receipt(tmp_path: Path) -> None:
    proc = run("drill", "--subjects", "3", "--memories", "3", "--receipt-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "all checks passed" in proc.stdout
    assert "byte scan" in proc.stdout
    (receipt,) = tmp_path.glob("keyshred-drill-receipt-*.jws")
    unpinned = run("receipt", "verify", str(receipt), "--json")  # no key to trust
    assert unpinned.returncode == 2 and "--public-key" in unpinned.stderr


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
    live = status["live"]
    assert live["epoch"] == 2 and live["overdue"] is False
    assert datetime.fromisoformat(live["due_at"]) - datetime.fromisoformat(
        live["created_at"]
    ) == timedelta(minutes=60)
    # A live epoch older than its period is flagged until 'keyshred maintain' runs.
    soon = {"KEYSHRED_KEYRING__LIVE_ROTATE_MINUTES": "0.0001"}
    text = run("keys", "status", "--path", str(data), env=soon)
    assert "OVERDUE" in text.stdout, text.stdout
    maintained = json.loads(run("maintain", "--path", str(data), "--json", env=soon).stdout)
    assert maintained["rotated_to"] == 3 and [d["epoch"] for d in maintained["destroyed"]] == [2]


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


def test_erasure_commands(tmp_path: Path) -> None:
    data = tmp_path / "d"
    run("init", str(data))
    code = (
        "import sys; from keyshred import Keyshred\n"
        "with Keyshred.open(sys.argv[1]) as ks:\n"
        "    ks.memories.put('cli-subject@example.org', ('m',), 'k', {'v': 'x'})\n"
    )
    zygote.run([sys.executable, "-c", code, str(data)], check=True)
    out = run(
        "erase",
        "cli-subject@example.org",
        "--requested-by",
        "dpo",
        "--reason",
        "gdpr-art17",
        "--request-id",
        "r1",
        "--path",
        str(data),
        "--json",
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["state"] == "completed" and "cli-subject" not in out.stdout
    status = json.loads(run("status", "r1", "--path", str(data), "--json").stdout)
    assert status["state"] == "completed" and "receipt" in status["steps_done"]
    assert json.loads(run("resume", "r1", "--path", str(data), "--json").stdout)["state"] == (
        "completed"
    )
    receipt = run("receipt", "show", "r1", "--path", str(data))
    assert receipt.returncode == 0
    file = tmp_path / "receipt.jws"
    file.write_text(receipt.stdout)
    key = json.loads(run("keys", "public-key", "--path", str(data), "--json").stdout)
    ok = run("receipt", "verify", str(file), "--public-key", key["public_key"], "--json")
    assert json.loads(ok.stdout)["valid"] is True
    head, payload, signature = receipt.stdout.strip().split(".")
    edited = payload[:10] + ("A" if payload[10] != "A" else "B") + payload[11:]
    file.write_text(f"{head}.{edited}.{signature}")
    bad = run("receipt", "verify", str(file), "--path", str(data))
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    audit = json.loads(run("audit", "verify", "--path", str(data), "--json").stdout)
    assert audit["valid"] is True and audit["events"] > 5
    shown = run("metrics", "--path", str(data)).stdout  # read from the store (issue 24)
    assert 'keyshred_erasure_requests_current{state="completed"}' in shown
    unknown = run("status", "nope", "--path", str(data))
    assert unknown.returncode == 2 and unknown.stderr.startswith("keyshred: error:")


def test_backup_commands(tmp_path: Path) -> None:
    from keyshred import Keyshred

    data = tmp_path / "d"
    run("init", str(data))
    with Keyshred.open(data) as ks:
        # More than a compaction keeps in the catalog: the close writes a segment,
        # an object for the restore to download.
        for i in range(40):
            ks.memories.put("olga", ("notes",), f"k{i}", {"n": i}, index=False)
    created = run("backup", "create", "--path", str(data), "--json")
    assert created.returncode == 0, created.stderr
    gen = json.loads(created.stdout)
    assert gen["subjects"] == 1 and gen["retention_class"] == "daily"
    listed = json.loads(run("backup", "list", "--path", str(data), "--json").stdout)
    assert [g["generation"] for g in listed["generations"]] == [gen["generation"]]
    shown = run(
        "backup", "restore", gen["generation"], "--into", str(tmp_path / "r"), "--path", str(data)
    )
    assert shown.returncode == 0, shown.stderr
    assert "restore: download" in shown.stderr  # the progress bar
    assert "1 subjects and 40 memories verified" in " ".join(shown.stdout.split())
    again = run(
        "backup", "restore", gen["generation"], "--into", str(tmp_path / "r"), "--path", str(data)
    )
    assert again.returncode == 2 and "not empty" in again.stderr
    assert "Traceback" not in again.stderr
    missing = run("backup", "restore", "nope", "--into", str(tmp_path / "x"), "--path", str(data))
    assert missing.returncode == 2 and "no backup generation nope" in missing.stderr
    pruned = json.loads(run("backup", "prune", "--path", str(data), "--json").stdout)
    assert pruned == {"pruned": []}
    maintained = json.loads(run("backup", "maintain", "--path", str(data), "--json").stdout)
    assert maintained["rotated_to"] is None and maintained["destroyed"] == []


def test_memory_and_consent_commands(tmp_path: Path) -> None:
    data = tmp_path / "d"
    (tmp_path / "d").mkdir()
    (data / "keyshred.toml").write_text(
        '[scopes."support/health"]\npurpose = "support"\ncategories = ["health"]\n'
    )
    init = run("init", str(data), "--json")
    assert init.returncode == 0, init.stderr
    subject = "cli-user-7"
    put = run(
        "put", subject, "notes/2026", "k1", '{"text": "likes tea"}', "--path", str(data), "--json"
    )
    assert put.returncode == 0, put.stderr
    assert json.loads(put.stdout)["namespace"] == ["notes", "2026"]
    got = json.loads(run("get", subject, "notes/2026", "k1", "--path", str(data), "--json").stdout)
    assert got["value"] == {"text": "likes tea"}
    found = json.loads(run("search", subject, "notes", "--path", str(data), "--json").stdout)
    assert [r["key"] for r in found["results"]] == ["k1"]
    missing = run("get", subject, "notes", "nope", "--path", str(data))
    assert missing.returncode == 2 and missing.stderr.startswith("keyshred: error: no memory")
    assert "nope" not in missing.stderr  # namespaces and keys are personal data too
    stranger = run("get", "unknown-subject", "notes", "k1", "--path", str(data))
    assert stranger.returncode == 2 and stranger.stderr.startswith("keyshred: error: no memory")
    assert "unknown-subject" not in stranger.stderr  # the subject id is never printed back
    refused = run(
        "put",
        subject,
        "h",
        "k",
        '"asthma"',
        "--scope",
        "support/health",
        "--category",
        "health",
        "--path",
        str(data),
    )
    assert refused.returncode == 2 and "consent" in refused.stderr
    granted = run(
        "consent",
        "grant",
        subject,
        "--scope",
        "support/health",
        "--category",
        "health",
        "--days",
        "30",
        "--path",
        str(data),
        "--json",
    )
    assert json.loads(granted.stdout)["status"] == "active"
    ok = run(
        "put",
        subject,
        "h",
        "k",
        '"asthma"',
        "--scope",
        "support/health",
        "--category",
        "health",
        "--path",
        str(data),
        "--json",
    )
    assert ok.returncode == 0, ok.stderr
    listed = json.loads(run("consent", "list", subject, "--path", str(data), "--json").stdout)
    assert [c["purpose"] for c in listed["consents"]] == ["support"]
    revoked = run(
        "consent",
        "revoke",
        subject,
        "--scope",
        "support/health",
        "--category",
        "health",
        "--path",
        str(data),
        "--json",
    )
    assert json.loads(revoked.stdout) == {"revoked": 1}
    bad_json = run("put", subject, "n", "k", "not json", "--path", str(data))
    assert bad_json.returncode == 2 and "not JSON" in bad_json.stderr
    for proc in (missing, refused, bad_json):
        assert "Traceback" not in proc.stderr and proc.stderr.strip().count("\n") == 0


def test_every_command_has_help() -> None:
    from typer.testing import CliRunner

    from keyshred.cli import app

    runner = CliRunner()
    for args in (
        (),
        ("init",),
        ("drill",),
        ("put",),
        ("get",),
        ("search",),
        ("erase",),
        ("status",),
        ("resume",),
        ("receipt", "show"),
        ("receipt", "verify"),
        ("audit", "verify"),
        ("backup", "create"),
        ("backup", "list"),
        ("backup", "restore"),
        ("backup", "prune"),
        ("backup", "maintain"),
        ("keys", "rotate-kek"),
        ("keys", "destroy-epochs"),
        ("consent", "grant"),
        ("consent", "revoke"),
        ("consent", "list"),
        ("metrics",),
        ("serve",),
    ):
        # In process (the help of 23 commands; the program itself is run above and
        # below): a subprocess each cost 20 s of the suite.
        result = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "120"})
        assert result.exit_code == 0, (args, result.output)
        assert "Usage" in result.output
        # Real metavars (SUBJECT, TEXT, PATH), not placeholders like {subject}, <str>
        # or <bool> (typer 0.27+ prints those: the dependency is pinned below it).
        for placeholder in ("<str>", "<bool>", "<path>", "{subject}", "{path}"):
            assert placeholder not in result.output, (args, placeholder)
    put = run("put", "--help").stdout
    assert "SUBJECT NAMESPACE KEY VALUE" in put and "PATH" in put


def test_lifecycle_commands(tmp_path: Path) -> None:
    data = tmp_path / "d"
    run("init", str(data))
    subject = "cli-user-9"
    run("put", subject, "notes", "k", '{"v": 1}', "--path", str(data))
    shown = json.loads(run("retention", "show", "--path", str(data), "--json").stdout)
    assert set(shown) >= {"memories", "vectors", "tokens", "checkpoints", "audit", "backups"}
    ran = json.loads(run("retention", "run", "--path", str(data), "--json").stdout)
    assert ran["expired_memories"] == 0
    out_file = tmp_path / "export.ksx"
    exported = run(
        "export",
        subject,
        "--out",
        str(out_file),
        "--passphrase-env",
        "KS_EXPORT_PASS",
        "--path",
        str(data),
        "--json",
        env={"KS_EXPORT_PASS": "a long enough passphrase"},
    )
    assert exported.returncode == 0, exported.stderr
    assert json.loads(exported.stdout)["counts"]["memories"] == 1
    again = run(
        "export",
        subject,
        "--out",
        str(out_file),
        "--passphrase-env",
        "KS_EXPORT_PASS",
        "--path",
        str(data),
        env={"KS_EXPORT_PASS": "a long enough passphrase"},
    )
    assert again.returncode == 2 and "exists" in again.stderr and "Traceback" not in again.stderr
    unset = run(
        "export",
        subject,
        "--out",
        str(tmp_path / "x.ksx"),
        "--passphrase-env",
        "NOPE_UNSET",
        "--path",
        str(data),
    )
    assert unset.returncode == 2 and "NOPE_UNSET" in unset.stderr


def test_receipt_verify_pins_the_signing_key(tmp_path: Path) -> None:
    """An edited receipt re-signed with a fresh key (its own key embedded) fails
    against the store's key, a pinned key and a key file; no trusted key: refused."""
    from keyshred import Keyshred
    from keyshred.keyring import _primitives as prim
    from keyshred.keyring.keyring import Signer
    from keyshred.receipts import load_receipt, sign_receipt

    data = tmp_path / "d"
    run("init", str(data))
    with Keyshred.open(data) as ks:
        ks.memories.put("pin-subject", ("m",), "k", {"v": "x"})
        ks.erase("pin-subject", requested_by="dpo", reason="gdpr-art17", request_id="r1")
        receipt = ks.erasure.receipt("r1")
    assert receipt is not None
    genuine, forged = tmp_path / "genuine.jws", tmp_path / "forged.jws"
    genuine.write_text(receipt.serialize())
    edited = load_receipt(receipt.serialize()).model_copy(update={"requested_by": "nobody"})
    fresh = Signer(prim.ed25519_private_bytes(prim.ed25519_generate()))
    forged.write_text(sign_receipt(edited, fresh).serialize())
    key = json.loads(run("keys", "public-key", "--path", str(data), "--json").stdout)
    key_file = tmp_path / "signer.pub"
    key_file.write_text(key["public_key"] + "\n")
    pins = (
        ("--path", str(data)),
        ("--public-key", key["public_key"]),
        ("--public-key-file", str(key_file)),
    )
    for pin in pins:
        ok = run("receipt", "verify", str(genuine), *pin, "--json")
        assert ok.returncode == 0 and json.loads(ok.stdout)["valid"] is True, ok.stderr
        bad = run("receipt", "verify", str(forged), *pin, "--json")
        assert bad.returncode == 1, (pin, bad.stdout, bad.stderr)
        assert json.loads(bad.stdout)["valid"] is False
    unpinned = run("receipt", "verify", str(forged))
    assert unpinned.returncode == 2 and "--public-key" in unpinned.stderr
    assert unpinned.stderr.startswith("keyshred: error:") and "Traceback" not in unpinned.stderr


def test_init_never_overrides_the_configured_kek_provider(tmp_path: Path) -> None:
    """keyshred.toml says vault: init without --kek uses vault (here unreachable, so
    it says so), and a contradicting --kek is refused before anything is created."""
    data = tmp_path / "d"
    data.mkdir()
    (data / "keyshred.toml").write_text(
        'tenant = "acme"\n\n[kek]\nprovider = "vault"\n\n[kek.vault]\nurl = "http://127.0.0.1:9"\n'
    )
    env = {"VAULT_TOKEN": "x"}
    implicit = run("init", str(data), env=env)
    assert implicit.returncode == 2 and "cannot reach Vault" in implicit.stderr, implicit
    for args in (("--kek", "local"), ("--tenant", "other")):
        conflict = run("init", str(data), *args, env=env)
        assert conflict.returncode == 2, conflict
        assert "contradicts" in conflict.stderr and "Traceback" not in conflict.stderr
        assert not (data / "keys" / "kek.local.json").exists()
    # URLs too, and a URL's password is never echoed.
    urls = tmp_path / "u"
    urls.mkdir()
    (urls / "keyshred.toml").write_text(
        '[storage]\ncatalog_url = "postgresql+psycopg://ks:s3cret-pw@127.0.0.1:9/ks"\n\n'
        '[backup]\ntarget = "s3://bucket/prod"\n'
    )
    for args in (
        ("--catalog-url", "sqlite:///elsewhere.db"),
        ("--backup-target", str(tmp_path / "b")),
    ):
        conflict = run("init", str(urls), *args)
        assert conflict.returncode == 2 and "contradicts" in conflict.stderr, conflict
        assert "s3cret-pw" not in conflict.stderr + conflict.stdout
        assert not (urls / "keys").exists()
    plain = tmp_path / "p"
    made = json.loads(run("init", str(plain), "--kek", "local", "--json").stdout)
    assert made["kek"] == "local"
    assert 'tenant = "default"' in (plain / "keyshred.toml").read_text()


def test_version_metrics_json_and_no_data_found(tmp_path: Path) -> None:
    version = run("--version")
    assert version.returncode == 0 and version.stdout.startswith("keyshred ")
    data = tmp_path / "d"
    run("init", str(data))
    erased = run(
        "erase", "never-stored", "--requested-by", "dpo", "--reason", "r", "--path", str(data)
    )
    assert erased.returncode == 0 and "no data found" in erased.stdout, erased
    assert "stays free" in erased.stdout
    blocked = run(
        "erase", "also-never", "--requested-by", "dpo", "--reason", "r", "--block",
        "--path", str(data),
    )  # fmt: skip
    assert blocked.returncode == 0 and "stays erased" in blocked.stdout, blocked
    doc = json.loads(
        run("status", erased.stdout.split()[1].rstrip(":"), "--path", str(data), "--json").stdout
    )
    assert doc["found_data"] is False and doc["state"] == "completed"
    shown = run("receipt", "show", doc["request_id"], "--path", str(data), "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["receipt"]["found_data"] is False
    samples = json.loads(run("metrics", "--path", str(data), "--json").stdout)["samples"]
    assert all({"name", "labels", "value"} <= set(s) for s in samples) and samples
    # Issue 24 item 6: read from the store, not a fresh process's zero counters.
    by_name = {(s["name"], tuple(sorted(s["labels"].items()))): s["value"] for s in samples}
    assert by_name[("keyshred_erasure_requests_current", (("state", "completed"),))] == 2
    assert by_name[("keyshred_erasure_completion_seconds_count", ())] == 2
    assert by_name[("keyshred_audit_events_total", (("event", "erasure.completed"),))] == 2
    text = run("metrics", "--path", str(data)).stdout
    assert "never-stored" not in text and "also-never" not in text  # no subject ids


def test_destroying_live_epochs_leaves_backups_restorable(tmp_path: Path) -> None:
    """A generation's key store is under its own archive epoch: destroying the live
    epoch it was made under needs no force and the generation still restores."""
    data = tmp_path / "d"
    run("init", str(data))
    gen = json.loads(run("backup", "create", "--path", str(data), "--json").stdout)
    assert gen["kek_lineage"] == "archive"
    run("keys", "rotate-kek", "--path", str(data))
    done = run("keys", "destroy-epochs", "--before", "2", "--path", str(data), "--json")
    assert [d["epoch"] for d in json.loads(done.stdout)["destroyed"]] == [1], done.stderr
    status = json.loads(run("keys", "status", "--path", str(data), "--json").stdout)
    assert [e["epoch"] for e in status["epochs"]] == [2]
    restored = run(
        "backup", "restore", gen["generation"], "--into", str(tmp_path / "r"), "--path", str(data)
    )
    assert restored.returncode == 0, restored.stderr


def _one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("keyshred: error: "), done.stderr
    return lines[0]


def test_init_where_no_folder_can_be_is_one_line(tmp_path: Path) -> None:
    assert "/proc/nope" in _one_line_error(run("init", "/proc/nope"))
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    _one_line_error(run("init", str(a_file)))
    assert a_file.read_text() == "not a folder"


def test_backup_to_a_target_that_cannot_be_is_one_line(tmp_path: Path) -> None:
    data = tmp_path / "data"
    assert run("init", str(data)).returncode == 0
    line = _one_line_error(run("backup", "create", "--path", str(data), "--target", "/proc/nope"))
    assert "/proc/nope" in line
    assert run("backup", "list", "--path", str(data), "--json").returncode == 0


def test_outside_a_data_folder_the_hint_names_the_real_fix(tmp_path: Path) -> None:
    """Issue 24 item 6: the hint said "run 'keyshred init .'" where pointing to the
    folder (-p or KEYSHRED_PATH) is the fix."""
    out = run("put", "ann", "notes", "k", "1", "--path", str(tmp_path / "nowhere"))
    assert out.returncode != 0
    text = " ".join((out.stdout + out.stderr).replace("│", " ").split())  # unwrapped
    assert "--path/-p" in text and "KEYSHRED_PATH" in text and "keyshred init PATH" in text
