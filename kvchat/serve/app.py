"""The HTTP routes: OpenAI's chat and plain completions (streamed or not), models, health.

Starlette on uvicorn. Every refusal is OpenAI's error shape,
``{"error": {"message", "type", "param", "code"}}``. The model work happens in
:class:`~kvchat.serve.worker.Engine`'s thread; a handler only validates,
queues, and forwards what the job reports. A client that goes away (its
connection closes) withdraws its queued request or stops its reply after the
current token; the session stays consistent and is saved as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import tools
from .constrain import schema_grammar
from .errors import ApiError
from .jobs import Finished, Job, Piece, Started
from .schema import (
    ChatRequest,
    CompletionRequest,
    cache_key_session,
    parse_request,
    session_name,
)
from .shapes import ChatShape, CompletionShape
from .worker import Engine

Shape = ChatShape | CompletionShape

DEFAULT_MAX_BODY = 8 << 20
DRAIN_FACTOR = 4  # an oversized body is read (and dropped) up to this many times the limit
EXPIRE_EVERY_S = 30.0


def create_app(
    engine: Engine, *, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY
) -> Starlette:
    """The ASGI app serving ``engine``'s model; ``api_key`` (if set) is required as a
    bearer token on every route but ``/health``."""

    async def health(request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "model": engine.lm.model_id,
                "running": engine.active > engine.waiting,
                "waiting": engine.waiting,
            }
        )

    async def models(request: Request) -> Response:
        _authorize(request, api_key)
        return JSONResponse({"object": "list", "data": [_model_card(engine)]})

    async def chat(request: Request) -> Response:
        _authorize(request, api_key)
        req = parse_request(await _body(request, max_body_bytes), ChatRequest)
        name = session_name(request.headers.get("x-session-id"))
        if name is None and req.prompt_cache_key is not None:
            name = cache_key_session(req.prompt_cache_key)
        req.history()  # refuse a conversation kvchat cannot answer now
        if req.tool_specs() is not None:
            tools.check_offered(engine.lm)
        shape = ChatShape(req.logprobs_wanted() is not None, req.legacy)
        schema = req.response_format.required_schema() if req.response_format else None
        if forced := req.forced_tools():
            grammar = tools.forced_grammar(engine.lm, forced)
        elif schema is not None:
            grammar = schema_grammar(schema, "response_format.json_schema.schema")
        else:
            grammar = None
        if grammar is not None and req.start():
            raise ApiError(
                400,
                "A trailing assistant message cannot be continued under a forced "
                "'tool_choice' or a 'response_format': the constrained reply starts afresh.",
                param="messages",
            )
        return await _reply(engine, request, req, name, shape, grammar)

    async def completions(request: Request) -> Response:
        _authorize(request, api_key)
        req = parse_request(await _body(request, max_body_bytes), CompletionRequest)
        if request.headers.get("x-session-id") is not None:
            raise ApiError(
                400,
                "'X-Session-Id' names a chat session; plain completions "
                "find their cache by the prompt alone.",
                param="X-Session-Id",
            )
        req.text()  # refuse a prompt kvchat cannot take now
        shape = CompletionShape(req.logprobs_wanted() is not None)
        return await _reply(engine, request, req, None, shape)

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        error = ApiError(
            exc.status_code,
            f"{exc.detail}: {request.method} {request.url.path}.",
            code=str(exc.status_code),
        )
        return JSONResponse(error.body(), status_code=exc.status_code)

    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        expiry = asyncio.ensure_future(_expire_regularly(engine))
        try:
            yield
        finally:
            expiry.cancel()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    return Starlette(
        routes=routes,
        lifespan=contextlib.asynccontextmanager(lifespan),
        exception_handlers={ApiError: api_error, HTTPException: http_error},
    )


class _ClientGone(Exception):
    """The client closed its connection."""


async def _reply(
    engine: Engine,
    request: Request,
    req: ChatRequest | CompletionRequest,
    name: str | None,
    shape: Shape,
    grammar: str | None = None,
) -> Response:
    """Queue ``req`` and answer with its reply in ``shape``, whole or streamed (held to
    ``grammar`` if given)."""
    job = engine.submit(req, name, grammar)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        first = await _next(job, gone)
    except _ClientGone:
        engine.cancel(job)
        return Response(status_code=499)
    if isinstance(first, ApiError):
        gone.cancel()
        raise first
    headers = _headers(first)
    reply_id = f"{shape.id_prefix}-{uuid.uuid4().hex}"
    if req.stream:
        body = _sse(engine, job, gone, reply_id, shape, req.include_usage(), req.n)
        return StreamingResponse(
            body, media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"}
        )
    try:
        while not isinstance(item := await _next(job, gone), (Finished, ApiError)):
            pass
    except _ClientGone:
        engine.cancel(job)
        return Response(status_code=499)
    finally:
        gone.cancel()
    if isinstance(item, ApiError):
        raise item
    reply = {
        **_envelope(engine, reply_id, shape.object),
        "choices": [shape.whole(reply) for reply in item.replies],
        "usage": item.usage,
        "kvchat": item.kvchat,
    }
    return JSONResponse(reply, headers={**headers, **_stat_headers(item)})


async def _sse(
    engine: Engine,
    job: Job,
    gone: asyncio.Future,
    reply_id: str,
    shape: Shape,
    include_usage: bool,
    n: int,
) -> AsyncIterator[str]:
    """The ``n`` replies as server-sent events, OpenAI's chunk shapes (each with its
    reply's index), ``[DONE]`` last."""
    base = _envelope(engine, reply_id, shape.chunk_object)

    def event(choices: list, **extra) -> str:
        return f"data: {json.dumps({**base, 'choices': choices, **extra})}\n\n"

    finished = False
    try:
        for index in range(n):
            if (opening := shape.opening(index)) is not None:
                yield event([opening])
        while True:
            item = await _next(job, gone)
            if isinstance(item, Piece):
                yield event([shape.piece(item)])
            elif isinstance(item, ApiError):
                finished = True
                yield f"data: {json.dumps(item.body())}\n\n"
                break
            elif isinstance(item, Finished):
                finished = True
                for reply in item.replies:
                    if (calls := shape.calls(reply)) is not None:
                        yield event([calls])
                *before, last = [shape.closing(reply) for reply in item.replies]
                for closing in before:
                    yield event([closing])
                # kvchat's object rides on the last chunk: the usage chunk when there is one
                if include_usage:
                    yield event([last])
                    yield event([], usage=item.usage, kvchat=item.kvchat)
                else:
                    yield event([last], kvchat=item.kvchat)
                break
        yield "data: [DONE]\n\n"
    except _ClientGone:
        pass
    finally:
        gone.cancel()
        if not finished:
            engine.cancel(job)


async def _next(job: Job, gone: asyncio.Future):
    """The job's next report, or :class:`_ClientGone` if the client leaves first."""
    get = asyncio.ensure_future(job.events.get())
    await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()
    raise _ClientGone


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has been read by now)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past ``limit`` bytes.

    A client that is still sending when the 413 goes out gets a reset instead
    of the answer (Python's urllib raises ``BrokenPipeError``), so the rest of
    the body is read and dropped first, up to :data:`DRAIN_FACTOR` times the
    limit; past that the connection is closed, answer or not.
    """
    too_big = ApiError(
        413,
        f"The request body is over the server's limit of {limit:,} bytes.",
        code="body_too_large",
    )
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > limit * DRAIN_FACTOR:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit * DRAIN_FACTOR:
            break
        if size <= limit:
            chunks.append(chunk)
    if size > limit:
        raise too_big
    return b"".join(chunks)


def _authorize(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), api_key.encode()):
        raise ApiError(
            401,
            "Missing or wrong API key: send 'Authorization: Bearer <key>'.",
            type="authentication_error",
            code="invalid_api_key",
        )


def _model_card(engine: Engine) -> dict:
    return {"id": engine.lm.model_id, "object": "model", "created": 0, "owned_by": "kvchat"}


def _envelope(engine: Engine, reply_id: str, kind: str) -> dict:
    return {
        "id": reply_id,
        "object": kind,
        "created": int(time.time()),
        "model": engine.lm.model_id,
    }


def _headers(started: Started) -> dict[str, str]:
    m = started.match
    return {
        "X-Kvchat-Session": m.name,
        "X-Kvchat-Match": m.how,
        "X-Kvchat-Resumed-From-Disk": "true" if m.resumed_from_disk else "false",
    }


def _stat_headers(done: Finished) -> dict[str, str]:
    k = done.kvchat
    return {
        "X-Kvchat-Cached-Tokens": str(k["reused_tokens"]),
        "X-Kvchat-Evaluated-Tokens": str(k["evaluated_tokens"]),
        "X-Kvchat-Prompt-Eval-Ms": f"{k['prompt_eval_s'] * 1000:.1f}",
        "X-Kvchat-Ttft-Ms": f"{k['ttft_s'] * 1000:.1f}",
        "X-Kvchat-Cache-Tokens": str(k["cache_tokens"]),
    }


async def _expire_regularly(engine: Engine) -> None:
    """Offload idle caches (the pool's TTL) even when no request comes."""
    while True:
        await asyncio.sleep(EXPIRE_EVERY_S)
        await asyncio.wrap_future(engine.call(engine.pool.expire))
