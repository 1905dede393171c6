"""OpenAI-compatible routes under /v1 (SPEC 6): chat completions, completions, embeddings, models."""

from __future__ import annotations

import base64
import json
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse, Response

from localrt.api import schemas as wire
from localrt.api.ollama import observe, runtime_of
from localrt.api.security import error_body
from localrt.api.streaming import first_and_rest, sse_response
from localrt.errors import LocalrtError, ModelNotFound
from localrt.runtime import images as image_input
from localrt.runtime.manager import Chunk, Metrics
from localrt.runtime.thinking import think_from_effort
from localrt.store.names import parse_name

router = APIRouter(prefix="/v1")
ERRORS = wire.error_responses(True)
GENERATION_ERRORS = wire.error_responses(True, 404, 499, 501, 503)
SSE = wire.SSE


def model_object(display: str, created: float, owner: str) -> dict[str, Any]:
    return {"id": display, "object": "model", "created": int(created), "owned_by": owner}


@router.get("/models", responses={200: wire.ok(wire.ModelList), **ERRORS})
async def list_models(request: Request) -> dict[str, Any]:
    entries = request.app.state.store.list_models()
    return {
        "object": "list",
        "data": [model_object(e.name.display, e.modified, e.name.namespace) for e in entries],
    }


@router.get(
    "/models/{model_id:path}", responses={200: wire.ok(wire.ModelObject), **wire.error_responses(True, 404)}
)
async def get_model(
    request: Request, model_id: Annotated[str, Path(json_schema_extra=wire.NAME_SCHEMA)]
) -> dict[str, Any]:
    wanted = parse_name(model_id)
    for entry in request.app.state.store.list_models():
        if entry.name.same_model(wanted):
            return model_object(entry.name.display, entry.modified, entry.name.namespace)
    raise ModelNotFound(f"model '{model_id}' not found")


# ---- translation to the runtime's options ------------------------------------------------------
# OpenAI top-level fields that map onto Ollama option names.
RENAMED = {"max_tokens": "num_predict", "max_completion_tokens": "num_predict"}
PASSED = ("temperature", "top_p", "seed", "frequency_penalty", "presence_penalty")
# Ours and Ollama's options accepted at top level (the openai client sends `extra_body` there).
EXTRA_OPTIONS = (
    "top_k",
    "min_p",
    "typical_p",
    "repeat_penalty",
    "repeat_last_n",
    "num_ctx",
    "grammar",
    "num_keep",
    "num_thread",
    "num_gpu",
    "num_batch",
    "backend",
    "kv_cache_type",
    "speculative",
    "draft_model",
    "num_draft",
)


def options_from(f: dict[str, Any]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for key in PASSED + EXTRA_OPTIONS:
        if f.get(key) is not None:
            options[key] = f[key]
    for key, name in RENAMED.items():
        if f.get(key) is not None:
            options[name] = f[key]
    stop = f.get("stop")
    if stop is not None:
        options["stop"] = [stop] if isinstance(stop, str) else stop
    extra = f.get("options")
    if extra is not None:
        if not isinstance(extra, dict):
            raise LocalrtError("options must be an object")
        options.update(extra)
    # OpenAI's defaults, not Ollama's, when the client leaves them out (as Ollama does on /v1)
    options.setdefault("temperature", 1.0)
    options.setdefault("top_p", 1.0)
    if f.get("n") not in (None, 1):
        raise OpenAIParamError("n", "only n=1 is supported")
    return options


class OpenAIParamError(LocalrtError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def format_from(f: dict[str, Any]) -> str | dict[str, Any] | None:
    rf = f.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise OpenAIParamError("response_format", "type must be text, json_object or json_schema")
    if rf["type"] == "json_object":
        return "json"
    if rf["type"] == "json_schema":
        schema = (rf.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise OpenAIParamError("response_format", "json_schema.schema must be an object")
        return schema
    return None


def message_text(content: Any) -> str:
    """Content as a string (text parts only, for the routes that take no images)."""
    text, urls = message_parts(content)
    if urls:
        raise OpenAIParamError("messages", "image_url parts are only supported by /v1/chat/completions")
    return text


def message_parts(content: Any) -> tuple[str, list[str]]:
    """Content as (text, image URLs): OpenAI allows a list of text and image_url parts. Each image's place
    in the text is Ollama's `[img]`, which the runtime fills in order."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if isinstance(content, list):
        texts, urls = [], []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                texts.append(str(part.get("text", "")))
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str) or not url:
                    raise OpenAIParamError("messages", "an image_url part needs image_url.url")
                urls.append(url)
                texts.append(image_input.PLACEHOLDER)
            else:
                raise OpenAIParamError(
                    "messages", f"unsupported content part type {kind!r} (text, image_url)"
                )
        return "".join(texts), urls
    raise OpenAIParamError("messages", "content must be a string or a list of parts")


async def fetch_message_images(raw: list[Any], messages: list[dict[str, Any]]) -> None:
    """Turn each message's image_url parts into image bytes (`images`), fetching in a worker thread."""
    import asyncio

    for i, (m, msg) in enumerate(zip(raw, messages)):
        _, urls = message_parts(m.get("content"))
        if urls:
            msg["images"] = [
                await asyncio.to_thread(image_input.image_url_bytes, url, f"messages[{i}] image_url")
                for url in urls
            ]


def messages_from(f: dict[str, Any]) -> list[dict[str, Any]]:
    raw = f.get("messages")
    if not isinstance(raw, list) or not raw:
        raise OpenAIParamError("messages", "a non-empty list of messages is required")
    out = []
    for m in raw:
        if not isinstance(m, dict) or m.get("role") not in (
            "system",
            "developer",
            "user",
            "assistant",
            "tool",
        ):
            raise OpenAIParamError("messages", f"invalid message {m!r:.80}")
        msg: dict[str, Any] = {
            "role": "system" if m["role"] == "developer" else m["role"],
            "content": message_parts(m.get("content"))[0],
        }
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = (call or {}).get("function") or {}
                args = fn.get("arguments", "{}")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except ValueError:
                    raise OpenAIParamError("messages", "tool call arguments must be JSON") from None
                calls.append({"id": call.get("id"), "function": {"name": fn.get("name"), "arguments": args}})
            msg["tool_calls"] = calls
        thinking = m.get("reasoning_content") or m.get("reasoning")
        if thinking and m["role"] == "assistant":
            msg["thinking"] = thinking
        if m.get("tool_call_id"):
            msg["tool_call_id"] = m["tool_call_id"]
        if m.get("name"):
            msg["tool_name"] = m["name"]
        out.append(msg)
    return out


def openai_tool_calls(calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The runtime's calls as OpenAI's: each whole in one entry (id, name and all its arguments)."""
    if not calls:
        return None
    return [
        {
            "index": c["function"].get("index", i),
            "id": c.get("id") or f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {
                "name": c["function"]["name"],
                "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False),
            },
        }
        for i, c in enumerate(calls)
    ]


def openai_logprobs(items: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    if items is None:
        return None
    return {
        "content": [
            {
                "token": lp["token"],
                "logprob": lp["logprob"],
                "bytes": lp.get("bytes"),
                "top_logprobs": [
                    {"token": t["token"], "logprob": t["logprob"], "bytes": t.get("bytes")}
                    for t in lp.get("top_logprobs", [])
                ],
            }
            for lp in items
        ]
    }


def usage_of(chunk: Chunk) -> dict[str, Any]:
    m = chunk.metrics or Metrics()
    prompt = m.prompt_eval_count + m.cached_count  # OpenAI counts the cached prompt tokens in prompt_tokens
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": m.eval_count,
        "total_tokens": prompt + m.eval_count,
        "prompt_tokens_details": {"cached_tokens": m.cached_count},
        "completion_tokens_details": {"reasoning_tokens": m.reasoning_tokens},
    }
    if m.draft_count:
        usage.update(draft_count=m.draft_count, draft_accepted_count=m.draft_accepted_count)
    return usage


def finish_reason(chunk: Chunk) -> str:
    if chunk.tool_calls:
        return "tool_calls"
    return {"length": "length"}.get(chunk.done_reason or "", "stop")


def logprob_flags(f: dict[str, Any]) -> tuple[bool, int]:
    want = f.get("logprobs")
    top = f.get("top_logprobs")
    if isinstance(want, int) and not isinstance(want, bool):  # /v1/completions: logprobs is a count
        return want > 0, want
    if want is not None and not isinstance(want, bool):
        raise OpenAIParamError("logprobs", "must be a boolean")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20):
        raise OpenAIParamError("top_logprobs", "must be an integer between 0 and 20")
    return bool(want), (top or 0) if want else 0


def include_usage(f: dict[str, Any]) -> bool:
    opts = f.get("stream_options") or {}
    return isinstance(opts, dict) and bool(opts.get("include_usage"))


def sse_error(e: LocalrtError) -> dict[str, Any]:
    return error_body(str(e), e.status, True)


async def answer(
    request: Request,
    chunks: AsyncIterator[Chunk],
    f: dict[str, Any],
    completion_id: str,
    model: str,
    objects: tuple[str, str],
    whole: Callable[[Chunk], dict[str, Any]],
    piece: Callable[[Chunk, bool], dict[str, Any] | None],
) -> Response:
    """What chat and text completions share: one JSON body from the final chunk (`whole` makes its
    choice), or SSE events (`piece` makes each chunk's choice, None to skip) and an optional usage event."""
    base = {
        "id": completion_id,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": "fp_localrt",
    }
    if f.get("stream") is not True:
        final: Chunk | None = None
        async for chunk in chunks:
            observe(request, chunk)
            final = chunk
        assert final is not None
        return JSONResponse(
            {**base, "object": objects[0], "choices": [whole(final)], "usage": usage_of(final)}
        )

    async def events() -> AsyncIterator[dict[str, Any]]:
        first = True
        async for chunk in chunks:
            observe(request, chunk)
            choice = piece(chunk, first)
            first = False
            if choice is not None:
                yield {**base, "object": objects[1], "choices": [choice]}
            if chunk.done and include_usage(f):
                yield {**base, "object": objects[1], "choices": [], "usage": usage_of(chunk)}

    _, items = await first_and_rest(events())
    return sse_response(items, sse_error)


# ---- routes ------------------------------------------------------------------------------------
@router.post(
    "/chat/completions",
    openapi_extra=wire.request_body(wire.ChatCompletionRequest),
    responses={200: wire.ok(wire.ChatCompletion, SSE), **GENERATION_ERRORS},
)
async def chat_completions(request: Request) -> Response:
    f = await wire.read_json(request, wire.ChatCompletionRequest)
    model = f.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIParamError("model", "model is required")
    messages = messages_from(f)
    await fetch_message_images(f["messages"], messages)  # issue 19: image_url parts
    options = options_from(f)
    fmt = format_from(f)
    want_logprobs, top = logprob_flags(f)
    tools = f.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise OpenAIParamError("tools", "must be a list")
    stream = f.get("stream") is True
    runtime = runtime_of(request)
    chunks = runtime.chat(
        model,
        messages,
        options=options,
        tools=tools or None,
        format=fmt,
        keep_alive=f.get("keep_alive"),
        logprobs=want_logprobs,
        top_logprobs=top,
        stream=stream,
        think=think_from_effort(f.get("reasoning_effort")),
        tool_choice=f.get("tool_choice"),
        parallel_tool_calls=f.get("parallel_tool_calls"),
    )

    def whole(final: Chunk) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": final.content,
            "tool_calls": openai_tool_calls(final.tool_calls),
        }
        if final.thinking:
            message["reasoning_content"] = final.thinking
        if message["tool_calls"]:
            message["content"] = final.content or None
        return {
            "index": 0,
            "message": message,
            "finish_reason": finish_reason(final),
            "logprobs": openai_logprobs(final.logprobs) if want_logprobs else None,
        }

    called = False  # a streamed call arrives before the final chunk; finish_reason must still say so

    def piece(chunk: Chunk, first: bool) -> dict[str, Any] | None:
        nonlocal called
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if chunk.thinking:
            delta["reasoning_content"] = chunk.thinking
        if chunk.content:
            delta["content"] = chunk.content
        if chunk.tool_calls:
            delta["tool_calls"] = openai_tool_calls(chunk.tool_calls)
            called = True
        reason = None
        if chunk.done:
            reason = "tool_calls" if called or chunk.tool_calls else finish_reason(chunk)
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": reason}
        if want_logprobs and chunk.logprobs:
            choice["logprobs"] = openai_logprobs(chunk.logprobs)
        return choice if delta or chunk.done else None

    return await answer(
        request,
        chunks,
        f,
        f"chatcmpl-{uuid.uuid4().hex[:24]}",
        model,
        ("chat.completion", "chat.completion.chunk"),
        whole,
        piece,
    )


@router.post(
    "/completions",
    openapi_extra=wire.request_body(wire.CompletionRequest),
    responses={200: wire.ok(wire.Completion, SSE), **GENERATION_ERRORS},
)
async def completions(request: Request) -> Response:
    f = await wire.read_json(request, wire.CompletionRequest)
    model = f.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIParamError("model", "model is required")
    prompt = f.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise OpenAIParamError("prompt", "must be a string")
    options = options_from(f)
    want_logprobs, top = logprob_flags(f)
    stream = f.get("stream") is True
    # A completion continues the text as given: no chat template (raw), as OpenAI's API means it.
    chunks = runtime_of(request).generate(
        model,
        prompt,
        raw=True,
        options=options,
        format=format_from(f),
        keep_alive=f.get("keep_alive"),
        logprobs=want_logprobs,
        top_logprobs=top,
        stream=stream,
    )

    def logprobs_legacy(items: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        if not want_logprobs or not items:
            return None
        return {
            "tokens": [lp["token"] for lp in items],
            "token_logprobs": [lp["logprob"] for lp in items],
            "top_logprobs": [{t["token"]: t["logprob"] for t in lp.get("top_logprobs", [])} for lp in items],
        }

    def choice(chunk: Chunk) -> dict[str, Any]:
        return {
            "index": 0,
            "text": chunk.content,
            "finish_reason": finish_reason(chunk) if chunk.done else None,
            "logprobs": logprobs_legacy(chunk.logprobs),
        }

    return await answer(
        request,
        chunks,
        f,
        f"cmpl-{uuid.uuid4().hex[:24]}",
        model,
        ("text_completion", "text_completion"),
        choice,
        lambda chunk, _first: choice(chunk) if chunk.content or chunk.done else None,
    )


@router.post(
    "/embeddings",
    openapi_extra=wire.request_body(wire.OpenAIEmbeddingsRequest),
    responses={200: wire.ok(wire.EmbeddingList), **GENERATION_ERRORS},
)
async def embeddings(request: Request) -> dict[str, Any]:
    f = await wire.read_json(request, wire.OpenAIEmbeddingsRequest)
    model = f.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIParamError("model", "model is required")
    inputs = f.get("input")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs or not all(isinstance(x, str) for x in inputs):
        raise OpenAIParamError("input", "must be a string or a non-empty list of strings")
    encoding = f.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise OpenAIParamError("encoding_format", "must be float or base64")
    result = await runtime_of(request).embed(model, inputs, keep_alive=f.get("keep_alive"))
    dims = f.get("dimensions")
    data = []
    for i, vector in enumerate(result.embeddings):
        if isinstance(dims, int) and not isinstance(dims, bool) and 0 < dims < len(vector):
            vector = vector[:dims]
        embedding: Any = vector
        if encoding == "base64":
            embedding = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"object": "embedding", "embedding": embedding, "index": i})
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": result.prompt_eval_count, "total_tokens": result.prompt_eval_count},
    }


@router.post(
    "/rerank",
    openapi_extra=wire.request_body(wire.RerankRequest),
    responses={200: wire.ok(wire.RerankResponse), **GENERATION_ERRORS},
)
async def rerank(request: Request) -> dict[str, Any]:
    """Jina / Cohere / llama-server rerank (issue 19): the same handler as /api/rerank."""
    from localrt.api.ollama import rerank_response

    return await rerank_response(request)
