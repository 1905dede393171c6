"""Ollama-compatible routes (SPEC 6), field for field with Ollama's API."""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from localrt import __version__
from localrt.api import schemas as wire
from localrt.api.streaming import first_and_rest, ndjson_response
from localrt.errors import LocalrtError
from localrt.runtime.bridge import run_in_thread_stream
from localrt.runtime.manager import Chunk, Metrics, Runtime
from localrt.store.names import normalize_digest, parse_name
from localrt.store.store import ResolvedModel, Store

router = APIRouter()


def store_of(request: Request) -> Store:
    return request.app.state.store


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
        from localrt.store.gguf import format_parameter_count, read_gguf

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


ERRORS = wire.error_responses(False)
MODEL_ERRORS = wire.error_responses(False, 404)
GENERATION_ERRORS = wire.error_responses(False, 404, 499, 501, 503)
STREAMED = wire.STREAMED


# documented, not enforced here: normalize_digest gives the clearer error
BlobDigest = Annotated[str, Path(json_schema_extra={"pattern": wire.DIGEST_PATTERN})]


# GET and HEAD as two routes (stacked decorators), so each has its own operationId in /openapi.json.
@router.get("/", response_class=PlainTextResponse, responses=ERRORS)
@router.head("/", response_class=PlainTextResponse, operation_id="root_head", responses=ERRORS)
async def root() -> str:
    return "localrt is running"


@router.get("/api/version", responses={200: wire.ok(wire.VersionResponse), **ERRORS})
@router.head("/api/version", operation_id="version_head", responses=ERRORS)
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/health", responses=ERRORS)
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/api/tags", responses={200: wire.ok(wire.TagsResponse), **ERRORS})
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


def required_model(f: dict[str, Any], key: str = "model") -> str:
    value = f.get(key) or (f.get("name") if key == "model" else None)
    if not isinstance(value, str) or not value:
        raise LocalrtError(f"{key} is required")
    return value


@router.post(
    "/api/show",
    openapi_extra=wire.request_body(wire.ModelRequest),
    responses={200: wire.ok(wire.ShowResponse), **MODEL_ERRORS},
)
async def show(request: Request) -> dict[str, Any]:
    from localrt.show import (
        model_capabilities,
        modelfile_text,
        parameter_lines,
        template_choice,
        template_of,
        template_origin,
    )
    from localrt.store.gguf import read_gguf

    body = await wire.read_json(request, wire.ModelRequest)
    store = store_of(request)
    resolved = store.resolve(parse_name(required_model(body)))
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
        "modified_at": rfc3339(store.manifest_path(resolved.name).stat().st_mtime)
        if store.manifest_path(resolved.name).exists()
        else None,
    }


async def show_remote(store: Store, resolved: ResolvedModel) -> dict[str, Any]:
    """`/api/show` for a remote model: its endpoints (probed now) and upstream model id."""
    import asyncio

    from localrt.show import parameter_lines, remote_health, remote_modelfile_text

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


@router.delete("/api/delete", openapi_extra=wire.request_body(wire.ModelRequest), responses=MODEL_ERRORS)
async def delete(request: Request) -> Response:
    name = parse_name(required_model(await wire.read_json(request, wire.ModelRequest)))
    runtime = request.app.state.runtime
    if runtime is not None:
        with contextlib.suppress(LocalrtError):
            await runtime.unload(name.display)
    store_of(request).remove(name)
    return Response(status_code=200)


@router.post("/api/copy", openapi_extra=wire.request_body(wire.CopyRequest), responses=MODEL_ERRORS)
async def copy(request: Request) -> Response:
    body = await wire.read_json(request, wire.CopyRequest)
    src, dst = parse_name(required_model(body, "source")), parse_name(required_model(body, "destination"))
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
    _, all_items = await first_and_rest(items)
    return ndjson_response(all_items)


@router.post(
    "/api/pull",
    openapi_extra=wire.request_body(wire.PullRequest),
    responses={200: STREAMED, **wire.error_responses(False, 404, 502)},
)
async def pull(request: Request) -> Response:
    from localrt.store.pull import pull as do_pull

    body = await wire.read_json(request, wire.PullRequest)
    name = parse_name(required_model(body))
    store, insecure = store_of(request), body.get("insecure") is True

    def work(emit: Callable[[dict[str, Any]], None]) -> None:
        do_pull(name, store=store, insecure=insecure, progress=lambda e: emit(progress_dict(e)))

    return await respond(
        run_in_thread_stream(work, wait=False, name="localrt-pull"), body.get("stream", True) is not False
    )


@router.post(
    "/api/push",
    openapi_extra=wire.request_body(wire.PushRequest),
    responses={200: STREAMED, **wire.error_responses(False, 404, 502)},
)
async def push(request: Request) -> Response:
    from localrt.store.push import push as do_push

    body = await wire.read_json(request, wire.PushRequest)
    name = parse_name(required_model(body))
    store, insecure = store_of(request), body.get("insecure") is True
    store.read_manifest(name)  # an unknown model is a 404 before the stream starts

    def work(emit: Callable[[dict[str, Any]], None]) -> None:
        do_push(name, store=store, insecure=insecure, progress=lambda e: emit(progress_dict(e)))

    return await respond(
        run_in_thread_stream(work, wait=False, name="localrt-push"), body.get("stream", True) is not False
    )


@router.post(
    "/api/create",
    openapi_extra=wire.request_body(wire.CreateRequest),
    responses={200: STREAMED, **MODEL_ERRORS},
)
async def create(request: Request) -> Response:
    from localrt.store.modelfile import create_from_request

    fields = await wire.read_json(request, wire.CreateRequest)
    store = store_of(request)
    name = parse_name(required_model(fields))
    # checked before the stream starts, so a bad name is a 400, not an error line after a 200
    if name.digest:
        raise LocalrtError(f"cannot create {name}: a model name to write takes no @digest")
    if fields.get("from") is not None:
        parse_name(fields["from"])  # `from` names a stored model (server-side paths are refused)

    def work(emit: Callable[[dict[str, Any]], None]) -> None:
        create_from_request(name, fields, store=store, progress=lambda status: emit({"status": status}))
        emit({"status": "success"})

    return await respond(
        run_in_thread_stream(work, wait=False, name="localrt-create"), fields.get("stream", True) is not False
    )


@router.head("/api/blobs/{digest}", responses=wire.error_responses(False, 404))
async def blob_exists(request: Request, digest: BlobDigest) -> Response:
    exists = store_of(request).has_blob(normalize_digest(digest))
    return Response(status_code=200 if exists else 404)


@router.post(
    "/api/blobs/{digest}",
    responses={201: {"description": "stored"}, **ERRORS},
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
    with store.begin_blob() as writer:
        async for chunk in request.stream():
            writer.write(chunk)
        writer.commit(digest)
    return Response(status_code=201)


@router.get("/api/ps", responses={200: wire.ok(wire.PsResponse), **ERRORS})
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


def metrics_fields(m: Metrics | None) -> dict[str, Any]:
    return m.to_ollama() if m is not None else {}


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
        out["logprobs"] = chunk.logprobs
    if chunk.done:
        out["done_reason"] = chunk.done_reason
        if chunk.context is not None:
            out["context"] = chunk.context
        if chunk.tool_calls:
            out["tool_calls"] = chunk.tool_calls
        out.update(metrics_fields(chunk.metrics))
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
        out["logprobs"] = chunk.logprobs
    if chunk.done:
        out["done_reason"] = chunk.done_reason
        out.update(metrics_fields(chunk.metrics))
    return out


def observe(request: Request, chunk: Chunk) -> None:
    """Feed /metrics from a final chunk."""
    m = chunk.metrics
    if chunk.done and m is not None and m.eval_count:
        ttft = (m.load_ns + m.prompt_eval_ns) / 1e9
        request.app.state.metrics.observe_generation(
            chunk.model, ttft, m.prompt_eval_count, m.eval_count, m.eval_ns / 1e9
        )


def bool_field(fields: dict[str, Any], key: str, default: bool) -> bool:
    value = fields.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise LocalrtError(f"{key} must be true or false")
    return value


def optional_str(fields: dict[str, Any], key: str) -> str | None:
    value = fields.get(key)
    if value is not None and not isinstance(value, str):
        raise LocalrtError(f"{key} must be a string")
    return value


async def generation_response(
    request: Request, chunks: AsyncIterator[Chunk], stream: bool, to_wire: Callable[[Chunk], dict[str, Any]]
) -> Response:
    async def wire() -> AsyncIterator[dict[str, Any]]:
        async for chunk in chunks:
            observe(request, chunk)
            yield to_wire(chunk)

    if not stream:
        last: dict[str, Any] = {}
        async for item in wire():
            last = item
        return JSONResponse(last)
    _, items = await first_and_rest(wire())
    return ndjson_response(items)


@router.post(
    "/api/generate",
    openapi_extra=wire.request_body(wire.GenerateRequest),
    responses={200: wire.ok(wire.GenerateResponse, STREAMED), **GENERATION_ERRORS},
)
async def generate(request: Request) -> Response:
    f = await wire.read_json(request, wire.GenerateRequest)
    runtime = runtime_of(request)
    context = f.get("context")
    if context is not None and (
        not isinstance(context, list) or not all(isinstance(t, int) for t in context)
    ):
        raise LocalrtError("context must be a list of token ids")
    prompt = f.get("prompt") or ""
    if not isinstance(prompt, str):
        raise LocalrtError("prompt must be a string")
    stream = bool_field(f, "stream", True)
    images = f.get("images")
    if images is not None and (not isinstance(images, list) or not all(isinstance(i, str) for i in images)):
        raise LocalrtError("images must be a list of base64 strings")
    chunks = runtime.generate(
        required_model(f),
        prompt,
        images=images or None,
        system=optional_str(f, "system"),
        raw=bool_field(f, "raw", False),
        context=context,
        options=f.get("options"),
        format=f.get("format") or None,
        keep_alive=f.get("keep_alive"),
        logprobs=bool_field(f, "logprobs", False),
        top_logprobs=f.get("top_logprobs") or 0,
        stream=stream,
        think=f.get("think"),
        truncate=bool_field(f, "truncate", True),
        shift=bool_field(f, "shift", True),
    )
    return await generation_response(request, chunks, stream, chunk_to_generate)


@router.post(
    "/api/chat",
    openapi_extra=wire.request_body(wire.ChatRequest),
    responses={200: wire.ok(wire.ChatResponse, STREAMED), **GENERATION_ERRORS},
)
async def chat(request: Request) -> Response:
    f = await wire.read_json(request, wire.ChatRequest)
    runtime = runtime_of(request)
    messages = f.get("messages") or []
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise LocalrtError("messages must be a list of objects")
    for m in messages:
        if m.get("role") not in ("system", "user", "assistant", "tool"):
            raise LocalrtError(f"invalid message role {m.get('role')!r}")
        if m.get("content") is not None and not isinstance(m.get("content"), str):
            raise LocalrtError("message content must be a string")
        images = m.get("images")
        if images is not None and (
            not isinstance(images, list) or not all(isinstance(i, str) for i in images)
        ):
            raise LocalrtError("message images must be a list of base64 strings")
    tools = f.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise LocalrtError("tools must be a list")
    stream = bool_field(f, "stream", True)
    chunks = runtime.chat(
        required_model(f),
        messages,
        options=f.get("options"),
        tools=tools or None,
        format=f.get("format") or None,
        keep_alive=f.get("keep_alive"),
        logprobs=bool_field(f, "logprobs", False),
        top_logprobs=f.get("top_logprobs") or 0,
        stream=stream,
        think=f.get("think"),
        truncate=bool_field(f, "truncate", True),
        shift=bool_field(f, "shift", True),
    )
    return await generation_response(request, chunks, stream, chunk_to_chat)


@router.post(
    "/api/embed",
    openapi_extra=wire.request_body(wire.EmbedRequest),
    responses={200: wire.ok(wire.EmbedResponse), **GENERATION_ERRORS},
)
async def embed(request: Request) -> dict[str, Any]:
    f = await wire.read_json(request, wire.EmbedRequest)
    inputs = f.get("input") or ""  # null or absent: only load the model, as Ollama does
    result = await runtime_of(request).embed(
        required_model(f),
        inputs,
        options=f.get("options"),
        keep_alive=f.get("keep_alive"),
        truncate=bool_field(f, "truncate", True),
    )
    return {
        "model": result.model,
        "embeddings": result.embeddings,
        "total_duration": result.total_ns,
        "load_duration": result.load_ns,
        "prompt_eval_count": result.prompt_eval_count,
    }


@router.post(
    "/api/embeddings",
    openapi_extra=wire.request_body(wire.EmbeddingsRequest),
    responses={200: wire.ok(wire.EmbeddingsResponse), **GENERATION_ERRORS},
)
async def embeddings_legacy(request: Request) -> dict[str, Any]:
    f = await wire.read_json(request, wire.EmbeddingsRequest)
    prompt = f.get("prompt") or ""
    # an empty prompt still loads the model (and checks the name and options), as Ollama does
    result = await runtime_of(request).embed(
        required_model(f), prompt, options=f.get("options"), keep_alive=f.get("keep_alive")
    )
    return {"embedding": result.embeddings[0] if prompt else []}


async def rerank_response(request: Request) -> dict[str, Any]:
    """`POST /api/rerank` and `/v1/rerank` (llama-server's, Jina's and Cohere's shape): results sorted by
    relevance_score, cut to top_n, each with its document's index (and text with return_documents)."""
    f = await wire.read_json(request, wire.RerankRequest)
    documents = f.get("documents")
    if not isinstance(documents, list) or not all(isinstance(d, str) for d in documents):
        raise LocalrtError("documents must be a list of strings")
    top_n = f.get("top_n")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0):
        raise LocalrtError("top_n must be a non-negative integer")
    result = await runtime_of(request).rerank(
        required_model(f),
        f.get("query"),
        documents,
        options=f.get("options"),
        keep_alive=f.get("keep_alive"),
    )
    order = sorted(range(len(documents)), key=lambda i: -result.scores[i])
    with_text = bool_field(f, "return_documents", False)
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
    openapi_extra=wire.request_body(wire.RerankRequest),
    responses={200: wire.ok(wire.RerankResponse), **GENERATION_ERRORS},
)
async def rerank(request: Request) -> dict[str, Any]:
    return await rerank_response(request)


@router.post(
    "/api/tokenize",
    openapi_extra=wire.request_body(wire.TokenizeRequest),
    responses={200: wire.ok(wire.TokenizeResponse), **GENERATION_ERRORS},
)
async def tokenize(request: Request) -> dict[str, Any]:
    f = await wire.read_json(request, wire.TokenizeRequest)
    text = f.get("text") if f.get("text") is not None else f.get("content") or ""
    if not isinstance(text, str):
        raise LocalrtError("text must be a string")
    tokens = await runtime_of(request).tokenize(
        required_model(f),
        text,
        add_special=bool_field(f, "add_special", True),
        parse_special=bool_field(f, "parse_special", False),
    )
    return {"model": required_model(f), "tokens": tokens}


@router.post(
    "/api/detokenize",
    openapi_extra=wire.request_body(wire.DetokenizeRequest),
    responses={200: wire.ok(wire.DetokenizeResponse), **GENERATION_ERRORS},
)
async def detokenize(request: Request) -> dict[str, Any]:
    f = await wire.read_json(request, wire.DetokenizeRequest)
    tokens = f.get("tokens")
    if not isinstance(tokens, list):
        raise LocalrtError("tokens must be a list of token ids")
    text = await runtime_of(request).detokenize(required_model(f), tokens)
    return {"model": required_model(f), "text": text}


@router.get("/metrics", response_class=PlainTextResponse, responses=ERRORS)
async def metrics(request: Request) -> str:
    runtime = request.app.state.runtime
    return request.app.state.metrics.render(
        queue_depth=lambda: runtime.queue_depth() if runtime is not None else {},
        loaded=lambda: [row.name for row in runtime.ps()] if runtime is not None else [],
    )
