"""Engine faults injected into a real `localrt serve` (`LOCALRT_TEST_FAULT`, localrt/faults.py): a llama.cpp
decode that fails fails only the requests of its step, each with a clear error (a 500, or its stream's error
chunk), and the model serves the next request; an engine thread that stops on an error fails what it held,
and the next request loads the model again while the other models serve on.

Tiny random-weight models whose greedy answers never reach an end token, so a request runs exactly as many
tokens as it asks for.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from localrt import faults
from localrt.backends.base import GenerateRequest
from localrt.backends.base import LoadOptions
from localrt.backends.base import SamplingParams
from localrt.backends.llamacpp import LlamaCppBackend
from localrt.store.importer import import_gguf
from localrt.store.store import Store
from tests.gguf_factory import write_tiny_llama
from tests.servers.serve import LocalrtServer

LIVENESS = 120.0  # seconds: a bound for a loaded machine, not a speed target
DECODE_FAILED = "llama.cpp decode failed (llama_decode returned -3)"
THREADS = int(os.environ.get("LOCALRT_TEST_THREADS", "1"))
ENGINE_STOPPED = "the model's engine stopped on an error: a fault injected by LOCALRT_TEST_FAULT"


def start_server(tmp_path: Path, fault: str, models: tuple[str, ...] = ("tiny:latest",)) -> LocalrtServer:
    store = Store(tmp_path / "models")
    for seed, name in enumerate(models, 1):
        import_gguf(store, name, write_tiny_llama(tmp_path / f"{seed}.gguf", seed=seed, context_length=512))
    return LocalrtServer(store.root, tmp_path / "serve.log", env={"LOCALRT_TEST_FAULT": fault})


def body(model: str, tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "stream": stream,
        "options": {"temperature": 0, "num_predict": tokens},
    }


def chat(server: LocalrtServer, model: str = "tiny:latest", tokens: int = 16) -> httpx.Response:
    return httpx.post(server.url + "/api/chat", json=body(model, tokens, False), timeout=LIVENESS)


def stream_chat(server: LocalrtServer, tokens: int) -> list[dict[str, Any]]:
    with httpx.stream(
        "POST", server.url + "/api/chat", json=body("tiny:latest", tokens, True), timeout=LIVENESS
    ) as r:
        assert r.status_code == 200
        return [json.loads(line) for line in r.iter_lines() if line]


def stop(server: LocalrtServer, tmp_path: Path) -> str:
    assert server.stop() in (0, -signal.SIGTERM)
    return (tmp_path / "serve.log").read_text()


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["one KV pool", "a KV stream per sequence"])
def test_a_failed_decode_fails_only_the_sequences_in_its_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch_invariant: bool
) -> None:
    """Three requests, with a prompt budget of one chunk a step: the first step evaluates `a`'s prompt, the
    second decodes `a` and evaluates `b`'s prompt while `c` waits for its turn. That second decode fails:
    `a` and `b` fail, `c`, running but outside the batch, runs to its end, and the KV memory holds what
    the engine's record says, nothing of the failed sequences."""
    model = LlamaCppBackend.load(
        write_tiny_llama(tmp_path / "tiny.gguf", context_length=512),
        LoadOptions(num_ctx=512, num_thread=THREADS, num_parallel=3, batch_invariant=batch_invariant),
    )
    try:
        engine = model.engine
        assert engine is not None
        engine.stop()  # stepped here instead (`run`), so that which decode fails does not depend on timing
        engine.scheduler.prompt_work = 1  # a step evaluates one prompt chunk
        greedy = SamplingParams(temperature=0.0)
        requests = [
            asyncio.run(model._prepare(GenerateRequest(model.tokenize(text), num_predict=4, sampling=greedy)))
            for text in ("one two three", "four five six", "seven eight nine")
        ]
        monkeypatch.setattr(faults, "_seen", {})
        monkeypatch.setenv("LOCALRT_TEST_FAULT", "decode#2")
        outputs = engine.run(requests)
        ends = [next(o for o in outputs if o.request is r and o.finish is not None) for r in requests]
        assert [o.finish for o in ends] == ["error", "error", "length"]
        assert [str(r.error) for r in requests[:2]] == [DECODE_FAILED] * 2
        assert sum(len(o.tokens) for o in outputs if o.request is requests[2]) == 4
        kv = engine.kv
        held = [int(kv.lib.llama_memory_seq_pos_max(kv.mem, s)) + 1 for s in range(len(kv.cells))]
        assert held == [len(cells) for cells in kv.cells]
        assert sum(held) == len(requests[2].prompt) + 3  # `c`'s prompt and the tokens fed back
    finally:
        model.unload()


def test_a_failed_decode_answers_500_and_the_model_serves_the_next_request(tmp_path: Path) -> None:
    server = start_server(tmp_path, "decode#3")  # the prompt's decode and one more run: the third fails
    try:
        failed = chat(server)
        assert failed.status_code == 500
        assert failed.json() == {"error": DECODE_FAILED}
        after = chat(server)
        assert after.status_code == 200
        assert after.json()["eval_count"] == 16
    finally:
        log = stop(server, tmp_path)
    assert "Traceback" not in log


def test_a_failed_decode_ends_its_stream_with_an_error_chunk_and_the_next_stream_runs(tmp_path: Path) -> None:
    server = start_server(tmp_path, "decode#3")
    try:
        failed = stream_chat(server, 32)
        assert failed[-1] == {"error": DECODE_FAILED}
        assert not any(line.get("done") for line in failed)
        assert len(failed) > 1  # tokens came first: it failed mid-stream
        after = stream_chat(server, 32)
        assert after[-1]["done"] is True
        assert after[-1]["eval_count"] == 32
    finally:
        log = stop(server, tmp_path)
    assert "Traceback" not in log


def test_a_stopped_engine_thread_is_loaded_again_and_the_other_model_serves(tmp_path: Path) -> None:
    # the first time an engine thread takes a request, an error escapes its loop
    server = start_server(tmp_path, "engine", ("first:latest", "other:latest"))
    try:
        failed = chat(server, "first:latest")
        assert failed.status_code == 500
        assert failed.json() == {"error": ENGINE_STOPPED}
        assert chat(server, "other:latest").status_code == 200
        again = chat(server, "first:latest")
        assert again.status_code == 200
        assert again.json()["load_duration"] > 0  # loaded again, not answered by the stopped engine
        assert server.alive()
    finally:
        log = stop(server, tmp_path)
    assert "the engine thread localrt-llamacpp-step stopped" in log
