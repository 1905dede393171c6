"""The tool commands: `convert` (the `convert` extra), `eval` and `bench`. They work in this process:
they measure or write files here, not on a server."""

from __future__ import annotations

import argparse

from localrt.cli.common import Subparsers

QUANT_HELP = "F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K_S/M/L Q4_K_S/M Q5_K_S/M Q6_K"


def add_convert(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser("convert", help="convert HF safetensors to GGUF")
    p.add_argument("source", help="HF model directory or repo id (org/name)")
    p.add_argument("-q", "--quant", default="Q4_K_M", help=QUANT_HELP)
    p.add_argument("-o", "--output", default=None, help="write FILE.gguf")
    p.add_argument("--name", default=None, help="import into the store as NAME")
    p.add_argument("--threads", type=int, default=0)
    p.set_defaults(func=cmd_convert, extra="convert")
    return p


def cmd_convert(args: argparse.Namespace) -> int:
    from localrt.converters.convert import convert_command

    return convert_command(args)


def add_eval(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser("eval", help="perplexity and KL divergence")
    p.add_argument("model", help="model name or .gguf path")
    p.add_argument("--text", required=True)
    p.add_argument("--reference", default=None)
    p.add_argument("--backend", default=None)
    p.add_argument("--reference-backend", default=None, help="backend for --reference (default: --backend)")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_eval)
    return p


def cmd_eval(args: argparse.Namespace) -> int:
    from localrt.eval import eval_command

    return eval_command(args)


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
