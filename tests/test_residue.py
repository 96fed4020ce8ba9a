"""The residue check (issue 19, item 6): ``ks.erasure.residue_scan`` and
``keyshred verify residue`` over a data folder, a backup target and an export.

Probes (a phone, an e-mail, a non-ASCII name) are planted in a subject's memories
(two scopes, flushed segments and the append log), vectors, checkpoints and tokens.
Before the erasure the scan must find them *decrypted* in every store and in the
backup, and never raw (encryption works); after it, nowhere, with the ciphertexts
reported as undecryptable. Files written with the probe in each encoding are found
raw. Neither the report nor the CLI's output ever holds a probe.
"""

from __future__ import annotations

import base64
import json
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest

from keyshred import Keyshred
from keyshred.errors import InvalidInput
from keyshred.residue import ResidueReport, probe_forms
from keyshred.storage.checkpoints import CheckpointRow, WriteRow
from tests.e2e.test_cli import run
from tests.storage.conftest import make_config, parquet_config
from tests.storage.test_vectors import bag_of_words

NS = ("profile",)
HEALTH = "support/health"
PASS = "correct horse battery staple"


@dataclass
class Planted:
    victim: str
    probes: list[str]  # phone, e-mail, non-ASCII name
    data: Path
    backups: Path
    exports: Path


# The scans below tell segments from hot records: compactions write segments
# however small the partition (``parquet_config``; by default a partition this small
# compacts into the catalog, where the scan finds its records as hot rows).
@pytest.fixture
def ks(catalog_url: str, tmp_path: Path) -> Iterator[Keyshred]:
    store = Keyshred.init(tmp_path / "data", parquet_config(catalog_url), embeddings=bag_of_words)
    yield store
    store.close()


@pytest.fixture
def sqlite_ks(tmp_path: Path) -> Iterator[Keyshred]:
    store = Keyshred.init(tmp_path / "data", parquet_config(None), embeddings=bag_of_words)
    yield store
    store.close()


def plant(ks: Keyshred, tmp_path: Path) -> Planted:
    run_id = uuid.uuid4().hex[:8]
    victim = f"victim-{run_id}"
    phone = "13812345678"  # a mobile number the vault's detector tokenizes
    email = f"v.{run_id}@example.org"
    name = f"Zoë Ørsted-Ñúñez {run_id}"
    ks.consent.grant(victim, scope=HEALTH, category="health")
    # Scope default, flushed into a segment, embedded into vectors.
    ks.memories.put(victim, NS, "contact", {"phone": phone, "email": email, "name": name})
    ks.memories.put(victim, NS, "bio", {"text": f"{name} rows kayaks"}, index=["text"])
    # Scope support/health, flushed too.
    ks.memories.put(
        victim, ("care",), "note", f"call {phone} about asthma", scope=HEALTH, category="health"
    )
    ks.memories.put("bob", NS, "own", {"text": "bob plays chess"}, index=["text"])
    ks.memories.flush()
    # Left in the append log (not flushed).
    ks.memories.put(victim, NS, "latest", {"mail": email, "who": name})
    # A thread's checkpoint and write.
    store = ks.checkpoints
    th = store.ensure_thread(f"thread-{run_id}", ks.subject_ref(victim), "default")
    payload = json.dumps({"messages": [f"I am {name}"]}, ensure_ascii=False).encode()
    store.put_checkpoint(th, CheckpointRow("", "", "c1", None, payload), None)
    store.put_writes(
        th, "", "c1", [WriteRow("t1", 0, "messages", "", email.encode())], replace=False
    )
    # Tokens of the phone and the e-mail.
    sanitized = ks.vault.sanitize(
        f"call {phone} or mail {email}", victim, "support", timedelta(hours=1)
    )
    assert len(sanitized.tokens) == 2
    ks.vault.flush()
    backups = tmp_path / "backups"
    ks.backup.create(str(backups))
    exports = tmp_path / "exports"
    exports.mkdir()
    ks.export(victim, exports / "victim.ksx", passphrase=PASS)
    return Planted(victim, [phone, email, name], tmp_path / "data", backups, exports)


def found(report: ResidueReport, *, root: int, layer: str) -> dict[str, set[int]]:
    """kind -> probe indexes found in that root and layer."""
    out: dict[str, set[int]] = {}
    for h in report.hits:
        if h.root == root and h.layer == layer:
            out.setdefault(h.kind, set()).add(h.probe)
    return out


def snapshot(root: Path) -> set[tuple[str, int, int]]:
    return {
        (str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in root.rglob("*") if f.is_file()
    }


def assert_no_probe(text: str, probes: list[str]) -> None:
    data = text.encode("utf-8")
    for probe in probes:
        assert probe not in text
        for _, needle in probe_forms(probe):
            assert needle not in data


def test_before_erasure_found_decrypted_never_raw_and_after_nowhere(
    ks: Keyshred, tmp_path: Path
) -> None:
    p = plant(ks, tmp_path)
    roots = [p.data, p.backups, p.exports]
    untouched = snapshot(p.backups) | snapshot(p.exports)
    before = ks.erasure.residue_scan(p.probes, roots)
    # The scan reads: nothing is created or changed under a backup or an export.
    assert snapshot(p.backups) | snapshot(p.exports) == untouched
    assert_no_probe(json.dumps(before.as_dict(), ensure_ascii=False) + repr(before), p.probes)

    # Encryption works: no probe in any file's bytes, in any encoding.
    assert [h for h in before.hits if h.layer == "raw"] == []
    # Everything the live keyring opens is searched: every store holds the probes.
    live = found(before, root=0, layer="decrypted")
    assert live["memory_segment"] == {0, 1, 2}  # both scopes, all three probes
    assert live["memory_log_record"] == {1, 2}
    assert live["token"] == {0, 1}
    assert live["checkpoint"] == {2}
    assert live["checkpoint_write"] == {1}
    # The backup's segments (mapped through the manifest) and its catalog copy.
    backup = found(before, root=1, layer="decrypted")
    assert backup["memory_segment"] == {0, 1, 2}
    assert backup["token"] == {0, 1}
    assert backup["checkpoint"] == {2}
    assert before.decrypted["vector"] >= 4  # live and backup: two memories, one field each
    assert before.decrypted["memory_segment"] >= 6  # 3 live (2 victim, 1 bob), 3 in the backup
    assert before.locked == {"export": 1}
    assert before.undecryptable == {}
    assert before.files_scanned > 10 and before.bytes_scanned > 0

    # A copy of the pre-erasure generation kept elsewhere (the erasure deletes the
    # subject's objects from the backup target; this copy is beyond its reach).
    offline = tmp_path / "offline-copy"
    shutil.copytree(p.backups, offline)

    req = ks.erase(p.victim, requested_by="dpo", reason="gdpr-art17")
    assert req.state == "completed", req.error
    after = ks.erasure.residue_scan(p.probes, [p.data, p.backups, offline, p.exports])
    assert after.hits == [], after.as_dict()
    # What is left of the subject is ciphertext under destroyed keys.
    gone = after.undecryptable
    assert gone["memory_segment"] >= 2  # the victim's two scopes, in the offline copy
    assert gone["vector"] >= 2
    assert gone["token"] >= 2 and gone["checkpoint"] >= 1 and gone["checkpoint_write"] >= 1
    assert gone["export"] == 1
    assert after.decrypted["memory_segment"] >= 1  # bob's segment still opens
    assert_no_probe(json.dumps(after.as_dict(), ensure_ascii=False) + repr(after), p.probes)


def test_the_hot_rows_of_the_backup_are_decoded(sqlite_ks: Keyshred, tmp_path: Path) -> None:
    """A record still in the hot tier when the backup ran is found decrypted in the
    backup, in the generation's copy of the catalog (hot rows live there)."""
    ks = sqlite_ks
    phone = "13812345678"
    ks.memories.put("ann", NS, "k", {"phone": phone})
    ks.backup.create(str(tmp_path / "b"))
    report = ks.erasure.residue_scan([phone], [tmp_path / "b"])
    assert found(report, root=0, layer="decrypted") == {"memory_log_record": {0}}
    assert report.decrypted["memory_log_record"] == 1
    # The objects folder alone (no manifest): Parquet objects are still segments.
    ks.memories.flush()
    ks.backup.create(str(tmp_path / "b"))
    objects = ks.erasure.residue_scan([phone], [tmp_path / "b" / "objects"])
    assert found(objects, root=0, layer="decrypted") == {"memory_segment": {0}}
    # One generation folder alone: its objects lie outside it, and are still read.
    gen = min((tmp_path / "b" / "generations").iterdir())  # the first, hot rows only
    alone = ks.erasure.residue_scan([phone], [gen])
    assert found(alone, root=0, layer="decrypted") == {"memory_log_record": {0}}
    assert {h.path for h in alone.hits if h.layer == "decrypted"} == {"catalog.db"}


def encoded_files(folder: Path, probes: list[str]) -> dict[str, tuple[int, bytes]]:
    """One file per encoding, the probe embedded between other bytes."""
    phone, email, name = probes
    raw = email.encode()
    files: dict[str, tuple[int, bytes]] = {
        "utf-16-le": (1, email.encode("utf-16-le")),
        "utf-16-be": (2, name.encode("utf-16-be")),
        "hex": (0, phone.encode().hex().encode()),
        "hex-upper": (1, raw.hex().upper().encode()),
        "json-ascii": (2, json.dumps({"n": name}).encode()),  # \u00eb escapes
        # JSON without escapes is UTF-8 for this probe: reported as such (below).
        "utf-8": (2, json.dumps({"n": name}, ensure_ascii=False).encode()),
    }
    for shift in range(3):
        files[f"base64-{shift}"] = (1, base64.b64encode(b"x" * shift + raw + b"tail"))
    folder.mkdir()
    for enc, (_, content) in files.items():
        (folder / f"{enc}.bin").write_bytes(b"\x00noise " + content + b" noise\xff")
    return files


def test_each_encoding_is_found_raw(sqlite_ks: Keyshred, tmp_path: Path) -> None:
    probes = ["13812345678", "v.x81@example.org", "Zoë Ørsted-Ñúñez"]
    files = encoded_files(tmp_path / "dump", probes)
    # Across the boundary of the scan's 8 MiB reads.
    (tmp_path / "dump" / "straddle.bin").write_bytes(b"\0" * ((8 << 20) - 5) + probes[1].encode())
    report = sqlite_ks.erasure.residue_scan(probes, [tmp_path / "dump"])
    hits = {(h.path, h.encoding, h.probe) for h in report.hits if h.layer == "raw"}
    for enc, (probe, _) in files.items():
        assert (f"{enc}.bin", enc, probe) in hits, enc
    assert ("straddle.bin", "utf-8", 1) in hits
    assert report.files_scanned == len(files) + 1
    # UTF-8 and plain JSON of a probe JSON leaves alone are the same bytes: one form.
    assert "json" not in dict(probe_forms("13812345678"))
    assert dict(probe_forms('say "hi" there'))["json"] == b'say \\"hi\\" there'
    assert_no_probe(json.dumps(report.as_dict(), ensure_ascii=False), probes)


def test_forms_and_refusals(sqlite_ks: Keyshred, tmp_path: Path) -> None:
    forms = dict(probe_forms("Zoë"))
    assert forms["json-ascii"] == b"Zo\\u00eb" and forms["json-ascii-upper"] == b"Zo\\u00EB"
    # Each base64 form occurs in the base64 of the probe at that offset, whatever
    # the bytes around it.
    for shift in range(3):
        piece = dict(probe_forms("alice@example.org"))[f"base64-{shift}"]
        assert piece in base64.b64encode(b"\xfe" * shift + b"alice@example.org\x01\x02")
    # A probe whose base64 holds '+' or '/' is also looked for in the URL-safe alphabet.
    url = dict(probe_forms("ab>>>?cd"))
    assert b"+" in url["base64-0"] or b"/" in url["base64-0"]
    assert url["base64url-0"] in base64.urlsafe_b64encode(b"ab>>>?cd")
    with pytest.raises(InvalidInput):
        sqlite_ks.erasure.residue_scan([], [tmp_path])
    with pytest.raises(InvalidInput):
        sqlite_ks.erasure.residue_scan(["ab"], [tmp_path])
    with pytest.raises(InvalidInput):
        sqlite_ks.erasure.residue_scan(["abcd"], [tmp_path / "missing"])
    # A file whose name holds the probe is a hit, and its name is not printed.
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "alice@example.org.txt").write_bytes(b"nothing")
    report = sqlite_ks.erasure.residue_scan(["alice@example.org"], [tmp_path / "d"])
    assert [(h.kind, h.path.startswith("<redacted")) for h in report.hits] == [("file_name", True)]


def test_cli_end_to_end(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with Keyshred.init(data, make_config(None), embeddings=bag_of_words) as ks:
        p = plant(ks, tmp_path)
    dump = tmp_path / "dump"
    encoded_files(dump, p.probes)
    probe_args = [a for probe in p.probes for a in ("--probe", probe)]

    clean = run("verify", "residue", *probe_args, str(p.exports), "--path", str(data))
    assert clean.returncode == 0, clean.stderr
    assert "no probe found" in clean.stdout

    hit = run("verify", "residue", *probe_args, str(dump), "--path", str(data), "--json")
    assert hit.returncode == 1, hit.stderr
    report = json.loads(hit.stdout)
    assert report["clean"] is False and len(report["hits"]) >= 9
    text = run("verify", "residue", *probe_args, str(data), str(dump), "--path", str(data))
    assert text.returncode == 1
    assert "HIT probe #" in text.stdout and "decrypted" in text.stdout
    for out in (clean, hit, text):
        assert_no_probe(out.stdout + out.stderr, p.probes)

    # The subject is erased through the CLI; the backup copy and the data folder
    # hold nothing that opens.
    erased = run(
        "erase", p.victim, "--requested-by", "dpo", "--reason", "art17", "--path", str(data)
    )
    assert erased.returncode == 0, erased.stderr
    (tmp_path / "probes.txt").write_text("\n".join(p.probes) + "\n", encoding="utf-8")
    after = run(
        "verify", "residue", "--probes-file", str(tmp_path / "probes.txt"),
        str(data), str(p.backups), "--path", str(data), "--json",
    )  # fmt: skip
    assert after.returncode == 0, after.stdout + after.stderr
    assert json.loads(after.stdout)["undecryptable"]["token"] >= 2

    # Usage errors: exit 2, one line, no probe echoed.
    for args in (
        ("verify", "residue", str(data), "--path", str(data)),  # no probe
        ("verify", "residue", "--probe", "ab", str(data), "--path", str(data)),
        ("verify", "residue", "--probe", p.probes[1], str(tmp_path / "nope"), "--path", str(data)),
        ("verify", "residue", "--probe", p.probes[1]),  # no path
    ):
        bad = run(*args)
        assert bad.returncode == 2, (args, bad.stdout, bad.stderr)
        assert "Traceback" not in bad.stderr
        assert_no_probe(bad.stdout + bad.stderr, p.probes[1:])


def test_a_token_journal_is_decrypted(sqlite_ks: Keyshred, tmp_path: Path) -> None:
    """Token rows journaled before their group commit (a dead process's, say) are
    opened with the live key like the catalog's, and erased with it."""
    from keyshred.keyring.envelope import Place
    from keyshred.vault.journal import TokenJournal, encode

    ks = sqlite_ks
    email = "pending.x9@example.org"
    ks.memories.put("eve", NS, "k", {"n": 1})  # eve's default key
    ref = ks.subject_ref("eve")
    token = "<EMAIL_0123456789>"
    value = ks.keyring.seal(email.encode(), Place(ref, "default", "tokens", token, "value"))
    journal = TokenJournal(tmp_path / "journal")
    row = (7, token, ref, "default", "EMAIL", "support", False, None, 0, 1, value)
    journal.append(encode(1, [row]))
    try:
        report = ks.erasure.residue_scan([email], [tmp_path / "journal"])
        assert report.decrypted == {"token_journal": 1}
        assert [(h.kind, h.layer) for h in report.hits] == [("token_journal", "decrypted")]
        ks.erase("eve", requested_by="dpo", reason="art17")
        after = ks.erasure.residue_scan([email], [tmp_path / "journal"])
        assert after.hits == [] and after.undecryptable == {"token_journal": 1}
    finally:
        journal.close()


def test_the_catalogs_vector_rows_are_decrypted(sqlite_ks: Keyshred, tmp_path: Path) -> None:
    """Vectors are rows of the catalog: the scan decrypts them there (a re-embedded
    memory's row was replaced in place, so only the live vector is left), and a
    probe's float bytes are searched in what they decrypt to."""
    ks = sqlite_ks
    ks.memories.put("fay", NS, "k", {"text": "fay rows kayaks"}, index=["text"])
    ks.memories.put("fay", NS, "k", {"text": "fay climbs rocks"}, index=["text"])
    assert ks.vectors.count(ks.subject_ref("fay")) == 1
    assert not (tmp_path / "data" / "vectors").exists()
    report = ks.erasure.residue_scan(["nothing-here"], [tmp_path / "data"])
    assert report.decrypted.get("vector") == 1, report.as_dict()
    assert report.hits == []
    assert ks.erase("fay", requested_by="dpo", reason="art17").state == "completed"
    after = ks.erasure.residue_scan(["nothing-here"], [tmp_path / "data"])
    assert "vector" not in after.decrypted and after.hits == []


def test_a_mention_is_unreadable_in_every_copy_after_erasure(
    sqlite_ks: Keyshred, tmp_path: Path
) -> None:
    """Carol's facts mention the victim: sealed under their shared key inside
    carol's segment and log (opened through the partition's own code), they are
    found before the erasure, live and in a copy of the backup; after it they are
    opaque rows everywhere, and carol's own rows still open."""
    ks = sqlite_ks
    phone = "13812345678"
    ks.memories.put("vic", NS, "own", {"n": 1})
    ks.memories.put("carol", ("facts",), "tea", "carol likes tea")
    ks.memories.put("carol", ("facts",), "met", f"met vic, call {phone}", mentions=["vic"])
    ks.memories.flush()  # carol's segment
    ks.memories.put("carol", ("facts",), "again", f"vic: {phone}", mentions=["vic"])  # her log
    ks.backup.create(str(tmp_path / "b"))
    shutil.copytree(tmp_path / "b", tmp_path / "copy")
    roots = [tmp_path / "data", tmp_path / "copy"]
    before = ks.erasure.residue_scan([phone], roots)
    both = {"memory_segment": {0}, "memory_log_record": {0}}
    assert found(before, root=0, layer="decrypted") == both
    assert found(before, root=1, layer="decrypted") == both
    assert [h for h in before.hits if h.layer == "raw"] == []

    assert ks.erase("vic", requested_by="dpo", reason="art17").state == "completed"
    after = ks.erasure.residue_scan([phone], roots)
    assert after.hits == [], after.as_dict()
    assert after.undecryptable["memory_row"] >= 2  # both facts, in the backup copy
    assert after.decrypted["memory_row"] >= 2  # carol's tea, live and in the copy
