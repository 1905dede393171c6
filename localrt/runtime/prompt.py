"""Prompt rendering: a request's messages through the model's chat template, with its thinking switch
and tools, as the tokens the backend evaluates; and the reply parser that splits the answer back into
thinking, content and tool calls. Everything here is per model format, nothing per backend.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from localrt.backends.base import IMAGE_TOKEN
from localrt.backends.base import GenerateRequest
from localrt.backends.base import ImageInput
from localrt.backends.base import LoadedModel
from localrt.errors import LocalrtError
from localrt.runtime import images as image_input
from localrt.runtime import thinking
from localrt.runtime.templates import ChatTemplate
from localrt.runtime.templates import RenderedPrompt
from localrt.runtime.templates import select_template
from localrt.runtime.templates import tokenize_rendered
from localrt.runtime.thinking import ModelFormat
from localrt.runtime.thinking import ReplyParser
from localrt.runtime.thinking import Think
from localrt.runtime.toolcalls import required_grammar
from localrt.runtime.truncate import drop_oldest
from localrt.store.store import ResolvedModel


@dataclass
class Turn:
    """One request's reply settings on one model: its format, the think setting in force, the tools the
    template renders and whether a call is required."""

    fmt: ModelFormat
    think: Think
    tools: list[dict[str, Any]] | None
    required: bool
    parallel: bool
    prompt_text: str = ""

    @classmethod
    def make(
        cls,
        fmt: ModelFormat,
        model: str,
        think: Think,
        tools: list[dict[str, Any]] | None,
        required: bool,
        parallel: bool | None,
    ) -> Turn:
        return cls(fmt, thinking.check_think(fmt, think, model), tools, required, parallel is not False)

    def prepare_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        msgs = thinking.history_messages(self.fmt, messages)
        if self.fmt.tool_style == "mistral":
            mistral_ids(msgs)
        return msgs

    def variables(self) -> dict[str, Any]:
        return thinking.template_variables(self.fmt, self.think)

    def close_prompt(self, rendered: RenderedPrompt) -> RenderedPrompt:
        """Think off on a prompt that opened thinking anyway: close the block, so the reply is the answer."""
        if self.think.enabled is False:
            tail = thinking.close_thinking(self.fmt, rendered.text)
            if tail:
                rendered = RenderedPrompt([*rendered.segments, (tail, True)])
        self.prompt_text = rendered.text
        return rendered

    def thinking_budget(self, request: GenerateRequest, format: Any) -> int | None:
        """The reply tokens thinking may take before the runtime closes it, when that can be enforced:
        a model that thinks in tags or harmony channels, thinking on, and no output constraint that a
        second generation would have to start over (`format`, a required call)."""
        budget = self.think.budget
        if budget is None or not self.think.enabled or not self.fmt.can_think:
            return None
        if format is not None or self.required or budget >= request.num_predict:
            return None
        return max(1, budget)

    def parser(self) -> ReplyParser:
        return ReplyParser(
            self.fmt,
            think=self.think,
            prompt_text=self.prompt_text,
            tools=self.tools,
            parallel_tool_calls=self.parallel,
        )

    def grammar(self) -> str:
        from localrt.backends.grammar import grammar_for

        think_tags = None
        if self.fmt.thinking == "tags" and self.think.enabled:
            opened = thinking.prompt_opens_thinking(self.fmt, self.prompt_text)
            think_tags = ("" if opened else self.fmt.open_tag, self.fmt.close_tag)
        return required_grammar(
            self.fmt.tool_style,
            self.tools or [],
            parallel=self.parallel,
            schema_gbnf=grammar_for,
            thinking=think_tags,
        )


@dataclass
class Prompter:
    """What renders prompts for one loaded model: its template, format and tokenizer."""

    name: str
    model: LoadedModel
    template: ChatTemplate
    format: ModelFormat

    def turn(
        self,
        model: str,
        think: Think,
        tools: list[dict[str, Any]] | None = None,
        required: bool = False,
        parallel: bool | None = None,
    ) -> Turn:
        """The reply settings of a request that named this model `model`."""
        return Turn.make(self.format, model, think, tools, required, parallel)

    def tokenize(self, rendered: RenderedPrompt, add_bos: bool = True, images: bool = False) -> list[int]:
        m = self.model

        def tokenize(text: str, add: bool, special: bool) -> list[int]:
            return m.tokenize(text, add_special=add, parse_special=special)

        return tokenize_rendered(
            rendered,
            image_input.split_markers(tokenize) if images else tokenize,
            m.bos_token_id,
            add_bos and m.add_bos,
        )

    async def render(
        self,
        msgs: list[dict[str, Any]],
        turn: Turn,
        pictures: Sequence[ImageInput] = (),
        add_bos: bool = True,
    ) -> list[int]:
        """The prompt through the template, with the turn's tools and thinking switch, as tokens."""
        msgs = turn.prepare_messages(msgs)
        render = functools.partial(
            self.template.render, msgs, tools=turn.tools, add_generation_prompt=True, extra=turn.variables()
        )
        rendered = turn.close_prompt(await asyncio.to_thread(render))
        tokens = self.tokenize(rendered, add_bos=add_bos, images=bool(pictures))
        if pictures and tokens.count(IMAGE_TOKEN) != len(pictures):
            # a vision model's template may read content only as a list of parts (SmolVLM's does)
            rendered = turn.close_prompt(await asyncio.to_thread(render, typed_content=True))
            tokens = self.tokenize(rendered, add_bos=add_bos, images=True)
        if pictures and tokens.count(IMAGE_TOKEN) != len(pictures):
            raise image_input.ImageError(
                f'the chat template of "{self.name}" does not render the messages\' text, so the images '
                "have no place in the prompt"
            )
        return tokens

    async def render_text(self, msgs: list[dict[str, Any]], turn: Turn) -> tuple[str, list[int]]:
        """The prompt text and its tokens, as a chat request on this turn would start (no images)."""
        rendered = await asyncio.to_thread(
            self.template.render, turn.prepare_messages(msgs), tools=turn.tools, extra=turn.variables()
        )
        rendered = turn.close_prompt(rendered)
        return rendered.text, self.tokenize(rendered)

    async def fit(self, msgs: list[dict[str, Any]], turn: Turn, tokens: list[int]) -> list[int]:
        """`truncate`: the conversation without its oldest turns, so that the prompt fits the context."""
        kept: list[dict[str, Any]] | None = msgs
        while len(tokens) >= self.model.context_length:
            kept = drop_oldest(kept or [])
            if kept is None:
                break  # only system messages and the last one left: the 400 follows
            tokens = await self.render(kept, turn)
        return tokens


def with_system(messages: Sequence[Mapping[str, Any]], system: str | None) -> list[dict[str, Any]]:
    """The messages as a new list, led by the model's own system prompt where they have none."""
    msgs = [dict(m) for m in messages]
    if system and not any(m.get("role") == "system" for m in msgs):
        msgs.insert(0, {"role": "system", "content": system})
    return msgs


def with_history(
    messages: Sequence[Mapping[str, Any]], system: str | None, history: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """A request's messages behind the model's own: its system prompt (where the request sets none), then
    its few-shot MESSAGE turns, then the request's turns, as Ollama orders them. A system message leading
    the request stays first, so that templates that read the system prompt only there still see it."""
    msgs = with_system(messages, system)
    lead = 0
    while lead < len(msgs) and msgs[lead].get("role") == "system":
        lead += 1
    return [*msgs[:lead], *(dict(m) for m in history), *msgs[lead:]]


def make_template(resolved: ResolvedModel, model: LoadedModel) -> ChatTemplate:
    source = select_template(
        resolved.template,
        model.metadata.get("tokenizer.chat_template"),
        model.metadata.get("general.architecture"),
        model.special_tokens(),
    ).source
    bos = model.token_text(model.bos_token_id) if model.bos_token_id is not None else ""
    eos = model.token_text(model.eos_token_ids[0]) if model.eos_token_ids else ""
    return ChatTemplate(source, bos_token=bos, eos_token=eos, special_tokens=model.special_tokens())


def tool_choice(
    choice: Any, tools: Sequence[Mapping[str, Any]] | None
) -> tuple[list[dict[str, Any]] | None, bool]:
    """(the tools the template renders, whether a call is required) for OpenAI's `tool_choice`."""
    if tools and not all(isinstance(t, Mapping) for t in tools):
        raise LocalrtError("tools must be a list of objects")
    listed = [dict(t) for t in tools] if tools else None
    if choice is None or choice == "auto":
        return listed, False
    if choice == "none":
        return None, False
    if choice == "required":
        if not listed:
            raise LocalrtError("tool_choice 'required' needs tools")
        return listed, True
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        fn = choice.get("function") if isinstance(choice.get("function"), Mapping) else choice
        wanted = fn.get("name")
        chosen = [t for t in listed or [] if thinking.tool_name(t) == wanted]
        if not chosen:
            raise LocalrtError(f"tool_choice names the function {wanted!r}, which is not in tools")
        return chosen, True
    raise LocalrtError('tool_choice must be "none", "auto", "required" or {"type": "function", ...}')


def mistral_ids(messages: list[dict[str, Any]]) -> None:
    """Mistral's templates refuse tool-call ids that are not 9 alphanumerics: map each id to one that is,
    the same way in the assistant's calls and in the tool results that answer them."""

    def short(call_id: Any) -> Any:
        if not isinstance(call_id, str) or (len(call_id) == 9 and call_id.isalnum()):
            return call_id
        return hashlib.sha256(call_id.encode()).hexdigest()[:9]

    for msg in messages:
        if isinstance(msg.get("tool_calls"), list):
            msg["tool_calls"] = [
                {**c, "id": short(c.get("id"))} if isinstance(c, Mapping) and c.get("id") else c
                for c in msg["tool_calls"]
            ]
        if msg.get("tool_call_id"):
            msg["tool_call_id"] = short(msg["tool_call_id"])


def preserved_tokens(model: LoadedModel, markers: Sequence[str]) -> frozenset[int]:
    """The special tokens spelling the format's markers (a marker that is plain text needs nothing)."""
    specials = set(model.special_tokens())
    ids = set()
    for marker in markers:
        if marker in specials:
            tokens = model.tokenize(marker, add_special=False, parse_special=True)
            if len(tokens) == 1:
                ids.add(tokens[0])
    return frozenset(ids)
