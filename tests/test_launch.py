"""`localrt launch`: against a real `localrt serve` with tiny real GGUFs, each agent replaced by a
stand-in executable of the same name (first on PATH) that records the environment and arguments it
was started with. The real agents run in tests/test_agents_e2e.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from localrt.store.importer import import_gguf
from localrt.store.store import Store
from tests import families
from tests.conftest import free_port
from tests.gguf_factory import write_tiny_llama
from tests.servers.serve import LocalrtServer

AGENTS = ("claude", "codex", "opencode")
PACKAGES = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex", "opencode": "opencode-ai"}
STANDIN = """#!{python}
import json, os, sys
with open({record!r}, "w") as f:
    json.dump({{"argv": sys.argv, "env": dict(os.environ)}}, f)
"""


def write_models(root: Path) -> Path:
    """qwen3:tiny renders tools (trained context 65536), chatml:tiny renders none, qwen3:short has a
    trained context too small for any agent."""
    store = Store(root / "models")
    qwen3 = families.FAMILIES["qwen3"]
    big = write_tiny_llama(
        root / "qwen3.gguf", chat_template=qwen3.template, extra_specials=qwen3.specials, context_length=65536
    )
    import_gguf(store, "qwen3:tiny", big)
    import_gguf(store, "chatml:tiny", write_tiny_llama(root / "chatml.gguf", context_length=65536))
    short = write_tiny_llama(
        root / "short.gguf", chat_template=qwen3.template, extra_specials=qwen3.specials, context_length=8192
    )
    import_gguf(store, "qwen3:short", short)
    return root / "models"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    root = tmp_path_factory.mktemp("launch")
    srv = LocalrtServer(write_models(root), root / "serve.log")
    yield srv
    srv.stop()
    assert "Traceback" not in srv.log_path.read_text(errors="replace")


class Launch:
    """Runs `localrt launch` with the stand-ins first on PATH; `record(agent)` is what one saw."""

    def __init__(self, tmp: Path, server: LocalrtServer | None, models: Path) -> None:
        self.bin = tmp / "bin"
        self.bin.mkdir()
        self.records = tmp / "records"
        self.records.mkdir()
        for agent in AGENTS:
            script = self.bin / agent
            record = self.records / f"{agent}.json"
            script.write_text(STANDIN.format(python=sys.executable, record=str(record)))
            script.chmod(0o755)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCALRT_", "ANTHROPIC_"))}
        self.env.update(
            {
                "PATH": os.pathsep.join(
                    [str(self.bin), str(Path(sys.executable).parent), "/usr/bin", "/bin"]
                ),
                "LOCALRT_MODELS": str(models),
                "LOCALRT_DATA": str(tmp / "data"),
                "LOCALRT_HOST": server.url if server else f"127.0.0.1:{free_port()}",
            }
        )

    def __call__(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "localrt", "launch", *args],
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=120,
        )

    def record(self, agent: str) -> dict[str, Any]:
        return json.loads((self.records / f"{agent}.json").read_text())


@pytest.fixture
def launch(tmp_path: Path, server: LocalrtServer) -> Launch:
    return Launch(tmp_path, server, Path(server.env["LOCALRT_MODELS"]))


# ---- what each agent was given, read back from its own settings ---------------------------------
def codex_overrides(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Codex's `-c key=value` pairs (values are TOML; launch writes JSON-compatible ones) and the rest."""
    overrides: dict[str, Any] = {}
    i = 1
    while i + 1 < len(argv) and argv[i] == "-c":
        key, _, value = argv[i + 1].partition("=")
        overrides[key] = json.loads(value)
        i += 2
    return overrides, argv[i:]


def seen(agent: str, record: dict[str, Any]) -> dict[str, Any]:
    """base URL, key, model, passed-through args and the telemetry/update switches the agent got."""
    env, argv = record["env"], record["argv"]
    if agent == "claude":
        return {
            "base_url": env["ANTHROPIC_BASE_URL"],
            "key": env["ANTHROPIC_AUTH_TOKEN"],
            "model": env["ANTHROPIC_MODEL"],
            "args": argv[1:],
            "off": [
                env.get(k) for k in ("DISABLE_TELEMETRY", "DISABLE_AUTOUPDATER", "DISABLE_ERROR_REPORTING")
            ],
        }
    if agent == "codex":
        c, rest = codex_overrides(argv)
        assert c["model_provider"] == "localrt"
        assert c["model_providers.localrt.wire_api"] == "responses"
        return {
            "base_url": c["model_providers.localrt.base_url"].removesuffix("/v1"),
            "key": env[c["model_providers.localrt.env_key"]],
            "model": c["model"],
            "args": rest,
            "off": [c["analytics.enabled"], c["check_for_update_on_startup"], c["features.plugins"]],
        }
    doc = json.loads(Path(env["OPENCODE_CONFIG"]).read_text())
    options = doc["provider"]["localrt"]["options"]
    key_var = options["apiKey"].removeprefix("{env:").removesuffix("}")
    return {
        "base_url": options["baseURL"].removesuffix("/v1"),
        "key": env[key_var],
        "model": doc["model"].removeprefix("localrt/"),
        "args": argv[1:],
        "off": [
            doc["autoupdate"],
            env.get("OPENCODE_DISABLE_AUTOUPDATE"),
            env.get("OPENCODE_DISABLE_MODELS_FETCH"),
        ],
    }


OFF = {"claude": ["1", "1", "1"], "codex": [False, False, False], "opencode": [False, "1", "1"]}


@pytest.mark.parametrize("agent", AGENTS)
def test_agent_gets_server_key_model_and_args(launch: Launch, server: LocalrtServer, agent: str) -> None:
    r = launch(agent, "qwen3:tiny", "--", "-p", "Say hello.", "--flag with space")
    assert r.returncode == 0, r.stderr
    got = seen(agent, launch.record(agent))
    assert got["base_url"] == server.url
    assert got["key"] == "localrt"
    assert got["model"] == "qwen3:tiny-32k"
    assert got["args"] == ["-p", "Say hello.", "--flag with space"]
    assert got["off"] == OFF[agent]


def show(server: LocalrtServer, model: str) -> dict[str, Any]:
    r = httpx.post(server.url + "/api/show", json={"model": model}, timeout=30)
    r.raise_for_status()
    return r.json()


def test_derived_model_holds_the_agents_prompt(launch: Launch, server: LocalrtServer) -> None:
    # the agents send no options: the context must be the model's own, so launch derives one
    assert launch("claude", "qwen3:tiny").returncode == 0
    derived = show(server, "qwen3:tiny-32k")
    assert "num_ctx 32768" in " ".join(derived["parameters"].split())
    assert "tools" in derived["capabilities"]
    assert derived["template"] == show(server, "qwen3:tiny")["template"]


def test_a_sufficient_num_ctx_is_kept(launch: Launch, server: LocalrtServer) -> None:
    body = {"model": "qwen3:roomy", "from": "qwen3:tiny", "parameters": {"num_ctx": 40000}, "stream": False}
    r = httpx.post(server.url + "/api/create", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert launch("codex", "qwen3:roomy").returncode == 0
    overrides, _ = codex_overrides(launch.record("codex")["argv"])
    assert overrides["model"] == "qwen3:roomy"
    assert overrides["model_context_window"] == 40000


def test_picks_a_model_that_fits(launch: Launch, server: LocalrtServer) -> None:
    # chatml:tiny (no tools) and qwen3:short (context 8192), imported last, cannot run claude
    r = launch("claude")
    assert r.returncode == 0, r.stderr
    picked = launch.record("claude")["env"]["ANTHROPIC_MODEL"]
    assert picked not in ("chatml:tiny", "qwen3:short")
    assert "tools" in show(server, picked)["capabilities"]


def test_config_prints_and_starts_nothing(launch: Launch, server: LocalrtServer) -> None:
    httpx.request("DELETE", server.url + "/api/delete", json={"model": "qwen3:tiny-32k"})  # if made earlier
    r = launch("claude", "qwen3:tiny", "--config", "--", "-p", "hi")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert f"export ANTHROPIC_BASE_URL={server.url}" in lines
    assert "export ANTHROPIC_MODEL=qwen3:tiny-32k" in lines
    assert "export DISABLE_TELEMETRY=1" in lines
    assert lines[-1] == "claude -p hi"
    assert not (launch.records / "claude.json").exists()  # the agent was not started
    names = [m["name"] for m in httpx.get(server.url + "/api/tags").json()["models"]]
    assert "qwen3:tiny-32k" not in names  # nothing created


def test_config_names_the_key_variable_never_the_key(launch: Launch, server: LocalrtServer) -> None:
    r = launch("opencode", "qwen3:tiny", "--config", env={"LOCALRT_API_KEY": "s3cret-value"})
    assert r.returncode == 0, r.stderr
    assert "export LOCALRT_AGENT_KEY=$LOCALRT_API_KEY" in r.stdout.splitlines()
    assert "s3cret-value" not in r.stdout


def test_the_servers_key_is_the_agents_key(launch: Launch, server: LocalrtServer) -> None:
    # the fixture's server takes any key; the agent must still be given the one LOCALRT_API_KEY names
    r = launch("codex", "qwen3:tiny", env={"LOCALRT_API_KEY": "s3cret-value"})
    assert r.returncode == 0, r.stderr
    assert seen("codex", launch.record("codex"))["key"] == "s3cret-value"


@pytest.mark.parametrize("agent", AGENTS)
def test_missing_agent_names_its_package(launch: Launch, agent: str) -> None:
    (launch.bin / agent).unlink()
    r = launch(agent, "qwen3:tiny")
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [f"Error: {agent} not found: npm install -g {PACKAGES[agent]}"]


def test_agent_path_is_searched_first(launch: Launch, tmp_path: Path) -> None:
    elsewhere = tmp_path / "npm-prefix" / "bin"
    elsewhere.mkdir(parents=True)
    (launch.bin / "claude").rename(elsewhere / "claude")
    r = launch("claude", "qwen3:tiny", env={"LOCALRT_AGENT_PATH": str(elsewhere)})
    assert r.returncode == 0, r.stderr
    assert launch.record("claude")["argv"][0] == str(elsewhere / "claude")


def test_model_without_tools_is_refused(launch: Launch) -> None:
    r = launch("codex", "chatml:tiny")
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("Error: chatml:tiny cannot run codex:")
    assert "does not support tools" in lines[0]
    assert not (launch.records / "codex.json").exists()


def test_model_with_a_short_context_is_refused(launch: Launch) -> None:
    r = launch("claude", "qwen3:short")
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "qwen3:short cannot run claude: its context is 8192 tokens" in lines[0]


def test_unknown_model_is_one_line(launch: Launch) -> None:
    r = launch("opencode", "nosuch:model")
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [
        "Error: model 'nosuch:model' not found (localrt pull nosuch:model)"
    ]


def test_starts_the_server_when_none_answers(tmp_path: Path, server: LocalrtServer) -> None:
    launch = Launch(tmp_path, None, Path(server.env["LOCALRT_MODELS"]))
    r = launch("claude", "qwen3:tiny")
    pid = int(r.stderr.split("(pid ", 1)[1].split(",", 1)[0]) if "(pid " in r.stderr else None
    try:
        assert r.returncode == 0, r.stderr
        base = launch.record("claude")["env"]["ANTHROPIC_BASE_URL"]
        assert base == f"http://{launch.env['LOCALRT_HOST']}"
        # the server outlives launch (detached) and serves the derived model
        assert httpx.post(base + "/api/show", json={"model": "qwen3:tiny-32k"}, timeout=30).status_code == 200
        assert (tmp_path / "data" / "serve.log").is_file()
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
