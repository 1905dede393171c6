"""Schemathesis against the app's own /openapi.json, over a real `localrt serve` on 127.0.0.1.

Every operation is fuzzed with bodies that follow the documented schema (positive) and bodies that
break it (negative), through the whole stack: uvicorn, the security gate, the routes and the real
llama.cpp running a tiny random-weight model. Checks: never a 5xx (a 502 from /api/pull, whose
registry is a closed 127.0.0.1 port, is the one upstream failure allowed), status codes, content
types and bodies as documented, and schema-breaking input rejected with a 4xx. Deterministic:
a fixed seed and derandomized generation.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck
from hypothesis import settings
from schemathesis.config import SchemathesisConfig
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from localrt.api.app import create_app
from localrt.store.importer import import_gguf
from localrt.store.names import parse_name
from localrt.store.store import Store
from tests.gguf_factory import write_tiny_llama
from tests.servers.serve import LocalrtServer
from tests.servers.serve import free_port

MODEL = "tiny:latest"
THREADS = int(os.environ.get("LOCALRT_TEST_THREADS", "1"))
# Answers the fuzz asks for, at most: an open-ended one (num_predict -1, the default) would run to
# 10 x num_ctx on a model that never ends, and a schema check needs only a few tokens.
MAX_ANSWER = 32
ANSWER_LIMITS = ("num_predict", "max_tokens", "max_completion_tokens", "max_output_tokens")
# Operations that load the model: their positive cases are pointed at the fixture model so
# generation runs for real instead of stopping at "model not found".
USES_MODEL = (
    "/api/generate",
    "/api/chat",
    "/api/embed",
    "/api/embeddings",
    "/api/tokenize",
    "/api/detokenize",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/responses/input_tokens",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/api/rerank",  # the fixture model is no reranker: a valid body gets the 400 saying so
    "/v1/rerank",
)
# /api/pull and /api/push reach a registry: a closed local port, so the transfer starts and fails cleanly
REGISTRY = ("/api/pull", "/api/push")
STATEFUL = (
    *USES_MODEL,
    "/api/create",
    "/api/blobs/{digest}",
    *REGISTRY,
    "/v1/responses/{response_id}",
    "/v1/responses/{response_id}/input_items",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    root = tmp_path_factory.mktemp("api-schema")
    gguf = write_tiny_llama(root / "tiny.gguf", context_length=128)
    # the model's own num_predict bounds the answers of requests that leave it unset
    import_gguf(Store(root / "models"), MODEL, gguf, params={"num_predict": MAX_ANSWER})
    # Nothing listens there: every registry, Hub, index and proxy the server could use is a closed local
    # port, so no generated name can make it reach the network.
    dead = f"http://127.0.0.1:{free_port()}"
    offline = {
        "HF_ENDPOINT": dead,
        "PIP_INDEX_URL": dead + "/simple",
        "PIP_NO_INDEX": "1",
        "NO_PROXY": "",
        "no_proxy": "",
        **{
            k: dead
            for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
        },
    }
    srv = LocalrtServer(
        root / "models",
        root / "serve.log",
        env={"LOCALRT_KEEP_ALIVE": "10m", "LOCALRT_MAX_BODY": str(1 << 20), **offline},
    )
    srv.dead_registry = dead.removeprefix("http://")  # type: ignore[attr-defined]
    # the fixture model also under a name on that registry, so a push really starts (and fails cleanly)
    Store(root / "models").copy(parse_name(MODEL), parse_name(f"{srv.dead_registry}/library/tiny:latest"))
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)
    log = srv.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]
    assert "internal error" not in log, log[-4000:]


@pytest.fixture(scope="module")
def api_schema(server: LocalrtServer) -> Any:
    config = SchemathesisConfig.from_dict(
        {
            "seed": 20261129,
            "generation": {"deterministic": True, "mode": "all", "max-examples": 12, "no-shrink": True},
            "phases": {"stateful": {"enabled": False}},
            "request-timeout": 120,
        }
    )
    return schemathesis.openapi.from_url(server.url + "/openapi.json", config=config)


schema = schemathesis.pytest.from_fixture("api_schema")


def steer(case: Any, server: LocalrtServer) -> None:
    """Keep the run local and bounded without changing what makes a case positive or negative."""
    body = case.body
    if not isinstance(body, dict):
        return
    path = case.operation.path
    if path == "/api/delete" and body.get("model") == MODEL:
        body["model"] = "not-the-fixture"
    if case.meta is None or case.meta.generation.mode is not GenerationMode.POSITIVE:
        return
    if path == "/api/pull":
        # a valid name on the closed local registry: the pull really starts and fails cleanly
        body["model"] = f"{server.dead_registry}/library/fuzz:latest"  # type: ignore[attr-defined]
    if path == "/api/push":
        body["model"] = f"{server.dead_registry}/library/tiny:latest"  # type: ignore[attr-defined]
    if path in USES_MODEL:
        body["model"] = MODEL
    options = body.get("options")
    if isinstance(options, dict) and isinstance(options.get("num_thread"), int):
        options["num_thread"] = THREADS  # a thousand threads on a 2-core machine is valid, just slow
    for fields in (body, options):
        if isinstance(fields, dict):
            bound_answer(fields)


def bound_answer(fields: dict[str, Any]) -> None:
    """An answer length the fuzz picked (often its schema's largest, or -1: open-ended) cut to
    MAX_ANSWER: still valid, and the run stays short."""
    for name in ANSWER_LIMITS:
        value = fields.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and (value < 0 or value > MAX_ANSWER):
            fields[name] = MAX_ANSWER


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_openapi_schema(case: Any, server: LocalrtServer) -> None:
    steer(case, server)
    response = case.call(timeout=120)
    path = case.operation.path
    if path in REGISTRY and response.status_code == 502:
        assert "127.0.0.1" in response.json()["error"]  # the unreachable registry, reported cleanly
        return
    if (
        response.status_code == 501
    ):  # a backend this build lacks, asked for by name (localrt/client.py maps 501)
        assert "is not available" in str(response.json()["error"])
        return
    # Whether a schema-valid body is accepted here depends on more than its shape (the model, uploaded
    # blobs, stored models, what fits the context): these may answer a clear 4xx to a valid body.
    excluded = [positive_data_acceptance] if path in STATEFUL else []
    case.validate_response(response, excluded_checks=excluded)
    assert server.proc.poll() is None  # still serving (the log is checked for tracebacks at the end)


def test_every_json_route_documents_its_body(tmp_path: Path) -> None:
    """In-process: the schema the run above fuzzes has a body model per JSON route and no framework 422."""
    doc = create_app(store=Store(tmp_path)).openapi()
    operation_ids = []
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            operation_ids.append(operation["operationId"])
            assert "422" not in operation["responses"], (method, path)
            # DELETE /v1/responses/{id} names what it deletes in the path, as OpenAI's does
            bodiless = path.startswith("/api/blobs") or path == "/v1/responses/{response_id}"
            if method in ("post", "delete") and not bodiless:
                ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                body = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
                assert body["type"] == "object", (method, path)
                assert body["properties"], (method, path)
                assert "model" in body.get("required", []) or path == "/api/copy", (method, path)
    assert len(operation_ids) == len(set(operation_ids))
    options = doc["components"]["schemas"]["GenerateRequest"]["properties"]["options"]["anyOf"][0]
    num_ctx = options["properties"]["num_ctx"]["anyOf"]
    assert num_ctx[0]["minimum"] == 1
    assert num_ctx[1] == {"type": "null"}  # null means not set
    assert options["additionalProperties"] is False
