"""One client for a model host, shared by the CLI and the chat app: one implementation of every answer.

`ServerClient` speaks Ollama's API (and, to count a prompt's tokens, Anthropic's count_tokens) to a
`localrt serve`. Without a running server, `InProcessClient` is the same client talking to the same
FastAPI app in this process (`localrt.api.app`, over `InProcessTransport`), so show, details, context
length and every other answer are the server's, computed once. `connect()` picks the server when
`GET http://LOCALRT_HOST/` answers, else the app in process, as Ollama's CLI builds
`api.ClientFromEnvironment()` for every command. Interfaces reach models only through this module, so a
command behaves the same either way: `ps` shows what `run` loaded on the server, and a second `run`
reuses the loaded model.
"""

from __future__ import annotations

import asyncio
import contextlib
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
    parallel: int = 0  # requests served at once; 0: not reported
    kv_pool: int = 0  # KV cells the sequences share; 0: none shared (a context each), or not reported


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
    """What the interfaces need from a model host; errors are LocalrtError subclasses."""

    kind: str  # "runtime" (the app in this process) | "server"
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

    async def _ready(self) -> None:
        """What must happen before the first request (nothing: a server is up)."""

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        await self._ready()
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
        await self._ready()
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
        # closed with the caller's iterator: the connection goes, and the generation behind it stops
        async with contextlib.aclosing(self._ndjson("/api/chat", request)) as items:
            async for item in items:
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
        return [_loaded_row(m) for m in loaded.models]

    async def stop(self, model: str) -> None:
        await self._post("/api/generate", wire.build(wire.GenerateRequest, model=model, keep_alive=0))

    async def _loaded(self, model: str) -> LoadedRow | None:
        from localrt.store.names import parse_name

        key = parse_name(model).display
        return next((row for row in await self.ps() if row.name == key), None)

    async def _show(self, model: str, options: Mapping[str, Any] | None = None) -> wire.ShowResponse:
        request = wire.build(wire.ShowRequest, model=model, options=dict(options) if options else None)
        answer = await self._post("/api/show", request)
        return wire.parse(wire.ShowResponse, answer.json())

    async def show(self, model: str, options: Mapping[str, Any] | None = None) -> ModelInfo:
        from localrt.store.names import parse_name

        data = await self._show(model, options)
        details, info = data.details, data.model_info
        arch = info.get("general.architecture") or details.family or "unknown"
        key = parse_name(model).display
        size = next((r.size for r in await self.list_models() if r.name == key), 0)
        loaded = await self._loaded(model)
        if data.remote is not None:  # no GGUF here: the model lives on its endpoints
            urls = [str(e.get("url", "")) for e in data.remote.get("endpoints", [])]
            arch, backend = f"remote: {data.remote.get('model', '')}", f"remote ({', '.join(urls)})"
        elif loaded:
            backend = loaded.backend or "unknown"
        else:
            backend = f"{data.backend} (not loaded)" if data.backend else "(not loaded on the server)"
        return ModelInfo(
            name=key,
            architecture=arch,
            parameters=details.parameter_size if data.remote is None else "",
            quantization=details.quantization_level if data.remote is None else "",
            context_length=info.get(f"{info.get('general.architecture')}.context_length"),
            size=size,
            backend=backend,
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
        """The loaded model's context, else num_ctx as a load would ask for it (the Modelfile's, then
        `options`), capped by what the model was trained for; a remote model's once it is loaded."""
        loaded = await self._loaded(model)
        if loaded and loaded.context_length:
            return loaded.context_length
        from localrt.runtime.options import Options

        data = await self._show(model)
        if data.remote is not None:  # the upstream's context is known once it is loaded
            return None
        params = dict(line.split(None, 1) for line in data.parameters.splitlines() if len(line.split()) > 1)
        num_ctx = Options.merge(params, options, lenient=(True, False)).num_ctx
        trained = data.model_info.get(f"{data.model_info.get('general.architecture')}.context_length")
        return min(num_ctx, trained) if trained else num_ctx

    async def count_tokens(
        self, model: str, messages: Sequence[Message], options: Mapping[str, Any] | None = None
    ) -> tuple[int, bool]:
        """The tokens of the prompt the next request would start from: exact where the server counts it
        through the model's template (localrt's `/v1/messages/count_tokens`); else the text's tokens and
        a few per message for the template's role markers, an estimate (the chat app shows it with ~)."""
        turns = [{"role": m.get("role"), "content": str(m.get("content") or "")} for m in messages]
        if turns:
            body = {"model": model, "messages": turns, **({"options": dict(options)} if options else {})}
            try:
                answer = await self._request("POST", "/v1/messages/count_tokens", json=body)
                return int(answer.json()["input_tokens"]), True
            except LocalrtError:
                pass  # a server without the route (Ollama); a model's own error comes again below
        text = "\n".join(turn["content"] for turn in turns)
        answer = await self._post("/api/tokenize", wire.build(wire.TokenizeRequest, model=model, text=text))
        return len(wire.parse(wire.TokenizeResponse, answer.json()).tokens) + 5 * len(turns), False

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()


# ---- in process --------------------------------------------------------------------------------
class InProcessTransport(httpx.AsyncBaseTransport):
    """httpx to an ASGI app in this process, streaming both ways: each request runs the app in a task of
    its own, and the answer's body arrives piece by piece as the app sends it (httpx's own ASGITransport
    collects a whole answer before handing it over, so a chat would arrive all at once). Closing the
    answer early is the client hanging up: the app hears `http.disconnect` and its task is cancelled,
    which cancels the generation behind it, as a real server's does."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request.method,
            "scheme": request.url.scheme,
            "path": request.url.path,
            "raw_path": request.url.raw_path.split(b"?", 1)[0],
            "query_string": request.url.query,
            "root_path": "",
            "headers": [(k.lower(), v) for k, v in request.headers.raw],
            "client": ("127.0.0.1", 0),
            "server": (request.url.host, request.url.port or 80),
        }
        body = aiter(request.stream)  # type: ignore[arg-type]
        gone = asyncio.Event()
        start: asyncio.Future[tuple[int, list[tuple[bytes, bytes]]]] = (
            asyncio.get_running_loop().create_future()
        )
        pieces: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        more = True

        async def receive() -> dict[str, Any]:
            nonlocal more
            if more:
                piece = await anext(body, None)
                more = piece is not None
                return {"type": "http.request", "body": piece or b"", "more_body": more}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                start.set_result((message["status"], list(message.get("headers", []))))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    pieces.put_nowait(message["body"])
                if not message.get("more_body", False):
                    pieces.put_nowait(None)

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            except BaseException as e:
                if not start.done():
                    start.set_exception(e)
                pieces.put_nowait(e)
                if isinstance(e, asyncio.CancelledError):
                    raise
            finally:
                pieces.put_nowait(None)

        task = asyncio.ensure_future(run())
        try:
            status, headers = await start
        except BaseException:
            task.cancel()
            raise
        return httpx.Response(status, headers=headers, stream=_AnswerStream(pieces, task, gone))


class _AnswerStream(httpx.AsyncByteStream):
    def __init__(
        self,
        pieces: asyncio.Queue[bytes | BaseException | None],
        task: asyncio.Future[None],
        gone: asyncio.Event,
    ) -> None:
        self.pieces, self.task, self.gone = pieces, task, gone

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (piece := await self.pieces.get()) is not None:
            if isinstance(piece, BaseException):
                if isinstance(piece, asyncio.CancelledError):
                    return
                raise piece
            yield piece

    async def aclose(self) -> None:
        self.gone.set()  # the app hears the client leave
        if not self.task.done():
            self.task.cancel()
        with contextlib.suppress(BaseException):
            await self.task


class InProcessClient(ServerClient):
    """The server's own app in this process (`localrt.api.app`, over `InProcessTransport`), with a
    runtime of its own: every answer is the server's, written once. The store is this process's, so
    `create` reads the files named to it where they are instead of uploading them (and, as the CLI
    runs as its user, may name any variable as a remote model's key)."""

    kind = "runtime"

    def __init__(self, store: Any = None) -> None:
        from localrt.api.app import create_app
        from localrt.runtime.front import Runtime
        from localrt.store.store import Store

        self.store = store or Store()
        self.runtime = Runtime(self.store)
        self.app = create_app(store=self.store, runtime=self.runtime, api_key="")
        super().__init__("http://127.0.0.1", "in-process")
        self.where = "in-process"
        self._lifespan: _Lifespan | None = None

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:  # made on the caller's loop, on first use
            self._http = httpx.AsyncClient(
                base_url=self.base_url, transport=InProcessTransport(self.app), timeout=self._timeout
            )
        return self._http

    async def _ready(self) -> None:
        """The app's start-up handlers run before its first request, as under a server."""
        if self._lifespan is None:
            self._lifespan = _Lifespan(self.app)
            await self._lifespan.start()

    async def create(self, spec: CreateSpec, status: StatusFn | None = None) -> str:
        return await asyncio.to_thread(create_in_store, spec, self.store)

    async def close(self) -> None:
        await super().close()
        if self._lifespan is not None:
            await self._lifespan.stop()
        await self.runtime.close()  # what this process loaded is unloaded with it


def create_in_store(spec: CreateSpec, store: Any) -> str:
    """Build the model `spec` asks for in `store`, reading the files it names where they are: what the
    CLI does in process, and for a remote model even while a server runs (the CLI runs as its user, so it
    may name any variable as the key's, which the server's API refuses a client)."""
    from localrt.store.modelfile import create

    return create(
        spec.model,
        modelfile_text=spec.modelfile_text,
        from_path=spec.from_path,
        store=store,
        base_dir=spec.base_dir,
        quantize=spec.quantize,
        remote=spec.remote,
        remote_model=spec.remote_model,
        api_key_env=spec.api_key_env,
        insecure=spec.insecure,
        projector_path=spec.projector_path,
        imatrix=spec.imatrix_path,
        adapters=spec.adapter_paths,
    ).display


class _Lifespan:
    """An ASGI app's lifespan (start-up and shutdown handlers), run as a server runs it."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.task: asyncio.Future[None] | None = None

    async def start(self) -> None:
        async def run() -> None:
            with contextlib.suppress(Exception):  # an app without a lifespan
                await self.app(
                    {"type": "lifespan", "asgi": {"version": "3.0"}}, self.inbox.get, self.outbox.put
                )
            self.outbox.put_nowait({"type": "lifespan.gone"})

        self.task = asyncio.ensure_future(run())
        self.inbox.put_nowait({"type": "lifespan.startup"})
        answer = await self.outbox.get()
        if answer["type"] == "lifespan.startup.failed":
            raise LocalrtError(f"the in-process server did not start: {answer.get('message', '')}")

    async def stop(self) -> None:
        if self.task is None or self.task.done():
            return
        self.inbox.put_nowait({"type": "lifespan.shutdown"})
        await self.outbox.get()
        with contextlib.suppress(BaseException):
            await self.task


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
    """A running server at LOCALRT_HOST if `GET /` answers 200 there, else the same server's app in
    this process."""
    if server_answers(timeout):
        return ServerClient(*server_address())
    return InProcessClient()


def _loaded_row(m: wire.RunningModel) -> LoadedRow:
    """A row of `/api/ps` as `localrt ps` prints it (the extras our server adds read from its details)."""
    details = m.details or {}
    return LoadedRow(
        name=m.name,
        digest=m.digest.removeprefix("sha256:"),
        size=m.size,
        size_vram=m.size_vram,
        processor=m.processor or _processor(m.size, m.size_vram),
        backend=m.backend or "",
        context_length=m.context_length,
        expires_at=_epoch(m.expires_at),
        weight_bytes=int(details.get("weight_bytes") or 0),
        numerics=str(details.get("numerics") or ""),
        shares_weights_with=tuple(details.get("shares_weights_with") or ()),
        parallel=int(details.get("parallel") or 0),
        kv_pool=int(details.get("kv_pool") or 0),
    )
