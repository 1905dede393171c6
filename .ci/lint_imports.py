"""`lint-imports` on the installed layout of the package.

pyproject maps `backends/`, `converters/`, `tui/` and `catalog/` into `localrt.*` (package-dir), which an
editable install resolves at import time but import-linter's graph builder cannot see: it reads the
`localrt/` folder only. So this copies the sources into a temporary tree shaped as site-packages
would hold them and runs `lint-imports` there with the repository's contracts (pyproject.toml).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    config = ROOT / "pyproject.toml"
    with open(config, "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    tool = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if tool is None:
        print("lint-imports is not installed: pip install -e '.[test]'", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="localrt-imports-") as tmp:
        # "localrt" first (dict order), then the folders that install inside it
        for package, folder in mapping.items():
            shutil.copytree(
                ROOT / folder,
                Path(tmp, *package.split(".")),
                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
                dirs_exist_ok=True,
            )
        return subprocess.call([tool, str(config), "--no-cache"], cwd=tmp)


if __name__ == "__main__":
    sys.exit(main())
