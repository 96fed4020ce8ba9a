"""The ASGI app: ``create_app(path_or_handle, settings)`` (Starlette).

Every ``/v1`` operation is served the same way, in this order: the Bearer token is
authenticated (401), the credential's rate limit spent (429 with ``Retry-After``),
the role checked (403), the body parsed (400 malformed, 422 invalid), an
``Idempotency-Key`` honoured (the first answer again, or 409), the handler run in a
worker thread, and the call audited (``api.call``: actor, action, status and the id
of what it was about; never a subject). keyshred's errors become problem documents
(``keyshred.api.problems``); anything unexpected is a 500 that names nothing but
its class in the server's log.

Public, unaudited: ``/healthz``, ``/readyz``, ``/openapi.json``, ``/v1/jwks``.
``/console``: the staff's pages over the same operations (``keyshred.api.console``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from keyshred import __version__
from keyshred._extras import require
from keyshred.api import access, chain, consent, console, erasure, holds
from keyshred.api.access import Downloads
from keyshred.api.auth import Authenticator, Unauthenticated
from keyshred.api.health import Readiness
from keyshred.api.idempotency import IdempotencyStore, Stored, check_key
from keyshred.api.identity import load_hook
from keyshred.api.openapi import openapi_document
from keyshred.api.operations import Call, Operation, Reply, Services
from keyshred.api.problems import PROBLEM_JSON, Problem, from_error
from keyshred.api.ratelimit import buckets_for, rate_limited
from keyshred.api.settings import ApiSettings
from keyshred.errors import KeyshredError
from keyshred.facade import Keyshred

require("starlette", extra="api")

from starlette.applications import Starlette  # noqa: E402 - after the extra's check
from starlette.concurrency import run_in_threadpool  # noqa: E402
from starlette.exceptions import HTTPException  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, Response  # noqa: E402
from starlette.routing import Route  # noqa: E402

__all__ = ["OPERATIONS", "VERSION", "create_app"]

VERSION = __version__
OPERATIONS: tuple[Operation, ...] = (
    *erasure.OPERATIONS,
    *holds.OPERATIONS,
    *consent.OPERATIONS,
    *access.OPERATIONS,
    *chain.OPERATIONS,
)
_log = logging.getLogger("keyshred.api")
# Ids in paths: what keyshred issues (hex, uuids) and request ids' usual alphabet.
_PATH_ID = re.compile(r"[A-Za-z0-9._:+-]{1,64}")
_ANONYMOUS = "anonymous"


class _State:
    """The app's parts, built when the store is open (per process)."""

    def __init__(self, ks: Keyshred, settings: ApiSettings, owned: bool) -> None:
        self.ks = ks
        self.owned = owned
        self.settings = settings
        self.auth = Authenticator(settings)
        self.buckets = buckets_for(
            ks.catalog,
            ks.keyring.subject_ref,
            settings.rate_limit.per_second,
            settings.rate_limit.burst,
        )
        self.idempotency = IdempotencyStore(
            ks.catalog, ks.keyring.subject_ref, settings.idempotency_hours
        )
        self.readiness = Readiness(ks)
        self.services = Services(
            ks,
            settings,
            load_hook(settings.identity_hook),
            Downloads(ks.catalog, ks.path / "api-scratch"),
        )


def create_app(
    path_or_handle: str | Path | Keyshred, settings: ApiSettings | None = None
) -> Starlette:
    """The API over a data folder (opened when the app starts, closed when it stops:
    each uvicorn worker process has its own handle) or over an open ``Keyshred``
    (left open)."""
    settings = settings or ApiSettings()
    # Checked now, so a bad setting fails the start rather than the first call.
    load_hook(settings.identity_hook)
    Authenticator(settings)
    holder: dict[str, _State] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if isinstance(path_or_handle, Keyshred):
            state = _State(path_or_handle, settings, owned=False)
        else:
            ks = await run_in_threadpool(Keyshred.open, Path(path_or_handle))
            state = _State(ks, settings, owned=True)
        holder["state"] = state
        app.state.keyshred = state
        try:
            yield
        finally:
            if state.owned:
                await run_in_threadpool(state.ks.close)

    routes = [
        Route("/healthz", _healthz, methods=["GET"]),
        Route("/readyz", _readyz, methods=["GET"]),
        Route("/openapi.json", _openapi, methods=["GET"]),
        Route("/v1/jwks", _jwks, methods=["GET"]),
        *(Route(op.path, _endpoint(op), methods=[op.method]) for op in OPERATIONS),
        # Server-rendered pages over the same operations; not in the OpenAPI document.
        *console.routes(),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error},  # type: ignore[dict-item]
    )


def _state(request: Request) -> _State:
    state: _State = request.app.state.keyshred
    return state


async def _healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok", "components": {}})


async def _readyz(request: Request) -> Response:
    components = await run_in_threadpool(_state(request).readiness.check)
    ready = all(v == "ok" for v in components.values())
    return JSONResponse(
        {"status": "ok" if ready else "unavailable", "components": components},
        status_code=200 if ready else 503,
    )


async def _openapi(request: Request) -> Response:
    return JSONResponse(openapi_document(OPERATIONS, VERSION))


async def _jwks(request: Request) -> Response:
    try:
        keys = await run_in_threadpool(_state(request).ks.receipts_jwks)
    except KeyshredError as exc:
        return _problem(from_error(exc), request.url.path)
    return JSONResponse(keys, headers={"Cache-Control": "max-age=300"})


async def _http_error(request: Request, exc: HTTPException) -> Response:
    slug = {404: "not-found", 405: "method-not-allowed"}.get(exc.status_code, "http-error")
    title = {404: "No such resource", 405: "Method not allowed"}.get(exc.status_code, "Error")
    return _problem(Problem(exc.status_code, slug, title), request.url.path)


def _problem(problem: Problem, instance: str | None = None) -> Response:
    return JSONResponse(
        problem.body(instance),
        status_code=problem.status,
        headers=problem.headers,
        media_type=PROBLEM_JSON,
    )


def _reply_response(reply: Reply) -> Response:
    if reply.content is not None:
        return Response(
            reply.content,
            status_code=reply.status,
            headers=reply.headers,
            media_type=reply.media_type,
        )
    if reply.status == 204:
        return Response(status_code=204, headers=reply.headers)
    return JSONResponse(reply.body, status_code=reply.status, headers=reply.headers)


def _endpoint(op: Operation) -> Any:
    async def endpoint(request: Request) -> Response:
        return await _serve(request, op)

    endpoint.__name__ = op.name.replace(".", "_")
    return endpoint


async def _audit(state: _State, actor: str, op: Operation, status: int, about: str | None) -> None:
    try:
        await run_in_threadpool(
            state.ks.audit.record,
            "api.call",
            request_id=about,
            actor=actor,
            action=op.name,
            status=status,
        )
    except Exception as exc:  # noqa: BLE001 - the answer stands; the log says why
        _log.error("audit of %s failed: %s", op.name, type(exc).__name__)


async def _serve(request: Request, op: Operation) -> Response:
    state = _state(request)
    instance = request.url.path
    params = dict(request.path_params)
    about = None
    for value in params.values():
        if not _PATH_ID.fullmatch(str(value)):
            # Not an id keyshred issues: never echoed, nor audited as given.
            return _problem(Problem(404, "not-found", "No such resource"), instance)
        about = str(value)
    try:
        # In a thread: a JWKS fetched from the identity provider blocks (cached after).
        principal = await run_in_threadpool(
            state.auth.authenticate, request.headers.get("authorization")
        )
    except Unauthenticated as exc:
        await _audit(state, _ANONYMOUS, op, 401, about)
        problem = Problem(
            401,
            "unauthenticated",
            "Authentication required",
            str(exc),
            headers={"WWW-Authenticate": 'Bearer realm="keyshred"'},
        )
        return _problem(problem, instance)
    # In a thread: on a PostgreSQL catalog the bucket is a database round trip.
    wait = await run_in_threadpool(state.buckets.take, principal.credential)
    if wait > 0:
        await _audit(state, principal.actor, op, 429, about)
        problem = rate_limited(wait)
        return _problem(problem, instance)
    if principal.role not in op.roles:
        await _audit(state, principal.actor, op, 403, about)
        problem = Problem(403, "forbidden", "This role may not do this", f"role {principal.role}")
        return _problem(problem, instance)
    try:
        body, canonical = await _body(request, op, state.settings.max_body_bytes)
    except Problem as problem:
        await _audit(state, principal.actor, op, problem.status, about)
        return _problem(problem, instance)
    call = Call(state.services, principal, body, params, _query(request))
    key_header = request.headers.get("idempotency-key")
    if op.method != "POST" or key_header is None:
        status, response, about = await _run(op, call, instance, about)
        await _audit(state, principal.actor, op, status, about)
        return response
    return await _idempotent(state, op, call, key_header, canonical, instance, about)


async def _idempotent(  # noqa: PLR0917 - one call's parts, passed on
    state: _State,
    op: Operation,
    call: Call,
    key_header: str,
    canonical: Any,
    instance: str,
    about: str | None,
) -> Response:
    actor = call.principal.actor
    try:
        key = check_key(key_header)
        body_hash = state.idempotency.request_hash(f"{op.name} {instance}", canonical)
        stored = await run_in_threadpool(state.idempotency.begin, actor, key, body_hash)
    except Problem as refused:
        await _audit(state, actor, op, refused.status, about)
        return _problem(refused, instance)
    except KeyshredError as exc:
        mapped = from_error(exc)
        await _audit(state, actor, op, mapped.status, about)
        return _problem(mapped, instance)
    if stored is not None:
        await _audit(state, actor, op, stored.status, _about(stored.body) or about)
        return _replayed(stored)
    status, response, about = await _run(op, call, instance, about)
    try:
        if status >= 500:
            await run_in_threadpool(state.idempotency.abandon, actor, key)
        else:
            body = json.loads(bytes(response.body)) if response.body else None
            location = response.headers.get("location")
            kept = Stored(status, body, location)
            await run_in_threadpool(state.idempotency.finish, actor, key, kept)
    except Exception as exc:  # noqa: BLE001 - the answer stands; a retry runs again
        _log.error("idempotency record of %s failed: %s", op.name, type(exc).__name__)
    await _audit(state, actor, op, status, about)
    return response


def _about(body: Any) -> str | None:
    if isinstance(body, dict):
        for name in ("request_id", "hold_id", "export_id"):
            if isinstance(body.get(name), str):
                return str(body[name])
    return None


def _replayed(stored: Stored) -> Response:
    headers = {"Idempotent-Replayed": "true"}
    if stored.location:
        headers["Location"] = stored.location
    if stored.status == 204:
        return Response(status_code=204, headers=headers)
    media = PROBLEM_JSON if stored.status >= 400 else "application/json"
    return JSONResponse(stored.body, status_code=stored.status, headers=headers, media_type=media)


async def _run(
    op: Operation, call: Call, instance: str, about: str | None
) -> tuple[int, Response, str | None]:
    try:
        reply = await run_in_threadpool(op.handler, call)
    except Problem as refused:
        return refused.status, _problem(refused, instance), about
    except KeyshredError as exc:
        mapped = from_error(exc, _strings(call.body))
        if mapped.status >= 500:
            _log.error("%s failed: %s", op.name, type(exc).__name__)
        return mapped.status, _problem(mapped, instance), about
    except Exception as exc:  # noqa: BLE001 - never a traceback: it may hold values
        _log.error("%s failed: %s", op.name, type(exc).__name__)
        return 500, _problem(Problem(500, "internal", "The request failed"), instance), about
    return reply.status, _reply_response(reply), reply.request_id or about


def _strings(body: BaseModel | None) -> list[str]:
    """Every string of a parsed body (what an error's message must not repeat)."""
    if body is None:
        return []
    found: list[str] = []
    stack: list[Any] = [body.model_dump(mode="json")]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _query(request: Request) -> Mapping[str, list[str]]:
    query: dict[str, list[str]] = {}
    for name, value in request.query_params.multi_items():
        query.setdefault(name, []).append(value)
    return query


async def _body(request: Request, op: Operation, limit: int) -> tuple[BaseModel | None, Any]:
    """The parsed body model and the body's JSON (what idempotency hashes)."""
    if op.body is None:
        return None, None
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise Problem(413, "too-large", "The body is too large", f"at most {limit} bytes")
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise Problem(413, "too-large", "The body is too large", f"at most {limit} bytes")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise Problem(400, "malformed", "The body is not JSON") from None
    try:
        model = op.body.model_validate(data)
    except ValidationError as exc:
        fields = set(op.body.model_fields)
        errors = [
            {
                "loc": [p if isinstance(p, int) or p in fields else "*" for p in e["loc"]],
                "type": e["type"],
                "msg": e["msg"],
            }
            for e in exc.errors(include_url=False, include_input=False, include_context=False)
        ]
        raise Problem(422, "invalid-input", "The body is not valid", errors=errors) from None
    return model, data
