"""A stored model described from its manifest layers and its GGUF header: Modelfile text and parameter
lines, shared by `localrt show` (through the client) and `/api/show`."""

from __future__ import annotations

import json
from typing import Any

from localrt.errors import LocalrtError
from localrt.runtime.family_templates import TemplateChoice
from localrt.runtime.templates import is_go_template
from localrt.runtime.templates import select_template
from localrt.store.gguf import GGUFInfo
from localrt.store.store import ResolvedModel


def parameter_lines(params: dict[str, Any]) -> list[tuple[str, str]]:
    """Modelfile-style `key value` pairs; list values (stop) give one line each."""
    lines = []
    for key, value in params.items():
        for item in value if isinstance(value, list) else [value]:
            lines.append(
                (
                    key,
                    json.dumps(item)
                    if isinstance(item, str)
                    else str(item).lower()
                    if isinstance(item, bool)
                    else str(item),
                )
            )
    return lines


POOLING_RANK = 4  # llama.cpp's LLAMA_POOLING_TYPE_RANK: a reranker's classification head


def is_reranker(info: GGUFInfo) -> bool:
    """Pooling type rank, or a classification head with labels (llama.cpp's converter writes these for
    sequence-classification checkpoints such as bge-reranker)."""
    arch = info.architecture
    return (
        info.metadata.get(f"{arch}.pooling_type") == POOLING_RANK
        or f"{arch}.classifier.output_labels" in info.metadata
    )


def media_capabilities(model: ResolvedModel, info: GGUFInfo, capabilities: list[str]) -> list[str]:
    """The media part of `capabilities`: `vision` with a projector; a reranker is `rerank`, not
    `completion`. Takes the list built so far and returns it amended."""
    caps = list(capabilities)
    if is_reranker(info):
        caps = [c for c in caps if c != "completion"] + ["rerank"]
    if model.projector_path is not None:
        caps.append("vision")
    return caps


def model_capabilities(model: ResolvedModel, info: GGUFInfo) -> list[str]:
    """`capabilities` of /api/show and `localrt show`: completion (or embedding), tools and thinking
    from the template the runtime renders with, then vision and rerank."""
    from localrt.runtime.lifecycle import parser_format
    from localrt.runtime.thinking import capabilities
    from localrt.runtime.thinking import model_format

    tokens = info.metadata.get("tokenizer.ggml.tokens") or []
    types = info.metadata.get("tokenizer.ggml.token_type") or []
    specials = [t for t, kind in zip(tokens, types) if kind in (3, 4)]  # control, user-defined
    if model.template is not None and is_go_template(model.template):
        fmt = model_format(model.template)  # a Go TEMPLATE is kept, not run: read what it shows
    else:
        fmt = model_format(template_choice(model, info).source, specials)
    caps = capabilities(parser_format(fmt, model), info.metadata)
    if "completion" in caps and can_insert(model, info):
        caps.append("insert")
    return media_capabilities(model, info, caps)


def can_insert(model: ResolvedModel, info: GGUFInfo) -> bool:
    """Ollama's `insert`: a Go TEMPLATE with a {{ if .Suffix }} branch, or FIM tokens in the vocabulary."""
    from localrt.runtime.fim import fim_tokens
    from localrt.runtime.fim import suffix_branch

    if suffix_branch(model.template) is not None:
        return True
    tokens = info.metadata.get("tokenizer.ggml.tokens") or []
    index: dict[str, int] = {}
    for i, text in enumerate(tokens):
        index.setdefault(str(text), i)
    return fim_tokens(info.metadata, index.get, len(tokens)) is not None


def projector_rows(meta: Any) -> list[tuple[str, str]]:
    """`show`'s Projector section from a projector GGUF's key/values (`GGUFInfo.summary()`)."""
    from localrt.store.gguf import format_parameter_count

    count = meta.get("general.parameter_count")
    return [
        ("architecture", str(meta.get("general.architecture", "unknown"))),
        ("parameters", format_parameter_count(int(count)) if count else "unknown"),
        ("projector type", str(meta.get("clip.projector_type", "unknown"))),
        ("embedding length", str(meta.get("clip.vision.embedding_length", "unknown"))),
        ("dimensions", str(meta.get("clip.vision.projection_dim", "unknown"))),
    ]


def template_choice(model: ResolvedModel, info: GGUFInfo) -> TemplateChoice:
    """The template the runtime renders this model's prompts with (see runtime/templates.py)."""
    tokens = info.metadata.get("tokenizer.ggml.tokens") or ()
    return select_template(model.template, info.chat_template, info.architecture, tokens)


def template_of(model: ResolvedModel, info: GGUFInfo) -> str:
    # A Modelfile TEMPLATE is shown as written, Go templates included (kept, not executed).
    return model.template if model.template is not None else template_choice(model, info).source


TEMPLATE_ORIGINS = {
    "modelfile": "from the Modelfile",
    "gguf": "from the GGUF file",
    "chatml fallback": "ChatML (the file has none and its family is unknown)",
}


def template_origin(choice: TemplateChoice) -> str:
    family = choice.origin.removeprefix("family:")
    return TEMPLATE_ORIGINS.get(choice.origin, f"{family}, built in (the file has none)")


def modelfile_text(model: ResolvedModel, info: GGUFInfo) -> str:
    out = [
        '# Modelfile generated by "localrt show"',
        "# To build a new Modelfile based on this, replace FROM with:",
        f"# FROM {model.name.display}",
        "",
        f"FROM {model.model_path}",
    ]
    if model.projector_path is not None:
        out.append(f"FROM {model.projector_path}")
    out += [f"ADAPTER {path}" for path in model.adapter_paths]
    template = template_of(model, info)
    if template:
        out.append(f'TEMPLATE """{template}"""')
    if model.system:
        out.append(f'SYSTEM """{model.system}"""')
    out += [f"PARAMETER {k} {v}" for k, v in parameter_lines(model.params)]
    if model.license:
        out.append(f'LICENSE """{model.license}"""')
    out += format_lines(model)
    return "\n".join(out) + "\n"


def format_lines(model: ResolvedModel) -> list[str]:
    """RENDERER, PARSER, REQUIRES and the MESSAGE turns of a stored model, as Modelfile lines."""
    out = [
        f"{key.upper()} {model.config[key]}"
        for key in ("renderer", "parser", "requires")
        if model.config.get(key)
    ]
    for msg in model.messages:
        content = msg.get("content", "")
        plain = "\n" not in content and '"' not in content and "\\" not in content
        quoted = f'"{content}"' if plain else f'"""{content}"""'
        out.append(f"MESSAGE {msg.get('role')} {quoted}")
    return out


def remote_modelfile_text(model: ResolvedModel) -> str:
    """`show --modelfile` of a remote model: its endpoints and upstream model as a Modelfile."""
    remote = model.remote or {}
    out = ['# Modelfile generated by "localrt show"', f"# {model.name.display} is a remote model", ""]
    out += [f"FROM {url}" for url in remote.get("endpoints", [])]
    out.append(f"PARAMETER remote_model {remote.get('model', '')}")
    if remote.get("api_key_env"):
        out.append(f"PARAMETER api_key_env {remote['api_key_env']}")
    if model.template:
        out.append(f'TEMPLATE """{model.template}"""')
    if model.system:
        out.append(f'SYSTEM """{model.system}"""')
    out += [f"PARAMETER {k} {v}" for k, v in parameter_lines(model.params)]
    if model.license:
        out.append(f'LICENSE """{model.license}"""')
    return "\n".join(out) + "\n"


def remote_health(model: ResolvedModel) -> list[tuple[str, str]]:
    """(endpoint, "ok" or why it is down) of a remote model, probed now; an endpoint that fails the
    URL rules (a pulled config never met `create`'s) is shown with the reason and never contacted."""
    from localrt.store.remote import api_key
    from localrt.store.remote import check_endpoint
    from localrt.store.remote import probe

    remote = model.remote or {}
    urls = [str(u) for u in remote.get("endpoints", [])]
    try:
        key = api_key(remote.get("api_key_env"), model.name.display)
    except LocalrtError as e:  # a missing key is worth showing, not a failure of `show`
        return [(url, f"not checked ({e})") for url in urls]
    rows = []
    for url in urls:
        try:
            checked = check_endpoint(url, remote.get("insecure") is True)
        except LocalrtError as e:
            rows.append((url, f"refused ({e})"))
            continue
        rows.append((url, probe(checked, key)))
    return rows
