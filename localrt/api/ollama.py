"""Ollama-compatible routes, field for field with Ollama's API."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator
from collections.abc import Callable
from typing import Annotated
from typing import Any

from fastapi import APIRouter
from fastapi import Path
from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.responses import PlainTextResponse
from fastapi.responses import Response

from localrt import __version__
from localrt import wire
from localrt.api import schemas
from localrt.api import web
from localrt.api.streaming import first_of
from localrt.api.streaming import ndjson_response
from localrt.api.streaming import unless_client_leaves
from localrt.errors import LocalrtError
from localrt.runtime.answers import Chunk
from localrt.runtime.answers import Settings
from localrt.runtime.front import Runtime
from localrt.runtime.prompt import tool_choice
from localrt.store.names import DIGEST_RE
from localrt.store.names import normalize_digest
from localrt.store.names import parse_name
from localrt.store.store import ResolvedModel
from localrt.store.store import Store
from localrt.store.store import check_room
from localrt.threads import run_in_thread_stream

router = APIRouter()


def store_of(request: Request) -> Store:
    return request.app.state.store


# Pulls, pushes and creates each run in a thread of their own and go on when their client leaves (as
# Ollama's do); past this many at once the others wait for a thread, so no number of requests starts more.
MAX_STORE_JOBS = 4


def store_job(
    request: Request, work: Callable[[Callable[[Any], None]], None], name: str
) -> AsyncIterator[Any]:
    """`work` in a thread of its own once one of MAX_STORE_JOBS is free; its items as they come."""
    state = request.app.state
    if getattr(state, "store_jobs", None) is None:
        state.store_jobs = asyncio.Semaphore(MAX_STORE_JOBS)
    slots: asyncio.Semaphore = state.store_jobs

    async def run() -> AsyncIterator[Any]:
        await slots.acquire()
        loop = asyncio.get_running_loop()

        def guarded(emit: Callable[[Any], None]) -> None:
            try:
                work(emit)
            finally:
                with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits for the slot
                    loop.call_soon_threadsafe(slots.release)

        async for item in run_in_thread_stream(guarded, name=name):
            yield item

    return run()


def rfc3339(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).astimezone().isoformat()


def expiry(ts: float | None) -> str:
    """`expires_at` of /api/ps: a keep_alive of 1e300 seconds is past any date, so it reads as forever."""
    try:
        return rfc3339(ts) if ts else FOREVER
    except (OverflowError, ValueError, OSError):
        return FOREVER


FOREVER = "0001-01-01T00:00:00Z"  # Go's zero time, what Ollama shows for a model kept until stopped


def model_details(store: Store, resolved: ResolvedModel) -> dict[str, Any]:
    """`details` as Ollama fills it, from the config blob (written at import) or the GGUF header."""
    cfg = resolved.config
    if not cfg.get("model_family"):
        from localrt.store.gguf import format_parameter_count
        from localrt.store.gguf import read_gguf

        info = read_gguf(resolved.model_path)
        cfg = {
            "model_family": info.architecture,
            "model_type": format_parameter_count(info.parameter_count),
            "file_type": info.file_type,
            **cfg,
        }
    family = cfg.get("model_family") or ""
    return {
        "parent_model": "",
        "format": cfg.get("model_format", "gguf"),
        "family": family,
        "families": cfg.get("model_families") or ([family] if family else None),
        "parameter_size": cfg.get("model_type", ""),
        "quantization_level": cfg.get("file_type", ""),
    }


ERRORS = schemas.error_responses(False)
MODEL_ERRORS = schemas.error_responses(False, 404)
GENERATION_ERRORS = schemas.error_responses(False, 404, 499, 501, 503)
STREAMED = schemas.STREAMED


# documented, not enforced here: normalize_digest gives the clearer error
BlobDigest = Annotated[str, Path(json_schema_extra={"pattern": wire.DIGEST_PATTERN})]


# GET and HEAD as two routes (stacked decorators), so each has its own operationId in /openapi.json.
@router.get("/", response_class=PlainTextResponse, responses=ERRORS)
@router.head("/", response_class=PlainTextResponse, operation_id="root_head", responses=ERRORS)
async def root(request: Request) -> Response:
    if web.wants_page(request):
        return web.page()  # a browser: the chat page (localrt/api/web.py)
    return PlainTextResponse("localrt is running", headers={"Vary": "Accept"})


@router.get("/api/version", responses={200: schemas.ok(wire.VersionResponse), **ERRORS})
@router.head("/api/version", operation_id="version_head", responses=ERRORS)
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/health", responses=ERRORS)
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/api/tags", responses={200: schemas.ok(wire.TagsResponse), **ERRORS})
@router.head("/api/tags", operation_id="tags_head", responses=ERRORS)
async def tags(request: Request) -> dict[str, Any]:
    store = store_of(request)
    models = []
    for entry in store.list_models():
        try:
            details = model_details(store, store.resolve(entry.name))
        except LocalrtError:
            continue  # a damaged entry is skipped, not a 500 for the whole list
        models.append(
            {
                "name": entry.name.display,
                "model": entry.name.display,
                "modified_at": rfc3339(entry.modified),
                "size": entry.size,
                "digest": entry.manifest_digest.split(":", 1)[1],
                "details": details,
            }
        )
    return {"models": models}


def given(value: str, key: str) -> str:
    if not value:
        raise LocalrtError(f"{key} is required")
    return value


@router.post(
    "/api/show",
    openapi_extra=schemas.request_body(wire.ShowRequest),
    responses={200: schemas.ok(wire.ShowResponse), **MODEL_ERRORS},
)
async def show(request: Request) -> dict[str, Any]:
    from localrt.show import model_capabilities
    from localrt.show import modelfile_text
    from localrt.show import parameter_lines
    from localrt.show import template_choice
    from localrt.show import template_of
    from localrt.show import template_origin
    from localrt.store.gguf import read_gguf

    body = await schemas.read_body(request, wire.ShowRequest)
    store = store_of(request)
    resolved = store.resolve(parse_name(body.required_name()))
    if resolved.remote is not None:
        return await show_remote(store, resolved)
    info = read_gguf(resolved.model_path)
    params = "\n".join(f"{k:<30}{v}" for k, v in parameter_lines(resolved.params))
    template = template_of(resolved, info)
    capabilities = model_capabilities(resolved, info)
    extra: dict[str, Any] = {}
    if resolved.projector_path is not None:
        extra["projector_info"] = read_gguf(resolved.projector_path).summary()
    return {
        **extra,
        "license": resolved.license or info.license or "",
        "modelfile": modelfile_text(resolved, info),
        "parameters": params,
        "template": template,
        "system": resolved.system or "",
        "details": model_details(store, resolved),
        "model_info": info.summary(),
        "capabilities": capabilities,
        "template_origin": template_origin(template_choice(resolved, info)),
        "backend": backend_for(request, resolved, body.options),
        **model_formats(resolved),
        "modified_at": rfc3339(store.manifest_path(resolved.name).stat().st_mtime)
        if store.manifest_path(resolved.name).exists()
        else None,
    }


def backend_for(request: Request, resolved: ResolvedModel, options: dict[str, Any] | None) -> str:
    """The backend a load of the model would use on this machine, with the Modelfile's and `options`'s
    `backend` (`auto` resolved), or why none would."""
    from localrt.runtime.options import Options

    try:
        wanted = Options.merge(resolved.params, options, lenient=(True, False)).backend
        return Runtime.backend_for(wanted)
    except LocalrtError as e:
        return f"unavailable: {e}"


def model_formats(resolved: ResolvedModel) -> dict[str, Any]:
    """/api/show's `messages`, `renderer`, `parser` and `requires`, where the model has them (Ollama's)."""
    out: dict[str, Any] = {
        k: resolved.config[k] for k in ("renderer", "parser", "requires") if resolved.config.get(k)
    }
    if resolved.messages:
        out["messages"] = resolved.messages
    return out


async def show_remote(store: Store, resolved: ResolvedModel) -> dict[str, Any]:
    """`/api/show` for a remote model: its endpoints (probed now) and upstream model id."""
    import asyncio

    from localrt.show import parameter_lines
    from localrt.show import remote_health
    from localrt.show import remote_modelfile_text

    health = await asyncio.to_thread(remote_health, resolved)
    remote = resolved.remote or {}
    path = store.manifest_path(resolved.name)
    return {
        "license": resolved.license or "",
        "modelfile": remote_modelfile_text(resolved),
        "parameters": "\n".join(f"{k:<30}{v}" for k, v in parameter_lines(resolved.params)),
        "template": resolved.template or "",
        "system": resolved.system or "",
        "details": model_details(store, resolved),
        "model_info": {"general.architecture": "remote", "remote.model": remote.get("model", "")},
        "capabilities": ["completion", "tools"],
        "remote": {
            "model": remote.get("model", ""),
            "api_key_env": remote.get("api_key_env"),
            "endpoints": [{"url": url, "health": state} for url, state in health],
        },
        "modified_at": rfc3339(path.stat().st_mtime) if path.exists() else None,
    }


@router.delete("/api/delete", openapi_extra=schemas.request_body(wire.ModelRequest), responses=MODEL_ERRORS)
async def delete(request: Request) -> Response:
    name = parse_name((await schemas.read_body(request, wire.ModelRequest)).required_name())
    runtime = request.app.state.runtime
    if runtime is not None:
        with contextlib.suppress(LocalrtError):
            await runtime.unload(name.display)
    store_of(request).remove(name)
    return Response(status_code=200)


@router.post("/api/copy", openapi_extra=schemas.request_body(wire.CopyRequest), responses=MODEL_ERRORS)
async def copy(request: Request) -> Response:
    body = await schemas.read_body(request, wire.CopyRequest)
    src, dst = parse_name(given(body.source, "source")), parse_name(given(body.destination, "destination"))
    store_of(request).copy(src, dst)
    return Response(status_code=200)


def progress_dict(event: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"status": event.status}
    for key in ("digest", "total", "completed"):
        value = getattr(event, key, None)
        if value is not None:
            out[key] = value
    return out


async def respond(items: AsyncIterator[dict[str, Any]], stream: bool) -> Response:
    """NDJSON when streaming; otherwise the last item alone. Early errors get their status code."""
    if not stream:
        last: dict[str, Any] = {}
        async for item in items:
            last = item
        return JSONResponse(last)
    first, rest = await first_of(items)
    return ndjson_response(first, rest)


@router.post(
    "/api/pull",
    openapi_extra=schemas.request_body(wire.PullRequest),
    responses={200: STREAMED, **schemas.error_responses(False, 404, 502, 507)},
)
async def pull(request: Request) -> Response:
    from localrt.store.pull import pull as do_pull

    body = await schemas.read_body(request, wire.PullRequest)
    name = parse_name(body.required_name())
    store, insecure = store_of(request), body.insecure is True

    def work(emit: Callable[[dict[str, Any]], None]) -> None:
        do_pull(name, store=store, insecure=insecure, progress=lambda e: emit(progress_dict(e)))

    return await respond(store_job(request, work, "localrt-pull"), body.stream is not False)


@router.post(
    "/api/push",
    openapi_extra=schemas.request_body(wire.PushRequest),
    responses={200: STREAMED, **schemas.error_responses(False, 404, 502)},
)
async def push(request: Request) -> Response:
    from localrt.store.push import push as do_push

    body = await schemas.read_body(request, wire.PushRequest)
    name = parse_name(body.required_name())
    store, insecure = store_of(request), body.insecure is True
    store.read_manifest(name)  # an unknown model is a 404 before the stream starts

    def work(emit: Callable[[dict[str, Any]], None]) -> None:
        do_push(name, store=store, insecure=insecure, progress=lambda e: emit(progress_dict(e)))

    return await respond(store_job(request, work, "localrt-push"), body.stream is not False)


@router.post(
    "/api/create",
    openapi_extra=schemas.request_body(wire.CreateRequest),
    responses={200: STREAMED, **schemas.error_responses(False, 404, 507)},
)
async def create(request: Request) -> Response:
    from localrt.store.modelfile import create_from_request

    body = await schemas.read_body(request, wire.CreateRequest)
    store = store_of(request)
    name = parse_name(body.required_name())
    # checked before the stream starts, so a bad name is a 400, not an error line after a 200
    if name.digest:
        raise LocalrtError(f"cannot create {name}: a model name to write takes no @digest")
    if body.from_ is not None:
        parse_name(body.from_)  # `from` names a stored model (server-side paths are refused)
    if body.draft is not None and not DIGEST_RE.match(body.draft):
        parse_name(body.draft)  # a stored model, else an uploaded blob's digest
    fields = wire.body_of(body)  # the store reads a create request by its wire names

    def work(emit: Callable[[dict[str, Any]], None]) -> None:
        create_from_request(name, fields, store=store, progress=lambda status: emit({"status": status}))
        emit({"status": "success"})

    return await respond(store_job(request, work, "localrt-create"), body.stream is not False)


class LengthRequired(LocalrtError):
    status = 411


@router.head("/api/blobs/{digest}", responses=schemas.error_responses(False, 404))
async def blob_exists(request: Request, digest: BlobDigest) -> Response:
    exists = store_of(request).has_blob(normalize_digest(digest))
    return Response(status_code=200 if exists else 404)


@router.post(
    "/api/blobs/{digest}",
    responses={201: {"description": "stored"}, **schemas.error_responses(False, 411, 507)},
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        }
    },
)
async def blob_upload(request: Request, digest: BlobDigest) -> Response:
    digest = normalize_digest(digest)
    store = store_of(request)
    if store.has_blob(digest):
        return Response(status_code=200)
    declared = request.headers.get("content-length", "")
    if not declared.isdigit():  # a chunked upload's size is unknown until the disk has filled
        raise LengthRequired("a blob upload needs a Content-Length header (its size in bytes)")
    check_room(store, int(declared))
    # a disk that fills while the body streams in (another writer) is a 507 naming the file; the
    # partial file goes, the store is untouched
    with store.begin_blob(int(declared)) as writer:
        async for chunk in request.stream():
            writer.write(chunk)
        writer.commit(digest)
    return Response(status_code=201)


@router.get("/api/ps", responses={200: schemas.ok(wire.PsResponse), **ERRORS})
async def ps(request: Request) -> dict[str, Any]:
    runtime = request.app.state.runtime
    rows = runtime.ps() if runtime is not None else []
    return {
        "models": [
            {
                "name": row.name,
                "model": row.name,
                "size": row.size,
                "digest": row.digest.split(":", 1)[-1],
                "details": row.details,
                "size_vram": row.size_vram,
                "context_length": row.context_length,
                "expires_at": expiry(row.expires_at),
                "backend": row.backend,
                "processor": row.processor,
            }
            for row in rows
        ]
    }


# ---- generation ------------------------------------------------------------------------------
def runtime_of(request: Request) -> Runtime:
    runtime = request.app.state.runtime
    if runtime is None:
        raise LocalrtError("this server was started without a runtime")
    return runtime


def chunk_to_generate(chunk: Chunk) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": chunk.model,
        "created_at": chunk.created_at,
        "response": chunk.content,
        "done": chunk.done,
    }
    if chunk.thinking:
        out["thinking"] = chunk.thinking
    if chunk.logprobs:
        out["logprobs"] = wire.logprobs_to_wire(chunk.logprobs)
    if chunk.done:
        out["done_reason"] = chunk.done_reason
        if chunk.context is not None:
            out["context"] = chunk.context
        if chunk.tool_calls:
            out["tool_calls"] = chunk.tool_calls
        out.update(wire.metrics_to_ollama(chunk.metrics))
    return out


def chunk_to_chat(chunk: Chunk) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": chunk.content}
    if chunk.thinking:
        message["thinking"] = chunk.thinking
    if chunk.tool_calls:
        message["tool_calls"] = chunk.tool_calls
    out: dict[str, Any] = {
        "model": chunk.model,
        "created_at": chunk.created_at,
        "message": message,
        "done": chunk.done,
    }
    if chunk.logprobs:
        out["logprobs"] = wire.logprobs_to_wire(chunk.logprobs)
    if chunk.done:
        out["done_reason"] = chunk.done_reason
        out.update(wire.metrics_to_ollama(chunk.metrics))
    return out


def observe(request: Request, chunk: Chunk) -> None:
    """Feed /metrics from a final chunk."""
    m = chunk.metrics
    if chunk.done and m is not None and m.eval_count:
        ttft = (m.load_ns + m.prompt_eval_ns) / 1e9
        request.app.state.metrics.observe_generation(
            chunk.model, ttft, m.prompt_eval_count, m.eval_count, m.eval_ns / 1e9
        )


def generation_args(body: wire.Generation) -> Settings:
    """What /api/chat and /api/generate share, in the runtime's names with Ollama's defaults for the
    fields not sent: the one place an Ollama request becomes the runtime's."""
    return Settings(
        options=wire.top_level_options(body),
        format=body.format or None,
        keep_alive=body.keep_alive,
        logprobs=body.logprobs is True,
        top_logprobs=body.top_logprobs or 0,
        stream=body.stream is not False,
        think=body.think,
        truncate=body.truncate is not False,
        shift=body.shift is not False,
        lora=wire.lora_setting(body.lora),
    )


async def generation_response(
    request: Request, chunks: AsyncIterator[Chunk], stream: bool, to_wire: Callable[[Chunk], dict[str, Any]]
) -> Response:
    """The runtime's chunks as Ollama's answer: one JSON object, or NDJSON written straight from the
    runtime's iterator once its first chunk has come (errors before it get their status code)."""

    def line(chunk: Chunk) -> list[dict[str, Any]]:
        observe(request, chunk)
        return [to_wire(chunk)]

    async def whole() -> dict[str, Any]:
        last: dict[str, Any] = {}
        async for chunk in chunks:
            last = line(chunk)[0]
        return last

    if not stream:
        return JSONResponse(await unless_client_leaves(request, whole()))
    first, rest = await unless_client_leaves(request, first_of(chunks))
    return ndjson_response(first, rest, line)


@router.post(
    "/api/generate",
    openapi_extra=schemas.request_body(wire.GenerateRequest),
    responses={200: schemas.ok(wire.GenerateResponse, STREAMED), **GENERATION_ERRORS},
)
async def generate(request: Request) -> Response:
    body = await schemas.read_body(request, wire.GenerateRequest)
    runtime = runtime_of(request)
    args = generation_args(body)
    tool_choice(wire.tool_choice_setting(body.tool_choice), None)  # a required call needs tools: 400
    chunks = runtime.generate(
        body.required_name(),
        body.prompt or "",
        images=body.images or None,
        system=body.system,
        raw=body.raw is True,
        context=body.context,
        suffix=body.suffix,
        **args,
    )
    return await generation_response(request, chunks, args["stream"], chunk_to_generate)


@router.post(
    "/api/chat",
    openapi_extra=schemas.request_body(wire.ChatRequest),
    responses={200: schemas.ok(wire.ChatResponse, STREAMED), **GENERATION_ERRORS},
)
async def chat(request: Request) -> Response:
    body = await schemas.read_body(request, wire.ChatRequest)
    runtime = runtime_of(request)
    args = generation_args(body)
    chunks = runtime.chat(
        body.required_name(),
        [m.model_dump(by_alias=True, exclude_unset=True) for m in body.messages or []],
        tools=body.tools or None,
        tool_choice=wire.tool_choice_setting(body.tool_choice),
        **args,
    )
    return await generation_response(request, chunks, args["stream"], chunk_to_chat)


@router.post(
    "/api/embed",
    openapi_extra=schemas.request_body(wire.EmbedRequest),
    responses={200: schemas.ok(wire.EmbedResponse), **GENERATION_ERRORS},
)
async def embed(request: Request) -> dict[str, Any]:
    body = await schemas.read_body(request, wire.EmbedRequest)
    inputs = body.input or ""  # null or absent: only load the model, as Ollama does
    result = await runtime_of(request).embed(
        body.required_name(),
        inputs,
        options=body.options,
        keep_alive=body.keep_alive,
        truncate=body.truncate is not False,
    )
    return {
        "model": result.model,
        "embeddings": [shortened(v, body.dimensions or 0) for v in result.embeddings],
        "total_duration": result.total_ns,
        "load_duration": result.load_ns,
        "prompt_eval_count": result.prompt_eval_count,
    }


def shortened(vector: list[float], dimensions: int) -> list[float]:
    """Ollama's `dimensions`: the first N values, scaled back to unit length (a larger N keeps them all)."""
    if not 0 < dimensions < len(vector):
        return vector
    kept = vector[:dimensions]
    norm = sum(v * v for v in kept) ** 0.5
    return [v / norm for v in kept] if norm > 0 else kept


@router.post(
    "/api/embeddings",
    openapi_extra=schemas.request_body(wire.EmbeddingsRequest),
    responses={200: schemas.ok(wire.EmbeddingsResponse), **GENERATION_ERRORS},
)
async def embeddings_legacy(request: Request) -> dict[str, Any]:
    body = await schemas.read_body(request, wire.EmbeddingsRequest)
    prompt = body.prompt or ""
    # an empty prompt still loads the model (and checks the name and options), as Ollama does
    result = await runtime_of(request).embed(
        body.required_name(), prompt, options=body.options, keep_alive=body.keep_alive
    )
    return {"embedding": result.embeddings[0] if prompt else []}


async def rerank_response(request: Request) -> dict[str, Any]:
    """`POST /api/rerank` and `/v1/rerank` (llama-server's, Jina's and Cohere's shape): results sorted by
    relevance_score, cut to top_n, each with its document's index (and text with return_documents)."""
    body = await schemas.read_body(request, wire.RerankRequest)
    documents, top_n = body.documents, body.top_n
    result = await runtime_of(request).rerank(
        body.required_name(),
        body.query,
        documents,
        options=body.options,
        keep_alive=body.keep_alive,
    )
    order = sorted(range(len(documents)), key=lambda i: -result.scores[i])
    with_text = body.return_documents is True
    results = [
        {
            "index": i,
            "relevance_score": result.scores[i],
            **({"document": {"text": documents[i]}} if with_text else {}),
        }
        for i in order[: top_n if top_n is not None else len(order)]
    ]
    return {
        "model": result.model,
        "object": "list",
        "results": results,
        "usage": {"prompt_tokens": result.prompt_eval_count, "total_tokens": result.prompt_eval_count},
        "total_duration": result.total_ns,
        "load_duration": result.load_ns,
    }


@router.post(
    "/api/rerank",
    openapi_extra=schemas.request_body(wire.RerankRequest),
    responses={200: schemas.ok(wire.RerankResponse), **GENERATION_ERRORS},
)
async def rerank(request: Request) -> dict[str, Any]:
    return await rerank_response(request)


@router.post(
    "/api/tokenize",
    openapi_extra=schemas.request_body(wire.TokenizeRequest),
    responses={200: schemas.ok(wire.TokenizeResponse), **GENERATION_ERRORS},
)
async def tokenize(request: Request) -> dict[str, Any]:
    body = await schemas.read_body(request, wire.TokenizeRequest)
    # llama-server names the field `content`
    text = body.text if body.text is not None else (body.model_extra or {}).get("content") or ""
    if not isinstance(text, str):
        raise LocalrtError("text must be a string")
    tokens = await runtime_of(request).tokenize(
        body.required_name(),
        text,
        add_special=body.add_special is not False,
        parse_special=body.parse_special is True,
    )
    return {"model": body.required_name(), "tokens": tokens}


@router.post(
    "/api/detokenize",
    openapi_extra=schemas.request_body(wire.DetokenizeRequest),
    responses={200: schemas.ok(wire.DetokenizeResponse), **GENERATION_ERRORS},
)
async def detokenize(request: Request) -> dict[str, Any]:
    body = await schemas.read_body(request, wire.DetokenizeRequest)
    text = await runtime_of(request).detokenize(body.required_name(), body.tokens)
    return {"model": body.required_name(), "text": text}


@router.get("/metrics", response_class=PlainTextResponse, responses=ERRORS)
async def metrics(request: Request) -> str:
    runtime = request.app.state.runtime
    return request.app.state.metrics.render(
        queue_depth=lambda: runtime.queue_depth() if runtime is not None else {},
        loaded=lambda: [row.name for row in runtime.ps()] if runtime is not None else [],
    )
