"""`push` to an Ollama-compatible registry: the real test registry (tests/servers/registry.py) on
127.0.0.1, taught to accept uploads behind a Bearer challenge, and pulls back into fresh stores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import ollama
import pytest

from localrt.errors import LocalrtError
from localrt.errors import ModelNotFound
from localrt.store.importer import import_gguf
from localrt.store.names import ModelName
from localrt.store.names import parse_name
from localrt.store.pull import Progress
from localrt.store.pull import pull
from localrt.store.push import PushError
from localrt.store.push import push
from localrt.store.store import Store
from localrt.store.store import manifest_layers
from tests.gguf_factory import write_tiny_llama
from tests.servers.registry import Registry
from tests.servers.serve import LocalrtServer
from tests.servers.serve import free_port

CHUNK = 64 * 1024  # small PATCH chunks, so a blob takes several requests


def no_sleep(_: float) -> None:
    pass


@pytest.fixture
def registry() -> Iterator[Registry]:
    with Registry() as server:
        server.token = "push-test-token"
        yield server
        assert server.dangling() == []  # never a manifest naming a blob the registry lacks


@pytest.fixture
def source(tmp_path: Path, registry: Registry) -> tuple[Store, ModelName]:
    """A store holding a small model (weights, template, system, params) named for the registry."""
    store = Store(tmp_path / "source")
    gguf = write_tiny_llama(tmp_path / "tiny.gguf")
    name = parse_name(f"{registry.address}/me/tiny:1")
    import_gguf(store, name, gguf, template="{{ .Prompt }}", system="Be brief.", params={"temperature": 0.3})
    return store, name


def blobs_of(store: Store, name: ModelName) -> dict[str, bytes]:
    manifest, _ = store.read_manifest(name)
    return {
        layer["digest"]: store.blob_path(layer["digest"]).read_bytes() for layer in manifest_layers(manifest)
    }


def model_blob(store: Store, name: ModelName) -> str:
    manifest, _ = store.read_manifest(name)
    return max(manifest["layers"], key=lambda layer: layer["size"])["digest"]


def test_push_then_pull_gives_identical_manifest_and_blobs(
    source: tuple[Store, ModelName], registry: Registry, tmp_path: Path
) -> None:
    store, name = source
    events: list[Progress] = []
    digest = push(name, store=store, insecure=True, progress=events.append, chunk_size=CHUNK)
    assert registry.manifests[("me/tiny", "1")] == store.manifest_bytes(name)
    assert digest == store.read_manifest(name)[1]
    for blob, data in blobs_of(store, name).items():
        assert registry.blobs[blob] == data
    fresh = Store(tmp_path / "fresh")
    pull(name, store=fresh, insecure=True)
    assert fresh.manifest_bytes(name) == store.manifest_bytes(name)
    assert blobs_of(fresh, name) == blobs_of(store, name)
    assert [e.status for e in events][0] == "retrieving manifest"
    assert [e.status for e in events][-2:] == ["pushing manifest", "success"]


def test_push_is_chunked_and_answers_the_bearer_challenge(
    source: tuple[Store, ModelName], registry: Registry
) -> None:
    store, name = source
    push(name, store=store, insecure=True, chunk_size=CHUNK)
    size = store.blob_path(model_blob(store, name)).stat().st_size
    patches = registry.seen("PATCH")
    assert len(patches) >= size // CHUNK  # the model blob went in many PATCH requests
    assert all(r.header("Authorization") == f"Bearer {registry.push_token}" for r in patches)
    assert registry.seen("PUT", "/manifests/1")[-1].header("Authorization") == f"Bearer {registry.push_token}"
    assert registry.seen("GET", "/token")[0].header("Authorization") is None  # the token endpoint gets none
    # the manifest went last, after every blob upload was closed
    puts = [r.path for r in registry.requests if r.method == "PUT"]
    assert "/manifests/" in puts[-1]
    assert all("digest=" in p for p in puts[:-1])


def test_push_skips_blobs_the_registry_has(source: tuple[Store, ModelName], registry: Registry) -> None:
    store, name = source
    push(name, store=store, insecure=True, chunk_size=CHUNK)
    before = len(registry.seen("PATCH"))
    push(name, store=store, insecure=True, chunk_size=CHUNK)
    assert len(registry.seen("PATCH")) == before
    assert len(registry.seen("HEAD")) >= 2 * len(blobs_of(store, name))


def test_push_resumes_a_chunk_cut_mid_blob(
    source: tuple[Store, ModelName], registry: Registry, tmp_path: Path
) -> None:
    store, name = source
    registry.drop_patch_after = 3 * CHUNK + 1000  # inside the fourth chunk of the first large upload
    push(name, store=store, insecure=True, chunk_size=CHUNK, sleep=no_sleep)
    assert registry.drop_patch_after is None  # the fault fired
    status_checks = [r for r in registry.seen("GET") if "/blobs/uploads/" in r.path]
    assert status_checks  # the client asked the registry where the upload stood ...
    resumed = [r.header("Content-Range") for r in registry.seen("PATCH")]
    assert f"{3 * CHUNK + 1000}-" in "".join(f"{c}," for c in resumed)  # ... and went on from there
    fresh = Store(tmp_path / "fresh")
    pull(name, store=fresh, insecure=True)
    assert blobs_of(fresh, name) == blobs_of(store, name)


def test_interrupted_push_leaves_no_manifest_and_a_rerun_restarts(
    source: tuple[Store, ModelName], registry: Registry, tmp_path: Path
) -> None:
    store, name = source
    registry.drop_patch_after = CHUNK // 2  # the first chunk is cut half way ...
    registry.refuse_patches = True  # ... then the link stays down
    registry.forget_uploads = True  # and the registry drops the half-done upload
    with pytest.raises(PushError) as err:
        push(name, store=store, insecure=True, chunk_size=CHUNK, sleep=no_sleep)
    assert "run push again" in str(err.value)
    assert registry.drop_patch_after is None
    assert ("me/tiny", "1") not in registry.manifests
    registry.refuse_patches = False
    push(name, store=store, insecure=True, chunk_size=CHUNK, sleep=no_sleep)
    assert registry.manifests[("me/tiny", "1")] == store.manifest_bytes(name)
    fresh = Store(tmp_path / "fresh")
    pull(name, store=fresh, insecure=True)
    assert blobs_of(fresh, name) == blobs_of(store, name)


def test_push_errors_are_clear(source: tuple[Store, ModelName], registry: Registry) -> None:
    store, name = source
    with pytest.raises(LocalrtError, match="pass --insecure"):
        push(f"http://{name.display}", store=store)
    with pytest.raises(ModelNotFound, match="not found"):
        push(f"{registry.address}/me/absent:1", store=store, insecure=True)
    registry.token = None
    registry.realm = None
    assert push(name, store=store, insecure=True, chunk_size=CHUNK)  # an open registry needs no token


def test_push_cli(source: tuple[Store, ModelName], registry: Registry, tmp_path: Path) -> None:
    store, name = source
    # nothing answers at LOCALRT_HOST: the command works on the store in this process
    env = {"LOCALRT_MODELS": str(store.root), "LOCALRT_HOST": f"127.0.0.1:{free_port()}"}
    ok = subprocess.run(
        [sys.executable, "-m", "localrt", "push", name.display, "--insecure"],
        capture_output=True,
        text=True,
        env={**_env(), **env},
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert "success" in ok.stdout + ok.stderr
    assert registry.manifests[("me/tiny", "1")] == store.manifest_bytes(name)
    bad = subprocess.run(
        [sys.executable, "-m", "localrt", "push", f"{registry.address}/me/absent:1", "--insecure"],
        capture_output=True,
        text=True,
        env={**_env(), **env},
        timeout=120,
    )
    assert bad.returncode != 0
    assert bad.stderr.count("\n") == 1
    assert "not found" in bad.stderr


def _env() -> dict[str, str]:
    return dict(os.environ)


def test_api_push_streams_progress(
    source: tuple[Store, ModelName], registry: Registry, tmp_path: Path
) -> None:
    store, name = source
    server = LocalrtServer(store.root, tmp_path / "serve.log")
    try:
        client = ollama.Client(host=server.url)
        events = list(client.push(name.display, insecure=True, stream=True))
        assert events[0].status == "retrieving manifest"
        assert events[-1].status == "success"
        assert any(e.digest and e.total and e.completed == e.total for e in events)
        assert registry.manifests[("me/tiny", "1")] == store.manifest_bytes(name)
        with pytest.raises(ollama.ResponseError) as err:
            client.push(f"{registry.address}/me/absent:1", insecure=True)
        assert err.value.status_code == 404
        # `localrt push` with a server at LOCALRT_HOST goes through its /api/push
        registry.manifests.clear()
        via_server = subprocess.run(
            [sys.executable, "-m", "localrt", "push", name.display, "--insecure"],
            capture_output=True,
            text=True,
            env={
                **_env(),
                "LOCALRT_HOST": f"127.0.0.1:{server.port}",
                "LOCALRT_MODELS": str(tmp_path / "unused"),
            },
            timeout=120,
        )
        assert via_server.returncode == 0, via_server.stderr
        assert registry.manifests[("me/tiny", "1")] == store.manifest_bytes(name)
        dead = parse_name(f"127.0.0.1:{free_port()}/me/tiny:1")  # nothing listens there
        store.copy(name, dead)
        lines = [json.loads(line) for line in _raw_push(server.url, dead.display)]
        assert lines[0] == {"status": "retrieving manifest"}
        assert "cannot reach 127.0.0.1" in lines[-1]["error"]
    finally:
        server.stop()
    assert "Traceback" not in (tmp_path / "serve.log").read_text(errors="replace")


def _raw_push(url: str, model: str) -> list[str]:
    import httpx

    with httpx.stream("POST", url + "/api/push", json={"model": model, "insecure": True}, timeout=120) as r:
        return [line for line in r.iter_lines() if line]
