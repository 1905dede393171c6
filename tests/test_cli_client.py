"""The CLI as a client of a running `localrt serve`, as Ollama's is.

A real server subprocess on a free port with its own store; the CLI runs as real subprocesses with
LOCALRT_HOST pointing at it and LOCALRT_MODELS at a different, empty store, so anything the CLI
shows or changes must have gone through the server's HTTP API.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("llama_cpp")

from localrt.store.importer import import_gguf  # noqa: E402
from localrt.store.store import Store  # noqa: E402
from tests.servers.registry import Registry  # noqa: E402
from tests.servers.serve import LocalrtServer  # noqa: E402

THREADS = int(os.environ.get("LOCALRT_TEST_THREADS", "1"))
PARAMS = {"temperature": 0, "num_ctx": 1024, "num_thread": THREADS, "num_batch": 256}
MODEL = "smollm2:135m"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    root = tmp_path_factory.mktemp("served") / "models"
    import_gguf(Store(root), MODEL, smollm2_gguf, params=PARAMS, system="You are a helpful assistant.")
    served = LocalrtServer(root, root.parent / "serve.log")
    yield served
    served.stop()


@pytest.fixture
def cli_store(tmp_path: Path) -> Path:
    """The CLI's own LOCALRT_MODELS: empty, and it must stay so while a server answers."""
    return tmp_path / "cli-models"


def localrt(
    server: LocalrtServer, cli_store: Path, *args: str, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LOCALRT_HOST": f"127.0.0.1:{server.port}", "LOCALRT_MODELS": str(cli_store)}
    return subprocess.run(
        [sys.executable, "-m", "localrt", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def served_names(server: LocalrtServer) -> set[str]:
    return {m["name"] for m in httpx.get(f"{server.url}/api/tags", timeout=30).json()["models"]}


def test_run_answers_through_the_server_and_ps_lists_what_it_loaded(
    server: LocalrtServer, cli_store: Path
) -> None:
    first = localrt(server, cli_store, "run", MODEL, QUESTION, "--verbose")
    assert first.returncode == 0, first.stderr
    assert "Paris" in first.stdout
    assert re.search(r"^load duration: +\S+$", first.stderr, re.MULTILINE), first.stderr

    ps = localrt(server, cli_store, "ps")
    assert ps.returncode == 0, ps.stderr
    rows = [line.split() for line in ps.stdout.splitlines()[1:]]
    assert [row[0] for row in rows] == [MODEL]
    assert "(llama.cpp)" in ps.stdout  # PROCESSOR names the backend

    # the model is warm on the server: no load this time (the runtime reports load_duration 0, and
    # `--verbose` prints the line only for a load, as Ollama does)
    second = localrt(server, cli_store, "run", MODEL, "And of Germany?", "--verbose")
    assert second.returncode == 0, second.stderr
    assert "eval rate:" in second.stderr
    assert "load duration" not in second.stderr

    # nothing was loaded or stored on the CLI's side
    assert not cli_store.exists()


def test_load_duration_over_the_api_is_zero_once_loaded(server: LocalrtServer, cli_store: Path) -> None:
    result = localrt(server, cli_store, "run", MODEL, "Say hi.")
    assert result.returncode == 0, result.stderr
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": False}
    body["options"] = {"num_predict": 4}
    answer = httpx.post(f"{server.url}/api/chat", json=body, timeout=300).json()
    assert answer["load_duration"] == 0


def test_list_show_cp_rm_go_through_the_server(server: LocalrtServer, cli_store: Path) -> None:
    listing = localrt(server, cli_store, "list")
    assert listing.returncode == 0, listing.stderr
    assert MODEL in listing.stdout

    show = localrt(server, cli_store, "show", MODEL)
    assert show.returncode == 0, show.stderr
    assert re.search(r"architecture\s+llama", show.stdout)

    params = localrt(server, cli_store, "show", MODEL, "--parameters")
    assert re.search(r"^num_ctx\s+1024$", params.stdout, re.MULTILINE), params.stdout

    system = localrt(server, cli_store, "show", MODEL, "--system")
    assert system.stdout.strip() == "You are a helpful assistant."

    copied = localrt(server, cli_store, "cp", MODEL, "twin:1")
    assert copied.returncode == 0, copied.stderr
    assert "twin:1" in served_names(server)

    removed = localrt(server, cli_store, "rm", "twin:1")
    assert removed.returncode == 0, removed.stderr
    assert "twin:1" not in served_names(server)
    assert not cli_store.exists()


def test_create_uploads_the_gguf_and_the_server_builds_it(
    server: LocalrtServer, cli_store: Path, smollm2_gguf: Path, tmp_path: Path
) -> None:
    made = localrt(server, cli_store, "create", "fromfile:1", "--from", str(smollm2_gguf))
    assert made.returncode == 0, made.stderr
    assert "fromfile:1" in served_names(server)

    modelfile = tmp_path / "Modelfile"
    modelfile.write_text(f"FROM {MODEL}\nPARAMETER temperature 0.3\nSYSTEM Be brief.\n")
    derived = localrt(server, cli_store, "create", "brief:1", "-f", str(modelfile))
    assert derived.returncode == 0, derived.stderr
    shown = localrt(server, cli_store, "show", "brief:1", "--parameters")
    assert re.search(r"^temperature\s+0\.3$", shown.stdout, re.MULTILINE), shown.stdout
    assert not cli_store.exists()

    for name in ("fromfile:1", "brief:1"):
        assert localrt(server, cli_store, "rm", name).returncode == 0


def test_create_with_a_draft_goes_through_the_server(
    server: LocalrtServer, cli_store: Path, smollm2_gguf: Path, tmp_path: Path
) -> None:
    served = Store(Path(server.env["LOCALRT_MODELS"]))
    # DRAFT naming a stored model: the server takes that model's weights as the draft
    by_name = tmp_path / "Modelfile"
    by_name.write_text(f"FROM {MODEL}\nDRAFT {MODEL}\n")
    made = localrt(server, cli_store, "create", "drafted:1", "-f", str(by_name))
    assert made.returncode == 0, made.stderr
    assert served.resolve("drafted:1").draft_path == served.resolve(MODEL).model_path

    # DRAFT naming a local GGUF: uploaded as a blob first, as FROM's file is
    by_file = tmp_path / "Modelfile.file"
    by_file.write_text(f"FROM {MODEL}\nDRAFT {smollm2_gguf}\n")
    made = localrt(server, cli_store, "create", "drafted:2", "-f", str(by_file))
    assert made.returncode == 0, made.stderr
    assert served.resolve("drafted:2").draft_path == served.resolve(MODEL).model_path
    assert not cli_store.exists()

    for name in ("drafted:1", "drafted:2"):
        assert localrt(server, cli_store, "rm", name).returncode == 0


def test_pull_goes_through_the_server(server: LocalrtServer, cli_store: Path, smollm2_gguf: Path) -> None:
    with Registry() as registry:
        registry.add_model("library/pulled", "1", smollm2_gguf)
        ref = f"{registry.address}/library/pulled:1"
        result = localrt(server, cli_store, "pull", ref, "--insecure")
    assert result.returncode == 0, result.stderr
    assert "success" in result.stdout
    assert any(name.endswith("library/pulled:1") for name in served_names(server))
    assert not cli_store.exists()


def test_stop_unloads_on_the_server(server: LocalrtServer, cli_store: Path) -> None:
    assert localrt(server, cli_store, "run", MODEL, "Hi").returncode == 0
    stopped = localrt(server, cli_store, "stop", MODEL)
    assert stopped.returncode == 0, stopped.stderr
    assert httpx.get(f"{server.url}/api/ps", timeout=30).json()["models"] == []
