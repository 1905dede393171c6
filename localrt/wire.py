"""The wire model: the typed requests and answers of the HTTP API (Ollama's and OpenAI's shapes), shared
by the server's routes (`localrt.api`) and the client that talks to a server (`localrt.client`).

A body is checked here once, field by field (types, ranges, names); the route hands the runtime what the
model holds and the runtime checks only what needs the model or the store. Option values are documented
from the runtime's own ranges (`localrt.runtime.options`) and checked by the runtime, which names the
option. Free of FastAPI, so the client can build its requests from these models and parse answers into them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated
from typing import Any
from typing import Literal
from typing import TypeVar

from pydantic import BaseModel
from pydantic import BeforeValidator
from pydantic import ConfigDict
from pydantic import Field
from pydantic import ValidationError
from pydantic import WithJsonSchema

from localrt.errors import LocalrtError
from localrt.runtime.answers import Metrics
from localrt.runtime.answers import TokenLogprob
from localrt.runtime.options import _RANGES
from localrt.runtime.options import BACKEND_ALIASES
from localrt.runtime.options import BACKEND_NAMES
from localrt.runtime.options import IGNORED_OPTIONS
from localrt.runtime.options import KV_ALIASES
from localrt.runtime.options import KV_CACHE_TYPES
from localrt.runtime.options import MAX_GRAMMAR_LENGTH
from localrt.runtime.options import MAX_NUM_CTX
from localrt.runtime.options import MAX_STOP_LENGTH
from localrt.runtime.options import MAX_STOP_STRINGS
from localrt.runtime.options import NUMERICS
from localrt.runtime.options import SPECULATIVE_MODES
from localrt.store import names

M = TypeVar("M", bound=BaseModel)


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
        "numerics": {"type": "string", "enum": list(NUMERICS)},
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
    "numerics",
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


class LoraScale(Wire):
    """One LoRA adapter's scale for a request, as llama-server's per-request `lora` entries."""

    id: Annotated[Int, Field(description="the adapter's index in the model's ADAPTER order, from 0")]
    scale: Annotated[float, Field(allow_inf_nan=False, description="its scale (1.0: as trained, 0: off)")]


LoraList = Annotated[
    list[LoraScale] | None,
    Field(
        description="LoRA adapter scales for this request (llama.cpp backend): adapters not listed are off; "
        "absent or empty: every adapter at 1.0"
    ),
]


def lora_setting(entries: list[LoraScale] | None) -> list[dict[str, Any]] | None:
    """The runtime's `lora` setting (`localrt.runtime.lora`) from the wire's entries."""
    return None if entries is None else [{"id": e.id, "scale": e.scale} for e in entries]


class Message(Wire):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class NamedFunction(Wire):
    name: str


class NamedToolChoice(Wire):
    type: Literal["function"]
    function: NamedFunction


# ---- Ollama requests -------------------------------------------------------------------------
def _model_required(schema: dict[str, Any]) -> None:
    schema["required"] = ["model", *[k for k in schema.get("required", []) if k != "model"]]


class Named(Wire):
    """`model` is documented as required, but older Ollama clients send `name`: `required_name` checks
    that one of them is there (the store checks that it is a valid name)."""

    model_config = ConfigDict(json_schema_extra=_model_required)
    model: Annotated[str | None, WithJsonSchema(NAME_SCHEMA)] = None

    def required_name(self) -> str:
        value = self.model or (self.model_extra or {}).get("name")
        if not isinstance(value, str) or not value:
            raise LocalrtError("model is required")
        return value


class ModelRequest(Named):
    pass


class ShowRequest(Named):
    options: OptionsField = None  # Ollama's: the options a load would use (ours: `backend` reads them)


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
                        "propertyNames": {"pattern": r"\.gguf$"},
                        "additionalProperties": {"type": "string", "pattern": DIGEST_PATTERN},
                    },
                    {"type": "null"},
                ]
            }
        ),
    ] = Field(
        None,
        description="file name -> sha256 digest of an uploaded blob (POST /api/blobs first): one GGUF, or "
        "the parts of a split GGUF (name-0000i-of-0000N.gguf), and a vision model's projector GGUF",
    )
    quantize: str | None = None
    template: str | None = None
    system: str | None = None
    license: str | list[str] | None = None
    parameters: dict[str, Any] | None = None
    messages: list[Message] | None = Field(None, description="few-shot turns every prompt starts with")
    requires: str | None = Field(None, description="the oldest localrt version that runs the model")
    renderer: str | None = Field(None, description="one of Ollama's built-in prompt renderers")
    parser: str | None = Field(None, description="one of Ollama's built-in reply parsers")
    stream: bool | None = None
    # a remote model: OpenAI-compatible endpoint URLs instead of weights
    remote: str | list[str] | None = Field(None, description="endpoint URL(s), e.g. https://host:8000/v1")
    remote_model: str | None = Field(None, description="the upstream's model id")
    api_key_env: str | None = Field(
        None, description="name of the server's environment variable with the key"
    )
    insecure: bool | None = Field(None, description="allow plain http to a non-loopback endpoint")
    # a Modelfile's DRAFT line: speculative decoding's draft model, stored beside the weights
    draft: str | None = Field(
        None, description="a stored model, or the sha256 digest of an uploaded GGUF blob (POST /api/blobs)"
    )
    imatrix: str | None = Field(
        None, description="sha256 digest of an uploaded importance matrix weighting `quantize`"
    )
    adapters: Annotated[
        dict[str, str] | None,
        WithJsonSchema(
            {
                "anyOf": [
                    {"type": "object", "additionalProperties": {"type": "string", "pattern": DIGEST_PATTERN}},
                    {"type": "null"},
                ]
            }
        ),
    ] = Field(
        None,
        description="file name -> sha256 digest of an uploaded LoRA adapter GGUF (POST /api/blobs first), "
        "applied in order; the llama.cpp backend runs them",
    )


# Sampling fields /api/chat and /api/generate also take at top level, where OpenAI-style clients put them
# (the Vercel AI SDK's Ollama provider): localrt's addition to Ollama's API, which ignores them. The same
# key in `options` wins; max_tokens and max_output_tokens are `num_predict`.
TOP_LEVEL_OPTIONS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "frequency_penalty",
    "presence_penalty",
)
TOP_LEVEL_LIMITS = ("max_output_tokens", "max_tokens")


class FlatToolChoice(Wire):
    """A named tool as the Responses API (and the Vercel AI SDK's Ollama provider) spells it."""

    type: Literal["function"]
    name: str


class Generation(Named):
    """What generate and chat share."""

    format: Format = None
    options: OptionsField = None
    temperature: option_field("temperature") = None
    top_p: option_field("top_p") = None
    top_k: option_field("top_k") = None
    min_p: option_field("min_p") = None
    seed: option_field("seed") = None
    stop: option_field("stop") = None
    frequency_penalty: option_field("frequency_penalty") = None
    presence_penalty: option_field("presence_penalty") = None
    max_output_tokens: option_field("num_predict") = None
    max_tokens: option_field("num_predict") = None
    tool_choice: Annotated[
        Literal["none", "auto", "required"] | NamedToolChoice | FlatToolChoice | None,
        Field(description="none, auto, required, or the function to call (a forced call is a grammar)"),
    ] = None
    keep_alive: KeepAlive = None
    stream: bool | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs = None
    think: ThinkValue = None
    truncate: bool | None = None  # drop the oldest turns when the prompt exceeds num_ctx (default true)
    shift: bool | None = None  # shift the context when generation reaches its end (default true)
    lora: LoraList = None


def top_level_options(body: Generation) -> dict[str, Any] | None:
    """`options` with the top-level sampling fields added where `options` does not set them (a null
    option is not set), in the runtime's names; None when neither is there."""
    options = dict(body.options or {})
    for key in TOP_LEVEL_OPTIONS:
        if getattr(body, key) is not None and options.get(key) is None:
            value = getattr(body, key)
            options[key] = [value] if key == "stop" and isinstance(value, str) else value
    limit = next((getattr(body, k) for k in TOP_LEVEL_LIMITS if getattr(body, k) is not None), None)
    if limit is not None and options.get("num_predict") is None:
        options["num_predict"] = limit
    return options or body.options


def tool_choice_setting(choice: Any) -> Any:
    """The runtime's `tool_choice` (OpenAI chat's form, which also reads the flat `{"type", "name"}`)."""
    return choice.model_dump() if isinstance(choice, BaseModel) else choice


class GenerateRequest(Generation):
    prompt: str | None = None
    suffix: str | None = Field(None, description="the text after the completion (fill-in-the-middle)")
    images: list[str] | None = None
    system: str | None = None
    raw: bool | None = None
    context: list[Int] | None = None


class ChatRequest(Generation):
    messages: list[Message] | None = None
    tools: list[dict[str, Any]] | None = None


class EmbedRequest(Named):
    input: str | list[str] | None = None
    truncate: bool | None = None
    dimensions: Annotated[
        Int | None, Field(ge=0, description="keep the first N dimensions, normalized again (0: all)")
    ] = None
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
    lora: LoraList = None


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
    suffix: str | None = Field(None, description="the text after the completion (fill-in-the-middle)")
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
    projector_info: dict[str, Any] | None = None  # ours: a vision model's projector GGUF header
    messages: list[dict[str, Any]] | None = None  # the Modelfile's MESSAGE turns
    renderer: str | None = None
    parser: str | None = None
    requires: str | None = None
    remote: dict[str, Any] | None = None  # ours: a remote model's upstream id and endpoints' health
    backend: str = ""  # ours: the backend a load of this local model would use here, with the options


class RunningModel(Out):
    name: str
    model: str
    size: int
    digest: str
    expires_at: str
    size_vram: int
    context_length: int
    details: dict[str, Any] | None = None
    backend: str | None = None  # ours: the backend it runs on
    processor: str | None = None  # ours: "100% CPU" as `ps` prints it


class ProgressResponse(Out):
    """One line of a pull, push or create stream."""

    status: str
    digest: str | None = None
    total: int | None = None
    completed: int | None = None


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


# ---- translations shared by the routes and the client -------------------------------------------
# the runtime's Metrics field -> its name on Ollama's wire (the draft counts are ours, sent only when
# speculating)
METRICS_WIRE: dict[str, str] = {
    "total_ns": "total_duration",
    "load_ns": "load_duration",
    "prompt_eval_count": "prompt_eval_count",
    "prompt_eval_ns": "prompt_eval_duration",
    "eval_count": "eval_count",
    "eval_ns": "eval_duration",
    "draft_count": "draft_count",
    "draft_accepted_count": "draft_accepted_count",
}


def logprobs_to_wire(items: list[TokenLogprob]) -> list[dict[str, Any]]:
    """Token log-probabilities as Ollama's `logprobs` and OpenAI's `logprobs.content` both write them
    (the same fields: token, logprob, its UTF-8 bytes, the alternatives)."""
    return [
        {
            "token": lp.token,
            "logprob": lp.logprob,
            "bytes": list(lp.token.encode("utf-8")),
            "top_logprobs": [
                {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode("utf-8"))}
                for t in lp.top
            ],
        }
        for lp in items
    ]


def metrics_to_ollama(m: Metrics | None) -> dict[str, int]:
    """The final chunk's numbers under Ollama's names (nothing for a chunk without metrics)."""
    if m is None:
        return {}
    out = {wire: getattr(m, name) for name, wire in METRICS_WIRE.items()}
    if not m.draft_count:
        del out["draft_count"], out["draft_accepted_count"]
    return out


def metrics_from_ollama(item: Mapping[str, Any]) -> Metrics:
    return Metrics(**{name: int(item.get(wire) or 0) for name, wire in METRICS_WIRE.items()})


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


def build(kind: type[M], /, **fields: Any) -> M:
    """A request as a client builds it: checked by the same model the server checks it with, so a bad
    value is one LocalrtError here instead of a round trip (None means: not sent)."""
    try:
        return kind.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        raise LocalrtError(error_text(e.errors(include_url=False))[0]) from None


def parse(model: type[M], item: Any) -> M:
    """An answer read into its model; a server that answers otherwise is one LocalrtError."""
    try:
        return model.model_validate(item)
    except ValidationError as e:
        message = error_text(e.errors(include_url=False))[0]
        raise LocalrtError(f"unexpected answer from the server ({model.__name__}: {message})") from None


def body_of(request: BaseModel) -> dict[str, Any]:
    """The JSON body of a request model: wire names, only the fields that were set."""
    return request.model_dump(by_alias=True, exclude_unset=True)
