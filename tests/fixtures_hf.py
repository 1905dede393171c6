"""Tiny Hugging Face checkpoints and llama.cpp's own converter, for byte-identity tests.

- `write_tiny_model`: a random Llama / Qwen2 / Qwen3 checkpoint written with numpy (safetensors by hand,
  optionally sharded) and a SentencePiece tokenizer trained on a few sentences. No torch needed.
- `smollm2_hf_dir`: SmolLM2-135M-Instruct as HF safetensors, derived once from the real GGUF with
  transformers' GGUF loader and cached (needs torch + transformers).
- `llama_cpp_src`: llama.cpp's convert_hf_to_gguf.py and gguf-py from the llama-cpp-python sdist,
  fetched once with pip into the test cache (never into the repo).
- `compare_gguf`: every key (order, type, value) and every tensor (order, type, shape, bytes).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

CACHE = Path(os.environ.get("LOCALRT_TEST_CACHE", Path.home() / ".cache" / "localrt-tests"))
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
ORACLE_FILES = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b  # sums two numbers",
    "Numbers like 3.14159 and 2718 appear in many formulas.",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein; naïve café résumé.",
    "日本語のテキストも少しだけ含めます。",
    "Emoji are bytes too: 🦙 🚀 ✅",
] * 20


# ---- safetensors by hand ---------------------------------------------------------------------------
def bf16_bits(a: np.ndarray) -> np.ndarray:
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str) -> None:
    """dtype "F32", "F16" or "BF16" for every tensor; names sorted, header padded to 8 bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        a = np.asarray(tensors[name], dtype=np.float32)
        raw = {"F32": a, "F16": a.astype(np.float16), "BF16": bf16_bits(a)}[dtype].tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for raw in blobs:
            f.write(raw)


def train_sentencepiece(out_dir: Path, vocab_size: int = 400) -> None:
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_prefix=str(out_dir / "tokenizer"),
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        # Llama 2's settings: raw text kept as is (llama.cpp does not normalize), digits split
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        control_symbols=["<|im_start|>", "<|im_end|>"],
        minloglevel=2,
        num_threads=1,
    )
    (out_dir / "tokenizer.vocab").unlink()


ARCHES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def write_tiny_model(
    out_dir: Path,
    arch: str = "llama",
    hidden: int = 256,
    ff: int = 512,
    n_layer: int = 4,
    n_head: int = 4,
    n_kv: int = 1,
    vocab: int = 512,
    tied: bool = False,
    dtype: str = "F32",
    shards: int = 1,
    seed: int = 0,
    rope_scaling: dict[str, Any] | None = None,
) -> Path:
    """A random-weight checkpoint whose matrix rows are multiples of 256 (every k-quant path)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    hd = hidden // n_head
    t: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((vocab, hidden)) * 0.02,
        "model.norm.weight": 1 + rng.standard_normal(hidden) * 0.05,
    }
    if not tied:
        t["lm_head.weight"] = rng.standard_normal((vocab, hidden)) * 0.02
    for i in range(n_layer):
        p = f"model.layers.{i}."
        t |= {
            p + "input_layernorm.weight": 1 + rng.standard_normal(hidden) * 0.05,
            p + "post_attention_layernorm.weight": 1 + rng.standard_normal(hidden) * 0.05,
            p + "self_attn.q_proj.weight": rng.standard_normal((n_head * hd, hidden)) * 0.05,
            p + "self_attn.k_proj.weight": rng.standard_normal((n_kv * hd, hidden)) * 0.05,
            p + "self_attn.v_proj.weight": rng.standard_normal((n_kv * hd, hidden)) * 0.05,
            p + "self_attn.o_proj.weight": rng.standard_normal((hidden, n_head * hd)) * 0.05,
            p + "mlp.gate_proj.weight": rng.standard_normal((ff, hidden)) * 0.05,
            p + "mlp.up_proj.weight": rng.standard_normal((ff, hidden)) * 0.05,
            p + "mlp.down_proj.weight": rng.standard_normal((hidden, ff)) * 0.05,
        }
        if arch == "qwen2":
            for k, n in (("q", n_head), ("k", n_kv), ("v", n_kv)):
                t[p + f"self_attn.{k}_proj.bias"] = rng.standard_normal(n * hd) * 0.1
        if arch == "qwen3":
            t[p + "self_attn.q_norm.weight"] = 1 + rng.standard_normal(hd) * 0.05
            t[p + "self_attn.k_norm.weight"] = 1 + rng.standard_normal(hd) * 0.05
    names = sorted(t)
    if shards == 1:
        write_safetensors(out_dir / "model.safetensors", t, dtype)
    else:
        weight_map = {}
        for s in range(shards):
            part = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            chunk = {n: t[n] for n in names[s::shards]}
            write_safetensors(out_dir / part, chunk, dtype)
            weight_map |= dict.fromkeys(chunk, part)
        (out_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
    config: dict[str, Any] = {
        "architectures": [ARCHES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": ff,
        "num_hidden_layers": n_layer,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "vocab_size": vocab,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tied,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[dtype],
    }
    if arch == "qwen3":
        config["head_dim"] = hd
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    train_sentencepiece(out_dir, vocab_size=min(vocab, 400))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
                "add_eos_token": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    return out_dir


# ---- SmolLM2 as an HF checkpoint -----------------------------------------------------------------
def smollm2_hf_dir(gguf_path: Path, dtype: str = "bfloat16") -> Path:
    """SmolLM2-135M-Instruct in HF format (safetensors + tokenizer), built once from the real GGUF."""
    target = CACHE / f"smollm2-135m-hf-{dtype}"
    if (target / "model.safetensors").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM
    from transformers import AutoTokenizer
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, torch_dtype=torch.float32
    )
    cfg = loaded.config.to_dict()
    cfg.pop("quantization_config", None)  # a GGUF-loaded model refuses save_pretrained; a fresh one does not
    fresh = LlamaForCausalLM(LlamaConfig(**cfg)).to(getattr(torch, dtype))
    fresh.load_state_dict(loaded.state_dict())
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    fresh.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


class LlamaCppBuildReference:
    """`score` from another llama-cpp-python build (e.g. `llama_cpp_blas()`), one subprocess per call:
    a reference for `localrt.eval.evaluate`, which measures models the way `localrt eval` does."""

    def __init__(
        self, build: Path | None, gguf: Path, like: Any, threads: int = 1, repack: bool = True
    ) -> None:
        """`like`: a loaded model of the same file, whose vocabulary facts the reference shares."""
        self.build, self.gguf, self.threads, self.repack = build, gguf, threads, repack
        self.n_vocab, self.add_bos, self.bos_token_id = like.n_vocab, like.add_bos, like.bos_token_id

    async def score(self, tokens: list[int], return_logits: bool = False) -> Any:
        from localrt.backends.base import ScoreResult
        from localrt.backends.base import log_softmax

        logits = llama_cpp_logits_of_build(
            self.build, self.gguf, list(tokens), 512, self.threads, self.repack
        )[0][:-1]
        logprobs = log_softmax(logits)[np.arange(len(tokens) - 1), np.asarray(tokens[1:])]
        return ScoreResult(logprobs, logits if return_logits else None)


# ---- llama.cpp's converter and quantizer (the oracle) ----------------------------------------------
def llama_cpp_sdist() -> Path:
    """The pinned llama-cpp-python source distribution (llama.cpp's sources under vendor/), downloaded once."""
    dl = CACHE / "sdist"
    found = sorted(dl.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-binary",
                ":all:",
                "--no-deps",
                "-q",
                "-d",
                str(dl),
                LLAMA_CPP_PYTHON,
            ],
            check=True,
        )
        found = sorted(dl.glob("llama_cpp_python-*.tar.gz"))
    return found[0]


def llama_cpp_blas() -> Path:
    """A second build of the pinned llama-cpp-python, with OpenBLAS, in its own directory (put it first
    on PYTHONPATH to use it). Built once (about 15 minutes on 2 cores); needs OpenBLAS's headers
    (Debian: libopenblas-dev). With weight repacking off (`repack=False` below), its batched matmuls
    (32+ rows) all run in fp32 on dequantized weights, so its logits are the file's exact function,
    without the CPU kernels' 8-bit activation rounding."""
    target = CACHE / "llama-cpp-blas"
    if (target / "llama_cpp" / "__init__.py").is_file():
        return target
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    env = {**os.environ, "CMAKE_ARGS": "-DGGML_BLAS=ON -DGGML_BLAS_VENDOR=OpenBLAS"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-cache-dir",
            "-q",
            "--target",
            str(tmp),
            str(llama_cpp_sdist()),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"building llama-cpp-python with OpenBLAS failed (is libopenblas-dev installed?):\n"
            f"{proc.stderr[-2000:]}"
        )
    tmp.rename(target)
    return target


LLAMA_CPP_LOGITS = """
import pathlib, sys, numpy as np, llama_cpp
gguf, tokens, out = sys.argv[1], np.load(sys.argv[2]).tolist(), sys.argv[3]
n_batch, threads, repack = map(int, sys.argv[4:7])
default_params = llama_cpp.llama_cpp.llama_model_default_params
def model_params():  # llama-cpp-python's Llama has no argument for this llama.cpp model parameter
    params = default_params()
    params.use_extra_bufts = bool(repack)  # the CPU backend's repacked weights (Q4_0, Q4_K, ...)
    return params
llama_cpp.llama_cpp.llama_model_default_params = model_params
llm = llama_cpp.Llama(gguf, logits_all=True, n_ctx=len(tokens) + 8, n_batch=n_batch, n_ubatch=n_batch,
                      n_threads=threads, verbose=False)
llm.eval(tokens)
np.save(out, np.asarray(llm.scores[: len(tokens)], dtype=np.float32))
print(any(pathlib.Path(llama_cpp.__file__).parent.glob("lib/*ggml-blas*")))  # the BLAS backend's library
"""


def llama_cpp_logits_of_build(
    build: Path | None,
    gguf: Path,
    tokens: list[int],
    n_batch: int = 512,
    threads: int = 1,
    repack: bool = True,
) -> tuple[np.ndarray, bool]:
    """(logits [n, vocab] of every position, whether that build has BLAS) from llama.cpp with its
    defaults otherwise (f16 KV, no flash attention), in a subprocess: `build` is a directory holding
    another llama-cpp-python (None: the installed one); two builds cannot share a process.
    `repack=False` turns off the CPU backend's repacked weight layouts, whose matmuls stay on the CPU
    kernels (8-bit activations) even in a BLAS build."""
    import tempfile

    env = dict(os.environ)
    if build is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(build), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp) / "tokens.npy", np.asarray(tokens, dtype=np.int64))
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                LLAMA_CPP_LOGITS,
                str(gguf),
                str(Path(tmp) / "tokens.npy"),
                str(Path(tmp) / "out.npy"),
                str(n_batch),
                str(threads),
                str(int(repack)),
            ],
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"llama.cpp ({build or 'installed'}) failed:\n{proc.stderr[-2000:]}")
        return np.load(Path(tmp) / "out.npy"), proc.stdout.strip().endswith("True")


def llama_cpp_src() -> Path:
    """Directory holding convert_hf_to_gguf.py, conversion/ and gguf-py/ from the pinned sdist."""
    root = CACHE / "llama.cpp-src"
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    archive = llama_cpp_sdist()
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            rel = member.name.split("/vendor/llama.cpp/", 1)
            if len(rel) == 2 and rel[1].startswith(ORACLE_FILES) and (member.isfile() or member.isdir()):
                member.name = rel[1]
                tar.extract(member, tmp, filter="data")
    tmp.rename(root)
    return root


def convert_lora_script() -> Path:
    """llama.cpp's convert_lora_to_gguf.py from the pinned sdist, placed beside convert_hf_to_gguf.py
    (it imports that script's conversion/ and gguf-py/)."""
    script = llama_cpp_src() / "convert_lora_to_gguf.py"
    if script.is_file():
        return script
    with tarfile.open(llama_cpp_sdist()) as tar:
        member = next(
            m for m in tar.getmembers() if m.name.endswith("/vendor/llama.cpp/convert_lora_to_gguf.py")
        )
        data = tar.extractfile(member).read()  # type: ignore[union-attr]
    tmp = script.with_name(script.name + ".tmp")
    tmp.write_bytes(data)
    tmp.rename(script)
    return script


def peft_lora_gguf(model_dir: Path, work: Path, seed: int = 0) -> tuple[Path, Path]:
    """A PEFT LoRA on the checkpoint at `model_dir` with random non-zero B matrices (so it changes the
    outputs without training), and its GGUF made by llama.cpp's convert_lora_to_gguf.py (f32).
    Returns (the PEFT folder, the GGUF)."""
    peft_dir, out = work / "peft-lora", work / "lora-f32.gguf"
    if not out.is_file():
        proc = subprocess.run(
            [sys.executable, "-c", PEFT_DRIVER, str(model_dir), str(peft_dir), str(seed)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"making the PEFT LoRA failed:\n{proc.stderr[-3000:]}")
        oracle_lora(model_dir, peft_dir, out, "f32")
    return peft_dir, out


def oracle_lora(model_dir: Path, peft_dir: Path, out: Path, outtype: str) -> Path:
    """llama.cpp's convert_lora_to_gguf.py on the PEFT folder `peft_dir` for the base at `model_dir`."""
    cmd = [sys.executable, str(convert_lora_script()), "--base", str(model_dir), "--outtype", outtype]
    proc = subprocess.run([*cmd, "--outfile", str(out), str(peft_dir)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"convert_lora_to_gguf failed:\n{proc.stderr[-3000:]}")
    return out


PEFT_DRIVER = """
import sys, torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
base, out, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
lora = get_peft_model(model, config)
g = torch.Generator().manual_seed(seed)
with torch.no_grad():  # PEFT starts B at zero (no change); random B makes the adapter matter
    for name, p in lora.named_parameters():
        if "lora_B" in name:
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
lora.save_pretrained(out)
"""


LLAMA_CPP_TOOLS = ("llama-server", "llama-imatrix", "llama-quantize")


def llama_cpp_tools() -> Path:
    """The `bin/` directory of llama.cpp's own tools (llama-server, llama-imatrix, llama-quantize) built
    from the llama.cpp sources vendored in the pinned sdist, with CMake and Ninja (no curl, no OpenSSL).

    Built once under the test cache, outside the repository (about 20 minutes on 2 cores); a file lock
    lets parallel test processes and benchmarks share one build.
    """
    from filelock import FileLock

    build = CACHE / "llama.cpp-tools"
    bin_dir = build / "build" / "bin"
    if all((bin_dir / tool).is_file() for tool in LLAMA_CPP_TOOLS):
        return bin_dir
    CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(CACHE / "llama.cpp-tools.lock")):
        if all((bin_dir / tool).is_file() for tool in LLAMA_CPP_TOOLS):
            return bin_dir
        src = build / "src"
        if not (src / "CMakeLists.txt").is_file():
            shutil.rmtree(src, ignore_errors=True)
            with tarfile.open(llama_cpp_sdist()) as tar:
                for member in tar.getmembers():
                    rel = member.name.split("/vendor/llama.cpp/", 1)
                    if len(rel) == 2 and rel[1] and (member.isfile() or member.isdir()):
                        member.name = rel[1]
                        tar.extract(member, src, filter="data")
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        configure = [
            "cmake",
            "-S",
            str(src),
            "-B",
            str(build / "build"),
            *generator,
            "-DCMAKE_BUILD_TYPE=Release",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_OPENSSL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DGGML_NATIVE=ON",
        ]
        for cmd in (
            configure,
            [
                "cmake",
                "--build",
                str(build / "build"),
                "-j",
                str(os.cpu_count() or 2),
                "--target",
                *LLAMA_CPP_TOOLS,
            ],
        ):
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(
                    f"building llama.cpp's tools failed ({' '.join(cmd[:3])}):\n{proc.stderr[-2000:]}"
                )
    return bin_dir


ORACLE_DRIVER = """
import json, sys
sys.argv = [sys.argv[1]]
sys.path.insert(0, sys.argv[0].rsplit('/', 1)[0])
import convert_hf_to_gguf as c
for model, out, outtype in json.loads(sys.stdin.read()):
    sys.argv = ['convert_hf_to_gguf.py', model, '--outfile', out, '--outtype', outtype]
    c.main()
"""


def oracle_convert_many(jobs: list[tuple[Path, Path, str]]) -> None:
    """Run llama.cpp's convert_hf_to_gguf.py for (model dir, out file, outtype) jobs in one process.

    One process pays the torch + transformers import once; needs both installed.
    """
    jobs = [(m, o, t) for m, o, t in jobs if not Path(o).is_file()]
    if not jobs:
        return
    script = llama_cpp_src() / "convert_hf_to_gguf.py"
    payload = json.dumps([[str(m), str(o), t] for m, o, t in jobs])
    proc = subprocess.run(
        [sys.executable, "-c", ORACLE_DRIVER, str(script)], input=payload, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf failed:\n{proc.stderr[-3000:]}")


def auto_outtype(model_dir: Path) -> str:
    """What --outtype auto picks: bf16 or f16 after the first matrix's dtype, else f16."""
    from localrt.converters.hf import index_tensors

    for t in index_tensors(model_dir).values():
        if t.ndim >= 2 and t.dtype in ("BF16", "F16"):
            return t.dtype.lower()
    return "f16"


def oracle_float(model_dir: Path, work: Path, outtype: str) -> Path:
    out = work / f"oracle-{outtype}.gguf"
    oracle_convert_many([(model_dir, out, outtype)])
    return out


def oracle_quantize(src: Path, dst: Path, file_type: str) -> Path:
    import llama_cpp

    from localrt.converters import mixes

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(mixes.FILE_TYPES[file_type][0])
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed for {file_type}")
    return dst


def oracle_file(model_dir: Path, work: Path, file_type: str) -> Path:
    """What llama.cpp makes for `file_type`: convert (f32/f16/bf16 directly, else auto + quantize).

    The auto conversion is the bf16 or f16 file, shared with a float type of the same name.
    """
    if file_type in ("F32", "F16", "BF16"):
        return oracle_float(model_dir, work, file_type.lower())
    dst = work / f"oracle-{file_type}.gguf"
    if not dst.is_file():
        oracle_quantize(oracle_float(model_dir, work, auto_outtype(model_dir)), dst, file_type)
    return dst


# ---- comparison ---------------------------------------------------------------------------------------
def compare_gguf(ours: Path, theirs: Path) -> list[str]:
    """Differences in keys (order, types, raw values) and tensors (order, type, shape, bytes)."""
    from gguf import GGUFReader

    a, b = GGUFReader(ours), GGUFReader(theirs)

    def fields(r: GGUFReader) -> dict[str, tuple[list[str], list[bytes]]]:
        return {
            k: ([t.name for t in f.types], [bytes(f.parts[i]) for i in f.data])
            for k, f in r.fields.items()
            if not k.startswith("GGUF.")
        }

    fa, fb = fields(a), fields(b)
    out = []
    if list(fa) != list(fb):
        out.append(f"key order: ours {list(fa)} vs llama.cpp {list(fb)}")
    for key in fa.keys() & fb.keys():
        if fa[key] != fb[key]:
            va, vb = a.fields[key].contents(), b.fields[key].contents()
            if isinstance(va, list) and isinstance(vb, list) and len(va) == len(vb):
                i = next(i for i, (x, y) in enumerate(zip(va, vb)) if x != y)
                out.append(f"{key}[{i}]: ours {va[i]!r} vs llama.cpp {vb[i]!r}")
            else:
                out.append(
                    f"{key}: ours {fa[key][0]} {str(va)[:80]!r} vs llama.cpp {fb[key][0]} {str(vb)[:80]!r}"
                )
    names_a, names_b = [t.name for t in a.tensors], [t.name for t in b.tensors]
    if names_a != names_b:
        out.append(f"tensor order: ours {names_a[:8]}... vs llama.cpp {names_b[:8]}...")
    tb = {t.name: t for t in b.tensors}
    for t in a.tensors:
        u = tb.get(t.name)
        if u is None:
            out.append(f"{t.name}: not in llama.cpp's file")
        elif t.tensor_type != u.tensor_type or list(t.shape) != list(u.shape):
            out.append(
                f"{t.name}: ours {t.tensor_type.name}{list(t.shape)} vs llama.cpp {u.tensor_type.name}{list(u.shape)}"
            )
        elif t.data.tobytes() != u.data.tobytes():
            out.append(f"{t.name}: {t.tensor_type.name} bytes differ")
    if not out and ours.read_bytes() != theirs.read_bytes():
        out.append("files differ outside keys and tensor data (padding, alignment?)")
    return out
