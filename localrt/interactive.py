"""`localrt run` (one-shot and the interactive chat), `localrt ps` and `localrt stop`.

`run` drives an in-process Runtime on one event loop for the whole session; `ps` and `stop` talk to a
running `localrt serve` at LOCALRT_HOST.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TextIO, TypeVar

from localrt import config
from localrt.errors import LocalrtError, ModelNotFound
from localrt.runtime.manager import Chunk, Metrics, Runtime
from localrt.runtime.options import Options, parse_option_value

T = TypeVar("T")

HELP = """Available Commands:
  /set parameter K V   Set a parameter (e.g. /set parameter temperature 0.2)
  /set system TEXT     Set the system message
  /set verbose|quiet   Show or hide timings after each answer
  /set format json     Answer in JSON (/set noformat to stop)
  /show info           Show details for this model
  /show parameters     Show the parameters in effect
  /show system         Show the system message
  /show template       Show the chat template
  /clear               Clear the session context
  /bye                 Exit
  /?, /help            Help for a command

Use \"\"\" to begin a multi-line message.
"""


# ---- formatting ------------------------------------------------------------------------------
def go_duration(ns: int) -> str:
    """Go's time.Duration.String(), which Ollama's timing lines use (1.234s, 56.7ms, 890µs)."""
    if ns < 1000:
        return f"{ns}ns"
    if ns < 1_000_000:
        return _trim(f"{ns / 1e3:.3f}") + "µs"
    if ns < 1_000_000_000:
        return _trim(f"{ns / 1e6:.6f}") + "ms"
    seconds = ns / 1e9
    if seconds < 60:
        return _trim(f"{seconds:.9f}") + "s"
    minutes, rest = divmod(seconds, 60)
    if minutes < 60:
        return f"{int(minutes)}m" + _trim(f"{rest:.9f}") + "s"
    hours, minutes = divmod(int(minutes), 60)
    return f"{hours}h{minutes}m" + _trim(f"{rest:.9f}") + "s"


def _trim(number: str) -> str:
    return number.rstrip("0").rstrip(".") if "." in number else number


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
        self.system: str | None = None
        self.messages: list[dict[str, Any]] = []
        self.runtime = Runtime()
        self.loop = asyncio.new_event_loop()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.loop.run_until_complete(self.runtime.close())
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
        from localrt.store.store import Store

        store = self.runtime.store
        try:
            store.resolve(self.model)
            return
        except ModelNotFound:
            pass
        from localrt.progress import PullProgress
        from localrt.store.pull import pull

        # stdout is the answer's: progress (bars or plain lines) goes to stderr
        with contextlib.redirect_stdout(self.err), PullProgress() as bar:
            pull(
                self.model,
                store=store if isinstance(store, Store) else None,
                insecure=insecure,
                progress=bar.update,
            )

    def load(self) -> None:
        async def go() -> None:
            async for _ in self.runtime.chat(
                self.model, [], options=self.options, keep_alive=self.keep_alive
            ):
                pass

        _, interrupted = self.run(go)
        if interrupted:
            raise KeyboardInterrupt

    # -- one answer --
    def ask(self, text: str) -> bool:
        """Send one user message and stream the answer. False when interrupted."""
        self.messages.append({"role": "user", "content": text})
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + self.messages
        parts: list[str] = []
        final: list[Chunk] = []

        async def go() -> None:
            async for chunk in self.runtime.chat(
                self.model, msgs, options=self.options, format=self.format, keep_alive=self.keep_alive
            ):
                if chunk.content:
                    parts.append(chunk.content)
                    self.out.write(chunk.content)
                    self.out.flush()
                if chunk.done:
                    final.append(chunk)

        _, interrupted = self.run(go)
        answer = "".join(parts)
        if answer and not answer.endswith("\n"):
            self.out.write("\n")
        self.out.flush()
        if answer:
            self.messages.append({"role": "assistant", "content": answer})
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
        else:
            self.out.write(
                "Usage: /set parameter K V | /set system TEXT | /set verbose | /set quiet | "
                "/set format json | /set noformat\n"
            )

    def _show(self, words: list[str]) -> None:
        what = words[1].lower() if len(words) > 1 else ""
        resolved = self.runtime.store.resolve(self.model)
        if what == "info":
            self.out.write(self.info_text(resolved))
        elif what == "parameters":
            params = {**resolved.params, **self.options}
            if not params:
                self.out.write("No parameters were specified for this model.\n")
            for key, value in params.items():
                for v in value if isinstance(value, list) else [value]:
                    self.out.write(f"{key:<24}{json.dumps(v) if isinstance(v, str) else v}\n")
        elif what == "system":
            self.out.write(
                (self.system or resolved.system or "No system message was specified for this model.") + "\n"
            )
        elif what == "template":
            self.out.write((resolved.template or self._gguf_template(resolved) or "No template.") + "\n")
        else:
            self.out.write("Usage: /show info | /show parameters | /show system | /show template\n")

    @staticmethod
    def _gguf_template(resolved: Any) -> str | None:
        try:
            from localrt.store.gguf import read_gguf

            return read_gguf(resolved.model_path).chat_template
        except Exception:
            return None

    def info_text(self, resolved: Any) -> str:
        rows: list[tuple[str, str]] = []
        try:
            from localrt.store.gguf import format_parameter_count, read_gguf

            info = read_gguf(resolved.model_path)
            rows += [
                ("architecture", info.architecture or "unknown"),
                ("parameters", format_parameter_count(info.parameter_count)),
                ("context length", str(info.context_length or "unknown")),
                ("embedding length", str(info.embedding_length or "unknown")),
                ("quantization", info.quantization_label),
            ]
        except Exception as e:  # the reader is optional here; show what we have
            rows.append(("model", f"{resolved.model_path.name} ({e})"))
        loaded = [p for p in self.runtime.ps() if p.name == resolved.name.display]
        if loaded:
            rows += [
                ("backend", loaded[0].backend),
                ("loaded context", str(loaded[0].context_length)),
                ("processor", loaded[0].processor),
            ]
        text = "  Model\n" + "".join(f"    {k:<20}{v}\n" for k, v in rows)
        params = {**resolved.params, **self.options}
        if params:
            text += "\n  Parameters\n" + "".join(f"    {k:<20}{v}\n" for k, v in params.items())
        return text + "\n"


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
            session.ask(line)
        except LocalrtError as e:  # the chat goes on after a bad request
            session.err.write(f"Error: {e}\n")
        except KeyboardInterrupt:  # Ctrl-C just before the answer started
            if session.messages and session.messages[-1]["role"] == "user":
                session.messages.pop()
        session.out.write("\n")


def run_command(args: argparse.Namespace) -> int:
    prompt_arg = getattr(args, "prompt", None)
    prompt = " ".join(prompt_arg) if isinstance(prompt_arg, list) else (prompt_arg or "")
    stdin_text: str | None = None
    if not sys.stdin.isatty():
        stdin_text = sys.stdin.read()
    session = Session(args)
    try:
        session.ensure_model(insecure=bool(getattr(args, "insecure", False)))
        if not prompt and stdin_text is None:
            session.load()
            return interactive(session)
        # as Ollama: piped text first, then the prompt words
        text = " ".join(p for p in (stdin_text.strip() if stdin_text else "", prompt) if p)
        if not text:
            session.load()
            return 0
        completed = session.ask(text)
        return 0 if completed else 130
    except KeyboardInterrupt:
        session.err.write("\n")
        return 130
    finally:
        session.close()


# ---- ps / stop: clients of a running server ----------------------------------------------------
PS_HEADER = ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]


def _until(expires_at: str | None) -> str:
    if not expires_at:
        return "Forever"
    try:
        from datetime import datetime

        when = datetime.fromisoformat(expires_at.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return expires_at
    left = when - time.time()
    if left > 10 * 365 * 86400:
        return "Forever"
    if left <= 1:
        return "Stopping..."
    for unit, span in (("hour", 3600), ("minute", 60), ("second", 1)):
        if left >= span:
            n = int(left // span)
            return f"{n} {unit}{'s' if n != 1 else ''} from now"
    return "Stopping..."


def _weights_note(details: dict) -> str:
    """`localrt ps`'s SIZE: the weights' share where the backend reports it (torch: quantized weights)."""
    from localrt.cli import human_size

    weights = details.get("weight_bytes")
    return f" (weights {human_size(int(weights))})" if isinstance(weights, int) else ""


def ps_command(args: argparse.Namespace) -> int:
    import httpx

    from localrt.cli import human_size, print_table

    url, _ = config.server_address()
    rows = [PS_HEADER]
    try:
        response = httpx.get(f"{url}/api/ps", headers=config.auth_headers(), timeout=10)
    except httpx.HTTPError:
        print_table(rows)  # nothing is running, so nothing is loaded
        return 0
    if response.status_code != 200:
        raise LocalrtError(_error_text(response))
    for m in response.json().get("models", []):
        size, vram = int(m.get("size", 0)), int(m.get("size_vram", 0))
        processor = m.get("processor") or (
            "100% GPU"
            if vram >= size > 0
            else "100% CPU"
            if vram == 0
            else f"{100 - vram * 100 // size}%/{vram * 100 // size}% CPU/GPU"
        )
        backend = m.get("backend")
        if backend:
            processor = f"{processor} ({backend})"
        rows.append(
            [
                m.get("name", ""),
                str(m.get("digest", "")).removeprefix("sha256:")[:12],
                human_size(size) + _weights_note(m.get("details") or {}),
                processor,
                str(m.get("context_length", "")),
                _until(m.get("expires_at")),
            ]
        )
    print_table(rows)
    return 0


def stop_command(args: argparse.Namespace) -> int:
    import httpx

    url, shown = config.server_address()
    try:
        response = httpx.post(
            f"{url}/api/generate",
            json={"model": args.model, "keep_alive": 0},
            headers=config.auth_headers(),
            timeout=60,
        )
    except httpx.HTTPError:
        raise LocalrtError(f"no server running at {shown}") from None
    if response.status_code != 200:
        raise LocalrtError(_error_text(response))
    return 0


def _error_text(response: Any) -> str:
    try:
        body = response.json()
        error = body.get("error")
        if isinstance(error, dict):
            error = error.get("message")
        if error:
            return str(error)
    except ValueError:
        pass
    return f"server answered {response.status_code}"
