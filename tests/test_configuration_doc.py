"""docs/configuration.md and the source agree with the table of variables in localrt/config.py."""

from __future__ import annotations

import re
from pathlib import Path

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
