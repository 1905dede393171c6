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
from dataclasses import asdict
from dataclasses import dataclass
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


# ---- several quantizations of one model against one reference (`eval --compare`) --------------------
@dataclass
class CompareRow:
    """One model's scores against the reference, and its size."""

    name: str
    size: int  # file bytes
    bpw: float  # bits per weight of its tensors
    perplexity: float
    kl_mean: float
    kl_p99: float
    top1: float


class _Scores:
    """Running sums for one model: NLL, per-token KL (kept for the percentile), top-1 agreement."""

    def __init__(self) -> None:
        self.nll = 0.0
        self.n = 0
        self.agree = 0
        self.kl: list[np.ndarray] = []

    def add(
        self, logprobs: np.ndarray, logits: np.ndarray | None, ref_lp: np.ndarray | None, ref_top: Any
    ) -> None:
        self.nll -= float(logprobs.sum())
        self.n += len(logprobs)
        if logits is not None and ref_lp is not None:
            lq = log_softmax(logits)
            self.kl.append((np.exp(ref_lp) * (ref_lp - lq)).sum(-1))
            self.agree += int((logits.argmax(-1) == ref_top).sum())


def size_and_bpw(path: Path) -> tuple[int, float]:
    """The file's size and its tensors' bits per weight (tensor bytes * 8 / elements, as llama.cpp's BPW)."""
    from localrt.store.gguf import read_gguf

    info = read_gguf(path)
    elements = sum(int(np.prod(t.shape, dtype=np.int64)) for t in info.tensors)
    nbytes = sum(t.n_bytes for t in info.tensors)
    return path.stat().st_size, (8 * nbytes / elements if elements else float("nan"))


async def compare(reference: Any, models: dict[str, Any], tokens: list[int], ctx: int) -> dict[str, _Scores]:
    """Score every model on the same windows; the reference's logits are computed once per window.

    Windows run outermost, so only one window of reference logits is ever held.
    """
    if ctx < 8:
        raise LocalrtError("--ctx must be at least 8")
    for name, m in models.items():
        if m.n_vocab != reference.n_vocab:
            raise LocalrtError(
                f"{name} has {m.n_vocab} tokens in its vocabulary, the reference {reference.n_vocab}: "
                "KL needs the same vocabulary"
            )
    bos = reference.bos_token_id if reference.add_bos else None
    wins = windows(tokens, ctx, bos)
    if not wins:
        raise LocalrtError("the text is too short to evaluate (needs at least a few tokens)")
    scores = {name: _Scores() for name in ["", *models]}  # "" is the reference itself
    for w in wins:
        first = len(w) // 2
        ref = await reference.score(w, return_logits=True)
        ref_lp = log_softmax(ref.logits[first:])
        ref_top = ref.logits[first:].argmax(-1)
        scores[""].add(ref.logprobs[first:], None, None, None)
        for name, m in models.items():
            res = await m.score(w, return_logits=True)
            scores[name].add(res.logprobs[first:], res.logits[first:], ref_lp, ref_top)
    return scores


def compare_rows(scores: dict[str, _Scores], paths: dict[str, Path], reference: str) -> list[CompareRow]:
    rows = []
    for name, sc in scores.items():
        label = name or reference
        size, bpw = size_and_bpw(paths[label])
        kl = np.concatenate(sc.kl) if sc.kl else np.zeros(1)
        rows.append(
            CompareRow(
                label,
                size,
                bpw,
                math.exp(sc.nll / sc.n),
                float(kl.mean()),
                float(np.percentile(kl, 99)),
                sc.agree / sc.n if sc.kl else 1.0,
            )
        )
    return rows


def print_compare(rows: list[CompareRow], tokens: int, out: Any = None) -> None:
    out = out or sys.stdout
    head = ["MODEL", "SIZE (MB)", "BPW", "PPL", "KL MEAN", "KL P99", "TOP-1"]
    body = [
        [
            r.name,
            f"{r.size / 1e6:.1f}",
            f"{r.bpw:.2f}",
            f"{r.perplexity:.4f}",
            f"{r.kl_mean:.6f}",
            f"{r.kl_p99:.5f}",
            f"{100 * r.top1:.2f}%",
        ]
        for r in rows
    ]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    for line in [head, *body]:
        out.write(
            "  ".join(c.ljust(wd) if i == 0 else c.rjust(wd) for i, (c, wd) in enumerate(zip(line, widths)))
            + "\n"
        )
    out.write(f"({tokens} scored tokens; the first row is the reference)\n")


def plot_compare(rows: list[CompareRow], path: Path) -> None:
    """KL against file size, one labelled point per model (the reference has no KL and is left out)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise LocalrtError("--plot needs matplotlib: pip install 'localrt[plot]'") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows[1:]:
        ax.scatter(r.size / 1e6, r.kl_mean)
        ax.annotate(
            Path(r.name).stem,
            (r.size / 1e6, r.kl_mean),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=8,
        )
    ax.set_xlabel("file size (MB)")
    ax.set_ylabel(f"mean KL vs {Path(rows[0].name).stem} (nats/token)")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".part.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def compare_command(args: Any, text: str, ctx: int) -> int:
    """`eval A --reference B --compare A2 A3 ... [--plot FILE.png]`: A and the others against B."""
    if not args.reference:
        raise LocalrtError("--compare needs --reference (the model the others are measured against)")
    if args.plot and not str(args.plot).lower().endswith(".png"):
        raise LocalrtError("--plot writes a PNG: give a FILE.png")
    names = list(dict.fromkeys([args.model, *args.compare]))
    paths = {n: model_path(n) for n in [args.reference, *names]}
    loaded: dict[str, Any] = {}
    reference = load(args.reference, getattr(args, "reference_backend", None) or args.backend, ctx)
    try:
        for n in names:
            loaded[n] = load(n, args.backend, ctx)
        tokens = reference.tokenize(text, add_special=False)
        scores = asyncio.run(compare(reference, loaded, tokens, ctx))
    finally:
        reference.unload()
        for m in loaded.values():
            m.unload()
    rows = compare_rows(scores, paths, args.reference)
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
    else:
        print_compare(rows, scores[""].n)
    if args.plot:
        plot_compare(rows, Path(args.plot))
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def eval_command(args: Any) -> int:
    """`localrt eval NAME --text FILE [--reference NAME [--reference-backend B]] [--backend B] [--ctx N] [--json]`."""
    try:
        text = Path(args.text).read_text(encoding="utf-8")
    except OSError as e:
        raise LocalrtError(f"cannot read {args.text}: {e.strerror}") from None
    ctx = args.ctx or 512
    if getattr(args, "compare", None):
        return compare_command(args, text, ctx)
    if getattr(args, "plot", None):
        raise LocalrtError("--plot needs --compare")
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
