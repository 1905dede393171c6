"""Remote models in the runtime: what differs from a local model, in one place.

The upstream templates and tokenizes, so the runtime hands the remote backend the conversation (chat,
templated generate) or the raw text (raw generate, OpenAI completions) instead of tokens; options that
no OpenAI-compatible server takes are refused with a 400 instead of being dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from localrt.backends.base import GenerateRequest
from localrt.errors import LocalrtError
from localrt.errors import OptionError
from localrt.runtime.options import Options
from localrt.store.store import ResolvedModel

BACKEND = "remote"
# Options an OpenAI-compatible upstream has no field for (load-time settings belong to the upstream's
# own launch; typical_p, mirostat and the penalty window are not in vLLM's or SGLang's API).
UNSUPPORTED = (
    "typical_p",
    "repeat_last_n",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "num_ctx",
    "num_keep",
    "num_thread",
    "num_gpu",
    "num_batch",
    "kv_cache_type",
    "flash_attn",
    "numerics",
    "draft_model",
    "num_draft",
    "backend",
    "grammar",
)


def is_remote(resolved: ResolvedModel) -> bool:
    return resolved.remote is not None


def check_options(resolved: ResolvedModel, opts: Options) -> None:
    """A 400 naming the first option (from the request or the model's parameters) a remote model
    cannot honour; the defaults (and the environment's) pass."""
    if resolved.remote is None:
        return
    defaults = Options()
    bad = [name for name in UNSUPPORTED if getattr(opts, name) != getattr(defaults, name)]
    if opts.speculative not in ("auto", "off"):
        bad.append("speculative")
    if bad:
        where = ", ".join(resolved.remote.get("endpoints") or [])
        raise OptionError(
            f"option {bad[0]!r} does not apply to remote model '{resolved.name.display}' "
            f"(served by {where}: the upstream sets it)"
        )


def chat_prompt(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> dict[str, Any]:
    """GenerateRequest fields for a chat: the messages and tools go upstream as they are."""
    return {"messages": [dict(m) for m in messages], "tools": [dict(t) for t in tools] if tools else None}


def generate_prompt(
    resolved: ResolvedModel,
    prompt: str,
    system: str | None,
    raw: bool,
    context: Sequence[int] | None,
) -> dict[str, Any] | None:
    """GenerateRequest fields for /api/generate on a remote model (None for a local one): raw text to
    the upstream's completions, else one user turn (with the system prompt) to its chat."""
    if resolved.remote is None:
        return None
    if context:
        raise LocalrtError("context (token ids of an earlier answer) is not supported for remote models")
    if raw:
        return {"prompt_text": prompt}
    sys_text = system if system is not None else resolved.system
    messages = [{"role": "system", "content": sys_text}] if sys_text else []
    return {"messages": [*messages, {"role": "user", "content": prompt}]}


def with_upstream(
    request: GenerateRequest, opts: Options, upstream: dict[str, Any] | None
) -> GenerateRequest:
    """The request for a remote model (`upstream` from chat_prompt/generate_prompt), else unchanged.
    The upstream bounds an answer by its own context, so -1 and -2 both mean no max_tokens."""
    if upstream is None:
        return request
    num_predict = opts.num_predict if opts.num_predict >= 0 else -1
    return dataclasses.replace(request, num_predict=num_predict, **upstream)
