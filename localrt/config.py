"""Configuration from the environment (docs/configuration.md). Read at call time so tests can set variables.

The one module that reads environment variables: every other module asks here (tests and benchmarks
excepted), so `grep environ` finds every knob in one place.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import platformdirs

from localrt.errors import LocalrtError

DEFAULT_HOST = "127.0.0.1:11434"


def setting(name: str, default: str = "") -> str:
    """The raw text of one variable, stripped, for a module that parses its own (e.g. LOCALRT_NUM_PARALLEL)."""
    return os.environ.get(name, default).strip()


def debug() -> bool:
    """`LOCALRT_DEBUG=1`: the CLI re-raises errors so the traceback shows."""
    return setting("LOCALRT_DEBUG") not in ("", "0")


def default_backend() -> str:
    return setting("LOCALRT_BACKEND") or "auto"


def default_kv_cache_type() -> str:
    return setting("LOCALRT_KV_CACHE_TYPE").lower() or "f16"


def extra_origins() -> list[str]:
    """LOCALRT_ORIGINS: CORS origins allowed beside localhost, comma separated."""
    return [o.strip() for o in setting("LOCALRT_ORIGINS").split(",") if o.strip()]


def api_key() -> str | None:
    return os.environ.get("LOCALRT_API_KEY") or None


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


def host() -> tuple[str, int]:
    """`LOCALRT_HOST` as (host, port); accepts `host`, `host:port`, `:port`, `http://host:port`."""
    raw = os.environ.get("LOCALRT_HOST", DEFAULT_HOST).strip()
    raw = re.sub(r"^[a-z]+://", "", raw).rstrip("/")
    if raw.startswith("["):  # [::1]:port
        h, _, rest = raw[1:].partition("]")
        port = rest.lstrip(":") or "11434"
    else:
        h, sep, port = raw.rpartition(":")
        if not sep:
            h, port = raw, "11434"
    try:
        return (h or "127.0.0.1", int(port))
    except ValueError:
        raise LocalrtError(f"LOCALRT_HOST has a bad port: {raw!r}") from None


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise LocalrtError(f"{name} must be an integer, got {raw!r}") from None


def parse_duration(value: str | int | float | None, default: float = 300.0) -> float:
    """Ollama's keep_alive: "5m", "1h30m", "300" or 300 (seconds); negative means forever (inf)."""
    if value is None or value == "":
        return default
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


def keep_alive_default() -> float:
    return parse_duration(os.environ.get("LOCALRT_KEEP_ALIVE"), 300.0)


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
    return os.environ.get("LOCALRT_FETCH_IMAGES", "").strip().lower() in ("1", "true", "yes", "on")


MAX_NUM_PARALLEL = 256


def num_parallel() -> int:
    """LOCALRT_NUM_PARALLEL: `auto` (the default, 0 here: the backend fits the memory budget) or 1..256."""
    raw = setting("LOCALRT_NUM_PARALLEL").lower()
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


def context_length(default: int = 4096) -> int:
    """LOCALRT_CONTEXT_LENGTH: num_ctx when neither the request nor the Modelfile sets it."""
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
    raw = setting("LOCALRT_GPU_OVERHEAD")
    return parse_size(raw, "LOCALRT_GPU_OVERHEAD") if raw else 0
