"""The CLI's remote-model pieces (SPEC 5, 8), self-contained so they move with the CLI:
`create --remote URL [--remote-model ID] [--api-key-env VAR] [--insecure]` and `serve-engine`."""

from __future__ import annotations

import argparse
from typing import Any

from localrt.serve_engine import add_parser as add_serve_engine_parser
from localrt.serve_engine import split_engine_args

__all__ = ["add_create_args", "add_serve_engine_parser", "create_kwargs", "split_engine_args"]


def add_create_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--remote",
        action="append",
        default=None,
        metavar="URL",
        help="an OpenAI-compatible endpoint (https://host:port/v1); repeat for a pool",
    )
    p.add_argument("--remote-model", default=None, metavar="ID", help="the upstream's model id")
    p.add_argument(
        "--api-key-env", default=None, metavar="VAR", help="environment variable holding the API key"
    )
    p.add_argument("--insecure", action="store_true", help="allow plain http to a non-loopback host")


def create_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The remote settings for `localrt.store.modelfile.create`."""
    return {
        "remote": args.remote,
        "remote_model": args.remote_model,
        "api_key_env": args.api_key_env,
        "insecure": args.insecure,
    }
