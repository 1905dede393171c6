"""`localrt launch claude|codex|opencode [NAME] [--config] [-- AGENT ARGS]`: run a coding agent on a
local model, as `ollama launch` does.

1. The agent's executable is found first (LOCALRT_AGENT_PATH, then PATH): a missing one is one line
   naming its npm package, before anything is started.
2. The server at LOCALRT_HOST is used when it answers; else `localrt serve` is started detached, its
   output in `serve.log` under the data dir, and outlives the agent (as Ollama's app keeps serving).
3. The model (NAME, or the most recently changed installed model that fits) must support tools and
   have a trained context of at least what the agent's first request takes. Its `num_ctx` must hold
   that prompt: when the Modelfile's is smaller, a derived model `NAME-32k` (`FROM NAME` plus
   `PARAMETER num_ctx`) is created, as the agents send no per-request options.
4. The agent is pointed at the server through its own settings: environment variables for Claude
   Code, `-c` overrides for Codex (its CODEX_HOME, logins and history stay the user's own), a config
   file named by OPENCODE_CONFIG for opencode. Telemetry and self-update are off, and the settings
   that make each agent fetch from other hosts (Codex's plugin marketplace sync) are turned off.
5. The agent replaces this process (exec), so its exit status is the command's.

`--config` prints those settings (a shell could `export` them) and exits without starting, creating
or writing anything. The key the agents send is LOCALRT_API_KEY when set (shown as a reference, never
its value), else the placeholder `localrt`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

from localrt import config
from localrt.cli.common import Subparsers
from localrt.cli.common import with_client
from localrt.client import Client
from localrt.client import CreateSpec
from localrt.client import ModelDetails
from localrt.errors import LocalrtError
from localrt.errors import ModelNotFound

PLACEHOLDER_KEY = "localrt"  # the server ignores the key unless LOCALRT_API_KEY is set
AGENT_KEY_VAR = "LOCALRT_AGENT_KEY"  # where Codex and opencode read the key (their config names it)
CONTEXT = 32768  # num_ctx given to a model whose Modelfile sets less: room for a few tool turns
SERVE_WAIT = 60.0  # seconds for a started `localrt serve` to answer


@dataclass(frozen=True)
class Agent:
    command: str
    package: str  # the npm package that installs `command`
    # tokens its first request takes, tools and system prompt included, with room for the answer
    # (Claude Code 2.1: about 19,000 with a Qwen3 tokenizer; Codex 0.171 and opencode 1.18: under 12,000)
    min_context: int


AGENTS = {
    "claude": Agent("claude", "@anthropic-ai/claude-code", 24576),
    "codex": Agent("codex", "@openai/codex", 16384),
    "opencode": Agent("opencode", "opencode-ai", 16384),
}


class LaunchError(LocalrtError):
    pass


@dataclass
class Setup:
    """Everything launch sets for the agent: shown by `--config`, applied before exec."""

    agent: Agent
    model: str
    num_ctx: int
    base_url: str
    derive_from: str | None = None  # the model `model` is created from (num_ctx raised), if it must be
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)  # put before the user's AGENT ARGS
    files: dict[Path, str] = field(default_factory=dict)  # written before exec


def add_launch(sub: Subparsers) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "launch",
        help="run Claude Code, Codex or opencode on a local model (start the server, set the agent up)",
    )
    p.add_argument("agent", choices=sorted(AGENTS), help="the coding agent to run")
    p.add_argument("model", nargs="?", default=None, help="a model with tool support (default: pick one)")
    p.add_argument("--config", action="store_true", help="print what would be set, then exit")
    p.set_defaults(func=cmd_launch, agent_args=[])
    return p


def split_agent_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """`launch ... -- AGENT ARGS`: the part for us and the part passed to the agent untouched."""
    if argv[:1] == ["launch"] and "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def cmd_launch(args: argparse.Namespace) -> int:
    agent = AGENTS[args.agent]
    executable = find_agent(agent.command)
    if executable is None and not args.config:
        raise LaunchError(f"{agent.command} not found: npm install -g {agent.package}")
    if not args.config:
        ensure_server()
    setup = with_client(lambda client: plan(client, agent, args.model, create=not args.config))
    configure(setup)
    if args.config:
        print_setup(setup, executable, list(args.agent_args))
        return 0
    assert executable is not None
    for path, text in setup.files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    env = {**config.environment(), **setup.env}
    sys.stdout.flush()
    os.execvpe(executable, [executable, *setup.args, *args.agent_args], env)
    return 0  # not reached: exec replaced this process


# ---- the agent's executable ----------------------------------------------------------------------
def find_agent(command: str) -> str | None:
    """LOCALRT_AGENT_PATH's folders first (an npm --prefix install), then PATH."""
    for folder in config.agent_path():
        found = shutil.which(command, path=str(folder))
        if found:
            return found
    return shutil.which(command)


# ---- the server ----------------------------------------------------------------------------------
def ensure_server() -> None:
    """Use the server at LOCALRT_HOST, or start `localrt serve` detached and wait until it answers."""
    from localrt.client import server_answers

    if server_answers():
        return
    log_path = config.data_dir() / "serve.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "localrt", "serve"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # not killed with the agent's terminal; Ctrl-C in the agent stays there
        )
    deadline = time.monotonic() + SERVE_WAIT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LaunchError(f"localrt serve exited with status {proc.returncode} (see {log_path})")
        if server_answers():
            where = config.server_address()[1]
            print(f"localrt serve started on {where} (pid {proc.pid}, log: {log_path})", file=sys.stderr)
            return
        time.sleep(0.2)
    raise LaunchError(f"localrt serve did not answer within {SERVE_WAIT:.0f}s (see {log_path})")


# ---- the model -----------------------------------------------------------------------------------
async def plan(client: Client, agent: Agent, name: str | None, *, create: bool) -> Setup:
    """The model the agent gets and its num_ctx; the derived model is created when `create`."""
    if name is None:
        name, details = await pick(client, agent)
    else:
        details = await details_or_none(client, name)
        if details is None:
            raise LaunchError(f"model {name!r} not found (localrt pull {name})")
        if reason := unfit(details, agent):
            raise LaunchError(f"{name} cannot run {agent.command}: {reason}")
    base_url = config.server_address()[0]
    if details.remote_model:  # the upstream decides its context; nothing to set here
        return Setup(agent, name, details.context_length or CONTEXT, base_url)
    current = num_ctx_of(details)
    if current >= agent.min_context:
        return Setup(agent, name, current, base_url)
    target = max(CONTEXT, agent.min_context)
    if details.context_length:
        target = min(target, details.context_length)
    derived = derived_name(name, target)
    if create:
        modelfile = f"FROM {name}\nPARAMETER num_ctx {target}\n"
        await client.create(CreateSpec(model=derived, modelfile_text=modelfile))
        print(f"created {derived} from {name} with num_ctx {target}", file=sys.stderr)
    return Setup(agent, derived, target, base_url, derive_from=name)


async def details_or_none(client: Client, name: str) -> ModelDetails | None:
    try:
        return await client.details(name)
    except ModelNotFound:
        return None


async def pick(client: Client, agent: Agent) -> tuple[str, ModelDetails]:
    """The most recently changed installed model that can run the agent."""
    rows = sorted(await client.list_models(), key=lambda row: row.modified, reverse=True)
    for row in rows:
        details = await details_or_none(client, row.name)
        if details is not None and unfit(details, agent) is None:
            return row.name, details
    raise LaunchError(
        f"no installed model can run {agent.command} (it needs tool support and a context of "
        f"{agent.min_context} tokens): pull one, e.g. localrt pull qwen3, and name it"
    )


def unfit(details: ModelDetails, agent: Agent) -> str | None:
    """Why a model cannot run the agent, or None when it can."""
    if "tools" not in details.capabilities:
        return "it does not support tools (its chat template renders no tools)"
    trained = details.context_length
    if trained and trained < agent.min_context:
        return f"its context is {trained} tokens, and {agent.command}'s prompt needs {agent.min_context}"
    return None


def num_ctx_of(details: ModelDetails) -> int:
    """The Modelfile's num_ctx, 0 when it sets none (the server's default then applies: too small)."""
    for key, value in details.parameter_lines:
        if key == "num_ctx":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def derived_name(name: str, num_ctx: int) -> str:
    """`qwen3:4b` -> `qwen3:4b-32k`; `qwen3` (tag latest) -> `qwen3:32k`."""
    from localrt.store.names import parse_name

    parsed = parse_name(name)
    size = f"{num_ctx // 1024}k" if num_ctx % 1024 == 0 else str(num_ctx)
    tag = size if parsed.tag == "latest" else f"{parsed.tag}-{size}"
    return parsed.with_tag(tag).display


# ---- the agent's settings ------------------------------------------------------------------------
def agent_key() -> str:
    return config.api_key() or PLACEHOLDER_KEY


def configure(setup: Setup) -> None:
    """Fill in the agent's environment, arguments and files."""
    {"claude": configure_claude, "codex": configure_codex, "opencode": configure_opencode}[
        setup.agent.command
    ](setup)


def configure_claude(setup: Setup) -> None:
    # ANTHROPIC_AUTH_TOKEN goes out as `Authorization: Bearer`; an ANTHROPIC_API_KEY from the user's
    # shell is blanked so their Anthropic key never reaches this server (and Claude Code does not ask
    # whether to use it)
    model = setup.model
    setup.env.update(
        {
            "ANTHROPIC_BASE_URL": setup.base_url,
            "ANTHROPIC_AUTH_TOKEN": agent_key(),
            "ANTHROPIC_API_KEY": "",
            "ANTHROPIC_MODEL": model,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
            "ANTHROPIC_SMALL_FAST_MODEL": model,
            "CLAUDE_CODE_SUBAGENT_MODEL": model,
            # its default asks for 32,000 tokens of answer; leave most of num_ctx to the prompt (its
            # compaction window has a 100k floor, so it cannot be told num_ctx)
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(min(32000, setup.num_ctx // 4)),
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        }
    )


def configure_codex(setup: Setup) -> None:
    provider = "model_providers.localrt"
    overrides = {
        "model_provider": "localrt",
        f"{provider}.name": "localrt",
        f"{provider}.base_url": f"{setup.base_url}/v1",
        f"{provider}.wire_api": "responses",
        f"{provider}.env_key": AGENT_KEY_VAR,
        "model": setup.model,
        "model_context_window": setup.num_ctx,
        "check_for_update_on_startup": False,
        "analytics.enabled": False,
        # the plugin marketplace and apps features fetch from github.com and chatgpt.com on start
        "features.plugins": False,
        "features.remote_plugin": False,
        "features.plugin_sharing": False,
        "features.apps": False,
    }
    for key, value in overrides.items():
        setup.args += ["-c", f"{key}={json.dumps(value)}"]  # a JSON string or bool is TOML as well
    setup.env[AGENT_KEY_VAR] = agent_key()


def configure_opencode(setup: Setup) -> None:
    path = config.data_dir() / "launch" / "opencode.json"
    model = setup.model
    document = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "localrt": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "localrt",
                # the key is read from the environment at start, never written to the file
                "options": {"baseURL": f"{setup.base_url}/v1", "apiKey": f"{{env:{AGENT_KEY_VAR}}}"},
                "models": {
                    model: {
                        "name": model,
                        "tool_call": True,
                        "limit": {"context": setup.num_ctx, "output": min(32000, setup.num_ctx // 4)},
                    }
                },
            }
        },
        "model": f"localrt/{model}",
        "small_model": f"localrt/{model}",
        "autoupdate": False,
        "share": "disabled",
    }
    setup.files[path] = json.dumps(document, indent=2) + "\n"
    setup.env.update(
        {
            "OPENCODE_CONFIG": str(path),
            AGENT_KEY_VAR: agent_key(),
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_SHARE": "1",
        }
    )


# ---- --config ------------------------------------------------------------------------------------
def print_setup(setup: Setup, executable: str | None, agent_args: list[str]) -> None:
    """The settings as shell lines: comments, `export` lines, the files' contents, the command."""
    origin = f", created from {setup.derive_from}" if setup.derive_from else ""
    print(f"# localrt launch {setup.agent.command}: model {setup.model} (num_ctx {setup.num_ctx}{origin})")
    print(f"# server {setup.base_url}")
    if executable is None:
        print(f"# {setup.agent.command} not found: npm install -g {setup.agent.package}")
    secret = config.api_key()
    for key, value in setup.env.items():
        # a real key is a secret: name its variable, never print it
        shown = "$LOCALRT_API_KEY" if secret and value == secret else shlex.quote(value)
        print(f"export {key}={shown}")
    for path, text in setup.files.items():
        print(f"# {path}:")
        for line in text.splitlines():
            print(f"#   {line}")
    print(shlex.join([setup.agent.command, *setup.args, *agent_args]))
