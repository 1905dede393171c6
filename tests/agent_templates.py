"""Official chat templates from llama.cpp's models/templates/, read from the pinned llama-cpp-python
sdist (downloaded once into the test cache): the templates the agents' models really ship with."""

from __future__ import annotations

import tarfile

from tests.fixtures_hf import CACHE
from tests.fixtures_hf import llama_cpp_sdist


def official_template(name: str) -> str:
    """The text of models/templates/NAME, e.g. "Qwen-Qwen3-0.6B.jinja"."""
    kept = CACHE / "templates" / name
    if not kept.is_file():
        sdist = llama_cpp_sdist()
        with tarfile.open(sdist) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith(f"/models/templates/{name}"))
            data = tar.extractfile(member)
            assert data is not None
            kept.parent.mkdir(parents=True, exist_ok=True)
            kept.write_bytes(data.read())
    return kept.read_text()


# ChatML (as SmolLM2's own template) plus the tools as JSON in a system turn, with no call markers: the
# runtime then reads a reply that is one call's JSON (`{"name", "arguments"}`) as a tool call
CHATML_JSON_TOOLS = (
    "{% if tools %}<|im_start|>system\nTo call a tool, answer with one JSON object "
    '{"name": ..., "arguments": {...}}. Tools:\n{{ tools | tojson }}<|im_end|>\n{% endif %}'
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
