"""`localrt ...`: thin argument parsing and formatting over the store and the runtime.

Every user mistake ends as one line on stderr and a non-zero exit; tracebacks only with LOCALRT_DEBUG=1.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from localrt import __version__
from localrt.errors import LocalrtError

Handler = Callable[[argparse.Namespace], int]


# ---- formatting helpers ----------------------------------------------------------------------
def human_size(n: float) -> str:
    """Decimal units as `ollama list` prints them: "98 MB", "4.7 GB", "512 KB"."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            break
        n /= 1000
    return f"{n:.1f} {unit}" if n < 10 and n != int(n) else f"{int(n)} {unit}"


def human_ago(then: float, now: float | None = None) -> str:
    seconds = max(0, int((now or time.time()) - then))
    for unit, span in (
        ("year", 31536000),
        ("month", 2592000),
        ("week", 604800),
        ("day", 86400),
        ("hour", 3600),
        ("minute", 60),
        ("second", 1),
    ):
        if seconds >= span:
            count = seconds // span
            return f"{count} {unit}{'s' if count != 1 else ''} ago"
    return "Less than a second ago"


def print_table(rows: list[list[str]], out: Any = None) -> None:
    out = out or sys.stdout
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write("    ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() + "\n")


# ---- store commands --------------------------------------------------------------------------
def cmd_pull(args: argparse.Namespace) -> int:
    from localrt.progress import PullProgress
    from localrt.store.pull import pull

    with PullProgress() as bar:
        pull(args.model, insecure=args.insecure, progress=bar.update)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from localrt.store.store import Store

    rows = [["NAME", "ID", "SIZE", "MODIFIED"]]
    for entry in Store().list_models():
        rows.append([entry.name.display, entry.id, human_size(entry.size), human_ago(entry.modified)])
    print_table(rows)
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from localrt.store.names import parse_name
    from localrt.store.store import Store

    store = Store()
    for text in args.models:
        name = parse_name(text)
        store.remove(name)
        print(f"deleted '{name.display}'")
    return 0


def cmd_cp(args: argparse.Namespace) -> int:
    from localrt.store.names import parse_name
    from localrt.store.store import Store

    src, dst = parse_name(args.source), parse_name(args.destination)
    Store().copy(src, dst)
    print(f"copied '{src.display}' to '{dst.display}'")
    return 0


def cmd_create(args: argparse.Namespace) -> int:
    from localrt.remote_cli import create_kwargs
    from localrt.store.modelfile import create

    if not args.from_path and not args.file and not args.remote:
        if os.path.exists("Modelfile"):
            args.file = "Modelfile"
        else:
            raise LocalrtError("create needs --from FILE.gguf or -f Modelfile")
    modelfile_text = None
    base_dir = None
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as f:
                modelfile_text = f.read()
        except OSError as e:
            raise LocalrtError(f"cannot read Modelfile {args.file}: {e.strerror}") from None
        base_dir = os.path.dirname(os.path.abspath(args.file))
    name = create(
        args.model,
        modelfile_text=modelfile_text,
        from_path=args.from_path,
        base_dir=base_dir,
        quantize=args.quantize,
        **create_kwargs(args),
    )
    print(f"success: created '{name.display}'")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from localrt.show import show_command

    return show_command(args)


# ---- runtime commands (implemented in localrt/interactive.py) --------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    from localrt.interactive import run_command

    return run_command(args)


def cmd_ps(args: argparse.Namespace) -> int:
    from localrt.interactive import ps_command

    return ps_command(args)


def cmd_stop(args: argparse.Namespace) -> int:
    from localrt.interactive import stop_command

    return stop_command(args)


def cmd_chat(args: argparse.Namespace) -> int:
    from localrt.chat_command import chat_command

    return chat_command(args)


def cmd_convert(args: argparse.Namespace) -> int:
    from localrt.converters.convert import convert_command

    return convert_command(args)


def cmd_eval(args: argparse.Namespace) -> int:
    from localrt.eval import eval_command

    return eval_command(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from localrt.bench import bench_command

    return bench_command(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from localrt.server import serve_command

    return serve_command(args)


# ---- parser ----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from localrt import remote_cli

    parser = OneLineErrorParser(prog="localrt", description="Run large language models locally.")
    parser.add_argument("-v", "--version", action="version", version=f"localrt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineErrorParser)

    p = sub.add_parser("pull", help="download a model")
    p.add_argument("model")
    p.add_argument("--insecure", action="store_true", help="allow http registries")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("run", help="run a model (one-shot with a prompt, else interactive)")
    p.add_argument("model")
    p.add_argument("prompt", nargs="*")
    p.add_argument("--backend", default=None, help="llama.cpp, mlx, torch or auto")
    p.add_argument("--verbose", action="store_true", help="print timings")
    p.add_argument("--format", default=None, help="'json' for JSON output")
    p.add_argument("--keepalive", default=None, help="how long the model stays loaded (e.g. 5m)")
    p.add_argument("--draft", default=None, help="draft model for speculative decoding")
    p.add_argument("--spec", default=None, help="speculative mode: off, draft, lookup, self, auto")
    p.add_argument("--insecure", action="store_true")
    p.set_defaults(func=cmd_run)

    for alias in ("list", "ls"):
        p = sub.add_parser(alias, help="list models")
        p.set_defaults(func=cmd_list)

    p = sub.add_parser("ps", help="list loaded models")
    p.set_defaults(func=cmd_ps)

    p = sub.add_parser("show", help="show information for a model")
    p.add_argument("model")
    for flag in ("modelfile", "parameters", "template", "system", "license", "path"):
        p.add_argument(f"--{flag}", action="store_true")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("rm", help="remove models")
    p.add_argument("models", nargs="+")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("cp", help="copy a model")
    p.add_argument("source")
    p.add_argument("destination")
    p.set_defaults(func=cmd_cp)

    p = sub.add_parser("stop", help="unload a running model")
    p.add_argument("model")
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("create", help="create a model from a GGUF file or a Modelfile")
    p.add_argument("model")
    p.add_argument("--from", dest="from_path", default=None, help="a GGUF file")
    p.add_argument("-f", "--file", default=None, help="a Modelfile")
    p.add_argument("-q", "--quantize", default=None, help="requantize to TYPE (e.g. Q4_K_M)")
    remote_cli.add_create_args(p)
    p.set_defaults(func=cmd_create)
    remote_cli.add_serve_engine_parser(sub)

    p = sub.add_parser("chat", help="the terminal chat app")
    p.add_argument("model", nargs="?", default=None, help="the model to start with (e.g. smollm2:135m)")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="start the HTTP server on LOCALRT_HOST")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("convert", help="convert HF safetensors to GGUF")
    p.add_argument("source", help="HF model directory or repo id (org/name)")
    p.add_argument(
        "-q",
        "--quant",
        default="Q4_K_M",
        help="F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K_S/M/L Q4_K_S/M Q5_K_S/M Q6_K",
    )
    p.add_argument("-o", "--output", default=None, help="write FILE.gguf")
    p.add_argument("--name", default=None, help="import into the store as NAME")
    p.add_argument("--threads", type=int, default=0)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("eval", help="perplexity and KL divergence")
    p.add_argument("model", help="model name or .gguf path")
    p.add_argument("--text", required=True)
    p.add_argument("--reference", default=None)
    p.add_argument("--backend", default=None)
    p.add_argument("--reference-backend", default=None, help="backend for --reference (default: --backend)")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_eval)

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
    return parser


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints usage plus the error; a user mistake should be one line on stderr."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"Error: {self.prog}: {message} (see --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    from localrt.remote_cli import split_engine_args

    parser = build_parser()
    argv, engine_args = split_engine_args(list(sys.argv[1:] if argv is None else argv))
    args, extra = parser.parse_known_args(argv)
    if engine_args:
        args.engine_args = engine_args
    # `run M --verbose Why is...`: argparse gives the prompt words after an option back as extras
    if extra and getattr(args, "command", None) == "run" and not any(w.startswith("-") for w in extra):
        args.prompt = [*args.prompt, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    debug = os.environ.get("LOCALRT_DEBUG", "") not in ("", "0")
    try:
        return int(args.func(args) or 0)
    except LocalrtError as e:
        if debug:
            raise
        print(f"Error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except OSError as e:
        if debug:
            raise
        if e.errno == errno.ENOSPC:
            print("Error: no space left on device", file=sys.stderr)
        else:
            where = f": {e.filename}" if e.filename else ""
            print(f"Error: {e.strerror or e}{where}", file=sys.stderr)
        return 1
    except Exception as e:  # a bug, not a user mistake: still one line, with a way to see more
        if debug:
            raise
        print(
            f"Error: internal error: {type(e).__name__}: {e} (set LOCALRT_DEBUG=1 for details)",
            file=sys.stderr,
        )
        return 1
