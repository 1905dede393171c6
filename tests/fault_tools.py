"""What the fault tests share: a real small filesystem to fill, another writer that fills it, and a
`localrt` process stopped at a named step of a store write (LOCALRT_TEST_PAUSE, localrt/faults.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

FILL_BLOCK = 64 << 10


@contextmanager
def small_disk(where: Path, size: str = "8m") -> Iterator[Path]:
    """A real tmpfs of `size`, mounted for the test (needs root, as CI and the dev machines have)."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(disk: Path, leave: int = 0) -> Path:
    """Another writer takes the disk's free room, all of it or all but about `leave` bytes."""
    filler = disk / "filler"

    def free() -> int:
        st = os.statvfs(disk)
        return st.f_bavail * st.f_frsize

    with open(filler, "wb", buffering=0) as f:
        try:
            while free() > leave + FILL_BLOCK:
                f.write(b"\0" * FILL_BLOCK)
            while not leave:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    return filler


def localrt_env(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra}


def start(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "localrt", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def wait_stopped(proc: subprocess.Popen[str], timeout: float = 120.0) -> None:
    """Until the process has stopped itself at its pause point (state T); fails if it exits first or
    never gets there (a pause point the operation does not reach is a failed test, not a hang)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"exited ({proc.returncode}) before its pause point: {err.strip()[-2000:]}")
        try:
            state = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = ""
        if state == "T":
            return
        time.sleep(0.02)
    proc.kill()
    raise AssertionError("the process never reached its pause point")


def paused(args: list[str], env: dict[str, str], point: str) -> subprocess.Popen[str]:
    """`localrt ARGS` started and stopped at `point` (`POINT[@BYTES][#N]`)."""
    proc = start(args, {**env, "LOCALRT_TEST_PAUSE": point})
    wait_stopped(proc)
    return proc


def go_on(proc: subprocess.Popen[str], timeout: float = 120.0) -> tuple[int, str, str]:
    """Let a paused process continue to its end: (exit status, stdout, stderr)."""
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def kill(proc: subprocess.Popen[str]) -> None:
    """SIGKILL: nothing of the process runs after it (no finally, no atexit)."""
    proc.kill()
    proc.communicate(timeout=30)


def run(args: list[str], env: dict[str, str], timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "localrt", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def one_line_error(result: subprocess.CompletedProcess[str] | tuple[int, str, str]) -> str:
    """The single `Error: ...` line of a failed command (asserting there is exactly one, no traceback)."""
    code, stderr = (
        (result.returncode, result.stderr) if not isinstance(result, tuple) else (result[0], result[2])
    )
    assert code != 0
    lines = [line for line in stderr.strip().splitlines() if not line.startswith("localrt-test: paused")]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("Error: "), stderr
    return lines[0]
