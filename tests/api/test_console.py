"""The console (``/console``) against the real server process: in Debian's Chromium,
headless, driven by Playwright (never a browser Playwright downloads), and with plain
HTTP for the handlers' refusals (CSRF, 403, 401, bad input, escaping).

The browser logs in with an operator token, records an erasure request for a probe
subject, watches its page refresh itself until a ``keyshred worker`` process has
completed it, and opens its receipt, verified server-side. A requester and an
auditor see what their roles allow; a bad token is refused. No page, access-log
line or audit event holds a probe subject id.

``KEYSHRED_CONSOLE_SCREENSHOT=docs/console.png`` saves the screenshot the README
shows (the requests page after the run).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from playwright import sync_api as playwright_api

from keyshred.api.console import COOKIE, DRILL_EVENT, csrf_token
from keyshred.schema import audit_events
from tests import zygote
from tests.api.conftest import ApiServer

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Subjects of this file only: found in no page, log line or audit event.
PROBES = (
    "console-probe-subject-ines-5rq8@example.com",
    "console-probe-subject-jules-2wd6@example.com",
    "console-probe-subject-karl-8pf3@example.com",
    "console-probe-subject-lena-4hn1@example.com",
)
KEYSHRED = str(Path(sys.executable).parent / "keyshred")


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One headless Chromium with a fresh profile folder; tests clear its cookies."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: scripts/ensure-chromium.sh installs it")
    profile = tmp_path_factory.mktemp("chromium-profile")
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(profile),
            executable_path=CHROMIUM,
            args=ARGS,
            headless=True,
            viewport={"width": 1280, "height": 860},
        )
        browser.set_default_timeout(30_000)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(context: Any) -> Iterator[Any]:
    """A new tab without cookies; ``tab.loads`` counts the documents it loaded."""
    context.clear_cookies()
    tab = context.new_page()
    tab.loads = []
    tab.on("load", lambda loaded: tab.loads.append(loaded.url))
    try:
        yield tab
        scan(tab)
    finally:
        tab.close()


def scan(page: Any) -> None:
    """The page's HTML holds no probe subject id."""
    html = page.content()
    for probe in PROBES:
        assert probe not in html, f"probe #{PROBES.index(probe)} in {page.url}"


def submit(page: Any, button: str) -> None:
    """Click a form's button and wait for the page it leads to."""
    with page.expect_navigation():
        page.click(button)


def login(page: Any, server: ApiServer, token: str) -> None:
    page.goto(server.url + "/console")
    assert page.url.endswith("/console/login")  # no session: the login page
    page.fill("#token", token)
    submit(page, "main button[type=submit]")
    scan(page)


def worker(server: ApiServer) -> zygote.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYSHRED_")}
    return zygote.Popen(
        [KEYSHRED, "worker", "--path", str(server.data)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_an_operator_records_an_erasure_watches_it_complete_and_opens_its_verified_receipt(
    server: ApiServer, page: Any
) -> None:
    subject = PROBES[0]
    with server.client("operator") as op:  # something of the subject is stored
        granted = op.post("/v1/consents", json={"subject": subject, "scope": "marketing/email"})
        assert granted.status_code == 201, granted.text
    login(page, server, server.tokens["operator"])
    assert page.url.endswith("/console/requests")
    assert page.inner_text("#who") == "key:operator · operator"
    cookie = next(c for c in page.context.cookies() if c["name"] == COOKIE)
    assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict"
    assert cookie["path"] == "/console"
    assert page.evaluate("document.cookie") == ""  # no script reads the token

    page.fill("#create #subject", subject)
    page.fill("#create #reason", "gdpr-art17")
    submit(page, "#create button[type=submit]")
    assert re.search(r"/console/requests/[0-9a-f]{32}$", page.url), page.url
    rid = page.url.rsplit("/", 1)[1]
    # No worker runs yet: the request waits, and its page refreshes itself.
    assert page.inner_text("#state") == "requested"
    assert page.locator("meta[http-equiv=refresh]").count() == 1
    assert page.locator("#receipt-link").count() == 0
    scan(page)
    loads = len(page.loads)
    running = worker(server)
    try:
        # Nothing reloads the page but its own meta refresh.
        page.wait_for_selector("#state:text-is('completed')", timeout=90_000)
    finally:
        running.terminate()
        running.wait(timeout=30)
    # At least one reload, its own: a worker that finishes within one refresh
    # interval (2 s) is seen at the first (this asked for two, a timing).
    assert len(page.loads) > loads, "the page did not refresh itself"
    scan(page)
    assert page.locator("meta[http-equiv=refresh]").count() == 0  # done: no more refresh
    steps = page.inner_text("#steps")
    assert "destroy_keys" in steps and "receipt" in steps and "next" not in steps

    submit(page, "#receipt-link")
    assert page.url.endswith(f"/console/requests/{rid}/receipt")
    verdict = page.inner_text("#verification")
    assert verdict.startswith("verified"), verdict
    with server.client("operator") as op:
        kid = op.get(f"/v1/erasure-requests/{rid}/receipt").json()["kid"]
    assert kid in verdict  # the service's key, named by its thumbprint
    scan(page)

    page.goto(server.url + "/console/requests")
    row = page.locator("#requests tr", has=page.locator(f"a[href='/console/requests/{rid}']"))
    cells = row.locator("td").all_inner_texts()
    assert cells[3] == "completed"
    assert all(re.fullmatch(r"\d+ ms|\d+\.\d\d s", t) for t in cells[6:9]), cells
    shot = os.environ.get("KEYSHRED_CONSOLE_SCREENSHOT")
    if shot:
        page.screenshot(path=shot, full_page=False)

    # Logging out ends the session: the next page is the login again.
    submit(page, "header button[type=submit]")
    assert page.url.endswith("/console/login")
    page.goto(server.url + "/console/requests")
    assert page.url.endswith("/console/login")

    # Neither the access log nor the audit log holds the subject (the URL did not).
    assert subject not in server.logs()
    assert f'"GET /console/requests/{rid}/receipt HTTP/1.1" 200' in server.logs()
    events = _audit_calls(server)
    assert subject not in json.dumps([e["data"] for e in events])
    mine = [e["data"] for e in events if e["request_id"] == rid and "via" in e["data"]]
    assert {(d["action"], d["via"], d["status"]) for d in mine} >= {
        ("erasure.create", "console", 202),
        ("erasure.get", "console", 200),
        ("erasure.receipt", "console", 200),
    }
    assert all(d["actor"] == "key:operator" for d in mine)


def test_a_requester_sees_only_its_own_requests_and_no_holds(server: ApiServer, page: Any) -> None:
    with server.client("operator") as op:
        others = op.post("/v1/erasure-requests", json={"subject": PROBES[1], "reason": "other"})
        assert others.status_code == 202
    other = others.json()["request_id"]
    login(page, server, server.tokens["requester"])
    assert page.inner_text("#who") == "key:requester · requester"
    nav = page.inner_text("header nav")
    assert "Requests" in nav and "Holds" not in nav and "Latest drill" not in nav
    page.fill("#create #subject", PROBES[2])
    page.fill("#create #reason", "user-request")
    submit(page, "#create button[type=submit]")
    mine = page.url.rsplit("/", 1)[1]
    assert page.inner_text("#state") == "requested"
    scan(page)
    page.goto(server.url + "/console/requests")
    listed = page.locator("#requests tbody a").evaluate_all("(a) => a.map(e => e.href)")
    assert any(h.endswith(mine) for h in listed)
    assert not any(h.endswith(other) for h in listed)
    assert set(page.locator("#requests tbody td:nth-child(5)").all_inner_texts()) == {
        "key:requester"
    }
    # Another caller's request, the holds and the drill: refused pages, not errors.
    for path in (f"/requests/{other}", "/holds", "/drill"):
        answer = page.goto(server.url + "/console" + path)
        assert answer.status == 403, path
        assert page.inner_text("#status") == "403"


def test_an_auditor_reads_everything_and_changes_nothing(server: ApiServer, page: Any) -> None:
    with server.client("operator") as op:
        held = op.post("/v1/holds", json={"subject": PROBES[3], "reason": "case-77"})
        assert held.status_code == 201
    login(page, server, server.tokens["auditor"])
    assert page.inner_text("#who") == "key:auditor · auditor"
    assert page.locator("#create").count() == 0  # no form to record a request
    assert page.locator("#requests tbody tr").count() >= 1
    page.goto(server.url + "/console/holds")
    assert held.json()["hold_id"][:12] in page.inner_text("#holds")
    assert page.locator("#place").count() == 0 and page.locator("text=Release").count() == 0
    # The form the auditor has no button for, posted anyway: a 403 page.
    csrf = page.locator("header input[name=csrf]").get_attribute("value")
    refused = page.request.post(
        server.url + "/console/requests",
        form={"csrf": csrf, "subject": PROBES[3], "reason": "nope"},
        headers={"Origin": server.url},
    )
    assert refused.status == 403
    assert refused.headers["content-type"].startswith("text/html")
    assert PROBES[3] not in refused.text()
    page.goto(server.url + "/console/drill")
    assert page.locator("h1").inner_text() == "Latest drill"


def test_an_operator_places_and_releases_a_hold(server: ApiServer, page: Any) -> None:
    login(page, server, server.tokens["operator"])
    page.goto(server.url + "/console/holds")
    before = page.locator("#holds tbody form").count()
    page.fill("#place #subject", PROBES[1])
    page.fill("#place #reason", "case-4711")
    submit(page, "#place button[type=submit]")
    assert page.url.endswith("/console/holds")
    row = page.locator("#holds tbody tr", has_text="case-4711")
    assert row.locator("td").nth(3).inner_text() == "case-4711"
    assert row.locator("td").nth(4).inner_text() == "key:operator"
    ref = row.locator("td").nth(1).inner_text()
    with server.client("operator") as op:  # the same hold, by the API
        found = op.post("/v1/holds/search", json={"subject": PROBES[1]}).json()["holds"]
    assert [h["subject_ref"] for h in found if h["reason"] == "case-4711"] == [ref]
    assert page.locator("#holds tbody form").count() == before + 1
    scan(page)
    submit(page, "#holds tbody tr:has-text('case-4711') button")
    assert page.locator("#holds tbody tr", has_text="case-4711").count() == 0
    with server.client("operator") as op:
        found = op.post("/v1/holds/search", json={"subject": PROBES[1]}).json()["holds"]
    assert not [h for h in found if h["reason"] == "case-4711"]


def test_a_bad_token_is_refused_and_an_oidc_token_logs_in(server: ApiServer, page: Any) -> None:
    login(page, server, "not-a-key-of-this-service")
    assert page.url.endswith("/console/login")
    assert page.inner_text("#message") == "Refused: the token is not valid."
    assert not [c for c in page.context.cookies() if c["name"] == COOKIE]
    login(page, server, server.jwt("operator", sub=PROBES[0]))
    who = page.inner_text("#who")
    assert re.fullmatch(r"oidc:[0-9a-f]{24} · operator", who), who


def test_the_latest_drill_is_the_one_recorded_in_the_store(
    server: ApiServer, page: Any, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYSHRED_")}
    ran = zygote.run(
        [
            *(KEYSHRED, "drill", "--subjects", "3", "--memories", "2", "--json"),
            *("--receipt-dir", str(tmp_path), "--record-in", str(server.data)),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    report = json.loads(ran.stdout)
    login(page, server, server.tokens["operator"])
    page.goto(server.url + "/console/drill")
    assert page.inner_text("#drill-verdict").startswith("all checks passed")
    shown = page.locator("#checks tbody td:first-child").all_inner_texts()
    assert shown == [c["name"] for c in report["checks"]]
    assert report["request_id"] in page.inner_text("main")
    # The event holds no path of the drill's folder (it may name a person's home).
    event = _audit_calls(server, DRILL_EVENT)[-1]
    assert event["data"]["check_names"] == shown
    assert report["path"] not in json.dumps(event["data"])


# -- the handlers over plain HTTP ---------------------------------------------------


def _session(server: ApiServer, role: str) -> tuple[httpx.Client, str]:
    """A client logged in through the login form, and its CSRF token."""
    client = httpx.Client(base_url=server.url, timeout=30)
    form = client.get("/console/login")  # the caller closes the client
    nonce = re.search(r'name="login_csrf" value="([^"]+)"', form.text)
    assert nonce is not None
    done = client.post(
        "/console/login", data={"token": server.tokens[role], "login_csrf": nonce.group(1)}
    )
    assert done.status_code == 303 and done.headers["location"] == "/console/requests"
    return client, csrf_token(server.tokens[role])


def _count(server: ApiServer) -> int:
    with server.client("operator") as op:
        return len(op.get("/v1/erasure-requests").json()["requests"])


def test_forms_without_the_sessions_csrf_token_or_from_another_origin_are_refused(
    server: ApiServer,
) -> None:
    client, csrf = _session(server, "operator")
    before = _count(server)
    body = {"subject": PROBES[1], "reason": "gdpr-art17"}
    other = csrf_token(server.tokens["requester"])
    try:
        for form, headers in (
            (body, {}),  # no token
            ({**body, "csrf": "0" * 64}, {}),  # a wrong one
            ({**body, "csrf": other}, {}),  # another session's
            ({**body, "csrf": csrf}, {"Origin": "https://evil.example"}),
            ({**body, "csrf": csrf}, {"Sec-Fetch-Site": "cross-site"}),
        ):
            refused = client.post("/console/requests", data=form, headers=headers)
            assert refused.status_code == 403, form.keys()
            assert "The form was refused" in refused.text
            assert PROBES[1] not in refused.text
        assert _count(server) == before
        release = client.post("/console/holds/abc123/release", data={"csrf": ""})
        assert release.status_code == 403
        # The login form has its own token: a cross-site login is refused too.
        fresh = httpx.post(
            server.url + "/console/login",
            data={"token": server.tokens["operator"], "login_csrf": "x"},
        )
        assert fresh.status_code == 403 and f"{COOKIE}=" not in fresh.headers["set-cookie"]
    finally:
        client.close()


def test_a_login_through_a_proxy_that_ends_tls_is_same_origin(server: ApiServer) -> None:
    """The browser's Origin is https behind a TLS-terminating proxy while the server
    sees http: with ``X-Forwarded-Proto: https`` (the scheme the cookie's Secure
    flag trusts) the form is the console's own; without it the origins differ."""
    netloc = server.url.split("://", 1)[1]
    for forwarded, status in (({"X-Forwarded-Proto": "https"}, 303), ({}, 403)):
        with httpx.Client(base_url=server.url, timeout=30) as client:
            nonce = re.search(
                r'name="login_csrf" value="([^"]+)"', client.get("/console/login").text
            )
            assert nonce is not None
            done = client.post(
                "/console/login",
                data={"token": server.tokens["auditor"], "login_csrf": nonce.group(1)},
                headers={"Origin": f"https://{netloc}", **forwarded},
            )
        assert done.status_code == status, forwarded
        if status == 303:
            assert "secure" in done.headers["set-cookie"].lower()


def test_bad_input_is_a_typed_page_that_never_echoes_it(server: ApiServer) -> None:
    client, csrf = _session(server, "operator")
    try:
        bad = client.post(
            "/console/requests", data={"csrf": csrf, "subject": PROBES[1], "reason": "<b>x\n"}
        )
        assert bad.status_code == 422
        assert "check: reason" in bad.text and "<b>x" not in bad.text
        assert PROBES[1] not in bad.text
        scope = client.post(
            "/console/requests",
            data={"csrf": csrf, "subject": PROBES[1], "reason": "r", "scope": "<i>" + PROBES[1]},
        )
        assert scope.status_code == 422 and PROBES[1] not in scope.text and "<i>" not in scope.text
        json_body = client.post("/console/requests", json={"csrf": csrf, "subject": PROBES[1]})
        assert json_body.status_code == 415
        twice = client.post(
            "/console/requests",
            content=f"csrf={csrf}&csrf={csrf}",
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        assert twice.status_code == 400
        odd = client.get("/console/requests/" + "%3Cscript%3E")
        assert odd.status_code == 404 and "<script>" not in odd.text
        unknown = client.get("/console/requests/" + "f" * 32)
        assert unknown.status_code == 404
        missing = client.post("/console/holds/" + "e" * 32 + "/release", data={"csrf": csrf})
        assert missing.status_code == 404
        gone = client.get("/console/no-such-page")
        assert gone.status_code == 404
    finally:
        client.close()
    assert not re.search(r'HTTP/1\.1" 5\d\d', server.logs())


def test_pages_without_a_valid_session_go_to_the_login(server: ApiServer) -> None:
    fresh = httpx.get(server.url + "/console/holds")
    assert fresh.status_code == 303 and fresh.headers["location"] == "/console/login"
    stale = httpx.get(server.url + "/console/holds", cookies={COOKIE: "revoked-or-forged"})
    assert stale.status_code == 401
    assert "Your token is not valid" in stale.text
    assert (
        f"{COOKIE}=" in stale.headers["set-cookie"] and "Max-Age=0" in stale.headers["set-cookie"]
    )
    page = httpx.get(server.url + "/console/login")
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "frame-ancestors 'none'" in policy
    assert page.headers["cache-control"] == "no-store"


def test_the_console_is_not_in_the_openapi_document(server: ApiServer) -> None:
    served = httpx.get(server.url + "/openapi.json").json()
    assert not [p for p in served["paths"] if p.startswith("/console")]


def test_pages_escape_what_they_show() -> None:
    from keyshred.api.console import _html
    from keyshred.api.problems import Problem

    markup = "<script>alert(1)</script>\"'&"
    page = _html("problem.html", 409, None, problem=Problem(409, "x", markup, markup))
    text = page.body.decode()
    assert "<script>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&#34;&#39;&amp;" in text
    view = {
        "request_id": "r1",
        "subject_ref": markup,
        "scope": markup,
        "kind": "erasure",
        "state": "manual_review",
        "requested_by": markup,
        "reason": markup,
        "created_at": "2026-01-01T00:00:00+00:00",
        "updated_at": "2026-01-01T00:00:01+00:00",
        "attempts": 1,
        "steps_done": [],
        "step_times": {},
        "step": "suppress",
        "error": markup,
        "error_class": markup,
        "found_data": None,
        "identity": {"method": markup, "decision": markup, "decided_for": markup},
        "receipt_available": False,
    }
    steps = [{"name": markup, "done": False, "at": None, "current": True}]
    timings = {"suppressed": None, "crypto_erased": None, "completed": None}
    html = _html("request.html", 200, None, view=view, steps=steps, timings=timings).body
    assert b"<script>" not in html and html.count(b"&lt;script&gt;") >= 8


def _audit_calls(server: ApiServer, event: str = "api.call") -> list[dict[str, Any]]:
    engine = sa.create_engine(f"sqlite:///{server.data / 'catalog' / 'catalog.db'}")
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.select(audit_events).where(audit_events.c.event == event))
            return [
                {"seq": r.seq, "request_id": r.request_id, "data": json.loads(r.data)} for r in rows
            ]
    finally:
        engine.dispose()


def test_no_probe_subject_in_the_servers_output_or_audit_log(server: ApiServer) -> None:
    logs = server.logs()
    assert "/console/" in logs  # the access log is there
    audit = json.dumps([e["data"] for e in _audit_calls(server)])
    for probe in PROBES:
        for form in {probe, probe.upper(), json.dumps(probe)[1:-1]}:
            assert form not in logs, f"probe #{PROBES.index(probe)} in the server's output"
            assert form not in audit, f"probe #{PROBES.index(probe)} in the audit log"
    assert "Traceback" not in logs


def test_the_receipt_verdict_is_keyshreds_verifier_against_the_services_keys(
    tmp_path: Path,
) -> None:
    """A receipt altered, or signed by a key the service does not publish, is shown
    as not verified (the page's verdict is the verifier's, not a constant)."""
    import base64
    import secrets
    from types import SimpleNamespace

    from keyshred import Keyshred
    from keyshred.api.console import _verification
    from keyshred.keyring.keyring import Signer
    from keyshred.receipts import load_receipt, sign_receipt

    with Keyshred.init(tmp_path / "d") as ks:
        ks.memories.put(PROBES[0], ("notes",), "k", {"text": "x"})
        rid = ks.erase(PROBES[0], requested_by="t", reason="test").request_id
        jws = ks.erasure.receipt(rid).serialize()  # type: ignore[union-attr]
        services = SimpleNamespace(ks=ks)
        ok, detail = _verification(services, {"request_id": rid, "jws": jws})  # type: ignore[arg-type]
        assert ok and detail.startswith("signature valid")
        header, payload, signature = jws.split(".")
        fields = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        fields["found_data"] = not fields["found_data"]
        edited = base64.urlsafe_b64encode(json.dumps(fields).encode()).rstrip(b"=").decode()
        altered = f"{header}.{edited}.{signature}"
        ok, detail = _verification(services, {"request_id": rid, "jws": altered})  # type: ignore[arg-type]
        assert not ok and detail.startswith("IntegrityError"), detail
        # The same fields re-signed by a key of someone else's (a well-formed JWS).
        resigned = sign_receipt(load_receipt(jws), Signer(secrets.token_bytes(32))).serialize()
        ok, detail = _verification(services, {"request_id": rid, "jws": resigned})  # type: ignore[arg-type]
        assert not ok and detail.startswith("UntrustedSigner"), detail
