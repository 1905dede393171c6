"""`localrt eval`: perplexity of a model on a text, and with a reference model the KL divergence and
top-1 agreement of its next-token distributions (what llama-perplexity --kl-divergence reports).

Works through the backend protocol's `score`, so every backend can be measured the same way. The text
is tokenized once (by the model under test) and cut into windows of `ctx` tokens; as in
llama-perplexity, each window starts with BOS when the vocabulary asks for one, and only the second
half of each window is scored, so every scored token has at least ctx/2 tokens of context.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from localrt.backends.base import log_softmax
from localrt.errors import LocalrtError


@dataclass
class EvalResult:
    perplexity: float
    tokens: int  # scored tokens
    kl: float | None = None  # mean KL(reference || model) in nats per token
    top1: float | None = None  # share of scored tokens where both models' most likely token agree
    windows: int = 0
    ctx: int = 0


def windows(tokens: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    """Consecutive windows of `ctx` tokens; with a BOS id, each window is BOS + ctx-1 text tokens."""
    step = ctx - 1 if bos is not None else ctx
    out = []
    for start in range(0, len(tokens), step):
        body = tokens[start : start + step]
        w = [bos, *body] if bos is not None else body
        if len(w) >= 4:
            out.append(w)
    return out


async def evaluate(model: Any, tokens: list[int], ctx: int, reference: Any | None = None) -> EvalResult:
    """Score `tokens` with `model` (a backends.base.LoadedModel) and optionally compare to `reference`."""
    if ctx < 8:
        raise LocalrtError("--ctx must be at least 8")
    bos = model.bos_token_id if model.add_bos else None
    if reference is not None and reference.n_vocab != model.n_vocab:
        raise LocalrtError(
            f"the reference has {reference.n_vocab} tokens in its vocabulary, the model "
            f"{model.n_vocab}: KL needs the same vocabulary"
        )
    nll = kl_sum = 0.0
    n = agree = 0
    wins = windows(tokens, ctx, bos)
    if not wins:
        raise LocalrtError("the text is too short to evaluate (needs at least a few tokens)")
    for w in wins:
        first = len(w) // 2  # logprobs[i] predicts w[i+1]; score the second half
        res = await model.score(w, return_logits=reference is not None)
        nll -= float(res.logprobs[first:].sum())
        n += len(res.logprobs) - first
        if reference is not None:
            ref = await reference.score(w, return_logits=True)
            lp, lq = log_softmax(ref.logits[first:]), log_softmax(res.logits[first:])
            kl_sum += float((np.exp(lp) * (lp - lq)).sum())
            agree += int((ref.logits[first:].argmax(-1) == res.logits[first:].argmax(-1)).sum())
    result = EvalResult(math.exp(nll / n), n, windows=len(wins), ctx=ctx)
    if reference is not None:
        result.kl, result.top1 = kl_sum / n, agree / n
    return result


def model_path(name: str) -> Path:
    """A stored model's GGUF blob, or a GGUF file given by path."""
    path = Path(name).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    from localrt.store.store import Store

    return Store().resolve(name).model_path


def load(name: str, backend: str | None, ctx: int) -> Any:
    from localrt.backends import registry
    from localrt.backends.base import LoadOptions

    cls = registry.get(registry.resolve(backend))
    return cls.load(model_path(name), LoadOptions(num_ctx=ctx))


def eval_command(args: Any) -> int:
    """`localrt eval NAME --text FILE [--reference NAME [--reference-backend B]] [--backend B] [--ctx N] [--json]`."""
    try:
        text = Path(args.text).read_text(encoding="utf-8")
    except OSError as e:
        raise LocalrtError(f"cannot read {args.text}: {e.strerror}") from None
    ctx = args.ctx or 512
    model = load(args.model, args.backend, ctx)
    reference = None
    try:
        tokens = model.tokenize(text, add_special=False)
        if args.reference:
            # the reference may run on another backend (e.g. MLX measured against llama.cpp)
            reference = load(args.reference, getattr(args, "reference_backend", None) or args.backend, ctx)
        result = asyncio.run(evaluate(model, tokens, ctx, reference))
    finally:
        model.unload()
        if reference is not None:
            reference.unload()
    if args.json:
        print(
            json.dumps(
                {k: v for k, v in asdict(result).items() if k in ("perplexity", "tokens", "kl", "top1")}
            )
        )
        return 0
    print(
        f"perplexity: {result.perplexity:.4f} over {result.tokens} tokens "
        f"({result.windows} windows of {result.ctx})"
    )
    if result.kl is not None and result.top1 is not None:
        print(f"KL divergence vs {args.reference}: {result.kl:.6f}")
        print(f"top-1 agreement: {100 * result.top1:.2f}%")
    sys.stdout.flush()
    return 0
