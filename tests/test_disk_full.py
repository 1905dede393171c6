"""A disk that fills while a write is under way, on a real 8 MiB tmpfs that the test mounts (as root).

Another writer takes the free room after the write started (after the up-front check, which cannot see
it): the write fails with one clear error naming the file, the room it still needed and the room there
is; the partial file is removed (kept for a pull, which resumes it); nothing else in the store changes;
the server keeps serving. Then the room comes back and the same command completes.
"""

from __future__ import annotations

import hashlib
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from localrt.store.names import parse_name
from localrt.store.store import Store
from tests.fault_tools import fill
from tests.fault_tools import go_on
from tests.fault_tools import localrt_env
from tests.fault_tools import one_line_error
from tests.fault_tools import paused
from tests.fault_tools import run
from tests.fault_tools import small_disk
from tests.gguf_factory import small_valid_gguf
from tests.gguf_factory import write_tiny_llama
from tests.servers.registry import Registry
from tests.servers.serve import LocalrtServer

MiB = 1 << 20


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    with small_disk(tmp_path / "disk", "8m") as mount:
        yield mount


@pytest.fixture
def store_on_disk(disk: Path, tmp_path: Path) -> Store:
    """A store on the small disk holding one small model, `other`, which no failure may touch."""
    store = Store(disk / "models")
    other = tmp_path / "other.gguf"
    other.write_bytes(small_valid_gguf())
    assert run(["create", "other", "--from", str(other)], env_for(store)).returncode == 0
    return store


@pytest.fixture(scope="module")
def five_mib_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real Llama GGUF (random F32 weights) of about 5 MiB: more than the disk keeps free once filled."""
    path = write_tiny_llama(tmp_path_factory.mktemp("gguf") / "five.gguf", n_embd=256, n_ff=512)
    assert 4 * MiB < path.stat().st_size < 7 * MiB
    return path


def env_for(store: Store, **extra: str) -> dict[str, str]:
    return localrt_env(LOCALRT_MODELS=str(store.root), **extra)


def assert_untouched(store: Store, *, expect: list[str]) -> None:
    """The store lists what it listed, and `verify` finds nothing broken (the full disk freed first)."""
    assert sorted(e.name.display for e in store.list_models()) == sorted(expect)
    checked = run(["verify"], env_for(store))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_pull_meets_a_disk_filled_mid_download_keeps_the_partial_and_resumes(
    store_on_disk: Store, five_mib_gguf: Path
) -> None:
    store = store_on_disk
    with Registry() as registry:
        _, layer = registry.add_model("library/five", "1", five_mib_gguf)
        name = f"{registry.address}/library/five:1"
        proc = paused(["pull", name, "--insecure"], env_for(store), "write@1000000")
        filler = fill(store.root.parent)
        error = one_line_error(go_on(proc))
        partial = store.partial_path(layer["digest"])
        assert re.fullmatch(
            re.escape(f"Error: not enough disk space for {partial}: need ")
            + r"[\d.]+ MB more, have [\d.]+ (KB|B) \(no space left on device; the partial download is kept: "
            r"pull again to resume once there is room\)",
            error,
        ), error
        kept = partial.stat().st_size
        assert kept >= 1_000_000
        filler.unlink()
        assert_untouched(store, expect=["other:latest"])
        again = run(["pull", name, "--insecure"], env_for(store))
        assert again.returncode == 0, again.stderr
        ranges = [r.header("Range") for r in registry.seen("GET") if r.path.endswith(layer["digest"])]
        assert ranges[-1] == f"bytes={kept}-"
    assert store.resolve(parse_name(name)).model_path.read_bytes() == five_mib_gguf.read_bytes()
    assert_untouched(store, expect=["other:latest", parse_name(name).display])


def test_create_meets_a_disk_filled_mid_copy_removes_the_partial(
    store_on_disk: Store, five_mib_gguf: Path
) -> None:
    store = store_on_disk
    proc = paused(["create", "five", "--from", str(five_mib_gguf)], env_for(store), "write@1000000")
    temp = next(store.blobs.glob(".incoming-*"))  # the blob being written
    filler = fill(store.root.parent)
    error = one_line_error(go_on(proc))
    assert re.fullmatch(
        re.escape(f"Error: not enough disk space for {temp}: need ")
        + r"[\d.]+ MB more, have [\d.]+ (KB|B) \(no space left on device; the partial file was removed\)",
        error,
    ), error
    assert list(store.blobs.glob(".incoming-*")) == []
    filler.unlink()
    assert_untouched(store, expect=["other:latest"])
    again = run(["create", "five", "--from", str(five_mib_gguf)], env_for(store))
    assert again.returncode == 0, again.stderr
    assert_untouched(store, expect=["other:latest", "five:latest"])


def test_create_quantize_on_a_full_disk_names_the_file_and_leaves_no_scratch(
    store_on_disk: Store, five_mib_gguf: Path
) -> None:
    store = store_on_disk
    filler = fill(store.root.parent, leave=300_000)  # less than the quantized model needs
    failed = run(["create", "small", "--from", str(five_mib_gguf), "-q", "Q8_0"], env_for(store))
    error = one_line_error(failed)
    assert re.fullmatch(
        re.escape(f"Error: not enough disk space for {store.root}/") + r"\.quantize-[^/]+/model\.gguf: need "
        r"[\d.]+ MB more, have [\d.]+ (KB|B) \(no space left on device; the partial file was removed\)",
        error,
    ), error
    assert list(store.root.glob(".quantize-*")) == []
    filler.unlink()
    assert_untouched(store, expect=["other:latest"])
    again = run(["create", "small", "--from", str(five_mib_gguf), "-q", "Q8_0"], env_for(store))
    assert again.returncode == 0, again.stderr
    assert_untouched(store, expect=["other:latest", "small:latest"])


def test_an_upload_meets_a_disk_filled_mid_body_and_the_server_keeps_serving(
    store_on_disk: Store, five_mib_gguf: Path, tmp_path: Path
) -> None:
    store = store_on_disk
    body = five_mib_gguf.read_bytes()
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    server = LocalrtServer(store.root, tmp_path / "serve.log")
    filled: list[Path] = []

    def slow_body() -> Iterator[bytes]:
        for start in range(0, len(body), MiB):
            yield body[start : start + MiB]
            if start == MiB:  # two MiB sent: another writer takes the rest of the disk
                filled.append(fill(store.root.parent))

    try:
        answer = httpx.post(
            f"{server.url}/api/blobs/{digest}",
            content=slow_body(),
            timeout=60,
            headers={"Content-Length": str(len(body))},
        )
        assert answer.status_code == 507
        message = answer.json()["error"]
        # mid-body, as meant; or, where the client's body ran ahead of the server's check of the room (a
        # busy machine), refused before a byte was written: both name the place and the space
        assert re.fullmatch(
            re.escape(f"not enough disk space for {store.blobs}/")
            + r"\.incoming-\S+: need [\d.]+ MB more, have "
            r"[\d.]+ (KB|B) \(no space left on device; the partial file was removed\)"
            + "|"
            + re.escape("not enough disk space for ")
            + r"[\d.]+ MB in "
            + re.escape(f"{store.blobs}: ")
            + r"[\d.]+ (MB|KB|B) are free and the store keeps [\d.]+ (MB|KB|B) spare",
            message,
        ), message
        assert list(store.blobs.glob(".incoming-*")) == []
        assert httpx.head(f"{server.url}/api/blobs/{digest}").status_code == 404
        tags = httpx.get(f"{server.url}/api/tags").json()
        assert [m["name"] for m in tags["models"]] == ["other:latest"]
        for taken in filled:
            taken.unlink()
        again = httpx.post(f"{server.url}/api/blobs/{digest}", content=body, timeout=60)
        assert again.status_code == 201
        assert store.has_blob(digest)
        assert server.alive()
    finally:
        assert server.stop() in (0, -signal.SIGTERM)
    assert "Traceback" not in (tmp_path / "serve.log").read_text()
