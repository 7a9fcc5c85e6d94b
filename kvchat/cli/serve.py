"""``kvchat serve``: the OpenAI-compatible server (routes in :mod:`kvchat.serve`)."""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING, Annotated

import typer

from .common import app, fail, load_or_exit

if TYPE_CHECKING:
    from kvchat.config import Config
    from kvchat.engine.models.model import LoadedModel
    from kvchat.runtime.pool import SessionPool


def is_loopback(host: str) -> bool:
    """Whether ``host`` only reaches this machine (``localhost`` or a loopback address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def serve_pool(lm: LoadedModel, config: Config) -> SessionPool:
    """The server's pool, as the TUI's: the weights of its model (which the server holds
    for as long as it runs) count in the memory budget with the caches."""
    from kvchat.engine.models.registry import ModelRegistry
    from kvchat.runtime.pool import SessionPool

    models = ModelRegistry()
    models.retain(lm)
    return SessionPool.for_config(config, models)


@app.command()
def serve(
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="Model to serve (default: the config's).")
    ] = None,
    host: Annotated[
        str, typer.Option(help="Address to listen on (loopback by default).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.", min=0, max=65535)] = 8000,
    cache: Annotated[str | None, typer.Option(help="Cache kind for new sessions.")] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            help="Require 'Authorization: Bearer KEY' (needed off loopback).",
            envvar="KVCHAT_API_KEY",
        ),
    ] = None,
    max_queue: Annotated[
        int | None,
        typer.Option(
            help="Requests that may wait for the model; more get 429 (default: twice "
            "--decode-concurrency).",
            min=0,
        ),
    ] = None,
    decode_concurrency: Annotated[
        int, typer.Option(help="Requests that reply at once, decoding in one batch.", min=1)
    ] = 32,
    prompt_concurrency: Annotated[
        int, typer.Option(help="Of those, how many evaluate their prompts at once.", min=1)
    ] = 8,
    max_body: Annotated[
        str, typer.Option(help="Largest request body, e.g. 8MiB; larger ones get 413.")
    ] = "8MiB",
    keep_anonymous: Annotated[
        int,
        typer.Option(
            help="Sessions the server names itself (serve-*) kept saved, the "
            "most recently used; older ones are deleted (0: keep all).",
            min=0,
        ),
    ] = 64,
) -> None:
    """Serve the model over OpenAI's chat completions API; every conversation keeps its cache.

    Sessions are matched by name (X-Session-Id) or by the longest shared prefix,
    saved after each reply in the same sessions folder as the TUI.
    """
    import uvicorn

    from kvchat.config import ConfigError, load_config, parse_size
    from kvchat.engine.caches.kinds import CacheKindError, make_cache, parse_kind
    from kvchat.engine.generation.per_model import warm_up
    from kvchat.serve import Engine, create_app
    from kvchat.settings import generation_of

    if not is_loopback(host) and not api_key:
        raise fail(
            f"--host {host} is reachable from other machines: give --api-key too "
            "(or KVCHAT_API_KEY).",
            2,
        )
    try:
        config = load_config()
        kind = parse_kind(cache).name if cache else config.cache
        body_limit = parse_size(max_body)
    except (ConfigError, CacheKindError) as exc:
        raise fail(str(exc), 2) from None
    except ValueError as exc:
        raise fail(f"--max-body {max_body}: {exc}", 2) from None
    lm = load_or_exit(model or config.model)
    try:
        make_cache(lm.model, parse_kind(kind))  # a kind this model cannot use: say so now
    except CacheKindError as exc:
        raise fail(str(exc), 2) from None
    warm_up(lm)  # the first request finds the model's once-only costs paid
    engine = Engine(
        lm,
        serve_pool(lm, config),
        kind=kind,
        settings=generation_of(config),
        max_queue=max_queue,
        keep_anonymous=keep_anonymous,
        decode_concurrency=decode_concurrency,
        prompt_concurrency=prompt_concurrency,
    )
    typer.echo(f"kvchat: serving {lm.model_id} on http://{host}:{port}/v1", err=True)
    try:
        uvicorn.run(
            create_app(engine, api_key=api_key, max_body_bytes=body_limit),
            host=host,
            port=port,
            log_level="warning",
        )
    finally:
        engine.shutdown()
