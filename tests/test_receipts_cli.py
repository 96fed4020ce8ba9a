"""The receipt and key commands as a user runs them (subprocesses): ``keys jwks``,
``receipt show`` (the JWS; ``--json``), ``receipt verify --jwks`` naming the form,
a JSON-form receipt issued before, ``keys rotate-signing-key``, and the README's
joserfc example run on what the commands printed."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from joserfc import jws as jose_jws
from joserfc.errors import JoseError
from joserfc.jwk import KeySet

from keyshred import Keyshred
from keyshred.jose import b64url_decode, b64url_encode
from keyshred.schema import deletion_requests
from tests import zygote
from tests.e2e.test_cli import run
from tests.receipt_forms import sign_json_form

# joserfc notes that RFC 9864 deprecates "EdDSA" for the fully specified "Ed25519";
# receipts keep "EdDSA", which every JOSE library verifies (see keyshred/jose.py).
pytestmark = pytest.mark.filterwarnings("ignore:EdDSA is deprecated")
README = Path(__file__).parents[1] / "README.md"
PROBE = "cli-receipt-subject-4b2a"


def _erase(data: Path, request_id: str, subject: str = PROBE) -> None:
    with Keyshred.open(data) as ks:
        ks.memories.put(subject, ("m",), "k", {"v": "x"})
        req = ks.erase(subject, requested_by="dpo", reason="gdpr-art17", request_id=request_id)
        assert req.state == "completed", req.error


def test_jwks_show_and_verify(tmp_path: Path) -> None:
    data = tmp_path / "d"
    assert run("init", str(data)).returncode == 0
    _erase(data, "r1")
    jwks_out = run("keys", "jwks", "--path", str(data))
    assert jwks_out.returncode == 0, jwks_out.stderr
    published = json.loads(jwks_out.stdout)
    compact = json.loads(run("keys", "jwks", "--path", str(data), "--json").stdout)
    assert compact == published and len(published["keys"]) == 1
    pinned = json.loads(run("keys", "public-key", "--path", str(data), "--json").stdout)
    assert pinned["kid"] == published["keys"][0]["kid"]
    jwks_file = tmp_path / "jwks.json"
    jwks_file.write_text(jwks_out.stdout)

    shown = run("receipt", "show", "r1", "--path", str(data))
    assert shown.returncode == 0, shown.stderr
    token = shown.stdout.strip()
    assert re.fullmatch(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+", token)
    assert PROBE not in shown.stdout and PROBE not in b64url_decode(token.split(".")[1]).decode()
    file = tmp_path / "receipt.jws"
    file.write_text(shown.stdout)
    ok = run("receipt", "verify", str(file), "--jwks", str(jwks_file), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout) | {"subject_ref": None} == {
        "valid": True,
        "form": "jws",
        "kid": published["keys"][0]["kid"],
        "request_id": "r1",
        "subject_ref": None,
    }
    text = run("receipt", "verify", str(file), "--path", str(data))
    assert text.returncode == 0 and "jws form" in text.stdout

    doc = json.loads(run("receipt", "show", "r1", "--path", str(data), "--json").stdout)
    assert doc["form"] == "jws" and doc["jws"] == token and doc["receipt"]["request_id"] == "r1"
    wrapped = tmp_path / "receipt.json"
    wrapped.write_text(json.dumps(doc))
    assert run("receipt", "verify", str(wrapped), "--jwks", str(jwks_file)).returncode == 0

    # Tampered: a payload byte; a kid altered; alg none. Exit 1, one line, typed reason.
    head, payload, signature = token.split(".")
    raw = bytearray(b64url_decode(payload))
    raw[raw.index(b'"reason":"') + len(b'"reason":"')] ^= 0x20
    header = json.loads(b64url_decode(head))
    other_kid = b64url_encode(json.dumps({**header, "kid": "x" * 43}).encode())
    forged = {
        "payload": f"{head}.{b64url_encode(bytes(raw))}.{signature}",
        "kid": f"{other_kid}.{payload}.{signature}",
        "none": f"{b64url_encode(json.dumps({'alg': 'none'}).encode())}.{payload}.",
    }
    for name, bad in forged.items():
        file.write_text(bad)
        out = run("receipt", "verify", str(file), "--jwks", str(jwks_file), "--json")
        assert out.returncode == 1 and "Traceback" not in out.stderr, (name, out.stderr)
        assert json.loads(out.stdout)["valid"] is False
    # A JWKS file that is no JWKS is the user's error (exit 2).
    jwks_file.write_text("[]")
    file.write_text(token)
    out = run("receipt", "verify", str(file), "--jwks", str(jwks_file))
    assert out.returncode == 2 and out.stderr.startswith("keyshred: error:")


def test_a_json_receipt_from_before_and_rotation(tmp_path: Path) -> None:
    data = tmp_path / "d"
    assert run("init", str(data)).returncode == 0
    _erase(data, "old")
    with Keyshred.open(data) as ks:
        receipt = ks.erasure.receipt("old")
        assert receipt is not None
        issued = sign_json_form(receipt, ks.keyring.signer()).to_json()
        with ks.catalog.transaction() as conn:
            conn.execute(
                deletion_requests.update()
                .where(deletion_requests.c.request_id == "old")
                .values(receipt=issued)
            )
    shown = run("receipt", "show", "old", "--path", str(data))
    assert json.loads(shown.stdout)["signature"] is not None  # printed as it was issued
    old_file = tmp_path / "old.json"
    old_file.write_text(shown.stdout)

    rotated = run("keys", "rotate-signing-key", "--path", str(data), "--json")
    assert rotated.returncode == 0, rotated.stderr
    assert json.loads(rotated.stdout)["keys"] == 2
    _erase(data, "new", "another-subject")
    jwks_file = tmp_path / "jwks.json"
    jwks_file.write_text(run("keys", "jwks", "--path", str(data)).stdout)
    new_file = tmp_path / "new.jws"
    new_file.write_text(run("receipt", "show", "new", "--path", str(data)).stdout)
    kids = [k["kid"] for k in json.loads(jwks_file.read_text())["keys"]]
    for file, form, kid in ((old_file, "json", kids[0]), (new_file, "jws", kids[1])):
        out = run("receipt", "verify", str(file), "--jwks", str(jwks_file), "--json")
        assert out.returncode == 0, out.stderr
        assert (json.loads(out.stdout)["form"], json.loads(out.stdout)["kid"]) == (form, kid)
    # The current key alone does not vouch for the receipt the old key signed.
    current = json.loads(run("keys", "public-key", "--path", str(data), "--json").stdout)
    out = run("receipt", "verify", str(old_file), "--public-key", current["public_key"])
    assert out.returncode == 1 and "another key" in out.stdout

    # The README's example, as written, on what the commands printed.
    section = README.read_text("utf-8").split("## Receipts anyone can verify")[1]
    example = section.split("```python")[1].split("```")[0]
    check = (
        "\nassert receipt['request_id'] == 'new'"
        "\nassert obj.headers()['kid'] == " + repr(kids[1]) + "\n"
    )
    (tmp_path / "receipt.jws").write_text(new_file.read_text())
    proc = zygote.run(
        [sys.executable, "-W", "ignore", "-c", example + check],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    # And the same library refuses the old key's signature over the new receipt.
    keys = KeySet.import_key_set({"keys": [json.loads(jwks_file.read_text())["keys"][0]]})
    with pytest.raises((JoseError, ValueError)):
        jose_jws.deserialize_compact(new_file.read_text().strip(), keys, algorithms=["EdDSA"])
