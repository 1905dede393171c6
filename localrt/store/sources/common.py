"""What every pull source shares: the progress event, digests as catalogs write them, disk-space checks.

The sources (`oci`, `hf`, `pypi`) import this module and `pull` imports the sources, so nothing here
imports `pull` back.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from localrt.errors import LocalrtError
from localrt.format import format_bytes
from localrt.store.names import normalize_digest
from localrt.store.store import StorageFull
from localrt.store.store import Store
from localrt.store.store import disk_full
from localrt.store.store import free_space


@dataclass
class Progress:
    """One pull progress event, shaped like Ollama's `/api/pull` stream."""

    status: str
    digest: str | None = None
    total: int | None = None
    completed: int | None = None


ProgressFn = Callable[[Progress], None]


PROGRESS_STEP = 0.01  # of a layer's size: finer byte counts are merged into the next event
PROGRESS_INTERVAL_S = 0.25  # and at least this long apart, unless the layer is done


def coalesce(emit: ProgressFn) -> ProgressFn:
    """`emit` for a pull's progress with the byte counts of each layer thinned to about a hundred
    events (and a few a second): a consumer that reads slowly (an HTTP client behind a queue) is
    handed a bounded number of events however small the blocks arrive. Other events pass as they come."""
    last: dict[str, tuple[int, float]] = {}

    def out(event: Progress) -> None:
        if event.digest is None or not event.total or event.completed is None:
            emit(event)
            return
        now = time.monotonic()
        before = last.get(event.digest)
        if (
            before is None
            or event.completed >= event.total
            or event.completed < before[0]  # a restart from scratch
            or event.completed - before[0] >= event.total * PROGRESS_STEP
            and now - before[1] >= PROGRESS_INTERVAL_S
        ):
            last[event.digest] = (event.completed, now)
            emit(event)

    return out


def as_digest(value: str) -> str:
    """A sha256 as catalogs write it (bare hex or `sha256:<hex>`) -> `sha256:<hex>` (InvalidName if malformed)."""
    return normalize_digest(value if value.startswith("sha256") else f"sha256:{value}")


def check_free_space(store: Store, needed: int) -> None:
    """Fail before writing when the blobs folder's filesystem cannot hold `needed` more bytes."""
    have = free_space(store.blobs)
    if needed > have:
        raise StorageFull(
            f"not enough disk space for {store.blobs}: need {format_bytes(needed)}, have {format_bytes(have)}"
        )


def partial_full(partial: Path, needed: int, err: OSError) -> LocalrtError | None:
    """ENOSPC while writing a resumable download -> the clear error (the partial stays for resuming);
    None for other errors."""
    if err.errno != errno.ENOSPC:
        return None
    return disk_full(partial, needed, "the partial download is kept: pull again to resume once there is room")
