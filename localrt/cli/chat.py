"""`localrt chat [NAME]`: the Textual chat app (the `tui` extra), against a server or in-process."""

from __future__ import annotations

import argparse

from localrt.cli.common import Subparsers


def add_chat(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser("chat", help="the terminal chat app")
    p.add_argument("model", nargs="?", default=None, help="the model to start with (e.g. smollm2:135m)")
    add_chat_tool_arguments(p)
    p.set_defaults(func=cmd_chat, extra="tui")
    return p


def cmd_chat(args: argparse.Namespace) -> int:
    from localrt.tui.launch import launch

    return launch(args.model, mcp_config=args.mcp, approve_all=args.yes, tool_choice=args.tool_choice)


def add_chat_tool_arguments(p: argparse.ArgumentParser) -> None:
    """The chat's tools: the MCP config to start, and approving every call (both also in the F6 panel)."""
    p.add_argument(
        "--mcp",
        default=None,
        metavar="FILE",
        help="MCP servers to start (default ~/.config/localrt/mcp.json)",
    )
    p.add_argument("--yes", action="store_true", help="approve every tool call without asking")
    p.add_argument(
        "--tool-choice",
        default=None,
        metavar="CHOICE",
        help="auto, required, none, or a tool's name, for each answer's first request",
    )
