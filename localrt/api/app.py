"""The FastAPI application: security gate, error shapes, and the Ollama, OpenAI and Anthropic routers."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from localrt import __version__
from localrt import config
from localrt.api.drain import Drain
from localrt.api.drain import DrainMiddleware
from localrt.api.metrics import Metrics as ServerMetrics
from localrt.api.metrics import RequestCounter
from localrt.api.schemas import error_text
from localrt.api.schemas import openapi_schema
from localrt.api.security import SecurityMiddleware
from localrt.api.security import error_body
from localrt.api.security import error_style
from localrt.errors import LocalrtError
from localrt.runtime.tenants import TenantScope
from localrt.store.store import Store

log = logging.getLogger("localrt.api")


def is_openai_path(request: Request) -> bool:
    return error_style(request.url.path) == "openai"


def error_response(request: Request, status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(message, status, error_style(request.url.path)), status_code=status)


def create_app(
    *,
    store: Store | None = None,
    runtime: Any = None,
    bind_host: str = "127.0.0.1",
    api_key: str | None = None,
    max_body: int | None = None,
) -> FastAPI:
    """Build the app; `runtime` is the shared `Runtime` (made lazily when None)."""
    app = FastAPI(
        title="localrt",
        version=__version__,
        description="Ollama-, OpenAI- and Anthropic-compatible local LLM API",
    )
    app.state.store = store or Store()
    app.state.runtime = runtime
    app.state.metrics = ServerMetrics()

    @app.exception_handler(LocalrtError)
    async def on_localrt_error(request: Request, exc: LocalrtError) -> JSONResponse:
        response = error_response(request, exc.status, str(exc))
        param = getattr(exc, "param", None)
        if param and is_openai_path(request):
            body = error_body(str(exc), exc.status, True)
            body["error"]["param"] = param
            response = JSONResponse(body, status_code=exc.status)
        return response

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request, 400, error_text(list(exc.errors()))[0])

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
        response = error_response(request, exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})  # e.g. the Allow list of a 405, which RFC 9110 requires
        return response

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return error_response(request, 500, f"internal error: {type(exc).__name__}")

    from localrt.api import anthropic
    from localrt.api import ollama
    from localrt.api import openai
    from localrt.api import responses
    from localrt.api import web

    app.state.responses = responses.ResponseStore()
    app.include_router(ollama.router)
    app.include_router(openai.router)
    app.include_router(responses.router)
    app.include_router(anthropic.router)
    app.state.ui = config.ui_enabled()
    if app.state.ui:
        app.include_router(web.router)
    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]
    app.add_middleware(TenantScope)  # whose cache hits a reply may report (runtime/tenants.py)
    app.add_middleware(RequestCounter, metrics=app.state.metrics)
    app.add_middleware(
        SecurityMiddleware,
        bind_host=bind_host,
        api_key=api_key if api_key is not None else config.api_key(),
        max_body=max_body or config.env_int("LOCALRT_MAX_BODY"),
    )
    # outermost: a stopping server refuses every request, and knows each one in flight (api/drain.py)
    app.state.drain = Drain(config.shutdown_grace())
    app.add_middleware(DrainMiddleware, drain=app.state.drain)
    return app
