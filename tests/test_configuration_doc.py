"""docs/configuration.md and the source agree with the table of variables in localrt/config.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from localrt import config

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("localrt", "backends", "converters", "tui")
# `localrt launch` sets this one for the agents it starts (their configs name it); localrt never reads it.
SET_FOR_AGENTS = {"LOCALRT_AGENT_KEY"}


def test_the_page_is_what_the_table_renders() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert page == config.configuration_markdown(), "run: python -m localrt.config"


def test_every_variable_the_source_names_is_in_the_table() -> None:
    named = {
        name
        for folder in SOURCE_DIRS
        for path in (ROOT / folder).rglob("*.py")
        for name in re.findall(r"\bLOCALRT_[A-Z][A-Z0-9_]*", path.read_text(encoding="utf-8"))
    }
    assert sorted(named - SET_FOR_AGENTS - set(config.BY_NAME)) == []


def test_only_the_table_reads_the_environment() -> None:
    """Every variable is read through localrt/config.py: no other module of the package reads the
    environment itself (a variable named by the user, such as a remote model's key, included)."""
    readers = sorted(
        str(path.relative_to(ROOT))
        for folder in SOURCE_DIRS
        for path in (ROOT / folder).rglob("*.py")
        if path != ROOT / "localrt" / "config.py"
        and re.search(
            r"\bos\.environ\b|\bgetenv\(|\bfrom os import environ\b", path.read_text(encoding="utf-8")
        )
    )
    assert readers == []


def test_load_variables_are_part_of_the_load_key(monkeypatch: pytest.MonkeyPatch) -> None:
    loads = [v.name for v in config.VARIABLES if v.load]
    assert "LOCALRT_BATCH_INVARIANT" in loads
    for name in loads:
        monkeypatch.delenv(name, raising=False)
    before = config.load_key()
    for name in loads:
        monkeypatch.setenv(name, "2")
        assert config.load_key() != before, name
        monkeypatch.delenv(name)
