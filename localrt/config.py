"""Configuration from the environment (docs/configuration.md). Read at call time so tests can set variables.

The one module that reads environment variables: every other module asks here (tests and benchmarks
excepted), so `grep environ` finds every knob in one place. `VARIABLES` lists each one with its default
and meaning; the accessors below take their defaults from it, `localrt serve --help` prints it and
docs/configuration.md is rendered from it (`python -m localrt.config` rewrites the page).
"""

from __future__ import annotations

import math
import os
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from localrt.errors import LocalrtError

SERVER = "The server and the CLI"
SECURITY = "Security"
TESTS = "Tests and benchmarks only"
SECTION_NOTES = {SECURITY: "See [security.md](security.md) for what each setting guards."}


@dataclass(frozen=True)
class Variable:
    """One environment variable. `default` is the text that, set, behaves as the variable unset ("" where
    nothing does); `shown` describes a default that is computed or means "nothing"."""

    name: str
    type: str
    default: str
    section: str
    help: str
    shown: str = ""
    load: bool = False  # read when a model loads: part of the load key, so a change reloads the model

    @property
    def default_text(self) -> str:
        """The default as the page shows it, in markdown."""
        return self.shown or (f"`{self.default}`" if self.default else "(none)")


VARIABLES: tuple[Variable, ...] = (
    Variable(
        "LOCALRT_HOST",
        "address",
        "127.0.0.1:11434",
        SERVER,
        "Where `serve` listens and where the CLI and the chat app look for a server. Accepts `host`, "
        "`host:port`, `:port` or `http://host:port`.",
    ),
    Variable(
        "LOCALRT_MODELS",
        "path",
        "",
        SERVER,
        "The model store. Set it to `~/.ollama/models` to use an Ollama store in place.",
        shown="platformdirs user data dir + `/models`",
    ),
    Variable(
        "LOCALRT_KEEP_ALIVE",
        "duration",
        "5m",
        SERVER,
        "How long an idle model stays loaded (`30s`, `10m`, `1h`, seconds, or `-1` for forever).",
    ),
    Variable(
        "LOCALRT_MAX_LOADED_MODELS",
        "integer",
        "2",
        SERVER,
        "Models kept loaded at once. Beyond it, the least recently used idle model is unloaded. Remote "
        "models do not count.",
    ),
    Variable(
        "LOCALRT_MAX_QUEUE",
        "integer",
        "512",
        SERVER,
        'Waiting requests per model. Beyond it the API answers 503 "server busy".',
    ),
    Variable(
        "LOCALRT_NUM_PARALLEL",
        "count",
        "auto",
        SERVER,
        "Concurrent sequences per loaded model: `auto` (what fits the memory budget, 4 to 8 where 4 fit) or "
        "1 to 256. For a remote model: requests in flight per endpoint (default 64).",
        load=True,
    ),
    Variable(
        "LOCALRT_CONTEXT_LENGTH",
        "integer",
        "4096",
        SERVER,
        "`num_ctx` when neither the request nor the Modelfile sets it.",
    ),
    Variable(
        "LOCALRT_BACKEND",
        "name",
        "auto",
        SERVER,
        "`llama.cpp`, `torch`, `mlx` or `auto` (MLX on Apple Silicon, else llama.cpp).",
    ),
    Variable(
        "LOCALRT_KV_CACHE_TYPE",
        "name",
        "f16",
        SERVER,
        "The KV cache type where the request does not set one: `f16`, `bf16`, `f32`, `q8_0` (`int8`), "
        "`q4_0`, `fp8`, where the backend supports it.",
    ),
    Variable(
        "LOCALRT_BATCH_INVARIANT",
        "flag",
        "",
        SERVER,
        "`1`: a request's output does not depend, to the last bit, on what is batched beside it, as vLLM's "
        "`VLLM_BATCH_INVARIANT`. It costs prefill speed (the llama.cpp backend evaluates 48 prompt rows a step "
        "instead of `num_batch`) and memory (a KV stream of `num_ctx` cells per parallel sequence instead of "
        "one shared pool). Off, a lone request's output is still the same from run to run "
        "(see [limitations.md](limitations.md)). The setting changes the llama.cpp backend only: the torch and "
        "MLX engines lay out each row's products the same whatever the batch, with or without it "
        "(see [backends.md](backends.md)).",
        shown="off",
        load=True,
    ),
    Variable(
        "LOCALRT_SHUTDOWN_GRACE",
        "duration",
        "30s",
        SERVER,
        "On SIGTERM or SIGINT, how long requests in flight may run on (new ones get 503 with `Retry-After`). "
        "Then each stream still running ends with its protocol's error chunk, and a pull stops where it can "
        "resume. A second signal stops at once.",
    ),
    Variable(
        "LOCALRT_MAX_RESPONSES",
        "integer",
        "1000",
        SERVER,
        "Stored `/v1/responses`. Past it, the least recently used response is dropped.",
    ),
    Variable(
        "LOCALRT_DATA",
        "path",
        "",
        SERVER,
        "Where the chat app keeps its conversation database.",
        shown="platformdirs user data dir",
    ),
    Variable(
        "LOCALRT_MLX_BLAS",
        "name",
        "",
        SERVER,
        "`openblas` or a library path: the BLAS under MLX's fp32 products on Linux (opt-in; see "
        "[backends.md](backends.md)).",
        shown="(MLX's own)",
        load=True,
    ),
    Variable(
        "LOCALRT_MAX_MEMORY",
        "size",
        "",
        SERVER,
        "The memory loaded models may use together (`8GiB`, `512MiB`). Beyond it idle models are unloaded, "
        "then the load is fitted down or refused. See [memory.md](memory.md).",
        shown="free RAM (within the memory cgroup)",
    ),
    Variable(
        "LOCALRT_GPU_OVERHEAD",
        "size",
        "0",
        SERVER,
        "VRAM kept free on each GPU (`512MiB`) when `num_gpu` -1 fits the llama.cpp backend's layers to "
        "the free VRAM (see [memory.md](memory.md)).",
        load=True,
    ),
    Variable(
        "LOCALRT_AGENT_PATH",
        "paths",
        "",
        SERVER,
        "Where `localrt launch` looks for `claude`, `codex` and `opencode` before `PATH`.",
    ),
    Variable(
        "LOCALRT_DEBUG",
        "flag",
        "",
        SERVER,
        "`1`: the CLI shows tracebacks, and llama.cpp's own log is not silenced.",
        shown="off",
    ),
    Variable(
        "HF_ENDPOINT",
        "URL",
        "",
        SERVER,
        "The Hub (or a mirror) that `pull hf.co/...` and `convert ORG/REPO` use.",
        shown="Hugging Face",
    ),
    Variable(
        "LOCALRT_UI",
        "flag",
        "on",
        SERVER,
        "`off`: `/` answers a browser with the liveness text, as any other client, instead of the chat page "
        "(see [web.md](web.md)), and the page's files under `/ui/` are not served.",
        shown="on",
    ),
    Variable(
        "LOCALRT_API_KEY",
        "text",
        "",
        SECURITY,
        "When set, every API call needs `Authorization: Bearer <key>` (or `x-api-key`). It is compared in "
        "constant time. The CLI and the chat app send it.",
    ),
    Variable(
        "LOCALRT_ORIGINS",
        "list",
        "",
        SECURITY,
        "Extra CORS origins allowed beside localhost, comma separated.",
    ),
    Variable(
        "LOCALRT_ALLOWED_HOSTS",
        "list",
        "",
        SECURITY,
        "Extra names allowed in the `Host` header, comma separated. Loopback names, and the machine's own "
        "names and addresses, are always allowed.",
    ),
    Variable(
        "LOCALRT_REMOTE_KEY_ENVS",
        "list",
        "",
        SECURITY,
        "The environment variables an API client may name as a remote model's `api_key_env`. The CLI may "
        "name any.",
    ),
    Variable(
        "LOCALRT_MAX_BODY",
        "integer",
        "67108864",
        SECURITY,
        "The largest request body, in bytes. Blob uploads are streamed and digest-checked instead.",
        shown="`67108864` (64 MiB)",
    ),
    Variable(
        "LOCALRT_FETCH_IMAGES",
        "flag",
        "",
        SECURITY,
        "`1`: OpenAI `image_url` parts and Responses `input_image` parts may name http(s) URLs (at most "
        "10 s and 20 MiB each).",
        shown="off",
    ),
    Variable(
        "LOCALRT_TEST_THREADS",
        "integer",
        "1",
        TESTS,
        "llama.cpp threads in the tests. On a busy 2-core machine, two spinning threads slow decoding many "
        "times over.",
    ),
    Variable(
        "LOCALRT_TEST_CACHE",
        "path",
        "~/.cache/localrt-tests",
        TESTS,
        "Test models, the llama.cpp sources and the llama.cpp tools the oracle tests build.",
    ),
    Variable(
        "LOCALRT_UPDATE_SCREENSHOT",
        "flag",
        "",
        TESTS,
        "`1`: `tests/test_tui_terminal.py` retakes `docs/tui.svg`, and `tests/test_web.py` the chat page's "
        "screenshots in `docs/`.",
        shown="off",
    ),
    Variable(
        "LOCALRT_TEST_PAUSE",
        "point",
        "",
        TESTS,
        "Fault injection, for tests only: `POINT[@BYTES][#N]` stops the process (SIGSTOP, after printing "
        "`localrt-test: paused at POINT` on stderr) the Nth time it reaches that point of a store write, so "
        "a test can kill it there or change the disk and let it go on. The points are listed in "
        "`localrt/faults.py`. Never set it outside a test.",
        shown="off",
    ),
    Variable(
        "LOCALRT_TEST_FAULT",
        "point",
        "",
        TESTS,
        "Fault injection, for tests only: `POINT[#N]` makes the Nth time (default the first) this process "
        "reaches an engine's fault point fail there: `decode` (a llama.cpp decode returns an error code) or "
        "`engine` (an error escapes an engine thread's loop between two steps). The points are listed in "
        "`localrt/faults.py`. Never set it outside a test.",
        shown="off",
    ),
    Variable(
        "LOCALRT_FUZZ_ARTIFACTS",
        "path",
        "",
        TESTS,
        "Where the GGUF fuzzer saves a failing input.",
        shown="a temporary directory",
    ),
)
BY_NAME = {v.name: v for v in VARIABLES}


def load_key() -> tuple[str, ...]:
    """The variables read when a model loads (`load=True`), as set now: part of each load's key, so that
    a model loaded under other values is reloaded, as other load options reload it."""
    return tuple(setting(v.name) for v in VARIABLES if v.load)


def default_of(name: str) -> str:
    """The default text of a variable in `VARIABLES` (a KeyError for one missing from the table)."""
    return BY_NAME[name].default


LOAD_NOTE = " Read when a model loads: a loaded model is reloaded when it changes."
INTRO = """\
Every setting is optional. The code reads each one through `localrt/config.py`, the only module that reads
environment variables, which is also where each default lives. A bad value (a port that is not a number,
`LOCALRT_NUM_PARALLEL=0`) is a one-line error at start-up."""


def configuration_markdown() -> str:
    """docs/configuration.md: the intro, then one table per section, in the order of `VARIABLES`."""
    out = [
        "# Configuration",
        "",
        "<!-- Rendered from VARIABLES in localrt/config.py by `python -m localrt.config`: edit the table there. -->",
        "",
        INTRO,
    ]
    for section in dict.fromkeys(v.section for v in VARIABLES):
        out += ["", f"## {section}", ""]
        if section in SECTION_NOTES:
            out += [SECTION_NOTES[section], ""]
        out += ["| variable | default | meaning |", "|---|---|---|"]
        out += [
            f"| `{v.name}` | {v.default_text} | {v.help}{LOAD_NOTE if v.load else ''} |"
            for v in VARIABLES
            if v.section == section
        ]
    return "\n".join(out) + "\n"


def _plain(markdown: str) -> str:
    """Markdown for a terminal: a link becomes the repository path of its page (links are relative to
    docs/), code spans lose their backticks."""
    return re.sub(r"\[[^\]]*\]\(([^)]*)\)", r"docs/\1", markdown).replace("`", "")


def help_text(width: int = 100) -> str:
    """The variables a running localrt reads (not the tests' own), for `localrt serve --help`."""
    lines = ["environment variables (docs/configuration.md):"]
    for v in VARIABLES:
        if v.section == TESTS:
            continue
        lines.append(f"  {v.name}  ({v.type}, default: {_plain(v.default_text)})")
        lines += textwrap.wrap(_plain(v.help), width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def setting(name: str, default: str = "") -> str:
    """The raw text of one variable, stripped, for a module that parses its own (e.g. LOCALRT_NUM_PARALLEL)."""
    return os.environ.get(name, default).strip()


def flag(name: str) -> bool:
    """An on/off variable: on for `1`, `true`, `yes` or `on` (any case)."""
    return setting(name).lower() in ("1", "true", "yes", "on")


def debug() -> bool:
    """`LOCALRT_DEBUG=1`: the CLI re-raises errors so the traceback shows."""
    return (setting("LOCALRT_DEBUG") or default_of("LOCALRT_DEBUG")) not in ("", "0")


def default_backend() -> str:
    return setting("LOCALRT_BACKEND") or default_of("LOCALRT_BACKEND")


def default_kv_cache_type() -> str:
    return setting("LOCALRT_KV_CACHE_TYPE").lower() or default_of("LOCALRT_KV_CACHE_TYPE")


def extra_origins() -> list[str]:
    """LOCALRT_ORIGINS: CORS origins allowed beside localhost, comma separated."""
    return [o.strip() for o in setting("LOCALRT_ORIGINS").split(",") if o.strip()]


def api_key() -> str | None:
    return os.environ.get("LOCALRT_API_KEY") or None


def secret(name: str) -> str | None:
    """A variable whose name the user chose, holding a key (a remote model's `api_key_env`, which is not
    in the table): read each time it is needed, so a rotated key needs no restart; None if unset or empty."""
    return os.environ.get(name) or None


def environment() -> dict[str, str]:
    """The whole environment, for a child process that inherits it (`localrt launch`'s agents)."""
    return dict(os.environ)


def hf_endpoint() -> str | None:
    """HF_ENDPOINT read now: huggingface_hub reads it once at import, which is too early for tests and mirrors."""
    return os.environ.get("HF_ENDPOINT") or None


def models_dir() -> Path:
    env = os.environ.get("LOCALRT_MODELS")
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_data_dir("localrt")) / "models"


def data_dir() -> Path:
    """Where the chat app keeps its conversations (`LOCALRT_DATA`, else the platformdirs data dir)."""
    env = os.environ.get("LOCALRT_DATA")
    return Path(env).expanduser() if env else Path(platformdirs.user_data_dir("localrt"))


def mcp_config_path() -> Path:
    """The MCP servers the chat app and `localrt run --tools` start: `mcp.json` in the platformdirs user
    config dir (`~/.config/localrt/mcp.json` on Linux; `XDG_CONFIG_HOME` moves it), in Claude Desktop's
    `mcpServers` format."""
    return Path(platformdirs.user_config_dir("localrt")) / "mcp.json"


def host() -> tuple[str, int]:
    """`LOCALRT_HOST` as (host, port); accepts `host`, `host:port`, `:port`, `http://host:port`."""
    raw = os.environ.get("LOCALRT_HOST", default_of("LOCALRT_HOST")).strip()
    default_port = default_of("LOCALRT_HOST").rpartition(":")[2]
    raw = re.sub(r"^[a-z]+://", "", raw).rstrip("/")
    if raw.startswith("["):  # [::1]:port
        h, _, rest = raw[1:].partition("]")
        port = rest.lstrip(":") or default_port
    else:
        h, sep, port = raw.rpartition(":")
        if not sep:
            h, port = raw, default_port
    try:
        return (h or "127.0.0.1", int(port))
    except ValueError:
        raise LocalrtError(f"LOCALRT_HOST has a bad port: {raw!r}") from None


def env_int(name: str, default: int | None = None) -> int:
    """An integer variable; `default` None means the table's."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return int(default_of(name)) if default is None else default
    try:
        return int(raw)
    except ValueError:
        raise LocalrtError(f"{name} must be an integer, got {raw!r}") from None


def parse_duration(value: str | int | float | None, default: float | None = None) -> float:
    """Ollama's keep_alive: "5m", "1h30m", "300" or 300 (seconds); negative means forever (inf). No value
    means `default`, or LOCALRT_KEEP_ALIVE's default in the table."""
    if value is None or value == "":
        return parse_duration(default_of("LOCALRT_KEEP_ALIVE")) if default is None else default
    if isinstance(value, bool):
        raise LocalrtError(f"invalid duration: {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            parts = re.findall(r"(-?\d+(?:\.\d+)?)(ms|h|m|s)", text)
            if not parts or "".join(n + u for n, u in parts) != text:
                raise LocalrtError(f"invalid duration: {value!r} (use e.g. 30s, 5m, 1h, -1)") from None
            scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
            seconds = sum(float(n) * scale[u] for n, u in parts)
    if math.isnan(seconds):  # float("nan") parses; a NaN timer would unload at once and break expiry dates
        raise LocalrtError(f"invalid duration: {value!r} (use e.g. 30s, 5m, 1h, -1)")
    return float("inf") if seconds < 0 else seconds


def shutdown_grace() -> float:
    """LOCALRT_SHUTDOWN_GRACE in seconds: how long a stopping server lets requests in flight run on."""
    return parse_duration(setting("LOCALRT_SHUTDOWN_GRACE") or default_of("LOCALRT_SHUTDOWN_GRACE"))


def keep_alive_default() -> float:
    return parse_duration(os.environ.get("LOCALRT_KEEP_ALIVE"))


def agent_path() -> list[Path]:
    """`LOCALRT_AGENT_PATH`: folders searched before PATH for `localrt launch`'s agents (os.pathsep separated)."""
    return [Path(p).expanduser() for p in setting("LOCALRT_AGENT_PATH").split(os.pathsep) if p.strip()]


def server_address() -> tuple[str, str]:
    """For clients of a running server: (base URL, host:port as configured); a wildcard bind means loopback."""
    host_name, port = host()
    shown = f"{host_name}:{port}"
    if ":" in host_name and not host_name.startswith("["):
        host_name = f"[{host_name}]"
    if host_name in ("0.0.0.0", "[::]"):
        host_name = "127.0.0.1"
    return f"http://{host_name}:{port}", shown


def auth_headers() -> dict[str, str]:
    """The Authorization header a client sends when LOCALRT_API_KEY is set."""
    key = api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def mlx_blas() -> str:
    """`LOCALRT_MLX_BLAS`: the BLAS library to put under MLX's fp32 products on Linux ("" = MLX's own)."""
    return setting("LOCALRT_MLX_BLAS")


def fetch_images() -> bool:
    """`LOCALRT_FETCH_IMAGES=1`: OpenAI `image_url` parts may name http(s) URLs (off by default: a request
    must not make the server reach out to the network)."""
    return flag("LOCALRT_FETCH_IMAGES")


def ui_enabled() -> bool:
    """LOCALRT_UI: the chat page at `/` for browsers (on unless `0`, `off`, `false` or `no`)."""
    return (setting("LOCALRT_UI") or default_of("LOCALRT_UI")).lower() not in ("0", "off", "false", "no")


def batch_invariant() -> bool:
    """LOCALRT_BATCH_INVARIANT: outputs that do not depend on what runs beside them (read into a load's
    options: a change means a reload)."""
    return flag("LOCALRT_BATCH_INVARIANT")


MAX_NUM_PARALLEL = 256


def num_parallel() -> int:
    """LOCALRT_NUM_PARALLEL: `auto` (the default, 0 here: the backend fits the memory budget) or 1..256."""
    raw = (setting("LOCALRT_NUM_PARALLEL") or default_of("LOCALRT_NUM_PARALLEL")).lower()
    if raw in ("", "auto", "0"):
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 1 <= value <= MAX_NUM_PARALLEL:
        raise LocalrtError(
            f"LOCALRT_NUM_PARALLEL must be auto or an integer from 1 to {MAX_NUM_PARALLEL}, got {raw!r}"
        )
    return value


def context_length(default: int | None = None) -> int:
    """LOCALRT_CONTEXT_LENGTH: num_ctx when neither the request nor the Modelfile sets it (`default` None:
    the table's)."""
    value = env_int("LOCALRT_CONTEXT_LENGTH", default)
    if value < 1:
        raise LocalrtError(f"LOCALRT_CONTEXT_LENGTH must be a positive integer, got {value}")
    return value


def allowed_hosts() -> list[str]:
    """LOCALRT_ALLOWED_HOSTS: more names for the Host header (loopback and this machine's always pass)."""
    return [h.strip().lower() for h in setting("LOCALRT_ALLOWED_HOSTS").split(",") if h.strip()]


def remote_key_envs() -> list[str]:
    """LOCALRT_REMOTE_KEY_ENVS: variables an API client may name as a remote's api_key_env (default none)."""
    return [v.strip() for v in setting("LOCALRT_REMOTE_KEY_ENVS").split(",") if v.strip()]


SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(raw: str, name: str) -> int:
    """A byte count as "8GiB", "512MiB", "8G", "8gb" or plain bytes (binary units, as Ollama reads them)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(?:i?b)?\s*", raw.lower())
    if m is None:
        raise LocalrtError(f"{name} must be a size such as 8GiB or 512MiB, not {raw!r}")
    return int(float(m.group(1)) * SIZE_UNITS[m.group(2)])


def max_memory() -> int | None:
    """LOCALRT_MAX_MEMORY: the memory loaded models may use together (default: the free RAM at each load)."""
    raw = setting("LOCALRT_MAX_MEMORY")
    return parse_size(raw, "LOCALRT_MAX_MEMORY") if raw else None


def gpu_overhead() -> int:
    """LOCALRT_GPU_OVERHEAD: VRAM kept free on each GPU, as Ollama's OLLAMA_GPU_OVERHEAD (default 0)."""
    return parse_size(
        setting("LOCALRT_GPU_OVERHEAD") or default_of("LOCALRT_GPU_OVERHEAD"), "LOCALRT_GPU_OVERHEAD"
    )


def test_pause() -> str:
    """LOCALRT_TEST_PAUSE: the pause point a test asked for ("" for none); see localrt/faults.py."""
    return setting("LOCALRT_TEST_PAUSE")


def test_fault() -> str:
    """LOCALRT_TEST_FAULT: the engine fault a test asked for ("" for none); see localrt/faults.py."""
    return setting("LOCALRT_TEST_FAULT")


def main(argv: list[str]) -> int:
    """Write docs/configuration.md (or the path given) from `VARIABLES`."""
    target = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
    target.write_text(configuration_markdown(), encoding="utf-8")
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
