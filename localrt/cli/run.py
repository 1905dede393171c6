"""The runtime commands: `run` (one-shot or the chat in repl.py), `ps` and `stop`, through the client.

With a `localrt serve` at LOCALRT_HOST, `run` answers through it (so `ps` lists what it loaded and the
next `run` finds the model warm); without one, `run` loads the model in this process, `ps` lists
nothing and `stop` says that no server is running.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from localrt.cli.agent import add_tool_arguments
from localrt.cli.common import Subparsers
from localrt.cli.common import with_client
from localrt.errors import LocalrtError
from localrt.format import human_size
from localrt.format import human_until
from localrt.format import print_table

if TYPE_CHECKING:
    from localrt.client import LoadedRow


# ---- run ----------------------------------------------------------------------------------------
def add_run(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser("run", help="run a model (one-shot with a prompt, else interactive)")
    p.add_argument("model")
    p.add_argument("prompt", nargs="*")
    p.add_argument("--backend", default=None, help="llama.cpp, mlx, torch or auto")
    p.add_argument("--verbose", action="store_true", help="print timings")
    p.add_argument("--format", default=None, help="'json' for JSON output")
    p.add_argument("--keepalive", default=None, help="how long the model stays loaded (e.g. 5m)")
    p.add_argument("--draft", default=None, help="draft model for speculative decoding")
    p.add_argument("--spec", default=None, help="speculative mode: off, draft, lookup, self, auto")
    p.add_argument(
        "--image", action="append", default=None, metavar="FILE", help="attach an image (repeatable)"
    )
    p.add_argument("--insecure", action="store_true")
    p.add_argument(
        "--estimate", action="store_true", help="print the memory a load would take, per part, and exit"
    )
    add_think_arguments(p)
    add_tool_arguments(p)
    p.set_defaults(func=cmd_run)
    return p


def add_think_arguments(p: argparse.ArgumentParser) -> None:
    """`run --think [low|medium|high]`, `--nothink`, `--hidethinking` (as Ollama's)."""
    p.add_argument(
        "--think",
        nargs="?",
        const="true",
        default=None,
        choices=["true", "false", "low", "medium", "high"],
        help="think before answering (a level for models that take one)",
    )
    p.add_argument("--nothink", action="store_true", help="answer without thinking")
    p.add_argument("--hidethinking", action="store_true", help="think, but do not print the thinking")


def cmd_run(args: argparse.Namespace) -> int:
    from localrt.cli.agent import ToolSession
    from localrt.cli.agent import wants_tools
    from localrt.cli.repl import Session
    from localrt.cli.repl import interactive
    from localrt.runtime.images import read_image_file

    if getattr(args, "estimate", False):
        return print_estimate(args)
    prompt_arg = getattr(args, "prompt", None)
    prompt = " ".join(prompt_arg) if isinstance(prompt_arg, list) else (prompt_arg or "")
    stdin_text = None if sys.stdin.isatty() else sys.stdin.read()
    images = [read_image_file(path) for path in getattr(args, "image", None) or []]  # before any load
    tools = wants_tools(args)
    session = Session(args)
    try:
        session.ensure_model(insecure=bool(getattr(args, "insecure", False)))
        if tools:
            session.agent = ToolSession(session, args)
            session.agent.start()
        if not prompt and stdin_text is None and not images:
            session.load()
            return interactive(session)
        # as Ollama: piped text first, then the prompt words
        text = " ".join(p for p in (stdin_text.strip() if stdin_text else "", prompt) if p)
        if not text and not images:
            session.load()
            return 0
        return 0 if session.ask(text, images) else 130
    except KeyboardInterrupt:
        session.err.write("\n")
        return 130
    finally:
        if session.agent is not None:
            session.agent.close()
        session.close()


def print_estimate(args: argparse.Namespace) -> int:
    """`run --estimate`: what a load would hold, from the stored file's header, without loading."""
    from localrt.runtime import memory
    from localrt.store.store import Store

    options = {k: v for k, v in (("backend", args.backend), ("draft_model", args.draft)) if v}
    estimate = memory.for_model(Store(), args.model, options)
    if estimate is None:
        raise LocalrtError(f"'{args.model}' is a remote model: it holds no memory here")
    fits, available, source = memory.fits_now(estimate)
    print(f"{args.model}")
    for line in estimate.lines():
        print(f"  {line}")
    verdict = "fits" if fits else "does not fit"
    print(f"  {'available':<12}{memory.human_bytes(available)} ({source}): {verdict}")
    return 0


# ---- ps -----------------------------------------------------------------------------------------
PS_HEADER = ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]


def add_ps(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser("ps", help="list loaded models")
    p.set_defaults(func=cmd_ps)
    return p


def cmd_ps(args: argparse.Namespace) -> int:
    rows = [PS_HEADER]
    for m in with_client(lambda client: client.ps()):  # in-process: nothing is loaded yet
        backend = ", ".join(part for part in (m.backend, m.numerics) if part)  # "torch, quantized"
        processor = f"{m.processor} ({backend})" if backend else m.processor
        rows.append(
            [
                m.name,
                m.digest[:12],
                human_size(m.size)
                + (f" (weights {human_size(m.weight_bytes)})" if m.weight_bytes else "")
                + (
                    f" (weights shared with {', '.join(m.shares_weights_with)})"
                    if m.shares_weights_with
                    else ""
                ),
                processor,
                context_text(m),
                human_until(m.expires_at),
            ]
        )
    print_table(rows)
    return 0


def context_text(m: LoadedRow) -> str:
    """The CONTEXT column: each sequence's context, and with several sequences their count and the KV
    pool they share (as `run --estimate` says it)."""
    if not m.context_length:
        return ""
    text = str(m.context_length)
    if m.parallel > 1:
        text += f" x {m.parallel}"
    if m.kv_pool:
        text += f", pool {m.kv_pool}"
    return text


# ---- stop ---------------------------------------------------------------------------------------
def add_stop(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser("stop", help="unload a running model")
    p.add_argument("model")
    p.set_defaults(func=cmd_stop)
    return p


def cmd_stop(args: argparse.Namespace) -> int:
    from localrt import config
    from localrt.client import server_answers

    if not server_answers():  # a model stays loaded only in a running server
        raise LocalrtError(f"no server running at {config.server_address()[1]}")
    with_client(lambda client: client.stop(args.model))
    return 0
