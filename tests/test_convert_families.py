"""`localrt convert` for Gemma 3, Gemma 2, Phi-3, Qwen3-MoE and OLMoE against llama.cpp's own converter.

The oracle is llama.cpp's convert_hf_to_gguf.py (from the llama-cpp-python sdist, fetched into the test
cache), followed for quantized types by `llama_model_quantize`. Every key (order, type, value) and
every tensor (order, type, shape, bytes) must be equal. The tiny models come from
tests/fixtures_families.py: per family one whose rows are multiples of 256 (every k-quant path) and
one whose rows are not (the 32-block fallbacks). The default suite checks the 16-bit file and
Q4_K_M of each; `-m slow` sweeps every file type.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from localrt.converters import mixes
from localrt.converters.convert import convert
from localrt.converters.hf import ConvertError
from tests.fixtures_families import GEMMA_TEMPLATE
from tests.fixtures_families import smollm2_tokenizer_json
from tests.fixtures_families import tokenizer_json_dir
from tests.fixtures_families import tokenizer_json_from_gguf
from tests.fixtures_families import write_family_model
from tests.fixtures_hf import auto_outtype
from tests.fixtures_hf import compare_gguf
from tests.fixtures_hf import oracle_convert_many
from tests.fixtures_hf import oracle_file

pytest.importorskip("sentencepiece")
llama_cpp = pytest.importorskip("llama_cpp")

ROWS320 = dict(hidden=320, ff=640, n_head=5, n_kv=1, head_dim=64, vocab=384)
MODELS: dict[str, dict[str, Any]] = {
    # f32 weights (the auto outtype rounds to f16), tied embeddings, window 64
    "gemma3": dict(family="gemma3"),
    # bf16 in two shards, linear RoPE scaling of the global layers, final-logit soft-capping
    "gemma3-bf16": dict(
        family="gemma3",
        dtype="BF16",
        shards=2,
        n_layer=2,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    ),
    "gemma3-rows320": dict(family="gemma3", n_layer=2, **ROWS320),
    # f16 weights: the 1 + w of the norms is an f16 add, as in llama.cpp's converter
    "gemma2": dict(family="gemma2", dtype="F16"),
    "gemma2-rows320": dict(family="gemma2", n_layer=2, **ROWS320),
    # LongRoPE (factors + attention factor), f16 weights
    "phi3": dict(family="phi3", dtype="F16", longrope=True, context=8192, original_context=2048),
    # partial rotary, no rope scaling, f32
    "phi3-rows320": dict(family="phi3", n_layer=2, partial_rotary_factor=0.5, **ROWS320),
    # one tensor per expert, bf16
    "qwen3moe": dict(family="qwen3moe", dtype="BF16"),
    # transformers 5's 3-D expert tensors, f16 in three shards
    "qwen3moe-3d": dict(family="qwen3moe", dtype="F16", shards=3, experts_3d=True),
    "qwen3moe-rows320": dict(family="qwen3moe", n_layer=2, moe_ff=160, **(ROWS320 | {"vocab": 49152})),
    # OLMoE: q/k norms over the whole projection, experts intermediate_size wide, bf16
    "olmoe": dict(family="olmoe", dtype="BF16"),
    "olmoe-rows320": dict(family="olmoe", n_layer=2, **(ROWS320 | {"n_kv": 5, "vocab": 49152})),
}
SLOW_FULL = ("gemma3", "gemma2", "phi3", "qwen3moe", "olmoe")  # every file type under -m slow
QUANT_TYPES = [t for t in mixes.FILE_TYPES if t not in ("F32", "F16", "BF16")]


def needs_oracle() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Every tiny model with llama.cpp's auto conversion of it (one converter process for all)."""
    needs_oracle()
    out = {}
    for name, kw in MODELS.items():
        work = tmp_path_factory.mktemp(name)
        out[name] = (write_family_model(work / "model", **kw), work)
    oracle_convert_many([(m, w / f"oracle-{auto_outtype(m)}.gguf", auto_outtype(m)) for m, w in out.values()])
    return out


def assert_same_as_llama_cpp(models: dict[str, tuple[Path, Path]], name: str, file_type: str) -> None:
    model, work = models[name]
    theirs = oracle_file(model, work, file_type)
    ours = convert(model, work / f"ours-{file_type}.gguf", file_type, threads=1).path
    diffs = compare_gguf(ours, theirs)
    assert not diffs, "\n".join(diffs[:20])


def _default_cases() -> list[Any]:
    cases = []
    for name, kw in MODELS.items():
        auto = {"F32": "F16", "F16": "F16", "BF16": "BF16"}[kw.get("dtype", "F32")]
        cases += [
            pytest.param(name, auto, id=f"{name}-{auto}"),
            pytest.param(name, "Q4_K_M", id=f"{name}-Q4_K_M"),
        ]
    return cases


@pytest.mark.parametrize(("name", "file_type"), _default_cases())
def test_family_matches_llama_cpp(models: dict[str, tuple[Path, Path]], name: str, file_type: str) -> None:
    assert_same_as_llama_cpp(models, name, file_type)


@pytest.mark.slow
@pytest.mark.parametrize("file_type", list(mixes.FILE_TYPES))
@pytest.mark.parametrize("name", SLOW_FULL)
def test_every_file_type_matches_llama_cpp(
    models: dict[str, tuple[Path, Path]], name: str, file_type: str
) -> None:
    assert_same_as_llama_cpp(models, name, file_type)


@pytest.mark.slow
@pytest.mark.parametrize("file_type", ["Q8_0", "Q2_K", "Q3_K_M", "Q4_K_S", "Q5_K_M", "Q6_K", "IQ4_XS"])
@pytest.mark.parametrize("name", [n for n in MODELS if n not in SLOW_FULL])
def test_variants_match_llama_cpp_in_more_file_types(
    models: dict[str, tuple[Path, Path]], name: str, file_type: str
) -> None:
    assert_same_as_llama_cpp(models, name, file_type)


# ---- Gemma 3 with a tokenizer.json and no tokenizer.model ------------------------------------------------
JSON_DIMS = dict(hidden=64, ff=128, n_layer=1, n_head=1, n_kv=1, head_dim=64)


def _json_only_gemma3(tokenizer: Path, vocab: int, work: Path) -> Path:
    base = write_family_model(work / "base", "gemma3", dtype="BF16", vocab=vocab, **JSON_DIMS)
    return tokenizer_json_dir(base, tokenizer, work / "model")


def test_gemma3_with_only_a_tokenizer_json_matches_llama_cpp(tmp_path: Path) -> None:
    """A GPT-2-style tokenizer.json (SmolLM2's, small and quick) on a Gemma 3 checkpoint: llama.cpp's
    converter then reads the vocabulary as BPE."""
    needs_oracle()
    model = _json_only_gemma3(smollm2_tokenizer_json(), 49152, tmp_path)
    for file_type in ("BF16", "Q8_0"):
        theirs = oracle_file(model, tmp_path, file_type)
        diffs = compare_gguf(
            convert(model, tmp_path / f"ours-{file_type}.gguf", file_type, threads=1).path, theirs
        )
        assert not diffs, "\n".join(diffs[:20])


@pytest.mark.slow
def test_gemma3_with_gemma3s_own_tokenizer_json_matches_llama_cpp(gemma3_gguf: Path, tmp_path: Path) -> None:
    """Gemma 3's real 262,144-token vocabulary as tokenizer.json only (SentencePiece-style BPE with
    byte fallback), taken from the Gemma 3 270M GGUF: the fingerprint llama.cpp names, every token."""
    needs_oracle()
    tokenizer = tokenizer_json_from_gguf(gemma3_gguf, "gemma3-tokenizer-json", GEMMA_TEMPLATE)
    model = _json_only_gemma3(tokenizer, 262144, tmp_path)
    for file_type in ("BF16", "Q4_K_M"):
        theirs = oracle_file(model, tmp_path, file_type)
        diffs = compare_gguf(
            convert(model, tmp_path / f"ours-{file_type}.gguf", file_type, threads=1).path, theirs
        )
        assert not diffs, "\n".join(diffs[:20])


# ---- what the files say, read back by llama.cpp ---------------------------------------------------------
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " a leading space,\ttabs\nand newlines\n\n",
    "Numbers 3.14159 and 2718; naïve café, 日本語, 🦙🚀",
    "",
]


def _gguf(models: dict[str, tuple[Path, Path]], name: str) -> Path:
    """Our conversion of a model to its 16-bit type (shared with the byte-identity test)."""
    model, work = models[name]
    file_type = auto_outtype(model).upper()
    path = work / f"ours-{file_type}.gguf"
    return path if path.is_file() else convert(model, path, file_type, threads=1).path


@pytest.mark.parametrize("name", ["gemma3", "gemma2", "phi3"])
def test_sentencepiece_vocab_tokenizes_like_sentencepiece(
    models: dict[str, tuple[Path, Path]], name: str
) -> None:
    import sentencepiece as spm

    model, _ = models[name]
    sp = spm.SentencePieceProcessor(model_file=str(model / "tokenizer.model"))
    vocab = llama_cpp.Llama(str(_gguf(models, name)), vocab_only=True, verbose=False)
    for text in TEXTS:
        assert vocab.tokenize(text.encode(), add_bos=False, special=False) == sp.encode(text), text


def test_gemma_special_tokens_are_single_tokens(models: dict[str, tuple[Path, Path]]) -> None:
    vocab = llama_cpp.Llama(str(_gguf(models, "gemma3")), vocab_only=True, verbose=False)
    turn = "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    ids = vocab.tokenize(turn.encode(), add_bos=True, special=True)
    assert ids[:2] == [2, 4]  # <bos>, <start_of_turn>
    assert ids.count(5) == 1  # <end_of_turn>
    assert vocab.tokenize(b"<start_of_image>", add_bos=False, special=True) == [400]
    # the user-defined added token "\u2581\u2581" is stored as two spaces and matched as one token
    assert 402 in vocab.tokenize(b"a  b", add_bos=False, special=False)


def test_chat_template_is_copied(models: dict[str, tuple[Path, Path]]) -> None:
    from gguf import GGUFReader

    for name in ("gemma3", "phi3", "qwen3moe"):
        model, _ = models[name]
        field = GGUFReader(_gguf(models, name)).fields["tokenizer.chat_template"]
        template = json.loads((model / "tokenizer_config.json").read_text())["chat_template"]
        assert field.contents() == template, name


# ---- bad input -----------------------------------------------------------------------------------------------
def test_incomplete_experts_are_named(tmp_path: Path) -> None:
    model = write_family_model(tmp_path / "m", "qwen3moe", n_layer=1)
    cfg_path = model / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_experts"] = 5
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ConvertError, match="incomplete experts"):
        convert(model, tmp_path / "out.gguf", "Q8_0")
    assert not list(tmp_path.glob("out.gguf*"))


def test_phi3_longrope_factors_of_the_wrong_length(tmp_path: Path) -> None:
    model = write_family_model(
        tmp_path / "m", "phi3", n_layer=1, longrope=True, context=8192, original_context=2048
    )
    cfg = json.loads((model / "config.json").read_text())
    cfg["rope_scaling"]["long_factor"] = cfg["rope_scaling"]["long_factor"][:-1]
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConvertError, match="long_factor and short_factor must both have 32 values"):
        convert(model, tmp_path / "out.gguf", "F16")


def test_convert_help_names_every_architecture() -> None:
    from localrt.cli.tools import CONVERT_ARCHITECTURES
    from localrt.converters.arch import registry

    for hf_name in registry():
        assert hf_name in CONVERT_ARCHITECTURES, hf_name
