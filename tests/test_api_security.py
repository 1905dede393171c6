"""SPEC 7 against a real `localrt serve`: Host and Origin checks, API key, body cap, clean errors."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.servers.serve import LocalrtServer

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    root = tmp_path_factory.mktemp("api-security")
    srv = LocalrtServer(root / "models", root / "serve.log",
                        env={"LOCALRT_ORIGINS": "https://trusted.example", "LOCALRT_MAX_BODY": "65536"})
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


@pytest.mark.parametrize("method, path", [("GET", "/api/tags"), ("POST", "/api/delete"), ("DELETE", "/api/delete"),
                                          ("OPTIONS", "/api/chat"), ("POST", "/v1/chat/completions")])
def test_foreign_origin_is_refused_on_every_method(server: LocalrtServer, method: str, path: str) -> None:
    r = httpx.request(method, server.url + path, headers={"Origin": "https://evil.example"},
                      content=b'{"model": "x"}')
    assert r.status_code == 403
    if path.startswith("/v1/"):
        assert r.json()["error"]["type"] == "permission_error"


def test_simple_cross_site_post_cannot_delete(server: LocalrtServer) -> None:
    r = httpx.post(server.url + "/api/pull", headers={"Origin": "http://evil.example", "Content-Type": "text/plain"},
                   content=b'{"model": "x"}')
    assert r.status_code == 403


@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://127.0.0.1", "https://trusted.example"])
def test_allowed_origins_get_cors_headers(server: LocalrtServer, origin: str) -> None:
    r = httpx.get(server.url + "/api/tags", headers={"Origin": origin})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == origin
    pre = httpx.options(server.url + "/api/chat", headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 204 and "POST" in pre.headers["access-control-allow-methods"]


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
def test_bad_requests_get_clear_errors(server: LocalrtServer, path: str, body: bytes, status: int,
                                       fragment: str) -> None:
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
    assert r.status_code == 400 and "digest mismatch" in r.json()["error"]
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
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_openai_error_shape(server: LocalrtServer) -> None:
    r = httpx.get(server.url + "/v1/models/nosuch")
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "model 'nosuch' not found", "type": "not_found_error",
                                  "param": None, "code": None}}
