"""One client for a model host, shared by the CLI and the chat app: one protocol, two implementations.

`ServerClient` speaks Ollama's API to a running `localrt serve`; `RuntimeClient` drives a `Runtime`
and the store in this process. `connect()` picks the server when `GET http://LOCALRT_HOST/` answers,
else the in-process runtime, as Ollama's CLI builds `api.ClientFromEnvironment()` for every command.
Interfaces reach models only through this module, so a command behaves the same either way: `ps`
shows what `run` loaded on the server, and a second `run` reuses the loaded model.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from datetime import datetime
from pathlib import Path
from typing import Any
from typing import Protocol

import httpx

from localrt import config
from localrt import wire
from localrt.errors import BackendUnavailable
from localrt.errors import LocalrtError
from localrt.errors import ModelNotFound
from localrt.errors import PullError
from localrt.runtime.answers import Chunk
from localrt.store.sources.common import Progress
from localrt.threads import run_in_thread_stream

# ---- what the interfaces see ----------------------------------------------------------------------


class ServerUnreachable(LocalrtError):
    """The `localrt serve` this client talks to did not answer (stopped, crashed, wrong LOCALRT_HOST)."""

    status = 503


@dataclass
class ModelRow:
    """One installed model: `localrt list` and the chat app's sidebar."""

    name: str
    size: int
    modified: float  # epoch seconds
    digest: str = ""  # the manifest's sha256, hex


@dataclass
class LoadedRow:
    """One loaded model: `localrt ps`."""

    name: str
    digest: str  # hex
    size: int
    size_vram: int
    processor: str  # "100% CPU"
    backend: str
    context_length: int
    expires_at: float | None  # epoch seconds; None = kept until stopped
    weight_bytes: int = 0  # the weights' share of size, where the backend reports it (torch); 0: unknown
    numerics: str = ""  # the torch engine's weights: "quantized", "dequantized", ...; "": not reported
    # the other loaded models on the same weights (one base file, other adapters); the first loaded counts them
    shares_weights_with: tuple[str, ...] = ()


@dataclass
class ModelInfo:
    """What the chat app's model-info dialog shows."""

    name: str
    architecture: str
    parameters: str
    quantization: str
    context_length: int | None  # what the model was trained for
    size: int
    backend: str  # the backend in use when loaded, else what `auto`/the settings would pick
    loaded_context: int | None = None  # num_ctx of the loaded instance


@dataclass
class ModelDetails:
    """What `localrt show` prints: the GGUF header's facts and the model's Modelfile parts."""

    architecture: str
    parameters: str  # "135M"
    context_length: int | None
    embedding_length: int | None
    quantization: str
    parameter_lines: list[tuple[str, str]] = field(default_factory=list)  # Modelfile `PARAMETER k v`
    template: str = ""
    system: str = ""
    license: str = ""
    modelfile: str = ""
    template_origin: str = ""  # which template renders prompts: the file's, the Modelfile's, a family's
    remote_model: str = ""  # a remote model: the upstream's model id
    endpoints: list[tuple[str, str]] = field(default_factory=list)  # (url, "ok" or why it is down)
    capabilities: list[str] = field(default_factory=list)  # completion, tools, vision, rerank, ...
    projector: list[tuple[str, str]] = field(default_factory=list)  # a vision model's projector facts
    adapters: list[str] = field(default_factory=list)  # LoRA adapter blobs (ADAPTER lines), in order


@dataclass
class CreateSpec:
    """What `localrt create` asks for, whichever client builds it: a Modelfile's text or a GGUF
    (`from_path`), or a remote model's endpoints, plus the command's options. Paths are read
    on this side: over HTTP the files are uploaded as blobs, the server never reads a path of ours."""

    model: str
    modelfile_text: str | None = None
    from_path: str | None = None
    base_dir: str | None = None  # where relative FROM / DRAFT / projector paths start
    quantize: str | None = None
    remote: Sequence[str] | None = None
    remote_model: str | None = None
    api_key_env: str | None = None
    insecure: bool = False
    projector_path: str | None = None
    imatrix_path: str | None = None
    adapter_paths: Sequence[str] = ()  # LoRA adapter GGUFs, after the Modelfile's ADAPTER lines


Message = Mapping[str, Any]
StatusFn = Callable[[str], None]


class Client(Protocol):
    """What the interfaces need from a model host; both implementations raise LocalrtError subclasses."""

    kind: str  # "runtime" | "server"
    where: str  # shown in the chat app's status bar

    def chat(
        self,
        model: str,
        messages: Sequence[Message],
        *,
        options: Mapping[str, Any] | None = None,
        format: str | None = None,
        keep_alive: str | float | None = None,
        think: bool | str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
    ) -> AsyncIterator[Chunk]:
        """Stream an answer. `tools` (OpenAI's function shape) and `tool_choice` (auto, required, none, or
        {"type": "function", "function": {"name": ...}}) offer tools; the calls come back in
        `Chunk.tool_calls`, parsed from the model's own format."""
        ...

    async def list_models(self) -> list[ModelRow]: ...

    async def ps(self) -> list[LoadedRow]: ...

    async def stop(self, model: str) -> None: ...

    async def show(self, model: str, options: Mapping[str, Any] | None = None) -> ModelInfo: ...

    async def details(self, model: str) -> ModelDetails: ...

    async def has_model(self, model: str) -> bool: ...

    def pull(self, model: str, *, insecure: bool = False) -> AsyncIterator[Progress]: ...

    def push(self, model: str, *, insecure: bool = False) -> AsyncIterator[Progress]: ...

    async def delete(self, model: str) -> None: ...

    async def copy(self, source: str, destination: str) -> None: ...

    async def create(self, spec: CreateSpec, status: StatusFn | None = None) -> str:
        """Build a model as `localrt create` asks; returns its name. `status` hears each step."""
        ...

    async def context_length(self, model: str, options: Mapping[str, Any] | None = None) -> int | None: ...

    async def count_tokens(
        self, model: str, messages: Sequence[Message], options: Mapping[str, Any] | None = None
    ) -> tuple[int, bool]: ...

    async def close(self) -> None: ...


def _ignore_status(_: str) -> None:
    pass


def _remote_fields(spec: CreateSpec, mf: Any) -> dict[str, Any]:
    """`/api/create`'s fields for a remote model (the key's variable is read in the server's environment)."""
    if spec.quantize:
        raise LocalrtError("--quantize does not apply to a remote model (its weights live upstream)")
    return {
        "remote": list(spec.remote or mf.remotes),
        "remote_model": spec.remote_model or mf.remote_model,
        "api_key_env": spec.api_key_env or mf.api_key_env,
        "insecure": spec.insecure,
        "draft": mf.draft,  # refused by the server, as in process: a remote model has no draft
    }


def _split_parts(source: Path) -> list[Path]:
    """The parts of a split GGUF beside its first part, or the file alone."""
    from localrt.store.split import find_parts
    from localrt.store.split import is_split_part

    return find_parts(source) if source.suffix.lower() == ".gguf" and is_split_part(source) else [source]


def _remote_details(resolved: Any) -> ModelDetails:
    """`show` of a remote model: no GGUF; its endpoints probed now."""
    from localrt.show import parameter_lines
    from localrt.show import remote_health
    from localrt.show import remote_modelfile_text

    return ModelDetails(
        architecture="remote",
        parameters="",
        context_length=None,
        embedding_length=None,
        quantization="",
        parameter_lines=parameter_lines(resolved.params),
        template=resolved.template or "",
        system=resolved.system or "",
        license=str(resolved.license or ""),
        modelfile=remote_modelfile_text(resolved),
        remote_model=str(resolved.remote.get("model", "")),
        endpoints=remote_health(resolved),
    )


# ---- in process -------------------------------------------------------------------------------


class RuntimeClient:
    """The runtime in this process, created on first use so it binds to the caller's event loop."""

    kind = "runtime"
    where = "in-process"

    def __init__(self, runtime: Any = None, store: Any = None) -> None:
        from localrt.store.store import Store

        self.store = store or (runtime.store if runtime is not None else Store())
        self._runtime = runtime

    @property
    def runtime(self) -> Any:
        if self._runtime is None:
            from localrt.runtime.front import Runtime

            self._runtime = Runtime(self.store)
        return self._runtime

    def chat(
        self,
        model: str,
        messages: Sequence[Message],
        *,
        options: Mapping[str, Any] | None = None,
        format: str | None = None,
        keep_alive: str | float | None = None,
        think: bool | str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
    ) -> AsyncIterator[Chunk]:
        # the runtime's own generator: closing or cancelling it cancels the generation there
        return self.runtime.chat(
            model,
            messages,
            options=options or None,
            format=format,
            keep_alive=keep_alive,
            think=think,
            tools=tools or None,
            tool_choice=tool_choice,
        )

    async def list_models(self) -> list[ModelRow]:
        entries = await asyncio.to_thread(self.store.list_models)
        return [ModelRow(e.name.display, e.size, e.modified, e.id) for e in entries]

    async def ps(self) -> list[LoadedRow]:
        if self._runtime is None:
            return []  # nothing was loaded by this process yet
        return [
            LoadedRow(
                name=row.name,
                digest=row.digest.split(":", 1)[-1],
                size=row.size,
                size_vram=row.size_vram,
                processor=row.processor,
                backend=row.backend,
                context_length=row.context_length,
                expires_at=row.expires_at,
                weight_bytes=int(row.details.get("weight_bytes", 0)),
                numerics=str(row.details.get("numerics", "")),
                shares_weights_with=tuple(row.details.get("shares_weights_with", ())),
            )
            for row in self.runtime.ps()
        ]

    async def stop(self, model: str) -> None:
        if not await self.runtime.unload(model):
            raise LocalrtError(f"model '{model}' is not loaded")

    async def show(self, model: str, options: Mapping[str, Any] | None = None) -> ModelInfo:
        from localrt.runtime.options import Options
        from localrt.store.gguf import format_parameter_count
        from localrt.store.gguf import read_gguf

        resolved = await asyncio.to_thread(self.store.resolve, model)
        loaded = [row for row in self.runtime.ps() if row.name == resolved.name.display]
        if resolved.remote is not None:  # no GGUF here: the model lives on its endpoints
            return ModelInfo(
                name=resolved.name.display,
                architecture=f"remote: {resolved.remote.get('model', '')}",
                parameters="",
                quantization="",
                context_length=None,
                size=0,
                backend=f"remote ({', '.join(resolved.remote.get('endpoints') or [])})",
                loaded_context=loaded[0].context_length if loaded else None,
            )
        info = await asyncio.to_thread(read_gguf, resolved.model_path)
        if loaded:
            backend, loaded_ctx = loaded[0].backend, loaded[0].context_length
        else:
            loaded_ctx = None
            try:
                wanted = Options.merge(resolved.params, options, lenient=(True, False)).backend
                backend = f"{self.runtime.backend_for(wanted)} (not loaded)"
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

    async def details(self, model: str) -> ModelDetails:
        return await asyncio.to_thread(self._details, model)

    def _details(self, model: str) -> ModelDetails:
        from localrt.show import model_capabilities
        from localrt.show import modelfile_text
        from localrt.show import parameter_lines
        from localrt.show import projector_rows
        from localrt.show import template_choice
        from localrt.show import template_of
        from localrt.show import template_origin
        from localrt.store.gguf import format_parameter_count
        from localrt.store.gguf import read_gguf
        from localrt.store.names import parse_name

        resolved = self.store.resolve(parse_name(model))
        if resolved.remote is not None:
            return _remote_details(resolved)
        info = read_gguf(resolved.model_path)
        return ModelDetails(
            architecture=info.architecture or "unknown",
            parameters=format_parameter_count(info.parameter_count),
            context_length=info.context_length,
            embedding_length=info.embedding_length,
            quantization=info.file_type or "unknown",
            parameter_lines=parameter_lines(resolved.params),
            template=template_of(resolved, info),
            system=resolved.system or "",
            license=str(resolved.license or info.license or ""),
            modelfile=modelfile_text(resolved, info),
            template_origin=template_origin(template_choice(resolved, info)),
            capabilities=model_capabilities(resolved, info),
            projector=projector_rows(read_gguf(resolved.projector_path).summary())
            if resolved.projector_path is not None
            else [],
            adapters=[str(path) for path in resolved.adapter_paths],
        )

    async def has_model(self, model: str) -> bool:
        try:
            await asyncio.to_thread(self.store.resolve, model)
        except ModelNotFound:
            return False
        return True

    def pull(self, model: str, *, insecure: bool = False) -> AsyncIterator[Progress]:
        from localrt.store.pull import pull

        def work(emit: Any) -> None:
            pull(model, store=self.store, insecure=insecure, progress=emit)

        return run_in_thread_stream(work, name="localrt-client-pull")

    def push(self, model: str, *, insecure: bool = False) -> AsyncIterator[Progress]:
        from localrt.store.push import push

        def work(emit: Any) -> None:
            push(model, store=self.store, insecure=insecure, progress=emit)

        return run_in_thread_stream(work, name="localrt-client-push")

    async def delete(self, model: str) -> None:
        from localrt.store.names import parse_name

        name = parse_name(model)
        if self._runtime is not None:
            await self._runtime.unload(name.display)
        await asyncio.to_thread(self.store.remove, name)

    async def copy(self, source: str, destination: str) -> None:
        from localrt.store.names import parse_name

        await asyncio.to_thread(self.store.copy, parse_name(source), parse_name(destination))

    async def create(self, spec: CreateSpec, status: StatusFn | None = None) -> str:
        from localrt.store.modelfile import create

        name = await asyncio.to_thread(
            create,
            spec.model,
            modelfile_text=spec.modelfile_text,
            from_path=spec.from_path,
            store=self.store,
            base_dir=spec.base_dir,
            quantize=spec.quantize,
            remote=spec.remote,
            remote_model=spec.remote_model,
            api_key_env=spec.api_key_env,
            insecure=spec.insecure,
            projector_path=spec.projector_path,
            imatrix=spec.imatrix_path,
            adapters=spec.adapter_paths,
        )
        return name.display

    async def context_length(self, model: str, options: Mapping[str, Any] | None = None) -> int | None:
        from localrt.runtime.options import Options
        from localrt.store.gguf import read_gguf

        resolved = await asyncio.to_thread(self.store.resolve, model)
        for row in self.runtime.ps():
            if row.name == resolved.name.display:
                return row.context_length
        # not loaded yet: num_ctx as the runtime will ask for it, capped by what the model was trained for
        num_ctx = Options.merge(resolved.params, options, lenient=(True, False)).num_ctx
        if resolved.remote is not None:  # the upstream's context is known once it is loaded
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
        if self._http is None:  # made on the caller's loop, on first use
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
        if response.status_code not in (200, 201):
            raise _error_from(response.status_code, response.content)
        return response

    async def _post(self, path: str, request: wire.Wire) -> httpx.Response:
        return await self._request("POST", path, json=wire.body_of(request))

    async def _ndjson(self, path: str, request: wire.Wire) -> AsyncIterator[dict[str, Any]]:
        try:
            async with self.http.stream("POST", path, json=wire.body_of(request)) as response:
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
        keep_alive: str | float | None = None,
        think: bool | str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
    ) -> AsyncIterator[Chunk]:
        request = wire.build(
            wire.ChatRequest,
            model=model,
            messages=[dict(m) for m in messages],
            stream=True,
            options=dict(options) if options else None,
            format=format or None,
            keep_alive=keep_alive,
            think=think,
            tools=[dict(t) for t in tools] if tools else None,
            tool_choice=tool_choice,
        )
        async for item in self._ndjson("/api/chat", request):
            answer = wire.parse(wire.ChatResponse, item)
            yield Chunk(
                model=answer.model,
                content=answer.message.content,
                thinking=answer.message.thinking or "",
                done=answer.done,
                done_reason=answer.done_reason,
                tool_calls=answer.message.tool_calls,
                metrics=wire.metrics_from_ollama(item) if answer.done else None,
            )

    async def list_models(self) -> list[ModelRow]:
        tags = wire.parse(wire.TagsResponse, (await self._request("GET", "/api/tags")).json())
        return [ModelRow(m.name, m.size, _epoch(m.modified_at) or 0.0, m.digest) for m in tags.models]

    async def ps(self) -> list[LoadedRow]:
        loaded = wire.parse(wire.PsResponse, (await self._request("GET", "/api/ps")).json())
        return [
            LoadedRow(
                name=m.name,
                digest=m.digest.removeprefix("sha256:"),
                size=m.size,
                size_vram=m.size_vram,
                processor=m.processor or _processor(m.size, m.size_vram),
                backend=m.backend or "",
                context_length=m.context_length,
                expires_at=_epoch(m.expires_at),
                weight_bytes=int((m.details or {}).get("weight_bytes") or 0),
                numerics=str((m.details or {}).get("numerics") or ""),
                shares_weights_with=tuple((m.details or {}).get("shares_weights_with") or ()),
            )
            for m in loaded.models
        ]

    async def stop(self, model: str) -> None:
        await self._post("/api/generate", wire.build(wire.GenerateRequest, model=model, keep_alive=0))

    async def _loaded(self, model: str) -> LoadedRow | None:
        from localrt.store.names import parse_name

        key = parse_name(model).display
        return next((row for row in await self.ps() if row.name == key), None)

    async def _show(self, model: str) -> wire.ShowResponse:
        answer = await self._post("/api/show", wire.build(wire.ModelRequest, model=model))
        return wire.parse(wire.ShowResponse, answer.json())

    async def show(self, model: str, options: Mapping[str, Any] | None = None) -> ModelInfo:
        from localrt.store.names import parse_name

        data = await self._show(model)
        details, info = data.details, data.model_info
        arch = info.get("general.architecture") or details.family or "unknown"
        key = parse_name(model).display
        size = next((r.size for r in await self.list_models() if r.name == key), 0)
        loaded = await self._loaded(model)
        return ModelInfo(
            name=key,
            architecture=arch,
            parameters=details.parameter_size or "unknown",
            quantization=details.quantization_level or "unknown",
            context_length=info.get(f"{arch}.context_length"),
            size=size,
            backend=(loaded.backend or "unknown") if loaded else "(not loaded on the server)",
            loaded_context=loaded.context_length if loaded else None,
        )

    async def details(self, model: str) -> ModelDetails:
        from localrt.store.gguf import format_parameter_count

        data = await self._show(model)
        details, info, remote = data.details, data.model_info, data.remote or {}
        arch = info.get("general.architecture") or details.family or ""
        count = info.get("general.parameter_count")
        lines = [line.split(None, 1) for line in data.parameters.splitlines() if line.strip()]
        return ModelDetails(
            architecture=arch or "unknown",
            parameters=format_parameter_count(int(count)) if count else details.parameter_size or "",
            context_length=info.get(f"{arch}.context_length"),
            embedding_length=info.get(f"{arch}.embedding_length"),
            quantization=details.quantization_level or "unknown",
            parameter_lines=[(k[0], k[1] if len(k) > 1 else "") for k in lines],
            template=data.template,
            system=data.system,
            license=data.license,
            modelfile=data.modelfile,
            template_origin=data.template_origin,
            remote_model=str(remote.get("model") or ""),
            endpoints=[(e.get("url", ""), e.get("health", "")) for e in remote.get("endpoints", [])],
            capabilities=list(data.capabilities),
            projector=_projector_rows(data.projector_info),
            adapters=adapter_lines(data.modelfile),
        )

    async def has_model(self, model: str) -> bool:
        try:
            await self._post("/api/show", wire.build(wire.ModelRequest, model=model))
        except ModelNotFound:
            return False
        return True

    async def _progress(self, path: str, request: wire.Wire) -> AsyncIterator[Progress]:
        async for item in self._ndjson(path, request):
            p = wire.parse(wire.ProgressResponse, item)
            yield Progress(p.status, p.digest, p.total, p.completed)

    def pull(self, model: str, *, insecure: bool = False) -> AsyncIterator[Progress]:
        request = wire.build(wire.PullRequest, model=model, insecure=insecure, stream=True)
        return self._progress("/api/pull", request)

    def push(self, model: str, *, insecure: bool = False) -> AsyncIterator[Progress]:
        request = wire.build(wire.PushRequest, model=model, insecure=insecure, stream=True)
        return self._progress("/api/push", request)

    async def delete(self, model: str) -> None:
        request = wire.build(wire.ModelRequest, model=model)
        await self._request("DELETE", "/api/delete", json=wire.body_of(request))

    async def copy(self, source: str, destination: str) -> None:
        await self._post("/api/copy", wire.build(wire.CopyRequest, source=source, destination=destination))

    async def create(self, spec: CreateSpec, status: StatusFn | None = None) -> str:
        """As `ollama create`: the Modelfile is read here, local GGUFs (FROM, DRAFT, a projector) are
        uploaded as blobs, and the server builds the model from `files` or `from` (it never reads a path
        of ours). A projector (`projector_path`, or a second FROM) is uploaded beside the model's GGUF."""
        from localrt.store.modelfile import Modelfile
        from localrt.store.modelfile import parse_modelfile
        from localrt.store.names import parse_name

        emit = status or _ignore_status
        name = parse_name(spec.model).display
        mf = parse_modelfile(spec.modelfile_text) if spec.modelfile_text is not None else Modelfile()
        if spec.remote or mf.remotes:  # a remote model: the server checks the URLs
            fields = _remote_fields(spec, mf)
        else:
            fields = await self._weights_fields(spec, mf, emit)
        fields.update(
            {k: getattr(mf, k) for k in ("template", "system", "license") if getattr(mf, k) is not None}
        )
        fields.update(mf.formats())  # RENDERER, PARSER, REQUIRES
        if mf.messages:
            fields["messages"] = mf.messages
        request = wire.build(
            wire.CreateRequest, model=name, stream=True, parameters=mf.parameters or None, **fields
        )
        async for item in self._ndjson("/api/create", request):
            emit(wire.parse(wire.ProgressResponse, item).status)
        return name

    async def _weights_fields(self, spec: CreateSpec, mf: Any, emit: StatusFn) -> dict[str, Any]:
        """`/api/create`'s fields for a model with weights: each local file uploaded, names as they are."""
        from localrt.store.modelfile import ModelfileError
        from localrt.store.names import parse_name

        if spec.from_path is not None:
            mf.from_ = spec.from_path
        if not mf.from_:
            raise ModelfileError("Modelfile has no FROM line (name a GGUF file or a model)")
        fields: dict[str, Any] = {}
        here = Path(spec.base_dir) if spec.base_dir else Path.cwd()
        source = _local_file(mf.from_, here)
        if source is not None:
            # a split GGUF's parts all go up, named as they are: the server merges them
            parts = await asyncio.to_thread(_split_parts, source)
            fields["files"] = {part.name: await self._upload(part, emit) for part in parts}
        else:
            fields["from"] = parse_name(mf.from_).display
        projector = spec.projector_path or mf.projector
        if projector is not None:
            proj_file = _local_file(projector, here)
            if proj_file is None or source is None:
                raise LocalrtError("over the server's create API a projector goes with a local GGUF file")
            fields["files"][f"mmproj-{proj_file.name}"] = await self._upload(proj_file, emit)
        if mf.draft is not None:  # a local GGUF is uploaded; a name is a model stored on the server
            draft_file = _local_file(mf.draft, here)
            fields["draft"] = (
                await self._upload(draft_file, emit)
                if draft_file is not None
                else parse_name(mf.draft).display
            )
        fields["quantize"] = spec.quantize or None
        if spec.imatrix_path is not None:  # uploaded like the GGUF; the server weights --quantize with it
            fields["imatrix"] = await self._upload(Path(spec.imatrix_path), emit)
        adapters = [value for value, _ in mf.adapters] + list(spec.adapter_paths)
        if adapters:  # Ollama's `adapters`: file name -> digest, each checked here before it goes up
            fields["adapters"] = await self._adapter_fields(adapters, here, source, emit)
        return fields

    async def _adapter_fields(
        self, values: list[str], here: Path, base: Path | None, emit: StatusFn
    ) -> dict[str, str]:
        from localrt.converters.lora import PEFT_FILES
        from localrt.converters.lora import is_peft_dir
        from localrt.store.importer import check_adapter_file
        from localrt.store.names import DIGEST_RE
        from localrt.store.names import normalize_digest

        out: dict[str, str] = {}
        for i, value in enumerate(values):
            if DIGEST_RE.match(value):  # a blob the server already holds
                out[f"adapter-{i}.gguf"] = normalize_digest(value)
                continue
            path = Path(value).expanduser()
            path = path if path.is_absolute() else here / path
            await asyncio.to_thread(check_adapter_file, path)
            if is_peft_dir(path) and base is not None:
                out[f"{i}-{path.name}.gguf"] = await self._converted_upload(path, base, emit)
                continue
            if is_peft_dir(path):  # FROM is the server's model: its files go up, and the server converts
                if any(not name.endswith(".gguf") for name in out):
                    raise LocalrtError(
                        "one PEFT adapter folder per create when FROM is a model on the server "
                        "(the server converts it; convert the others with FROM a local GGUF)"
                    )
                for name in PEFT_FILES:
                    if (path / name).is_file():
                        out[name] = await self._upload(path / name, emit)
                continue
            out[f"{i}-{path.name}"] = await self._upload(path, emit)  # the index keeps equal names apart
        return out

    async def _converted_upload(self, peft_dir: Path, base: Path, emit: StatusFn) -> str:
        """A PEFT adapter folder goes up as the GGUF LoRA it converts to here: the server takes
        files, and the conversion reads the base model's GGUF, which is here too."""
        import tempfile

        from localrt.store.importer import convert_peft_adapter

        with tempfile.TemporaryDirectory(prefix="localrt-lora-") as tmp:
            out = Path(tmp) / f"{peft_dir.name}.gguf"
            emit(f"converting adapter {peft_dir.name}")
            await asyncio.to_thread(convert_peft_adapter, peft_dir, out, base)
            return await self._upload(out, emit)

    async def _upload(self, path: Path, emit: StatusFn) -> str:
        """The blob's digest, uploaded first unless the server already has it (HEAD /api/blobs)."""
        from localrt.store.store import sha256_file

        emit(f"gathering model components: {path.name}")
        digest = await asyncio.to_thread(sha256_file, path)
        try:
            head = await self.http.head(f"/api/blobs/{digest}")
        except httpx.TransportError as e:
            raise self._unreachable(e) from None
        if head.status_code != 200:
            emit(f"copying file {digest}")
            with open(path, "rb") as f:
                # the server refuses an upload whose size it cannot check against its free space
                length = {"Content-Length": str(os.fstat(f.fileno()).st_size)}
                await self._request("POST", f"/api/blobs/{digest}", content=_chunks(f), headers=length)
        return digest

    async def context_length(self, model: str, options: Mapping[str, Any] | None = None) -> int | None:
        loaded = await self._loaded(model)
        if loaded and loaded.context_length:
            return loaded.context_length
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
        answer = await self._post("/api/tokenize", wire.build(wire.TokenizeRequest, model=model, text=text))
        return len(wire.parse(wire.TokenizeResponse, answer.json()).tokens) + 5 * len(messages), False

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()


def adapter_lines(modelfile: str) -> list[str]:
    """The ADAPTER values of a Modelfile as `show` writes it (the server's blob paths)."""
    return [line.split(None, 1)[1].strip() for line in modelfile.splitlines() if line.startswith("ADAPTER ")]


def _projector_rows(info: Any) -> list[tuple[str, str]]:
    if not isinstance(info, dict) or not info:
        return []
    from localrt.show import projector_rows

    return projector_rows(info)


async def _chunks(f: Any, size: int = 1 << 20) -> AsyncIterator[bytes]:
    while block := await asyncio.to_thread(f.read, size):
        yield block


def _local_file(value: str, base_dir: Path) -> Path | None:
    """A FROM value naming a file here (read and uploaded by the client), else None (a model name)."""
    from localrt.store.modelfile import looks_like_path

    candidate = Path(value).expanduser()
    if not candidate.is_absolute():
        candidate = base_dir / candidate
    if candidate.is_file():
        return candidate
    if looks_like_path(value):
        raise LocalrtError(f"model file not found: {value}")
    return None


def _processor(size: int, vram: int) -> str:
    if vram >= size > 0:
        return "100% GPU"
    if vram == 0:
        return "100% CPU"
    gpu = vram * 100 // size
    return f"{100 - gpu}%/{gpu}% CPU/GPU"


def _epoch(stamp: Any) -> float | None:
    """An RFC 3339 time from the server as epoch seconds; None for Go's zero time (kept forever)."""
    if not stamp:
        return None
    try:
        when = datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))
    except ValueError:
        return None
    return None if when.year < 1970 else when.timestamp()


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


def server_answers(timeout: float = 0.5) -> bool:
    """True when `GET /` at LOCALRT_HOST answers 200 (a `localrt serve` or Ollama is there)."""
    url, _ = server_address()
    try:
        return httpx.get(url + "/", timeout=timeout, headers=config.auth_headers()).status_code == 200
    except httpx.HTTPError:
        return False


def connect(timeout: float = 0.5) -> Client:
    """A running server at LOCALRT_HOST if `GET /` answers 200 there, else the in-process runtime."""
    if server_answers(timeout):
        return ServerClient(*server_address())
    return RuntimeClient()
