"""LoRA adapters (a Modelfile's ADAPTER, `create --adapter`, /api/create's `adapters`).

The model is a tiny random Llama converted by llama.cpp's own convert_hf_to_gguf.py; the adapter is a
PEFT LoRA on it with random non-zero B matrices, converted by llama.cpp's convert_lora_to_gguf.py. The
oracle is llama-server with `--lora` on the same two files.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import ollama
import pytest

from localrt.backends.base import LoadOptions
from localrt.backends.llamacpp.memory import estimate as llamacpp_estimate
from localrt.errors import LocalrtError
from localrt.store.importer import import_gguf
from localrt.store.modelfile import create
from localrt.store.names import parse_name
from localrt.store.store import MEDIA_ADAPTER
from localrt.store.store import Store
from localrt.store.store import sha256_file
from tests.fixtures_hf import oracle_float
from tests.fixtures_hf import peft_lora_gguf
from tests.fixtures_hf import write_tiny_model
from tests.servers.llama_server import running_llama_server
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
        # several sequences, so that concurrent requests share steps (or, under other scales, alternate)
        # batch invariant: concurrent requests are checked against each alone, to the last bit
        env={
            "LOCALRT_KEEP_ALIVE": "10m",
            "LOCALRT_BACKEND": "llama.cpp",
            "LOCALRT_NUM_PARALLEL": "4",
            "LOCALRT_BATCH_INVARIANT": "1",
        },
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


def generate(
    server: LocalrtServer, model: str, lora: list[dict[str, float]] | None = None, **options: object
) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "raw": True, "stream": False, "options": {**GREEDY, **options}}
    if lora is not None:
        body["lora"] = lora
    return httpx.post(server.url + "/api/generate", json=body, timeout=300)


def text(
    server: LocalrtServer, model: str, lora: list[dict[str, float]] | None = None, **options: object
) -> str:
    answer = generate(server, model, lora, **options)
    assert answer.status_code == 200, answer.text
    return answer.json()["response"]


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
    args = ["-m", str(files["base"]), "--lora", str(files["lora"]), "-c", str(CTX), "-t", "2", "-np", "1"]
    with running_llama_server(args, tmp_path_factory.mktemp("llama-server") / "log.txt") as url:
        yield url


@pytest.mark.oracle
def test_greedy_tokens_equal_llama_server_with_lora(server: LocalrtServer, llama_server: str) -> None:
    body = {"prompt": PROMPT, "n_predict": 12, "temperature": 0, "top_k": 1, "cache_prompt": False}
    body["return_tokens"] = True
    theirs = httpx.post(llama_server + "/completion", json=body, timeout=300).json()
    ours = generate(server, "lora:tiny").json()
    # the raw route returns no context ids: the text and the token count, together, stand for the tokens
    assert (ours["response"], ours["eval_count"]) == (theirs["content"], len(theirs["tokens"]))


@pytest.mark.oracle
def test_greedy_tokens_equal_llama_server_at_scale_half(server: LocalrtServer, llama_server: str) -> None:
    lora = [{"id": 0, "scale": 0.5}]
    body = {"prompt": PROMPT, "n_predict": 12, "temperature": 0, "top_k": 1, "cache_prompt": False}
    body.update(return_tokens=True, lora=lora)
    theirs = httpx.post(llama_server + "/completion", json=body, timeout=300).json()
    ours = generate(server, "lora:tiny", lora).json()
    assert (ours["response"], ours["eval_count"]) == (theirs["content"], len(theirs["tokens"]))


@pytest.mark.oracle
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_logprobs_equal_llama_servers_within_1e_3(
    server: LocalrtServer, llama_server: str, scale: float
) -> None:
    """The top-5 log-probabilities at each of the 12 greedy steps (the logits less their log-sum-exp), from
    llama-server's `n_probs` and localrt's `top_logprobs`. llama-server reports the tokens of a character
    split over several tokens as one entry, with the last token's probabilities (and drops a split one at
    the end), so each of its rows must equal, in order, one of localrt's rows."""
    lora = [{"id": 0, "scale": scale}]
    body = {"prompt": PROMPT, "n_predict": 12, "temperature": 0, "top_k": 1, "cache_prompt": False}
    body.update(n_probs=5, lora=lora)
    theirs = httpx.post(llama_server + "/completion", json=body, timeout=300).json()[
        "completion_probabilities"
    ]
    ask = {"model": "lora:tiny", "prompt": PROMPT, "raw": True, "stream": False, "options": GREEDY}
    ask.update(lora=lora, logprobs=True, top_logprobs=5)
    ours = httpx.post(server.url + "/api/generate", json=ask, timeout=300).json()["logprobs"]
    mine, reference = (
        [np.array([t["logprob"] for t in row["top_logprobs"]]) for row in rows] for rows in (ours, theirs)
    )
    assert reference, "llama-server reported no probabilities"
    rows = iter(mine)
    matched = [any(np.abs(row - want).max() <= 1e-3 for row in rows) for want in reference]
    assert matched == [True] * len(reference)


# ---- per-request scales (llama-server's `lora` field) ------------------------------------------------
def test_scale_zero_gives_the_base_model(server: LocalrtServer) -> None:
    # the default (scale 1.0) ran this prompt before: its cached KV must not be reused at scale 0
    text(server, "lora:tiny")
    assert text(server, "lora:tiny", [{"id": 0, "scale": 0.0}]) == text(server, "base:tiny")


def test_scale_one_equals_the_default(server: LocalrtServer) -> None:
    assert text(server, "lora:tiny", [{"id": 0, "scale": 1.0}]) == text(server, "lora:tiny")


def test_an_empty_list_is_the_default(server: LocalrtServer) -> None:
    assert text(server, "lora:tiny", []) == text(server, "lora:tiny")


def test_scale_half_is_neither_off_nor_full(server: LocalrtServer) -> None:
    half = text(server, "lora:tiny", [{"id": 0, "scale": 0.5}])
    assert half not in (text(server, "lora:tiny"), text(server, "base:tiny"))


def test_concurrent_requests_under_other_scales_answer_as_alone(server: LocalrtServer) -> None:
    scales = [0.0, 1.0, 0.0, 1.0]
    alone = {s: text(server, "lora:tiny", [{"id": 0, "scale": s}], num_predict=48) for s in set(scales)}
    start = threading.Barrier(len(scales))
    together: list[str] = [""] * len(scales)

    def run(i: int) -> None:
        start.wait()
        together[i] = text(server, "lora:tiny", [{"id": 0, "scale": scales[i]}], num_predict=48)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(scales))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert together == [alone[s] for s in scales]


def test_the_openai_completions_route_takes_scales(server: LocalrtServer) -> None:
    def completion(model: str, lora: list[dict[str, float]] | None) -> str:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "lora": lora}
        return httpx.post(server.url + "/v1/completions", json=body, timeout=300).json()["choices"][0]["text"]

    assert completion("lora:tiny", [{"id": 0, "scale": 0}]) == completion("base:tiny", None)


def test_an_unknown_adapter_id_is_refused(server: LocalrtServer) -> None:
    answer = generate(server, "lora:tiny", [{"id": 1, "scale": 0.5}])
    assert (answer.status_code, answer.json()["error"]) == (
        400,
        "lora: unknown adapter id 1 (the model 'lora:tiny' has 1 LoRA adapter: id 0)",
    )


def test_an_adapter_listed_twice_is_refused(server: LocalrtServer) -> None:
    answer = generate(server, "lora:tiny", [{"id": 0, "scale": 0.5}, {"id": 0, "scale": 1}])
    assert (answer.status_code, answer.json()["error"]) == (400, "lora: adapter id 0 is listed twice")


def test_scales_for_a_model_without_adapters_are_refused(server: LocalrtServer) -> None:
    answer = generate(server, "base:tiny", [{"id": 0, "scale": 0.5}])
    assert (answer.status_code, answer.json()["error"]) == (
        400,
        "lora: the model 'base:tiny' has no LoRA adapters (ADAPTER) to scale",
    )


def test_scales_on_the_torch_backend_are_refused(server: LocalrtServer) -> None:
    answer = generate(server, "lora:tiny", [{"id": 0, "scale": 0.5}], backend="torch")
    assert (answer.status_code, answer.json()["error"]) == (
        400,
        "lora: the torch backend does not apply LoRA adapters; use the llama.cpp backend "
        "(option backend llama.cpp)",
    )


def test_the_chat_routes_check_scales(server: LocalrtServer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "lora:tiny", "messages": messages, "stream": False, "lora": [{"id": 3, "scale": 1}]}
    ollama_chat = httpx.post(server.url + "/api/chat", json=body, timeout=60)
    openai_chat = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert (ollama_chat.status_code, openai_chat.status_code) == (400, 400)


def test_a_malformed_entry_is_refused(server: LocalrtServer) -> None:
    answer = generate(server, "lora:tiny", [{"id": 0}])  # type: ignore[list-item]
    assert answer.status_code == 400


# ---- models made from one base with other adapters share its weights ---------------------------------
def loaded(server: LocalrtServer) -> dict[str, dict]:
    return {m["name"]: m for m in httpx.get(server.url + "/api/ps", timeout=30).json()["models"]}


def load_both(server: LocalrtServer) -> None:
    for model in ("base:tiny", "lora:tiny"):
        assert generate(server, model).status_code == 200


def test_ps_names_the_models_that_share_the_weights(server: LocalrtServer) -> None:
    load_both(server)
    assert loaded(server)["lora:tiny"]["details"]["shares_weights_with"] == ["base:tiny"]


def test_shared_weights_count_once_in_ps(server: LocalrtServer, files: dict[str, Path]) -> None:
    """The first of the two loaded counts the weights; the other only its own context and adapter."""
    load_both(server)
    sizes = sorted(m["size"] for name, m in loaded(server).items() if name in ("base:tiny", "lora:tiny"))
    assert sizes[0] < files["base"].stat().st_size


def test_the_model_that_stays_counts_the_weights(server: LocalrtServer, files: dict[str, Path]) -> None:
    load_both(server)
    unload = {"model": "base:tiny", "keep_alive": 0, "stream": False}
    assert httpx.post(server.url + "/api/generate", json=unload, timeout=60).status_code == 200
    assert loaded(server)["lora:tiny"]["size"] >= files["base"].stat().st_size


def test_the_base_answers_as_itself_beside_its_adapter_model(server: LocalrtServer) -> None:
    """The adapter is set on the adapter model's own context, never on the weights both run on."""
    load_both(server)
    assert text(server, "base:tiny") == text(server, "lora:tiny", [{"id": 0, "scale": 0.0}])


def test_an_adapter_model_fits_beside_its_base_where_two_copies_would_not(
    files: dict[str, Path], tmp_path: Path
) -> None:
    """LOCALRT_MAX_MEMORY holds both loads with one copy of the weights, not with two."""
    full = llamacpp_estimate(files["base"], LoadOptions(num_ctx=CTX, num_parallel=1))
    limit = full.total + full.without_weights().total + full.weights // 2
    store = Store(tmp_path / "models")
    import_gguf(store, "base:tiny", files["base"], params={"num_ctx": CTX})
    create("lora:tiny", modelfile_text=f"FROM base:tiny\nADAPTER {files['lora']}\n", store=store)
    env = {"LOCALRT_NUM_PARALLEL": "1", "LOCALRT_BACKEND": "llama.cpp", "LOCALRT_MAX_MEMORY": str(limit)}
    srv = LocalrtServer(tmp_path / "models", tmp_path / "serve.log", env={**env, "LOCALRT_KEEP_ALIVE": "10m"})
    try:
        load_both(srv)
        assert sorted(loaded(srv)) == ["base:tiny", "lora:tiny"]
    finally:
        srv.stop()


def test_cached_prompts_are_reused_only_under_equal_scales(files: dict[str, Path]) -> None:
    """One sequence: the prompt held under 1.0 is evaluated again at 0.0 (the 1.0 state goes to the RAM
    cache), and a later request at 1.0 gets that state back."""
    from localrt.backends.base import DoneEvent
    from localrt.backends.base import GenerateRequest
    from localrt.backends.base import LoadOptions
    from localrt.backends.base import SamplingParams
    from localrt.backends.llamacpp import LlamaCppBackend

    opts = LoadOptions(num_ctx=CTX, num_thread=2, num_parallel=1, adapters=(files["lora"],))
    m = LlamaCppBackend.load(files["base"], opts)

    async def cached(tokens: list[int], lora: tuple[float, ...] | None) -> int:
        request = GenerateRequest(tokens, SamplingParams(temperature=0), num_predict=2, lora=lora)
        async for event in m.generate(request):
            if isinstance(event, DoneEvent):
                return event.timings.cached_count
        return -1

    try:
        tokens = m.tokenize(PROMPT * 4, True, True)
        counts = [asyncio.run(cached(tokens, lora)) for lora in (None, (0.0,), (1.0,))]
    finally:
        m.unload()
    assert counts == [0, 0, len(tokens) - 1]
