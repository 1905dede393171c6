"""Tiny random vision and reranker models, built with transformers and converted by llama.cpp's own
`convert_hf_to_gguf.py` (text part, `--mmproj` projector), cached under the test cache.

- `tiny_vlm()`: an Idefics3 (SmolVLM's architecture) checkpoint with a SigLIP vision tower of 2 layers on
  32x32 tiles and a 2-layer Llama text model, a SentencePiece vocabulary that holds the tokens llama.cpp's
  mtmd wraps Idefics3 images in. Returns (text GGUF, projector GGUF).
- `tiny_reranker()`: a random BERT sequence classifier with one label (a cross-encoder, like bge-reranker),
  converted to a GGUF whose pooling type is rank.
- `png_bytes()`: a deterministic test image.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.fixtures_hf import CACHE
from tests.fixtures_hf import CORPUS
from tests.fixtures_hf import llama_cpp_src

VLM_VERSION = "v1"  # bump when the recipe below changes, so the cache is rebuilt
# Idefics3 wraps each image in these (llama.cpp's mtmd looks them up in the vocabulary)
IMAGE_TOKENS = ["<fake_token_around_image>", "<global-img>", "<image>", "<row_1_col_1>", "<end_of_utterance>"]
VLM_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CONVERT_DRIVER = """
import json, sys
sys.argv = [sys.argv[1]]
sys.path.insert(0, sys.argv[0].rsplit('/', 1)[0])
import convert_hf_to_gguf as c
for args in json.loads(sys.stdin.read()):
    sys.argv = ['convert_hf_to_gguf.py', *args]
    c.main()
"""


def run_converter(jobs: list[list[str]]) -> None:
    """llama.cpp's converter over several argument lists in one process (torch is imported once)."""
    script = llama_cpp_src() / "convert_hf_to_gguf.py"
    proc = subprocess.run(
        [sys.executable, "-c", CONVERT_DRIVER, str(script)],
        input=json.dumps(jobs),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf failed:\n{proc.stderr[-3000:]}")


def _spm_vocab(out_dir: Path, symbols: list[str], vocab_size: int = 400) -> None:
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
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        # "\n\n" opens an Idefics3 image in mtmd; it must be one token of the vocabulary
        user_defined_symbols=["\n\n", *symbols],
        control_symbols=["<|im_start|>", "<|im_end|>"],
        minloglevel=2,
        num_threads=1,
    )
    (out_dir / "tokenizer.vocab").unlink()


def _write_vlm(hf: Path) -> None:
    import sentencepiece as spm
    import torch
    from transformers import Idefics3Config
    from transformers import Idefics3ForConditionalGeneration

    hf.mkdir(parents=True)
    _spm_vocab(hf, IMAGE_TOKENS)
    sp = spm.SentencePieceProcessor(model_file=str(hf / "tokenizer.model"))
    vocab = sp.get_piece_size()
    text = {
        "architectures": ["VLlama3ForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 32,
        "patch_size": 8,
    }
    config = Idefics3Config(
        vision_config=vision,
        text_config=text,
        scale_factor=2,
        image_token_id=sp.piece_to_id("<image>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # random init is near zero for some layers; spread it so images matter
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(hf, safe_serialization=True)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["text_config"]["architectures"] = ["VLlama3ForCausalLM"]
    (hf / "config.json").write_text(json.dumps(cfg, indent=2))
    (hf / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
                "add_eos_token": False,
                "chat_template": VLM_TEMPLATE,
            }
        )
    )
    (hf / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "size": {"longest_edge": 32},
                "max_image_size": {"longest_edge": 32},
            }
        )
    )


def tiny_vlm() -> tuple[Path, Path]:
    """(text GGUF, projector GGUF) of a tiny random Idefics3 model, built once."""
    root = CACHE / f"tiny-vlm-{VLM_VERSION}"
    model, proj = root / "tiny-vlm-f32.gguf", root / "mmproj-tiny-vlm-f32.gguf"
    if model.is_file() and proj.is_file():
        return model, proj
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    hf = tmp / "hf"
    _write_vlm(hf)
    run_converter(
        [
            [str(hf), "--outfile", str(tmp / model.name), "--outtype", "f32"],
            [str(hf), "--outfile", str(tmp / proj.name), "--outtype", "f32", "--mmproj"],
        ]
    )
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return model, proj


def png_bytes(
    seed: int = 0, size: tuple[int, int] = (40, 32), fmt: str = "PNG", solid: bool = False
) -> bytes:
    """A noisy RGB image (different seeds give different pictures); `solid`: one colour (compresses)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    if solid:
        pixels = np.full((size[1], size[0], 3), seed * 37 % 256, dtype=np.uint8)
    else:
        pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, fmt)
    return out.getvalue()


def tiny_reranker() -> Path:
    """A tiny random XLM-RoBERTa cross-encoder with one label (bge-reranker-v2-m3's architecture) as a GGUF
    with rank pooling, converted by llama.cpp's converter; built once. Its HF folder sits beside it."""
    root = CACHE / f"tiny-reranker-{RERANKER_VERSION}"
    out = root / "tiny-reranker-f32.gguf"
    if out.is_file():
        return out
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    hf = tmp / "hf"
    _write_reranker(hf)
    run_converter([[str(hf), "--outfile", str(tmp / out.name), "--outtype", "f32"]])
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return out


RERANKER_VERSION = "v3"


def _write_reranker(hf: Path) -> None:
    import sentencepiece as spm
    import torch
    from transformers import XLMRobertaConfig
    from transformers import XLMRobertaForSequenceClassification

    hf.mkdir(parents=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_prefix=str(hf / "sentencepiece.bpe"),
        vocab_size=100,  # a unigram model of this little text holds about 110 pieces
        model_type="unigram",
        character_coverage=1.0,
        minloglevel=2,
        num_threads=1,
    )
    (hf / "sentencepiece.bpe.vocab").unlink()
    n_spm = spm.SentencePieceProcessor(model_file=str(hf / "sentencepiece.bpe.model")).get_piece_size()
    config = XLMRobertaConfig(
        vocab_size=n_spm + 1,  # fairseq's layout: <s> <pad> </s> <unk>, then the pieces
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=130,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        num_labels=1,
        architectures=["XLMRobertaForSequenceClassification"],
    )
    torch.manual_seed(0)
    model = XLMRobertaForSequenceClassification(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.1)
    model.save_pretrained(hf, safe_serialization=True)
    special = {"bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>", "cls_token": "<s>"}
    (hf / "special_tokens_map.json").write_text(
        json.dumps({**special, "unk_token": "<unk>", "pad_token": "<pad>", "mask_token": "<mask>"})
    )
    (hf / "tokenizer_config.json").write_text(
        json.dumps(
            {
                **special,
                "tokenizer_class": "XLMRobertaTokenizer",
                "model_max_length": 128,
                # <s> query </s> ... document </s>, as XLM-R's tokenizer.json post-processor says
                "add_bos_token": True,
                "add_eos_token": True,
            }
        )
    )
