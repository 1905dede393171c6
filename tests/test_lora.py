"""LoRA adapters (a Modelfile's ADAPTER, `create --adapter`, /api/create's `adapters`).

The model is a tiny random Llama converted by llama.cpp's own convert_hf_to_gguf.py; the adapter is a
PEFT LoRA on it with random non-zero B matrices, converted by llama.cpp's convert_lora_to_gguf.py. The
oracle is llama-server with `--lora` on the same two files.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest

from localrt.errors import LocalrtError
from localrt.store.importer import import_gguf
from localrt.store.modelfile import create
from localrt.store.names import parse_name
from localrt.store.store import MEDIA_ADAPTER
from localrt.store.store import Store
from localrt.store.store import sha256_file
from tests.conftest import free_port
from tests.fixtures_hf import oracle_float
from tests.fixtures_hf import peft_lora_gguf
from tests.fixtures_hf import write_tiny_model
from tests.servers.serve import LocalrtServer

PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0, "num_predict": 12}
CTX = 512


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("lora")
    model_dir = write_tiny_model(work / "hf", arch="llama", hidden=256, ff=512, n_layer=2, seed=5)
    base = oracle_float(model_dir, work, "f32")
    peft_dir, lora = peft_lora_gguf(model_dir, work)
    return {"base": base, "lora": lora, "peft": peft_dir, "work": work}


@pytest.fixture(scope="module")
def server(files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    root = tmp_path_factory.mktemp("lora-serve")
    import_gguf(Store(root / "models"), "base:tiny", files["base"], params={"num_ctx": CTX})
    srv = LocalrtServer(
        root / "models",
        root / "serve.log",
        env={"LOCALRT_KEEP_ALIVE": "10m", "LOCALRT_BACKEND": "llama.cpp"},
    )
    # the CLI against the running server: the Modelfile's ADAPTER is uploaded and sent as `adapters`
    modelfile = files["work"] / "Modelfile"
    modelfile.write_text(f"FROM {files['base']}\nPARAMETER num_ctx {CTX}\nADAPTER ./{files['lora'].name}\n")
    cli(srv, "create", "lora:tiny", "-f", str(modelfile))
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)
    assert "Traceback" not in srv.log_path.read_text(errors="replace")


def cli(server: LocalrtServer, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "localrt", *args], env=server.env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def generate(server: LocalrtServer, model: str, **options: object) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "raw": True, "stream": False, "options": {**GREEDY, **options}}
    return httpx.post(server.url + "/api/generate", json=body, timeout=300)


# ---- the store ---------------------------------------------------------------------------------------
def test_the_adapter_is_stored_as_an_adapter_layer(server: LocalrtServer, files: dict[str, Path]) -> None:
    manifest = Store(Path(server.env["LOCALRT_MODELS"])).read_manifest(parse_name("lora:tiny"))[0]
    adapters = [layer["digest"] for layer in manifest["layers"] if layer["mediaType"] == MEDIA_ADAPTER]
    assert adapters == [sha256_file(files["lora"])]


def test_show_modelfile_writes_the_adapter_back(server: LocalrtServer, files: dict[str, Path]) -> None:
    digest = sha256_file(files["lora"]).replace(":", "-")
    lines = cli(server, "show", "--modelfile", "lora:tiny").splitlines()
    assert [line for line in lines if line.startswith("ADAPTER ")] == [
        f"ADAPTER {Path(server.env['LOCALRT_MODELS']) / 'blobs' / digest}"
    ]


def test_a_model_made_from_a_model_keeps_its_adapters(files: dict[str, Path], tmp_path: Path) -> None:
    store = Store(tmp_path / "models")
    create("with:lora", from_path=files["base"], adapters=[files["lora"]], store=store)
    create("derived:1", modelfile_text="FROM with:lora\nSYSTEM hi\n", store=store)
    assert store.resolve("derived:1").adapter_paths == store.resolve("with:lora").adapter_paths


def test_a_model_gguf_given_as_adapter_is_refused(files: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(LocalrtError, match="is not a LoRA adapter GGUF \\(general.type 'model'"):
        create(
            "x:1",
            modelfile_text=f"FROM {files['base']}\nADAPTER {files['base']}\n",
            store=Store(tmp_path / "models"),
        )


def test_a_peft_folder_is_refused_naming_the_converter(files: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(LocalrtError, match="convert it with llama.cpp's convert_lora_to_gguf.py first"):
        create("x:1", from_path=files["base"], adapters=[files["peft"]], store=Store(tmp_path / "models"))


def test_the_create_api_refuses_a_model_blob_as_adapter(
    server: LocalrtServer, files: dict[str, Path]
) -> None:
    client = ollama.Client(host=server.url)
    digest = client.create_blob(files["base"])
    body = {"model": "bad:tiny", "from": "base:tiny", "adapters": {"base.gguf": digest}, "stream": False}
    answer = httpx.post(server.url + "/api/create", json=body, timeout=120)
    assert (answer.status_code, "is not a LoRA adapter GGUF" in answer.json()["error"]) == (400, True)


# ---- generation --------------------------------------------------------------------------------------
def test_the_adapter_changes_the_output(server: LocalrtServer) -> None:
    assert (
        generate(server, "lora:tiny").json()["response"] != generate(server, "base:tiny").json()["response"]
    )


def test_the_ollama_client_creates_with_adapters(server: LocalrtServer, files: dict[str, Path]) -> None:
    client = ollama.Client(host=server.url)
    digest = client.create_blob(files["lora"])
    client.create(model="viaclient:tiny", from_="base:tiny", adapters={files["lora"].name: digest})
    assert (
        generate(server, "viaclient:tiny").json()["response"]
        == generate(server, "lora:tiny").json()["response"]
    )


def test_torch_refuses_a_model_with_adapters(server: LocalrtServer) -> None:
    answer = generate(server, "lora:tiny", backend="torch")
    assert (answer.status_code, answer.json()["error"]) == (
        501,
        "this model has LoRA adapters (ADAPTER), which the torch backend does not apply: "
        "load it with the llama.cpp backend (option backend llama.cpp)",
    )


# ---- the oracle: llama-server --lora -----------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_server(files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from tests.fixtures_hf import llama_cpp_tools

    binary = llama_cpp_tools() / "llama-server"
    port = free_port()
    log = open(tmp_path_factory.mktemp("llama-server") / "log.txt", "wb")
    cmd = [str(binary), "-m", str(files["base"]), "--lora", str(files["lora"]), "--port", str(port)]
    proc = subprocess.Popen(
        [*cmd, "-c", str(CTX), "-t", "2", "-np", "1"], stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, "llama-server exited"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.mark.oracle
def test_greedy_tokens_equal_llama_server_with_lora(server: LocalrtServer, llama_server: str) -> None:
    body = {"prompt": PROMPT, "n_predict": 12, "temperature": 0, "top_k": 1, "cache_prompt": False}
    body["return_tokens"] = True
    theirs = httpx.post(llama_server + "/completion", json=body, timeout=300).json()
    ours = generate(server, "lora:tiny").json()
    # the raw route returns no context ids: the text and the token count, together, stand for the tokens
    assert (ours["response"], ours["eval_count"]) == (theirs["content"], len(theirs["tokens"]))
