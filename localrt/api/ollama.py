"""Ollama-compatible routes (SPEC 6), field for field with Ollama's API."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from localrt import __version__
from localrt.api.streaming import first_and_rest, ndjson_response
from localrt.errors import LocalrtError
from localrt.store.names import normalize_digest, parse_name
from localrt.store.store import ResolvedModel, Store

router = APIRouter()


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")


def store_of(request: Request) -> Store:
    return request.app.state.store


def rfc3339(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).astimezone().isoformat()


def model_details(store: Store, resolved: ResolvedModel) -> dict[str, Any]:
    """`details` as Ollama fills it, from the config blob (written at import) or the GGUF header."""
    cfg = resolved.config
    if not cfg.get("model_family"):
        from localrt.store.gguf import format_parameter_count, read_gguf

        info = read_gguf(resolved.model_path)
        cfg = {"model_family": info.architecture, "model_type": format_parameter_count(info.parameter_count),
               "file_type": info.file_type, **cfg}
    family = cfg.get("model_family") or ""
    return {"parent_model": "", "format": cfg.get("model_format", "gguf"), "family": family,
            "families": cfg.get("model_families") or ([family] if family else None),
            "parameter_size": cfg.get("model_type", ""), "quantization_level": cfg.get("file_type", "")}


@router.api_route("/", methods=["GET", "HEAD"], response_class=PlainTextResponse)
async def root() -> str:
    return "localrt is running"


@router.api_route("/api/version", methods=["GET", "HEAD"])
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.api_route("/api/tags", methods=["GET", "HEAD"])
async def tags(request: Request) -> dict[str, Any]:
    store = store_of(request)
    models = []
    for entry in store.list_models():
        try:
            details = model_details(store, store.resolve(entry.name))
        except LocalrtError:
            continue  # a damaged entry is skipped, not a 500 for the whole list
        models.append({"name": entry.name.display, "model": entry.name.display,
                       "modified_at": rfc3339(entry.modified), "size": entry.size,
                       "digest": entry.manifest_digest.split(":", 1)[1], "details": details})
    return {"models": models}


def required_model(body: Body, key: str = "model") -> str:
    value = getattr(body, key, None) or (getattr(body, "name", None) if key == "model" else None)
    if not isinstance(value, str) or not value:
        raise LocalrtError(f"{key} is required")
    return value


@router.post("/api/show")
async def show(request: Request, body: Body) -> dict[str, Any]:
    from localrt.show import modelfile_text, parameter_lines, template_of
    from localrt.store.gguf import read_gguf

    store = store_of(request)
    resolved = store.resolve(parse_name(required_model(body)))
    info = read_gguf(resolved.model_path)
    params = "\n".join(f"{k:<30}{v}" for k, v in parameter_lines(resolved.params))
    capabilities = ["completion"]
    template = template_of(resolved, info)
    if "tools" in template:
        capabilities.append("tools")
    return {
        "license": resolved.license or info.license or "",
        "modelfile": modelfile_text(resolved, info),
        "parameters": params,
        "template": template,
        "system": resolved.system or "",
        "details": model_details(store, resolved),
        "model_info": info.summary(),
        "capabilities": capabilities,
        "modified_at": rfc3339(store.manifest_path(resolved.name).stat().st_mtime)
        if store.manifest_path(resolved.name).exists() else None,
    }


@router.delete("/api/delete")
async def delete(request: Request, body: Body) -> Response:
    name = parse_name(required_model(body))
    runtime = request.app.state.runtime
    if runtime is not None:
        with contextlib.suppress(LocalrtError):
            await runtime.unload(name.display)
    store_of(request).remove(name)
    return Response(status_code=200)


@router.post("/api/copy")
async def copy(request: Request, body: Body) -> Response:
    src, dst = parse_name(required_model(body, "source")), parse_name(required_model(body, "destination"))
    store_of(request).copy(src, dst)
    return Response(status_code=200)


async def stream_from_thread(work: Callable[[Callable[[dict[str, Any]], None]], None]) -> AsyncIterator[dict]:
    """Run blocking `work(emit)` in a thread and yield what it emits; its exception ends the stream."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def emit(item: dict[str, Any]) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, ("item", item))

    def target() -> None:
        try:
            work(emit)
            loop.call_soon_threadsafe(queue.put_nowait, ("done", None))
        except BaseException as e:  # delivered to the consumer, which raises it there
            loop.call_soon_threadsafe(queue.put_nowait, ("error", e))

    threading.Thread(target=target, daemon=True).start()
    while True:
        kind, value = await queue.get()
        if kind == "item":
            yield value
        elif kind == "done":
            return
        else:
            raise value


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


@router.post("/api/pull")
async def pull(request: Request, body: Body) -> Response:
    from localrt.store.pull import pull as do_pull

    name = parse_name(required_model(body))
    store, insecure = store_of(request), bool(getattr(body, "insecure", False))

    def work(emit: Callable[[dict[str, Any]], None]) -> None:
        do_pull(name, store=store, insecure=insecure, progress=lambda e: emit(progress_dict(e)))

    return await respond(stream_from_thread(work), getattr(body, "stream", True) is not False)


@router.post("/api/create")
async def create(request: Request, body: Body) -> Response:
    from localrt.store.modelfile import create_from_request

    store = store_of(request)
    name = parse_name(required_model(body))
    fields = body.model_dump()

    def work(emit: Callable[[dict[str, Any]], None]) -> None:
        create_from_request(name, fields, store=store, progress=lambda status: emit({"status": status}))
        emit({"status": "success"})

    return await respond(stream_from_thread(work), fields.get("stream", True) is not False)


@router.head("/api/blobs/{digest}")
async def blob_exists(request: Request, digest: str) -> Response:
    exists = store_of(request).has_blob(normalize_digest(digest))
    return Response(status_code=200 if exists else 404)


@router.post("/api/blobs/{digest}")
async def blob_upload(request: Request, digest: str) -> Response:
    digest = normalize_digest(digest)
    store = store_of(request)
    if store.has_blob(digest):
        return Response(status_code=200)
    with store.begin_blob() as writer:
        async for chunk in request.stream():
            writer.write(chunk)
        writer.commit(digest)
    return Response(status_code=201)


@router.get("/api/ps")
async def ps(request: Request) -> dict[str, Any]:
    runtime = request.app.state.runtime
    if runtime is None:
        return {"models": []}
    return {"models": [dict(m) for m in runtime.ps()]}
