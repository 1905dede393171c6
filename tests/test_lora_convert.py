"""Our PEFT LoRA -> GGUF converter, and `create` taking a PEFT folder as an adapter.

The oracle is llama.cpp's own convert_lora_to_gguf.py (from the pinned llama-cpp-python sdist) on the
same PEFT folder and base checkpoint: the files must be equal byte for byte. The base is the tiny random
Llama of tests/test_lora.py, its adapter the PEFT LoRA made there (q_proj, v_proj, down_proj, f32);
a second adapter, written here, adds k_proj (its own head count under GQA), o_proj and gate_proj in bf16.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import ollama
import pytest

from localrt.converters.convert import convert
from localrt.converters.hf import read_part
from localrt.converters.lora import base_from_gguf
from localrt.converters.lora import base_from_hf
from localrt.converters.lora import convert_lora
from localrt.errors import LocalrtError
from localrt.store.gguf import read_gguf
from localrt.store.modelfile import create
from localrt.store.store import MEDIA_ADAPTER
from localrt.store.store import Store
from localrt.store.store import sha256_file
from tests.fixtures_hf import oracle_float
from tests.fixtures_hf import oracle_lora
from tests.fixtures_hf import peft_lora_gguf
from tests.fixtures_hf import write_safetensors
from tests.fixtures_hf import write_tiny_model
from tests.servers.serve import LocalrtServer

# found, not imported: importing peft loads triton, which must first see TRITON_INTERPRET (tests/conftest.py)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")
pytest.importorskip("llama_cpp")

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("lora-convert")
    model_dir = write_tiny_model(work / "hf", arch="llama", hidden=256, ff=512, n_layer=2, seed=5)
    base = oracle_float(model_dir, work, "f32")
    peft_dir, lora = peft_lora_gguf(model_dir, work)
    return {"hf": model_dir, "base": base, "lora": lora, "peft": peft_dir, "work": work}


@pytest.fixture(scope="module")
def wide_peft(files: dict[str, Path]) -> Path:
    """The fixture's adapter plus bf16 pairs on k_proj (4 heads, 1 KV head), o_proj and gate_proj."""
    out = files["work"] / "peft-wide"
    out.mkdir(exist_ok=True)
    config = json.loads((files["peft"] / "adapter_config.json").read_text())
    config["target_modules"] = sorted({*config["target_modules"], "k_proj", "o_proj", "gate_proj"})
    (out / "adapter_config.json").write_text(json.dumps(config))
    tensors = {n: st.read() for n, st in read_part(files["peft"] / "adapter_model.safetensors").items()}
    rng = np.random.default_rng(7)
    rank = 8
    for layer in range(2):
        for module, rows, cols in (
            ("self_attn.k_proj", 64, 256),
            ("self_attn.o_proj", 256, 256),
            ("mlp.gate_proj", 512, 256),
        ):
            p = f"base_model.model.model.layers.{layer}.{module}"
            tensors[p + ".lora_A.weight"] = rng.standard_normal((rank, cols))
            tensors[p + ".lora_B.weight"] = rng.standard_normal((rows, rank))
    write_safetensors(out / "adapter_model.safetensors", tensors, "BF16")
    return out


def other_base(files: dict[str, Path], name: str, **shape: object) -> Path:
    """A tiny model other than the adapter's base, converted by our own converter (F32)."""
    out = files["work"] / f"{name}.gguf"
    if not out.is_file():
        model_dir = write_tiny_model(files["work"] / name, seed=9, **shape)  # type: ignore[arg-type]
        convert(model_dir, out, "F32")
    return out


# ---- the converter against llama.cpp's -------------------------------------------------------------
def test_the_f32_adapter_equals_llama_cpps_byte_for_byte(files: dict[str, Path], tmp_path: Path) -> None:
    ours = convert_lora(files["peft"], tmp_path / "ours.gguf", base_from_hf(files["hf"])).path
    assert sha256_file(ours) == sha256_file(files["lora"])


@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16"])
def test_a_bf16_adapter_with_k_proj_equals_llama_cpps_byte_for_byte(
    files: dict[str, Path], wide_peft: Path, tmp_path: Path, outtype: str
) -> None:
    theirs = oracle_lora(files["hf"], wide_peft, tmp_path / "theirs.gguf", outtype)
    ours = convert_lora(wide_peft, tmp_path / "ours.gguf", base_from_hf(files["hf"]), outtype).path
    assert sha256_file(ours) == sha256_file(theirs)


def test_the_base_gguf_alone_gives_the_same_file(files: dict[str, Path], tmp_path: Path) -> None:
    base = base_from_gguf(read_gguf(files["base"]).metadata, files["peft"])
    ours = convert_lora(files["peft"], tmp_path / "ours.gguf", base).path
    assert sha256_file(ours) == sha256_file(files["lora"])


def test_the_base_named_in_the_adapter_config_is_found(files: dict[str, Path], tmp_path: Path) -> None:
    ours = convert_lora(files["peft"], tmp_path / "ours.gguf").path
    assert sha256_file(ours) == sha256_file(files["lora"])


def test_a_dora_adapter_is_refused(files: dict[str, Path], tmp_path: Path) -> None:
    peft = tmp_path / "dora"
    shutil.copytree(files["peft"], peft)
    config = json.loads((peft / "adapter_config.json").read_text())
    (peft / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(LocalrtError, match="is a DoRA adapter"):
        convert_lora(peft, tmp_path / "out.gguf", base_from_hf(files["hf"]))


# ---- create ----------------------------------------------------------------------------------------
def test_create_stores_llama_cpps_adapter_file(files: dict[str, Path], tmp_path: Path) -> None:
    store = Store(tmp_path / "models")
    create("peft:1", from_path=files["base"], adapters=[files["peft"]], store=store)
    manifest = store.read_manifest(store.resolve("peft:1").name)[0]
    adapters = [layer["digest"] for layer in manifest["layers"] if layer["mediaType"] == MEDIA_ADAPTER]
    assert adapters == [sha256_file(files["lora"])]


def test_a_modelfile_adapter_line_takes_a_peft_folder(files: dict[str, Path], tmp_path: Path) -> None:
    store = Store(tmp_path / "models")
    text = f"FROM {files['base']}\nADAPTER ./{files['peft'].name}\n"
    create("peft:1", modelfile_text=text, base_dir=files["work"], store=store)
    assert [sha256_file(p) for p in store.resolve("peft:1").adapter_paths] == [sha256_file(files["lora"])]


def test_the_cli_against_a_server_uploads_the_converted_adapter(
    files: dict[str, Path], tmp_path: Path
) -> None:
    """`localrt create` against a running server converts the folder on the client (the server takes
    files) and uploads the GGUF: the server stores llama.cpp's file."""
    srv = LocalrtServer(tmp_path / "models", tmp_path / "serve.log")
    try:
        modelfile = files["work"] / "Modelfile.peft"
        modelfile.write_text(f"FROM {files['base']}\nADAPTER ./{files['peft'].name}\n")
        cmd = [sys.executable, "-m", "localrt", "create", "peft:1", "-f", str(modelfile)]
        proc = subprocess.run(cmd, env=srv.env, capture_output=True, text=True, timeout=300)
        stored = [sha256_file(p) for p in Store(tmp_path / "models").resolve("peft:1").adapter_paths]
    finally:
        srv.stop()
    assert (proc.returncode, stored) == (0, [sha256_file(files["lora"])]), proc.stderr


PEFT_PAIR = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(scope="module")
def api_server(files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    """A server whose store has the base model, created through the API from the uploaded GGUF."""
    root = tmp_path_factory.mktemp("peft-api")
    srv = LocalrtServer(root / "models", root / "serve.log")
    try:
        client = ollama.Client(host=srv.url)
        client.create(model="base:1", files={"base.gguf": client.create_blob(files["base"])})
        yield srv
    finally:
        srv.stop()


def test_the_cli_against_a_server_uploads_a_peft_folder_for_a_stored_base(
    api_server: LocalrtServer, files: dict[str, Path]
) -> None:
    """`FROM` a model the server holds: the folder's files go up and the server converts them."""
    modelfile = files["work"] / "Modelfile.stored"
    modelfile.write_text(f"FROM base:1\nADAPTER ./{files['peft'].name}\n")
    cmd = [sys.executable, "-m", "localrt", "create", "stored:1", "-f", str(modelfile)]
    proc = subprocess.run(cmd, env=api_server.env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (stored,) = Store(Path(api_server.env["LOCALRT_MODELS"])).resolve("stored:1").adapter_paths
    assert adapter_content(stored) == adapter_content(files["lora"])


def adapter_content(path: Path) -> tuple[float, list[tuple[str, str, tuple[int, ...]]], bytes]:
    """What an adapter GGUF applies: its alpha, its tensors (name, type, shape) and their data."""
    info = read_gguf(path)
    tensors = [(t.name, t.ggml_type, tuple(t.shape)) for t in info.tensors]
    return info.metadata["adapter.lora.alpha"], tensors, path.read_bytes()[info.data_offset :]


def create_with(server: LocalrtServer, name: str, adapters: dict[str, str]) -> httpx.Response:
    body = {"model": name, "from": "base:1", "adapters": adapters, "stream": False}
    return httpx.post(server.url + "/api/create", json=body, timeout=300)


def test_the_create_api_takes_a_peft_adapters_files(
    api_server: LocalrtServer, files: dict[str, Path]
) -> None:
    """Ollama's `adapters` with a PEFT adapter's files (the official client): the server converts them, and
    the stored adapter has the tensors and the alpha of llama.cpp's file. The rest of the header may differ:
    llama.cpp names the model card after the folder, which an upload does not have."""
    client = ollama.Client(host=api_server.url)
    adapters = {name: client.create_blob(files["peft"] / name) for name in PEFT_PAIR}
    client.create(model="peft:api", from_="base:1", adapters=adapters)
    (stored,) = Store(Path(api_server.env["LOCALRT_MODELS"])).resolve("peft:api").adapter_paths
    assert adapter_content(stored) == adapter_content(files["lora"])


def test_a_peft_adapter_without_its_weights_is_refused(
    api_server: LocalrtServer, files: dict[str, Path]
) -> None:
    config = ollama.Client(host=api_server.url).create_blob(files["peft"] / PEFT_PAIR[0])
    answer = create_with(api_server, "half:api", {PEFT_PAIR[0]: config})
    assert (answer.status_code, "needs adapter_config.json and adapter_model.safetensors" in answer.text) == (
        400,
        True,
    )


def test_an_adapter_file_name_with_a_path_is_refused(
    api_server: LocalrtServer, files: dict[str, Path]
) -> None:
    client = ollama.Client(host=api_server.url)
    adapters = {name: client.create_blob(files["peft"] / name) for name in PEFT_PAIR}
    adapters["../adapter_config.json"] = adapters.pop(PEFT_PAIR[0])
    answer = create_with(api_server, "path:api", adapters)
    assert (answer.status_code, "is not a plain file name" in answer.text) == (400, True)


def greedy_tokens(model: Path, adapter: Path) -> list[int]:
    from localrt.backends.base import GenerateRequest
    from localrt.backends.base import LoadOptions
    from localrt.backends.base import SamplingParams
    from localrt.backends.base import TextEvent
    from localrt.backends.llamacpp import LlamaCppBackend

    m = LlamaCppBackend.load(
        model, LoadOptions(num_ctx=256, num_thread=2, num_parallel=1, adapters=(adapter,))
    )

    async def run() -> list[int]:
        out: list[int] = []
        request = GenerateRequest(
            m.tokenize(PROMPT, True, True), SamplingParams(temperature=0), num_predict=12
        )
        async for event in m.generate(request):
            if isinstance(event, TextEvent):
                out += event.token_ids
        return out

    try:
        return asyncio.run(run())
    finally:
        m.unload()


def test_greedy_tokens_equal_those_under_llama_cpps_adapter(files: dict[str, Path], tmp_path: Path) -> None:
    store = Store(tmp_path / "models")
    create("peft:1", from_path=files["base"], adapters=[files["peft"]], store=store)
    create("gguf:1", from_path=files["base"], adapters=[files["lora"]], store=store)
    ours, theirs = store.resolve("peft:1"), store.resolve("gguf:1")
    assert greedy_tokens(ours.model_path, ours.adapter_paths[0]) == greedy_tokens(
        theirs.model_path, theirs.adapter_paths[0]
    )


def test_the_adapter_changes_the_greedy_tokens(files: dict[str, Path], tmp_path: Path) -> None:
    """The equality above means something only if the adapter moves the output."""
    store = Store(tmp_path / "models")
    create("peft:1", from_path=files["base"], adapters=[files["peft"]], store=store)
    ours = store.resolve("peft:1")
    zero = tmp_path / "zero"
    shutil.copytree(files["peft"], zero)
    config = json.loads((zero / "adapter_config.json").read_text())
    (zero / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 0}))
    create("zero:1", from_path=files["base"], adapters=[zero], store=store)
    off = store.resolve("zero:1")
    assert greedy_tokens(ours.model_path, ours.adapter_paths[0]) != greedy_tokens(
        off.model_path, off.adapter_paths[0]
    )


# ---- rsLoRA against PEFT itself ------------------------------------------------------------------------
# llama.cpp's script writes lora_alpha unchanged whatever use_rslora says, so the oracle for rsLoRA's scale
# (alpha / sqrt(rank), not alpha / rank) is PEFT's own forward pass on the same folder, in a child process
# (importing peft loads triton: tests/conftest.py).
PEFT_LOGITS = """
import json, sys, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
base, adapter, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
with torch.no_grad():
    print(json.dumps(model(torch.tensor([ids])).logits[0].tolist()))
"""
IDS = [1, 25, 60, 7, 99, 14, 200, 33]


def peft_logits(base: Path, adapter: Path) -> np.ndarray:
    cmd = [sys.executable, "-c", PEFT_LOGITS, str(base), str(adapter), json.dumps(IDS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return np.array(json.loads(proc.stdout), dtype=np.float32)[:-1]  # the rows score() gives


def our_logits(files: dict[str, Path], adapter: Path, tmp_path: Path) -> np.ndarray:
    from localrt.backends.base import LoadOptions
    from localrt.backends.llamacpp import LlamaCppBackend

    store = Store(tmp_path / "models")
    create("rs:1", from_path=files["base"], adapters=[adapter], store=store)
    resolved = store.resolve("rs:1")
    opts = LoadOptions(
        num_ctx=256, num_thread=2, num_parallel=1, kv_cache_type="f32", adapters=tuple(resolved.adapter_paths)
    )
    m = LlamaCppBackend.load(resolved.model_path, opts)
    try:
        logits = asyncio.run(m.score(IDS, return_logits=True)).logits
    finally:
        m.unload()
    assert logits is not None
    return logits


@pytest.fixture(scope="module")
def rslora(files: dict[str, Path]) -> Path:
    """The fixture's PEFT folder with use_rslora: the same tensors under a scale sqrt(rank) times larger."""
    out = files["work"] / "peft-rslora"
    if not out.is_dir():
        shutil.copytree(files["peft"], out)
        config = json.loads((out / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps({**config, "use_rslora": True}))
    return out


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["lora", "rslora"])
def test_logits_under_the_converted_adapter_equal_pefts(
    files: dict[str, Path], rslora: Path, tmp_path: Path, kind: str
) -> None:
    """Plain LoRA shows the comparison holds where llama.cpp's file agrees too; rsLoRA is the case
    only PEFT can judge. llama.cpp's float32 and torch's differ by about 1e-3 of the largest logit on this
    model; a wrong scale (alpha / rank for rsLoRA) moves them by about as much as the largest logit."""
    adapter = files["peft"] if kind == "lora" else rslora
    theirs = peft_logits(files["hf"], adapter)
    assert np.abs(our_logits(files, adapter, tmp_path) - theirs).max() <= 1e-2 * np.abs(theirs).max()


def test_rslora_moves_the_logits_away_from_plain_lora(
    files: dict[str, Path], rslora: Path, tmp_path: Path
) -> None:
    """The rsLoRA comparison above means something only if its scale changes the output."""
    plain = our_logits(files, files["peft"], tmp_path / "plain")
    assert np.abs(our_logits(files, rslora, tmp_path / "rs") - plain).max() > 0.1 * np.abs(plain).max()


# ---- the adapter against its base --------------------------------------------------------------------
@pytest.mark.parametrize("adapter", ["peft", "lora"])  # a PEFT folder, a GGUF adapter
def test_an_adapter_for_another_hidden_size_is_refused_naming_the_tensor(
    files: dict[str, Path], tmp_path: Path, adapter: str
) -> None:
    base = other_base(files, "hidden128", hidden=128, ff=512, n_layer=2)
    with pytest.raises(LocalrtError, match="tensor blk.0.ffn_down.weight has lora_a"):
        create("x:1", from_path=base, adapters=[files[adapter]], store=Store(tmp_path / "models"))


def test_an_adapter_tensor_the_base_lacks_is_refused_naming_it(
    files: dict[str, Path], tmp_path: Path
) -> None:
    base = other_base(files, "one-layer", hidden=256, ff=512, n_layer=1)
    with pytest.raises(LocalrtError, match="tensor blk.1.ffn_down.weight is not in the base model"):
        create("x:1", from_path=base, adapters=[files["lora"]], store=Store(tmp_path / "models"))


def test_an_adapter_for_another_architecture_is_refused(files: dict[str, Path], tmp_path: Path) -> None:
    base = other_base(files, "qwen2", arch="qwen2", hidden=256, ff=512, n_layer=2)
    with pytest.raises(LocalrtError, match="is for a 'llama' model, but the base model is 'qwen2'"):
        create("x:1", from_path=base, adapters=[files["lora"]], store=Store(tmp_path / "models"))


def test_a_folder_that_is_no_peft_adapter_is_refused(files: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(LocalrtError, match="is a folder without adapter_config.json"):
        create("x:1", from_path=files["base"], adapters=[files["hf"]], store=Store(tmp_path / "models"))
