"""The chats the trained ``demo`` learns from (:mod:`kvchat.engine.models.demo_train`).

:func:`exchanges` makes (question, answer) pairs of the corpus's text. :func:`tool_chats`
makes chats with tools: each offers one or two tools (OpenAI's function specs, as
clients send them) and asks for something one of them does: the reply is a call of that
tool, its arguments taken from the question; the tool's result comes back and the reply
after it says the result. Some ask an ordinary question from the corpus, with tools
offered or none, or a tool's kind of question with none offered: the reply is a corpus
answer, no call. Chats are drawn from a seeded generator, so the same list comes back
every time.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from kvchat.engine.models.demo import corpus_parts

SEED = 0
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'])")
CITIES = [
    "Oslo", "Paris", "Lima", "Tokyo", "Cairo", "Berlin", "Madrid", "Dublin", "Quito",
    "Nairobi", "Lisbon", "Vienna", "Seoul", "Perth", "Boston", "Rome", "Delhi", "Accra",
    "Bergen", "Porto", "Turin", "Kyoto", "Dakar", "Hanoi", "Lagos", "Milan", "Zurich",
    "Sydney", "Denver", "Austin", "Havana", "Tunis", "Riga", "Minsk", "Kiev", "Prague",
]  # fmt: skip
TOPICS = [
    "lighthouses", "sourdough bread", "hash tables", "bus timetables", "gannets",
    "storms at sea", "rivers", "old maps", "tea", "glass floats", "bees", "knitting",
]  # fmt: skip
NAMES = ["Alice", "Bob", "Maria", "Tom", "Priya", "Chen", "Olga", "Sam"]
WORDS = ["bread", "sea", "river", "lamp", "morning", "friend", "harbour", "rain"]
LANGUAGES = ["French", "Spanish", "German", "Italian", "Norwegian"]
SKIES = ["Sunny", "Cloudy", "Rain", "Fog", "Snow", "Windy"]


def exchanges(text: str) -> list[tuple[str, str]]:
    """(user, assistant) pairs built from the training text."""
    pairs = []
    lines = [line.strip() for line in text.splitlines()]
    for line, after in zip(lines, lines[1:] + [""], strict=True):
        if line.startswith("User:") and after.startswith("Assistant:"):
            pairs.append(
                (line.removeprefix("User:").strip(), after.removeprefix("Assistant:").strip())
            )
        elif line.endswith("?") and len(after) > 40 and not after.startswith(("User:", '"')):
            pairs.append((line, after))
    for paragraph in text.split("\n\n"):
        sentences = _SENTENCE.split(" ".join(paragraph.split()))
        if len(sentences) >= 3:
            pairs.append((sentences[0], " ".join(sentences[1:4])))
    return pairs


def ordinary_pairs() -> list[tuple[str, str]]:
    """The training text's (question, answer) pairs short enough to follow a tools list."""
    return [(user, reply) for user, reply in exchanges(corpus_parts()[0]) if len(reply) < 300]


@dataclass(frozen=True)
class Task:
    """A kind of request a tool answers: the tool, how users ask for it (``{slot}`` s),
    where each argument comes from, and what the tool says back."""

    name: str
    description: str
    properties: dict[str, dict[str, Any]]
    asks: tuple[str, ...]


TASKS = [
    Task(
        "get_weather",
        "Get the current weather in a city.",
        {"city": {"type": "string", "description": "The city's name."}},
        (
            "What is the weather in {city}?",
            "Weather in {city}?",
            "How is the weather in {city} today?",
            "Is it raining in {city}?",
        ),
    ),
    Task(
        "get_time",
        "The current time in a city.",
        {"city": {"type": "string"}},
        ("What time is it in {city}?", "Tell me the time in {city}.", "Time in {city}?"),
    ),
    Task(
        "search_web",
        "Search the web.",
        {"query": {"type": "string", "description": "What to search for."}},
        ("Search the web for {query}.", "Look up {query}.", "Find pages about {query}."),
    ),
    Task(
        "add",
        "Add two integers.",
        {"a": {"type": "integer"}, "b": {"type": "integer"}},
        ("What is {a} plus {b}?", "Add {a} and {b}.", "What is the sum of {a} and {b}?"),
    ),
    Task(
        "send_email",
        "Send an email.",
        {"subject": {"type": "string"}, "to": {"type": "string"}},
        ("Send an email to {to} about {subject}.", "Email {to} about {subject}."),
    ),
    Task(
        "set_timer",
        "Start a timer.",
        {"minutes": {"type": "integer", "minimum": 1}},
        ("Set a timer for {minutes} minutes.", "Start a {minutes} minute timer."),
    ),
    Task(
        "translate",
        "Translate a word into another language.",
        {"language": {"type": "string"}, "text": {"type": "string"}},
        ("Translate {text} into {language}.", "How do you say {text} in {language}?"),
    ),
    Task(
        "get_stock_price",
        "The latest price of a stock.",
        {"symbol": {"type": "string"}},
        ("What is the stock price of {symbol}?", "How is {symbol} trading?"),
    ),
]


def _arguments(task: Task, rng: random.Random) -> dict[str, Any]:
    values: dict[str, Any] = {
        "city": rng.choice(CITIES),
        "query": rng.choice(TOPICS),
        "a": rng.randint(1, 99),
        "b": rng.randint(1, 99),
        "subject": rng.choice(TOPICS),
        "to": rng.choice(NAMES),
        "minutes": rng.randint(1, 60),
        "language": rng.choice(LANGUAGES),
        "text": rng.choice(WORDS),
        "symbol": "".join(rng.choice("ABCDEFGHKLMNPRSTUVXZ") for _ in range(rng.randint(2, 4))),
    }
    return {key: values[key] for key in sorted(task.properties)}


def _result(task: Task, arguments: dict[str, Any], rng: random.Random) -> str:
    if task.name == "get_weather":
        return f"{rng.choice(SKIES)}, {rng.randint(-5, 32)} C."
    if task.name == "get_time":
        return f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
    if task.name == "add":
        return str(arguments["a"] + arguments["b"])
    if task.name == "translate":
        return rng.choice(["pain", "mer", "Fluss", "lampada", "morgen"])
    if task.name == "get_stock_price":
        return f"{rng.randint(5, 900)}.{rng.randint(0, 99):02d} USD"
    return rng.choice(["Done.", "OK, done.", "Sent."] if task.name != "search_web" else TOPICS)


def spec(task: Task, rng: random.Random) -> dict[str, Any]:
    """``task``'s tool as a client offers it (the schema's keys in the order of OpenAI's
    examples or of pydantic's, as langchain sends them)."""
    parameters: dict[str, Any] = {"type": "object", "properties": task.properties}
    parameters["required"] = list(task.properties)
    if rng.random() < 0.5:
        parameters["type"] = parameters.pop("type")
    if rng.random() < 0.5:
        parameters["additionalProperties"] = False
    function: dict[str, Any] = {"name": task.name}
    if rng.random() < 0.8:
        function["description"] = task.description
    function["parameters"] = parameters
    return {"type": "function", "function": function}


Chat = tuple[list[dict[str, Any]], list[dict[str, Any]]]  # (messages, tools offered)


def tool_chats(count: int, ordinary: list[tuple[str, str]], seed: int = SEED) -> list[Chat]:
    """``count`` chats as (messages, tools offered), drawn from ``seed``. Three in eight
    are answered without a call, by one of the ``ordinary`` (question, answer) pairs'
    answers: its question with tools offered, its question with none, and a tool's kind
    of question with none (the demo only calls what is offered). The others ask for one offered tool's work, call it with the question's
    values, and say the tool's result."""
    rng = random.Random(seed)
    chats: list[Chat] = []
    for i in range(count):
        offered = rng.sample(TASKS, rng.randint(1, 2))
        tools = [spec(t, rng) for t in offered]
        if i % 8 in (3, 5, 7):
            question, answer = rng.choice(ordinary)
            if i % 8 == 5:
                task = rng.choice(TASKS)
                question = rng.choice(task.asks).format(**_arguments(task, rng))
            asked: list[dict[str, Any]] = [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
            ]
            chats.append((asked, tools if i % 8 == 3 else []))
            continue
        task = rng.choice(offered)
        arguments = _arguments(task, rng)
        question = rng.choice(task.asks).format(**arguments)
        call = {"name": task.name, "arguments": arguments}
        result = _result(task, arguments, rng)
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": question},
            {"role": "assistant", "content": "", "tool_calls": [{"function": call}]},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": f"The {task.name} tool says: {result}"},
        ]
        chats.append((messages, tools))
    return chats
