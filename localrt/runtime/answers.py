"""What the runtime answers, whichever path served the request: the chunks of chat and generate, their
metrics, the results of embed and rerank, and the settings chat and generate share. The local path
(`generate.py`) and the remote path (`remote.py`) both speak these, so the API layer sees one shape.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from datetime import datetime
from datetime import timezone
from typing import Any
from typing import TypedDict

from localrt.backends.base import Timings
from localrt.backends.base import TokenLogprob as TokenLogprob  # the API names it through the runtime
from localrt.errors import LocalrtError
from localrt.runtime import thinking
from localrt.runtime.prompt import tool_choice


class ContextLengthError(LocalrtError):
    """A prompt longer than the context; `tokens` and `limit` let a protocol word it its own way."""

    status = 400

    def __init__(self, message: str, tokens: int | None = None, limit: int | None = None) -> None:
        super().__init__(message)
        self.tokens, self.limit = tokens, limit


@dataclass
class Metrics(Timings):
    """A request's numbers, in nanoseconds: the backend's timings plus the request's total (`localrt.wire`
    gives them their names on Ollama's wire)."""

    total_ns: int = 0
    # the whole prompt, a reused (cached) prefix included: prompt_eval_count counts only what was
    # evaluated; OpenAI's and Anthropic's usage count the whole input
    prompt_tokens: int = 0
    reasoning_tokens: int = 0  # of eval_count: generated inside the thinking (Responses' reasoning_tokens)


_second: tuple[int, str] = (-1, "")  # the last whole second formatted: chunks come many a second


def now_rfc3339() -> str:
    """UTC now as RFC 3339 with microseconds (Ollama's `created_at`), stamped on every streamed chunk: the
    date and time of day are formatted once a second, not once a token."""
    global _second
    seconds, ns = divmod(time.time_ns(), 1_000_000_000)
    stamp = _second
    if stamp[0] != seconds:
        stamp = _second = (
            seconds,
            datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S"),
        )
    return f"{stamp[1]}.{ns // 1000:06d}Z"


@dataclass
class Chunk:
    """One streamed piece of a chat or generate answer; the last one has done=True and metrics."""

    model: str
    content: str = ""
    thinking: str = ""  # a reasoning model's thinking, split out of content (Ollama's message.thinking)
    done: bool = False
    done_reason: str | None = None  # stop | length | cancel | load | unload
    stop_sequence: str | None = None  # done_reason "stop" because this stop string matched (not an end token)
    tool_calls: list[dict[str, Any]] | None = None
    logprobs: list[TokenLogprob] | None = None  # the API routes write them in their own wire shape
    metrics: Metrics | None = None
    context: list[int] | None = None  # generate only: prompt + answer tokens, for the next call
    created_at: str = field(default_factory=now_rfc3339)


@dataclass
class EmbedResult:
    model: str
    embeddings: list[list[float]]
    prompt_eval_count: int
    total_ns: int
    load_ns: int


@dataclass
class RerankResult:
    model: str
    scores: list[float]  # per document, in the order given
    prompt_eval_count: int
    total_ns: int
    load_ns: int


class Settings(TypedDict, total=False):
    """What chat and generate share, in the runtime's names (each API translates its fields to these).

    options: option name -> value (`localrt.runtime.options`); format: "json" or a JSON schema;
    keep_alive: a duration or seconds (0 unloads after the answer); logprobs / top_logprobs (0..20);
    stream: chunks as they come, else one final chunk; think: Ollama's value (None, bool, "low"|"medium"|
    "high") or a Think; truncate: drop the oldest turns to fit the context; shift: shift the context when
    generation reaches its end; lora: llama-server's per-request adapter scales, [{"id": N, "scale":
    S}] (`localrt.runtime.lora`); defaults: a protocol's own option defaults for what the request left
    unset (OpenAI's temperature 1.0), applied on a local model, never sent to a remote model's upstream.
    Unset means the default."""

    options: Mapping[str, Any] | None
    defaults: Mapping[str, Any] | None
    format: str | dict[str, Any] | None
    keep_alive: str | float | None
    logprobs: bool
    top_logprobs: int
    stream: bool
    think: Any
    truncate: bool
    shift: bool
    lora: Sequence[Mapping[str, Any]] | None


def check_settings(settings: Mapping[str, Any]) -> None:
    """What a signature would refuse: a misspelt setting must not pass silently."""
    unknown = set(settings) - set(Settings.__annotations__)
    if unknown:
        raise TypeError(f"unexpected keyword argument {sorted(unknown)[0]!r}")


def check_format(format: Any) -> str | dict[str, Any] | None:
    if format is None or format == "":
        return None
    if format == "json" or isinstance(format, dict):
        return format
    raise LocalrtError(f'invalid format {format!r}: use "json" or a JSON schema object')


def check_logprobs(top_logprobs: Any) -> None:
    if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or not 0 <= top_logprobs <= 20:
        raise LocalrtError("top_logprobs must be between 0 and 20")


def asked(
    settings: Mapping[str, Any], tools: Sequence[Mapping[str, Any]] | None, choice: Any
) -> dict[str, Any]:
    """What a chat or generate request asks besides its options and model, checked once before any load,
    the same for a local and a remote model (part of its `plan.Plan`)."""
    format = check_format(settings.get("format"))
    top_logprobs = settings.get("top_logprobs", 0)
    check_logprobs(top_logprobs)
    think = settings.get("think")
    listed, required = tool_choice(choice, tools)
    return {
        "format": format,
        "logprobs": settings.get("logprobs", False),
        "top_logprobs": top_logprobs,
        "stream": settings.get("stream", True),
        "think": think if isinstance(think, thinking.Think) else thinking.parse_think(think),
        "tools": listed,
        "required": required,
    }
