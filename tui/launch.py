"""Start the chat app: `localrt chat [NAME]` and `python -m localrt.tui [NAME]` both land here."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from localrt.errors import LocalrtError


def launch(
    model: str | None,
    *,
    mcp_config: str | None = None,
    approve_all: bool = False,
    tool_choice: str | None = None,
) -> int:
    """Run the chat app on this terminal, starting with `model`; LocalrtError when it cannot start."""
    try:
        from localrt.tui.app import ChatApp
    except ImportError as e:
        raise LocalrtError(
            f"the chat app needs Textual ({e.name or e}): pip install 'localrt[tui]'"
        ) from None
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise LocalrtError("localrt chat needs a terminal (use `localrt run` for pipes and scripts)")
    if mcp_config is not None:
        from localrt.agent.mcp import load_config

        load_config(mcp_config)  # a missing or broken file is an error before the screen changes
    app = ChatApp(model, mcp_config=mcp_config, approve_all=approve_all, tool_choice=tool_choice)
    code = app.run()
    return int(code or app.return_code or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m localrt.tui [NAME]`: the same as `localrt chat [NAME]`, errors as one line."""
    parser = argparse.ArgumentParser(prog="localrt chat", description="The terminal chat app.")
    parser.add_argument("model", nargs="?", default=None, help="the model to start with (e.g. smollm2:135m)")
    parser.add_argument("--mcp", default=None, metavar="FILE", help="MCP servers to start")
    parser.add_argument("--yes", action="store_true", help="approve every tool call without asking")
    parser.add_argument("--tool-choice", default=None, help="auto, required, none, or a tool's name")
    args = parser.parse_args(argv)
    try:
        return launch(args.model, mcp_config=args.mcp, approve_all=args.yes, tool_choice=args.tool_choice)
    except LocalrtError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
