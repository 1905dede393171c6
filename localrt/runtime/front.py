"""The runtime's entrance: `Runtime`, the one object every interface (CLI, HTTP server, TUI) talks to.

    rt = Runtime()
    async for chunk in rt.chat("smollm2:135m", [{"role": "user", "content": "Hi"}]):
        print(chunk.content, end="")

Each request's model is resolved here once and the whole request goes down one of two paths: a remote
model (a manifest naming OpenAI-compatible endpoints) to `remote.RemoteRuntime`, which sends the
conversation or text upstream; every other model to `generate.LocalRuntime`, which renders, tokenizes
and runs it on a local backend. Both share one `ModelPool` (queue, slots, keep-alive, `ps`, `stop`) and
answer in the same `answers` types, so nothing above this module can tell them apart.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Unpack

from localrt.backends import devices
from localrt.backends import registry
from localrt.backends.base import ScoreResult
from localrt.errors import LocalrtError
from localrt.runtime import remote
from localrt.runtime.answers import Chunk
from localrt.runtime.answers import EmbedResult
from localrt.runtime.answers import RerankResult
from localrt.runtime.answers import Settings
from localrt.runtime.answers import check_settings
from localrt.runtime.generate import LocalRuntime
from localrt.runtime.lifecycle import LoadedInfo
from localrt.runtime.lifecycle import ModelPool
from localrt.runtime.tenants import PrefixRecord
from localrt.store.store import ResolvedModel
from localrt.store.store import Store


class Runtime:
    """The runtime every interface shares: the model pool and the entrance of every request path."""

    def __init__(
        self,
        store: Store | None = None,
        *,
        max_loaded: int | None = None,
        max_queue: int | None = None,
        keep_alive: float | None = None,
    ) -> None:
        self.pool = ModelPool(store, max_loaded=max_loaded, max_queue=max_queue, keep_alive=keep_alive)
        self.local = LocalRuntime(self.pool)
        self.remote = remote.RemoteRuntime(self.pool)

    @property
    def store(self) -> Store:
        return self.pool.store

    @property
    def prefixes(self) -> PrefixRecord:
        return self.local.prefixes

    def _path(self, model: str) -> tuple[ResolvedModel, LocalRuntime | remote.RemoteRuntime]:
        """The stored model and the path that serves it: the one place that tells remote from local."""
        resolved = self.pool.resolve(model)
        return resolved, self.remote if remote.is_remote(resolved) else self.local

    # ---- chat and generate -----------------------------------------------------------------------
    async def chat(
        self,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool | None = None,
        **settings: Unpack[Settings],
    ) -> AsyncIterator[Chunk]:
        """Answer a conversation. Empty `messages` only loads the model (or unloads with keep_alive 0).

        `tool_choice`: OpenAI's (None/"auto", "none", "required", {"type": "function", "function":
        {"name": ...}}); `settings`: what chat and generate share (`Settings`)."""
        check_settings(settings)
        resolved, path = self._path(model)
        chunks = path.chat(
            resolved,
            model,
            messages,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
            **settings,
        )
        async for chunk in chunks:
            yield chunk

    async def generate(
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
        """Complete a prompt (templated as one user turn unless raw). Empty prompt: load / unload only.

        `images`: base64 strings or bytes, placed at `[img]` in the prompt or in front of it;
        `suffix`: the text after the completion (fill-in-the-middle, `prompt` is the text before);
        `settings`: what chat and generate share (`Settings`)."""
        check_settings(settings)
        resolved, path = self._path(model)
        chunks = path.generate(
            resolved,
            model,
            prompt,
            system=system,
            raw=raw,
            context=context,
            images=images,
            suffix=suffix,
            **settings,
        )
        async for chunk in chunks:
            yield chunk

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
        resolved, path = self._path(model)
        return await path.embed(resolved, texts, options=options, keep_alive=keep_alive, truncate=truncate)

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
        resolved, path = self._path(model)
        return await path.rerank(resolved, query, documents, options=options, keep_alive=keep_alive)

    async def tokenize(
        self,
        model: str,
        text: str,
        *,
        add_special: bool = True,
        parse_special: bool = False,
        options: Mapping[str, Any] | None = None,
    ) -> list[int]:
        resolved, path = self._path(model)
        return await path.tokenize(
            resolved, text, add_special=add_special, parse_special=parse_special, options=options
        )

    async def detokenize(
        self, model: str, tokens: Sequence[int], *, options: Mapping[str, Any] | None = None
    ) -> str:
        resolved, path = self._path(model)
        return await path.detokenize(resolved, tokens, options=options)

    async def score(
        self,
        model: str,
        tokens: Sequence[int] | str,
        *,
        return_logits: bool = False,
        options: Mapping[str, Any] | None = None,
    ) -> ScoreResult:
        """Per-position log p(token_i | prefix) for perplexity / KL (a text is tokenized with BOS)."""
        resolved, path = self._path(model)
        result: ScoreResult = await path.score(resolved, tokens, return_logits=return_logits, options=options)
        return result

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
        resolved, path = self._path(model)
        return await path.render(resolved, model, messages, tools=tools, options=options, think=think)

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
