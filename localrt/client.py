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
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import httpx

from localrt import config
from localrt.errors import BackendUnavailable, LocalrtError, ModelNotFound, PullError
from localrt.runtime.bridge import run_in_thread_stream
from localrt.runtime.manager import Chunk, Metrics
from localrt.store.sources.common import Progress

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
    remote_model: str = ""  # a remote model (SPEC 8): the upstream's model id
    endpoints: list[tuple[str, str]] = field(default_factory=list)  # (url, "ok" or why it is down)
    capabilities: list[str] = field(default_factory=list)  # completion, tools, vision, rerank, ...
    projector: list[tuple[str, str]] = field(default_factory=list)  # a vision model's projector facts


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
    ) -> AsyncIterator[Chunk]: ...

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

    async def create(
        self,
        model: str,
        *,
        modelfile_text: str | None = None,
        from_path: str | None = None,
        base_dir: str | None = None,
        quantize: str | None = None,
        status: StatusFn | None = None,
        remote: Sequence[str] | None = None,
        remote_model: str | None = None,
        api_key_env: str | None = None,
        insecure: bool = False,
        projector_path: str | None = None,
        imatrix_path: str | None = None,
    ) -> str: ...

    async def context_length(self, model: str, options: Mapping[str, Any] | None = None) -> int | None: ...

    async def count_tokens(
        self, model: str, messages: Sequence[Message], options: Mapping[str, Any] | None = None
    ) -> tuple[int, bool]: ...

    async def close(self) -> None: ...


def _ignore_status(_: str) -> None:
    pass


def _remote_create_body(
    mf: Any, remote_model: str | None, api_key_env: str | None, insecure: bool
) -> dict[str, Any]:
    """`/api/create` fields for a remote model (the key's variable is read in the server's environment)."""
    body: dict[str, Any] = {
        "remote": mf.remotes,
        "remote_model": remote_model or mf.remote_model,
        "api_key_env": api_key_env or mf.api_key_env,
        "insecure": insecure,
    }
    if mf.parameters:
        body["parameters"] = mf.parameters
    for key in ("template", "system", "license"):
        if getattr(mf, key) is not None:
            body[key] = getattr(mf, key)
    return body


def _remote_details(resolved: Any) -> ModelDetails:
    """`show` of a remote model: no GGUF; its endpoints probed now."""
    from localrt.show import parameter_lines, remote_health, remote_modelfile_text

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
        keep_alive: str | float | None = None,
        think: bool | str | None = None,
    ) -> AsyncIterator[Chunk]:
        # the runtime's own generator: closing or cancelling it cancels the generation there
        return self.runtime.chat(
            model, messages, options=options or None, format=format, keep_alive=keep_alive, think=think
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
            )
            for row in self.runtime.ps()
        ]

    async def stop(self, model: str) -> None:
        if not await self.runtime.unload(model):
            raise LocalrtError(f"model '{model}' is not loaded")

    async def show(self, model: str, options: Mapping[str, Any] | None = None) -> ModelInfo:
        from localrt.runtime.bridge import resolve_backend
        from localrt.runtime.options import Options
        from localrt.store.gguf import format_parameter_count, read_gguf

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
                backend = f"{resolve_backend(wanted)} (not loaded)"
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
        from localrt.show import (
            model_capabilities,
            modelfile_text,
            parameter_lines,
            projector_rows,
            template_choice,
            template_of,
            template_origin,
        )
        from localrt.store.gguf import format_parameter_count, read_gguf
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

        return run_in_thread_stream(work, wait=False, name="localrt-client-pull")

    def push(self, model: str, *, insecure: bool = False) -> AsyncIterator[Progress]:
        from localrt.store.push import push

        def work(emit: Any) -> None:
            push(model, store=self.store, insecure=insecure, progress=emit)

        return run_in_thread_stream(work, wait=False, name="localrt-client-push")

    async def delete(self, model: str) -> None:
        from localrt.store.names import parse_name

        name = parse_name(model)
        if self._runtime is not None:
            await self._runtime.unload(name.display)
        await asyncio.to_thread(self.store.remove, name)

    async def copy(self, source: str, destination: str) -> None:
        from localrt.store.names import parse_name

        await asyncio.to_thread(self.store.copy, parse_name(source), parse_name(destination))

    async def create(
        self,
        model: str,
        *,
        modelfile_text: str | None = None,
        from_path: str | None = None,
        base_dir: str | None = None,
        quantize: str | None = None,
        status: StatusFn | None = None,
        remote: Sequence[str] | None = None,
        remote_model: str | None = None,
        api_key_env: str | None = None,
        insecure: bool = False,
        projector_path: str | None = None,
        imatrix_path: str | None = None,
    ) -> str:
        from localrt.store.modelfile import create

        name = await asyncio.to_thread(
            create,
            model,
            modelfile_text=modelfile_text,
            from_path=from_path,
            store=self.store,
            base_dir=base_dir,
            quantize=quantize,
            remote=remote,
            remote_model=remote_model,
            api_key_env=api_key_env,
            insecure=insecure,
            projector_path=projector_path,
            imatrix=imatrix_path,
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
        keep_alive: str | float | None = None,
        think: bool | str | None = None,
    ) -> AsyncIterator[Chunk]:
        body: dict[str, Any] = {"model": model, "messages": [dict(m) for m in messages], "stream": True}
        if options:
            body["options"] = dict(options)
        if format:
            body["format"] = format
        if keep_alive is not None:
            body["keep_alive"] = keep_alive
        if think is not None:
            body["think"] = think
        async for item in self._ndjson("/api/chat", body):
            message = item.get("message") or {}
            yield Chunk(
                model=item.get("model", model),
                content=message.get("content") or "",
                thinking=message.get("thinking") or "",
                done=bool(item.get("done")),
                done_reason=item.get("done_reason"),
                tool_calls=message.get("tool_calls"),
                metrics=Metrics.from_ollama(item) if item.get("done") else None,
            )

    async def list_models(self) -> list[ModelRow]:
        rows = []
        for m in (await self._request("GET", "/api/tags")).json().get("models", []):
            modified = _epoch(m.get("modified_at")) or 0.0
            name = m.get("name") or m.get("model", "")
            rows.append(ModelRow(name, int(m.get("size", 0)), modified, str(m.get("digest", ""))))
        return rows

    async def ps(self) -> list[LoadedRow]:
        rows = []
        for m in (await self._request("GET", "/api/ps")).json().get("models", []):
            size, vram = int(m.get("size", 0)), int(m.get("size_vram", 0))
            rows.append(
                LoadedRow(
                    name=m.get("name") or m.get("model", ""),
                    digest=str(m.get("digest", "")).removeprefix("sha256:"),
                    size=size,
                    size_vram=vram,
                    processor=m.get("processor") or _processor(size, vram),
                    backend=m.get("backend") or "",
                    context_length=int(m.get("context_length") or 0),
                    expires_at=_epoch(m.get("expires_at")),
                    weight_bytes=int((m.get("details") or {}).get("weight_bytes") or 0),
                )
            )
        return rows

    async def stop(self, model: str) -> None:
        await self._request("POST", "/api/generate", json={"model": model, "keep_alive": 0})

    async def _loaded(self, model: str) -> LoadedRow | None:
        from localrt.store.names import parse_name

        key = parse_name(model).display
        return next((row for row in await self.ps() if row.name == key), None)

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
            backend=(loaded.backend or "unknown") if loaded else "(not loaded on the server)",
            loaded_context=loaded.context_length if loaded else None,
        )

    async def details(self, model: str) -> ModelDetails:
        from localrt.store.gguf import format_parameter_count

        data = (await self._request("POST", "/api/show", json={"model": model})).json()
        details, info = data.get("details") or {}, data.get("model_info") or {}
        arch = info.get("general.architecture") or details.get("family") or ""
        count = info.get("general.parameter_count")
        lines = [
            line.split(None, 1) for line in str(data.get("parameters") or "").splitlines() if line.strip()
        ]
        return ModelDetails(
            architecture=arch or "unknown",
            parameters=format_parameter_count(int(count)) if count else details.get("parameter_size") or "",
            context_length=info.get(f"{arch}.context_length"),
            embedding_length=info.get(f"{arch}.embedding_length"),
            quantization=details.get("quantization_level") or "unknown",
            parameter_lines=[(k[0], k[1] if len(k) > 1 else "") for k in lines],
            template=data.get("template") or "",
            system=data.get("system") or "",
            license=data.get("license") or "",
            modelfile=data.get("modelfile") or "",
            template_origin=data.get("template_origin") or "",
            remote_model=str((data.get("remote") or {}).get("model") or ""),
            endpoints=[
                (e.get("url", ""), e.get("health", ""))
                for e in (data.get("remote") or {}).get("endpoints", [])
            ],
            capabilities=list(data.get("capabilities") or []),
            projector=_projector_rows(data.get("projector_info")),
        )

    async def has_model(self, model: str) -> bool:
        try:
            await self._request("POST", "/api/show", json={"model": model})
        except ModelNotFound:
            return False
        return True

    async def pull(self, model: str, *, insecure: bool = False) -> AsyncIterator[Progress]:
        async for item in self._ndjson("/api/pull", {"model": model, "insecure": insecure, "stream": True}):
            yield Progress(
                item.get("status", ""), item.get("digest"), item.get("total"), item.get("completed")
            )

    async def push(self, model: str, *, insecure: bool = False) -> AsyncIterator[Progress]:
        async for item in self._ndjson("/api/push", {"model": model, "insecure": insecure, "stream": True}):
            yield Progress(
                item.get("status", ""), item.get("digest"), item.get("total"), item.get("completed")
            )

    async def delete(self, model: str) -> None:
        await self._request("DELETE", "/api/delete", json={"model": model})

    async def copy(self, source: str, destination: str) -> None:
        await self._request("POST", "/api/copy", json={"source": source, "destination": destination})

    async def create(
        self,
        model: str,
        *,
        modelfile_text: str | None = None,
        from_path: str | None = None,
        base_dir: str | None = None,
        quantize: str | None = None,
        status: StatusFn | None = None,
        remote: Sequence[str] | None = None,
        remote_model: str | None = None,
        api_key_env: str | None = None,
        insecure: bool = False,
        projector_path: str | None = None,
        imatrix_path: str | None = None,
    ) -> str:
        """As `ollama create`: the Modelfile is read here, a local GGUF is uploaded as a blob, and
        the server builds the model from `files` or `from` (it never reads a path of ours). A projector
        (`projector_path`, or a second FROM) is uploaded beside the model's GGUF."""
        from localrt.store.modelfile import Modelfile, ModelfileError, parse_modelfile
        from localrt.store.names import parse_name

        emit = status or _ignore_status
        name = parse_name(model)
        mf = parse_modelfile(modelfile_text) if modelfile_text is not None else Modelfile()
        if remote or mf.remotes:  # a remote model (SPEC 8)
            mf.remotes = list(remote or mf.remotes)
            return await self._create_remote(
                name.display, mf, remote_model, api_key_env, insecure, quantize, emit
            )
        if from_path is not None:
            mf.from_ = from_path
        if not mf.from_:
            raise ModelfileError("Modelfile has no FROM line (name a GGUF file or a model)")
        if mf.draft is not None:
            raise LocalrtError(
                "DRAFT is not part of the server's create API yet; stop `localrt serve` to create "
                "this model in-process"
            )
        body: dict[str, Any] = {"model": name.display, "stream": True}
        here = Path(base_dir) if base_dir else Path.cwd()
        source = _local_file(mf.from_, here)
        if source is not None:
            body["files"] = {source.name: await self._upload(source, emit)}
        else:
            body["from"] = parse_name(mf.from_).display
        projector = projector_path or mf.projector
        if projector is not None:
            proj_file = _local_file(projector, here)
            if proj_file is None or source is None:
                raise LocalrtError("over the server's create API a projector goes with a local GGUF file")
            body["files"][f"mmproj-{proj_file.name}"] = await self._upload(proj_file, emit)
        if mf.parameters:
            body["parameters"] = mf.parameters
        for key in ("template", "system", "license"):
            if getattr(mf, key) is not None:
                body[key] = getattr(mf, key)
        if quantize:
            body["quantize"] = quantize
        if imatrix_path is not None:  # uploaded like the GGUF; the server weights --quantize with it
            body["imatrix"] = await self._upload(Path(imatrix_path), emit)
        async for item in self._ndjson("/api/create", body):
            emit(str(item.get("status", "")))
        return name.display

    async def _create_remote(
        self,
        name: str,
        mf: Any,
        remote_model: str | None,
        api_key_env: str | None,
        insecure: bool,
        quantize: str | None,
        emit: StatusFn,
    ) -> str:
        """Through /api/create: the server checks the URLs and asks the upstream for its model."""
        if quantize:
            raise LocalrtError("--quantize does not apply to a remote model (its weights live upstream)")
        body = _remote_create_body(mf, remote_model, api_key_env, insecure)
        async for item in self._ndjson("/api/create", {"model": name, "stream": True, **body}):
            emit(str(item.get("status", "")))
        return name

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
                await self._request("POST", f"/api/blobs/{digest}", content=_chunks(f))
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
        data = (await self._request("POST", "/api/tokenize", json={"model": model, "text": text})).json()
        return len(data.get("tokens", [])) + 5 * len(messages), False

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()


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
