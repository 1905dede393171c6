"""Modelfile parsing and `create`: from a GGUF file with overrides, from a stored model, and the errors."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from localrt.errors import LocalrtError
from localrt.errors import ModelNotFound
from localrt.store.gguf import format_parameter_count
from localrt.store.gguf import read_gguf
from localrt.store.modelfile import ModelfileError
from localrt.store.modelfile import create
from localrt.store.modelfile import parse_modelfile
from localrt.store.names import parse_name
from localrt.store.store import MEDIA_DRAFT
from localrt.store.store import MEDIA_MODEL
from localrt.store.store import Store
from tests.gguf_factory import write_tiny_llama

MODELFILE = '''# a comment, then keywords in any case
FROM ./weights/tiny.gguf
parameter temperature 0.4
PARAMETER num_ctx 128
PARAMETER stop "<|im_end|>"
PARAMETER stop </s>
PARAMETER use_mmap false
TEMPLATE """{{ bos_token }}{% for m in messages %}
{{ m.content }}
{% endfor %}"""
SYSTEM """
You are terse.
"""
LICENSE MIT
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("modelfile") / "weights"
    folder.mkdir()
    return write_tiny_llama(folder / "tiny.gguf", file_type="Q8_0")


@pytest.fixture
def store(models_dir: Path) -> Store:
    return Store(models_dir)


def digest_of(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def test_parse_modelfile_types_and_multiline_values() -> None:
    mf = parse_modelfile(MODELFILE)
    assert mf.from_ == "./weights/tiny.gguf"
    assert mf.from_line == 2
    assert mf.parameters == {
        "temperature": 0.4,
        "num_ctx": 128,
        "stop": ["<|im_end|>", "</s>"],
        "use_mmap": False,
    }
    assert mf.template == "{{ bos_token }}{% for m in messages %}\n{{ m.content }}\n{% endfor %}"
    assert mf.system == "You are terse."
    assert mf.license == "MIT"


def test_create_from_a_gguf_with_overrides(tiny: Path, store: Store) -> None:
    name = create("me/tiny:q8", modelfile_text=MODELFILE, store=store, base_dir=tiny.parent.parent)
    assert name == parse_name("me/tiny:q8")
    resolved = store.resolve(name)
    assert digest_of(resolved.model_path) == digest_of(tiny)
    expected = parse_modelfile(MODELFILE)
    assert (resolved.template, resolved.system, resolved.license) == (
        expected.template,
        expected.system,
        "MIT",
    )
    assert resolved.params == expected.parameters
    info = read_gguf(tiny)
    assert resolved.config["model_format"] == "gguf"
    assert resolved.config["file_type"] == info.file_type
    assert resolved.config["model_type"] == format_parameter_count(info.parameter_count)
    assert resolved.config["context_length"] == info.context_length
    assert [e.name for e in store.list_models()] == [name]


def test_create_with_from_path_only(tiny: Path, store: Store) -> None:
    name = create("plain", from_path=str(tiny), store=store)
    resolved = store.resolve(name)
    assert digest_of(resolved.model_path) == digest_of(tiny)
    assert resolved.template is None
    assert resolved.params == {}


def test_from_an_existing_model_inherits_and_overrides(tiny: Path, store: Store, tmp_path: Path) -> None:
    base = create("base", modelfile_text=MODELFILE, store=store, base_dir=tiny.parent.parent)
    draft = write_tiny_llama(tmp_path / "draft.gguf", file_type="F32", seed=3)
    derived = create(
        "derived",
        store=store,
        base_dir=tmp_path,
        modelfile_text=("FROM base\nSYSTEM You are verbose.\nPARAMETER temperature 1\nDRAFT draft.gguf\n"),
    )
    a, b = store.resolve(base), store.resolve(derived)
    assert a.model_path == b.model_path  # one blob, shared
    assert b.template == a.template
    assert b.license == a.license
    assert b.system == "You are verbose."
    assert b.params == {**a.params, "temperature": 1.0}
    assert b.draft_path is not None
    assert digest_of(b.draft_path) == digest_of(draft)
    layers, _ = store.read_manifest(derived)
    assert [layer["mediaType"] for layer in layers["layers"]][:2] == [MEDIA_MODEL, MEDIA_DRAFT]


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("FROM x.gguf\nPARAMETER temperature 0.1\nFROB 1\n", "Modelfile line 3: unknown instruction 'FROB'"),
        ('FROM x.gguf\n\nTEMPLATE """never closed\n{{ x }}\n', 'Modelfile line 3: TEMPLATE opens """'),
        (
            "# c\nFROM x.gguf\nPARAMETER num_ctx lots\n",
            "Modelfile line 3: parameter num_ctx expects an integer",
        ),
        ("FROM x.gguf\nPARAMETER temperature\n", "Modelfile line 2: PARAMETER needs a name and a value"),
        ("FROM a.gguf\nFROM b.gguf\nFROM c.gguf\n", "Modelfile line 3: a third FROM (a model takes one GGUF"),
        ("FROM x.gguf\nADAPTER\n", "Modelfile line 2: ADAPTER needs a value"),
        ('FROM x.gguf\nSYSTEM "unterminated\n', "Modelfile line 2: unterminated quote"),
        ("PARAMETER temperature 1\n", "no FROM line"),
    ],
)
def test_modelfile_errors_name_the_line(text: str, fragment: str, store: Store) -> None:
    with pytest.raises(ModelfileError) as info:
        create("x", modelfile_text=text, store=store)
    assert fragment in str(info.value)


def test_from_errors_are_clear(tmp_path: Path, store: Store) -> None:
    with pytest.raises(LocalrtError, match="Modelfile line 2: model file not found: ./missing.gguf"):
        create("x", modelfile_text="# weights\nFROM ./missing.gguf\n", store=store, base_dir=tmp_path)
    with pytest.raises(ModelNotFound, match="Modelfile line 1: model 'nothing:1' not found"):
        create("x", modelfile_text="FROM nothing:1\n", store=store, base_dir=tmp_path)
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"PK\x03\x04 not a gguf" * 8)
    with pytest.raises(LocalrtError, match="is not a GGUF file"):
        create("x", from_path=str(bogus), store=store)
    with pytest.raises(LocalrtError, match="is a folder, not a GGUF file"):
        create("x", from_path=str(tmp_path), store=store)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(LocalrtError):
        create("x", from_path=str(truncated), store=store)
    assert store.list_models() == []
    assert not store.blobs.exists() or list(store.blobs.iterdir()) == []


def test_create_quantize_requantizes_an_f32_source(tmp_path: Path, store: Store) -> None:
    f32 = write_tiny_llama(tmp_path / "f32.gguf", file_type="F32")
    name = create("tiny:q8", from_path=str(f32), store=store, quantize="Q8_0")
    model = store.resolve(name)
    assert read_gguf(model.model_path).file_type == "Q8_0"
    assert model.model_path.stat().st_size < f32.stat().st_size / 2
    assert not any(p.name.startswith(".quantize-") for p in store.root.iterdir())  # temp folder gone


def test_create_quantize_refuses_a_quantized_source(tiny: Path, store: Store) -> None:
    with pytest.raises(LocalrtError):
        create("x", from_path=str(tiny), store=store, quantize="Q4_K_M")
    assert not store.exists(parse_name("x"))
