"""OpenAI-compatible routes under /v1: chat completions, completions, embeddings, models."""

from __future__ import annotations

import base64
import json
import struct
import time
import uuid
from collections.abc import AsyncIterator
from collections.abc import Callable
from typing import Annotated
from typing import Any
from typing import TypeVar

from fastapi import APIRouter
from fastapi import Path
from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.responses import Response
from fastapi.responses import StreamingResponse

from localrt import wire
from localrt.api import schemas
from localrt.api.ollama import observe
from localrt.api.ollama import runtime_of
from localrt.api.security import error_body
from localrt.api.streaming import first_of
from localrt.api.streaming import sse_response
from localrt.api.streaming import unless_client_leaves
from localrt.api.streaming import with_warnings
from localrt.api.translate import ParamError
from localrt.api.translate import effort_setting
from localrt.api.translate import sampling_options
from localrt.errors import LocalrtError
from localrt.errors import ModelNotFound
from localrt.runtime import images as image_input
from localrt.runtime.answers import Chunk
from localrt.runtime.answers import Metrics
from localrt.runtime.answers import Settings
from localrt.runtime.answers import TokenLogprob
from localrt.store.names import parse_name

router = APIRouter(prefix="/v1")
ERRORS = schemas.error_responses(True)
GENERATION_ERRORS = schemas.error_responses(True, 404, 499, 501, 503)
SSE = schemas.SSE


def model_object(display: str, created: float, owner: str) -> dict[str, Any]:
    return {"id": display, "object": "model", "created": int(created), "owned_by": owner}


@router.get("/models", responses={200: schemas.ok(wire.ModelList), **ERRORS})
async def list_models(request: Request) -> dict[str, Any]:
    entries = request.app.state.store.list_models()
    return {
        "object": "list",
        "data": [model_object(e.name.display, e.modified, e.name.namespace) for e in entries],
    }


@router.get(
    "/models/{model_id:path}",
    responses={200: schemas.ok(wire.ModelObject), **schemas.error_responses(True, 404)},
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
RENAMED = {"max_tokens": "num_predict", "max_completion_tokens": "num_predict", "stop": "stop"}
# OpenAI's defaults, not Ollama's, where the client leaves them out (as Ollama does on /v1)
DEFAULTS = {"temperature": 1.0, "top_p": 1.0}


def options_of(body: wire.OpenAISampling) -> dict[str, Any]:
    """The runtime's options from the fields the client sent (extra_body lands at top level)."""
    return sampling_options(wire.body_of(body), RENAMED)


def settings_of(
    body: wire.ChatCompletionRequest | wire.CompletionRequest, logprobs: bool, top: int
) -> Settings:
    """What chat and text completions ask alike, in the runtime's names: the one place an OpenAI
    request becomes the runtime's."""
    return Settings(
        options=options_of(body),
        defaults=DEFAULTS,
        format=format_from(body.response_format),
        keep_alive=body.keep_alive,
        logprobs=logprobs,
        top_logprobs=top,
        stream=body.stream is True,
        lora=wire.lora_setting(body.lora),
    )


def required_model(model: str) -> str:
    if not model:
        raise ParamError("model", "model is required")
    return model


def format_from(rf: wire.ResponseFormat | None) -> str | dict[str, Any] | None:
    if isinstance(rf, wire.JsonObjectFormat):
        return "json"
    if isinstance(rf, wire.JsonSchemaFormat):
        return rf.json_schema.schema_
    return None


Content = str | list[wire.ContentPart | wire.ImagePart] | None


def message_parts(content: Content) -> tuple[str, list[str]]:
    """Content as (text, image URLs): OpenAI allows a list of text and image_url parts. Each image's place
    in the text is Ollama's `[img]`, which the runtime fills in order."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    texts, urls = [], []
    for part in content:
        if isinstance(part, wire.ImagePart):
            if not part.image_url.url:
                raise ParamError("messages", "an image_url part needs image_url.url")
            urls.append(part.image_url.url)
            texts.append(image_input.PLACEHOLDER)
        else:
            texts.append(part.text)
    return "".join(texts), urls


async def fetch_message_images(raw: list[wire.OpenAIMessage], messages: list[dict[str, Any]]) -> None:
    """Turn each message's image_url parts into image bytes (`images`), fetching in a worker thread."""
    import asyncio

    image_input.check_count(sum(len(message_parts(m.content)[1]) for m in raw))  # before any fetch
    for i, (m, msg) in enumerate(zip(raw, messages)):
        _, urls = message_parts(m.content)
        if urls:
            msg["images"] = [
                await asyncio.to_thread(image_input.image_url_bytes, url, f"messages[{i}] image_url")
                for url in urls
            ]


def messages_from(raw: list[wire.OpenAIMessage]) -> list[dict[str, Any]]:
    """OpenAI's messages as the runtime's (Ollama's shape): developer is system, calls' arguments parsed."""
    out = []
    for m in raw:
        msg: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": message_parts(m.content)[0],
        }
        if m.tool_calls:
            calls = []
            for call in m.tool_calls:
                fn = (call or {}).get("function") or {}
                args = fn.get("arguments", "{}")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except ValueError:
                    raise ParamError("messages", "tool call arguments must be JSON") from None
                calls.append({"id": call.get("id"), "function": {"name": fn.get("name"), "arguments": args}})
            msg["tool_calls"] = calls
        thinking = m.reasoning_content or m.reasoning
        if thinking and m.role == "assistant":
            msg["thinking"] = thinking
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.name:
            msg["tool_name"] = m.name
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


def openai_logprobs(items: list[TokenLogprob] | None) -> dict[str, Any] | None:
    return None if items is None else {"content": wire.logprobs_to_wire(items)}


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


def finish_reason(chunk: Chunk, called: bool = False) -> str:
    """The token limit's `length` first, even after complete calls (a cut call is dropped), then
    `tool_calls` when the reply made any (`called`: in an earlier streamed chunk)."""
    if chunk.done_reason == "length":
        return "length"
    return "tool_calls" if called or chunk.tool_calls else "stop"


def logprob_flags(want: bool | int | None, top: int | None = None) -> tuple[bool, int]:
    """(logprobs wanted, how many alternatives): chat sends a flag and top_logprobs, /v1/completions
    a count."""
    if isinstance(want, int) and not isinstance(want, bool):
        return want > 0, want
    return bool(want), (top or 0) if want else 0


def include_usage(body: wire.OpenAISampling) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage is True


def function_tools(tools: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]] | None, list[str]]:
    """The function tools, which the model is shown; other kinds (hosted ones such as web_search)
    have nothing here to run them, so they are left out and named in a warning."""
    kept = [t for t in tools or [] if t.get("type", "function") == "function"]
    other = sorted({str(t.get("type")) for t in tools or [] if t.get("type", "function") != "function"})
    warnings = (
        [f"tools not offered to the model (localrt cannot run them): {', '.join(other)}"] if other else []
    )
    return kept or None, warnings


def tool_choice_of(body: wire.ChatCompletionRequest) -> Any:
    """OpenAI's tool_choice as the runtime reads it: a name, or {"type": "function", "function": ...}."""
    choice = body.tool_choice
    return wire.body_of(choice) if isinstance(choice, wire.NamedToolChoice) else choice


def sse_error(e: LocalrtError) -> dict[str, Any]:
    return error_body(str(e), e.status, True)


async def answer(
    request: Request,
    chunks: AsyncIterator[Chunk],
    body: wire.OpenAISampling,
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
    if body.stream is not True:

        async def last() -> Chunk:
            final: Chunk | None = None
            async for chunk in chunks:
                observe(request, chunk)
                final = chunk
            assert final is not None
            return final

        final = await unless_client_leaves(request, last())
        return JSONResponse(
            {**base, "object": objects[0], "choices": [whole(final)], "usage": usage_of(final)}
        )
    first_piece = True
    with_usage = include_usage(body)

    def events(chunk: Chunk) -> list[dict[str, Any]]:
        nonlocal first_piece
        observe(request, chunk)
        choice = piece(chunk, first_piece)
        first_piece = False
        out = [{**base, "object": objects[1], "choices": [choice]}] if choice is not None else []
        if chunk.done and with_usage:
            out.append({**base, "object": objects[1], "choices": [], "usage": usage_of(chunk)})
        return out

    first, rest = await unless_client_leaves(request, first_of(chunks))
    return sse_response(first, rest, sse_error, events)


B = TypeVar("B", wire.ChatCompletionRequest, wire.CompletionRequest, wire.OpenAIEmbeddingsRequest)


async def read_or_forward(request: Request, kind: type[B], route: str) -> tuple[B, Response | None]:
    """The body, checked; and for a remote model the answer: its upstream's bytes as they come, the
    request forwarded as the client wrote it (None for a local model, which the route answers)."""
    body = await schemas.read_body(request, kind)
    raw = json.loads(await request.body())  # as sent: every field, unknown ones too
    runtime = runtime_of(request)
    answer = await unless_client_leaves(
        request, runtime.forward(required_model(body.model), route, raw, keep_alive=body.keep_alive)
    )
    if answer is None:
        return body, None

    def tally() -> None:  # once the answer has passed: what /metrics counts of it
        observe(request, Chunk(model=answer.model, done=True, metrics=answer.metrics()))

    answer.ended = tally
    headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
    return body, StreamingResponse(answer.chunks, media_type=answer.media_type, headers=headers)


# ---- routes ------------------------------------------------------------------------------------
@router.post(
    "/chat/completions",
    openapi_extra=schemas.request_body(wire.ChatCompletionRequest),
    responses={200: schemas.ok(wire.ChatCompletion, SSE), **GENERATION_ERRORS},
)
async def chat_completions(request: Request) -> Response:
    body, passed = await read_or_forward(request, wire.ChatCompletionRequest, "chat/completions")
    if passed is not None:
        return passed
    model = required_model(body.model)
    messages = messages_from(body.messages)
    await fetch_message_images(body.messages, messages)  # image_url parts
    want_logprobs, top = logprob_flags(body.logprobs, body.top_logprobs)
    tools, left_out = function_tools(body.tools)
    chunks = runtime_of(request).chat(
        model,
        messages,
        tools=tools,
        tool_choice=tool_choice_of(body),
        parallel_tool_calls=body.parallel_tool_calls,
        think=effort_setting(body.reasoning_effort, "reasoning_effort"),
        **settings_of(body, want_logprobs, top),
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
            reason = finish_reason(chunk, called)
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": reason}
        if want_logprobs and chunk.logprobs:
            choice["logprobs"] = openai_logprobs(chunk.logprobs)
        return choice if delta or chunk.done else None

    response = await answer(
        request,
        chunks,
        body,
        f"chatcmpl-{uuid.uuid4().hex[:24]}",
        model,
        ("chat.completion", "chat.completion.chunk"),
        whole,
        piece,
    )
    return with_warnings(response, left_out)


@router.post(
    "/completions",
    openapi_extra=schemas.request_body(wire.CompletionRequest),
    responses={200: schemas.ok(wire.Completion, SSE), **GENERATION_ERRORS},
)
async def completions(request: Request) -> Response:
    body, passed = await read_or_forward(request, wire.CompletionRequest, "completions")
    if passed is not None:
        return passed
    model = required_model(body.model)
    prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    want_logprobs, top = logprob_flags(body.logprobs)
    # A completion continues the text as given: no chat template (raw), as OpenAI's API means it;
    # with a suffix it fills the middle, in the model's FIM prompt.
    chunks = runtime_of(request).generate(
        model, prompt, raw=not body.suffix, suffix=body.suffix, **settings_of(body, want_logprobs, top)
    )

    def logprobs_legacy(items: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if not want_logprobs or not items:
            return None
        return {
            "tokens": [lp.token for lp in items],
            "token_logprobs": [lp.logprob for lp in items],
            "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in items],
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
        body,
        f"cmpl-{uuid.uuid4().hex[:24]}",
        model,
        ("text_completion", "text_completion"),
        choice,
        lambda chunk, _first: choice(chunk) if chunk.content or chunk.done else None,
    )


@router.post(
    "/embeddings",
    openapi_extra=schemas.request_body(wire.OpenAIEmbeddingsRequest),
    responses={200: schemas.ok(wire.EmbeddingList), **GENERATION_ERRORS},
)
async def embeddings(request: Request) -> Any:
    body, passed = await read_or_forward(request, wire.OpenAIEmbeddingsRequest, "embeddings")
    if passed is not None:
        return passed
    model = required_model(body.model)
    inputs = [body.input] if isinstance(body.input, str) else body.input
    encoding = body.encoding_format or "float"
    result = await runtime_of(request).embed(model, inputs, keep_alive=body.keep_alive)
    dims = body.dimensions
    data = []
    for i, vector in enumerate(result.embeddings):
        if dims is not None and 0 < dims < len(vector):
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
    openapi_extra=schemas.request_body(wire.RerankRequest),
    responses={200: schemas.ok(wire.RerankResponse), **GENERATION_ERRORS},
)
async def rerank(request: Request) -> dict[str, Any]:
    """Jina / Cohere / llama-server rerank: the same handler as /api/rerank."""
    from localrt.api.ollama import rerank_response

    return await rerank_response(request)
