"""Every relative link and every repository path named in README.md, CHANGELOG.md, benchmarks/README.md and
docs/*.md exists: a page that points at a moved or deleted file fails CI instead of misleading a reader.

Links (`[text](path)`, `![alt](path)`) are relative to the page; anchors are not checked. Paths in inline
code (`tests/test_x.py::name`, `python benchmarks/bench_serve.py --flags`) are relative to the repository
root and checked when their first part is a top-level entry of the repository; `*` matches as a glob.
Exits 1 and prints one line per broken reference.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^\s*(```|~~~)")
EXTERNAL = ("http://", "https://", "mailto:", "#")


def pages(root: Path) -> list[Path]:
    found = [root / "README.md", root / "CHANGELOG.md", root / "benchmarks" / "README.md"]
    found += sorted((root / "docs").glob("*.md"))
    return [p for p in found if p.is_file()]


def top_level(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.name not in (".git",)}


def exists(root: Path, rel: str) -> bool:
    if "*" in rel:
        return any(root.glob(rel))
    return (root / rel).exists()


def path_tokens(span: str, tops: set[str]) -> Iterator[str]:
    """The tokens of one inline code span that name a repository path."""
    for token in span.split():
        token = token.strip("\"'(),;")
        token = token.split("::", 1)[0]
        token = re.sub(r":\d+$", "", token)  # path:line
        first = token.split("/", 1)[0]
        if first in tops and ("/" in token or token == first and "." in first):
            yield token.rstrip(".")


def broken_references(page: Path, root: Path) -> Iterator[str]:
    tops = top_level(root)
    in_fence = False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        where = f"{page.relative_to(root)}:{number}"
        for target in LINK.findall(line):
            if target.startswith(EXTERNAL):
                continue
            rel = target.split("#", 1)[0]
            if rel and not (page.parent / rel).exists():
                yield f"{where}: broken link {target}"
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        for span in CODE_SPAN.findall(line):
            for rel in path_tokens(span, tops):
                if not exists(root, rel):
                    yield f"{where}: no such path `{rel}`"


def main(argv: list[str]) -> int:
    root = Path(argv[1]).resolve() if len(argv) > 1 else ROOT
    problems = [problem for page in pages(root) for problem in broken_references(page, root)]
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print(f"check_links: {len(problems)} broken reference(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
