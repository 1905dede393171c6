"""Rerank: a tiny random XLM-RoBERTa cross-encoder (bge-reranker-v2-m3's architecture) converted by
llama.cpp's own converter, served by a real `localrt serve` through llama.cpp's rank pooling.

The scores are checked against transformers' forward pass of the same checkpoint on the same tokens, the
order against llama.cpp's score of each (query, document) pair on its own, and (oracle) against llama-server's
own /v1/rerank.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest

from localrt.backends.base import LoadOptions
from localrt.store.modelfile import create
from localrt.store.store import Store
from tests.fixtures_vision import tiny_reranker
from tests.fixtures_vision import tiny_vlm
from tests.servers.llama_server import running_llama_server
from tests.servers.serve import LocalrtServer

MODEL = "tiny-rerank:latest"
NOT_A_RERANKER = "tiny-text:latest"
QUERY = "capital of France"
DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France.",
    "def add(a, b): return a + b",
    "Numbers like 3.14159 appear in many formulas.",
    "Berlin is the capital of Germany.",
]


@pytest.fixture(scope="module")
def reranker() -> Path:
    return tiny_reranker()


def pair_scores(path: Path) -> tuple[list[float], list[list[int]]]:
    """llama.cpp's score of each (query, document) pair, each in a context of its own, and the tokens."""
    from localrt.backends.llamacpp import LlamaCppBackend

    m = LlamaCppBackend.load(path, LoadOptions(num_ctx=128))
    try:
        scores = [asyncio.run(m.rerank(QUERY, [d]))[0][0] for d in DOCS]
        tokens = [m.rank_tokens(QUERY, d) for d in DOCS]
    finally:
        m.unload()
    return scores, tokens


def test_scores_are_computed_on_the_step_thread(
    reranker: Path, pooled_threads: list[threading.Thread]
) -> None:
    """As embeddings: no graph of the model runs on a thread other than its step thread."""
    from localrt.backends.llamacpp import LlamaCppBackend
    from localrt.backends.llamacpp.engine import Engine

    m = LlamaCppBackend.load(reranker, LoadOptions(num_ctx=128))
    try:
        asyncio.run(m.rerank(QUERY, DOCS))
    finally:
        m.unload()
    assert {t.name for t in pooled_threads} == {Engine.thread_name}


def test_scores_are_the_checkpoints_own(reranker: Path) -> None:
    import torch
    from transformers import XLMRobertaForSequenceClassification

    scores, tokens = pair_scores(reranker)
    hf = XLMRobertaForSequenceClassification.from_pretrained(reranker.parent / "hf").eval()
    with torch.no_grad():
        expected = [hf(torch.tensor([t])).logits[0, 0].item() for t in tokens]
    assert tokens[0][0] == 0  # <s> query </s> ... document </s>, as the vocabulary asks
    assert tokens[0][-1] == 2
    assert max(abs(a - b) for a, b in zip(scores, expected)) < 2e-3
    assert sorted(range(len(DOCS)), key=lambda i: -scores[i]) == sorted(
        range(len(DOCS)), key=lambda i: -expected[i]
    )


@pytest.fixture(scope="module")
def server(reranker: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    root = tmp_path_factory.mktemp("rerank")
    store = Store(root / "models")
    create(MODEL, from_path=reranker, store=store)
    create(NOT_A_RERANKER, from_path=tiny_vlm()[0], store=store)
    srv = LocalrtServer(root / "models", root / "serve.log", env={"LOCALRT_KEEP_ALIVE": "10m"})
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)
    assert "Traceback" not in srv.log_path.read_text(errors="replace")


def test_v1_rerank_orders_by_the_pair_scores(server: LocalrtServer, reranker: Path) -> None:
    scores, _ = pair_scores(reranker)
    body = httpx.post(
        server.url + "/v1/rerank", json={"model": MODEL, "query": QUERY, "documents": DOCS}, timeout=60
    ).json()
    results = body["results"]
    assert [r["index"] for r in results] == sorted(range(len(DOCS)), key=lambda i: -scores[i])
    assert all(abs(r["relevance_score"] - scores[r["index"]]) < 1e-4 for r in results)
    assert body["usage"]["prompt_tokens"] > 0
    assert "document" not in results[0]


def test_top_n_and_return_documents(server: LocalrtServer) -> None:
    body = httpx.post(
        server.url + "/v1/rerank",
        json={"model": MODEL, "query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": True},
        timeout=60,
    ).json()
    results = body["results"]
    assert len(results) == 2
    assert results[0]["relevance_score"] >= results[1]["relevance_score"]
    assert [r["document"]["text"] for r in results] == [DOCS[r["index"]] for r in results]


def test_the_ollama_clients_raw_request_path(server: LocalrtServer) -> None:
    client = ollama.Client(host=server.url)
    response = client._request_raw(
        "POST", "/api/rerank", json={"model": MODEL, "query": QUERY, "documents": DOCS}
    )
    via_ollama = response.json()["results"]
    via_openai_route = httpx.post(
        server.url + "/v1/rerank", json={"model": MODEL, "query": QUERY, "documents": DOCS}, timeout=60
    ).json()["results"]
    assert via_ollama == via_openai_route


def test_show_says_rerank(server: LocalrtServer) -> None:
    client = ollama.Client(host=server.url)
    assert "rerank" in (client.show(MODEL).capabilities or [])
    assert "completion" not in (client.show(MODEL).capabilities or [])
    assert "rerank" not in (client.show(NOT_A_RERANKER).capabilities or [])


@pytest.mark.parametrize(
    "path, body, status, fragment",
    [
        (
            "/v1/rerank",
            {"model": NOT_A_RERANKER, "query": "q", "documents": ["d"]},
            400,
            "does not support reranking",
        ),
        ("/api/rerank", {"model": MODEL, "documents": ["d"]}, 400, "query"),
        ("/api/rerank", {"model": MODEL, "query": "q", "documents": "d"}, 400, "documents"),
        ("/api/rerank", {"model": MODEL, "query": "q", "documents": ["d"], "top_n": -1}, 400, "top_n"),
        ("/api/rerank", {"model": "nothing:here", "query": "q", "documents": ["d"]}, 404, "not found"),
        # a reranker embeds pairs; it does not generate text (Ollama's words)
        (
            "/api/chat",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False},
            400,
            "does not support chat",
        ),
        (
            "/api/generate",
            {"model": MODEL, "prompt": "hi", "stream": False},
            400,
            "does not support generate",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            400,
            "does not support chat",
        ),
    ],
)
def test_bad_rerank_requests(
    server: LocalrtServer, path: str, body: dict, status: int, fragment: str
) -> None:
    r = httpx.post(server.url + path, json=body, timeout=60)
    error = r.json()["error"]
    message = error["message"] if isinstance(error, dict) else error
    assert r.status_code == status, message
    assert fragment in message


@pytest.mark.oracle
def test_llama_servers_own_rerank_agrees(server: LocalrtServer, reranker: Path, tmp_path: Path) -> None:
    """llama.cpp's llama-server --rerank on the same GGUF: the same order and scores."""
    args = ["-m", str(reranker), "--rerank", "-c", "128", "-ub", "128", "-t", "1"]
    with running_llama_server(args, tmp_path / "llama-server.log") as url:
        their_body = httpx.post(
            url + "/v1/rerank", json={"query": QUERY, "documents": DOCS}, timeout=60
        ).json()
    theirs = their_body["results"]
    our_body = httpx.post(
        server.url + "/v1/rerank", json={"model": MODEL, "query": QUERY, "documents": DOCS}, timeout=60
    ).json()
    ours = our_body["results"]
    assert our_body["usage"]["prompt_tokens"] == their_body["usage"]["prompt_tokens"]  # the same pairs
    assert [r["index"] for r in ours] == [r["index"] for r in theirs]
    # two builds of llama.cpp (the wheel's kernels, the tools' -march=native ones): close, not bit-equal
    assert max(abs(a["relevance_score"] - b["relevance_score"]) for a, b in zip(ours, theirs)) < 2e-3
