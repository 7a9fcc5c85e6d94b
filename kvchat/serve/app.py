"""The HTTP routes: OpenAI's chat and plain completions and Anthropic's messages (streamed
or not), models, health.

Starlette on uvicorn. Every refusal is OpenAI's error shape,
``{"error": {"message", "type", "param", "code"}}``, or Anthropic's on its routes. Both
chat APIs answer through :func:`_answer`: an Anthropic request is translated to the chat
request OpenAI's route takes (:mod:`kvchat.serve.anthropic`). The model work happens in
:class:`~kvchat.serve.worker.Engine`'s thread; a handler only validates,
queues, and forwards what the job reports. A client that goes away (its
connection closes) withdraws its queued request or stops its reply after the
current token; the session stays consistent and is saved as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import tools
from .anthropic import CountRequest, MessagesRequest, input_tokens
from .anthropic_reply import AnthropicReply, anthropic_error
from .constrain import Opened, schema_grammar
from .errors import ApiError
from .jobs import Finished, Job, Started
from .schema import (
    ChatRequest,
    CompletionRequest,
    cache_key_session,
    parse_request,
    session_name,
)
from .shapes import ChatShape, CompletionShape, OpenAIReply, Reply, Report
from .worker import Engine

DEFAULT_MAX_BODY = 8 << 20
DRAIN_FACTOR = 4  # an oversized body is read (and dropped) up to this many times the limit
EXPIRE_EVERY_S = 30.0


def create_app(
    engine: Engine, *, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY
) -> Starlette:
    """The ASGI app serving ``engine``'s model; ``api_key`` (if set) is required as a
    bearer token or an ``x-api-key`` header on every route but ``/health``."""
    model = engine.lm.model_id

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
        shape = ChatShape(req.logprobs_wanted() is not None, req.legacy)
        reply = OpenAIReply(shape, model, req.include_usage(), req.n)
        return await _answer(engine, request, req, reply)

    async def messages(request: Request) -> Response:
        _authorize(request, api_key)
        asked = parse_request(await _body(request, max_body_bytes), MessagesRequest)
        return await _answer(engine, request, asked.chat(), AnthropicReply(model))

    async def count_tokens(request: Request) -> Response:
        _authorize(request, api_key)
        req = parse_request(await _body(request, max_body_bytes), CountRequest).chat_request()
        if req.tool_specs() is not None:
            tools.check_offered(engine.lm)
        return JSONResponse({"input_tokens": await asyncio.to_thread(input_tokens, engine.lm, req)})

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
        reply = OpenAIReply(shape, model, req.include_usage())
        return await _reply(engine, request, req, None, reply)

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return JSONResponse(_error_body(request, exc), status_code=exc.status, headers=exc.headers)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        error = ApiError(
            exc.status_code,
            f"{exc.detail}: {request.method} {request.url.path}.",
            code=str(exc.status_code),
        )
        return JSONResponse(_error_body(request, error), status_code=exc.status_code)

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
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    ]
    return Starlette(
        routes=routes,
        lifespan=contextlib.asynccontextmanager(lifespan),
        exception_handlers={ApiError: api_error, HTTPException: http_error},
    )


class _ClientGone(Exception):
    """The client closed its connection."""


async def _answer(engine: Engine, request: Request, req: ChatRequest, reply: Reply) -> Response:
    """Answer a chat request in ``reply``'s format: the session it names (``X-Session-Id``
    or ``prompt_cache_key``; else the one prefix matching finds), its tools, the grammar
    its forced tool call or ``response_format`` holds it to (or a call it opens on its own).
    Every chat route's way in."""
    name = session_name(request.headers.get("x-session-id"))
    if name is None and req.prompt_cache_key is not None:
        name = cache_key_session(req.prompt_cache_key)
    req.history()  # refuse a conversation kvchat cannot answer now
    if req.tool_specs() is not None:
        tools.check_offered(engine.lm)
    schema = req.response_format.required_schema() if req.response_format else None
    grammar: str | Opened | None = None
    if forced := req.forced_tools():
        grammar = tools.forced_grammar(engine.lm, forced)
    elif schema is not None:
        grammar = schema_grammar(schema, "response_format.json_schema.schema")
    elif req.tools and req.tool_choice != "none":  # a call the model opens comes out valid
        grammar = tools.opened_grammar(engine.lm, req.tools)
    if isinstance(grammar, str) and req.start():
        raise ApiError(
            400,
            "A trailing assistant message cannot be continued under a forced "
            "'tool_choice' or a 'response_format': the constrained reply starts afresh.",
            param="messages",
        )
    return await _reply(engine, request, req, name, reply, grammar)


async def _reply(
    engine: Engine,
    request: Request,
    req: ChatRequest | CompletionRequest,
    name: str | None,
    reply: Reply,
    grammar: str | Opened | None = None,
) -> Response:
    """Queue ``req`` and answer with its reply in ``reply``'s format, whole or streamed
    (held to ``grammar`` if given)."""
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
    headers = {**_headers(first), **_ignored(engine, req)}
    if req.stream:
        return StreamingResponse(
            _sse(engine, job, first, gone, reply),
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache"},
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
    return JSONResponse(reply.whole(item), headers={**headers, **_stat_headers(item)})


async def _sse(
    engine: Engine, job: Job, started: Started, gone: asyncio.Future, reply: Reply
) -> AsyncIterator[str]:
    """The job's reports after ``started`` as ``reply``'s server-sent events; the job is
    cancelled if the client leaves before its end."""
    finished = False

    async def reports() -> AsyncIterator[Report]:
        nonlocal finished
        while not finished:
            item = await _next(job, gone)
            finished = isinstance(item, (Finished, ApiError))
            yield item

    try:
        async for event in reply.stream(started, reports()):
            yield event
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
    """Refuse a request without ``api_key``, as a bearer token (OpenAI's clients send it
    so) or an ``x-api-key`` header (Anthropic's)."""
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        token = request.headers.get("x-api-key", "")
    if not hmac.compare_digest(token.encode(), api_key.encode()):
        raise ApiError(
            401,
            "Missing or wrong API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
            type="authentication_error",
            code="invalid_api_key",
        )


def _error_body(request: Request, error: ApiError) -> dict:
    """``error`` in the shape of the API the request's route is (Anthropic's or OpenAI's)."""
    anthropic = request.url.path.startswith("/v1/messages")
    return anthropic_error(error) if anthropic else error.body()


def _model_card(engine: Engine) -> dict:
    return {"id": engine.lm.model_id, "object": "model", "created": 0, "owned_by": "kvchat"}


def _headers(started: Started) -> dict[str, str]:
    m = started.match
    return {
        "X-Kvchat-Session": m.name,
        "X-Kvchat-Match": m.how,
        "X-Kvchat-Resumed-From-Disk": "true" if m.resumed_from_disk else "false",
    }


def _ignored(engine: Engine, req: ChatRequest | CompletionRequest) -> dict[str, str]:
    """``X-Kvchat-Ignored`` naming a field that changed nothing: a ``reasoning_effort`` sent
    to a model whose chat template has no thinking switch."""
    if isinstance(req, ChatRequest) and req.reasoning_effort:
        if not req.template_variables(engine.lm):
            return {"X-Kvchat-Ignored": "reasoning_effort"}
    return {}


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
