"""Who may do what, against the real server: every role's allowed and forbidden
calls (403, never a 500), 401 without a valid credential, OIDC JWTs verified
against the identity provider's JWKS, the identity hook, and rate limits."""

from __future__ import annotations

import time

import httpx
import pytest
from joserfc import jwt
from joserfc.jwk import OKPKey

from tests.api.conftest import AUDIENCE, ISSUER, ApiServer, start_server, stop_server

ERASE = {"subject": "auth-test-subject-x9", "reason": "gdpr-art17"}
HOLD = {"subject": "auth-test-subject-x9", "reason": "case-1"}


def _calls(c: httpx.Client, rid: str, hold_id: str) -> dict[str, int]:
    """One call of each operation, by name: its status."""
    subject = {"subject": "auth-test-subject-x9"}
    return {
        "erasure.create": c.post("/v1/erasure-requests", json=ERASE).status_code,
        "erasure.list": c.get("/v1/erasure-requests").status_code,
        "erasure.get": c.get(f"/v1/erasure-requests/{rid}").status_code,
        "erasure.receipt": c.get(f"/v1/erasure-requests/{rid}/receipt").status_code,
        "hold.place": c.post("/v1/holds", json=HOLD).status_code,
        "hold.list": c.post("/v1/holds/search", json=subject).status_code,
        "hold.release": c.post(f"/v1/holds/{hold_id}/release").status_code,
        "audit.events": c.get("/v1/audit/events", params={"limit": 5}).status_code,
        "audit.verify": c.get("/v1/audit/verify").status_code,
        "jwks": c.get("/v1/jwks").status_code,
    }


@pytest.fixture
def targets(server: ApiServer) -> tuple[str, str, str]:
    """A request by the operator, one by the requester, and a hold (fresh per use)."""
    with server.client("operator") as op:
        mine = op.post("/v1/erasure-requests", json=ERASE).json()["request_id"]
        hold = op.post("/v1/holds", json=HOLD).json()["hold_id"]
    with server.client("requester") as rq:
        theirs = rq.post("/v1/erasure-requests", json=ERASE).json()["request_id"]
    return mine, theirs, hold


def test_each_role_may_do_its_calls_and_gets_403_for_the_others(
    server: ApiServer, targets: tuple[str, str, str]
) -> None:
    by_operator, by_requester, hold = targets
    with server.client("operator") as c:
        operator = _calls(c, by_requester, hold)
    assert operator == {
        "erasure.create": 202,
        "erasure.list": 200,
        "erasure.get": 200,
        "erasure.receipt": 404,  # not completed: no receipt yet (allowed, though)
        "hold.place": 201,
        "hold.list": 200,
        "hold.release": 204,
        "audit.events": 403,
        "audit.verify": 403,
        "jwks": 200,
    }
    with server.client("operator") as c:
        hold = c.post("/v1/holds", json=HOLD).json()["hold_id"]
    with server.client("auditor") as c:
        auditor = _calls(c, by_requester, hold)
    assert auditor == {
        "erasure.create": 403,
        "erasure.list": 200,
        "erasure.get": 200,
        "erasure.receipt": 404,
        "hold.place": 403,
        "hold.list": 200,
        "hold.release": 403,
        "audit.events": 200,
        "audit.verify": 200,
        "jwks": 200,
    }
    with server.client("requester") as c:
        own = _calls(c, by_requester, hold)
        others = c.get(f"/v1/erasure-requests/{by_operator}")
        others_receipt = c.get(f"/v1/erasure-requests/{by_operator}/receipt")
    assert own == {
        "erasure.create": 202,
        "erasure.list": 403,
        "erasure.get": 200,
        "erasure.receipt": 404,
        "hold.place": 403,
        "hold.list": 403,
        "hold.release": 403,
        "audit.events": 403,
        "audit.verify": 403,
        "jwks": 200,
    }
    # A requester reads only its own requests.
    assert others.status_code == 403
    assert others_receipt.status_code == 403
    with server.client("requester-2") as c:
        assert c.get(f"/v1/erasure-requests/{by_requester}").status_code == 403
    for response in (others, others_receipt):
        assert response.headers["content-type"] == "application/problem+json"
        assert response.json()["status"] == 403


def test_an_auditors_verify_says_the_chain_is_intact(server: ApiServer) -> None:
    with server.client("auditor") as c:
        result = c.get("/v1/audit/verify").json()
        events = c.get("/v1/audit/events", params={"event": "api.call", "limit": 1000}).json()
    assert result["intact"] is True and result["events_checked"] > 0
    calls = events["events"]
    assert calls and all(e["data"]["actor"] and e["data"]["action"] for e in calls)
    assert {e["data"]["actor"] for e in calls} >= {"key:operator"}


def test_no_or_a_bad_credential_is_401(server: ApiServer) -> None:
    for token in (None, "not-a-key", server.tokens["operator"] + "x", "a.b.c"):
        with server.client(token=token) as c:
            r = c.post("/v1/erasure-requests", json=ERASE)
            assert r.status_code == 401, token
            assert r.headers["www-authenticate"].startswith("Bearer")
            assert r.headers["content-type"] == "application/problem+json"
            assert c.get("/v1/erasure-requests").status_code == 401
    other_scheme = httpx.get(
        server.url + "/v1/erasure-requests",
        headers={"Authorization": f"Basic {server.tokens['operator']}"},
    )
    assert other_scheme.status_code == 401


def test_oidc_tokens_carry_roles_and_the_verified_claim(server: ApiServer) -> None:
    with server.client(token=server.jwt("operator", sub="ops-person")) as c:
        assert c.get("/v1/erasure-requests").status_code == 200
    with server.client(token=server.jwt("auditor")) as c:
        assert c.post("/v1/erasure-requests", json=ERASE).status_code == 403
        assert c.get("/v1/audit/verify").status_code == 200
    # An end user: a verified requester files, an unverified one is refused by the
    # identity hook; the actor is a hash, never the token's sub (an e-mail here).
    sub = "end-user-sub-4417@example.com"
    with server.client(token=server.jwt("requester", sub=sub, verified=True)) as c:
        created = c.post("/v1/erasure-requests", json=ERASE)
        assert created.status_code == 202
        view = created.json()
        assert view["requested_by"].startswith("oidc:") and sub not in created.text
        assert view["identity"]["method"] == "requester-verified"
        assert c.get(f"/v1/erasure-requests/{view['request_id']}").status_code == 200
    with server.client(token=server.jwt("requester", sub=sub, verified=False)) as c:
        refused = c.post("/v1/erasure-requests", json=ERASE)
        assert refused.status_code == 403
        assert refused.json()["type"].endswith("identity-not-verified")
    with server.client(token=server.jwt("requester", sub="someone-else")) as c:
        assert c.get(f"/v1/erasure-requests/{view['request_id']}").status_code == 403
    assert sub not in server.logs()


def test_bad_jwts_are_401(server: ApiServer) -> None:
    other = OKPKey.generate_key("Ed25519")
    other.ensure_kid()
    now = int(time.time())
    base = {
        "iss": ISSUER,
        "aud": AUDIENCE,
        "sub": "x",
        "exp": now + 60,
        "keyshred_roles": ["operator"],
    }

    def signed(payload: dict[str, object], key: OKPKey = server.oidc_key) -> str:
        return jwt.encode({"alg": "EdDSA", "kid": key.kid}, payload, key, algorithms=["EdDSA"])

    tokens = [
        signed(base, other),  # another key
        signed({**base, "exp": now - 3600}),  # expired
        signed({**base, "aud": "someone-else"}),  # another audience
        signed({**base, "iss": "https://evil.test"}),  # another issuer
        signed({**base, "keyshred_roles": ["admin"]}),  # no keyshred role
    ]
    for token in tokens:
        with server.client(token=token) as c:
            assert c.get("/v1/erasure-requests").status_code == 401


def test_an_unverified_requester_key_is_refused_by_the_identity_hook(server: ApiServer) -> None:
    with server.client("requester-unverified") as c:
        r = c.post("/v1/erasure-requests", json=ERASE)
        assert r.status_code == 403
        assert r.json()["type"].endswith("identity-not-verified")
        w = c.post("/v1/consents/withdrawals", json={"subject": "s", "scope": "marketing/email"})
        assert w.status_code == 403


def test_rate_limits_per_credential_answer_429_with_retry_after(
    tmp_path_factory: pytest.TempPathFactory, server: ApiServer
) -> None:
    folder = tmp_path_factory.mktemp("limited")
    text = (server.data.parent / "api.toml").read_text()
    text = text.replace("per_second = 200.0", "per_second = 0.01").replace(
        "burst = 400", "burst = 3"
    )
    (folder / "api.toml").write_text(text)
    # A second server on a copy of the settings with a tiny bucket, same data folder.
    process, url, _, _ = start_server(folder, server.data, settings=folder / "api.toml")
    try:
        auth = {"Authorization": f"Bearer {server.tokens['auditor']}"}
        statuses = [httpx.get(url + "/v1/audit/verify", headers=auth).status_code for _ in range(5)]
        assert statuses[:3] == [200, 200, 200]
        assert statuses[3:] == [429, 429]
        limited = httpx.get(url + "/v1/audit/verify", headers=auth)
        assert int(limited.headers["retry-after"]) >= 1
        # Another credential has its own bucket.
        other = {"Authorization": f"Bearer {server.tokens['operator']}"}
        assert httpx.get(url + "/v1/erasure-requests", headers=other).status_code == 200
    finally:
        stop_server(process)


def test_jwts_verified_against_a_jwks_url(
    tmp_path_factory: pytest.TempPathFactory, server: ApiServer
) -> None:
    """The identity provider's JWKS fetched over HTTP (PyJWKClient), not a file."""
    import http.server
    import threading
    from functools import partial

    folder = tmp_path_factory.mktemp("jwks-url")
    (folder / "jwks.json").write_text((server.data.parent / "idp-jwks.json").read_text())
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    idp = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=idp.serve_forever, daemon=True).start()
    try:
        text = (server.data.parent / "api.toml").read_text()
        jwks_file = str(server.data.parent / "idp-jwks.json")
        url = f"http://127.0.0.1:{idp.server_address[1]}/jwks.json"
        settings = text.replace(f'jwks_file = "{jwks_file}"', f'jwks_url = "{url}"')
        assert "jwks_file" not in settings and url in settings
        (folder / "api.toml").write_text(settings)
        process, base, _, _ = start_server(folder, server.data, settings=folder / "api.toml")
        try:
            ok = server.jwt("auditor")
            forged_key = OKPKey.generate_key("Ed25519")
            forged_key.ensure_kid()
            forged = jwt.encode(
                {"alg": "EdDSA", "kid": server.oidc_key.kid},
                {
                    "iss": ISSUER,
                    "aud": AUDIENCE,
                    "sub": "x",
                    "exp": int(time.time()) + 60,
                    "keyshred_roles": ["auditor"],
                },
                forged_key,
                algorithms=["EdDSA"],
            )
            statuses = [
                httpx.get(
                    base + "/v1/audit/verify", headers={"Authorization": f"Bearer {t}"}
                ).status_code
                for t in (ok, forged)
            ]
            assert statuses == [200, 401]
        finally:
            stop_server(process)
    finally:
        idp.shutdown()
        idp.server_close()


def test_a_configured_identity_hook_decides_and_its_decision_is_in_the_request(
    tmp_path_factory: pytest.TempPathFactory, server: ApiServer
) -> None:
    folder = tmp_path_factory.mktemp("hook")
    text = (server.data.parent / "api.toml").read_text()
    hooked = 'identity_hook = "tests.api.hooks:tenant_checked"\n' + text
    (folder / "api.toml").write_text(hooked)
    process, base, _, _ = start_server(folder, server.data, settings=folder / "api.toml")
    try:
        auth = {"Authorization": f"Bearer {server.tokens['requester-unverified']}"}
        body = {"subject": "hooked-subject", "reason": "gdpr-art17"}
        refused = httpx.post(base + "/v1/erasure-requests", json=body, headers=auth)
        allowed = httpx.post(
            base + "/v1/erasure-requests",
            json={**body, "tenant": "verified-tenant"},
            headers=auth,
        )
    finally:
        stop_server(process)
    assert refused.status_code == 403
    assert allowed.status_code == 202
    assert allowed.json()["identity"] == {
        "decision": "allowed",
        "method": "document-check",
        "detail": "erasure.create-by-hook",
        "decided_for": "key:requester-unverified",
    }
