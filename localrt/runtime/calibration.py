"""An importance matrix computed on a calibration text, as llama-imatrix computes it.

llama.cpp collects the activations (`backends/llamacpp/activations.py`); here they become the imatrix
that quantization weighs its errors with (`converters/imatrix.py`), recorded with the text's name, and
the text's perplexity comes back beside it. The CLI reaches the backend through this module only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from localrt.backends.llamacpp import activations
from localrt.converters import imatrix as imatrix_io


@dataclass
class Result:
    imatrix: imatrix_io.Imatrix
    perplexity: float
    ppl_error: float
    tokens: int
    chunks: int
    seconds: float


def compute(
    model_path: Path,
    text: str,
    dataset: str,
    ctx: int = 512,
    chunks: int = -1,
    threads: int = 0,
    progress: Callable[[int, int, float], None] | None = None,
) -> Result:
    """Run `model_path` over `text` in chunks of `ctx` and collect its importance matrix; `dataset` is
    the text's name as the file records it. `progress(done, total, seconds)` after each group of chunks."""
    run = activations.collect(model_path, text, ctx, chunks, threads, progress)
    im = imatrix_io.Imatrix(datasets=[dataset], chunk_count=run.chunk_count, chunk_size=run.chunk_size)
    for name in sorted(run.sums):
        im.entries[name] = imatrix_io.Entry(run.sums[name], run.counts[name])
    return Result(im, run.perplexity, run.ppl_error, run.tokens, run.chunks, run.seconds)
