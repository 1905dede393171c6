"""A model's blob removed while the model is loaded (another process, a disk clean-up) does not crash the
server: the model is refused with a clear error naming the damage (each request resolves the store first),
the other models serve on, and `localrt verify` names what to pull again.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx

from localrt.store.importer import import_gguf
from localrt.store.store import Store
from tests.gguf_factory import write_tiny_llama
from tests.servers.serve import LocalrtServer

LIVENESS = 120.0


def chat(server: LocalrtServer, model: str, **extra: object) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "stream": False}
    body["options"] = {"temperature": 0, "num_predict": 8}
    return httpx.post(server.url + "/api/chat", json=body | extra, timeout=LIVENESS)


def test_a_blob_removed_under_a_loaded_model_does_not_crash_the_server(tmp_path: Path) -> None:
    store = Store(tmp_path / "models")
    import_gguf(store, "gone:latest", write_tiny_llama(tmp_path / "a.gguf", seed=1))
    import_gguf(store, "kept:latest", write_tiny_llama(tmp_path / "b.gguf", seed=2))
    blob = store.resolve("gone:latest").model_path
    server = LocalrtServer(store.root, tmp_path / "serve.log")
    try:
        assert chat(server, "gone:latest").status_code == 200
        blob.unlink()  # while it is loaded
        refused = chat(server, "gone:latest")
        assert refused.status_code == 400
        assert refused.json() == {
            "error": "model 'gone:latest' is damaged: its model blob is missing; pull it again"
        }
        assert chat(server, "kept:latest").status_code == 200
        assert server.alive()
    finally:
        assert server.stop() in (0, -signal.SIGTERM)
    assert "Traceback" not in (tmp_path / "serve.log").read_text()
    checked = subprocess.run(
        [sys.executable, "-m", "localrt", "verify"],
        capture_output=True,
        text=True,
        env={**server.env, "LOCALRT_HOST": "127.0.0.1:9"},
    )
    assert checked.returncode == 1
    assert f"gone:latest: blob sha256:{blob.name[7:]} is missing" in checked.stdout
