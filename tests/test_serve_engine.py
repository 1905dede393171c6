"""`localrt serve-engine` with a stand-in engine (tests/servers/engine_standin.py) given as
--engine-python: the command line it gets, the wait for /health, registration as a remote model that
the runtime can use, and Ctrl-C stopping the engine and removing the registration."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from localrt.runtime.front import Runtime
from localrt.store.importer import import_gguf
from localrt.store.names import parse_name
from localrt.store.store import Store
from tests.gguf_factory import write_tiny_llama
from tests.servers.serve import ctrl_c_reaches_the_child

STANDIN = Path(__file__).parent / "servers" / "engine_standin.py"


@pytest.fixture
def engine(tmp_path: Path) -> Path:
    """An executable that behaves like a Python with the engine installed."""
    exe = tmp_path / "engine-python"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{STANDIN}" "$@"\n')
    exe.chmod(0o755)
    return exe


def serve_engine(models_dir: Path, record: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "localrt", "serve-engine", *args],
        env={**os.environ, "LOCALRT_MODELS": str(models_dir), "STANDIN_RECORD": str(record), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_reaches_the_child,
    )


def wait_for_line(proc: subprocess.Popen[str], needle: str, timeout: float = 120) -> str:
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    while True:
        line = lines.get(timeout=timeout)
        if needle in line:
            return line


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def chat(store: Store, model: str) -> str:
    async def go() -> str:
        rt = Runtime(store)
        try:
            parts = [c.content async for c in rt.chat(model, [{"role": "user", "content": "hi"}])]
        finally:
            await rt.close()
        return "".join(parts)

    return asyncio.run(go())


def test_serve_engine_runs_registers_and_stops(models_dir: Path, tmp_path: Path, engine: Path) -> None:
    store = Store(models_dir)
    hf_dir = tmp_path / "hf-model"
    hf_dir.mkdir()
    import_gguf(store, "tiny", write_tiny_llama(tmp_path / "tiny.gguf"), hf_source=str(hf_dir))
    record = tmp_path / "record.jsonl"
    parallel = [
        "--tensor-parallel-size",
        "2",
        "--pipeline-parallel-size",
        "2",
        "--distributed-executor-backend",
        "ray",
    ]
    proc = serve_engine(models_dir, record, "vllm", "tiny", "--engine-python", str(engine), "--", *parallel)
    try:
        line = wait_for_line(proc, "serving")
        assert "tiny:vllm" in line
        argv = records(record)[0]["argv"]
        port = argv[argv.index("--port") + 1]
        assert argv == [
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(hf_dir),
            "--served-model-name",
            "tiny:vllm",
            "--host",
            "127.0.0.1",
            "--port",
            port,
            *parallel,
        ]
        remote = store.resolve("tiny:vllm").remote
        assert remote["endpoints"] == [f"http://127.0.0.1:{port}/v1"]
        assert remote["model"] == "tiny:vllm"
        assert (
            chat(store, "tiny:vllm") == "stand-in"
        )  # the runtime reaches the engine through the registration
        assert store.resolve("tiny").remote is None  # the stored model itself is untouched
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    assert code == 0
    assert records(record)[-1] == {"stopped": True}
    assert not store.exists(parse_name("tiny:vllm"))
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    assert "Traceback" not in proc.stderr.read()  # type: ignore[union-attr]


def test_serve_engine_gguf_fallback_and_sglang_flags(models_dir: Path, tmp_path: Path, engine: Path) -> None:
    """Without a recorded HF source the GGUF goes to the engine under a .gguf name; SGLang's flags."""
    from tests.servers.serve import free_port

    port = str(free_port())
    store = Store(models_dir)
    import_gguf(store, "tiny", write_tiny_llama(tmp_path / "tiny.gguf"))
    record = tmp_path / "record.jsonl"
    proc = serve_engine(
        models_dir,
        record,
        "sglang",
        "tiny",
        "--as",
        "tiny-sg",
        "--engine-python",
        str(engine),
        "--",
        "--tp",
        "2",
        "--port",
        port,
    )
    try:
        wait_for_line(proc, "serving")
        argv = records(record)[0]["argv"]
        assert argv[:3] == ["-m", "sglang.launch_server", "--model-path"]
        gguf = Path(argv[3])
        assert gguf.suffix == ".gguf"
        assert gguf.resolve() == store.resolve("tiny").model_path.resolve()
        assert argv[-4:] == ["--tp", "2", "--port", port]  # passed through untouched, ours not added twice
        assert argv.count("--port") == 1
        assert store.exists(parse_name("tiny-sg"))
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    assert code == 0
    assert not store.exists(parse_name("tiny-sg"))


def test_engine_failing_before_ready_is_one_line(models_dir: Path, tmp_path: Path, engine: Path) -> None:
    store = Store(models_dir)
    import_gguf(store, "tiny", write_tiny_llama(tmp_path / "tiny.gguf"))
    proc = serve_engine(
        models_dir, tmp_path / "r.jsonl", "vllm", "tiny", "--engine-python", str(engine), STANDIN_EXIT="3"
    )
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "vllm exited with code 3 before it was ready" in err
    assert "Traceback" not in err
    assert not store.exists(parse_name("tiny:vllm"))


def test_missing_engine_says_how_to_install(models_dir: Path, tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed in this environment")
    store = Store(models_dir)
    import_gguf(store, "tiny", write_tiny_llama(tmp_path / "tiny.gguf"))
    r = subprocess.run(
        [sys.executable, "-m", "localrt", "serve-engine", "sglang", "tiny"],
        env={**os.environ, "LOCALRT_MODELS": str(models_dir)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    [line] = r.stderr.strip().splitlines()
    assert "sglang is not installed" in line
    assert "pip install" in line
