"""Split GGUF files: parts made by llama.cpp's own `llama-gguf-split`, taken by `create` (from the first
part) and by `pull hf.co/...` (every part, from the local Hub stand-in), merged into one blob that is the
file they were split from, and answering as that file does."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import ollama
import pytest

from localrt.runtime.front import Runtime
from localrt.store.gguf import GGUFError
from localrt.store.importer import import_gguf
from localrt.store.modelfile import create
from localrt.store.pull import pull
from localrt.store.split import SplitError
from localrt.store.split import merge_parts
from localrt.store.split import series_names
from localrt.store.store import MEDIA_MODEL
from localrt.store.store import Store
from tests.conftest import async_test
from tests.fixtures_hf import CACHE
from tests.fixtures_hf import llama_cpp_tools
from tests.gguf_factory import write_tiny_llama
from tests.servers.hub import Hub
from tests.servers.serve import LocalrtServer

REPO = "tiny-org/Split-Llama-GGUF"
PARTS = 3


def gguf_split_tool() -> Path:
    """llama.cpp's llama-gguf-split, built as one more target of the shared tools build (same lock)."""
    from filelock import FileLock

    bin_dir = llama_cpp_tools()
    tool = bin_dir / "llama-gguf-split"
    if tool.is_file():
        return tool
    with FileLock(str(CACHE / "llama.cpp-tools.lock")):
        if not tool.is_file():
            build = bin_dir.parent
            cmd = [
                "cmake",
                "--build",
                str(build),
                "-j",
                str(os.cpu_count() or 2),
                "--target",
                "llama-gguf-split",
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"building llama-gguf-split failed:\n{proc.stderr[-2000:]}")
    return tool


def sha256_of(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("whole") / "tiny.gguf", file_type="F32", seed=7)


def split_with_gguf_py(whole: Path, out: Path) -> None:
    """The same split through llama.cpp's gguf-py, whose writer makes split files itself (what
    convert_hf_to_gguf.py --split-max-tensors writes): every key and tensor of `whole` written again."""
    import gguf

    reader = gguf.GGUFReader(whole)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(out / "Tiny.F32.gguf", arch, split_max_tensors=8)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[1] if len(f.types) > 1 else None
        writer.add_key_value(name, f.contents(), f.types[0], sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def split_tool_ready() -> bool:
    """llama.cpp's tools are built: then llama-gguf-split is one more target of that build."""
    from tests.fixtures_hf import LLAMA_CPP_TOOLS

    bin_dir = CACHE / "llama.cpp-tools" / "build" / "bin"
    return all((bin_dir / tool).is_file() for tool in LLAMA_CPP_TOOLS)


@pytest.fixture(scope="module")
def parts(whole: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The whole file split into three parts of at most 8 tensors: by llama-gguf-split when llama.cpp's
    tools are built, else by gguf-py's split writer (the same format, from the same sources)."""
    out = tmp_path_factory.mktemp("parts")
    if split_tool_ready():
        cmd = [
            str(gguf_split_tool()),
            "--split",
            "--split-max-tensors",
            "8",
            str(whole),
            str(out / "Tiny.F32"),
        ]
        subprocess.run(cmd, check=True, capture_output=True)
    else:
        split_with_gguf_py(whole, out)
    found = sorted(out.glob("*.gguf"))
    assert [p.name for p in found] == series_names(f"Tiny.F32-00001-of-{PARTS:05d}.gguf")
    return found


@pytest.fixture
def store(models_dir: Path) -> Store:
    return Store(models_dir)


@pytest.fixture
def copied(parts: list[Path], tmp_path: Path) -> list[Path]:
    """The parts in a folder of the test's own, to damage."""
    return [Path(shutil.copy(p, tmp_path / p.name)) for p in parts]


# ---- names -------------------------------------------------------------------------------------------
def test_series_names_follow_llama_cpps_pattern() -> None:
    assert series_names("m/Q4-00001-of-00002.gguf") == [
        "m/Q4-00001-of-00002.gguf",
        "m/Q4-00002-of-00002.gguf",
    ]


def test_a_later_part_names_the_first() -> None:
    with pytest.raises(SplitError, match="give the first part, m-00001-of-00003.gguf"):
        series_names("m-00002-of-00003.gguf")


# ---- merging --------------------------------------------------------------------------------------------
def test_merged_parts_are_the_file_they_were_split_from(parts: list[Path], whole: Path) -> None:
    out = io.BytesIO()
    merge_parts(parts, out.write)
    assert "sha256:" + hashlib.sha256(out.getvalue()).hexdigest() == sha256_of(whole)


def test_create_from_the_first_part_stores_one_merged_blob(
    parts: list[Path], whole: Path, store: Store
) -> None:
    name = create("split:model", from_path=parts[0], store=store)
    manifest, _ = store.read_manifest(name)
    models = [layer for layer in manifest["layers"] if layer["mediaType"] == MEDIA_MODEL]
    assert [m["digest"] for m in models] == [sha256_of(whole)]


def test_a_missing_part_is_named(copied: list[Path], store: Store) -> None:
    copied[1].unlink()
    with pytest.raises(SplitError, match=f"missing part\\(s\\) {copied[1].name}"):
        create("split:model", from_path=copied[0], store=store)


def test_every_part_goes_through_the_bounded_reader(copied: list[Path], store: Store) -> None:
    data = copied[2].read_bytes()
    copied[2].write_bytes(data[: len(data) // 2])
    with pytest.raises(GGUFError, match=f"^split GGUF part {copied[2].name}: "):
        create("split:model", from_path=copied[0], store=store)


def test_parts_out_of_order_are_refused(copied: list[Path], store: Store) -> None:
    second, third = copied[1], copied[2]
    swap = second.with_name("swap")
    second.rename(swap)
    third.rename(second)
    swap.rename(third)
    with pytest.raises(SplitError, match=f"part {second.name} says it is part 2 of 3, not 1 of 3"):
        create("split:model", from_path=copied[0], store=store)


def test_a_lone_part_blob_is_not_a_model(parts: list[Path], store: Store) -> None:
    digest, _ = store.add_blob_file(parts[0])
    with pytest.raises(SplitError, match="is part 1 of 3 of a split model"):
        import_gguf(store, "lone:part", digest)


def test_cli_create_names_a_missing_part_in_one_line(copied: list[Path], tmp_path: Path) -> None:
    copied[2].unlink()
    env = {**os.environ, "LOCALRT_MODELS": str(tmp_path / "models")}
    proc = subprocess.run(
        [sys.executable, "-m", "localrt", "create", "x", "--from", str(copied[0])],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        f"Error: split GGUF {copied[0].name}: missing part(s) {copied[2].name} beside it"
    ]


# ---- pull from the Hub stand-in ------------------------------------------------------------------------
@pytest.fixture
def hub(parts: list[Path], monkeypatch: pytest.MonkeyPatch) -> Iterator[Hub]:
    with Hub() as server:
        server.add_repo(REPO, {**{p.name: p for p in parts}, "README.md": b"# split\n"})
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server


def test_pull_takes_every_part_and_keeps_one_blob(
    hub: Hub, store: Store, parts: list[Path], whole: Path
) -> None:
    name = pull(f"hf.co/{REPO}:F32", store=store)
    assert store.resolve(name).model_path.name == sha256_of(whole).replace(":", "-")
    assert [p.name for p in parts if hub.seen("GET", p.name)] == [p.name for p in parts]
    assert not [p for p in parts if store.has_blob(sha256_of(p))]  # the parts went once merged


def test_an_interrupted_pull_resumes_from_the_parts_it_has(hub: Hub, store: Store, parts: list[Path]) -> None:
    store.add_blob_file(parts[0])  # what a pull stopped after its first part left behind
    pull(f"hf.co/{REPO}:F32", store=store)
    assert [p.name for p in parts if hub.seen("GET", p.name)] == [p.name for p in parts[1:]]


@pytest.mark.parametrize("backend", ["llama.cpp", "torch", "mlx"])
@async_test
async def test_pulled_split_model_answers_as_the_whole_file(
    hub: Hub, store: Store, whole: Path, backend: str
) -> None:
    import_gguf(store, "whole:latest", whole)
    name = pull(f"hf.co/{REPO}:F32", store=store)
    runtime = Runtime(store)
    greedy = {"temperature": 0, "num_predict": 8, "backend": backend}
    try:
        answers = []
        for model in ("whole:latest", name.display):
            async for chunk in runtime.generate(model, "Hello there", options=greedy, stream=False):
                answers.append(chunk.context)
    finally:
        await runtime.pool.close()
    assert answers[0] == answers[1]


# ---- over the server's create API ---------------------------------------------------------------------
@pytest.fixture
def server(tmp_path: Path) -> Iterator[LocalrtServer]:
    srv = LocalrtServer(tmp_path / "models", tmp_path / "serve.log")
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)
    assert "Traceback" not in srv.log_path.read_text(errors="replace")


def test_ollama_client_creates_from_uploaded_parts(
    server: LocalrtServer, parts: list[Path], whole: Path
) -> None:
    client = ollama.Client(host=server.url)
    files = {p.name: client.create_blob(p) for p in parts}
    client.create("split:client", files=files)
    assert Store(server.env["LOCALRT_MODELS"]).resolve("split:client").model_path.name == sha256_of(
        whole
    ).replace(":", "-")


def test_uploaded_parts_with_one_missing_are_a_400_naming_it(
    server: LocalrtServer, parts: list[Path]
) -> None:
    client = ollama.Client(host=server.url)
    files = {p.name: client.create_blob(p) for p in parts[:2]}
    with pytest.raises(ollama.ResponseError) as err:
        client.create("split:broken", files=files)
    assert err.value.status_code == 400
    assert err.value.error == f"split GGUF {parts[0].name}: missing part(s) {parts[2].name}"


def test_cli_create_through_a_server_uploads_every_part(
    server: LocalrtServer, parts: list[Path], whole: Path
) -> None:
    env = {**os.environ, "LOCALRT_HOST": server.url.removeprefix("http://"), "LOCALRT_MODELS": "/nonexistent"}
    proc = subprocess.run(
        [sys.executable, "-m", "localrt", "create", "split:cli", "--from", str(parts[0])],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    model = Store(server.env["LOCALRT_MODELS"]).resolve("split:cli").model_path
    assert model.name == sha256_of(whole).replace(":", "-")
