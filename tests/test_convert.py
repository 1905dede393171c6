"""`localrt convert` against llama.cpp's own converter and quantizer, file for file.

The oracle is llama.cpp's convert_hf_to_gguf.py (from the llama-cpp-python sdist, fetched into the test
cache) followed, for quantized types, by `llama_model_quantize`. Every key (order, type, value) and
every tensor (order, type, shape, bytes) must be equal. Needs torch + transformers for the oracle.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from localrt.converters import mixes
from localrt.converters.convert import convert
from localrt.converters.convert import hyperparameters
from localrt.converters.convert import permute_rows
from localrt.converters.hf import ConvertError
from tests.fixtures_hf import auto_outtype
from tests.fixtures_hf import compare_gguf
from tests.fixtures_hf import oracle_convert_many
from tests.fixtures_hf import oracle_file
from tests.fixtures_hf import smollm2_hf_dir
from tests.fixtures_hf import write_safetensors
from tests.fixtures_hf import write_tiny_model

pytest.importorskip("sentencepiece")
llama_cpp = pytest.importorskip("llama_cpp")

QUANT_TYPES = [t for t in mixes.FILE_TYPES if t not in ("F32", "F16", "BF16")]
FAST_TYPES = [
    "F16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_1",
    "Q2_K",
    "Q3_K_S",
    "Q3_K_M",
    "Q4_K_S",
    "Q4_K_M",
    "Q5_K_M",
    "Q6_K",
]


def needs_oracle() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")


def assert_same(ours: Path, theirs: Path) -> None:
    diffs = compare_gguf(ours, theirs)
    assert not diffs, "\n".join(diffs[:20])


# ---- tiny random models: every file type -------------------------------------------------------------
TINY = {
    # f32 weights (auto -> f16 intermediate), rows of 256/512, GQA 4, untied
    "llama": dict(arch="llama", n_layer=4, n_kv=1, dtype="F32"),
    # bf16 weights, q/k/v biases, tied embeddings (token_embd takes the output rule), GQA 2
    "qwen2-bf16-tied": dict(arch="qwen2", n_layer=2, n_kv=2, tied=True, dtype="BF16"),
    # f16 weights in 3 shards with an index, per-head q/k norms
    "qwen3-f16-sharded": dict(arch="qwen3", n_layer=2, n_kv=2, tied=True, dtype="F16", shards=3),
    # Llama 3 rope scaling: an extra rope_freqs.weight tensor
    "llama3-rope": dict(
        arch="llama",
        n_layer=2,
        n_kv=1,
        dtype="BF16",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    ),
    # 320-wide rows: the 32-block fallbacks of every k-quant
    "rows320": dict(arch="llama", hidden=320, ff=640, n_head=5, n_kv=5, n_layer=2, vocab=384),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Every tiny model with its auto conversion by llama.cpp (one converter process for all)."""
    needs_oracle()
    out = {}
    for name, kw in TINY.items():
        work = tmp_path_factory.mktemp(name)
        out[name] = (write_tiny_model(work / "model", **kw), work)
    oracle_convert_many([(m, w / f"oracle-{auto_outtype(m)}.gguf", auto_outtype(m)) for m, w in out.values()])
    return out


@pytest.mark.parametrize(
    "file_type",
    [pytest.param(t, marks=[] if t in FAST_TYPES else pytest.mark.oracle) for t in mixes.FILE_TYPES],
)
def test_tiny_llama_matches_llama_cpp(tiny: dict[str, tuple[Path, Path]], file_type: str) -> None:
    model, work = tiny["llama"]
    theirs = oracle_file(model, work, file_type)
    ours = convert(model, work / f"ours-{file_type}.gguf", file_type).path
    assert_same(ours, theirs)


@pytest.mark.parametrize("variant", ["qwen2-bf16-tied", "qwen3-f16-sharded", "llama3-rope"])
def test_architecture_variants_match_llama_cpp(tiny: dict[str, tuple[Path, Path]], variant: str) -> None:
    model, work = tiny[variant]
    for file_type in (auto_outtype(model).upper(), "Q4_K_M", "Q3_K_S"):
        theirs = oracle_file(model, work, file_type)
        assert_same(convert(model, work / f"ours-{file_type}.gguf", file_type).path, theirs)


def test_rows_not_multiple_of_256_fall_back_like_llama_cpp(tiny: dict[str, tuple[Path, Path]]) -> None:
    model, work = tiny["rows320"]
    for file_type in ("Q2_K", "Q4_K_M", "Q5_K_S", "Q6_K"):
        theirs = oracle_file(model, work, file_type)
        assert_same(convert(model, work / f"ours-{file_type}.gguf", file_type).path, theirs)


# ---- the real SmolLM2-135M-Instruct -------------------------------------------------------------------
@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf: Path) -> Path:
    needs_oracle()
    return smollm2_hf_dir(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("smollm2")


@pytest.mark.parametrize(
    "file_type", [pytest.param(t, marks=[] if t == "Q4_K_M" else pytest.mark.slow) for t in mixes.FILE_TYPES]
)
def test_smollm2_matches_llama_cpp(smollm2_hf: Path, smollm2_work: Path, file_type: str) -> None:
    theirs = oracle_file(smollm2_hf, smollm2_work, file_type)
    ours = convert(smollm2_hf, smollm2_work / f"ours-{file_type}.gguf", file_type).path
    assert_same(ours, theirs)
    if file_type != "Q4_K_M":
        ours.unlink()


SAMPLES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "Ünïcödé: naïve café, Ελληνικά, Русский, 日本語のテキスト, 🦙🚀✅",
    "def square(x):\n    return x ** 2  # comment\n\nprint([square(i) for i in range(10)])",
    "3.14159 2718 1,000,000 0xFF 1e-9",
    "I've been 'told' he's there, 'RE you sure? We'Ve a'lL",
    "",
]
SPECIAL_SAMPLES = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more",
]


def test_smollm2_tokenizes_like_hf(smollm2_hf: Path, smollm2_work: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    path = smollm2_work / "ours-Q4_K_M.gguf"
    if not path.is_file():
        convert(smollm2_hf, path, "Q4_K_M")
    hf = tokenizers.Tokenizer.from_file(str(smollm2_hf / "tokenizer.json"))
    vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in SAMPLES + SPECIAL_SAMPLES:
        assert vocab.tokenize(text.encode(), add_bos=False, special=True) == hf.encode(text).ids, text


def test_sentencepiece_model_tokenizes_like_sentencepiece(tmp_path: Path) -> None:
    import sentencepiece as spm

    model = write_tiny_model(tmp_path / "model", n_layer=1)
    out = convert(model, tmp_path / "tiny.gguf", "F16").path
    sp = spm.SentencePieceProcessor(model_file=str(model / "tokenizer.model"))
    vocab = llama_cpp.Llama(str(out), vocab_only=True, verbose=False)
    for text in SAMPLES:
        assert vocab.tokenize(text.encode(), add_bos=True, special=True) == [1, *sp.encode(text)], text


def test_smollm2_q4_k_m_answers(smollm2_hf: Path, smollm2_work: Path) -> None:
    path = smollm2_work / "ours-Q4_K_M.gguf"
    if not path.is_file():
        convert(smollm2_hf, path, "Q4_K_M")
    llm = llama_cpp.Llama(str(path), n_ctx=256, verbose=False, seed=0)
    # the ChatML turn the runtime sends (llama-cpp-python's own chat formatter adds the template's system
    # prompt, which makes this 135M model answer in French even from the original GGUF)
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    out = llm(prompt, temperature=0.0, max_tokens=24)
    assert "Paris" in out["choices"][0]["text"]


# ---- bad input: one clear error, no output file ---------------------------------------------------------
def test_missing_config(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    with pytest.raises(ConvertError, match="no config.json"):
        convert(tmp_path / "m", tmp_path / "out.gguf", "Q4_K_M")
    assert not list(tmp_path.glob("out.gguf*"))


def test_unsupported_architecture_lists_supported(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m", n_layer=1)
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ConvertError, match=r"FalconForCausalLM.*supported: .*LlamaForCausalLM.*Qwen2ForCausalLM"
    ):
        convert(model, tmp_path / "out.gguf", "Q4_K_M")


def test_shape_mismatch(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m", n_layer=1)
    cfg = json.loads((model / "config.json").read_text())
    cfg["intermediate_size"] = 768
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ConvertError, match=r"down_proj.weight has shape \[256, 512\], config.json implies \[256, 768\]"
    ):
        convert(model, tmp_path / "out.gguf", "Q4_K_M")
    assert not list(tmp_path.glob("out.gguf*"))


def test_truncated_safetensors(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m", n_layer=1)
    st = model / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ConvertError, match="truncated"):
        convert(model, tmp_path / "out.gguf", "Q8_0")
    st.write_bytes(data[:20])
    with pytest.raises(ConvertError, match="header length"):
        convert(model, tmp_path / "out.gguf", "Q8_0")
    assert not list(tmp_path.glob("out.gguf*"))


def test_missing_layer_and_unknown_tensor(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m", n_layer=2)
    cfg = json.loads((model / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConvertError, match="missing for some of the 3 layers"):
        convert(model, tmp_path / "out.gguf", "Q8_0")
    cfg["num_hidden_layers"] = 2
    (model / "config.json").write_text(json.dumps(cfg))
    write_safetensors(
        model / "model-extra.safetensors", {"model.vision_tower.weight": np.zeros((4, 4))}, "F32"
    )
    with pytest.raises(ConvertError, match="vision_tower.weight.*no GGUF name"):
        convert(model, tmp_path / "out.gguf", "Q8_0")


def test_unknown_quant_type(tmp_path: Path) -> None:
    with pytest.raises(mixes.MixError, match="choose one of"):
        convert(tmp_path, tmp_path / "out.gguf", "Q9_X")


def test_failed_write_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = write_tiny_model(tmp_path / "m", n_layer=1)
    from localrt.converters import quants

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(quants, "quantize", boom)
    with pytest.raises(RuntimeError, match="disk on fire"):
        convert(model, tmp_path / "out.gguf", "Q4_K_M")
    assert not list(tmp_path.glob("out.gguf*"))


# ---- sources and the CLI entry point ------------------------------------------------------------------
def test_convert_from_hub_repo_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    from tests.servers.hub import Hub

    model = write_tiny_model(tmp_path / "m", n_layer=1)
    local = convert(model, tmp_path / "local.gguf", "Q8_0").path
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    with Hub() as hub:
        hub.add_repo("org/tiny", {p.name: p for p in model.iterdir()})
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        remote = convert("org/tiny", tmp_path / "remote.gguf", "Q8_0").path
    diffs = compare_gguf(remote, local)
    assert len(diffs) == 1, diffs
    assert "general.name" in diffs[0], diffs
    assert "'org/tiny'" in diffs[0], diffs  # named after the repo


def test_convert_command_writes_file_and_imports(tmp_path: Path, models_dir: Path) -> None:
    import argparse

    from localrt.cli.tools import cmd_convert as convert_command
    from localrt.errors import LocalrtError
    from localrt.store.store import Store

    model = write_tiny_model(tmp_path / "m", n_layer=1)
    args = argparse.Namespace(
        source=str(model), quant="q4_k_m", output=str(tmp_path / "out.gguf"), name=None, threads=1
    )
    assert convert_command(args) == 0
    args.output, args.name = None, "tiny:q4"
    assert convert_command(args) == 0
    stored = Store(models_dir).resolve("tiny:q4").model_path
    assert stored.read_bytes() == (tmp_path / "out.gguf").read_bytes()
    args.output = str(tmp_path / "x.gguf")
    with pytest.raises(LocalrtError, match="exactly one of"):
        convert_command(args)
    args.name, args.quant = None, "Q7"
    with pytest.raises(LocalrtError, match="choose one of"):
        convert_command(args)


# ---- memory: streaming, one tensor at a time ------------------------------------------------------
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork + exec, so it would include the test process
PEAK_RSS = """
import sys
from localrt.converters.convert import convert
convert(sys.argv[1], sys.argv[2], "Q8_0", threads=2)
print(next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_peak_memory_follows_largest_tensor_not_model(tmp_path: Path) -> None:
    peaks = []
    for layers in (4, 8):  # 27 MB and 54 MB of f16 weights; the interpreter with numpy is ~60 MB
        model = write_tiny_model(
            tmp_path / f"m{layers}",
            hidden=512,
            ff=1536,
            n_head=8,
            n_kv=8,
            n_layer=layers,
            vocab=512,
            dtype="F16",
        )
        out = subprocess.run(
            [sys.executable, "-c", PEAK_RSS, str(model), str(tmp_path / f"o{layers}.gguf")],
            capture_output=True,
            text=True,
            check=True,
        )
        peaks.append(int(out.stdout.split()[-1]))
        shutil.rmtree(model)
    assert peaks[1] < peaks[0] * 1.10, f"peak RSS {peaks[0]} KiB -> {peaks[1]} KiB with twice the layers"


# ---- pieces --------------------------------------------------------------------------------------------
def test_permute_rows_interleaves_halves_per_head() -> None:
    w = np.arange(2 * 8).reshape(8, 2)  # 2 heads of head_dim 4: rows [0 1 2 3 | 4 5 6 7]
    assert permute_rows(w, 2)[:, 0].tolist() == [0, 4, 2, 6, 8, 12, 10, 14]


def test_hyperparameters_fill_transformers_defaults() -> None:
    from localrt.converters.arch import find_arch

    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 300,
    }
    hp = hyperparameters(cfg, find_arch(cfg))
    assert hp["num_key_value_heads"] == 4
    assert hp["head_dim"] == 64
    assert hp["max_position_embeddings"] == 2048
    assert hp["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
