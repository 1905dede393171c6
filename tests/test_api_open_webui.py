"""Open WebUI's backend with a real `localrt serve` as its Ollama (OLLAMA_BASE_URL), offline: the model
list, a streamed chat, a pull with progress, and the embeddings of its RAG (a file uploaded, embedded
through /api/embed, and found again by a query).

`slow`: Open WebUI is installed into a venv of its own on first use (tests/clients_fixtures.py), about
7 GiB and 18 minutes on 2 busy cores. Its environment turns off everything that would reach the network
(offline mode, no update check, no telemetry, no local embedding model: embeddings come from localrt).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from localrt.store.catalog import load_catalog
from localrt.store.importer import import_gguf
from localrt.store.store import Store
from tests.clients_fixtures import open_webui
from tests.gguf_factory import write_tiny_llama
from tests.servers.registry import Registry
from tests.servers.serve import LocalrtServer
from tests.servers.serve import free_port

pytestmark = pytest.mark.slow

MODEL = "smollm2:135m"


@pytest.fixture(scope="module")
def localrt(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    root = tmp_path_factory.mktemp("open-webui-localrt")
    import_gguf(Store(root / "models"), MODEL, smollm2_gguf, system=load_catalog().find(MODEL).system)
    srv = LocalrtServer(root / "models", root / "serve.log", env={"LOCALRT_KEEP_ALIVE": "10m"})
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)
    assert "Traceback" not in srv.log_path.read_text(errors="replace")


def offline_env(localrt: LocalrtServer, data: Path, port: int) -> dict[str, str]:
    return {
        **os.environ,
        "OLLAMA_BASE_URL": localrt.url,
        "ENABLE_OPENAI_API": "false",
        "OFFLINE_MODE": "true",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "WEBUI_AUTH": "false",
        "WEBUI_SECRET_KEY": "localrt-test",
        "DATA_DIR": str(data),
        "PORT": str(port),
        "RAG_EMBEDDING_ENGINE": "ollama",
        "RAG_EMBEDDING_MODEL": MODEL,
        "ENABLE_VERSION_UPDATE_CHECK": "false",
        "SCARF_NO_ANALYTICS": "true",
        "DO_NOT_TRACK": "true",
        "ANONYMIZED_TELEMETRY": "false",
        "ENABLE_EVALUATION_ARENA_MODELS": "false",
        "ENABLE_TITLE_GENERATION": "false",
        "ENABLE_FOLLOW_UP_GENERATION": "false",
        "ENABLE_TAGS_GENERATION": "false",
        "ENABLE_AUTOCOMPLETE_GENERATION": "false",
        "ENABLE_RETRIEVAL_QUERY_GENERATION": "false",
    }


@pytest.fixture(scope="module")
def webui(localrt: LocalrtServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """Open WebUI's backend, and a client signed in as its single user."""
    program = open_webui()
    work = tmp_path_factory.mktemp("open-webui")
    port = free_port()
    log = open(work / "open-webui.log", "wb")
    proc = subprocess.Popen(
        [str(program), "serve", "--host", "127.0.0.1", "--port", str(port)],
        env=offline_env(localrt, work / "data", port),
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=work,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, (work / "open-webui.log").read_text(errors="replace")[-4000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        # without auth, signing in with no credentials gives the single admin user's token
        token = httpx.post(
            url + "/api/v1/auths/signin", json={"email": "", "password": ""}, timeout=60
        ).json()
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {token['token']}"}, timeout=300
        ) as client:
            yield client
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_model_list(webui: httpx.Client) -> None:
    models = webui.get("/api/models").json()["data"]
    assert MODEL in [m["id"] for m in models]
    assert [m.get("owned_by") for m in models if m["id"] == MODEL] == ["ollama"]


def test_streamed_chat(webui: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "stream": True,
        "params": {"temperature": 0, "max_tokens": 16},
    }
    pieces = []
    with webui.stream("POST", "/api/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line.removeprefix("data: "))
                pieces += [c["delta"].get("content") or "" for c in event.get("choices") or []]
    assert len([p for p in pieces if p]) > 1
    assert "Paris" in "".join(pieces)


def test_pull_with_progress(webui: httpx.Client, tmp_path: Path) -> None:
    tiny = write_tiny_llama(tmp_path / "tiny.gguf")
    with Registry() as registry:
        registry.add_model("library/tiny", "1", tiny)
        name = f"{registry.address}/library/tiny:1"
        with webui.stream("POST", "/ollama/api/pull", json={"model": name, "insecure": True}) as r:
            assert r.status_code == 200
            events = [json.loads(line) for line in r.iter_lines() if line.strip()]
    statuses = [e.get("status") for e in events]
    assert statuses[0] == "pulling manifest"
    assert statuses[-1] == "success"
    layers = [e for e in events if e.get("digest") and e.get("total")]
    assert layers[-1]["completed"] == layers[-1]["total"]
    assert name in [m["name"] for m in webui.get("/ollama/api/tags").json()["models"]]


def test_rag_embeddings(webui: httpx.Client) -> None:
    fact = b"The localrt test fact: the secret city is Paris.\n"
    uploaded = webui.post("/api/v1/files/", params={"process": "true"}, files={"file": ("fact.txt", fact)})
    assert uploaded.status_code == 200, uploaded.text
    file_id = uploaded.json()["id"]
    deadline = time.monotonic() + 300
    status = ""
    while time.monotonic() < deadline and status not in ("completed", "failed"):
        status = webui.get(f"/api/v1/files/{file_id}/process/status").json().get("status", "")
        time.sleep(1)
    assert status == "completed"
    found = webui.post(
        "/api/v1/retrieval/query/doc",
        json={"collection_name": f"file-{file_id}", "query": "Which city is the secret one?", "k": 1},
    ).json()
    assert found["documents"] == [[fact.decode().strip()]]
    assert found["metadatas"][0][0]["embedding_config"] == str({"engine": "ollama", "model": MODEL})
