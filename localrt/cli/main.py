"""`localrt ...`: the parser (one `add_*` function per command, in its group's module) and `main`.

Every user mistake ends as one line on stderr and a non-zero exit; a missing optional part names the
extra to install; tracebacks only with LOCALRT_DEBUG=1.

To add a command: write `add_NAME(sub)` (building its parser, `set_defaults(func=...)`) beside its
group (store.py for store commands, run.py for runtime commands, tools.py for the rest) and list it
in COMMANDS below; a flag for an existing command goes into that command's `add_*` function.
"""

from __future__ import annotations

import argparse
import errno
import sys
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from localrt import __version__
from localrt import config
from localrt.cli import agent
from localrt.cli import chat
from localrt.cli import launch
from localrt.cli import run
from localrt.cli import serve
from localrt.cli import serve_engine
from localrt.cli import store
from localrt.cli import tools
from localrt.errors import LocalrtError

# in `localrt --help` order
COMMANDS: list[Callable[[Any], Any]] = [
    store.add_pull,
    store.add_push,
    run.add_run,
    store.add_list,
    run.add_ps,
    store.add_show,
    store.add_rm,
    store.add_cp,
    run.add_stop,
    store.add_create,
    store.add_verify,
    chat.add_chat,
    serve.add_serve,
    tools.add_convert,
    tools.add_eval,
    tools.add_imatrix,
    tools.add_bench,
    serve_engine.add_serve_engine,
    launch.add_launch,
    agent.add_mcp,
]

# an optional library -> the extra that installs it (a command's own `extra` default wins)
EXTRAS = {
    "llama_cpp": "llama",
    "torch": "torch",
    "triton": "torch",
    "mlx": "mlx",
    "textual": "tui",
    "gguf": "convert",
    "tokenizers": "convert",
    "safetensors": "convert",
    "numpy": "convert",
}


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints usage plus the error; a user mistake should be one line on stderr."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"Error: {self.prog}: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="localrt", description="Run large language models locally.")
    parser.add_argument("-v", "--version", action="version", version=f"localrt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineErrorParser)
    for add in COMMANDS:
        add(sub)
    return parser


def missing_extra(e: ModuleNotFoundError, args: argparse.Namespace) -> str | None:
    """The one line for an optional library that is not installed; None when the missing module is
    ours (a packaging bug, reported as an internal error)."""
    module = (e.name or "").split(".")[0]
    if not module or module == "localrt":
        return None
    extra = getattr(args, "extra", None) or EXTRAS.get(module)
    if extra is None:
        return f"{module} is not installed (reinstall localrt: pip install localrt)"
    return f"localrt {args.command} needs {module}, which is not installed: pip install 'localrt[{extra}]'"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # `serve-engine ... -- ENGINE ARGS`: everything after `--` goes to the engine untouched
    argv, engine_args = serve_engine.split_engine_args(list(sys.argv[1:] if argv is None else argv))
    argv, agent_args = launch.split_agent_args(argv)  # `launch ... -- AGENT ARGS`, likewise
    args, extra = parser.parse_known_args(argv)
    if engine_args:
        args.engine_args = engine_args
    if agent_args:
        args.agent_args = agent_args
    # `run M --verbose Why is...`: argparse gives the prompt words after an option back as extras
    if extra and getattr(args, "command", None) == "run" and not any(w.startswith("-") for w in extra):
        args.prompt = [*args.prompt, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except Exception as e:
        if config.debug():
            raise
        print(f"Error: {error_line(e, args)}", file=sys.stderr)
        return 1


def error_line(e: Exception, args: argparse.Namespace) -> str:
    """The one line a failed command prints after `Error: `."""
    if isinstance(e, LocalrtError):
        return str(e)
    if isinstance(e, ModuleNotFoundError) and (line := missing_extra(e, args)):
        return line
    if isinstance(e, OSError):
        if e.errno == errno.ENOSPC:
            return "no space left on device"
        where = f": {e.filename}" if e.filename else ""
        return f"{e.strerror or e}{where}"
    # a bug, not a user mistake: still one line, with a way to see more
    return f"internal error: {type(e).__name__}: {e} (set LOCALRT_DEBUG=1 for details)"
