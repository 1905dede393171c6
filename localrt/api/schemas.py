"""The HTTP side of the wire model: the one gate every JSON body goes through, and /openapi.json.

Routes read the raw body themselves (`read_body`) so Ollama's and OpenAI's error shapes stay ours,
not the framework's 422; the typed models of `localrt.wire` that document a body check it, so a wrong
type is one 400 naming the field on every route, and the route hands on the checked model. The models
themselves live in `localrt.wire` (shared with the client); names not defined here resolve there.
"""

from __future__ import annotations

import json
from typing import Any
from typing import TypeVar

from fastapi import FastAPI
from fastapi import Request
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic import ValidationError
from pydantic.json_schema import models_json_schema

from localrt.errors import LocalrtError
from localrt.wire import OllamaError
from localrt.wire import OpenAIError
from localrt.wire import error_text

Body = TypeVar("Body", bound=BaseModel)


REF = "#/components/schemas/{model}"
# Models referenced from openapi_extra; FastAPI only emits components for models it validates itself.
_DOCUMENTED: dict[str, type[BaseModel]] = {}


class RequestBodyError(LocalrtError):
    """A body that is not a JSON object or has a field of the wrong type; `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _no_constant(name: str) -> Any:
    """NaN and Infinity are not JSON (Python's reader accepts them; Ollama's and OpenAI's do not)."""
    raise ValueError(name)


async def read_json(request: Request, model: type[BaseModel]) -> dict[str, Any]:
    """`read_body` as a dict: the fields the client sent and nothing added."""
    return (await read_body(request, model)).model_dump(by_alias=True, exclude_unset=True)


async def read_body(request: Request, model: type[Body]) -> Body:
    """The body (whatever its Content-Type, as Ollama reads it), checked once as `model`; integral
    numbers such as 5.0 become ints, as JSON Schema counts them."""
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
        return model.model_validate(data)
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


def ok(model: type[BaseModel], base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The 200 entry of `responses=`: `model` documents the application/json body."""
    return {**(base or {}), "model": model}
