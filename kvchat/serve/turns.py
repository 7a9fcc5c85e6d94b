"""A request as the engine's turn, and its reply as the client's answer: the
:class:`~kvchat.engine.conversation.events.TurnOptions` a request asks for (its sampling
over the server's, its logprobs, tools, template variables, a reply's given start, its
logit bias and grammar), the session call that answers it, and the tool calls read out
of the reply. The request's session is never changed for the request: what it asks
travels with its turn."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from mlx_lm.sample_utils import make_logits_processors

from kvchat.engine.conversation.events import TurnOptions
from kvchat.settings import apply_overrides

from .constrain import Opened, constraint
from .jobs import Answer
from .schema import ChatRequest, CompletionRequest
from .tools import split

if TYPE_CHECKING:
    from kvchat.engine.conversation.events import GenerationSettings, Turn, TurnDone
    from kvchat.engine.conversation.session import Session
    from kvchat.engine.generation.sampling import LogitsProcessor
    from kvchat.engine.models.model import LoadedModel

Request = ChatRequest | CompletionRequest


def turn_options(lm: LoadedModel, req: Request, settings: GenerationSettings) -> TurnOptions:
    """What ``req`` asks of its turn: ``settings`` (the server's) with the request's own
    sampling over them, its logprobs, and for a chat its tools, template variables and the
    reply's given start."""
    options = TurnOptions(
        settings=apply_overrides(settings, req.sampling()), report_logprobs=req.logprobs_wanted()
    )
    if not isinstance(req, ChatRequest):
        return options
    variables = req.template_variables(lm)
    return replace(options, start=req.start(), tools=req.tool_specs(), variables=variables)


def processors(
    lm: LoadedModel, req: Request, grammar: str | Opened | None
) -> tuple[LogitsProcessor, ...]:
    """A reply's logits processors: the request's logit bias, its ``grammar`` (each reply's
    own: a constraint follows the tokens of one reply)."""
    biases = req.biases(len(lm.tokenizer.get_vocab()))
    return (
        *(make_logits_processors(logit_bias=biases) if biases else []),
        *([constraint(lm, grammar)] if grammar else []),
    )


def turn_of(session: Session, options: TurnOptions, req: Request, new: list[dict]) -> Turn:
    """The turn that answers ``req`` on ``session`` as ``options`` ask (``new``: the
    messages it adds)."""
    if isinstance(req, CompletionRequest):
        return session.complete(req.text(), options)
    if new[-1]["role"] == "user":
        return session.send(new[-1], options)
    return session.answer(new, options)  # tools' results: the model answers them


def answer(
    lm: LoadedModel,
    req: Request,
    streamed: tuple[TurnDone, str, str | None, list],
    tools: list[dict] | None,
) -> Answer:
    """A reply streamed, its tool calls read out of it when ``tools`` are offered."""
    done, reply, hit_stop, logprobs = streamed
    if tools is None or not isinstance(req, ChatRequest):
        return Answer(done, reply, hit_stop, logprobs, reply, reply, [])
    content, calls = split(lm, reply, tools)
    calls = calls if req.parallel_tool_calls else calls[:1]
    if req.legacy:  # a legacy result names its call by the function's name
        calls = [{**c, "id": c["function"]["name"]} for c in calls]
    # a call cut short: its unfinished markup (a forced call's: the whole reply) is
    # never content, as it is never streamed
    opened = reply.partition(lm.tokenizer.tool_call_start)[0]
    shown = content if calls else ("" if req.forced_tools() else opened)
    return Answer(done, reply, hit_stop, logprobs, content, shown, calls)
