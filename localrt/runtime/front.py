"""The runtime's entrance: `Runtime`, the one object every interface (CLI, HTTP server, TUI) talks to.

    rt = Runtime()
    async for chunk in rt.chat("smollm2:135m", [{"role": "user", "content": "Hi"}]):
        print(chunk.content, end="")

Each request's model is resolved here once, the request is planned once (`plan.py`: options, checks,
keep-alive, the kind of model), and the chosen path's iterator is handed back as it is: a remote model
(a manifest naming OpenAI-compatible endpoints) to `remote.RemoteRuntime`, which sends the conversation
or text upstream; every other model to `generate.LocalRuntime`, which renders, tokenizes and runs it on
a local backend. Both share one `ModelPool` (queue, slots, keep-alive, `ps`, `stop`) and answer in the
same `answers` types, so nothing above this module can tell them apart. An OpenAI request for a remote
model may instead be forwarded as the client wrote it (`forward`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Protocol
from typing import Unpack

from localrt.backends import devices
from localrt.backends import registry
from localrt.backends.base import ScoreResult
from localrt.errors import LocalrtError
from localrt.runtime import fim
from localrt.runtime import remote
from localrt.runtime.answers import Chunk
from localrt.runtime.answers import EmbedResult
from localrt.runtime.answers import RerankResult
from localrt.runtime.answers import Settings
from localrt.runtime.answers import check_settings
from localrt.runtime.generate import LocalRuntime
from localrt.runtime.lifecycle import LoadedInfo
from localrt.runtime.lifecycle import Loader
from localrt.runtime.lifecycle import ModelPool
from localrt.runtime.lifecycle import PoolLimits
from localrt.runtime.plan import Asked
from localrt.runtime.plan import ChatAsked
from localrt.runtime.plan import InfillAsked
from localrt.runtime.plan import Plan
from localrt.runtime.plan import TextAsked
from localrt.runtime.plan import load_only
from localrt.runtime.plan import plan
from localrt.runtime.prompt import with_history
from localrt.runtime.remote import Forwarded
from localrt.store.remote import is_remote
from localrt.store.store import ResolvedModel
from localrt.store.store import Store


class Path(Protocol):
    """What a request path does once the entrance has chosen it and planned the request."""

    @property
    def loader(self) -> Loader[Any]: ...

    def answer(self, p: Plan, asked: Asked) -> AsyncIterator[Chunk]:
        """The answer to a planned chat, generate or fill-in-the-middle request, as it streams."""
        ...

    async def embed(self, p: Plan, texts: list[str], truncate: bool) -> EmbedResult: ...

    async def rerank(self, p: Plan, query: str, documents: Sequence[str]) -> RerankResult: ...

    async def tokenize(self, p: Plan, text: str, add_special: bool, parse_special: bool) -> list[int]: ...

    async def detokenize(self, p: Plan, tokens: Sequence[int]) -> str: ...

    async def score(self, p: Plan, tokens: Sequence[int] | str, return_logits: bool) -> ScoreResult: ...

    async def render(self, p: Plan, messages: list[dict[str, Any]]) -> tuple[str, list[int]]:
        """The prompt text and tokens `p` (its tools and thinking) would make of `messages`."""
        ...


class Runtime:
    """The runtime every interface shares: the model pool and the entrance of every request path."""

    def __init__(self, store: Store | None = None, **limits: Unpack[PoolLimits]) -> None:
        self.pool = ModelPool(store, **limits)
        self.local = LocalRuntime(self.pool)
        self.remote = remote.RemoteRuntime(self.pool)

    @property
    def store(self) -> Store:
        return self.pool.store

    def _path(self, model: str) -> tuple[ResolvedModel, Path]:
        """The stored model and the path that serves it: the one place that tells remote from local."""
        resolved = self.pool.resolve(model)
        return resolved, self.remote if is_remote(resolved) else self.local

    def _plan(
        self, model: str, settings: Settings, *, tools: Any = None, choice: Any = None
    ) -> tuple[Plan, Path]:
        """The request planned (`plan.py`) for the path that serves its model."""
        resolved, path = self._path(model)
        return plan(self.pool, resolved, model, settings, path.loader, tools=tools, choice=choice), path

    # ---- chat and generate -----------------------------------------------------------------------
    def chat(
        self,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool | None = None,
        **settings: Unpack[Settings],
    ) -> AsyncIterator[Chunk]:
        """Answer a conversation: the chosen path's chunks. Empty `messages` only loads the model (or
        unloads with keep_alive 0). The model and the settings are checked now, before any load.

        `tool_choice`: OpenAI's (None/"auto", "none", "required", {"type": "function", "function":
        {"name": ...}}); `settings`: what chat and generate share (`Settings`)."""
        check_settings(settings)
        p, path = self._plan(model, settings, tools=tools, choice=tool_choice)
        if not messages:
            return load_only(self.pool, p)
        return path.answer(p, ChatAsked(messages, parallel_tool_calls))

    def generate(
        self,
        model: str,
        prompt: str = "",
        *,
        system: str | None = None,
        raw: bool = False,
        context: Sequence[int] | None = None,
        images: Sequence[Any] | None = None,
        suffix: str | None = None,
        **settings: Unpack[Settings],
    ) -> AsyncIterator[Chunk]:
        """Complete a prompt (templated as one user turn unless raw): the chosen path's chunks. An empty
        prompt only loads or unloads. The model and the settings are checked now, before any load.

        `images`: base64 strings or bytes, placed at `[img]` in the prompt or in front of it;
        `suffix`: the text after the completion (fill-in-the-middle, `prompt` is the text before);
        `settings`: what chat and generate share (`Settings`)."""
        check_settings(settings)
        p, path = self._plan(model, settings)
        if suffix:
            fim.check_insert(p.name, True, raw, bool(images))
            return path.answer(p, InfillAsked(prompt, suffix, context))
        if not prompt and not context:
            return load_only(self.pool, p)
        if raw and (system or context):
            raise LocalrtError("raw mode does not support template, system, or context")
        return path.answer(p, TextAsked(prompt, system, raw, context, images))

    async def forward(
        self, model: str, route: str, body: Mapping[str, Any], *, keep_alive: Any = None
    ) -> Forwarded | None:
        """An OpenAI request (`route`: chat/completions, completions, embeddings) for a remote model,
        passed to its upstream as the client wrote it, `model` renamed; None for a local model, which the
        caller answers itself. Errors before the upstream's first byte raise here."""
        resolved, path = self._path(model)
        if path is not self.remote:
            return None
        p = plan(self.pool, resolved, model, {"keep_alive": keep_alive}, path.loader)
        return await self.remote.forward(p, route, body)

    # ---- the other paths ---------------------------------------------------------------------
    async def embed(
        self,
        model: str,
        inputs: str | Sequence[str],
        *,
        options: Mapping[str, Any] | None = None,
        keep_alive: str | float | None = None,
        truncate: bool = True,
    ) -> EmbedResult:
        texts = [inputs] if isinstance(inputs, str) else list(inputs)
        if not all(isinstance(t, str) for t in texts):
            raise LocalrtError("input must be a string or a list of strings")
        p, path = self._plan(model, {"options": options, "keep_alive": keep_alive})
        result = await path.embed(p, texts, truncate)
        result.total_ns = time.perf_counter_ns() - p.start
        return result

    async def rerank(
        self,
        model: str,
        query: str,
        documents: Sequence[str],
        *,
        options: Mapping[str, Any] | None = None,
        keep_alive: str | float | None = None,
    ) -> RerankResult:
        """Relevance of each document to the query, from a reranker model (rank pooling)."""
        if not isinstance(query, str) or not query:
            raise LocalrtError("query is required (a string)")
        if not isinstance(documents, (list, tuple)) or not all(isinstance(d, str) for d in documents):
            raise LocalrtError("documents must be a list of strings")
        p, path = self._plan(model, {"options": options, "keep_alive": keep_alive})
        result = await path.rerank(p, query, documents)
        result.total_ns = time.perf_counter_ns() - p.start
        return result

    async def tokenize(
        self,
        model: str,
        text: str,
        *,
        add_special: bool = True,
        parse_special: bool = False,
        options: Mapping[str, Any] | None = None,
    ) -> list[int]:
        p, path = self._plan(model, {"options": options})
        return await path.tokenize(p, text, add_special, parse_special)

    async def detokenize(
        self, model: str, tokens: Sequence[int], *, options: Mapping[str, Any] | None = None
    ) -> str:
        p, path = self._plan(model, {"options": options})
        return await path.detokenize(p, tokens)

    async def score(
        self,
        model: str,
        tokens: Sequence[int] | str,
        *,
        return_logits: bool = False,
        options: Mapping[str, Any] | None = None,
    ) -> ScoreResult:
        """Per-position log p(token_i | prefix) for perplexity / KL (a text is tokenized with BOS)."""
        p, path = self._plan(model, {"options": options})
        return await path.score(p, tokens, return_logits)

    async def render(
        self,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        options: Mapping[str, Any] | None = None,
        think: Any = None,
    ) -> tuple[str, list[int]]:
        """The prompt text and tokens a chat request would use (debugging, `_debug_render_only`, and
        Anthropic's count_tokens, which must match the answer's input_tokens)."""
        p, path = self._plan(model, {"options": options, "think": think}, tools=tools)
        return await path.render(p, with_history(messages, p.resolved.system, p.resolved.messages))

    # ---- the pool's state -------------------------------------------------------------------------
    def ps(self) -> list[LoadedInfo]:
        return self.pool.ps()

    def queue_depth(self) -> dict[str, int]:
        """Requests waiting or running, per model (for /metrics)."""
        return self.pool.queue_depth()

    async def unload(self, model: str) -> bool:
        """Unload now if idle, else as soon as its running requests finish. False when not loaded."""
        return await self.pool.unload(model)

    async def close(self) -> None:
        """Cancel what runs and unload everything (server shutdown, end of `localrt run`)."""
        await self.pool.close()

    # ---- the machine, as the interfaces may tell it --------------------------------------------------
    @staticmethod
    def backend_for(name: str | None) -> str:
        """The backend a request naming `name` (`auto`, None, or a backend) would load on here."""
        return registry.resolve(name)

    @staticmethod
    def device_report() -> list[str]:
        """What `localrt serve` logs at start-up: llama.cpp's compute devices, and how to reinstall it when
        the machine has a GPU the build cannot use."""
        return devices.startup_report()
