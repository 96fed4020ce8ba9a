"""The console: server-rendered pages for privacy and operations staff (``/console``).

Requests with their states and timings, one request's steps and exceptions, its
receipt with the verification result (keyshred's own verifier against the service's
JWKS, computed here), legal holds (list; place and release for operators) and the
latest drill recorded in the store (``keyshred drill --record-in DATA``).

Every page is one of the ``/v1`` operations (``keyshred.api.erasure``, ``holds``),
called the way the app calls them: the token is authenticated by the same
``Authenticator``, the credential's rate limit spent, the role checked against the
operation's roles, the body validated by the operation's model, the handler run in
a thread (owner checks included: a requester sees only its own requests) and the
call audited as ``api.call`` (actor, action, status, the id it was about, and
``via: console``; never a subject). Four reads have no ``/v1`` route and are
console operations of their own, with the roles of their ``/v1`` siblings: a
requester's own requests (what ``erasure.get`` already shows it, one by one), every
active hold, the latest drill. None is in the OpenAPI document (``OPERATIONS`` in
``keyshred.api.app`` builds it; the console's routes are not there).

The session: the token (an API key or an OIDC JWT) is kept in a cookie that is
``HttpOnly`` (no script can read it, so an injected script cannot steal it, as
it could from ``sessionStorage``), ``SameSite=Strict`` (never sent with a request
another site starts), ``Path=/console`` and ``Secure`` over https, and with no
lifetime (it goes with the browser session; a JWT's own ``exp`` still applies, as
it is authenticated again on every page, so a revoked key is refused at once).
No session state lives on the server, so several uvicorn workers serve the console
alike. Forms that change state carry a CSRF token: an HMAC of a fixed label keyed
by the session's token (a page of another origin can neither read the cookie nor
compute it; it says nothing of the token), and a cross-site ``Origin`` is refused.
The login form has its own random token, in a cookie and in the form (login CSRF).

Subjects are typed into POST form bodies, never put in a URL (those reach access
logs), never echoed into a page or an error; pages name subjects by subject_ref.
The pages need no JavaScript: a request in progress refreshes with a meta refresh.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import secrets
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qsl

from pydantic import ValidationError

from keyshred._extras import require
from keyshred.api import erasure, holds
from keyshred.api.auth import Authenticator, Principal, Unauthenticated
from keyshred.api.holds import hold_view
from keyshred.api.operations import Call, Operation, Reply, Services
from keyshred.api.problems import Problem, from_error
from keyshred.api.ratelimit import Buckets, rate_limited
from keyshred.api.settings import ApiSettings
from keyshred.errors import KeyshredError
from keyshred.receipts import load_receipt, verify_receipt

require("jinja2", extra="api")
require("starlette", extra="api")

import jinja2  # noqa: E402 - after the extra's check
from starlette.concurrency import run_in_threadpool  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import HTMLResponse, RedirectResponse, Response  # noqa: E402
from starlette.routing import Route  # noqa: E402

__all__ = ["COOKIE", "DRILL_EVENT", "PREFIX", "csrf_token", "routes"]

PREFIX = "/console"
COOKIE = "keyshred_console"
LOGIN_COOKIE = "keyshred_console_login"
# keyshred.drill.DRILL_EVENT (the drill is a layer above the API: not imported).
DRILL_EVENT = "drill.report"
# A request in one of these states is moving: its page refreshes itself.
IN_PROGRESS = frozenset(
    {"requested", "authorized", "suppressed", "propagating", "verifying", "retryable_failure"}
)
REFRESH_SECONDS = 2
_ANONYMOUS = "anonymous"
_PATH_ID = re.compile(r"[A-Za-z0-9._:+-]{1,64}")  # as keyshred.api.app's
# RFC 6750's b64token: what an API key or a JWT is made of, and safe in a cookie.
_TOKEN = re.compile(r"[A-Za-z0-9._~+/=-]{1,3800}")
_CSRF_LABEL = b"keyshred-console-csrf/1"
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; img-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    # Not no-referrer: browsers then send ``Origin: null`` with a form, and the
    # origin check refuses it. Nothing leaves for another site.
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
_HERE = Path(__file__).parent / "console_templates"
_log = logging.getLogger("keyshred.api")
_OPS = {op.name: op for op in (*erasure.OPERATIONS, *holds.OPERATIONS)}


class _AppState(Protocol):
    """What the console uses of the app's per-process state (``keyshred.api.app``)."""

    auth: Authenticator
    buckets: Buckets
    services: Services
    settings: ApiSettings


# -- the console's own reads (no /v1 route) ------------------------------------------


def _own_requests(call: Call) -> Reply:
    """A requester's own requests: ``erasure.list`` filtered by ``requested_by``."""
    reply = erasure.list_requests(call)
    mine = [v for v in reply.body["requests"] if v["requested_by"] == call.principal.actor]
    return Reply(200, {"requests": mine})


def _active_holds(call: Call) -> Reply:
    return Reply(200, {"holds": [hold_view(h) for h in call.ks.erasure.active_holds()]})


def _latest_drill(call: Call) -> Reply:
    found = call.ks.audit.events(event=DRILL_EVENT)
    if not found:
        return Reply(200, {"drill": None})
    event = found[-1]
    data = event.data
    columns = [
        data.get(n) for n in ("check_names", "check_passed", "check_seconds", "check_details")
    ]
    lists = [c if isinstance(c, list) else [] for c in columns]
    checks = [
        {"name": str(n), "passed": p is True, "seconds": s, "detail": str(d)}
        for n, p, s, d in zip(*lists, strict=False)
    ]
    drill = {
        "at": event.at,
        "seq": event.seq,
        "passed": data.get("passed") is True,
        "profile": str(data.get("profile", "")),
        "subjects": data.get("subjects"),
        "records": data.get("records"),
        "seconds": data.get("seconds"),
        "request_id": str(data.get("drill_request_id", "")),
        "subject_ref": str(data.get("drill_subject_ref", "")),
        "checks": checks,
        "runs": len(found),
    }
    return Reply(200, {"drill": drill})


_OWN = Operation(
    "GET",
    PREFIX + "/requests",
    "erasure.list_own",
    "The caller's own erasure requests",
    frozenset({"requester"}),
    _own_requests,
)
_HOLDS = Operation(
    "GET",
    PREFIX + "/holds",
    "hold.list_active",
    "Every active hold",
    _OPS["hold.list"].roles,
    _active_holds,
)
_DRILL = Operation(
    "GET",
    PREFIX + "/drill",
    "drill.latest",
    "The latest drill recorded in the store",
    frozenset({"operator", "auditor"}),
    _latest_drill,
)


# -- rendering -------------------------------------------------------------------


def _when(value: Any) -> str:
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S UTC")
    try:
        return datetime.fromisoformat(str(value)).strftime("%Y-%m-%d %H:%M:%S UTC")
    except ValueError:  # None, a missing field of an older receipt
        return "—"


def _seconds(value: Any) -> str:
    if not isinstance(value, int | float):
        return "—"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(_HERE),
    autoescape=True,  # every value is escaped; nothing is marked safe
    trim_blocks=True,
    lstrip_blocks=True,
)
_ENV.filters["when"] = _when
_ENV.filters["seconds"] = _seconds
_CSS = (_HERE / "console.css").read_bytes()


def csrf_token(token: str) -> str:
    """The CSRF token of the session whose bearer token is ``token``."""
    key = token.encode("utf-8", "surrogatepass")
    return hmac.new(key, _CSRF_LABEL, hashlib.sha256).hexdigest()


class _Session:
    def __init__(self, principal: Principal, token: str) -> None:
        self.principal = principal
        self.csrf = csrf_token(token)

    def may(self, name: str) -> bool:
        op = {"hold.list_active": _HOLDS, "drill.latest": _DRILL}.get(name) or _OPS[name]
        return self.principal.role in op.roles


def _html(
    template: str, status: int = 200, session: _Session | None = None, **context: Any
) -> HTMLResponse:
    body = _ENV.get_template(template).render(
        session=session, refresh=context.pop("refresh", None), **context
    )
    return HTMLResponse(body, status_code=status, headers=_HEADERS)


def _problem(problem: Problem, session: _Session | None) -> HTMLResponse:
    headers = {k: v for k, v in problem.headers.items() if k == "Retry-After"}
    page = _html("problem.html", problem.status, session, problem=problem)
    page.headers.update(headers)
    return page


def _secure(request: Request) -> bool:
    forwarded = request.headers.get("x-forwarded-proto", "")
    return request.url.scheme == "https" or forwarded.lower() == "https"


def _state(request: Request) -> _AppState:
    state: _AppState = request.app.state.keyshred
    return state


async def _audit(request: Request, actor: str, action: str, status: int, about: str | None) -> None:
    try:
        await run_in_threadpool(
            _state(request).services.ks.audit.record,
            "api.call",
            request_id=about,
            actor=actor,
            action=action,
            status=status,
            via="console",
        )
    except Exception as exc:  # noqa: BLE001 - the answer stands; the log says why
        _log.error("audit of console %s failed: %s", action, type(exc).__name__)


# -- the steps of every page -------------------------------------------------------


async def _session(request: Request, action: str, about: str | None) -> _Session | Response:
    """The authenticated caller, or the page that answers instead (the login)."""
    token = request.cookies.get(COOKIE)
    if not token:
        return RedirectResponse(PREFIX + "/login", status_code=303)
    state = _state(request)
    try:
        principal = await run_in_threadpool(state.auth.authenticate, f"Bearer {token}")
    except Unauthenticated:
        await _audit(request, _ANONYMOUS, action, 401, about)
        page = _login_page(request, 401, "Your token is not valid (any more): log in again.")
        page.delete_cookie(COOKIE, path=PREFIX, httponly=True, samesite="strict")
        return page
    session = _Session(principal, token)
    # In a thread: on a PostgreSQL catalog the bucket is a database round trip.
    wait = await run_in_threadpool(state.buckets.take, principal.credential)
    if wait > 0:
        await _audit(request, principal.actor, action, 429, about)
        problem = rate_limited(wait)
        return _problem(problem, session)
    return session


def _same_origin(request: Request) -> bool:
    origin = request.headers.get("origin")
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in {"same-origin", "none"}:
        return False
    if origin is None:
        return True
    # Behind a proxy that ends TLS the browser's origin is https while this server
    # sees http: the scheme ``_secure`` trusts for the cookie is the page's. (No
    # bypass: a cross-site form cannot set the header, and its Origin names its
    # own host.)
    scheme = "https" if _secure(request) else request.url.scheme
    return origin == f"{scheme}://{request.url.netloc}"


async def _form(request: Request) -> dict[str, str]:
    """The url-encoded form of a POST (never echoed; each name at most once)."""
    limit = _state(request).settings.max_body_bytes
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/x-www-form-urlencoded":
        raise Problem(415, "unsupported-media-type", "The form is not url-encoded")
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise Problem(413, "too-large", "The form is too large", f"at most {limit} bytes")
    try:
        pairs = parse_qsl(raw.decode("utf-8"), keep_blank_values=True, max_num_fields=32)
    except (UnicodeDecodeError, ValueError):
        raise Problem(400, "malformed", "The form cannot be read") from None
    form: dict[str, str] = {}
    for name, value in pairs:
        if name in form:
            raise Problem(400, "malformed", "The form names a field twice")
        form[name] = value
    return form


async def _posted(request: Request, action: str) -> tuple[_Session, dict[str, str]] | Response:
    """A state-changing POST: the session, the same origin, the CSRF token, the form."""
    found = await _session(request, action, None)
    if isinstance(found, Response):
        return found
    try:
        form = await _form(request)
    except Problem as problem:
        await _audit(request, found.principal.actor, action, problem.status, None)
        return _problem(problem, found)
    given = form.pop("csrf", "")
    if not _same_origin(request) or not hmac.compare_digest(given, found.csrf):
        await _audit(request, found.principal.actor, action, 403, None)
        refused = Problem(
            403, "csrf", "The form was refused", "it did not come from this console's page"
        )
        return _problem(refused, found)
    return found, form


async def _perform(
    request: Request,
    session: _Session,
    op: Operation,
    params: Mapping[str, str] | None = None,
    form: Mapping[str, Any] | None = None,
) -> Reply | Response:
    """Run ``op`` as ``/v1`` does (role, body, handler, audit): its reply, or the
    page of its refusal."""
    params = dict(params or {})
    about = next(iter(params.values()), None)
    for value in params.values():
        if not _PATH_ID.fullmatch(value):
            return _problem(Problem(404, "not-found", "No such resource"), session)
    actor, role = session.principal.actor, session.principal.role
    if role not in op.roles:
        await _audit(request, actor, op.name, 403, about)
        return _problem(
            Problem(403, "forbidden", "This role may not do this", f"role {role}"), session
        )
    body = None
    if op.body is not None:
        try:
            body = op.body.model_validate(dict(form or {}))
        except ValidationError as exc:
            fields = sorted(
                {str(e["loc"][0]) for e in exc.errors() if e["loc"]} & set(op.body.model_fields)
            )
            problem = Problem(
                422,
                "invalid-input",
                "The form is not valid",
                "check: " + ", ".join(fields) if fields else None,
            )
            await _audit(request, actor, op.name, 422, about)
            return _problem(problem, session)
    query = {k: [v] for k, v in request.query_params.items()} if op.method == "GET" else {}
    call = Call(_state(request).services, session.principal, body, params, query)
    try:
        reply = await run_in_threadpool(op.handler, call)
    except Problem as refused:
        await _audit(request, actor, op.name, refused.status, about)
        return _problem(refused, session)
    except KeyshredError as exc:
        given = [str(v) for v in (form or {}).values()]
        mapped = from_error(exc, given)
        if mapped.status >= 500:
            _log.error("console %s failed: %s", op.name, type(exc).__name__)
        await _audit(request, actor, op.name, mapped.status, about)
        return _problem(mapped, session)
    except Exception as exc:  # noqa: BLE001 - never a traceback: it may hold values
        _log.error("console %s failed: %s", op.name, type(exc).__name__)
        await _audit(request, actor, op.name, 500, about)
        return _problem(Problem(500, "internal", "The request failed"), session)
    await _audit(request, actor, op.name, reply.status, reply.request_id or about)
    return reply


def _subject_form(form: Mapping[str, str], *names: str) -> dict[str, Any]:
    """A form's fields as the operation's body: blanks of optional fields left out."""
    body: dict[str, Any] = {"subject": form.get("subject", "")}
    for name in ("tenant", *names):
        value = form.get(name, "").strip()
        if value or name == "reason":
            body[name] = value
    return body


# -- pages -------------------------------------------------------------------------


def _login_page(request: Request, status: int = 200, message: str | None = None) -> HTMLResponse:
    nonce = secrets.token_urlsafe(24)
    page = _html("login.html", status, None, message=message, login_csrf=nonce)
    page.set_cookie(
        LOGIN_COOKIE,
        nonce,
        path=PREFIX,
        httponly=True,
        samesite="strict",
        secure=_secure(request),
    )
    return page


async def _login(request: Request) -> Response:
    if request.method == "GET":
        return _login_page(request)
    try:
        form = await _form(request)
    except Problem as problem:
        return _problem(problem, None)
    expected = request.cookies.get(LOGIN_COOKIE, "")
    given = form.get("login_csrf", "")
    if not expected or not _same_origin(request) or not hmac.compare_digest(given, expected):
        return _login_page(request, 403, "The login form expired: try again.")
    token = form.get("token", "").strip()
    try:
        if not _TOKEN.fullmatch(token):
            raise Unauthenticated("the token is not valid")
        principal = await run_in_threadpool(_state(request).auth.authenticate, f"Bearer {token}")
    except Unauthenticated as exc:
        await _audit(request, _ANONYMOUS, "console.login", 401, None)
        return _login_page(request, 401, f"Refused: {exc}.")
    await _audit(request, principal.actor, "console.login", 200, None)
    page = RedirectResponse(PREFIX + "/requests", status_code=303)
    page.set_cookie(
        COOKIE, token, path=PREFIX, httponly=True, samesite="strict", secure=_secure(request)
    )
    page.delete_cookie(LOGIN_COOKIE, path=PREFIX, httponly=True, samesite="strict")
    return page


async def _logout(request: Request) -> Response:
    found = await _posted(request, "console.logout")
    if isinstance(found, Response):
        return found
    await _audit(request, found[0].principal.actor, "console.logout", 200, None)
    page = RedirectResponse(PREFIX + "/login", status_code=303)
    page.delete_cookie(COOKIE, path=PREFIX, httponly=True, samesite="strict")
    return page


def _timings(view: Mapping[str, Any]) -> dict[str, float | None]:
    """Seconds from the request's creation to its suppression, its keys' destruction
    (crypto-erased) and its receipt (completed)."""
    start = datetime.fromisoformat(view["created_at"])
    times = view["step_times"]
    out: dict[str, float | None] = {}
    for label, step in (
        ("suppressed", "suppress"),
        ("crypto_erased", "destroy_keys"),
        ("completed", "receipt"),
    ):
        at = times.get(step)
        out[label] = None if at is None else (datetime.fromisoformat(at) - start).total_seconds()
    return out


async def _requests(request: Request) -> Response:
    if request.method == "POST":
        return await _create(request)
    session = await _session(request, "erasure.list", None)
    if isinstance(session, Response):
        return session
    op = _OWN if session.principal.role == "requester" else _OPS["erasure.list"]
    reply = await _perform(request, session, op)
    if isinstance(reply, Response):
        return reply
    rows = [{**v, "timings": _timings(v)} for v in reversed(reply.body["requests"])]
    state = request.query_params.get("state")
    return _html("requests.html", 200, session, rows=rows, state=state, states=_STATES)


_STATES = (
    "requested",
    "legal_hold",
    "retryable_failure",
    "manual_review",
    "completed",
    "rejected",
)


async def _create(request: Request) -> Response:
    found = await _posted(request, "erasure.create")
    if isinstance(found, Response):
        return found
    session, form = found
    body = _subject_form(form, "scope", "reason")
    body["block"] = form.get("block") == "on"
    reply = await _perform(request, session, _OPS["erasure.create"], form=body)
    if isinstance(reply, Response):
        return reply
    rid = reply.body["request_id"]
    return RedirectResponse(f"{PREFIX}/requests/{rid}", status_code=303)


async def _request(request: Request) -> Response:
    rid = request.path_params["request_id"]
    session = await _session(request, "erasure.get", rid if _PATH_ID.fullmatch(rid) else None)
    if isinstance(session, Response):
        return session
    reply = await _perform(request, session, _OPS["erasure.get"], {"request_id": rid})
    if isinstance(reply, Response):
        return reply
    view = reply.body
    done, times = set(view["steps_done"]), view["step_times"]
    steps = [
        {"name": s, "done": s in done, "at": times.get(s), "current": s == view["step"]}
        for s in _state(request).services.ks.erasure.steps
    ]
    moving = view["state"] in IN_PROGRESS
    return _html(
        "request.html",
        200,
        session,
        view=view,
        steps=steps,
        timings=_timings(view),
        refresh=REFRESH_SECONDS if moving else None,
    )


def _verification(services: Services, body: Mapping[str, Any]) -> tuple[bool, str]:
    """keyshred's own verifier, against the service's published keys (never a key
    named in the receipt): the receipt as the operation served it."""
    ks = services.ks
    try:
        if body["jws"] is not None:
            receipt = load_receipt(body["jws"])
        else:
            issued = ks.erasure.receipt(body["request_id"])
            if issued is None:
                return False, "the receipt is gone"
            receipt = issued
        verify_receipt(receipt, ks.receipts_jwks())
    except KeyshredError as exc:
        return False, f"{type(exc).__name__}: {exc}"
    kid = receipt.kid or "?"
    return True, f"signature valid, by key {kid} of this service's JWKS ({receipt.form} form)"


async def _receipt(request: Request) -> Response:
    rid = request.path_params["request_id"]
    session = await _session(request, "erasure.receipt", rid if _PATH_ID.fullmatch(rid) else None)
    if isinstance(session, Response):
        return session
    reply = await _perform(request, session, _OPS["erasure.receipt"], {"request_id": rid})
    if isinstance(reply, Response):
        return reply
    body = reply.body
    ok, detail = await run_in_threadpool(_verification, _state(request).services, body)
    fields = body["receipt"]
    exceptions = [
        f"external processor {c['processor']}: {c['status']} ({c['detail']})"
        for c in fields.get("external", [])
        if c.get("status") != "acknowledged"
    ] + [
        f"check {c['name']} failed: {c['detail']}"
        for c in fields.get("verification", [])
        if not c.get("passed")
    ]
    return _html(
        "receipt.html",
        200,
        session,
        body=body,
        receipt=fields,
        verified=ok,
        verification=detail,
        exceptions=exceptions,
        pretty=json.dumps(fields, indent=2, sort_keys=True),
    )


async def _holds(request: Request) -> Response:
    if request.method == "POST":
        return await _place(request)
    session = await _session(request, _HOLDS.name, None)
    if isinstance(session, Response):
        return session
    reply = await _perform(request, session, _HOLDS)
    if isinstance(reply, Response):
        return reply
    return _html("holds.html", 200, session, holds=reply.body["holds"])


async def _place(request: Request) -> Response:
    found = await _posted(request, "hold.place")
    if isinstance(found, Response):
        return found
    session, form = found
    body = _subject_form(form, "scope", "reason")
    reply = await _perform(request, session, _OPS["hold.place"], form=body)
    if isinstance(reply, Response):
        return reply
    return RedirectResponse(PREFIX + "/holds", status_code=303)


async def _release(request: Request) -> Response:
    found = await _posted(request, "hold.release")
    if isinstance(found, Response):
        return found
    hold_id = request.path_params["hold_id"]
    reply = await _perform(request, found[0], _OPS["hold.release"], {"hold_id": hold_id})
    if isinstance(reply, Response):
        return reply
    return RedirectResponse(PREFIX + "/holds", status_code=303)


async def _drill(request: Request) -> Response:
    session = await _session(request, _DRILL.name, None)
    if isinstance(session, Response):
        return session
    reply = await _perform(request, session, _DRILL)
    if isinstance(reply, Response):
        return reply
    return _html("drill.html", 200, session, drill=reply.body["drill"])


async def _home(request: Request) -> Response:
    return RedirectResponse(PREFIX + "/requests", status_code=303)


async def _css(request: Request) -> Response:
    return Response(_CSS, media_type="text/css", headers={"Cache-Control": "max-age=300"})


async def _not_found(request: Request) -> Response:
    return _problem(Problem(404, "not-found", "No such page"), None)


def routes() -> list[Route]:
    """The console's routes, for ``create_app``."""
    return [
        Route(PREFIX, _home, methods=["GET"]),
        Route(PREFIX + "/", _home, methods=["GET"]),
        Route(PREFIX + "/console.css", _css, methods=["GET"]),
        Route(PREFIX + "/login", _login, methods=["GET", "POST"]),
        Route(PREFIX + "/logout", _logout, methods=["POST"]),
        Route(PREFIX + "/requests", _requests, methods=["GET", "POST"]),
        Route(PREFIX + "/requests/{request_id}", _request, methods=["GET"]),
        Route(PREFIX + "/requests/{request_id}/receipt", _receipt, methods=["GET"]),
        Route(PREFIX + "/holds", _holds, methods=["GET", "POST"]),
        Route(PREFIX + "/holds/{hold_id}/release", _release, methods=["POST"]),
        Route(PREFIX + "/drill", _drill, methods=["GET"]),
        Route(PREFIX + "/{rest:path}", _not_found, methods=["GET", "POST"]),
    ]
