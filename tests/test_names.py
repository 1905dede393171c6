"""Model references: defaults, Hugging Face names, digests, and everything that must be refused."""

from __future__ import annotations

import pytest

from localrt.errors import InvalidName
from localrt.store.names import DEFAULT_HOST
from localrt.store.names import normalize_digest
from localrt.store.names import parse_name

HEX = "a" * 64


@pytest.mark.parametrize(
    "text, parts",
    [
        ("smollm2", (DEFAULT_HOST, "library", "smollm2", "latest")),
        ("smollm2:135m", (DEFAULT_HOST, "library", "smollm2", "135m")),
        ("me/my-model:v1.2", (DEFAULT_HOST, "me", "my-model", "v1.2")),
        ("127.0.0.1:5000/library/smollm2:135m", ("127.0.0.1:5000", "library", "smollm2", "135m")),
        (
            "hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M",
            ("hf.co", "bartowski", "SmolLM2-135M-Instruct-GGUF", "Q4_K_M"),
        ),
        ("huggingface.co/org/repo", ("hf.co", "org", "repo", "latest")),
    ],
)
def test_parse_defaults_and_forms(text: str, parts: tuple[str, str, str, str]) -> None:
    name = parse_name(text)
    assert name.manifest_parts == parts
    assert name.is_hf == (parts[0] == "hf.co")


def test_display_drops_defaults() -> None:
    assert parse_name("registry.ollama.ai/library/smollm2:135m").display == "smollm2:135m"
    assert parse_name("me/m").display == "me/m:latest"
    assert parse_name("hf.co/o/r:Q4_0").display == "hf.co/o/r:Q4_0"


def test_digest_forms() -> None:
    name = parse_name(f"smollm2:135m@sha256-{HEX}")
    assert name.digest == f"sha256:{HEX}"
    assert normalize_digest(f"sha256:{HEX}") == f"sha256:{HEX}"


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "   ",
        "../etc/passwd",
        "a/../b",
        "lib/..:x",
        "model:..",
        "a/b/c/d",
        "/abs",
        "a//b",
        "model:tag:extra",
        "mo del",
        "a\\b",
        "a\0b",
        "-leading",
        ".hidden",
        "hf.co/onlyorg",
        f"m@sha256:{'A' * 64}",
        "m@sha256:../../x",
        "m@md5:" + "a" * 32,
        f"m@sha256:{HEX}0",
        "x" * 81,
        "m:" + "t" * 81,
    ],
)
def test_rejects_bad_names(bad: str) -> None:
    with pytest.raises(InvalidName):
        parse_name(bad)


def test_case_insensitive_match() -> None:
    assert parse_name("SmolLM2:135M").same_model(parse_name("smollm2:135m"))
    assert not parse_name("smollm2:135m").same_model(parse_name("smollm2:360m"))
