"""The `localrt run` session: one-shot answers and the interactive chat (`/set`, `/show`, `\"\"\"`).

A session holds one client (a running `localrt serve`, else the same server app in process) and one event
loop for its whole life, so an interactive chat loads the model once either way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import Awaitable
from collections.abc import Callable
from typing import Any
from typing import TextIO
from typing import TypeVar

from localrt import config
from localrt.client import Client
from localrt.client import ModelDetails
from localrt.client import connect
from localrt.errors import LocalrtError
from localrt.format import go_duration
from localrt.runtime.answers import Chunk
from localrt.runtime.answers import Metrics
from localrt.runtime.options import Options
from localrt.runtime.options import parse_option_value

T = TypeVar("T")

HELP = """Available Commands:
  /set parameter K V   Set a parameter (e.g. /set parameter temperature 0.2)
  /set system TEXT     Set the system message
  /set verbose|quiet   Show or hide timings after each answer
  /set format json     Answer in JSON (/set noformat to stop)
  /set think [LEVEL]   Think before answering (low, medium, high); /set nothink to stop
  /set maxsteps N      With --tools: requests to the model per answer (calls run between them)
  /show info           Show details for this model
  /show parameters     Show the parameters in effect
  /show system         Show the system message
  /show template       Show the chat template
  /clear               Clear the session context
  /bye                 Exit
  /?, /help            Help for a command

Use \"\"\" to begin a multi-line message.
"""


def timing_lines(m: Metrics) -> list[str]:
    """Ollama's `--verbose` block; the speculative lines only when drafts were made."""
    lines = []
    if m.total_ns > 0:
        lines.append(f"total duration:       {go_duration(m.total_ns)}")
    if m.load_ns > 0:
        lines.append(f"load duration:        {go_duration(m.load_ns)}")
    if m.prompt_eval_count > 0:
        lines.append(f"prompt eval count:    {m.prompt_eval_count} token(s)")
    if m.prompt_eval_ns > 0:
        lines.append(f"prompt eval duration: {go_duration(m.prompt_eval_ns)}")
        lines.append(f"prompt eval rate:     {m.prompt_eval_count / m.prompt_eval_ns * 1e9:.2f} tokens/s")
    if m.draft_count > 0:
        rate = m.draft_accepted_count / m.draft_count * 100
        lines.append(f"draft count:          {m.draft_count} token(s)")
        lines.append(f"draft accepted:       {m.draft_accepted_count} token(s) ({rate:.1f}%)")
    if m.eval_count > 0:
        lines.append(f"eval count:           {m.eval_count} token(s)")
    if m.eval_ns > 0:
        lines.append(f"eval duration:        {go_duration(m.eval_ns)}")
        lines.append(f"eval rate:            {m.eval_count / m.eval_ns * 1e9:.2f} tokens/s")
    return lines


# ---- the session -----------------------------------------------------------------------------
class Session:
    """One `localrt run`: the model name, request options and the conversation so far."""

    def __init__(
        self, args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None
    ) -> None:
        self.model = args.model
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.verbose = bool(getattr(args, "verbose", False))
        fmt = getattr(args, "format", None)
        if fmt not in (None, "", "json"):
            raise LocalrtError(f"invalid format {fmt!r}: only 'json' is supported")
        self.format: str | None = fmt or None
        self.keep_alive = getattr(args, "keepalive", None)
        if self.keep_alive is not None:
            config.parse_duration(self.keep_alive)  # a bad value is an error before any work
        self.options: dict[str, Any] = {}
        if getattr(args, "backend", None):
            self.options["backend"] = args.backend
        if getattr(args, "draft", None):
            self.options["draft_model"] = args.draft
        if getattr(args, "spec", None):
            self.options["speculative"] = args.spec
        Options.merge(self.options)  # fail early on a bad --backend / --spec
        self.think = think_setting(args)
        self.hide_thinking = bool(getattr(args, "hidethinking", False))
        self.system: str | None = None
        self.messages: list[dict[str, Any]] = []
        self.loop = asyncio.new_event_loop()
        self.client: Client = connect()
        self.agent: Any = None  # the tools of `run --tools` (localrt.cli.agent.ToolSession)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.loop.run_until_complete(self.client.close())
        self.loop.close()

    def run(self, coro_fn: Callable[[], Awaitable[T]]) -> tuple[T | None, bool]:
        """Run a coroutine; Ctrl-C cancels it (not the program). Returns (result, interrupted)."""

        async def main() -> T:
            return await coro_fn()

        task = self.loop.create_task(main())
        installed = False
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            self.loop.add_signal_handler(signal.SIGINT, task.cancel)
            installed = True
        try:
            return self.loop.run_until_complete(task), False
        except asyncio.CancelledError:
            return None, True
        except KeyboardInterrupt:  # no signal handler (e.g. not the main thread)
            task.cancel()
            with contextlib.suppress(BaseException):
                self.loop.run_until_complete(task)
            return None, True
        finally:
            if installed:
                self.loop.remove_signal_handler(signal.SIGINT)

    # -- model presence --
    def ensure_model(self, insecure: bool = False) -> None:
        """Pull the model first when the store (the server's, or ours) does not have it."""
        from localrt.cli.progress import PullProgress

        async def go() -> None:
            if await self.client.has_model(self.model):
                return
            # stdout is the answer's: progress (bars or plain lines) goes to stderr
            with contextlib.redirect_stdout(self.err), PullProgress() as bar:
                async for event in self.client.pull(self.model, insecure=insecure):
                    bar.update(event)

        _, interrupted = self.run(go)
        if interrupted:
            raise KeyboardInterrupt

    def load(self) -> None:
        async def go() -> None:
            async for _ in self.client.chat(self.model, [], options=self.options, keep_alive=self.keep_alive):
                pass

        _, interrupted = self.run(go)
        if interrupted:
            raise KeyboardInterrupt

    # -- one answer --
    def ask(self, text: str, images: list[str] | None = None) -> bool:
        """Send one user message (with base64 images) and stream the answer, its thinking first (dimmed).
        False when interrupted."""
        if self.agent is not None:
            return bool(self.agent.ask(text, images))
        self.messages.append({"role": "user", "content": text, **({"images": images} if images else {})})
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + self.messages
        parts: list[str] = []
        thoughts: list[str] = []
        final: list[Chunk] = []
        shown = ThinkingPrinter(self.out, hidden=self.hide_thinking)

        async def go() -> None:
            async for chunk in self.client.chat(
                self.model,
                msgs,
                options=self.options,
                format=self.format,
                keep_alive=self.keep_alive,
                think=self.think,
            ):
                if chunk.thinking:
                    thoughts.append(chunk.thinking)
                    shown.thinking(chunk.thinking)
                if chunk.content:
                    shown.done()
                    parts.append(chunk.content)
                    self.out.write(chunk.content)
                    self.out.flush()
                if chunk.done:
                    final.append(chunk)

        _, interrupted = self.run(go)
        shown.done()
        answer = "".join(parts)
        if answer and not answer.endswith("\n"):
            self.out.write("\n")
        self.out.flush()
        if answer:
            self.messages.append({"role": "assistant", "content": answer, "thinking": "".join(thoughts)})
        else:
            self.messages.pop()  # nothing came back: forget the question too
        if final and final[0].tool_calls:
            self.out.write(json.dumps(final[0].tool_calls, ensure_ascii=False) + "\n")
        if self.verbose and final and final[0].metrics is not None:
            self.err.write("\n".join(timing_lines(final[0].metrics)) + "\n")
            self.err.flush()
        return not interrupted

    # -- /commands --
    def command(self, line: str) -> bool:
        """Handle a /command. False means: leave the chat."""
        words = line.split()
        cmd = words[0].lower()
        if cmd in ("/bye", "/exit", "/quit"):
            return False
        if cmd in ("/?", "/help"):
            self.out.write(HELP)
        elif cmd == "/clear":
            self.messages.clear()
            self.out.write("Cleared session context\n")
        elif cmd == "/set":
            self._set(line, words)
        elif cmd == "/show":
            self._show(words)
        else:
            self.out.write(f"Unknown command '{words[0]}'. Type /? for help\n")
        return True

    def _set(self, line: str, words: list[str]) -> None:
        what = words[1].lower() if len(words) > 1 else ""
        if what == "parameter" and len(words) >= 4:
            name, raw = words[2], line.split(None, 3)[3]
            try:
                value = parse_option_value(name, raw)
                trial = dict(self.options)
                if name == "stop":  # repeated /set parameter stop X adds stop words
                    trial["stop"] = [*trial.get("stop", []), *value]
                else:
                    trial[name] = value
                Options.merge(trial)
            except LocalrtError as e:
                self.err.write(f"Error: {e}\n")
                return
            self.options = trial
            self.out.write(f"Set parameter '{name}' to '{raw}'\n")
        elif what == "system" and len(words) >= 3:
            text = line.split(None, 2)[2].strip()
            if len(text) >= 6 and text.startswith('"""') and text.endswith('"""'):
                text = text[3:-3].strip()
            self.system = text
            self.out.write("Set system message.\n")
        elif what == "verbose":
            self.verbose = True
            self.out.write("Set 'verbose' mode.\n")
        elif what == "quiet":
            self.verbose = False
            self.out.write("Set 'quiet' mode.\n")
        elif what == "format" and len(words) >= 3 and words[2] == "json":
            self.format = "json"
            self.out.write("Set format to 'json' mode.\n")
        elif what == "noformat":
            self.format = None
            self.out.write("Disabled format.\n")
        elif what in ("think", "nothink"):
            self._set_think(what, words[2].lower() if len(words) > 2 else "")
        elif what == "maxsteps":
            self._set_max_steps(words[2] if len(words) > 2 else "")
        else:
            self.out.write(
                "Usage: /set parameter K V | /set system TEXT | /set verbose | /set quiet | "
                "/set format json | /set noformat | /set think [LEVEL] | /set nothink | /set maxsteps N\n"
            )

    def _set_max_steps(self, raw: str) -> None:
        if self.agent is None:
            self.err.write("Error: maxsteps applies to the tool loop: start with --tools\n")
        elif not raw.isdigit() or int(raw) < 1:
            self.err.write(f"Error: maxsteps must be a whole number of at least 1, got {raw!r}\n")
        else:
            self.agent.max_steps = int(raw)
            self.out.write(f"Set 'maxsteps' to {raw}.\n")

    def _set_think(self, what: str, level: str) -> None:
        if what == "nothink":
            self.think = False
            self.out.write("Set 'nothink' mode.\n")
        elif level in ("", "low", "medium", "high"):
            self.think = level or True
            self.out.write(f"Set 'think' mode{f' ({level})' if level else ''}.\n")
        else:
            self.err.write(f"Error: invalid think level {level!r} (use low, medium or high)\n")

    def _show(self, words: list[str]) -> None:
        what = words[1].lower() if len(words) > 1 else ""
        if what not in ("info", "parameters", "system", "template"):
            self.out.write("Usage: /show info | /show parameters | /show system | /show template\n")
            return
        details, _ = self.run(lambda: self.client.details(self.model))
        if details is None:  # interrupted
            return
        if what == "info":
            self.out.write(self.info_text(details))
        elif what == "parameters":
            lines = self.parameter_lines(details)
            if not lines:
                self.out.write("No parameters were specified for this model.\n")
            self.out.write("".join(f"{key:<24}{value}\n" for key, value in lines))
        elif what == "system":
            text = self.system or details.system or "No system message was specified for this model."
            self.out.write(text + "\n")
        else:
            self.out.write((details.template or "No template.") + "\n")

    def parameter_lines(self, details: ModelDetails) -> list[tuple[str, str]]:
        """The model's parameters with this session's `/set parameter` values in their place."""
        from localrt.show import parameter_lines

        ours = parameter_lines(self.options)
        return [line for line in details.parameter_lines if line[0] not in self.options] + ours

    def info_text(self, details: ModelDetails) -> str:
        rows = [
            ("architecture", details.architecture),
            ("parameters", details.parameters),
            ("context length", str(details.context_length or "unknown")),
            ("embedding length", str(details.embedding_length or "unknown")),
            ("quantization", details.quantization),
        ]
        loaded, _ = self.run(self.client.ps)
        here = [row for row in loaded or [] if row.name == self._display_name()]
        if here:
            rows += [
                ("backend", here[0].backend),
                ("loaded context", str(here[0].context_length)),
                ("processor", here[0].processor),
            ]
        text = "  Model\n" + "".join(f"    {k:<20}{v}\n" for k, v in rows)
        params = self.parameter_lines(details)
        if params:
            text += "\n  Parameters\n" + "".join(f"    {k:<20}{v}\n" for k, v in params)
        return text + "\n"

    def _display_name(self) -> str:
        from localrt.store.names import parse_name

        return parse_name(self.model).display


def think_setting(args: argparse.Namespace) -> bool | str | None:
    """`--think [LEVEL]` / `--nothink` as the runtime's `think` (None: the model's default)."""
    if getattr(args, "nothink", False):
        return False
    value = getattr(args, "think", None)
    if value is None or value == "true":
        return None if value is None else True
    return False if value == "false" else value


class ThinkingPrinter:
    """Ollama's way: "Thinking..." and the thinking, dimmed on a terminal, then "...done thinking."."""

    def __init__(self, out: TextIO, hidden: bool) -> None:
        self.out, self.hidden = out, hidden
        self.dim = out.isatty() if hasattr(out, "isatty") else False
        self.state = "before"  # before | thinking | done

    def thinking(self, text: str) -> None:
        if self.hidden or self.state == "done":
            return
        if self.state == "before":
            self.out.write(("\x1b[2m" if self.dim else "") + "Thinking...\n")
            self.state = "thinking"
        self.out.write(text)
        self.out.flush()

    def done(self) -> None:
        if self.state == "thinking":
            self.out.write("\n...done thinking.\n\n" + ("\x1b[0m" if self.dim else ""))
            self.out.flush()
        self.state = "done"


def _read_message(first: str) -> str:
    """`\"\"\"` starts a multi-line message that ends at a line ending in `\"\"\"`."""
    body = first[3:]
    if body.endswith('"""') and len(body) >= 3:
        return body[:-3]
    lines = [body]
    while True:
        line = input("... ")
        if line.endswith('"""'):
            lines.append(line[:-3])
            return "\n".join(lines).strip("\n")
        lines.append(line)


def _dropped_images(session: Session, line: str) -> tuple[str, list[str]]:
    """Image files named (or dragged) into the prompt are attached, as Ollama's CLI does."""
    from localrt.runtime.images import images_in_prompt
    from localrt.runtime.images import read_image_file

    text, paths = images_in_prompt(line)
    images = []
    for path in paths:
        images.append(read_image_file(path))
        session.err.write(f"Added image '{path}'\n")
    return text, images


def interactive(session: Session) -> int:
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    while True:
        try:
            line = input(">>> ")
            if line.startswith('"""'):
                line = _read_message(line)
        except EOFError:
            session.out.write("\n")
            return 0
        except KeyboardInterrupt:
            session.out.write("\nUse Ctrl + d or /bye to exit.\n")
            continue
        if not line.strip():
            continue
        if line.startswith("/"):
            try:
                if not session.command(line):
                    return 0
            except LocalrtError as e:
                session.err.write(f"Error: {e}\n")
            continue
        try:
            line, images = _dropped_images(session, line)
            session.ask(line, images)
        except LocalrtError as e:  # the chat goes on after a bad request
            session.err.write(f"Error: {e}\n")
        except KeyboardInterrupt:  # Ctrl-C just before the answer started
            if session.messages and session.messages[-1]["role"] == "user":
                session.messages.pop()
        session.out.write("\n")
