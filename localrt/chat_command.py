"""`localrt chat [NAME]`: start the Textual chat app (the `tui` extra) against a server or in-process."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from localrt.errors import LocalrtError


def chat_command(args: argparse.Namespace) -> int:
    """Run the chat app. `args.model` (or the first word of `args.rest`) names the model to start with."""
    model = getattr(args, "model", None)
    rest = getattr(args, "rest", None)
    if model is None and rest:  # the placeholder parser collects everything into `rest`
        model = rest[0]
    try:
        from localrt.tui.app import ChatApp
    except ImportError as e:
        raise LocalrtError(
            f"the chat app needs Textual ({e.name or e}): pip install 'localrt[tui]'"
        ) from None
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise LocalrtError("localrt chat needs a terminal (use `localrt run` for pipes and scripts)")
    app = ChatApp(model)
    code = app.run()
    return int(code or app.return_code or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="localrt chat", description="The terminal chat app.")
    parser.add_argument("model", nargs="?", default=None, help="the model to start with (e.g. smollm2:135m)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m localrt.tui [NAME]`: the same as `localrt chat [NAME]`, errors as one line."""
    args = build_parser().parse_args(argv)
    try:
        return chat_command(args)
    except LocalrtError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
