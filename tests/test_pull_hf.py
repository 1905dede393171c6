"""`pull hf.co/org/repo[:QUANT]` through the real `huggingface_hub` client against a local Hub (tests/servers/hub.py)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from localrt.errors import DigestMismatch
from localrt.errors import LocalrtError
from localrt.errors import ModelNotFound
from localrt.errors import PullError
from localrt.store.gguf import read_gguf
from localrt.store.pull import Progress
from localrt.store.pull import pull
from localrt.store.sources.hf import pick_gguf
from localrt.store.store import Store
from tests.gguf_factory import write_tiny_llama
from tests.servers.hub import Hub

REPO = "tiny-org/Tiny-Llama-GGUF"


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two real (tiny, random-weight) GGUFs of different file types, named like a Hub GGUF repo."""
    root = tmp_path_factory.mktemp("ggufs")
    return {
        "Tiny-Llama.Q8_0.gguf": write_tiny_llama(root / "q8.gguf", file_type="Q8_0"),
        "Tiny-Llama.Q4_K_M.gguf": write_tiny_llama(root / "q4.gguf", file_type="Q4_0", seed=1),
    }


@pytest.fixture
def hub(ggufs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> Iterator[Hub]:
    with Hub() as server:
        server.add_repo(REPO, {**ggufs, "README.md": b"# tiny\n"})
        monkeypatch.setenv("HF_ENDPOINT", server.url)  # read at call time, after huggingface_hub's import
        yield server


@pytest.fixture
def store(models_dir: Path) -> Store:
    return Store(models_dir)


def sha256_of(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def test_pull_picks_the_quant_case_insensitively(hub: Hub, store: Store, ggufs: dict[str, Path]) -> None:
    events: list[Progress] = []
    name = pull(f"hf.co/{REPO}:q8_0", store=store, progress=events.append)
    assert name.display == f"hf.co/{REPO}:q8_0"
    source = ggufs["Tiny-Llama.Q8_0.gguf"]
    resolved = store.resolve(name)
    assert sha256_of(resolved.model_path) == sha256_of(source)
    assert resolved.config["file_type"] == read_gguf(source).file_type
    assert resolved.config["model_format"] == "gguf"
    assert resolved.config["architecture"] == "llama"
    # huggingface_hub really talked to our endpoint: the listing, then the file
    assert hub.seen("GET", f"/api/models/{REPO}")
    assert hub.seen("GET", "/resolve/")
    assert hub.seen("GET", "Tiny-Llama.Q8_0.gguf")
    statuses = [e.status for e in events]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == [
        "verifying sha256 digest",
        "writing manifest",
        "success",
    ]
    digest = sha256_of(source)
    assert any(e.status == f"pulling {digest[7:19]}" and e.completed == source.stat().st_size for e in events)


def test_latest_means_q4_k_m(hub: Hub, store: Store, ggufs: dict[str, Path]) -> None:
    name = pull(f"hf.co/{REPO}", store=store)
    assert name.tag == "latest"
    assert sha256_of(store.resolve(name).model_path) == sha256_of(ggufs["Tiny-Llama.Q4_K_M.gguf"])


def test_unknown_quant_lists_the_files(hub: Hub, store: Store, ggufs: dict[str, Path]) -> None:
    with pytest.raises(ModelNotFound) as info:
        pull(f"hf.co/{REPO}:Q5_K_S", store=store)
    message = str(info.value)
    assert "Q5_K_S" in message
    assert all(f in message for f in ggufs)
    assert store.list_models() == []


def test_missing_repo_is_not_found(hub: Hub, store: Store) -> None:
    with pytest.raises(ModelNotFound, match="not found"):
        pull("hf.co/tiny-org/nothing-here:Q8_0", store=store)


def test_hub_sha256_is_verified(hub: Hub, store: Store) -> None:
    hub.repos[REPO].files["Tiny-Llama.Q8_0.gguf"].listed_sha256 = "0" * 64
    with pytest.raises(DigestMismatch, match="digest mismatch"):
        pull(f"hf.co/{REPO}:Q8_0", store=store)
    assert store.list_models() == []
    assert [p.name for p in store.blobs.iterdir()] == []
    assert [p for p in store.root.iterdir() if p.name.startswith(".hf-")] == []  # scratch folder removed


def test_unreachable_hub_fails_fast(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(PullError, match="cannot reach 127.0.0.1:9"):
        pull(f"hf.co/{REPO}:Q8_0", store=store)


@pytest.mark.parametrize(
    "files, quant, expected",
    [
        (["m.Q4_K_M.gguf", "m.Q4_K_S.gguf"], "q4_k_s", "m.Q4_K_S.gguf"),
        (["m-F16.gguf", "m-BF16.gguf"], "F16", "m-F16.gguf"),  # F16 is not BF16
        (["m-BF16.gguf", "m.Q8_0.gguf"], "bf16", "m-BF16.gguf"),
        (["mmproj-Q8_0.gguf", "m.Q8_0.gguf"], "Q8_0", "m.Q8_0.gguf"),  # the vision projector is not a model
        (["b.Q8_0.gguf", "a.Q2_K.gguf"], "latest", "a.Q2_K.gguf"),  # no Q4_K_M: the first file
        (["x.Q4_K_M.gguf", "x.Q8_0.gguf", "README.md"], "latest", "x.Q4_K_M.gguf"),
        # a split model is named by its first part
        (["m.Q8_0-00002-of-00002.gguf", "m.Q8_0-00001-of-00002.gguf"], "Q8_0", "m.Q8_0-00001-of-00002.gguf"),
    ],
)
def test_pick_gguf(files: list[str], quant: str, expected: str) -> None:
    assert pick_gguf(files, quant, "o/r") == expected


@pytest.mark.parametrize(
    "files, quant, fragment",
    [
        (["m.Q4_K_M.gguf", "m.Q4_K_S.gguf"], "Q4_K", "ambiguous"),
        (["README.md"], "Q8_0", "no .gguf files"),
    ],
)
def test_pick_gguf_errors(files: list[str], quant: str, fragment: str) -> None:
    with pytest.raises(LocalrtError, match=fragment):
        pick_gguf(files, quant, "o/r")
