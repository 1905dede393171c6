"""The security defaults against a real `localrt serve`: Host and Origin checks, API key, body cap, clean errors."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from localrt.store.importer import import_gguf
from localrt.store.store import Store
from tests.gguf_factory import write_tiny_llama
from tests.servers.serve import LocalrtServer

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    root = tmp_path_factory.mktemp("api-security")
    srv = LocalrtServer(
        root / "models",
        root / "serve.log",
        env={"LOCALRT_ORIGINS": "https://trusted.example", "LOCALRT_MAX_BODY": "65536"},
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    root = tmp_path_factory.mktemp("api-key")
    srv = LocalrtServer(root / "models", root / "serve.log", env={"LOCALRT_API_KEY": KEY})
    yield srv
    srv.stop()


@pytest.mark.parametrize("host", ["evil.example", "attacker.com:11434", "1.2.3.4"])
def test_foreign_host_header_is_refused(server: LocalrtServer, host: str) -> None:
    r = httpx.get(server.url + "/api/tags", headers={"Host": host})
    assert r.status_code == 403
    assert "Host" in r.json()["error"]


@pytest.mark.parametrize("host", ["localhost:11434", "127.0.0.1", "[::1]:8080", "myapp.localhost"])
def test_local_host_headers_pass(server: LocalrtServer, host: str) -> None:
    assert httpx.get(server.url + "/api/tags", headers={"Host": host}).status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "192.168.1.7:11434", "10.0.0.1", "printer.local"])
def test_private_addresses_and_names_are_not_this_machine(server: LocalrtServer, host: str) -> None:
    """A rebinding name may point at a LAN address as well as at loopback: only this machine's own
    names and addresses pass, not every private one."""
    assert httpx.get(server.url + "/api/tags", headers={"Host": host}).status_code == 403


def test_this_machines_own_name_passes(server: LocalrtServer) -> None:
    import socket

    r = httpx.get(server.url + "/api/tags", headers={"Host": f"{socket.gethostname()}:{server.port}"})
    assert r.status_code == 200


@pytest.fixture(scope="module")
def wide_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    """Bound to every interface (as in a container, or to reach it from the LAN); reached via 127.0.0.1."""
    from tests.servers.serve import free_port

    root = tmp_path_factory.mktemp("api-wide")
    port = free_port()
    env = {"LOCALRT_HOST": f"0.0.0.0:{port}", "LOCALRT_ALLOWED_HOSTS": "models.example, gpu-box"}
    srv = LocalrtServer(root / "models", root / "serve.log", env=env, port=port)
    yield srv
    srv.stop()


@pytest.mark.parametrize(
    "method, path", [("GET", "/api/tags"), ("POST", "/api/create"), ("POST", "/api/chat")]
)
def test_rebinding_is_refused_when_bound_wide(wide_server: LocalrtServer, method: str, path: str) -> None:
    """The attacker's page at http://rebind.evil:PORT, its name now pointing here: same Host and Origin."""
    port = wide_server.port
    headers = {"Host": f"rebind.evil:{port}", "Origin": f"http://rebind.evil:{port}"}
    r = httpx.request(method, wide_server.url + path, headers=headers, json={"model": "x"})
    assert r.status_code == 403, r.text
    assert "Host" in r.json()["error"]


def test_same_origin_is_no_pass_for_a_listed_host(wide_server: LocalrtServer) -> None:
    """A name in LOCALRT_ALLOWED_HOSTS is served; a page on it still needs its Origin listed."""
    port = wide_server.port
    assert (
        httpx.get(wide_server.url + "/api/tags", headers={"Host": f"models.example:{port}"}).status_code
        == 200
    )
    assert httpx.get(wide_server.url + "/api/tags", headers={"Host": "gpu-box"}).status_code == 200
    same_origin = {"Host": f"models.example:{port}", "Origin": f"http://models.example:{port}"}
    r = httpx.get(wide_server.url + "/api/tags", headers=same_origin)
    assert r.status_code == 403
    assert "origin" in r.json()["error"]


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]"])
def test_loopback_still_passes_when_bound_wide(wide_server: LocalrtServer, host: str) -> None:
    r = httpx.get(wide_server.url + "/api/tags", headers={"Host": f"{host}:{wide_server.port}"})
    assert r.status_code == 200


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/api/tags"),
        ("POST", "/api/delete"),
        ("DELETE", "/api/delete"),
        ("OPTIONS", "/api/chat"),
        ("POST", "/v1/chat/completions"),
    ],
)
def test_foreign_origin_is_refused_on_every_method(server: LocalrtServer, method: str, path: str) -> None:
    r = httpx.request(
        method, server.url + path, headers={"Origin": "https://evil.example"}, content=b'{"model": "x"}'
    )
    assert r.status_code == 403
    if path.startswith("/v1/"):
        assert r.json()["error"]["type"] == "permission_error"


def test_simple_cross_site_post_cannot_delete(server: LocalrtServer) -> None:
    r = httpx.post(
        server.url + "/api/pull",
        headers={"Origin": "http://evil.example", "Content-Type": "text/plain"},
        content=b'{"model": "x"}',
    )
    assert r.status_code == 403


@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://127.0.0.1", "https://trusted.example"])
def test_allowed_origins_get_cors_headers(server: LocalrtServer, origin: str) -> None:
    r = httpx.get(server.url + "/api/tags", headers={"Origin": origin})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == origin
    pre = httpx.options(
        server.url + "/api/chat", headers={"Origin": origin, "Access-Control-Request-Method": "POST"}
    )
    assert pre.status_code == 204
    assert "POST" in pre.headers["access-control-allow-methods"]


def test_body_cap(server: LocalrtServer) -> None:
    big = b'{"model": "' + b"x" * 70000 + b'"}'
    assert httpx.post(server.url + "/api/show", content=big).status_code == 413

    def chunked() -> Iterator[bytes]:  # no Content-Length: the cap must count streamed bytes
        yield b'{"model": "'
        for _ in range(20):
            yield b"y" * 8192
        yield b'"}'

    r = httpx.post(server.url + "/api/show", content=chunked())
    assert r.status_code == 413
    assert server.alive()


@pytest.mark.parametrize(
    "path, body, status, fragment",
    [
        ("/api/show", b"", 400, "missing request body"),
        ("/api/show", b"{not json", 400, "invalid JSON"),
        ("/api/show", b'{"model": "../../etc/passwd"}', 400, "invalid model name"),
        ("/api/show", b'{"model": "nosuch:model"}', 404, "not found"),
        ("/api/copy", b'{"source": "nosuch", "destination": "x"}', 404, "not found"),
        ("/api/delete", b'{"model": "nosuch"}', 404, "not found"),
    ],
)
def test_bad_requests_get_clear_errors(
    server: LocalrtServer, path: str, body: bytes, status: int, fragment: str
) -> None:
    method = "DELETE" if path == "/api/delete" else "POST"
    r = httpx.request(method, server.url + path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]
    assert "Traceback" not in r.text


def test_blob_upload_checks_digest(server: LocalrtServer) -> None:
    data = b"some blob bytes" * 1000
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert httpx.head(f"{server.url}/api/blobs/{digest}").status_code == 404
    wrong = "sha256:" + hashlib.sha256(b"other").hexdigest()
    r = httpx.post(f"{server.url}/api/blobs/{wrong}", content=data)
    assert r.status_code == 400
    assert "digest mismatch" in r.json()["error"]
    assert httpx.head(f"{server.url}/api/blobs/{wrong}").status_code == 404
    assert httpx.post(f"{server.url}/api/blobs/{digest}", content=data).status_code == 201
    assert httpx.head(f"{server.url}/api/blobs/{digest}").status_code == 200
    for bad in ("sha256:../../etc/passwd", "md5:abc", "sha256:" + "A" * 64):
        assert httpx.post(f"{server.url}/api/blobs/{bad}", content=data).status_code in (400, 404)
    models = Path(server.env["LOCALRT_MODELS"])
    assert not any(p.name.startswith(".incoming") for p in (models / "blobs").iterdir())


def test_api_key(keyed_server: LocalrtServer) -> None:
    url = keyed_server.url
    assert httpx.get(url + "/").status_code == 200  # liveness stays open
    assert httpx.get(url + "/api/tags").status_code == 401
    assert httpx.get(url + "/api/tags", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url + "/api/tags", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    r = httpx.get(url + "/v1/models")
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"


def test_x_api_key_like_bearer(keyed_server: LocalrtServer) -> None:
    """Anthropic's SDK sends `x-api-key`; it opens every route as `Authorization: Bearer` does."""
    import anthropic

    url = keyed_server.url
    assert httpx.get(url + "/api/tags", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(url + "/api/tags", headers={"x-api-key": "wrong"}).status_code == 401
    r = httpx.post(url + "/v1/messages", json={})
    assert r.status_code == 401
    assert r.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "unauthorized: a valid API key is required"},
    }
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.count_tokens(
            model="nosuch", messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(anthropic.NotFoundError):  # the key is accepted: the model lookup is reached
        anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0).messages.count_tokens(
            model="nosuch", messages=[{"role": "user", "content": "hi"}]
        )


def test_openai_error_shape(server: LocalrtServer) -> None:
    r = httpx.get(server.url + "/v1/models/nosuch")
    assert r.status_code == 404
    assert r.json() == {
        "error": {
            "message": "model 'nosuch' not found",
            "type": "not_found_error",
            "param": None,
            "code": None,
        }
    }


# ---- bad input on every route (hand-written; tests/test_api_schema.py fuzzes the same routes) ----
@pytest.fixture(scope="module")
def model_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    """A server with a tiny real model, so checks that come after the model lookup are reached."""
    root = tmp_path_factory.mktemp("api-bad-input")
    import_gguf(Store(root / "models"), TINY, write_tiny_llama(root / "tiny.gguf", context_length=128))
    srv = LocalrtServer(root / "models", root / "serve.log")
    yield srv
    srv.stop()
    assert "Traceback" not in srv.log_path.read_text(errors="replace")


TINY = "tiny:latest"
GEN = {"num_predict": 4, "num_thread": 1, "temperature": 0}


def call(server: LocalrtServer, method: str, path: str, body: object) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.request(method, server.url + path, content=content, timeout=60)


def error_message(r: httpx.Response) -> str:
    err = r.json()["error"]
    return err["message"] if isinstance(err, dict) else err


@pytest.mark.parametrize(
    "method, path, body, field",
    [
        ("POST", "/api/generate", {"model": TINY, "prompt": 5}, "prompt"),
        ("POST", "/api/generate", {"model": TINY, "stream": "yes"}, "stream"),
        ("POST", "/api/generate", {"model": TINY, "context": [1, "two"]}, "context"),
        ("POST", "/api/chat", {"model": TINY, "messages": "hi"}, "messages"),
        ("POST", "/api/chat", {"model": TINY, "messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ("POST", "/api/embed", {"model": TINY, "input": 7}, "input"),
        ("POST", "/api/embeddings", {"model": TINY, "prompt": [1]}, "prompt"),
        ("POST", "/api/tokenize", {"model": TINY, "text": 1}, "text"),
        ("POST", "/api/detokenize", {"model": TINY, "tokens": ["a"]}, "tokens"),
        ("POST", "/api/show", {"model": 5}, "model"),
        ("DELETE", "/api/delete", {"model": []}, "model"),
        ("POST", "/api/copy", {"source": TINY, "destination": 1}, "destination"),
        ("POST", "/api/pull", {"model": "x", "insecure": "yes"}, "insecure"),
        ("POST", "/api/create", {"model": "x", "files": [1]}, "files"),
        (
            "POST",
            "/v1/chat/completions",
            {"model": TINY, "messages": [{"role": "user", "content": 1}]},
            "messages",
        ),
        ("POST", "/v1/chat/completions", {"model": TINY, "messages": [], "stream": 1}, "messages"),
        ("POST", "/v1/completions", {"model": TINY, "prompt": {}}, "prompt"),
        ("POST", "/v1/embeddings", {"model": TINY, "input": 5}, "input"),
        ("POST", "/api/generate", [TINY], "JSON object"),
        ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "invalid JSON"),
    ],
)
def test_wrong_types_are_400_naming_the_field(
    model_server: LocalrtServer, method: str, path: str, body: object, field: str
) -> None:
    r = call(model_server, method, path, body)
    assert r.status_code == 400, r.text
    assert field in error_message(r)
    if path.startswith("/v1/"):
        assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "path, body, option",
    [
        ("/api/generate", {"options": {"num_ctx": -1}}, "num_ctx"),
        ("/api/generate", {"options": {"temperature": 1e9}}, "temperature"),
        ("/api/chat", {"messages": [], "options": {"top_k": "many"}}, "top_k"),
        ("/api/chat", {"messages": [], "options": {"seed": True}}, "seed"),
        ("/api/embed", {"input": "x", "options": {"bogus": 1}}, "bogus"),
        ("/api/generate", {"options": {"num_predict": -7}}, "num_predict"),
        ("/api/generate", {"keep_alive": "nan"}, "duration"),
        ("/api/generate", {"top_logprobs": 99}, "top_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "temperature": -1},
            "temperature",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 3}, "n"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -5}, "max_tokens"),
    ],
)
def test_negative_or_absurd_options_are_400(
    model_server: LocalrtServer, path: str, body: dict, option: str
) -> None:
    r = call(model_server, "POST", path, {"model": TINY, "stream": False, **body})
    assert r.status_code == 400, r.text
    assert option in error_message(r)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/api/generate", {"prompt": "hi"}),
        ("/api/chat", {"messages": []}),
        ("/api/embed", {"input": "x"}),
        ("/api/embeddings", {"prompt": ""}),
        ("/api/tokenize", {"text": "x"}),
        ("/api/show", {}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/embeddings", {"input": "x"}),
    ],
)
def test_unknown_model_is_404_naming_it(model_server: LocalrtServer, path: str, body: dict) -> None:
    r = call(model_server, "POST", path, {"model": "no-such-model:7b", "stream": False, **body})
    assert r.status_code == 404, r.text
    assert "no-such-model:7b" in error_message(r)


# Regressions for what schemathesis found (each was a 500, a missing header or a wrong 200).
def test_405_names_the_allowed_methods(model_server: LocalrtServer) -> None:
    r = httpx.get(model_server.url + "/api/generate")
    assert r.status_code == 405
    assert r.headers["allow"] == "POST"


def test_embed_with_null_input_loads_the_model(model_server: LocalrtServer) -> None:
    r = call(model_server, "POST", "/api/embed", {"model": TINY, "input": None})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == TINY


def test_legacy_embeddings_needs_a_model_even_for_an_empty_prompt(model_server: LocalrtServer) -> None:
    r = call(model_server, "POST", "/api/embeddings", {"prompt": None})
    assert r.status_code == 400
    assert "model is required" in r.json()["error"]
    r = call(
        model_server, "POST", "/api/embeddings", {"model": TINY, "prompt": "", "options": {"flash_attn": {}}}
    )
    assert r.status_code == 400
    assert "flash_attn" in r.json()["error"]
    assert call(model_server, "POST", "/api/embeddings", {"model": TINY, "prompt": ""}).json() == {
        "embedding": []
    }


@pytest.mark.parametrize(
    "method, path, key",
    [
        ("POST", "/api/show", "model"),
        ("DELETE", "/api/delete", "model"),
        ("POST", "/api/copy", "source"),
        ("POST", "/api/create", "from"),
    ],
)
def test_host_longer_than_a_file_name_is_400(
    model_server: LocalrtServer, method: str, path: str, key: str
) -> None:
    name = "h" * 300 + "/ns/model:tag"  # the host becomes one directory name in the store
    body = {"model": "dst", "destination": "dst", key: name}
    r = call(model_server, method, path, body)
    assert r.status_code == 400, r.text
    assert "invalid model name" in r.json()["error"]


def test_keep_alive_past_any_date_reads_as_forever(model_server: LocalrtServer) -> None:
    r = call(
        model_server,
        "POST",
        "/api/generate",
        {"model": TINY, "prompt": "hi", "stream": False, "keep_alive": 1e300, "options": GEN},
    )
    assert r.status_code == 200, r.text
    ps = httpx.get(model_server.url + "/api/ps")
    assert ps.status_code == 200, ps.text
    [row] = [m for m in ps.json()["models"] if m["name"] == TINY]
    assert row["expires_at"] == "0001-01-01T00:00:00Z"


def test_integral_numbers_count_as_integers(model_server: LocalrtServer) -> None:
    """JSON Schema's integer includes 300.0; the schema says integer, so the server takes it as 300."""
    as_float = call(model_server, "POST", "/api/detokenize", {"model": TINY, "tokens": [300.0, 301]})
    as_int = call(model_server, "POST", "/api/detokenize", {"model": TINY, "tokens": [300, 301]})
    assert as_float.status_code == 200, as_float.text
    assert as_float.json() == as_int.json()
    assert (
        call(model_server, "POST", "/api/detokenize", {"model": TINY, "tokens": [300.5]}).status_code == 400
    )


@pytest.mark.parametrize(
    "body, reason",
    [
        ({"model": "dst@sha256:" + "9" * 64, "from": TINY}, "takes no @digest"),
        ({"model": "dst", "from": "bad name\twith tab", "remote": ""}, "invalid model name"),
    ],
)
def test_create_refuses_bad_names_before_streaming(
    model_server: LocalrtServer, body: dict, reason: str
) -> None:
    """Found by schemathesis: these were a 200 whose stream ended in an error line."""
    r = call(model_server, "POST", "/api/create", body)
    assert r.status_code == 400, r.text
    assert reason in r.json()["error"]
