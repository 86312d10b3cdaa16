"""The aiohttp application: routes, auth, and errors as OpenAI-shaped JSON."""

from __future__ import annotations

import asyncio
import hmac
import uuid

import orjson
import structlog
from aiohttp import web

import vlmd
from vlmd.errors import AuthenticationError, HttpError, ServiceUnavailableError, VlmdError, as_client_error
from vlmd.server.audio import transcriptions, translations
from vlmd.server.chat import chat_completions
from vlmd.server.completions import completions
from vlmd.server.encoder_route import encoder_outputs
from vlmd.server.realtime import realtime
from vlmd.server.responses_route import create_response
from vlmd.server.tokenize import detokenize, tokenize
from vlmd.server.metrics import CONTENT_TYPE
from vlmd.server.state import ServerState

log = structlog.get_logger(__name__)

# Characters of an error's full text that the log keeps: a message may quote a client's
# value (a library's parse error, a field), and a request must not write megabytes of log.
LOGGED_DETAIL_CHARACTERS = 2000


def _error_response(
    status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None
) -> web.Response:
    return vlmd_error_response(HttpError(status, message, kind=kind, headers=headers))


def _http_error_response(request: web.Request, exc: web.HTTPException) -> web.Response:
    """aiohttp's own errors (routing, body size) as JSON that says what was wrong."""
    if exc.status == 404:
        message = f"no route for {request.method} {request.path}"
        return _error_response(404, message, "not_found_error")
    if exc.status == 405:
        allowed = ", ".join(sorted(getattr(exc, "allowed_methods", ()) or ()))
        message = f"method {request.method} is not allowed for {request.path}"
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return _error_response(405, message + (f"; use {allowed}" if allowed else ""), headers=headers)
    # aiohttp's text is specific (e.g. the body size limit and the actual size); its
    # reason phrase is the fallback.
    text = (exc.text or "").strip()
    message = text.split(": ", 1)[1] if text.startswith(f"{exc.status}: ") else text
    return _error_response(exc.status, message or exc.reason or "error")


# Retry-After while the model loads: a client comes back soon, a probe polls on its own period.
LOADING_RETRY_AFTER_S = 5


@web.middleware
async def until_loaded(request: web.Request, handler):
    """While the model loads, every route answers at once: 503 "loading" with Retry-After (a
    readiness probe, /health, sees not-ready; a client sees when to come back), instead of
    the connection waiting in the listen backlog until the load is done."""
    state: ServerState = request.app["state"]
    if not state.ready:
        return vlmd_error_response(ServiceUnavailableError(
            f"loading: the model `{state.config.model_name}` is not loaded yet; retry later",
            retry_after_s=LOADING_RETRY_AFTER_S))
    return await handler(request)


@web.middleware
async def errors_as_json(request: web.Request, handler):
    try:
        return await handler(request)
    except VlmdError as exc:
        if exc.detail != exc.message:  # the client got a trimmed message: the log keeps it whole
            log.info("error message trimmed for the client", path=request.path, status=exc.status,
                     detail=logged_detail(exc.detail))
        return vlmd_error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _http_error_response(request, exc)
    except asyncio.CancelledError:
        raise
    except ConnectionResetError as exc:
        if request.transport is None or request.transport.is_closing():
            # The client left mid-answer: a normal abort. aiohttp drops this response
            # quietly when it finds the connection gone.
            log.info("client disconnected", path=request.path)
            return web.Response(status=499)
        return _unhandled(request, exc)
    except Exception as exc:
        return _unhandled(request, exc)


def logged_detail(text: str) -> str:
    """``text`` as the log keeps it: at most ``LOGGED_DETAIL_CHARACTERS``, and how long it was."""
    if len(text) <= LOGGED_DETAIL_CHARACTERS:
        return text
    return f"{text[:LOGGED_DETAIL_CHARACTERS]}\u2026 ({len(text)} characters in all)"


def _unhandled(request: web.Request, exc: Exception) -> web.Response:
    """A server fault: logged with an id the client is given, never its internals."""
    error_id = f"err-{uuid.uuid4().hex[:16]}"
    log.error("unhandled error", path=request.path, request_id=error_id, exc_info=exc)
    return vlmd_error_response(as_client_error(exc, error_id))


def vlmd_error_response(exc: VlmdError) -> web.Response:
    """The one rendering of vlmd.errors: status, JSON body, headers (Retry-After)."""
    response = web.Response(
        body=orjson.dumps(exc.to_dict()), status=exc.status, content_type="application/json", headers=exc.headers
    )
    if exc.status == 408:  # the rest of that body may never come: the connection is not reused
        response.force_close()
    return response


def _auth_middleware(api_key: str):
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check_api_key(request: web.Request, handler):
        if request.path != "/health":
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                raise AuthenticationError("invalid or missing API key")
        return await handler(request)

    return check_api_key


async def models(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    body = {
        "object": "list",
        "data": [
            {
                "id": state.config.model_name,
                "object": "model",
                "created": state.created,
                "owned_by": "vlmd",
                "root": state.config.model,
                "max_model_len": state.max_model_len,
            }
        ],
    }
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def health(request: web.Request) -> web.Response:
    """Liveness: 200 with an empty body (``/ping`` is the same, under the API key); 503 once
    the model cannot run any more (a tensor-parallel rank was lost)."""
    state: ServerState = request.app["state"]
    if state.fatal_error is not None:
        return _error_response(503, f"the engine cannot run: {state.fatal_error}", "server_error")
    return web.Response(text="")


async def version(request: web.Request) -> web.Response:
    return web.Response(body=orjson.dumps({"version": vlmd.__version__}), content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def get_load(request: web.Request) -> web.Response:
    """``{"load": N}``: the requests this server holds now, admitted and not finished (bodies
    being read, preprocessing, waiting for the engine, running). vllm-router (and SGLang's
    gateway, whose code it started from) polls each worker's ``GET /get_load`` for the
    power_of_two policy and reads the integer ``load``; without the route every worker's
    load is unknown and power_of_two cannot tell them apart. (cache_aware balances on the
    router's own count of requests in flight, and reads nothing from the worker.) Counted in
    requests, as those routers compare it; under ``--api-key`` it needs the key, as /metrics
    does, and the router sends it (``--api-key``)."""
    state: ServerState = request.app["state"]
    load = state.admission.num_waiting + state.engine.stats.num_running
    return web.Response(body=orjson.dumps({"load": load}), content_type="application/json")


def create_app(state: ServerState) -> web.Application:
    middlewares = [until_loaded, errors_as_json]
    if state.config.api_key:
        middlewares.append(_auth_middleware(state.config.api_key))
    app = web.Application(middlewares=middlewares, client_max_size=state.config.max_request_bytes)
    app["state"] = state
    if state.config.encoder_only:  # an encoder server: encoder outputs, no generation
        app.router.add_post("/v1/encoder_outputs", encoder_outputs)
    else:
        app.router.add_post("/v1/chat/completions", chat_completions)
        app.router.add_post("/v1/completions", completions)
        app.router.add_post("/v1/responses", create_response)
        app.router.add_post("/tokenize", tokenize)
        app.router.add_post("/detokenize", detokenize)
        app.router.add_post("/v1/audio/transcriptions", transcriptions)
        app.router.add_post("/v1/audio/translations", translations)
        app.router.add_get("/v1/realtime", realtime)
    app.router.add_get("/version", version)
    app.router.add_get("/ping", health)
    app.router.add_post("/ping", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/get_load", get_load)
    return app
