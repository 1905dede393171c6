"""The tool commands: `convert` (the `convert` extra), `eval`, `imatrix` and `bench`. They work in this
process: they measure or write files here, not on a server."""

from __future__ import annotations

import argparse
import errno
import sys
from pathlib import Path
from typing import TYPE_CHECKING
from typing import Any

from localrt.cli.common import Subparsers
from localrt.errors import LocalrtError

if TYPE_CHECKING:
    from localrt.converters.convert import Result
    from localrt.runtime import calibration

QUANT_HELP = "F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K_S/M/L Q4_K_S/M Q5_K_S/M Q6_K IQ4_NL IQ4_XS"
# the text models localrt convert writes (converters/arch/: one table per architecture)
CONVERT_ARCHITECTURES = (
    "Llama 2/3 and Mistral (LlamaForCausalLM, MistralForCausalLM), Qwen2 (Qwen2ForCausalLM), "
    "Qwen3 (Qwen3ForCausalLM), Qwen3-MoE (Qwen3MoeForCausalLM), Gemma 2 (Gemma2ForCausalLM), "
    "Gemma 3 text (Gemma3ForCausalLM), Phi-3/Phi-4 (Phi3ForCausalLM), OLMoE (OlmoeForCausalLM)"
)


def add_convert(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "convert",
        help="convert HF safetensors to GGUF",
        description=f"Convert a Hugging Face checkpoint to GGUF. Architectures: {CONVERT_ARCHITECTURES}.",
    )
    p.add_argument("source", help="HF model directory or repo id (org/name)")
    p.add_argument("-q", "--quant", default="Q4_K_M", help=QUANT_HELP)
    p.add_argument("-o", "--output", default=None, help="write FILE.gguf")
    p.add_argument("--name", default=None, help="import into the store as NAME")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--imatrix", default=None, help="importance matrix weighting the quantized types")
    p.set_defaults(func=cmd_convert, extra="convert")
    return p


def cmd_convert(args: argparse.Namespace) -> int:
    """`localrt convert SRC --quant TYPE (-o FILE.gguf | --name NAME)`: the converter writes a file;
    with --name the store imports it (the converters never import the store)."""
    from localrt.converters import mixes

    if bool(getattr(args, "output", None)) == bool(getattr(args, "name", None)):
        raise LocalrtError("convert needs exactly one of -o FILE.gguf or --name NAME")
    try:
        file_type = mixes.parse_file_type(args.quant)
    except mixes.MixError as e:
        raise LocalrtError(str(e)) from None
    threads = getattr(args, "threads", 0) or 0
    weighting = imatrix_arg(args, file_type)
    if args.output:
        result = convert_with_progress(args.source, Path(args.output), file_type, threads, weighting)
    else:
        result = convert_into_store(args, file_type, threads, weighting)
        print(f"success: created '{args.name}'", file=sys.stderr)
    print(
        f"wrote {result.path if args.output else args.name}: {result.file_type}, {result.n_tensors} tensors, "
        f"{result.nbytes / 1e6:.1f} MB in {result.seconds:.1f} s",
        file=sys.stderr,
    )
    return 0


def convert_into_store(args: argparse.Namespace, file_type: str, threads: int, weighting: Any) -> Any:
    """`convert --name`: the converter writes into a scratch folder of the store (its disk, found by the
    recovery if this process is killed), and the finished file moves into blobs/ by a rename."""
    from localrt import faults
    from localrt.store.importer import import_gguf
    from localrt.store.names import parse_name
    from localrt.store.store import Store
    from localrt.store.store import disk_full

    name = parse_name(args.name)  # a bad name fails before hours of converting
    store = Store()
    with store.scratch(".convert-") as tmp:
        out = tmp / "model.gguf"
        try:
            result = convert_with_progress(args.source, out, file_type, threads, weighting)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise disk_full(out, getattr(e, "needed", None), "the partial file was removed") from None
            raise
        faults.reach("scratch.written")
        source = Path(args.source).expanduser()
        # recorded so `serve-engine` can hand vLLM/SGLang the original safetensors
        hf_source = str(source.resolve()) if source.is_dir() else args.source
        import_gguf(store, name, result.path, hf_source=hf_source)
    return result


def imatrix_arg(args: argparse.Namespace, file_type: str) -> tuple[Any, str]:
    """`--imatrix FILE`: the matrix (read and checked before any work) and the label recorded in the file."""
    path = getattr(args, "imatrix", None)
    if not path:
        return None, ""
    from localrt.converters import imatrix as imatrix_io

    im = imatrix_io.read(path)
    imatrix_io.check_quantized(file_type, im)
    return im, str(path)


def convert_with_progress(
    source: str, out: Path, file_type: str, threads: int, weighting: tuple[Any, str] = (None, "")
) -> Result:
    """The conversion, with a transient rich bar on a terminal; `weighting`: (Imatrix, label) or (None, "")."""
    from rich.console import Console
    from rich.progress import BarColumn
    from rich.progress import DownloadColumn
    from rich.progress import Progress
    from rich.progress import TextColumn
    from rich.progress import TimeRemainingColumn

    from localrt.converters.convert import convert

    im, label = weighting
    console = Console(stderr=True)
    if not console.is_terminal:
        return convert(source, out, file_type, threads, imatrix=im, imatrix_label=label)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task(f"converting to {file_type}", total=None)

        def progress(name: str, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, description=f"{file_type} {name}")

        return convert(source, out, file_type, threads, progress, imatrix=im, imatrix_label=label)


def add_eval(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser("eval", help="perplexity and KL divergence")
    p.add_argument("model", help="model name or .gguf path")
    p.add_argument("--text", required=True)
    p.add_argument("--reference", default=None)
    p.add_argument("--backend", default=None)
    p.add_argument("--reference-backend", default=None, help="backend for --reference (default: --backend)")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--compare", nargs="+", default=None, metavar="MODEL", help="more models scored against --reference"
    )
    p.add_argument("--plot", default=None, metavar="FILE.png", help="with --compare: KL against file size")
    p.set_defaults(func=cmd_eval)
    return p


def cmd_eval(args: argparse.Namespace) -> int:
    from localrt.eval import eval_command

    return eval_command(args)


def add_imatrix(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser("imatrix", help="compute an importance matrix on a text (llama-imatrix's format)")
    p.add_argument("model", help="model name or .gguf path")
    p.add_argument("--text", required=True, help="calibration text (UTF-8)")
    p.add_argument("-o", "--output", default="imatrix.gguf", help="output file (.dat: the legacy format)")
    p.add_argument("--ctx", type=int, default=512, help="chunk length in tokens (default 512)")
    p.add_argument("--chunks", type=int, default=-1, help="at most N chunks (default: all)")
    p.add_argument("--threads", type=int, default=0)
    p.set_defaults(func=cmd_imatrix, extra="llama")
    return p


def cmd_imatrix(args: argparse.Namespace) -> int:
    """`localrt imatrix NAME|FILE.gguf --text FILE [-o imatrix.gguf] [--ctx 512] [--chunks N] [--threads N]`."""
    from localrt.converters import imatrix as imatrix_io
    from localrt.eval import model_path

    try:
        text = Path(args.text).read_text(encoding="utf-8")
    except OSError as e:
        raise LocalrtError(f"cannot read {args.text}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise LocalrtError(f"{args.text} is not UTF-8 text") from None
    out = Path(args.output or "imatrix.gguf")
    if not out.parent.is_dir():
        raise LocalrtError(f"output directory {out.parent} does not exist")
    path = model_path(args.model)
    result = calibrate_with_progress(path, text, args.text, args.ctx or 512, args.chunks, args.threads or 0)
    imatrix_io.write(result.imatrix, out)
    print(
        f"Final estimate: PPL = {result.perplexity:.4f} +/- {result.ppl_error:.5f} "
        f"({result.chunks} chunks of {args.ctx or 512} tokens, {result.tokens / result.seconds:.1f} tokens/s)"
    )
    print(f"wrote {out}: {len(result.imatrix.entries)} entries", file=sys.stderr)
    return 0


def calibrate_with_progress(
    path: Path, text: str, dataset: str, ctx: int, chunks: int, threads: int
) -> calibration.Result:
    """The imatrix run, with a transient rich bar on a terminal, one line per group of chunks elsewhere."""
    from rich.console import Console
    from rich.progress import BarColumn
    from rich.progress import MofNCompleteColumn
    from rich.progress import Progress
    from rich.progress import TextColumn
    from rich.progress import TimeRemainingColumn

    from localrt.runtime.calibration import compute

    console = Console(stderr=True)
    if not console.is_terminal:

        def log(done: int, total: int, seconds: float) -> None:
            rate = done * ctx / seconds if seconds > 0 else 0.0
            print(f"imatrix: chunk {done}/{total}, {rate:.1f} tokens/s", file=sys.stderr)

        return compute(path, text, dataset, ctx, chunks, threads, log)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task("imatrix chunks", total=None, rate="")

        def update(done: int, total: int, seconds: float) -> None:
            rate = done * ctx / seconds if seconds > 0 else 0.0
            bar.update(task, completed=done, total=total, rate=f"{rate:.0f} tokens/s")

        return compute(path, text, dataset, ctx, chunks, threads, update)


def add_bench(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="measure TTFT, decode tokens/s and aggregate throughput")
    p.add_argument("model", help="model name")
    p.add_argument("--backend", default=None)
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated request counts (default 1,4,16)")
    p.add_argument(
        "--spec",
        default=None,
        choices=["off", "auto", "draft", "lookup", "self"],
        help="speculative decoding mode",
    )
    p.add_argument("--num-predict", type=int, default=128, help="tokens per request (default 128)")
    p.add_argument("--prompt", default=None, help="one prompt for every request (default: varied questions)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)
    return p


def cmd_bench(args: argparse.Namespace) -> int:
    from localrt.bench import bench_command

    return bench_command(args)
