"""JWS receipts: the fixed vectors (tests/vectors/receipt_jws.json, made from the
RFCs without keyshred's code), a real erasure's receipt verified with ``joserfc``
(a JOSE library keyshred does not use) against the published JWKS, every tampering
refused by keyshred's own verify with a typed error, signing-key rotation, and the
receipts of the JSON form issued before (by the code of that time) still verifying."""

from __future__ import annotations

import base64
import importlib.util
import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from joserfc import jws as jose_jws
from joserfc.errors import JoseError
from joserfc.jwk import KeySet, OKPKey

from keyshred import Keyshred
from keyshred import errors as errors_module
from keyshred.errors import IntegrityError, InvalidInput, UntrustedSigner
from keyshred.jose import b64url_decode, b64url_encode, jwk_thumbprint, jwks, public_jwk
from keyshred.keyring import _primitives as prim
from keyshred.keyring.keyring import Signer
from keyshred.receipts import (
    JWS_TYPE,
    Receipt,
    load_receipt,
    sign_receipt,
    verify_receipt,
    verify_receipt_text,
)
from keyshred.schema import deletion_requests
from tests.storage.conftest import make_config
from tests.storage.test_vectors import bag_of_words

# joserfc notes that RFC 9864 deprecates "EdDSA" for the fully specified "Ed25519";
# receipts keep "EdDSA", which every JOSE library verifies (see keyshred/jose.py).
pytestmark = pytest.mark.filterwarnings("ignore:EdDSA is deprecated")
VECTORS = json.loads((Path(__file__).parent / "vectors" / "receipt_jws.json").read_text("utf-8"))
LEGACY = Path(__file__).parent / "vectors" / "receipt_legacy_json.json"
NS = ("m",)
PROBE = "probe-receipt-7c1e"


@pytest.fixture
def ks(catalog_url: str, tmp_path: Path) -> Iterator[Keyshred]:
    store = Keyshred.init(tmp_path / "data", make_config(catalog_url), embeddings=bag_of_words)
    yield store
    store.close()


def erased_receipt(ks: Keyshred, subject: str = "alice-" + PROBE) -> Receipt:
    ks.memories.put(subject, NS, "k", {"text": f"{subject} likes {PROBE}"})
    req = ks.erase(subject, requested_by="dpo", reason="gdpr-art17", probes=[PROBE])
    assert req.state == "completed", req.error
    receipt = ks.erasure.receipt(req.request_id)
    assert receipt is not None
    return receipt


def vector_signer() -> Signer:
    return Signer(bytes.fromhex(VECTORS["signing_key_seed"]))


# -- the vectors -------------------------------------------------------------------


def test_the_valid_vector_is_what_keyshred_signs_and_verifies() -> None:
    valid = VECTORS["valid"]
    receipt = verify_receipt_text(valid["jws"], VECTORS["jwks"])
    assert receipt.form == "jws" and receipt.jws == valid["jws"]
    assert receipt.request_id == "req-vector-1" and receipt.reason.startswith("Art. 17 DSGVO")
    # The payload is RFC 8785 canonical JSON of the fields, byte for byte.
    assert receipt.payload() == valid["payload"].encode("utf-8")
    assert receipt.kid == valid["header"]["kid"] == jwk_thumbprint(vector_signer().public_key)
    # Ed25519 is deterministic: signing the same receipt gives the very same token.
    unsigned = Receipt.model_validate_json(valid["payload"])
    assert sign_receipt(unsigned, vector_signer()).serialize() == valid["jws"]
    assert jwks([vector_signer().public_key])["keys"] == [VECTORS["jwks"]["keys"][1]]


@pytest.mark.parametrize("case", VECTORS["invalid"], ids=[c["reason"] for c in VECTORS["invalid"]])
def test_every_invalid_vector_is_refused_with_its_error(case: dict[str, str]) -> None:
    error = getattr(errors_module, case["error"])
    with pytest.raises(IntegrityError) as caught:
        verify_receipt_text(case["jws"], VECTORS["jwks"])
    assert type(caught.value) is error, (case["reason"], caught.value)


@pytest.mark.parametrize("case", VECTORS["invalid"], ids=[c["reason"] for c in VECTORS["invalid"]])
def test_joserfc_agrees_the_invalid_vectors_are_not_receipts(case: dict[str, str]) -> None:
    """The invalid vectors are not keyshred's quirks: a JOSE library refuses each
    too (or, for the shapes it would accept, verifies something keyshred must not:
    another typ, no typ, extra header members, a payload that is no receipt)."""
    keys = KeySet.import_key_set(VECTORS["jwks"])
    try:
        obj = jose_jws.deserialize_compact(case["jws"], keys, algorithms=["EdDSA"])
    except (JoseError, ValueError, KeyError, TypeError):
        return
    header = obj.headers()
    assert (
        header.get("typ") != JWS_TYPE
        or set(header) != {"alg", "kid", "typ"}
        or ("extra" in json.loads(obj.payload))
    ), case["reason"]


def test_rfc8037_and_rfc7638_examples() -> None:
    """RFC 8037 A.1-A.4: the Ed25519 key, its thumbprint, and the EdDSA signature."""
    d = b64url_decode("nWGxne_9WmC6hEr0kuwsxERJxWl7MmkZcDusAxyuf2A")
    x = b64url_decode("11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo")
    signer = Signer(d)
    assert signer.public_key == x
    assert jwk_thumbprint(x) == "kPrK_qmxVWaYVA9wwBF6Iuo3vVzz7TxHCTwXBygrS4k"
    signing_input = b"eyJhbGciOiJFZERTQSJ9.RXhhbXBsZSBvZiBFZDI1NTE5IHNpZ25pbmc"
    assert b64url_encode(signer.sign(signing_input)) == (
        "hgyY0il_MGCjP0JzlnLWG1PPOt7-09PGcvMg3AIbQR6dWbhijcNR4ki4iylGjg5BhVsPt9g7sVvpAr_MuM0KAg"
    )
    assert public_jwk(x) == {
        "kty": "OKP",
        "crv": "Ed25519",
        "x": "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo",
        "kid": "kPrK_qmxVWaYVA9wwBF6Iuo3vVzz7TxHCTwXBygrS4k",
        "use": "sig",
        "alg": "EdDSA",
    }


def test_the_vectors_are_what_their_generator_makes(tmp_path: Path) -> None:
    """The committed file is the generator's output (no hand edits)."""
    script = Path(__file__).parent / "vectors" / "generate_receipt_vectors.py"
    copy = tmp_path / script.name
    copy.write_text(script.read_text("utf-8"), "utf-8")
    subprocess.run([sys.executable, str(copy)], check=True, timeout=60)
    assert json.loads((tmp_path / "receipt_jws.json").read_text("utf-8")) == VECTORS


# -- a real erasure, verified by another JOSE library -----------------------------------


def test_a_real_receipt_verifies_with_joserfc_against_the_jwks(ks: Keyshred) -> None:
    receipt = erased_receipt(ks)
    assert receipt.form == "jws" and receipt.signature is None
    token = receipt.serialize()
    published = json.loads(json.dumps(ks.receipts_jwks()))  # as fetched over the wire
    (member,) = published["keys"]
    assert set(member) == {"kty", "crv", "x", "kid", "use", "alg"}
    assert (member["kty"], member["crv"], member["use"], member["alg"]) == (
        "OKP",
        "Ed25519",
        "sig",
        "EdDSA",
    )
    assert OKPKey.import_key(member).thumbprint() == member["kid"]

    obj = jose_jws.deserialize_compact(
        token, KeySet.import_key_set(published), algorithms=["EdDSA"]
    )
    assert obj.headers() == {"alg": "EdDSA", "kid": member["kid"], "typ": JWS_TYPE}
    fields = {k: v for k, v in json.loads(receipt.to_json()).items() if k != "signature"}
    assert json.loads(obj.payload) == fields
    # And keyshred's own verify, against the JWKS and against the one raw key.
    verify_receipt(receipt, published)
    verify_receipt(receipt, ks.keyring.signer().public_key)
    again = ks.erasure.receipt(receipt.request_id)
    assert again is not None and again.serialize() == token  # stored as the JWS
    assert PROBE not in token and PROBE not in base64.urlsafe_b64decode(
        token.split(".")[1] + "=="
    ).decode("utf-8")


def test_tampering_with_a_real_receipt_is_refused_with_typed_errors(ks: Keyshred) -> None:
    receipt = erased_receipt(ks)
    published = ks.receipts_jwks()
    head, payload, signature = receipt.serialize().split(".")
    raw = bytearray(b64url_decode(payload))
    at = raw.index(b'"reason":"gdpr-art17"') + len(b'"reason":"')
    raw[at] ^= 0x20  # "gdpr" -> "Gdpr": still a valid receipt, not what was signed
    fresh = Signer(prim.ed25519_private_bytes(prim.ed25519_generate()))
    header = json.loads(b64url_decode(head))

    def with_header(**changes: Any) -> str:
        h = b64url_encode(json.dumps({**header, **changes}).encode())
        return f"{h}.{payload}.{signature}"

    cases = {
        "a flipped payload byte": (
            f"{head}.{b64url_encode(bytes(raw))}.{signature}",
            IntegrityError,
        ),
        "a wrong kid": (with_header(kid=jwk_thumbprint(fresh.public_key)), UntrustedSigner),
        "alg none": (
            f"{b64url_encode(json.dumps({'alg': 'none', 'typ': JWS_TYPE}).encode())}.{payload}.",
            IntegrityError,
        ),
        "a key not in the JWKS": (sign_receipt(receipt, fresh).serialize(), UntrustedSigner),
    }
    for name, (token, error) in cases.items():
        with pytest.raises(IntegrityError) as caught:
            verify_receipt_text(token, published)
        assert type(caught.value) is error, (name, caught.value)
        # ... and a JOSE library keyshred does not use refuses it as well.
        with pytest.raises((JoseError, ValueError)):
            jose_jws.deserialize_compact(
                token, KeySet.import_key_set(published), algorithms=["EdDSA"]
            )

    # A copy of the loaded receipt with an edited field keeps the token: refused.
    edited = receipt.model_copy(update={"requested_by": "nobody"})
    assert edited.jws == receipt.jws
    with pytest.raises(IntegrityError, match="differs"):
        verify_receipt(edited, published)
    # The key inside is never trusted: re-signed by a fresh key, the JWKS refuses it.
    with pytest.raises(UntrustedSigner):
        verify_receipt(sign_receipt(edited, fresh), published)
    with pytest.raises(InvalidInput):
        verify_receipt(receipt, {"keys": []})
    with pytest.raises(InvalidInput):
        verify_receipt(receipt, b"short")
    bad_kid = {"keys": [{**published["keys"][0], "kid": "someone-else"}]}
    with pytest.raises(InvalidInput):
        verify_receipt(receipt, bad_kid)
    unsigned = Receipt.model_validate_json(receipt.to_json())
    assert unsigned.form == "unsigned"
    with pytest.raises(IntegrityError, match="not signed"):
        verify_receipt(unsigned, published)


# -- rotation ----------------------------------------------------------------------------


def test_rotation_keeps_every_signing_key_published(
    ks: Keyshred, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, every level: scanned below
    first = erased_receipt(ks, "bob")
    old_key = ks.keyring.receipt_signer().public_key
    assert old_key == ks.keyring.signer().public_key  # one key until the first rotation
    before = ks.backup.create()
    new_key = ks.keyring.rotate_receipt_signer().public_key
    assert new_key != old_key
    second = erased_receipt(ks, "carl-" + PROBE)
    # Backups keep the first key: a generation signed before the rotation still lists
    # (its manifest verifies), and one made after is signed by the same key.
    assert ks.keyring.signer().public_key == old_key
    after = ks.backup.create()
    assert {before.generation, after.generation} <= {g.generation for g in ks.backup.generations()}
    assert first.kid != second.kid == jwk_thumbprint(new_key)
    published = ks.receipts_jwks()
    assert [k["kid"] for k in published["keys"]] == [first.kid, second.kid]  # current last
    for receipt in (first, second):
        verify_receipt(receipt, published)
        jose_jws.deserialize_compact(
            receipt.serialize(), KeySet.import_key_set(published), algorithms=["EdDSA"]
        )
    with pytest.raises(UntrustedSigner):
        verify_receipt(first, new_key)  # the old receipt needs the old key
    data = tmp_path / "data"
    ks.close()
    with Keyshred.open(data) as reopened:
        assert reopened.keyring.receipt_signer().public_key == new_key  # the newest signs
        assert reopened.keyring.signer().public_key == old_key  # backups' key
        assert reopened.receipts_jwks() == published
        # A KEK rotation re-wraps every version; all stay readable.
        reopened.keyring.rotate_kek()
        assert reopened.receipts_jwks() == published
        # The private halves are nowhere in what is published or printed.
        text = json.dumps(published) + repr(reopened.keyring.receipt_signer()) + caplog.text
        text += first.serialize() + second.serialize() + repr(second)
        assert PROBE not in text
        for version in ("receipt-signing-key", "receipt-signing-key.v2"):
            record = reopened.keyring.store.get_secret(version)
            assert record is not None
        private = [
            reopened.keyring._system_secret(name, bytes)
            for name in ("receipt-signing-key", "receipt-signing-key.v2")
        ]
        for raw in private:
            for form in (raw.hex(), b64url_encode(raw), base64.b64encode(raw).decode()):
                assert form not in text


# -- receipts issued before, in the JSON form --------------------------------------------


def _old_receipts_module() -> Any:
    """keyshred/receipts.py as it was before JWS receipts (commit f8fbea5), loaded
    from its copy in tests/vectors: the code that issued the JSON receipts in the wild."""
    spec = importlib.util.spec_from_file_location(
        "receipts_f8fbea5", Path(__file__).parent / "vectors" / "receipts_f8fbea5.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the annotations through it
    spec.loader.exec_module(module)
    return module


def test_a_json_receipt_issued_before_loads_and_verifies(ks: Keyshred) -> None:
    """A receipt signed by the previous code, stored in the catalog as it was: it
    loads, says it is the JSON form, and verifies against the JWKS, the raw key and
    the command line; edited, it fails."""
    old = _old_receipts_module()
    receipt = erased_receipt(ks)
    # The previous code knew no ``metrics`` (eviction everywhere came after it).
    fields = {
        k: v for k, v in json.loads(receipt.to_json()).items() if k not in ("signature", "metrics")
    }
    issued = old.sign_receipt(old.Receipt.model_validate(fields), ks.keyring.signer()).to_json()
    with ks.catalog.transaction() as conn:
        conn.execute(
            deletion_requests.update()
            .where(deletion_requests.c.request_id == receipt.request_id)
            .values(receipt=issued)
        )
    loaded = ks.erasure.receipt(receipt.request_id)
    assert loaded is not None and loaded.form == "json" and loaded.jws is None
    assert loaded.serialize() == issued
    assert loaded.kid == jwk_thumbprint(ks.keyring.signer().public_key)
    verify_receipt(loaded, ks.receipts_jwks())
    verify_receipt(loaded, ks.keyring.signer().public_key)
    doc = json.loads(issued)
    doc["requested_by"] = "nobody"
    with pytest.raises(IntegrityError):
        verify_receipt_text(json.dumps(doc), ks.receipts_jwks())
    fresh = Signer(prim.ed25519_private_bytes(prim.ed25519_generate()))
    forged = old.sign_receipt(old.Receipt.model_validate_json(json.dumps(doc)), fresh).to_json()
    with pytest.raises(UntrustedSigner):
        verify_receipt_text(forged, ks.receipts_jwks())


def test_the_committed_json_receipt_vector_verifies() -> None:
    """A JSON-form receipt issued by the previous code with the vectors' fixed key
    (tests/vectors/receipt_legacy_json.json): still loads and verifies."""
    doc = json.loads(LEGACY.read_text("utf-8"))
    receipt = load_receipt(doc["receipt"])
    assert receipt.form == "json"
    verify_receipt(receipt, VECTORS["jwks"])
    verify_receipt(receipt, vector_signer().public_key)
    assert receipt.serialize() == doc["receipt"]
    with pytest.raises(IntegrityError):
        verify_receipt_text(doc["receipt"].replace("req-legacy-1", "req-legacy-2"), VECTORS["jwks"])


def test_receipts_table_holds_the_jws(ks: Keyshred) -> None:
    receipt = erased_receipt(ks)
    with ks.catalog.engine.connect() as conn:
        stored = conn.execute(
            sa.select(deletion_requests.c.receipt).where(
                deletion_requests.c.request_id == receipt.request_id
            )
        ).scalar()
    assert stored == receipt.jws and stored.count(".") == 2  # the token, nothing around it
