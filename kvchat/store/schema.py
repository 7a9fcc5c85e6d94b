"""The schema of ``session.json``, checked on every read before anything uses the data.

pydantic v2 rather than msgspec or hand-written checks: it is installed
already (``pydantic>=2`` is declared), it parses and validates the bytes in
one pass with a JSON parser that stops at 200 levels of nesting (where
``json.loads`` raises RecursionError), strict mode refuses ``"hot"`` for a
number and ``1e400`` for a count, ``allow_inf_nan=False`` refuses infinite
and NaN floats, and every error carries the path of the field, which the
message names. Per-turn stats are validated against the engine's own
``TurnStats`` dataclass, so their fields are defined once.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    create_model,
    model_validator,
)

from kvchat.engine.conversation.branches import BranchError, Branches, talk
from kvchat.engine.conversation.stats import TurnStats
from kvchat.settings import GENERATION, model_fields
from kvchat.store.base import StoreError

Count = Annotated[int, Field(ge=0, lt=1 << 53)]
TokenId = Annotated[int, Field(ge=0, lt=1 << 32)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    stopped: bool = False
    # an assistant's calls of the tools it was offered
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None  # a tool's result: the call it answers
    name: str | None = None  # a participant's name, kept where the chat template renders it


class BranchNode(Message):
    """A message of the branch tree: its parent is an earlier node, or -1 for a first message."""

    parent: int = Field(ge=-1, lt=1 << 53)
    turn: TurnStats | None = None


class BranchTree(_Strict):
    """Every path the conversation took; ``path`` (node indices) is ``messages``."""

    nodes: list[BranchNode]
    path: list[Count]


class _StoredSettings(_Strict):
    """``GenerationSettings`` as stored: the fields of kvchat/settings.py's generation
    settings (their ranges included), and two the benchmarks set."""

    prefill_step: int = Field(512, ge=1, lt=1 << 31)
    ignore_eos: bool = False


if TYPE_CHECKING:  # a model made at run time: its base is what a type checker can see
    Settings = _StoredSettings
else:
    Settings = create_model("Settings", __base__=_StoredSettings, **model_fields(GENERATION))


class CacheInfo(_Strict):
    file: str
    sha256: str
    bytes: Count = 0
    tokens: Count = 0
    ledger_sha256: str = ""
    shards: list[str] = []  # a sharded run's: the sha256 of rank 1's, 2's, ... cache shard


class CheckpointsInfo(_Strict):
    """``checkpoints.safetensors``: its checksum and the ledger length of each checkpoint
    (checked against the ledger and the file when it is read)."""

    file: str
    sha256: str
    bytes: Count = 0
    tokens: list[Count]


class SessionFile(_Strict):
    format: int = 1
    generation: Count = 0  # one more on every save; absent before kvchat had it
    kvchat_version: str = ""
    name: str = ""
    created: str = ""
    updated: str = ""
    model_id: str = ""
    model_fingerprint: str = ""
    cache_kind: str = "standard"
    settings: Settings = Settings()
    messages: list[Message]
    archived: list[Message] = []
    ledger: list[TokenId] = []
    turns: list[TurnStats] = []
    cache: CacheInfo | None = None
    checkpoints: CheckpointsInfo | None = None  # absent where none were kept (and before 0.x)
    branches: BranchTree | None = None  # absent while there is only one path (and before 0.x)
    _tree: Branches | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _branches_fit(self) -> SessionFile:
        if self.branches is not None:
            messages = talk([m.model_dump(exclude_unset=True) for m in self.messages])
            try:
                self._tree = Branches.from_record(
                    self.branches.model_dump(exclude_unset=True), messages
                )
            except BranchError as exc:
                raise ValueError(str(exc)) from None
        return self

    @property
    def tree(self) -> Branches | None:
        """The saved branch tree, built and checked against ``messages`` once, by the
        validation; None where none was saved (one path)."""
        return self._tree


def parse_file(raw: bytes, path: Path) -> SessionFile:
    """The validated ``session.json`` ``path``; any problem is a :class:`StoreError`
    naming the file and the field."""
    try:
        return SessionFile.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        first = errors[0]
        where = error_location(first["loc"])
        problem = f"{where}: {first['msg']}" if where else first["msg"]
        if len(errors) > 1:
            problem += f", and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''}"
        raise StoreError(f"{path} is damaged ({problem}); it was left as it is.") from None


def parse_session(raw: bytes, path: Path) -> dict[str, Any]:
    """The validated content of ``session.json`` ``path`` as plain data (only the keys
    the file has); any problem is a :class:`StoreError` naming the file and the field."""
    return parse_file(raw, path).model_dump(exclude_unset=True)


def error_location(loc: tuple[int | str, ...]) -> str:
    """``('turns', 0, 'temp')`` -> ``turns[0].temp``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
