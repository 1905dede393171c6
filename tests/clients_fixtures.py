"""The client apps the tests drive that do not install into the test environment: pinned versions and
where .ci/run puts them (under LOCALRT_CLIENTS_PREFIX, by default ~/.cache/localrt-clients).

- `npm/`: the Vercel AI SDK with its providers, `npm install --prefix` (run by the machine's Node);
- `aider/`: aider in a venv of its own, because it pins every one of its dependencies;
- `open-webui/`: Open WebUI in a venv of its own (it pins its own FastAPI and pydantic). Its install is
  heavy (about 7 GiB and 18 minutes on 2 busy cores, CUDA torch included), so its test is `slow` and
  installs it itself on first use (`open_webui()`), under a file lock, instead of .ci/run.

.ci/run writes the npm and aider pins into each folder's `.pins` file and installs again only when they
change.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

NPM_PINS = {
    "ai": "7.0.173",
    "ollama-ai-provider-v2": "4.0.1",
    "@ai-sdk/openai-compatible": "3.0.97",
    "zod": "4.6.7",
}
AIDER_PIN = "aider-chat==0.86.2"
OPEN_WEBUI_PIN = "open-webui==0.12.4"


def prefix() -> Path:
    return Path(os.environ.get("LOCALRT_CLIENTS_PREFIX") or Path.home() / ".cache" / "localrt-clients")


def npm_specs() -> list[str]:
    return [f"{package}@{version}" for package, version in NPM_PINS.items()]


def node_modules() -> Path | None:
    """The AI SDK's node_modules, or None when it is not installed at the pinned versions."""
    folder = prefix() / "npm" / "node_modules"
    return folder if all((folder / p / "package.json").is_file() for p in NPM_PINS) else None


def venv_bin(name: str, program: str) -> Path | None:
    """A program of one of the client venvs (`aider`, `open-webui`), or None when not installed."""
    path = prefix() / name / "bin" / program
    return path if path.is_file() else None


def open_webui() -> Path:
    """Open WebUI's `open-webui` program, installed into its venv first when it is not there."""
    from filelock import FileLock

    folder = prefix() / "open-webui"
    program = folder / "bin" / "open-webui"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if (folder / ".pins").is_file() and (folder / ".pins").read_text() == OPEN_WEBUI_PIN:
            return program
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(folder)], check=True)
        subprocess.run([str(folder / "bin" / "pip"), "install", "-q", OPEN_WEBUI_PIN], check=True)
        (folder / ".pins").write_text(OPEN_WEBUI_PIN)
    return program


# a tool the client tests offer, and the schema that forces the model's output into the shape of its call,
# so the tool-call path is exercised for real
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["get_weather"]},
        "arguments": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    "required": ["name", "arguments"],
}
