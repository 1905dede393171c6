"""How the chat app reaches models: one small protocol, two implementations.

`RuntimeClient` drives an in-process `Runtime` (and the store, and the same `pull` as the CLI);
`ServerClient` speaks Ollama's API to a running `localrt serve`. `connect()` picks the server when
`GET http://LOCALRT_HOST/` answers, else the in-process runtime, as DESIGN.md's layers ask: the TUI
never reaches around these two.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from localrt import config
from localrt.backends.base import run_in_thread_stream
from localrt.errors import BackendUnavailable, LocalrtError, ModelNotFound, PullError
from localrt.runtime.manager import Chunk, Metrics
from localrt.store.pull import Progress

# ---- what the app sees --------------------------------------------------------------------------


class ServerUnreachable(LocalrtError):
    """The `localrt serve` this app talks to did not answer (stopped, crashed, wrong LOCALRT_HOST)."""

    status = 503


@dataclass
class ModelRow:
    """One installed model, for the sidebar."""

    name: str
    size: int
    modified: float


@dataclass
class ModelInfo:
    """What the model-info dialog shows."""

    name: str
    architecture: str
    parameters: str
    quantization: str
    context_length: int | None  # what the model was trained for
    size: int
    backend: str  # the backend in use when loaded, else what `auto`/the settings would pick
    loaded_context: int | None = None  # num_ctx of the loaded instance


Message = Mapping[str, Any]


class ChatClient(Protocol):
    """What the app needs from a model host; both implementations raise LocalrtError subclasses."""

    kind: str  # "runtime" | "server"
    where: str  # shown in the status bar

    def chat(
        self,
        model: str,
        messages: Sequence[Message],
        *,
        options: Mapping[str, Any] | None = None,
        format: str | None = None,
    ) -> AsyncIterator[Chunk]: ...

    async def list_models(self) -> list[ModelRow]: ...

    async def show(self, model: str, options: Mapping[str, Any] | None = None) -> ModelInfo: ...

    def _remote_info(self, resolved: Any) -> ModelInfo:
        loaded = [row for row in self.runtime.ps() if row.name == resolved.name.display]
        endpoints = resolved.remote.get("endpoints") or []
        return ModelInfo(
            name=resolved.name.display,
            architecture=f"remote: {resolved.remote.get('model', '')}",
            parameters="",
            quantization="",
            context_length=None,
            size=0,
            backend=f"remote ({', '.join(endpoints)})",
            loaded_context=loaded[0].context_length if loaded else None,
        )

    def pull(self, model: str, *, insecure: bool = False) -> AsyncIterator[Progress]: ...

    async def delete(self, model: str) -> None: ...

    async def context_length(self, model: str, options: Mapping[str, Any] | None = None) -> int | None: ...

    async def count_tokens(
        self, model: str, messages: Sequence[Message], options: Mapping[str, Any] | None = None
    ) -> tuple[int, bool]: ...

    async def close(self) -> None: ...


# ---- in process -------------------------------------------------------------------------------


class RuntimeClient:
    """The runtime in this process, created on first use so it binds to the app's event loop."""

    kind = "runtime"
    where = "in-process"

    def __init__(self, runtime: Any = None, store: Any = None) -> None:
        from localrt.store.store import Store

        self.store = store or (runtime.store if runtime is not None else Store())
        self._runtime = runtime

    @property
    def runtime(self) -> Any:
        if self._runtime is None:
            from localrt.runtime.manager import Runtime

            self._runtime = Runtime(self.store)
        return self._runtime

    def chat(
        self,
        model: str,
        messages: Sequence[Message],
        *,
        options: Mapping[str, Any] | None = None,
        format: str | None = None,
    ) -> AsyncIterator[Chunk]:
        # the runtime's own generator: closing or cancelling it cancels the generation there
        return self.runtime.chat(model, messages, options=options or None, format=format)

    async def list_models(self) -> list[ModelRow]:
        entries = await asyncio.to_thread(self.store.list_models)
        return [ModelRow(e.name.display, e.size, e.modified) for e in entries]

    async def show(self, model: str, options: Mapping[str, Any] | None = None) -> ModelInfo:
        from localrt.backends import registry
        from localrt.runtime.options import Options
        from localrt.store.gguf import format_parameter_count, read_gguf

        resolved = await asyncio.to_thread(self.store.resolve, model)
        if resolved.remote is not None:  # no GGUF here: the model lives on its endpoints
            return self._remote_info(resolved)
        info = await asyncio.to_thread(read_gguf, resolved.model_path)
        loaded = [row for row in self.runtime.ps() if row.name == resolved.name.display]
        if loaded:
            backend, loaded_ctx = loaded[0].backend, loaded[0].context_length
        else:
            loaded_ctx = None
            try:
                wanted = Options.merge(resolved.params, options, lenient=(True, False)).backend
                backend = f"{registry.resolve(wanted)} (not loaded)"
            except LocalrtError as e:
                backend = f"unavailable: {e}"
        return ModelInfo(
            name=resolved.name.display,
            architecture=info.architecture or "unknown",
            parameters=format_parameter_count(info.parameter_count),
            quantization=info.quantization_label,
            context_length=info.context_length,
            size=resolved.size,
            backend=backend,
            loaded_context=loaded_ctx,
        )

    def _remote_info(self, resolved: Any) -> ModelInfo:
        loaded = [row for row in self.runtime.ps() if row.name == resolved.name.display]
        endpoints = resolved.remote.get("endpoints") or []
        return ModelInfo(
            name=resolved.name.display,
            architecture=f"remote: {resolved.remote.get('model', '')}",
            parameters="",
            quantization="",
            context_length=None,
            size=0,
            backend=f"remote ({', '.join(endpoints)})",
            loaded_context=loaded[0].context_length if loaded else None,
        )

    def pull(self, model: str, *, insecure: bool = False) -> AsyncIterator[Progress]:
        from localrt.store.pull import pull

        def work(emit: Any) -> None:
            pull(model, store=self.store, insecure=insecure, progress=emit)

        return run_in_thread_stream(work, wait=False, name="localrt-tui-pull")

    async def delete(self, model: str) -> None:
        from localrt.store.names import parse_name

        name = parse_name(model)
        await self.runtime.unload(name.display)
        await asyncio.to_thread(self.store.remove, name)

    async def context_length(self, model: str, options: Mapping[str, Any] | None = None) -> int | None:
        from localrt.runtime.options import Options
        from localrt.store.gguf import read_gguf

        resolved = await asyncio.to_thread(self.store.resolve, model)
        for row in self.runtime.ps():
            if row.name == resolved.name.display:
                return row.context_length
        # not loaded yet: num_ctx as the runtime will ask for it, capped by what the model was trained for
        num_ctx = Options.merge(resolved.params, options, lenient=(True, False)).num_ctx
        if resolved.remote is not None:  # the upstream's context is known once loaded
            return None
        trained = (await asyncio.to_thread(read_gguf, resolved.model_path)).context_length
        return min(num_ctx, trained) if trained else num_ctx

    async def count_tokens(
        self, model: str, messages: Sequence[Message], options: Mapping[str, Any] | None = None
    ) -> tuple[int, bool]:
        # the exact prompt the next request would start from: templated and tokenized by the runtime,
        # with the model's own system prompt where the conversation has none (as Runtime.chat adds it)
        msgs = [dict(m) for m in messages]
        if not any(m.get("role") == "system" for m in msgs):
            resolved = await asyncio.to_thread(self.store.resolve, model)
            if resolved.system:
                msgs.insert(0, {"role": "system", "content": resolved.system})
        _, tokens = await self.runtime.render(model, msgs, options=options or None)
        return len(tokens), True

    async def close(self) -> None:
        if self._runtime is not None:
            await self._runtime.close()


# ---- over HTTP --------------------------------------------------------------------------------
server_address = config.server_address


class ServerClient:
    """A running `localrt serve` (or any Ollama-compatible server) over its NDJSON API."""

    kind = "server"

    def __init__(self, base_url: str, shown: str | None = None, *, connect_timeout: float = 5.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.where = f"server {shown or self.base_url}"
        self._shown = shown or self.base_url
        self._timeout = httpx.Timeout(connect_timeout, read=None)  # answers and pulls take their time
        self._http: httpx.AsyncClient | None = None

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:  # made on the app's loop, on first use
            self._http = httpx.AsyncClient(
                base_url=self.base_url, headers=config.auth_headers(), timeout=self._timeout
            )
        return self._http

    def _unreachable(self, e: Exception) -> ServerUnreachable:
        return ServerUnreachable(
            f"cannot reach the localrt server at {self._shown} "
            f"({type(e).__name__}); is `localrt serve` running?"
        )

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self.http.request(method, path, **kwargs)
        except httpx.TransportError as e:
            raise self._unreachable(e) from None
        if response.status_code != 200:
            raise _error_from(response.status_code, response.content)
        return response

    async def _ndjson(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        try:
            async with self.http.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    raise _error_from(response.status_code, await response.aread())
                async for line in response.aiter_lines():
                    if not line.strip():
                        continue
                    item = json.loads(line)
                    if "error" in item:  # an error after the stream began is one more line
                        raise _error_from(500, line.encode())
                    yield item
        except httpx.TransportError as e:
            raise self._unreachable(e) from None

    async def chat(
        self,
        model: str,
        messages: Sequence[Message],
        *,
        options: Mapping[str, Any] | None = None,
        format: str | None = None,
    ) -> AsyncIterator[Chunk]:
        body: dict[str, Any] = {"model": model, "messages": [dict(m) for m in messages], "stream": True}
        if options:
            body["options"] = dict(options)
        if format:
            body["format"] = format
        async for item in self._ndjson("/api/chat", body):
            message = item.get("message") or {}
            metrics = None
            if item.get("done"):
                metrics = Metrics.from_ollama(item)
            yield Chunk(
                model=item.get("model", model),
                content=message.get("content") or "",
                done=bool(item.get("done")),
                done_reason=item.get("done_reason"),
                tool_calls=message.get("tool_calls"),
                metrics=metrics,
            )

    async def list_models(self) -> list[ModelRow]:
        from datetime import datetime

        rows = []
        for m in (await self._request("GET", "/api/tags")).json().get("models", []):
            try:
                stamp = str(m.get("modified_at", "")).replace("Z", "+00:00")
                modified = datetime.fromisoformat(stamp).timestamp()
            except ValueError:
                modified = 0.0
            rows.append(ModelRow(m.get("name") or m.get("model", ""), int(m.get("size", 0)), modified))
        return rows

    async def _loaded(self, model: str) -> dict[str, Any] | None:
        from localrt.store.names import parse_name

        key = parse_name(model).display
        for row in (await self._request("GET", "/api/ps")).json().get("models", []):
            if row.get("name") == key or row.get("model") == key:
                return row
        return None

    async def show(self, model: str, options: Mapping[str, Any] | None = None) -> ModelInfo:
        from localrt.store.names import parse_name

        data = (await self._request("POST", "/api/show", json={"model": model})).json()
        details, info = data.get("details") or {}, data.get("model_info") or {}
        arch = info.get("general.architecture") or details.get("family") or "unknown"
        key = parse_name(model).display
        size = next((r.size for r in await self.list_models() if r.name == key), 0)
        loaded = await self._loaded(model)
        return ModelInfo(
            name=key,
            architecture=arch,
            parameters=details.get("parameter_size") or "unknown",
            quantization=details.get("quantization_level") or "unknown",
            context_length=info.get(f"{arch}.context_length"),
            size=size,
            backend=(loaded.get("backend") or "unknown") if loaded else "(not loaded on the server)",
            loaded_context=loaded.get("context_length") if loaded else None,
        )

    async def pull(self, model: str, *, insecure: bool = False) -> AsyncIterator[Progress]:
        async for item in self._ndjson("/api/pull", {"model": model, "insecure": insecure, "stream": True}):
            yield Progress(
                item.get("status", ""), item.get("digest"), item.get("total"), item.get("completed")
            )

    async def delete(self, model: str) -> None:
        await self._request("DELETE", "/api/delete", json={"model": model})

    async def context_length(self, model: str, options: Mapping[str, Any] | None = None) -> int | None:
        loaded = await self._loaded(model)
        if loaded and loaded.get("context_length"):
            return int(loaded["context_length"])
        from localrt.runtime.options import Options

        info = await self.show(model)
        num_ctx = Options.merge(options).num_ctx  # the server's Modelfile parameters are not known here
        return min(num_ctx, info.context_length) if info.context_length else num_ctx

    async def count_tokens(
        self, model: str, messages: Sequence[Message], options: Mapping[str, Any] | None = None
    ) -> tuple[int, bool]:
        # the server has no render route: tokenize the text and add a few tokens per message for
        # the template's role markers, so the count is an estimate (shown with a ~)
        text = "\n".join(str(m.get("content") or "") for m in messages)
        data = (await self._request("POST", "/api/tokenize", json={"model": model, "text": text})).json()
        return len(data.get("tokens", [])) + 5 * len(messages), False

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()


def _error_from(status: int, body: bytes) -> LocalrtError:
    """A server error body ({"error": "..."} or OpenAI's shape) as the matching LocalrtError."""
    try:
        error = json.loads(body).get("error")
        if isinstance(error, dict):
            error = error.get("message")
    except (ValueError, AttributeError):
        error = None
    message = str(error) if error else f"the server answered {status}"
    kind = {404: ModelNotFound, 501: BackendUnavailable, 502: PullError}.get(status, LocalrtError)
    return kind(message)


def connect(timeout: float = 0.5) -> ChatClient:
    """A running server at LOCALRT_HOST if `GET /` answers 200 there, else the in-process runtime."""
    url, shown = server_address()
    try:
        if httpx.get(url + "/", timeout=timeout, headers=config.auth_headers()).status_code == 200:
            return ServerClient(url, shown)
    except httpx.HTTPError:
        pass
    return RuntimeClient()
