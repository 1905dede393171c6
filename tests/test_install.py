"""The install on a fresh machine: the base install plus `[llama]` (the README's main command) in a new
virtual environment with nothing else, then every command run there as a user would.

Each command either works (`serve` answers, `run` answers, the store commands) or, where its optional
part is missing (convert, torch, MLX, the chat app, requantizing), prints one line naming the extra to
install and exits non-zero, never "internal error". pip reuses the llama-cpp-python wheel it built
before from its cache; the other packages come from the configured index.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny:1"

# pip builds the project and resolves the base dependencies: minutes when its cache is cold
pytestmark = pytest.mark.timeout(1200)


def clean_env() -> dict[str, str]:
    """This process's environment without what would leak our own venv into the fresh one."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "LOCALRT_DEBUG")}


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new venv (no system site-packages) with `pip install SRC[llama]`: its bin folder. SRC is a
    copy of the working tree, so pip's build folders never land in the repository."""
    base = tmp_path_factory.mktemp("fresh")
    src = base / "src"
    shutil.copytree(
        REPO,
        src,
        ignore=shutil.ignore_patterns(
            ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", "tests"
        ),
    )
    subprocess.run([sys.executable, "-m", "venv", str(base / "venv")], check=True)
    bin_dir = base / "venv" / "bin"
    result = subprocess.run(
        [str(bin_dir / "python"), "-m", "pip", "install", "-q", f"{src}[llama]"],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=1100,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return bin_dir


@pytest.fixture(scope="module")
def store(venv: Path, smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store with one model, made by the fresh install's own `localrt create` (one thread and short
    answers: the machine is shared)."""
    work = tmp_path_factory.mktemp("user")
    (work / "Modelfile").write_text(
        f"FROM {smollm2_gguf}\nPARAMETER num_thread 1\nPARAMETER num_ctx 512\nPARAMETER num_predict 8\n"
    )
    env = {**clean_env(), "PATH": f"{venv}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.update(LOCALRT_MODELS=str(work / "models"), LOCALRT_HOST=f"127.0.0.1:{free_port()}")
    created = localrt(env, work, "create", MODEL, "-f", "Modelfile")
    assert created.returncode == 0, created.stderr
    return work / "models"


@pytest.fixture
def user(venv: Path, store: Path) -> dict[str, str]:
    """The environment a user's shell has: the venv's bin on PATH, the store, no server."""
    env = clean_env()
    env.update(
        PATH=f"{venv}{os.pathsep}{env.get('PATH', '')}",
        LOCALRT_MODELS=str(store),
        LOCALRT_HOST=f"127.0.0.1:{free_port()}",
    )
    return env


def localrt(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["localrt", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300, input=""
    )


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The single stderr line of a failed command."""
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "internal error" not in lines[0]
    assert "Traceback" not in result.stderr
    return lines[0]


def test_the_venv_has_only_the_base_install_and_llama(venv: Path) -> None:
    probe = "import importlib.util as u; print(*[m for m in %r if u.find_spec(m)])"
    base = ("fastapi", "uvicorn", "httptools", "uvloop", "PIL", "llama_cpp")
    wanted = (*base, "textual", "torch", "mlx", "gguf", "tokenizers")
    found = subprocess.run(
        [str(venv / "python"), "-c", probe % (wanted,)], capture_output=True, text=True, check=True
    )
    assert found.stdout.split() == list(base)


def test_store_and_run_commands_work(user: dict[str, str], tmp_path: Path) -> None:
    assert localrt(user, tmp_path, "--version").stdout.startswith("localrt ")
    listing = localrt(user, tmp_path, "list")
    assert MODEL in listing.stdout
    shown = localrt(user, tmp_path, "show", MODEL)
    assert "architecture" in shown.stdout
    ran = localrt(user, tmp_path, "run", MODEL, "Say hello.")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip()
    ps = localrt(user, tmp_path, "ps")  # no server: nothing is loaded
    assert ps.stdout.split() == ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]


@pytest.mark.parametrize(
    "args,extra",
    [
        (["run", MODEL, "hi", "--backend", "torch"], "pip install 'localrt[torch]'"),
        (["run", MODEL, "hi", "--backend", "mlx"], "pip install 'localrt[mlx]'"),
        (["convert", "org/model", "-o", "out.gguf"], "pip install 'localrt[convert]'"),
        (["chat", MODEL], "pip install 'localrt[tui]'"),
        (["create", "q:1", "--from", "SRC", "--quantize", "Q4_K_M"], "pip install 'localrt[convert]'"),
    ],
)
def test_a_missing_extra_is_one_line_naming_it(
    user: dict[str, str], tmp_path: Path, smollm2_gguf: Path, args: list[str], extra: str
) -> None:
    args = [str(smollm2_gguf) if a == "SRC" else a for a in args]
    assert one_line(localrt(user, tmp_path, *args)).endswith(extra)


def test_serve_answers_and_the_cli_uses_it(user: dict[str, str], tmp_path: Path) -> None:
    url = "http://" + user["LOCALRT_HOST"]
    log = open(tmp_path / "serve.log", "wb")
    server = subprocess.Popen(
        ["localrt", "serve"], env=user, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        version = None
        for _ in range(600):  # until it listens (or exits)
            if server.poll() is not None:
                break
            try:
                version = httpx.get(f"{url}/api/version", timeout=2).json()
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert version is not None, (tmp_path / "serve.log").read_text(errors="replace")
        assert version["version"]
        ran = localrt(user, tmp_path, "run", MODEL, "Say hello.")
        assert ran.returncode == 0, ran.stderr
        ps = localrt(user, tmp_path, "ps")
        assert MODEL in ps.stdout  # `run` loaded it on the server
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
