"""Tiny stand-ins for each model family's chat template and special tokens, for the thinking and tool-call
tests. Each template is written from the family's documented prompt format (the reference notes on
agent APIs, sections 2 and 3): the same markers, roles, tool rendering and generation prompt, trimmed
to what the tests exercise. The GGUFs are random-weight tiny Llamas; a grammar forces the reply.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tests.gguf_factory import TOKEN_CONTROL
from tests.gguf_factory import TOKEN_USER_DEFINED
from tests.gguf_factory import write_tiny_llama


@dataclass(frozen=True)
class Family:
    name: str
    template: str
    specials: tuple[tuple[str, int], ...]

    def write(self, path: Path) -> Path:
        return write_tiny_llama(
            path, chat_template=self.template, extra_specials=self.specials, context_length=4096
        )


# Qwen3 (hybrid): ChatML; tools listed in the system turn inside <tools>; calls as <tool_call> JSON;
# tool results as <tool_response> in a user turn; `enable_thinking=false` closes an empty think block.
QWEN3 = Family(
    "qwen3",
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if message.reasoning_content and loop.last %}<think>\n{{ message.reasoning_content }}\n</think>\n\n"
    "{% endif %}{{ message.content }}"
    "{% for tool_call in message.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ tool_call.function.name }}", "arguments": {{ tool_call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}",
    (
        ("<think>", TOKEN_USER_DEFINED),
        ("</think>", TOKEN_USER_DEFINED),
        ("<tool_call>", TOKEN_USER_DEFINED),
        ("</tool_call>", TOKEN_USER_DEFINED),
    ),
)

# DeepSeek-R1: the generation prompt already opens <think>; the model writes its reasoning, </think>,
# then the answer. Earlier answers are kept without their thinking.
DEEPSEEK_R1 = Family(
    "deepseek-r1",
    "{{ bos_token }}{% for message in messages %}"
    "{% if message.role == 'system' %}{{ message.content }}"
    "{% elif message.role == 'user' %}<｜User｜>{{ message.content }}"
    "{% elif message.role == 'assistant' %}<｜Assistant｜>"
    "{% set content = message.content %}{% if '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}{{ content }}<｜end▁of▁sentence｜>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}",
    (
        ("<｜User｜>", TOKEN_CONTROL),
        ("<｜Assistant｜>", TOKEN_CONTROL),
        ("<｜end▁of▁sentence｜>", TOKEN_CONTROL),
        ("<think>", TOKEN_USER_DEFINED),
        ("</think>", TOKEN_USER_DEFINED),
    ),
)

# gpt-oss (harmony): a system message with the reasoning effort and the valid channels, a developer
# message with the tools as a TypeScript namespace, tool calls on `commentary` to `functions.NAME`,
# tool results from `functions.NAME to=assistant`; the generation prompt is `<|start|>assistant`.
HARMONY = Family(
    "gpt-oss",
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\n\n"
    "Reasoning: {{ reasoning_effort if reasoning_effort is defined else 'medium' }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "{% if tools %}\nCalls to these tools must go to the commentary channel: 'functions'.{% endif %}"
    "<|end|>"
    "{% if tools or messages[0].role == 'system' %}<|start|>developer<|message|>"
    "{% if messages[0].role == 'system' %}# Instructions\n\n{{ messages[0].content }}\n\n{% endif %}"
    "{% if tools %}# Tools\n\n## functions\n\nnamespace functions {\n"
    "{% for tool in tools %}\n// {{ tool.function.description }}\n"
    "type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;\n"
    "{% endfor %}\n} // namespace functions{% endif %}<|end|>{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' %}<|start|>user<|message|>{{ message.content }}<|end|>"
    "{% elif message.role == 'assistant' %}"
    "{% if message.tool_calls %}{% for tc in message.tool_calls %}"
    "<|start|>assistant<|channel|>commentary to=functions.{{ tc.function.name }} <|constrain|>json"
    "<|message|>{{ tc.function.arguments | tojson }}<|call|>{% endfor %}"
    "{% else %}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>{% endif %}"
    "{% elif message.role == 'tool' %}<|start|>functions.{{ message.tool_name or 'tool' }} to=assistant"
    "<|channel|>commentary<|message|>{{ message.content | tojson }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}",
    tuple(
        (t, TOKEN_CONTROL)
        for t in (
            "<|start|>",
            "<|end|>",
            "<|message|>",
            "<|channel|>",
            "<|constrain|>",
            "<|return|>",
            "<|call|>",
        )
    ),
)

# Llama 3.1/3.2: header tokens; tools offered in the (last) user turn with the JSON instruction; the
# model answers `{"name": ..., "parameters": ...}`; results come back in the `ipython` role.
LLAMA3 = Family(
    "llama3",
    "{{ bos_token }}{% for message in messages %}"
    "{% if message.role == 'user' and loop.last and tools %}"
    "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a "
    "JSON for a function call with its proper arguments that best answers the given prompt.\n\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
    "value}. Do not use variables.\n\n{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}"
    "{{ message.content }}<|eot_id|>"
    "{% elif message.role == 'assistant' and message.tool_calls %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% for tc in message.tool_calls %}"
    '{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}'
    "{% endfor %}<|eot_id|>"
    "{% elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    "{{ message.content }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
    (
        ("<|start_header_id|>", TOKEN_CONTROL),
        ("<|end_header_id|>", TOKEN_CONTROL),
        ("<|eot_id|>", TOKEN_CONTROL),
        ("<|python_tag|>", TOKEN_CONTROL),
    ),
)

# Mistral (v3 tokenizer, e.g. 7B v0.3 / Nemo): [AVAILABLE_TOOLS] before the last user turn, calls as
# [TOOL_CALLS] + a JSON list, results as [TOOL_RESULTS] with the 9-character call id.
MISTRAL = Family(
    "mistral",
    "{{ bos_token }}{% for message in messages %}"
    "{% if message.role == 'user' %}"
    "{% if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST]{{ message.content }}[/INST]"
    "{% elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS]["
    "{% for tc in message.tool_calls %}"
    "{% if tc.id is not defined or tc.id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}, '
    '"id": "{{ tc.id }}"}{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}'
    "{% elif message.role == 'assistant' %}{{ message.content }}{{ eos_token }}"
    "{% elif message.role == 'tool' %}"
    "{% if message.tool_call_id is not defined or message.tool_call_id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    '[TOOL_RESULTS]{"content": {{ message.content | tojson }}, "call_id": "{{ message.tool_call_id }}"}'
    "[/TOOL_RESULTS]{% endif %}{% endfor %}",
    tuple(
        (t, TOKEN_CONTROL)
        for t in (
            "[INST]",
            "[/INST]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_CALLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        )
    ),
)

# Granite 3.x: roles between <|start_of_role|> and <|end_of_role|>, tools in an `available_tools`
# turn, calls as <|tool_call|> + a JSON list, results in the `tool_response` role.
GRANITE = Family(
    "granite",
    "{% if tools %}<|start_of_role|>available_tools<|end_of_role|>"
    "{% for t in tools %}{{ t | tojson(indent=4) }}{% if not loop.last %}\n\n{% endif %}{% endfor %}"
    "<|end_of_text|>\n{% endif %}{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}"
    "<|start_of_role|>assistant<|end_of_role|><|tool_call|>{{ message.tool_calls | map(attribute='function')"
    " | list | tojson }}<|end_of_text|>\n"
    "{% elif message.role == 'tool' %}<|start_of_role|>tool_response<|end_of_role|>{{ message.content }}"
    "<|end_of_text|>\n{% else %}<|start_of_role|>{{ message.role }}<|end_of_role|>{{ message.content }}"
    "<|end_of_text|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|>{% endif %}",
    (
        ("<|start_of_role|>", TOKEN_CONTROL),
        ("<|end_of_role|>", TOKEN_CONTROL),
        ("<|end_of_text|>", TOKEN_CONTROL),
        ("<|tool_call|>", TOKEN_CONTROL),
    ),
)

# Phi-4-mini: tools inside <|tool|>…<|/tool|> in the system turn; calls as `functools[...]`.
PHI4 = Family(
    "phi4",
    "{% for message in messages %}"
    "{% if message.role == 'system' and tools %}<|system|>{{ message.content }}<|tool|>{{ tools | tojson }}"
    "<|/tool|><|end|>{% elif message.role == 'assistant' and message.tool_calls %}<|assistant|>functools"
    "{{ message.tool_calls | map(attribute='function') | list | tojson }}<|end|>"
    "{% else %}<|{{ message.role }}|>{{ message.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    tuple(
        (t, TOKEN_CONTROL)
        for t in ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|/tool|>", "<|end|>")
    ),
)

# Qwen3-Coder: ChatML without thinking; tools listed in the system turn, calls written as XML inside
# <tool_call> (`<function=NAME>` with one `<parameter=NAME>` block per argument), results in <tool_response>.
QWEN3_CODER = Family(
    "qwen3-coder",
    "<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}"
    "{% else %}You are Qwen, a helpful assistant.{% endif %}"
    "{% if tools %}\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>"
    "{% for tool in tools %}\n<function>\n<name>{{ tool.function.name }}</name>\n<parameters>"
    "{% for p in tool.function.parameters.properties %}\n<parameter>\n<name>{{ p }}</name>\n</parameter>"
    "{% endfor %}\n</parameters>\n</function>{% endfor %}\n</tools>\n\n"
    "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
    "</parameter>\n</function>\n</tool_call>{% endif %}<|im_end|>\n"
    "{% for message in messages %}"
    "{% if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}"
    "{% for tc in message.tool_calls or [] %}\n<tool_call>\n<function={{ tc.function.name }}>\n"
    "{% for k, v in tc.function.arguments.items() %}<parameter={{ k }}>\n"
    "{{ v if v is string else v | tojson }}\n</parameter>\n{% endfor %}</function>\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    (("<tool_call>", TOKEN_USER_DEFINED), ("</tool_call>", TOKEN_USER_DEFINED)),
)

FAMILIES = {f.name: f for f in (QWEN3, DEEPSEEK_R1, HARMONY, LLAMA3, MISTRAL, GRANITE, PHI4, QWEN3_CODER)}


FIRST_SPECIAL_ID = 5  # tiny_spm_vocab puts the extra specials right after <unk> <s> </s> and ChatML's two


def gbnf_literal(text: str, specials: tuple[tuple[str, int], ...] = ()) -> str:
    """A GBNF sequence that spells `text` exactly, each special token as that very token (`<[id]>`)."""
    import json
    import re

    ids = {t: FIRST_SPECIAL_ID + i for i, (t, _) in enumerate(specials)}
    if not ids:
        return json.dumps(text)
    names = sorted(ids, key=len, reverse=True)
    parts = re.split("(" + "|".join(re.escape(n) for n in names) + ")", text)
    return " ".join(f"<[{ids[p]}]>" if p in ids else json.dumps(p) for p in parts if p)


def forced(text: str, family: Family | None = None) -> str:
    """A grammar whose only sentence is `text` (llama.cpp then samples exactly it, token by token)."""
    return "root ::= " + gbnf_literal(text, family.specials if family else ())


# ---- the official templates (llama.cpp's models/templates/, copied into tests/templates/) ------------
TEMPLATES = Path(__file__).parent / "templates"
_CONTROL = re.compile(r"<[|｜][^<>]*[|｜]>|<\|[^<>|]*>|<[^<>|]*\|>|\[/?[A-Z_]+\]|\]<\]minimax\[>\[")
_TAG = re.compile(r"</?[^<>\s]+>")


def marker_specials(markers: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    """The format's markers as the model's vocabulary has them: `<|x|>`, `<｜x｜>`, `[X]` as control tokens
    (dropped from text unless the runtime keeps them), XML-like tags as user-defined ones (always text);
    a marker that is plain text (`<function=`) stays text."""
    out: list[tuple[str, int]] = []
    for m in dict.fromkeys(markers):
        if _CONTROL.fullmatch(m):
            out.append((m, TOKEN_CONTROL))
        elif _TAG.fullmatch(m):
            out.append((m, TOKEN_USER_DEFINED))
    return tuple(out)


@dataclass(frozen=True)
class Official:
    """A family with its official template, and a reply calling `get_weather(city="Paris", days=3)`
    written exactly as that template renders an assistant's call."""

    name: str
    template_file: str
    style: str
    call: str
    thinking: str = ""  # a reply that thinks "Use the tool." and then calls, where the family thinks

    @property
    def template(self) -> str:
        return (TEMPLATES / self.template_file).read_text()

    def family(self) -> Family:
        from localrt.runtime.thinking import model_format

        return Family(self.name, self.template, marker_specials(model_format(self.template).markers))


_GLM_NL = (
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
    "<arg_value>3</arg_value>\n</tool_call>"
)
_GLM = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
_KIMI = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_calls_section_end|>'
)
_DSML = (
    '\n\n<｜DSML｜{tag}>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Paris'
    '</｜DSML｜parameter>\n<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    "</｜DSML｜{tag}>"
)
_HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
_CODER = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
    "</parameter>\n</function>\n</tool_call>"
)
_COHERE = (
    '<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris", '
    '"days": 3}}\n]<|END_ACTION|>'
)
_GEMMA4 = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'
_THOUGHT = "Use the tool."

OFFICIAL = {
    f.name: f
    for f in (
        Official("glm-4.6", "GLM-4.6.jinja", "glm", "\n" + _GLM_NL, f"<think>{_THOUGHT}</think>\n" + _GLM_NL),
        Official("glm-4.7-flash", "GLM-4.7-Flash.jinja", "glm", _GLM, f"{_THOUGHT}</think>{_GLM}"),
        Official("spark-2.5", "Spark2.5.jinja", "glm", _GLM, f"{_THOUGHT}</think>{_GLM}"),
        Official(
            "ling-3.0",
            "inclusionai-ling-3.0-flash.jinja",
            "glm",
            "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value><arg_key>days</arg_key>\n"
            "<arg_value>3</arg_value>\n</tool_call>",
        ),
        Official("laguna-s-2.1", "poolside-Laguna-S-2.1.jinja", "glm", _GLM, f"{_THOUGHT}</think>{_GLM}"),
        Official("laguna-xs-2.1", "poolside-Laguna-XS-2.1.jinja", "glm", _GLM_NL),
        Official("laguna-xs.2", "poolside-Laguna-XS.2.jinja", "glm", _GLM_NL),
        Official("kimi-k2", "moonshotai-Kimi-K2.jinja", "kimi", _KIMI),
        Official("kimi-k2-instruct", "Kimi-K2-Instruct.jinja", "kimi", _KIMI),
        Official(
            "kimi-k2-thinking", "Kimi-K2-Thinking.jinja", "kimi", _KIMI, f"<think>{_THOUGHT}</think>{_KIMI}"
        ),
        Official(
            "kimi-k3",
            "Kimi-K3.jinja",
            "kimi-k3",
            '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" '
            'type="string"<|sep|>Paris<|close|>argument<|sep|><|open|>argument key="days" type="number"<|sep|>3'
            "<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>",
        ),
        Official(
            "minimax-m1",
            "MiniMax-M1.jinja",
            "tool-list",
            '<tool_calls>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_calls>',
        ),
        Official(
            "minimax-m2",
            "MiniMax-M2.jinja",
            "minimax",
            '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
            '<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>',
        ),
        Official(
            "minimax-m3",
            "MiniMax-M3.jinja",
            "minimax-m3",
            ']<]minimax[>[<tool_call>\n]<]minimax[>[<invoke name="get_weather">]<]minimax[>[<city>Paris]<]minimax[>['
            "</city>]<]minimax[>[<days>3]<]minimax[>[</days>]<]minimax[>[</invoke>\n]<]minimax[>[</tool_call>",
        ),
        Official(
            "deepseek-r1",
            "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
            "deepseek",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        ),
        Official(
            "deepseek-v3.1",
            "deepseek-ai-DeepSeek-V3.1.jinja",
            "deepseek",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
            '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        ),
        Official(
            "deepseek-v3.2", "deepseek-ai-DeepSeek-V3.2.jinja", "dsml", _DSML.format(tag="function_calls")
        ),
        Official("deepseek-v4", "deepseek-ai-DeepSeek-V4.jinja", "dsml-v4", _DSML.format(tag="tool_calls")),
        Official(
            "deepseek-v4-flash",
            "deepseek-ai-DeepSeek-V4-Flash-0731.jinja",
            "dsml-v4",
            _DSML.format(tag="tool_calls"),
        ),
        Official(
            "seed-oss",
            "ByteDance-Seed-OSS.jinja",
            "seed",
            "<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n"
            "<parameter=days>3</parameter>\n</function>\n</seed:tool_call>",
        ),
        Official(
            "lfm2.5",
            "LFM2.5-8B-A1B.jinja",
            "lfm2",
            "<|tool_call_start|>[get_weather(city='Paris', days=3)]<|tool_call_end|>",
        ),
        Official(
            "lfm2",
            "LFM2-8B-A1B.jinja",
            "lfm2",
            "<|tool_call_start|>[get_weather(city='Paris', days=3)]<|tool_call_end|>",
        ),
        Official(
            "functionary-v3.1",
            "meetkai-functionary-medium-v3.1.jinja",
            "functionary",
            '<function=get_weather>{"city": "Paris", "days": 3}</function>',
        ),
        Official(
            "command-r7b",
            "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja",
            "cohere",
            _COHERE,
            f"<|START_THINKING|>{_THOUGHT}<|END_THINKING|>{_COHERE}",
        ),
        Official("cohere2-moe", "Cohere2MoE.jinja", "cohere", _COHERE),
        Official(
            "command-r-plus",
            "CohereForAI-c4ai-command-r-plus-tool_use.jinja",
            "command-r",
            'Action:\n```json\n[\n    {\n        "tool_name": "get_weather",\n        "parameters": {\n'
            '            "city": "Paris",\n            "days": 3\n        }\n    }\n]```',
        ),
        Official(
            "apertus",
            "Apertus-8B-Instruct.jinja",
            "apertus",
            '<|tools_prefix|>[{"get_weather": {"city": "Paris", "days": 3}}]<|tools_suffix|>',
        ),
        Official(
            "apriel-1.5",
            "unsloth-Apriel-1.5.jinja",
            "tool-list",
            '<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}, "id": "abcDEF123"}]'
            "</tool_calls>",
        ),
        Official(
            "apriel-1.6",
            "Apriel-1.6-15b-Thinker-fixed.jinja",
            "tool-list",
            '<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}, "id": "abcDEF123"}]'
            "</tool_calls>",
        ),
        Official(
            "nemotron-nano-v2",
            "NVIDIA-Nemotron-Nano-v2.jinja",
            "nemotron",
            '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]</TOOLCALL>',
        ),
        Official(
            "solar-open",
            "upstage-Solar-Open-100B.jinja",
            "solar",
            "<|tool_calls|><|tool_call:begin|>abcDEF123<|tool_call:name|>get_weather<|tool_call:args|>"
            '{"city": "Paris", "days": 3}<|tool_call:end|>',  # then `<|calls|>`, the end of its turn
        ),
        Official("gemma-4", "google-gemma-4-31B-it.jinja", "gemma4", _GEMMA4),
        Official("gemma-4-interleaved", "google-gemma-4-31B-it-interleaved.jinja", "gemma4", _GEMMA4),
        Official(
            "gigachat-3.1",
            "GigaChat3.1-10B-A1.8B.jinja",
            "gigachat",
            '<|function_call|>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
        ),
        Official(
            "minicpm5",
            "openbmb-MiniCPM5-1B.jinja",
            "minicpm",
            '<function name="get_weather"><param name="city">Paris</param><param name="days">3</param></function>',
        ),
        Official(
            "hy3",
            "tencent-Hy3.jinja",
            "hy3",
            "<tool_calls:opensource>\n<tool_call:opensource>get_weather<tool_sep:opensource>\n"
            "<arg_key:opensource>city</arg_key:opensource>\n<arg_value:opensource>Paris</arg_value:opensource>\n"
            "<arg_key:opensource>days</arg_key:opensource>\n<arg_value:opensource>3</arg_value:opensource>\n"
            "</tool_call:opensource>\n</tool_calls:opensource>",
        ),
        # families parsed before; here with their official templates
        Official("hermes-3", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "hermes", _HERMES),
        Official(
            "qwen3-official",
            "Qwen-Qwen3-0.6B.jinja",
            "hermes",
            _HERMES,
            f"<think>\n{_THOUGHT}\n</think>\n\n{_HERMES}",
        ),
        Official("granite-4.0", "ibm-granite-granite-4.0.jinja", "hermes", _HERMES),
        Official("qwen3-coder-official", "Qwen3-Coder.jinja", "hermes", _CODER),
        Official("qwen3.5", "Qwen3.5-4B.jinja", "hermes", _CODER),
        Official("nemotron-3-nano", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja", "hermes", _CODER),
        Official(
            "llama-3.1",
            "meta-llama-Llama-3.1-8B-Instruct.jinja",
            "llama3",
            '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
        ),
        Official(
            "devstral",
            "unsloth-mistral-Devstral-Small-2507.jinja",
            "mistral",
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
        ),
        Official(
            "ministral-3",
            "mistralai-Ministral-3-14B-Reasoning-2512.jinja",
            "mistral",
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
        ),
        Official(
            "gpt-oss-official",
            "openai-gpt-oss-120b.jinja",
            "harmony",
            '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}',
        ),
    )
}
