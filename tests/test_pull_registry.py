"""`pull` from an Ollama-compatible registry: a real HTTP server on 127.0.0.1 (tests/servers/registry.py).

The real SmolLM2 GGUF is pulled once for the module; the fault cases use small random blobs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from localrt.errors import DigestMismatch
from localrt.errors import LocalrtError
from localrt.errors import ModelNotFound
from localrt.errors import PullError
from localrt.format import format_bytes
from localrt.store.names import parse_name
from localrt.store.pull import Progress
from localrt.store.pull import pull
from localrt.store.store import MEDIA_MODEL
from localrt.store.store import StorageFull
from localrt.store.store import Store
from tests.servers.registry import MANIFEST_MEDIA_TYPE
from tests.servers.registry import BlobHost
from tests.servers.registry import Registry
from tests.servers.registry import digest_of


@pytest.fixture
def registry() -> Iterator[Registry]:
    with Registry() as server:
        yield server


@pytest.fixture
def store(models_dir: Path) -> Store:
    return Store(models_dir)


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


def blob_gets(server: Registry | BlobHost, digest: str) -> list:
    return [r for r in server.seen("GET") if r.path.endswith(digest)]


# ---- the real model, pulled once ----------------------------------------------------------------
@pytest.fixture(scope="module")
def real_pull(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    with Registry() as server:
        manifest_digest, layer = server.add_model(
            "library/smollm2",
            "135m",
            smollm2_gguf,
            template="{{ .Prompt }}",
            params={"temperature": 0.2, "stop": ["<|im_end|>"]},
        )
        store = Store(tmp_path_factory.mktemp("real") / "models")
        events: list[Progress] = []
        name = f"{server.address}/library/smollm2:135m"
        started = time.monotonic()
        result = pull(name, store=store, insecure=True, progress=events.append)
        yield {
            "server": server,
            "store": store,
            "events": events,
            "name": result,
            "layer": layer,
            "manifest_digest": manifest_digest,
            "seconds": time.monotonic() - started,
        }


def test_real_smollm2_pull_is_verified_and_listed(real_pull: dict, smollm2_gguf: Path) -> None:
    store: Store = real_pull["store"]
    server: Registry = real_pull["server"]
    entries = store.list_models()
    assert [e.name for e in entries] == [real_pull["name"]]
    served = server.manifests[("library/smollm2", "135m")]
    manifest = json.loads(served)
    assert entries[0].size == sum(layer["size"] for layer in manifest["layers"]) + manifest["config"]["size"]
    assert entries[0].manifest_digest == real_pull["manifest_digest"]
    # the manifest is stored byte for byte as served
    assert store.manifest_path(real_pull["name"]).read_bytes() == served
    resolved = store.resolve(real_pull["name"])
    assert resolved.model_path == store.blob_path(real_pull["layer"]["digest"])
    assert resolved.model_path.stat().st_size == smollm2_gguf.stat().st_size
    assert "sha256:" + hashlib.sha256(resolved.model_path.read_bytes()).hexdigest() == digest_of(smollm2_gguf)
    assert resolved.params == {"temperature": 0.2, "stop": ["<|im_end|>"]}
    assert not list(store.blobs.glob("*-partial"))


def test_real_pull_progress_is_ollamas(real_pull: dict) -> None:
    events: list[Progress] = real_pull["events"]
    statuses = [e.status for e in events]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    layer = real_pull["layer"]
    mine = [e for e in events if e.digest == layer["digest"]]
    assert mine
    assert all(e.status == f"pulling {layer['digest'][7:19]}" and e.total == layer["size"] for e in mine)
    assert [e.completed for e in mine] == sorted(e.completed for e in mine)  # monotonic
    assert mine[-1].completed == layer["size"]


# ---- resume ---------------------------------------------------------------------------------------
def test_dropped_connection_resumes_with_range(registry: Registry, store: Store) -> None:
    payload = os.urandom(3_000_000)
    _, layer = registry.add_model("library/tiny", "1", payload)
    registry.drop_after[layer["digest"]] = 1_000_000
    name = pull(f"{registry.address}/library/tiny:1", store=store, insecure=True)
    gets = blob_gets(registry, layer["digest"])
    assert [g.header("Range") for g in gets] == [None, "bytes=1000000-"]
    assert store.resolve(name).model_path.read_bytes() == payload


def test_a_server_that_ignores_range_restarts_cleanly(registry: Registry, store: Store) -> None:
    payload = os.urandom(1_500_000)
    _, layer = registry.add_model("library/norange", "1", payload)
    registry.drop_after[layer["digest"]] = 700_000
    registry.ignore_range = True
    name = pull(f"{registry.address}/library/norange:1", store=store, insecure=True)
    assert blob_gets(registry, layer["digest"])[-1].header("Range") == "bytes=700000-"
    assert store.resolve(name).model_path.read_bytes() == payload  # the 200 body replaced the partial


def test_killed_pull_resumes_from_the_partial_file(
    registry: Registry, store: Store, models_dir: Path
) -> None:
    payload = os.urandom(6_000_000)
    _, layer = registry.add_model("library/slow", "1", payload)
    registry.delay = 0.02  # 64 KiB per 20 ms: the first pull is still running when it is killed
    name = f"{registry.address}/library/slow:1"
    proc = subprocess.Popen(
        [sys.executable, "-m", "localrt", "pull", name, "--insecure"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "LOCALRT_MODELS": str(models_dir)},
    )
    partial = store.partial_path(layer["digest"])
    deadline = time.monotonic() + 60
    while not (partial.exists() and partial.stat().st_size > 500_000):
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert time.monotonic() < deadline, "the pull never started writing"
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    kept = partial.stat().st_size
    assert 0 < kept < len(payload)
    assert not store.exists(parse_name(name))

    registry.delay = 0.0
    pull(name, store=store, insecure=True)
    last = blob_gets(registry, layer["digest"])[-1]
    assert last.header("Range") == f"bytes={kept}-"
    assert store.resolve(name).model_path.read_bytes() == payload
    assert not partial.exists()


# ---- integrity ------------------------------------------------------------------------------------
def test_wrong_bytes_are_rejected_and_nothing_is_written(registry: Registry, store: Store) -> None:
    _, layer = registry.add_model("library/bad", "1", os.urandom(200_000))
    registry.corrupt.add(layer["digest"])
    with pytest.raises(DigestMismatch, match="digest mismatch"):
        pull(f"{registry.address}/library/bad:1", store=store, insecure=True)
    assert not [p for p in store.manifests.rglob("*") if p.is_file()]
    assert not store.has_blob(layer["digest"])
    assert not store.partial_path(layer["digest"]).exists()


def test_traversal_digest_in_manifest_writes_nothing(
    registry: Registry, store: Store, tmp_path: Path
) -> None:
    good = registry.add_blob(b"config")
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", **good},
        "layers": [{"mediaType": MEDIA_MODEL, "digest": "sha256:../../x", "size": 10}],
    }
    registry.add_manifest("library/evil", "1", manifest)
    before = files_under(tmp_path)
    with pytest.raises(PullError, match="invalid manifest.*invalid digest"):
        pull(f"{registry.address}/library/evil:1", store=store, insecure=True)
    assert files_under(tmp_path) == before
    assert not (tmp_path / "x").exists()
    assert not (store.root.parent / "x").exists()
    assert not registry.seen(contains="/blobs/")


def test_pull_by_digest_verifies_the_manifest(registry: Registry, store: Store) -> None:
    manifest_digest, _ = registry.add_model("library/pinned", "1", os.urandom(10_000))
    name = pull(f"{registry.address}/library/pinned@{manifest_digest}", store=store, insecure=True)
    assert name.tag == "latest"
    assert store.list_models()[0].manifest_digest == manifest_digest
    assert registry.seen("GET", f"/manifests/{manifest_digest}")

    # a registry that answers a digest request with other bytes is caught
    lying = "sha256:" + "0" * 64
    registry.manifests[("library/pinned", lying)] = registry.manifests[("library/pinned", "1")]
    with pytest.raises(DigestMismatch, match="digest mismatch"):
        pull(f"{registry.address}/library/pinned:2@{lying}", store=store, insecure=True)


def test_registry_token_is_never_sent_to_another_host(registry: Registry, store: Store) -> None:
    with BlobHost(registry) as cdn:
        registry.token = "s3cret-token"
        registry.redirect_blobs_to = cdn.url
        _, layer = registry.add_model("library/private", "1", os.urandom(300_000))
        name = pull(f"{registry.address}/library/private:1", store=store, insecure=True)
        assert store.resolve(name).model_path.is_file()
        assert registry.tokens_issued == 1
        assert registry.seen("GET", "/token")[0].header("Authorization") is None
        authed = [r for r in registry.seen(contains="/v2/") if r.header("Authorization")]
        assert authed
        assert all(r.header("Authorization") == "Bearer s3cret-token" for r in authed)
        assert blob_gets(registry, layer["digest"])[-1].header("Authorization") == "Bearer s3cret-token"
        assert cdn.seen("GET", layer["digest"])  # the redirect was followed ...
        assert all(r.header("Authorization") is None for r in cdn.requests)  # ... without the token


def test_token_realm_on_another_host_is_refused(registry: Registry, store: Store) -> None:
    with BlobHost(registry) as other:
        registry.token = "s3cret-token"
        registry.realm = f"{other.url}/token"
        registry.add_model("library/private", "1", b"x" * 100)
        with pytest.raises(PullError, match="another host"):
            pull(f"{registry.address}/library/private:1", store=store, insecure=True)
        assert other.requests == []


# ---- user-facing errors ---------------------------------------------------------------------------
def test_http_registry_needs_insecure(registry: Registry, store: Store) -> None:
    registry.add_model("library/tiny", "1", b"x" * 100)
    for name in (f"{registry.address}/library/tiny:1", f"http://{registry.address}/library/tiny:1"):
        with pytest.raises(PullError, match=f"registry {registry.address} uses http; pass --insecure"):
            pull(name, store=store)
    assert pull(f"http://{registry.address}/library/tiny:1", store=store, insecure=True).tag == "1"


def test_missing_model_is_not_found(registry: Registry, store: Store) -> None:
    with pytest.raises(ModelNotFound, match="file does not exist"):
        pull(f"{registry.address}/library/nothing:1", store=store, insecure=True)


@pytest.mark.parametrize("name", ["127.0.0.1:9/library/x:1", "no-such-host.invalid/library/x:1"])
def test_unreachable_registry_is_a_clear_error(store: Store, name: str) -> None:
    with pytest.raises(PullError, match=f"cannot reach {name.split('/')[0]}: "):
        pull(name, store=store, insecure=True)
    assert store.list_models() == []


def test_layer_bigger_than_the_disk_is_refused_up_front(registry: Registry, store: Store) -> None:
    config = registry.add_blob(b"{}")
    registry.add_manifest(
        "library/huge",
        "1",
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "config": {"mediaType": "application/vnd.docker.container.image.v1+json", **config},
            "layers": [{"mediaType": MEDIA_MODEL, "digest": "sha256:" + "ab" * 32, "size": 10**18}],
        },
    )
    with pytest.raises(
        StorageFull,
        match=re.escape(f"not enough disk space for {store.blobs}: need {format_bytes(10**18)}, have "),
    ):
        pull(f"{registry.address}/library/huge:1", store=store, insecure=True)
    assert not registry.seen(contains="/blobs/")


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB tmpfs to fill up (needs root, as CI has); skipped where it cannot be mounted."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_disk_filling_up_mid_blob_keeps_the_partial(
    registry: Registry, tiny_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, layer = registry.add_model("library/big", "1", os.urandom(3_000_000))
    # skip the up-front check so the write itself meets ENOSPC
    monkeypatch.setattr("localrt.store.sources.oci.check_free_space", lambda store, needed: None)
    store = Store(tiny_disk)
    partial = store.partial_path(layer["digest"])
    with pytest.raises(
        StorageFull,
        match=re.escape(f"not enough disk space for {partial}: need ")
        + ".*no space left on device; the partial download is kept",
    ):
        pull(f"{registry.address}/library/big:1", store=store, insecure=True)
    assert store.partial_path(layer["digest"]).stat().st_size > 0
    assert not [p for p in store.manifests.rglob("*") if p.is_file()]


# ---- concurrency ----------------------------------------------------------------------------------
def test_concurrent_pulls_download_each_blob_once(registry: Registry, store: Store) -> None:
    payload = os.urandom(2_000_000)
    _, layer = registry.add_model("library/shared", "1", payload)
    registry.delay = 0.005  # long enough that the two pulls overlap
    name = f"{registry.address}/library/shared:1"
    results: list[object] = []

    def worker() -> None:
        try:
            results.append(pull(name, store=Store(store.root), insecure=True))
        except LocalrtError as e:  # surfaced by the assertion below
            results.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [parse_name(name)] * 2
    assert len(blob_gets(registry, layer["digest"])) == 1
    assert sorted(p.name for p in store.blobs.iterdir()) == sorted(
        "sha256-" + d.split(":")[1] for d in registry.blobs
    )
    assert store.resolve(name).model_path.read_bytes() == payload
