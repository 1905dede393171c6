"""The wire formats as /openapi.json documents them, and the one gate every JSON body goes through.

Routes read the raw body themselves (`read_json`) so Ollama's and OpenAI's error shapes stay ours,
not the framework's 422; the same pydantic models that document a body check its field types first,
so a wrong type is one 400 naming the field on every route. Option values are documented from the
runtime's own ranges (`localrt.runtime.options`) but checked by the runtime, which names the option.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema
from pydantic.json_schema import models_json_schema

from localrt.errors import LocalrtError
from localrt.runtime.bridge import KV_CACHE_TYPES, SPECULATIVE_MODES
from localrt.runtime.options import (
    _RANGES,
    BACKEND_ALIASES,
    BACKEND_NAMES,
    IGNORED_OPTIONS,
    KV_ALIASES,
    MAX_GRAMMAR_LENGTH,
    MAX_NUM_CTX,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
)
from localrt.store import names

REF = "#/components/schemas/{model}"
# Models referenced from openapi_extra; FastAPI only emits components for models it validates itself.
_DOCUMENTED: dict[str, type[BaseModel]] = {}


class RequestBodyError(LocalrtError):
    """A body that is not a JSON object or has a field of the wrong type; `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def error_text(errors: list[Any]) -> tuple[str, str | None]:
    """pydantic/FastAPI error list to one line, and the first field it names (OpenAI's `param`)."""
    parts, first = [], None
    for err in errors:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "json_invalid" or (err.get("type") == "missing" and not loc):
            return (
                "invalid JSON in request body"
                if err.get("type") == "json_invalid"
                else "missing request body"
            ), None
        first = first or loc or None
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts[:3]) or "invalid request", first


def _no_constant(name: str) -> Any:
    """NaN and Infinity are not JSON (Python's reader accepts them; Ollama's and OpenAI's do not)."""
    raise ValueError(name)


async def read_json(request: Request, model: type[BaseModel]) -> dict[str, Any]:
    """The body (whatever its Content-Type, as Ollama reads it), type-checked, with the fields the client
    sent and nothing added; integral numbers such as 5.0 become ints, as JSON Schema counts them."""
    raw = await request.body()
    if not raw.strip():
        raise RequestBodyError("missing request body")
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        raise RequestBodyError("invalid JSON in request body") from None
    if not isinstance(data, dict):
        raise RequestBodyError("request body must be a JSON object")
    try:
        return model.model_validate(data).model_dump(by_alias=True, exclude_unset=True)
    except ValidationError as e:
        message, param = error_text(e.errors(include_url=False))
        raise RequestBodyError(message, param) from None
    except RecursionError:
        raise RequestBodyError("request body is nested too deeply") from None


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` documenting `model` as the route's JSON body."""
    _DOCUMENTED[model.__name__] = model
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}},
        }
    }


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the request-body components, without the 422 we never send."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        _, defs = models_json_schema([(m, "validation") for m in _DOCUMENTED.values()], ref_template=REF)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(defs.get("$defs", {}))
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        for operations in schema.get("paths", {}).values():
            for method, operation in operations.items():
                responses = operation.get("responses", {})
                responses.pop("422", None)
                if method == "head":  # a HEAD answer has headers only
                    for response in responses.values():
                        response.pop("content", None)
        app.openapi_schema = schema
    return app.openapi_schema


# ---- options (documented from the runtime's table, checked by the runtime) --------------------
def option_schema(name: str) -> dict[str, Any]:
    if name in _RANGES:
        kind, lo, hi = _RANGES[name]
        out: dict[str, Any] = {"type": "integer" if kind is int else "number"}
        if lo is not None:
            out["minimum"] = lo
        if hi is not None:
            out["maximum"] = hi
        return {"anyOf": [out, {"type": "null"}]}  # null: not set
    spec = {
        "stop": {
            "anyOf": [
                {"type": "string", "maxLength": MAX_STOP_LENGTH},
                {
                    "type": "array",
                    "maxItems": MAX_STOP_STRINGS,
                    "items": {"type": "string", "maxLength": MAX_STOP_LENGTH},
                },
            ]
        },
        "backend": {"type": "string", "enum": [*BACKEND_NAMES, *BACKEND_ALIASES]},
        "kv_cache_type": {"type": "string", "enum": [*KV_CACHE_TYPES, *KV_ALIASES]},
        "speculative": {"type": "string", "enum": list(SPECULATIVE_MODES)},
        "draft_model": {"type": "string"},
        "flash_attn": {"type": "boolean"},
        "grammar": {"type": "string", "maxLength": MAX_GRAMMAR_LENGTH, "pattern": "root"},
    }[name]
    return {"anyOf": [spec, {"type": "null"}]}


OPTION_KEYS = (
    *_RANGES,
    "stop",
    "backend",
    "kv_cache_type",
    "speculative",
    "draft_model",
    "flash_attn",
    "grammar",
)
OPTIONS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "description": "Ollama's options plus localrt's; unknown names are a 400. Ignored for compatibility: "
    + ", ".join(sorted(IGNORED_OPTIONS)),
    "properties": {**{k: option_schema(k) for k in OPTION_KEYS}, **{k: {} for k in sorted(IGNORED_OPTIONS)}},
}
OptionsField = Annotated[dict[str, Any] | None, WithJsonSchema({"anyOf": [OPTIONS_SCHEMA, {"type": "null"}]})]


def option_field(name: str) -> Any:
    """An OpenAI top-level option: documented as the runtime's option, validated there."""
    return Annotated[Any, WithJsonSchema({"anyOf": [option_schema(name), {"type": "null"}]})]


# ---- shared pieces ---------------------------------------------------------------------------
class Wire(BaseModel):
    """Strict types (a bool is not a number, a number is not a string); unknown fields pass, as in Ollama."""

    model_config = ConfigDict(extra="allow", strict=True)


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# An integer as JSON Schema means it: 3 and 3.0 both are; true is not.
Int = Annotated[int, BeforeValidator(_integral)]


# localrt.store.names as one regular expression, so generated names are the ones the store accepts:
# [host[:port]/][namespace/]model[:tag][@sha256:<hex>], no "..", and "hf.co/x" alone is not a model.
def _bare(pattern: re.Pattern[str]) -> str:
    return pattern.pattern.removeprefix("^").removesuffix("$")


_HF = r"(?:[hH][fF]|[hH][uU][gG][gG][iI][nN][gG][fF][aA][cC][eE])\.[cC][oO]"  # no inline flags in ECMA regex
DIGEST_PATTERN = names.DIGEST_RE.pattern
NAME_PATTERN = (
    rf"^(?!.*\.\.)(?!{_HF}/[^/]*$)(?:(?:{_bare(names._HOST)}/)?{_bare(names._NAMESPACE)}/)?"
    rf"{_bare(names._MODEL)}(?::{_bare(names._TAG)})?(?:@{_bare(names.DIGEST_RE)})?$"
)
NAME_SCHEMA = {
    "type": "string",
    "pattern": NAME_PATTERN,
    "maxLength": 600,
    "description": "model name, e.g. smollm2:135m",
}
ModelName = Annotated[str, WithJsonSchema(NAME_SCHEMA)]
KeepAlive = Annotated[
    str | float | None, Field(description='duration ("5m", "1h", "-1") or seconds; 0 unloads')
]
Format = Annotated[
    Literal["", "json"] | dict[str, Any] | None,
    Field(description='"json" or a JSON schema the output must follow'),
]
TopLogprobs = Annotated[Int | None, Field(ge=0, le=20)]
ThinkValue = Annotated[
    bool | Literal["low", "medium", "high", "max"] | None,
    Field(description="think before answering: true/false or a level (a model that cannot think: 400)"),
]


class Message(Wire):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


# ---- Ollama requests -------------------------------------------------------------------------
def _model_required(schema: dict[str, Any]) -> None:
    schema["required"] = ["model", *[k for k in schema.get("required", []) if k != "model"]]


class Named(Wire):
    """`model` is documented as required, but older Ollama clients send `name`: the route checks that
    one of them is there (and a valid name) itself."""

    model_config = ConfigDict(json_schema_extra=_model_required)
    model: Annotated[str | None, WithJsonSchema(NAME_SCHEMA)] = None


class ModelRequest(Named):
    pass


class CopyRequest(Wire):
    source: ModelName
    destination: ModelName


class PullRequest(Named):
    insecure: bool | None = None
    stream: bool | None = None


class PushRequest(Named):
    insecure: bool | None = None
    stream: bool | None = None


class CreateRequest(Named):
    # `from` is a Python keyword; the wire name is kept through the alias
    from_: Annotated[str | None, WithJsonSchema({"anyOf": [NAME_SCHEMA, {"type": "null"}]})] = Field(
        None, alias="from", description="a stored model to build on"
    )
    files: Annotated[
        dict[str, str] | None,
        WithJsonSchema(
            {
                "anyOf": [
                    {
                        "type": "object",
                        "minProperties": 1,
                        "maxProperties": 2,  # a vision model: its GGUF and its projector GGUF
                        "propertyNames": {"pattern": r"\.gguf$"},
                        "additionalProperties": {"type": "string", "pattern": DIGEST_PATTERN},
                    },
                    {"type": "null"},
                ]
            }
        ),
    ] = Field(None, description="file name -> sha256 digest of an uploaded blob (POST /api/blobs first)")
    quantize: str | None = None
    template: str | None = None
    system: str | None = None
    license: str | list[str] | None = None
    parameters: dict[str, Any] | None = None
    messages: list[Message] | None = None
    stream: bool | None = None
    # a remote model (SPEC 8): OpenAI-compatible endpoint URLs instead of weights
    remote: str | list[str] | None = Field(None, description="endpoint URL(s), e.g. https://host:8000/v1")
    remote_model: str | None = Field(None, description="the upstream's model id")
    api_key_env: str | None = Field(
        None, description="name of the server's environment variable with the key"
    )
    insecure: bool | None = Field(None, description="allow plain http to a non-loopback endpoint")


class _Generation(Named):
    """What generate and chat share."""

    format: Format = None
    options: OptionsField = None
    keep_alive: KeepAlive = None
    stream: bool | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs = None
    think: ThinkValue = None
    truncate: bool | None = None  # drop the oldest turns when the prompt exceeds num_ctx (default true)
    shift: bool | None = None  # shift the context when generation reaches its end (default true)


class GenerateRequest(_Generation):
    prompt: str | None = None
    images: list[str] | None = None
    system: str | None = None
    raw: bool | None = None
    context: list[Int] | None = None


class ChatRequest(_Generation):
    messages: list[Message] | None = None
    tools: list[dict[str, Any]] | None = None


class EmbedRequest(Named):
    input: str | list[str] | None = None
    truncate: bool | None = None
    options: OptionsField = None
    keep_alive: KeepAlive = None


class EmbeddingsRequest(Named):
    prompt: str | None = None
    options: OptionsField = None
    keep_alive: KeepAlive = None


class TokenizeRequest(Named):
    text: str | None = None
    add_special: bool | None = None
    parse_special: bool | None = None


class DetokenizeRequest(Named):
    tokens: list[Int]


class RerankRequest(Named):
    query: str
    documents: list[str]
    top_n: Annotated[Int | None, Field(ge=0)] = None
    return_documents: bool | None = None
    options: OptionsField = None
    keep_alive: KeepAlive = None


# ---- OpenAI requests -------------------------------------------------------------------------
class ContentPart(Wire):
    type: Literal["text"]
    text: str


class ImageURL(Wire):
    url: Annotated[str, Field(description="a base64 data URL; http(s) only with LOCALRT_FETCH_IMAGES=1")]
    detail: str | None = None


class ImagePart(Wire):
    type: Literal["image_url"]
    image_url: ImageURL


class OpenAIMessage(Wire):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart | ImagePart] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(Wire):
    include_usage: bool | None = None


class TextFormat(Wire):
    type: Literal["text"]


class JsonObjectFormat(Wire):
    type: Literal["json_object"]


class JsonSchemaSpec(Wire):
    name: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(Wire):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class OpenAISampling(Wire):
    """Top-level options (the openai client's `extra_body` lands here too)."""

    temperature: option_field("temperature") = None
    top_p: option_field("top_p") = None
    seed: option_field("seed") = None
    frequency_penalty: option_field("frequency_penalty") = None
    presence_penalty: option_field("presence_penalty") = None
    max_tokens: Annotated[Int | None, Field(ge=0, le=10 * MAX_NUM_CTX)] = None
    max_completion_tokens: Annotated[Int | None, Field(ge=0, le=10 * MAX_NUM_CTX)] = None
    stop: option_field("stop") = None
    n: Annotated[Int | None, Field(ge=1, le=1, description="only 1 is supported")] = None
    top_k: option_field("top_k") = None
    min_p: option_field("min_p") = None
    repeat_penalty: option_field("repeat_penalty") = None
    num_ctx: option_field("num_ctx") = None
    grammar: option_field("grammar") = None
    backend: option_field("backend") = None
    speculative: option_field("speculative") = None
    options: OptionsField = None
    keep_alive: KeepAlive = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None


class NamedFunction(Wire):
    name: str


class NamedToolChoice(Wire):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ChatCompletionRequest(OpenAISampling):
    model: ModelName
    messages: Annotated[list[OpenAIMessage], Field(min_length=1)]
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: ReasoningEffort | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs = None


class CompletionRequest(OpenAISampling):
    model: ModelName
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    logprobs: Annotated[Int | None, Field(ge=0, le=20)] = None
    response_format: ResponseFormat | None = None


class OpenAIEmbeddingsRequest(Wire):
    model: ModelName
    input: str | Annotated[list[str], Field(min_length=1)]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[Int | None, Field(ge=1)] = None
    keep_alive: KeepAlive = None


# ---- responses (documentation only: FastAPI does not filter what the routes return) ------------
class OllamaError(BaseModel):
    error: str


class OpenAIErrorObject(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(BaseModel):
    error: OpenAIErrorObject


STREAMED = {
    "description": 'one JSON object with `"stream": false`, else NDJSON lines',
    "content": {"application/json": {}, "application/x-ndjson": {"schema": {"type": "string"}}},
}
SSE = {
    "description": 'one JSON object, or server-sent events with `"stream": true`',
    "content": {
        "application/json": {},
        "text/event-stream": {
            "schema": {
                "type": "object",
                "required": ["data"],
                "properties": {"data": {"type": "string", "description": "a JSON chunk, or [DONE] to end"}},
            }
        },
    },
}


def error_responses(openai: bool, *statuses: int) -> dict[int | str, dict[str, Any]]:
    """Every error a route can answer: its own, plus the security gate's 401/403/413 and a busy 503."""
    model = OpenAIError if openai else OllamaError
    codes = sorted({400, 401, 403, 413, *statuses})
    return {code: {"model": model, "description": _REASONS.get(code, "error")} for code in codes}


_REASONS = {
    400: "bad request",
    401: "API key required",
    403: "Host or Origin not allowed",
    404: "model not found",
    413: "request body too large",
    499: "client closed the request",
    501: "backend not available here",
    502: "registry unreachable or failed",
    503: "server busy (queue full)",
}


# ---- 200 bodies (documentation only; the fields every client relies on, more may follow) ---------
class Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class VersionResponse(Out):
    version: str


class ModelDetails(Out):
    format: str
    family: str
    families: list[str] | None = None
    parameter_size: str
    quantization_level: str


class TagModel(Out):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails


class TagsResponse(Out):
    models: list[TagModel]


class ShowResponse(Out):
    license: str
    modelfile: str
    parameters: str
    template: str
    system: str
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    template_origin: str = ""  # ours: the Modelfile's, the file's, or a built-in family template


class RunningModel(Out):
    name: str
    model: str
    size: int
    digest: str
    expires_at: str
    size_vram: int
    context_length: int


class PsResponse(Out):
    models: list[RunningModel]


class Timings(Out):
    done: bool
    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class GenerateResponse(Timings):
    model: str
    created_at: str
    response: str
    thinking: str | None = None
    context: list[int] | None = None


class ChatMessageOut(Out):
    role: Literal["assistant"]
    content: str
    thinking: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatResponse(Timings):
    model: str
    created_at: str
    message: ChatMessageOut


class EmbedResponse(Out):
    model: str
    embeddings: list[list[float]]
    prompt_eval_count: int


class RerankDocument(Out):
    text: str


class RerankResult(Out):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(Out):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(Out):
    model: str
    object: Literal["list"]
    results: list[RerankResult]
    usage: RerankUsage


class EmbeddingsResponse(Out):
    embedding: list[float]


class TokenizeResponse(Out):
    model: str
    tokens: list[int]


class DetokenizeResponse(Out):
    model: str
    text: str


class ModelObject(Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(Out):
    object: Literal["list"]
    data: list[ModelObject]


class Usage(Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None  # cached_tokens: prompt tokens the KV cache held


class CompletionMessage(Out):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(Out):
    index: int
    message: CompletionMessage
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(Out):
    index: int
    text: str
    finish_reason: Literal["stop", "length", "tool_calls"]


class Completion(Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class EmbeddingObject(Out):
    object: Literal["embedding"]
    embedding: list[float] | str  # str: base64 of little-endian float32
    index: int


class EmbeddingUsage(Out):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(Out):
    object: Literal["list"]
    data: list[EmbeddingObject]
    model: str
    usage: EmbeddingUsage


def ok(model: type[BaseModel], base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The 200 entry of `responses=`: `model` documents the application/json body."""
    return {**(base or {}), "model": model}
