"""`localrt run` / `ps` / `stop` as a user runs them: subprocesses of `python -m localrt` on the real model."""

from __future__ import annotations

import json
import os
import re
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

from localrt.store.store import Store  # noqa: E402

THREADS = int(os.environ.get("LOCALRT_TEST_THREADS", "1"))
PARAMS = {"temperature": 0, "num_ctx": 1024, "num_thread": THREADS, "num_batch": 256}
QUESTION = "What is the capital of France?"


@pytest.fixture
def store(models_dir: Path, smollm2_gguf: Path) -> Store:
    from localrt.store.importer import import_gguf

    s = Store(models_dir)
    # a plain system prompt: with its built-in one, SmolLM2-135M answers this question in riddles
    import_gguf(s, "smollm2:135m", smollm2_gguf, params=PARAMS, system="You are a helpful assistant.")
    return s


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def localrt(*args: str, stdin: str | None = "", timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LOCALRT_HOST": f"127.0.0.1:{free_port()}"}
    return subprocess.run(
        [sys.executable, "-m", "localrt", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_one_shot_answers_paris(store: Store) -> None:
    result = localrt("run", "smollm2:135m", QUESTION)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert result.stderr == ""  # no llama.cpp chatter


def test_verbose_prints_ollamas_timing_lines(store: Store) -> None:
    result = localrt("run", "smollm2:135m", QUESTION, "--verbose")
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    labels = [line.split(":")[0] for line in lines]
    assert labels == [
        "total duration",
        "load duration",
        "prompt eval count",
        "prompt eval duration",
        "prompt eval rate",
        "eval count",
        "eval duration",
        "eval rate",
    ]
    assert re.fullmatch(r"prompt eval count:    \d+ token\(s\)", lines[2])
    assert re.fullmatch(r"eval rate:            \d+\.\d\d tokens/s", lines[-1])
    assert re.fullmatch(r"total duration:       [\d.]+(s|ms)", lines[0])


def test_stdin_is_the_prompt(store: Store) -> None:
    result = localrt("run", "smollm2:135m", stdin=QUESTION + "\n")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_format_json(store: Store) -> None:
    result = localrt(
        "run", "smollm2:135m", "Describe Paris as JSON with name and country.", "--format", "json"
    )
    assert result.returncode == 0, result.stderr
    assert isinstance(json.loads(result.stdout), dict)


def test_lookup_speculation_flag(store: Store) -> None:
    result = localrt(
        "run",
        "smollm2:135m",
        "Repeat exactly: red green blue, red green blue, red green blue.",
        "--spec",
        "lookup",
        "--verbose",
    )
    assert result.returncode == 0, result.stderr
    assert "draft accepted:" in result.stderr
    assert "eval rate:" in result.stderr.splitlines()[-1]


@pytest.mark.parametrize(
    "args,message",
    [
        (["run", "nosuch:1b", "hi", "--backend", "tensorflow"], "unknown backend 'tensorflow'"),
        (["run", "smollm2:135m", "hi", "--spec", "self"], "'self' is not supported by the llama.cpp backend"),
        (["run", "smollm2:135m", "hi", "--keepalive", "soon"], "invalid duration"),
        (["run", "smollm2:135m", "hi", "--format", "yaml"], "invalid format"),
        (["run", "smollm2:135m", "hi", "--draft", "nosuch:draft"], "draft model 'nosuch:draft' not found"),
        (["run", "127.0.0.1:9/library/nosuch:latest", "hi"], "Error:"),
    ],
)
def test_errors_are_one_line(store: Store, args: list[str], message: str) -> None:
    result = localrt(*args)
    assert result.returncode == 1
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.startswith("Error")]) == 1


def test_backend_not_installed_is_one_line(store: Store, without_mlx: None) -> None:
    result = localrt("run", "smollm2:135m", "hi", "--backend", "mlx")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        "Error: backend mlx is not available: mlx is not installed; pip install 'localrt[mlx]'"
    )


def test_auto_pull_when_missing(models_dir: Path, smollm2_gguf: Path) -> None:
    from tests.servers.registry import Registry

    with Registry() as registry:
        registry.add_model(
            "library/smollm2",
            "135m",
            smollm2_gguf,
            template="{{ .Prompt }}",
            params={**PARAMS, "num_predict": 8},
        )
        name = f"{registry.address}/library/smollm2:135m"
        result = localrt("run", name, "Hello", "--insecure")
    assert result.returncode == 0, result.stderr
    assert "pulling" in result.stderr
    assert "success" in result.stderr
    assert result.stdout.strip()
    assert Store(models_dir).exists(
        __import__("localrt.store.names", fromlist=["parse_name"]).parse_name(name)
    )


def test_bench_reports_each_concurrency(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALRT_NUM_PARALLEL", "2")
    result = localrt("bench", "smollm2:135m", "--concurrency", "1,2", "--num-predict", "8", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["backend"] == "llama.cpp"
    assert [r["concurrency"] for r in report["rounds"]] == [1, 2]
    for r in report["rounds"]:
        # greedy, 8 tokens each unless an answer ends first
        assert r["requests"] == r["concurrency"]
        assert 0 < r["tokens"] <= 8 * r["requests"]
        assert r["aggregate_tps"] > 0
        assert r["decode_tps_median"] > 0
        assert 0 < r["ttft_ms_median"] <= r["ttft_ms_max"]
        assert r["acceptance"] is None
    copy = "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog"
    result = localrt(
        "bench",
        "smollm2:135m",
        "--concurrency",
        "1",
        "--num-predict",
        "24",
        "--spec",
        "lookup",
        "--prompt",
        copy,
    )
    assert result.returncode == 0, result.stderr
    header, row = result.stdout.splitlines()[1:3]
    assert header.split()[0] == "concurrency"
    assert row.split()[0] == "1"
    assert row.split()[-1].endswith("%")  # lookup drafted, so an acceptance rate is shown


@pytest.mark.parametrize(
    "args,message",
    [
        (["--concurrency", "0"], "--concurrency must be"),
        (["--concurrency", "two"], "--concurrency must be"),
        (["--num-predict", "0"], "--num-predict must be at least 1"),
        (["--spec", "fast"], "invalid choice"),
    ],
)
def test_bench_bad_arguments(store: Store, args: list[str], message: str) -> None:
    result = localrt("bench", "smollm2:135m", *args)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_ps_and_stop_without_a_server() -> None:
    result = localrt("ps")
    assert result.returncode == 0
    assert result.stdout.split() == ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]
    result = localrt("stop", "smollm2:135m")
    assert result.returncode == 1
    assert re.search(r"no server running at 127\.0\.0\.1:\d+", result.stderr)


# ---- the interactive chat, on a pseudo-terminal -------------------------------------------------
class Terminal:
    """The child gets the pty as its controlling terminal, so Ctrl-C (\\x03) becomes a real SIGINT."""

    def __init__(self, *args: str) -> None:
        import pty

        env = {**os.environ, "LOCALRT_HOST": f"127.0.0.1:{free_port()}", "TERM": "dumb"}
        self.pid, self.master = pty.fork()
        if self.pid == 0:  # the child
            os.execve(sys.executable, [sys.executable, "-m", "localrt", *args], env)
        self.seen = ""

    def read_until(self, pattern: str, since: int = 0, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.seen[since:]):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"timed out waiting for {pattern!r}; got:\n{self.seen}")
            ready, _, _ = select.select([self.master], [], [], min(remaining, 0.5))
            if ready:
                try:
                    self.seen += os.read(self.master, 65536).decode("utf-8", "replace")
                except OSError:  # the child closed the terminal
                    raise AssertionError(
                        f"terminal closed waiting for {pattern!r}; got:\n{self.seen}"
                    ) from None
        return self.seen

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.master)
                return os.waitstatus_to_exitcode(status)
            with __import__("contextlib").suppress(OSError):  # keep the pty drained
                if select.select([self.master], [], [], 0.1)[0]:
                    self.seen += os.read(self.master, 65536).decode("utf-8", "replace")
        raise AssertionError("localrt run did not exit")

    def kill(self) -> None:
        with __import__("contextlib").suppress(OSError):
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)


def test_interactive_chat(store: Store) -> None:
    term = Terminal("run", "smollm2:135m")
    try:
        term.read_until(">>> ")
        term.send("/?\n")
        term.read_until("/set parameter")
        term.send("/set parameter num_predict 400\n")
        term.read_until("Set parameter 'num_predict' to '400'")
        term.send("/set parameter temperature hot\n")
        term.read_until("must be a number")
        term.send("/show info\n")
        term.read_until(r"architecture\s+llama")
        # Ctrl-C stops the answer, not the program
        mark = len(term.seen)
        term.send("Write a very long story about a dragon.\n")
        # the answer is streaming: two words after the prompt's own echo (not typeahead + ">>> ")
        term.read_until(r"dragon\.\r?\n(?!>>>)\S+ \S+ ", since=mark)
        term.send("\x03")
        term.read_until(">>> ", since=mark)
        term.send("/clear\n")
        term.read_until("Cleared session context")
        mark = len(term.seen)
        term.send('"""What is the capital\nof France?"""\n')
        term.read_until("Paris", since=mark + 40)
        term.read_until(">>> ", since=mark + 40)
        term.send("/bye\n")
        assert term.wait() == 0
    finally:
        term.kill()


@pytest.mark.parametrize("delay", [0.0, 0.3, 1.0])
def test_ctrl_c_before_the_first_token_keeps_the_chat(store: Store, delay: float) -> None:
    """Ctrl-C while a long prompt is still being evaluated: back to the prompt, nothing lost."""
    term = Terminal("run", "smollm2:135m")
    try:
        term.read_until(">>> ")
        mark = len(term.seen)
        long_prompt = " ".join(["The lighthouse keeper counted the ships in the rocky strait."] * 60)
        term.send(f"Summarise: {long_prompt}\n")
        term.read_until(r"strait\.\r?\n", since=mark)  # the line is in (readline may scroll its echo)
        time.sleep(delay)
        term.send("\x03")
        # the tty echoes ^C once the line is taken; with no delay the interrupt may still land inside
        # readline, between its echo of Enter and input() returning: then the line is not taken (as
        # at an empty prompt) and the chat must go on just the same
        at_prompt = r"|Use Ctrl \+ d or /bye to exit\.\r?\n" if delay == 0.0 else ""
        term.read_until(rf"(\^C{at_prompt})[\s\S]*>>> ", since=mark)
        # the chat goes on: the interrupted question was dropped, the next one is answered
        mark = len(term.seen)
        term.send("What is the capital of France?\n")
        term.read_until("Paris", since=mark + 30)
        term.read_until(">>> ", since=mark + 30)
        term.send("/bye\n")
        assert term.wait() == 0
    finally:
        term.kill()


def test_interactive_tools_ask_on_the_terminal(
    models_dir: Path, smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run --tools` on a terminal: the step limit is set, a command the model wants to run is shown
    and asked about on the terminal, denied, and the chat goes on."""
    from tests.tool_loop_fixtures import tool_model_store

    tool_model_store(models_dir, smollm2_gguf)  # SmolLM2 under a template with tools
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # no user's MCP servers
    monkeypatch.setenv("LOCALRT_DATA", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    term = Terminal("run", "smollm2:135m", "--tools", "--tool-choice", "run_shell")
    try:
        term.read_until(">>> ")
        term.send("/set maxsteps 2\n")
        term.read_until("Set 'maxsteps' to 2.")
        mark = len(term.seen)
        term.send("List the files here.\n")
        term.read_until(r"→ run_shell: \$ ", since=mark, timeout=600)
        term.read_until(
            r"Allow run_shell \(\$ .*\)\? \[y\] once, \[a\] for this run, \[n\] deny: ", since=mark
        )
        term.send("n\n")
        denied = r"← run_shell \(denied\):\r?\n  The user denied this call"
        mark += re.search(denied, term.read_until(denied, since=mark)[mark:]).end()  # type: ignore[union-attr]
        # the forced reply may hold more calls than the first (each asked about in turn): denied too
        for _ in range(8):
            term.read_until(r">>> |\[n\] deny: ", since=mark, timeout=600)
            found = re.search(r">>> |\[n\] deny: ", term.seen[mark:])
            assert found is not None
            mark += found.end()
            if found.group() == ">>> ":
                break
            term.send("n\n")
        else:
            raise AssertionError(f"the chat never came back to its prompt:\n{term.seen}")
        term.send("/bye\n")
        assert term.wait(timeout=180) == 0  # a busy machine takes a while to unload
    finally:
        term.kill()
