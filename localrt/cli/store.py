"""The store commands: `pull`, `push`, `list`/`ls`, `show`, `rm`, `cp`, `create` through the client, and
`verify`, which reads the store on this machine itself.

With a `localrt serve` at LOCALRT_HOST they are requests to it (so its runtime unloads a removed model,
and a model it pulls is in its store); without one they work on the store in this process. `create
--remote` always writes the store itself (see create_remote_here).
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING
from typing import Any

from localrt.cli.common import Subparsers
from localrt.cli.common import with_client
from localrt.errors import LocalrtError
from localrt.format import human_ago
from localrt.format import human_size
from localrt.format import print_table

if TYPE_CHECKING:  # the client module (and the runtime behind it) loads on first use
    from localrt.client import Client
    from localrt.client import CreateSpec
    from localrt.client import ModelDetails


# ---- pull ---------------------------------------------------------------------------------------
def add_pull(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser("pull", help="download a model")
    p.add_argument("model")
    p.add_argument("--insecure", action="store_true", help="allow http registries")
    p.set_defaults(func=cmd_pull)
    return p


def cmd_pull(args: argparse.Namespace) -> int:
    from localrt.cli.progress import PullProgress

    async def go(client: Client) -> None:
        with PullProgress() as bar:
            async for event in client.pull(args.model, insecure=args.insecure):
                bar.update(event)

    with_client(go)
    return 0


# ---- push ---------------------------------------------------------------------------------------
def add_push(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser("push", help="upload a model to a registry")
    p.add_argument("model")
    p.add_argument("--insecure", action="store_true", help="allow http registries")
    p.set_defaults(func=cmd_push)
    return p


def cmd_push(args: argparse.Namespace) -> int:
    from localrt.cli.progress import PullProgress

    async def go(client: Client) -> None:
        with PullProgress() as bar:
            async for event in client.push(args.model, insecure=args.insecure):
                bar.update(event)

    with_client(go)
    return 0


# ---- list ---------------------------------------------------------------------------------------
def add_list(sub: Subparsers) -> list[argparse.ArgumentParser]:
    parsers = []
    for alias in ("list", "ls"):
        p = sub.add_parser(alias, help="list models")
        p.set_defaults(func=cmd_list)
        parsers.append(p)
    return parsers


def cmd_list(args: argparse.Namespace) -> int:
    rows = [["NAME", "ID", "SIZE", "MODIFIED"]]
    for m in with_client(lambda client: client.list_models()):
        rows.append([m.name, m.digest[:12], human_size(m.size), human_ago(m.modified)])
    print_table(rows)
    return 0


# ---- show ---------------------------------------------------------------------------------------
SHOW_FLAGS = ("modelfile", "parameters", "template", "system", "license", "path")


def add_show(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser("show", help="show information for a model")
    p.add_argument("model")
    for flag in SHOW_FLAGS:
        p.add_argument(f"--{flag}", action="store_true")
    p.set_defaults(func=cmd_show)
    return p


def cmd_show(args: argparse.Namespace) -> int:
    if args.path:  # a path on this machine: the local store's, never the server's
        from localrt.store.names import parse_name
        from localrt.store.store import Store

        resolved = Store().resolve(parse_name(args.model))
        if resolved.remote is not None:
            raise LocalrtError(f"'{resolved.name.display}' is a remote model: it has no GGUF file")
        print(resolved.model_path)
        return 0
    details = with_client(lambda client: client.details(args.model))
    if args.modelfile:
        print(details.modelfile, end="")
    elif args.template:
        print(details.template)
    elif args.parameters:
        for key, value in details.parameter_lines:
            print(f"{key:<24}{value}")
    elif args.system:
        print(details.system)
    elif args.license:
        print(details.license)
    else:
        print(show_text(details), end="")
        print_estimate_section(args.model)
    return 0


def print_estimate_section(model: str) -> None:
    """The memory a load would take, from the local store's file (nothing is loaded); silent for a
    remote model or one this machine's store does not hold."""
    from localrt.runtime import memory
    from localrt.store.store import Store

    try:
        estimate = memory.for_model(Store(), model)
    except LocalrtError:
        return
    if estimate is not None:
        print("  Memory (estimate)")
        print("\n".join(f"    {line}" for line in estimate.lines()), end="\n\n")


def show_text(details: ModelDetails) -> str:
    """`localrt show NAME` without flags: Ollama's indented sections."""
    rows = [
        ("architecture", details.architecture),
        ("parameters", details.parameters),
        ("context length", str(details.context_length or "unknown")),
        ("embedding length", str(details.embedding_length or "unknown")),
        ("quantization", details.quantization),
    ]
    if details.template_origin:
        rows.append(("template", details.template_origin))
    if details.endpoints:  # a remote model: what serves it, and whether each endpoint answers now
        out = ["  Remote", f"    {'upstream model':<20}{details.remote_model}", "", "  Endpoints"]
        out += [f"    {url:<40}{health}" for url, health in details.endpoints]
    else:
        out = ["  Model", *(f"    {key:<20}{value}" for key, value in rows)]
        if details.projector:
            out += ["", "  Projector", *(f"    {key:<20}{value}" for key, value in details.projector)]
        if details.adapters:  # LoRA adapters, in the order they apply (llama.cpp backend)
            out += ["", "  Adapters", *(f"    {path}" for path in details.adapters)]
        if details.capabilities:
            out += ["", "  Capabilities", *(f"    {cap}" for cap in details.capabilities)]
    if details.parameter_lines:
        out += ["", "  Parameters", *(f"    {key:<20}{value}" for key, value in details.parameter_lines)]
    if details.system:
        out += ["", "  System", "    " + details.system.strip().replace("\n", "\n    ")]
    if details.license.strip():
        out += ["", "  License", "    " + details.license.strip().splitlines()[0]]
    return "\n".join(out) + "\n\n"


# ---- rm, cp -------------------------------------------------------------------------------------
def add_rm(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser("rm", help="remove models")
    p.add_argument("models", nargs="+")
    p.set_defaults(func=cmd_rm)
    return p


def cmd_rm(args: argparse.Namespace) -> int:
    from localrt.store.names import parse_name

    async def go(client: Client) -> None:
        for text in args.models:
            name = parse_name(text)
            await client.delete(name.display)
            print(f"deleted '{name.display}'")

    with_client(go)
    return 0


def add_cp(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser("cp", help="copy a model")
    p.add_argument("source")
    p.add_argument("destination")
    p.set_defaults(func=cmd_cp)
    return p


def cmd_cp(args: argparse.Namespace) -> int:
    from localrt.store.names import parse_name

    src, dst = parse_name(args.source), parse_name(args.destination)
    with_client(lambda client: client.copy(src.display, dst.display))
    print(f"copied '{src.display}' to '{dst.display}'")
    return 0


# ---- verify -------------------------------------------------------------------------------------
def add_verify(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser("verify", help="re-hash blobs and check manifests (after a crash or a disk error)")
    p.add_argument("model", nargs="?", default=None, help="one model (default: the whole store)")
    p.add_argument("--repair", action="store_true", help="remove what is broken and name what to pull again")
    p.set_defaults(func=cmd_verify)
    return p


def cmd_verify(args: argparse.Namespace) -> int:
    """The store on this machine, read directly even while a server runs (its writes are atomic, and
    what it is writing is held, so a verify never takes it for a leftover)."""
    from localrt.cli.progress import ByteProgress
    from localrt.store.names import parse_name
    from localrt.store.store import Store
    from localrt.store.verify import verify

    name = parse_name(args.model) if args.model else None
    with ByteProgress("verifying") as bar:
        report = verify(Store(), name, repair=args.repair, progress=bar.update)
    for leftover in report.leftovers:
        print(f"store: {leftover.line()}")
    for problem in report.problems:
        print(problem.text)
    for line in report.removed:
        print(line)
    if report.unreferenced:
        size = human_size(sum(n for _, n in report.unreferenced))
        print(
            f"note: {len(report.unreferenced)} blob(s) ({size}) named by no model (an upload waiting for "
            "its create, or what an interrupted rm left); the next `localrt rm` collects them"
        )
    checked = f"{report.models} model(s), {report.blobs} blob(s), {human_size(report.bytes)}"
    if report.ok:
        print(f"ok: {checked} verified")
        return 0
    again = ", ".join(report.broken_models)
    if args.repair:
        then = f"; pull or create again: {again}" if again else ""
        raise LocalrtError(f"{len(report.problems)} problem(s) found in {checked} and removed{then}")
    raise LocalrtError(
        f"{len(report.problems)} problem(s) in {checked}: `localrt verify --repair` removes what is broken"
        + (f" ({again}: pull or create them again afterwards)" if again else "")
    )


# ---- create -------------------------------------------------------------------------------------
def add_create(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser("create", help="create a model from a GGUF file or a Modelfile")
    p.add_argument("model")
    p.add_argument("--from", dest="from_path", default=None, help="a GGUF file")
    p.add_argument("-f", "--file", default=None, help="a Modelfile")
    p.add_argument("-q", "--quantize", default=None, help="requantize to TYPE (e.g. Q4_K_M)")
    add_remote_args(p)
    p.add_argument("--mmproj", default=None, help="a vision model's projector GGUF (mmproj-*.gguf)")
    p.add_argument("--imatrix", default=None, help="importance matrix weighting --quantize (localrt imatrix)")
    p.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="PATH",
        help="a LoRA adapter: a GGUF, or a PEFT adapter folder (converted); after the Modelfile's ADAPTER "
        "lines; repeatable",
    )
    p.set_defaults(func=cmd_create)
    return p


def add_remote_args(p: argparse.ArgumentParser) -> None:
    """`create --remote URL [--remote-model ID] [--api-key-env VAR] [--insecure]`."""
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


def remote_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "remote": args.remote,
        "remote_model": args.remote_model,
        "api_key_env": args.api_key_env,
        "insecure": args.insecure,
    }


def cmd_create(args: argparse.Namespace) -> int:
    from localrt.client import CreateSpec
    from localrt.store.names import parse_name

    parse_name(args.model)  # a bad name fails before any file is read
    modelfile, base_dir = read_modelfile(args)
    spec = CreateSpec(
        args.model,
        modelfile_text=modelfile,
        from_path=args.from_path,
        base_dir=base_dir,
        quantize=args.quantize,
        **remote_kwargs(args),
        projector_path=args.mmproj,
        imatrix_path=args.imatrix,
        adapter_paths=tuple(args.adapter),
    )
    name = (
        create_remote_here(spec) if creates_remote(spec) else with_client(lambda client: client.create(spec))
    )
    print(f"success: created '{name}'")
    return 0


def creates_remote(spec: CreateSpec) -> bool:
    from localrt.store.modelfile import parse_modelfile

    return bool(spec.remote) or (
        spec.modelfile_text is not None and bool(parse_modelfile(spec.modelfile_text).remotes)
    )


def create_remote_here(spec: CreateSpec) -> str:
    """A remote model is written into the store by this process, even while a server runs: the CLI runs
    as the user, so it may name any variable as the key's, which the API refuses to a client (the
    server's API takes only LOCALRT_REMOTE_KEY_ENVS). The server reads the new manifest from the store."""
    from localrt.client import create_in_store
    from localrt.store.store import Store

    return create_in_store(spec, Store())


def read_modelfile(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """The Modelfile's text and folder (relative FROM paths start there); ./Modelfile by default."""
    if not args.from_path and not args.file and not args.remote:
        if not os.path.exists("Modelfile"):
            raise LocalrtError("create needs --from FILE.gguf or -f Modelfile")
        args.file = "Modelfile"
    if not args.file:
        return None, None
    try:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise LocalrtError(f"cannot read Modelfile {args.file}: {e.strerror}") from None
    return text, os.path.dirname(os.path.abspath(args.file))
