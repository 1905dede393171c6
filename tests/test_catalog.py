"""The catalog (catalog/*.toml): validation with the file named, and `pull` trying each source in order."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from localrt.errors import PullError
from localrt.store.catalog import CatalogError
from localrt.store.catalog import load_catalog
from localrt.store.names import parse_name
from localrt.store.pull import pull
from localrt.store.sources.pypi import parse_pypi_url
from localrt.store.store import Store
from tests.conftest import SMOLLM2_MEMBER
from tests.conftest import SMOLLM2_SHA256
from tests.conftest import SMOLLM2_WHEEL_REQ
from tests.gguf_factory import write_tiny_llama
from tests.servers.hub import Hub
from tests.servers.registry import Registry


def test_packaged_catalog_is_valid() -> None:
    catalog = load_catalog()
    assert len(catalog) >= 1
    entry = catalog.find("SmolLM2:135M")  # names compare case-insensitively
    assert entry is not None
    assert entry.name == parse_name("smollm2:135m")
    assert entry.path == "smollm2.toml"
    assert [s.kind for s in entry.sources] == ["registry", "hf", "pypi"]
    # the catalog and the test fixture describe the same file
    assert entry.sha256 == f"sha256:{SMOLLM2_SHA256}"
    assert parse_pypi_url(entry.sources[2].url) == (SMOLLM2_WHEEL_REQ, SMOLLM2_MEMBER)
    assert entry.sources[1].file == SMOLLM2_MEMBER.rsplit("/", 1)[1]
    assert catalog.find("smollm2") is None  # smollm2:latest is another model on Ollama: no alias


GOOD = """
[model]
name = "tiny:1"
sha256 = "{sha}"
[[sources]]
url = "registry.example/library/tiny:1"
"""


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("[model\nname=", "invalid TOML"),
        ('[model]\nname = "tiny:1"\n', "at least one [[sources]]"),
        (GOOD.format(sha="abc"), "64 lowercase hex"),
        (GOOD.format(sha="0" * 64) + "colour = 1\n", "unknown key(s) colour"),
        (GOOD.format(sha="0" * 64).replace('"tiny:1"', '"../x"', 1), "invalid model name"),
        (GOOD.format(sha="0" * 64) + '[parameters]\nnum_ctx = "big"\n', "num_ctx"),
        (GOOD.format(sha="0" * 64) + 'file = "x.gguf"\n', "hf.co sources only"),
        (
            GOOD.format(sha="0" * 64).replace("registry.example/library/tiny:1", "pypi:--evil#x"),
            "invalid PyPI",
        ),
    ],
)
def test_bad_catalog_files_name_the_file(tmp_path: Path, text: str, fragment: str) -> None:
    (tmp_path / "broken.toml").write_text(text)
    with pytest.raises(CatalogError, match="catalog file broken.toml") as info:
        load_catalog(tmp_path)
    assert fragment in str(info.value)


def test_duplicate_names_are_refused(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text(GOOD.format(sha="0" * 64))
    (tmp_path / "b.toml").write_text(GOOD.format(sha="1" * 64).replace('"tiny:1"', '"TINY:1"', 1))
    with pytest.raises(CatalogError, match="(?i)b.toml: tiny:1 is already defined in a.toml"):
        load_catalog(tmp_path)


# ---- pull through the sources, in order ---------------------------------------------------------
@pytest.fixture
def servers(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Registry, Hub]]:
    with Registry() as registry, Hub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        yield registry, hub


def write_entry(folder: Path, sha: str, sources: list[str]) -> None:
    text = f'[model]\nname = "tiny:1"\nsha256 = "{sha}"\n'
    for source in sources:
        text += f"[[sources]]\n{source}\n"
    text += '[parameters]\ntemperature = 0.3\nstop = ["<|im_end|>"]\n'
    (folder / "tiny.toml").write_text(text)


def test_sources_are_tried_in_order_until_one_works(
    tmp_path: Path, models_dir: Path, servers: tuple[Registry, Hub]
) -> None:
    registry, hub = servers
    wanted = write_tiny_llama(tmp_path / "wanted.gguf", file_type="Q8_0")
    other = write_tiny_llama(tmp_path / "other.gguf", file_type="Q8_0", seed=7)
    sha = hashlib.sha256(wanted.read_bytes()).hexdigest()
    registry.add_model("library/tiny", "1", other.read_bytes())  # serves a different model
    hub.add_repo("org/tiny-GGUF", {"tiny.Q8_0.gguf": wanted})
    write_entry(
        tmp_path,
        sha,
        [
            'url = "127.0.0.1:9/library/tiny:1"',  # nothing listens there
            f'url = "{registry.address}/library/tiny:1"',
            'url = "hf.co/org/tiny-GGUF:Q8_0"',
        ],
    )
    store = Store(models_dir)
    name = pull("tiny:1", store=store, insecure=True, catalog=load_catalog(tmp_path))
    assert name == parse_name("tiny:1")
    resolved = store.resolve(name)
    assert hashlib.sha256(resolved.model_path.read_bytes()).hexdigest() == sha
    assert resolved.params == {"temperature": 0.3, "stop": ["<|im_end|>"]}
    # the registry's model layer was refused from its manifest alone: no blob was downloaded
    assert registry.seen("GET", "/manifests/")
    assert not registry.seen(contains="/blobs/")


def test_when_every_source_fails_the_error_lists_each(
    tmp_path: Path, models_dir: Path, servers: tuple[Registry, Hub]
) -> None:
    registry, _ = servers
    write_entry(
        tmp_path,
        "0" * 64,
        [
            'url = "127.0.0.1:9/library/tiny:1"',
            f'url = "{registry.address}/library/tiny:1"',
            'url = "hf.co/org/missing:Q8_0"',
        ],
    )
    with pytest.raises(PullError) as info:
        pull("tiny:1", store=Store(models_dir), insecure=True, catalog=load_catalog(tmp_path))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("cannot pull tiny:1: every source failed: ")
    reasons = message.split(": every source failed: ", 1)[1].split("; ")
    assert len(reasons) == 3
    assert reasons[0].startswith("127.0.0.1:9/library/tiny:1: cannot reach 127.0.0.1:9")
    assert reasons[1].startswith(
        f"{registry.address}/library/tiny:1: pull model manifest: file does not exist"
    )
    assert reasons[2].startswith("hf.co/org/missing:Q8_0: hf.co/org/missing not found")
    assert Store(models_dir).list_models() == []
