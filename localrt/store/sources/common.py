"""What every pull source shares: the progress event, digests as catalogs write them, disk-space checks.

The sources (`oci`, `hf`, `pypi`) import this module and `pull` imports the sources, so nothing here
imports `pull` back.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass

from localrt.errors import LocalrtError
from localrt.errors import PullError
from localrt.format import format_bytes
from localrt.store.names import normalize_digest
from localrt.store.store import Store
from localrt.store.store import free_space


@dataclass
class Progress:
    """One pull progress event, shaped like Ollama's `/api/pull` stream."""

    status: str
    digest: str | None = None
    total: int | None = None
    completed: int | None = None


ProgressFn = Callable[[Progress], None]


def as_digest(value: str) -> str:
    """A sha256 as catalogs write it (bare hex or `sha256:<hex>`) -> `sha256:<hex>` (InvalidName if malformed)."""
    return normalize_digest(value if value.startswith("sha256") else f"sha256:{value}")


def check_free_space(store: Store, needed: int) -> None:
    """Fail before writing when the blobs folder's filesystem cannot hold `needed` more bytes."""
    have = free_space(store.blobs)
    if needed > have:
        raise PullError(f"not enough disk space: need {format_bytes(needed)}, have {format_bytes(have)}")


def disk_full(store: Store, needed: int, err: OSError) -> LocalrtError | None:
    """ENOSPC while writing -> the same clear error as the up-front check; None for other errors."""
    if err.errno != errno.ENOSPC:
        return None
    have = free_space(store.blobs)
    return PullError(
        f"not enough disk space: need {format_bytes(needed)}, have {format_bytes(have)} "
        "(no space left on device; the partial download is kept for resuming)"
    )
