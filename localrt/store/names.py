"""Model references: `[host[:port]/][namespace/]model[:tag][@sha256:<hex>]` and `hf.co/org/repo[:QUANT]`.

Every part is validated against Ollama's character rules before it becomes a path in the store,
so a name can never climb out of `manifests/` ("..", separators, NUL, drive letters).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

from localrt.errors import InvalidName

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
HF_HOSTS = ("hf.co", "huggingface.co")

# Each part becomes one directory name in the store, which filesystems cap at 255 bytes: a longer host
# (Ollama allows 350) could only fail later as an OSError, so it is refused here with the name.
_HOST = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9\-_.:]{0,253}$")
_NAMESPACE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9\-_.]{0,79}$")
_MODEL = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9\-_.]{0,79}$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9\-_.]{0,79}$")
DIGEST_RE = re.compile(r"^sha256[:-]([0-9a-f]{64})$")


def normalize_digest(digest: str) -> str:
    """`sha256:<hex>` or `sha256-<hex>` -> `sha256:<hex>`; anything else is an InvalidName."""
    m = DIGEST_RE.match(digest or "")
    if not m:
        raise InvalidName(f"invalid digest {digest!r}: expected sha256:<64 lowercase hex digits>")
    return "sha256:" + m.group(1)


@dataclass(frozen=True)
class ModelName:
    host: str
    namespace: str
    model: str
    tag: str
    digest: str | None = None

    @property
    def is_hf(self) -> bool:
        return self.host.lower() in HF_HOSTS

    @property
    def manifest_parts(self) -> tuple[str, str, str, str]:
        return (self.host, self.namespace, self.model, self.tag)

    @property
    def display(self) -> str:
        """The short form `ollama list` prints: defaults are dropped."""
        if self.host == DEFAULT_HOST and self.namespace == DEFAULT_NAMESPACE:
            return f"{self.model}:{self.tag}"
        if self.host == DEFAULT_HOST:
            return f"{self.namespace}/{self.model}:{self.tag}"
        return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"

    @property
    def repository(self) -> str:
        return f"{self.namespace}/{self.model}"

    def with_tag(self, tag: str) -> ModelName:
        return ModelName(self.host, self.namespace, self.model, tag, self.digest)

    def __str__(self) -> str:
        return self.display + (f"@{self.digest}" if self.digest else "")

    def manifest_relpath(self) -> PurePosixPath:
        return PurePosixPath(*self.manifest_parts)

    def same_model(self, other: ModelName) -> bool:
        """Names compare case-insensitively, as Ollama's do."""
        return all(a.lower() == b.lower() for a, b in zip(self.manifest_parts, other.manifest_parts))


def _check(part: str, pattern: re.Pattern[str], what: str, full: str) -> str:
    if not pattern.match(part) or ".." in part:
        raise InvalidName(f"invalid model name {full!r}: bad {what} {part!r}")
    return part


def parse_name(text: str) -> ModelName:
    """Parse and validate a model reference; raise InvalidName with the reason."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidName("model name is empty")
    full = text.strip()
    if len(full) > 600 or any(c in full for c in "\\\0 \t\n"):
        raise InvalidName(f"invalid model name {full!r}")
    rest, digest = full, None
    if "@" in rest:
        rest, _, raw_digest = rest.partition("@")
        digest = normalize_digest(raw_digest)
    parts = rest.split("/")
    if any(p == "" for p in parts) or len(parts) > 3:
        raise InvalidName(f"invalid model name {full!r}: expected [host/][namespace/]model[:tag]")

    host, namespace = DEFAULT_HOST, DEFAULT_NAMESPACE
    if len(parts) == 3:
        host, namespace, last = parts
    elif len(parts) == 2:
        # "hf.co/org" is not a model; a first part with a dot or port is a host, as in Ollama.
        if parts[0].lower() in HF_HOSTS:
            raise InvalidName(f"invalid model name {full!r}: expected hf.co/<org>/<repo>[:QUANT]")
        namespace, last = parts
    else:
        last = parts[0]

    model, sep, tag = last.partition(":")
    if not sep:
        tag = DEFAULT_TAG
    _check(host, _HOST, "host", full)
    _check(namespace, _NAMESPACE, "namespace", full)
    _check(model, _MODEL, "model", full)
    _check(tag, _TAG, "tag", full)
    if host.lower() == "huggingface.co":
        host = "hf.co"
    return ModelName(host, namespace, model, tag, digest)
