"""The package layout: every package folder is installed under `localrt.*`."""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {
    "localrt": "localrt",
    "backends": "localrt.backends",
    "converters": "localrt.converters",
    "tui": "localrt.tui",
    "catalog": "localrt.catalog",
}


def test_every_package_folder_is_listed() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for top, dotted in MAPPED.items():
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top).parts
            found.add(".".join((dotted, *rel)))
    assert found == listed, f"pyproject packages differ: missing {found - listed}, stale {listed - found}"


def test_top_level_layout() -> None:
    for entry in (
        "pyproject.toml",
        "README.md",
        "localrt",
        "backends",
        "converters",
        "tui",
        "tests",
        "catalog",
    ):
        assert (ROOT / entry).exists(), entry


def test_installed_names_do_not_leak() -> None:
    import localrt.backends
    import localrt.catalog
    import localrt.converters
    import localrt.tui

    assert Path(localrt.backends.__file__).parent == ROOT / "backends"
    assert Path(localrt.catalog.__file__).parent == ROOT / "catalog"
    assert localrt.converters
    assert localrt.tui
