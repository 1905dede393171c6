"""The coding agents for the end-to-end tests: pinned versions, where their binaries are, a tiny model
that speaks Qwen3's tool-call format, and a proxy that forces each reply with a grammar.

- The agents are the npm packages at PINS, installed by .ci/run with `npm install --prefix`; their
  bin folder is LOCALRT_AGENT_PATH (also what `localrt launch` searches), else the default prefix.
- The model: random weights, 2 layers of width 64 (fast on a 20,000-token prompt), SmolLM2's BPE
  vocabulary (real text takes about as many tokens as with a real model's), the official Qwen3 chat
  template from llama.cpp's models/templates/ (tools rendered in the system turn, calls as
  `<tool_call>` JSON, results as `<tool_response>`).
- The agents cannot send a grammar, so the test's replies are forced as the thinking tests force
  theirs, by a proxy between the agent and `localrt serve`: it adds one field, `grammar`, to each
  generation request (chosen from what the request holds: a tool result, tools, or neither; in `options`
  on Ollama's routes) and passes
  everything else through unchanged, both ways.
"""

from __future__ import annotations

import json
import os
import tarfile
import threading
from http.server import BaseHTTPRequestHandler
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import gguf
import httpx
import numpy as np

from tests.conftest import CACHE
from tests.gguf_factory import LlamaShape
from tests.gguf_factory import add_llama_hparams
from tests.gguf_factory import add_llama_tensors

# the versions the end-to-end tests are run with; .ci/run installs exactly these
PINS = {
    "claude": ("@anthropic-ai/claude-code", "2.1.332"),
    "codex": ("@openai/codex", "0.171.0"),
    "opencode": ("opencode-ai", "1.18.33"),
}
DEFAULT_PREFIX = Path.home() / ".cache" / "localrt-agents"


def npm_specs() -> list[str]:
    return [f"{package}@{version}" for package, version in PINS.values()]


def agents_bin() -> Path | None:
    """The folder holding all three agents' executables, or None when they are not installed."""
    candidates = [Path(p) for p in os.environ.get("LOCALRT_AGENT_PATH", "").split(os.pathsep) if p]
    candidates.append(DEFAULT_PREFIX / "node_modules" / ".bin")
    for folder in candidates:
        if all((folder / agent).is_file() for agent in PINS):
            return folder
    return None


# ---- the model -------------------------------------------------------------------------------------
def official_template(name: str) -> str:
    """A chat template from llama.cpp's models/templates/, read from the pinned llama-cpp-python sdist."""
    from tests.fixtures_hf import llama_cpp_sdist

    target = CACHE / "templates" / name
    if not target.is_file():
        with tarfile.open(llama_cpp_sdist()) as tar:
            member = next(
                m for m in tar.getmembers() if m.name.endswith(f"/vendor/llama.cpp/models/templates/{name}")
            )
            data = tar.extractfile(member).read()  # type: ignore[union-attr]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return target.read_text()


def write_agent_model(path: Path, *, context_length: int, template: str, seed: int = 0) -> Path:
    """A random-weight Llama with SmolLM2's BPE vocabulary and `template` as its chat template."""
    from tests.conftest import _fetch_smollm2

    source = gguf.GGUFReader(str(_fetch_smollm2()))

    def strings(key: str) -> list[str]:
        f = source.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    tokens = strings("tokenizer.ggml.tokens")
    f = source.fields["tokenizer.ggml.token_type"]
    types = [int(f.parts[i][0]) for i in f.data]
    shape = LlamaShape(n_vocab=len(tokens), n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=128)
    im_end = tokens.index("<|im_end|>")
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-agent")
    add_llama_hparams(w, shape, context_length)
    w.add_file_type(0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(str(bytes(source.fields["tokenizer.ggml.pre"].parts[-1]), "utf-8"))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(strings("tokenizer.ggml.merges"))
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(im_end)  # a forced reply ends at the grammar's end: the one token left is EOS
    w.add_add_bos_token(False)
    w.add_chat_template(template)
    rng = np.random.default_rng(seed)

    def weight(name: str, rows: int, cols: int) -> None:
        w.add_tensor(name, (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32))

    add_llama_tensors(w, shape, weight)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- what the model says ---------------------------------------------------------------------------
def qwen3_call(name: str, arguments: dict[str, Any]) -> str:
    """A tool call in Qwen3's format, as its template describes it to the model."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def turn_of(path: str, body: dict[str, Any]) -> str:
    """Which turn a generation request is: "result" (it carries a tool's result), "tools" (tools are
    offered, no result yet) or "plain" (neither: e.g. a session-title request)."""
    if path.startswith("/v1/messages"):
        items = [
            b for m in body.get("messages", []) if isinstance(m.get("content"), list) for b in m["content"]
        ]
        has_result = any(b.get("type") == "tool_result" for b in items)
    elif path.startswith("/v1/responses"):
        has_result = any(
            i.get("type") == "function_call_output" for i in body.get("input", []) if isinstance(i, dict)
        )
    else:
        has_result = any(m.get("role") == "tool" for m in body.get("messages", []))
    if has_result:
        return "result"
    return "tools" if body.get("tools") else "plain"


GENERATION_PATHS = ("/v1/messages", "/v1/responses", "/v1/chat/completions", "/api/chat")


class GrammarProxy:
    """A 127.0.0.1 proxy to `upstream` that adds `grammar` to generation requests: the reply
    `replies[turn_of(request)]` spelled exactly. Every forwarded generation request is kept in `seen`."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.replies: dict[str, str] = {}
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self.http = httpx.Client(base_url=upstream, timeout=httpx.Timeout(None))
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                proxy.forward(self)

            do_POST = do_HEAD = do_DELETE = do_PUT = do_GET

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def rewrite(self, path: str, raw: bytes) -> bytes:
        if not path.startswith(GENERATION_PATHS) or not raw:
            return raw
        body = json.loads(raw)
        turn = turn_of(path, body)
        self.seen.append((path, body))
        reply = self.replies.get(turn)
        if reply is None:
            return raw
        grammar = {"grammar": "root ::= " + json.dumps(reply)}
        if path.startswith("/api/"):  # Ollama's routes take it as an option
            return json.dumps({**body, "options": {**(body.get("options") or {}), **grammar}}).encode()
        return json.dumps({**body, **grammar}).encode()

    def forward(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("content-length") or 0)
        raw = handler.rfile.read(length) if length else b""
        raw = self.rewrite(handler.path, raw)
        skip = {"host", "content-length", "connection", "accept-encoding", "transfer-encoding"}
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in skip}
        r = self.http.request(handler.command, handler.path, content=raw, headers=headers)
        handler.send_response(r.status_code)
        for k, v in r.headers.items():
            if k.lower() not in skip | {"content-encoding"}:
                handler.send_header(k, v)
        handler.send_header("content-length", str(len(r.content)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(r.content)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.http.close()
