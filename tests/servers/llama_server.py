"""llama.cpp's own llama-server, the oracle of the tests that compare with it: built from the pinned
sdist's sources (tests/fixtures_hf.py), started on a free 127.0.0.1 port, stopped after."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.servers.serve import free_port


@contextmanager
def running_llama_server(
    args: list[str], log_path: Path, env: dict[str, str] | None = None, limit: float = 120
) -> Iterator[str]:
    """llama-server with `args` (the model and its settings), until it answers /health; yields its URL.
    A server that exits, or is not healthy within `limit` seconds, fails the test with its log's end."""
    from tests.fixtures_hf import llama_cpp_tools

    port = free_port()
    cmd = [str(llama_cpp_tools() / "llama-server"), *args, "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + limit
            while not healthy(url):
                tail = log_path.read_text(errors="replace")[-3000:]
                assert proc.poll() is None, f"llama-server exited:\n{tail}"
                assert time.monotonic() < deadline, f"llama-server did not become healthy:\n{tail}"
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
