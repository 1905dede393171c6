"""A client's grammar that rules out every token of the vocabulary. llama.cpp aborts the process when a
grammar is made to accept a token it refused; every backend must end that one request with a 400 instead,
while the other requests in the same batch go on."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from localrt.store.importer import import_gguf
from localrt.store.store import Store
from tests.servers.serve import LocalrtServer

# "ab" and then a NUL byte, which no token of SmolLM2's vocabulary spells
DEAD_END = 'root ::= "ab" [\\x00]'


@pytest.fixture(scope="module", params=["llama.cpp", "torch", "mlx"])
def server(
    request: pytest.FixtureRequest, smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalrtServer]:
    if request.param == "torch":
        pytest.importorskip("torch")
    if request.param == "mlx":
        pytest.importorskip("mlx.core")
    root = tmp_path_factory.mktemp("grammar-" + request.param)
    import_gguf(Store(root / "models"), "smol", smollm2_gguf)
    env = {"LOCALRT_BACKEND": request.param, "LOCALRT_NUM_PARALLEL": "2", "LOCALRT_KEEP_ALIVE": "10m"}
    srv = LocalrtServer(root / "models", root / "serve.log", env=env)
    yield srv
    srv.stop()


def dead_end(srv: LocalrtServer) -> httpx.Response:
    body = {
        "model": "smol",
        "prompt": "hi",
        "stream": False,
        "options": {"grammar": DEAD_END, "num_predict": 8},
    }
    return httpx.post(srv.url + "/api/generate", json=body, timeout=300)


def test_dead_end_is_a_400(server: LocalrtServer) -> None:
    assert dead_end(server).status_code == 400


def test_dead_end_names_the_grammar(server: LocalrtServer) -> None:
    assert "the grammar allows no token" in dead_end(server).json()["error"]


def test_server_keeps_serving_after_a_dead_end(server: LocalrtServer) -> None:
    dead_end(server)
    body = {"model": "smol", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
    assert httpx.post(server.url + "/api/generate", json=body, timeout=300).status_code == 200


def test_request_beside_a_dead_end_finishes(server: LocalrtServer) -> None:
    """A plain request streaming when the dead end comes: same batch, and it still gets every token."""
    body = {
        "model": "smol",
        "prompt": "Tell me a story.",
        "options": {"num_predict": 40, "temperature": 0},
    }
    last: dict = {}
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", server.url + "/api/generate", json=body, timeout=300) as r:
            for line in r.iter_lines():
                started.set()
                last.update(json.loads(line))
        started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    started.wait(300)
    dead_end(server)
    thread.join(300)
    assert last.get("eval_count") == 40
