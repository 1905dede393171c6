"""The plan of one chat or generate request, written once for a local and a remote model.

`front.Runtime` makes the plan as a request arrives, before any load: the model's options (its Modelfile
parameters, then the request's), the checks every request passes (format, logprobs, tools and
tool_choice, thinking, LoRA scales, what the kind of model refuses), keep-alive, and the kind of model
(`Loader`) that the pool holds it as. The two paths then only do what differs: the local one renders and
runs the prompt, the remote one sends the conversation upstream. What both do with a plan, such as
loading without generating and checking a conversation's images, is here too.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from localrt.backends.base import CancelToken
from localrt.runtime import images as image_input
from localrt.runtime import lora as lora_scales
from localrt.runtime import tenants
from localrt.runtime.answers import Chunk
from localrt.runtime.answers import Metrics
from localrt.runtime.answers import Settings
from localrt.runtime.answers import asked
from localrt.runtime.lifecycle import Loader
from localrt.runtime.lifecycle import ModelPool
from localrt.runtime.options import Options
from localrt.runtime.prompt import with_history
from localrt.runtime.thinking import Think
from localrt.store.store import ResolvedModel


@dataclass
class Plan:
    """What a chat or generate request settles before any load: checked once, used by every step."""

    model: str  # as the request named it
    resolved: ResolvedModel
    loader: Loader[Any]  # the kind of model: how the pool loads it
    opts: Options  # every option in force, defaults included
    given: dict[str, Any]  # only the options the model's Modelfile or the request set (typed)
    format: str | dict[str, Any] | None
    logprobs: bool
    top_logprobs: int
    stream: bool
    think: Think
    tools: list[dict[str, Any]] | None  # tool_choice applied
    required: bool  # tool_choice asks for a call
    choice: Any  # tool_choice as the request sent it
    keep_alive: float
    truncate: bool
    shift: bool
    tenant: str | None  # whose prompt prefixes a reported cache hit may cover (tenants.py)
    lora: tuple[float, ...] | None = None  # one scale per adapter; None: the model's default
    start: int = field(default_factory=time.perf_counter_ns)  # at arrival
    # the request's, made before its prompt is rendered: a local model is told the request is coming
    cancel: CancelToken = field(default_factory=CancelToken)

    @property
    def name(self) -> str:
        return self.resolved.name.display


@dataclass
class ChatAsked:
    """A conversation to answer."""

    messages: Sequence[Mapping[str, Any]]
    parallel_tool_calls: bool | None = None


@dataclass
class TextAsked:
    """A prompt to complete: one user turn of the template (after `context`, an earlier answer's
    tokens), or the text as given when `raw`; `images` placed at `[img]` or in front of it."""

    prompt: str
    system: str | None = None
    raw: bool = False
    context: Sequence[int] | None = None
    images: Sequence[Any] | None = None


@dataclass
class InfillAsked:
    """Fill-in-the-middle: the text between `prefix` and `suffix`."""

    prefix: str
    suffix: str
    context: Sequence[int] | None = None


Asked = ChatAsked | TextAsked | InfillAsked


def plan(
    pool: ModelPool,
    resolved: ResolvedModel,
    model: str,
    settings: Settings,
    loader: Loader[Any],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    choice: Any = None,
) -> Plan:
    """The checks chat and generate share, done once before any load."""
    start = time.perf_counter_ns()
    opts, given = pool.options_given(resolved, settings.get("options"), settings.get("defaults"))
    loader.check(resolved, opts, given)
    return Plan(
        model=model,
        resolved=resolved,
        loader=loader,
        opts=opts,
        given=given,
        **asked(settings, tools, choice),
        choice=choice,
        keep_alive=pool.keep_alive(settings.get("keep_alive")),
        truncate=settings.get("truncate", True),
        shift=settings.get("shift", True),
        tenant=tenants.current_tenant.get(),
        lora=lora_scales.scales(settings.get("lora"), resolved, opts.backend),
        start=start,
    )


async def load_only(pool: ModelPool, p: Plan) -> AsyncIterator[Chunk]:
    """A request with nothing to answer: load the model (or, with keep_alive 0, unload it)."""
    if p.keep_alive <= 0:
        await pool.unload(p.name)
        yield Chunk(
            model=p.name,
            done=True,
            done_reason="unload",
            metrics=Metrics(total_ns=time.perf_counter_ns() - p.start),
        )
        return
    async with pool.use(p.resolved, p.opts, p.keep_alive, exclusive=False, loader=p.loader) as (_, load_ns):
        pass
    yield Chunk(
        model=p.name,
        done=True,
        done_reason="load",
        metrics=Metrics(total_ns=time.perf_counter_ns() - p.start, load_ns=load_ns),
    )


async def conversation(
    p: Plan, messages: Sequence[Mapping[str, Any]]
) -> tuple[list[dict[str, Any]], list[image_input.PendingImage]]:
    """The request's turns behind the model's own (system prompt, MESSAGE history), and their images
    counted, typed and sized from their headers: before any load, so the decoded pixels in memory are
    bounded by the slots, not by the requests waiting."""
    msgs = with_history(messages, p.resolved.system, p.resolved.messages)
    msgs, pending = await image_input.check_images(msgs)
    check_vision(p.resolved, pending)
    return msgs, pending


async def prompt_images(
    p: Plan, prompt: str, images: Sequence[Any] | None
) -> tuple[str, list[image_input.PendingImage]]:
    """A generate request's prompt with its images marked in it, checked as `conversation` checks them."""
    pending: list[image_input.PendingImage] = []
    if images:
        (marked,), pending = await image_input.check_images([{"content": prompt, "images": list(images)}])
        prompt = marked["content"]
    check_vision(p.resolved, pending)
    return prompt, pending


def check_vision(resolved: ResolvedModel, pending: Sequence[image_input.PendingImage]) -> None:
    """Images for a model without a projector (a remote model has none here) are a 400 naming it."""
    if pending and resolved.projector_path is None:
        raise image_input.ImageError(f'"{resolved.name.display}" does not support images')
