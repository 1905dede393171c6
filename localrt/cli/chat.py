"""`localrt chat [NAME]`: the Textual chat app (the `tui` extra), against a server or in-process."""

from __future__ import annotations

import argparse

from localrt.cli.common import Subparsers
from localrt.cli.common import add_tool_options


def add_chat(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser("chat", help="the terminal chat app")
    p.add_argument("model", nargs="?", default=None, help="the model to start with (e.g. smollm2:135m)")
    add_tool_options(p)
    p.set_defaults(func=cmd_chat, extra="tui")
    return p


def cmd_chat(args: argparse.Namespace) -> int:
    from localrt.tui.launch import launch

    return launch(args.model, mcp_config=args.mcp, approve_all=args.yes, tool_choice=args.tool_choice)
