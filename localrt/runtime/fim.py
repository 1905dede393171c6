"""Fill-in-the-middle: the prompt a code model completes between a prefix and a suffix (`suffix` on
generate and completions; Ollama's `insert` capability).

Two sources, as the model has them:
  * a Go TEMPLATE whose `{{ if .Suffix }}` branch spells the FIM prompt (Ollama's code models): that
    branch, its markers parsed as special tokens and the user's texts as plain text;
  * the vocabulary's FIM tokens (`tokenizer.ggml.fim_{pre,suf,mid,rep,sep}_token_id`, the older
    `prefix/suffix/middle_token_id`, or the token texts llama.cpp recognises when the ids are absent),
    in llama-server's /infill order:
        [fim_rep]myproject\\n [fim_sep]filename\\n (where the model has them)
        [bos] [fim_pre] prefix [fim_suf] suffix [fim_mid]
    The repo and file names are llama-server's fixed placeholders, so the same request gets the same
    tokens (and the same greedy completion) from both.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from localrt.errors import LocalrtError

_KEYS = {
    "pre": ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
    "suf": ("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
    "mid": ("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"),
    "rep": ("tokenizer.ggml.fim_rep_token_id",),
    "sep": ("tokenizer.ggml.fim_sep_token_id",),
}
# llama.cpp's vocabulary loader finds FIM tokens by these texts when the file names no id
_TEXTS = {
    "pre": (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    "suf": (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    "mid": (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
REPO_NAME = "myproject\n"  # llama-server's placeholders for the repository and the current file
FILE_NAME = "filename\n"


class InsertError(LocalrtError):
    status = 400


@dataclass(frozen=True)
class FimTokens:
    pre: int
    suf: int
    mid: int
    rep: int | None = None
    sep: int | None = None


def fim_tokens(
    metadata: Mapping[str, Any], find: Callable[[str], int | None], n_vocab: int
) -> FimTokens | None:
    """The model's FIM tokens: ids from the metadata, else found by their text (`find`); None when the
    prefix, suffix or middle token is missing."""
    found: dict[str, int | None] = {}
    for role, keys in _KEYS.items():
        ids = [_as_id(metadata.get(k), n_vocab) for k in keys]
        found[role] = next((i for i in ids if i is not None), None)
        if found[role] is None:
            found[role] = next((i for i in map(find, _TEXTS[role]) if i is not None), None)
    pre, suf, mid = found["pre"], found["suf"], found["mid"]
    if pre is None or suf is None or mid is None:
        return None
    return FimTokens(pre, suf, mid, found["rep"], found["sep"])


def _as_id(value: Any, n_vocab: int) -> int | None:
    try:
        token = int(value)
    except (TypeError, ValueError):
        return None
    return token if 0 <= token < n_vocab else None


def infill_tokens(
    fim: FimTokens,
    prefix: str,
    suffix: str,
    tokenize: Callable[[str], list[int]],
    bos: int | None,
    n_ctx: int,
    n_batch: int,
) -> list[int]:
    """The /infill prompt; `tokenize` reads text as plain text (no special tokens, no BOS). What is kept
    is llama-server's `format_prompt_infill` rule, token for token: the prefix's last 3/4 of a batch, the
    suffix's first 1/4 of a batch less two, and the end of the repository preamble that fits in the
    context beyond one batch (its n_predict being -1, which localrt's request does not change)."""
    extra: list[int] = []
    if fim.rep is not None:
        extra += [fim.rep, *tokenize(REPO_NAME)]
    if fim.sep is not None:
        extra += [fim.sep, *tokenize(FILE_NAME)]
    pre, suf = tokenize(prefix), tokenize(suffix)
    keep_pre = min(len(pre), 3 * (n_batch // 4))
    keep_suf = min(len(suf), max(0, n_batch // 4 - 2))
    keep_extra = min(max(0, n_ctx - n_batch + 2), len(extra))
    head = [bos] if bos is not None else []
    pre, suf, extra = pre[len(pre) - keep_pre :], suf[:keep_suf], extra[len(extra) - keep_extra :]
    return [*extra, *head, fim.pre, *pre, fim.suf, *suf, fim.mid]


# ---- a Go template's {{ if .Suffix }} branch --------------------------------------------------------
_BRANCH = re.compile(r"\{\{(-?)\s*if\s+\.Suffix\s*(-?)\}\}(.*?)\{\{(-?)\s*(?:else|end)\b", re.DOTALL)
_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.DOTALL)


def suffix_branch(template: str | None) -> list[tuple[str, bool]] | None:
    """The `{{ if .Suffix }}` branch of a Go template as (text, is_literal) parts, where `.Prompt` and
    `.Suffix` stand as ("prompt", False) and ("suffix", False); None without such a branch, or when it
    uses anything else (we do not run Go templates)."""
    match = _BRANCH.search(template or "")
    if match is None:
        return None
    body = match[3]
    body = body.lstrip() if match[2] else body
    body = body.rstrip() if match[4] else body
    parts: list[tuple[str, bool]] = []
    pos = 0
    for action in _ACTION.finditer(body):
        literal = body[pos : action.start()]
        parts.append((literal.rstrip() if action[1] else literal, True))
        field = {".Prompt": "prompt", ".Suffix": "suffix"}.get(action[2])
        if field is None:
            return None
        parts.append((field, False))
        pos = action.end()
        if action[3]:
            rest = body[pos:]
            pos += len(rest) - len(rest.lstrip())
    parts.append((body[pos:], True))
    return [p for p in parts if p[0] or not p[1]]


def template_tokens(
    parts: list[tuple[str, bool]],
    prefix: str,
    suffix: str,
    tokenize: Callable[[str, bool], list[int]],
    bos: int | None,
) -> list[int]:
    """The branch as tokens: its markers parsed as special tokens, the user's texts as plain text."""
    out = [bos] if bos is not None else []
    for text, literal in parts:
        out += tokenize(text, True) if literal else tokenize(prefix if text == "prompt" else suffix, False)
    return out


def check_insert(model: str, supported: bool, raw: bool, images: bool) -> None:
    """The 400s of a request with a `suffix`: a model without FIM, raw mode, images."""
    if raw:
        raise InsertError("raw mode does not support suffix")
    if images:
        raise InsertError("suffix (fill-in-the-middle) does not support images")
    if not supported:
        raise InsertError(
            f'"{model}" does not support insert (fill-in-the-middle): its vocabulary has no FIM prefix, '
            "suffix and middle tokens and its template no .Suffix"
        )
