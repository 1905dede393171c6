"""Start the chat app: `localrt chat [NAME]` and `python -m localrt.tui [NAME]` both land here."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from localrt.errors import LocalrtError


def launch(model: str | None) -> int:
    """Run the chat app on this terminal, starting with `model`; LocalrtError when it cannot start."""
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


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m localrt.tui [NAME]`: the same as `localrt chat [NAME]`, errors as one line."""
    parser = argparse.ArgumentParser(prog="localrt chat", description="The terminal chat app.")
    parser.add_argument("model", nargs="?", default=None, help="the model to start with (e.g. smollm2:135m)")
    args = parser.parse_args(argv)
    try:
        return launch(args.model)
    except LocalrtError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
