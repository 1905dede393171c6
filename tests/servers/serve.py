"""A real `localrt serve` subprocess on a free 127.0.0.1 port, for the API tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalrtServer:
    def __init__(
        self, models_dir: Path, log_path: Path, env: dict[str, str] | None = None, port: int | None = None
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "LOCALRT_HOST": f"127.0.0.1:{self.port}",
            "LOCALRT_MODELS": str(models_dir),
            # a test's requests are over when it stops the server: a short drain keeps `stop` within its wait
            "LOCALRT_SHUTDOWN_GRACE": "5s",
            **(env or {}),
        }
        self.log_path = log_path
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "localrt", "serve"],
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"localrt serve exited: {self.log_path.read_text(errors='replace')}")
            try:
                if httpx.get(self.url + "/", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("localrt serve did not come up in time")

    def alive(self) -> bool:
        return self.proc.poll() is None and httpx.get(self.url + "/", timeout=5).status_code == 200

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def ctrl_c_reaches_the_child() -> None:
    """Before exec: SIGINT back to its default. A suite started in the background (`cmd &` in a
    non-interactive shell) runs with SIGINT ignored, and a child would inherit that and ignore the
    Ctrl-C these tests send it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
