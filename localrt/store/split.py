"""Split GGUF files (`name-00001-of-00003.gguf`, llama.cpp's gguf-split format), merged into one GGUF.

The first part holds every key/value plus `split.no`, `split.count` and `split.tensors.count`; the others
hold only those three keys and their tensors, each part's offsets relative to its own data section.
Merging writes the first part's key/values (the split keys left out, every other entry copied byte for
byte), the tensor infos of all parts in order with offsets laid out again at the file's alignment, and
the tensor data: the GGUF the parts were split from. Every part goes through the bounded reader first.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from pathlib import Path

from localrt.errors import LocalrtError
from localrt.store.gguf import GGUFError
from localrt.store.gguf import GGUFInfo
from localrt.store.gguf import read_gguf
from localrt.store.store import Store

SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
COPY_CHUNK = 8 << 20


class SplitError(LocalrtError):
    pass


def split_series(name: str) -> tuple[str, int, int] | None:
    """(prefix, part number from 1, part count) of a split part's file name; None for other names."""
    match = SPLIT_NAME.match(name)
    if match is None:
        return None
    no, count = int(match["no"]), int(match["count"])
    return (match["prefix"], no, count) if 1 <= no <= count and count > 1 else None


def part_name(prefix: str, no: int, count: int) -> str:
    """llama.cpp's split path format: PREFIX-%05d-of-%05d.gguf."""
    return f"{prefix}-{no:05d}-of-{count:05d}.gguf"


def series_names(first: str) -> list[str]:
    """Every part's file name, from the first part's; a later part is refused, naming the first."""
    series = split_series(first)
    if series is None:
        raise SplitError(f"{first} is not a split GGUF part (name-00001-of-0000N.gguf)")
    prefix, no, count = series
    if no != 1:
        raise SplitError(
            f"{first} is part {no} of {count}: give the first part, {part_name(prefix, 1, count)}"
        )
    return [part_name(prefix, i, count) for i in range(1, count + 1)]


def find_parts(first: Path) -> list[Path]:
    """The parts beside `first` (the first part), each checked to exist."""
    paths = [first.with_name(name) for name in series_names(first.name)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise SplitError(f"split GGUF {first.name}: missing part(s) {', '.join(missing)} beside it")
    return paths


def is_split_part(path: Path) -> bool:
    """A GGUF whose header says it is one of several parts."""
    count = read_gguf(path).metadata.get("split.count", 0)
    return isinstance(count, int) and count > 1


def check_parts(infos: list[GGUFInfo], names: list[str]) -> None:
    """Each part's header agrees: its number, the count, the alignment, and the tensors add up."""
    count = len(infos)
    first = infos[0]
    for i, (info, name) in enumerate(zip(infos, names)):
        meta = info.metadata
        if meta.get("split.count") != count or meta.get("split.no") != i:
            raise SplitError(
                f"split GGUF part {name} says it is part {meta.get('split.no')} of {meta.get('split.count')}, "
                f"not {i} of {count} (counted from 0)"
            )
        if info.alignment != first.alignment:
            raise SplitError(f"split GGUF part {name} has alignment {info.alignment}, not {first.alignment}")
    seen: set[str] = set()
    for info, name in zip(infos, names):
        for t in info.tensors:
            if t.name in seen:
                raise SplitError(f"split GGUF part {name} repeats tensor '{t.name}'")
            seen.add(t.name)
    declared = first.metadata.get("split.tensors.count")
    if declared != len(seen):
        raise SplitError(f"split GGUF {names[0]} declares {declared} tensors, its parts hold {len(seen)}")


def _read_part(path: Path) -> GGUFInfo:
    """One part through the bounded reader; its error names the part."""
    try:
        return read_gguf(path)
    except GGUFError as e:
        raise GGUFError(f"split GGUF part {path.name}: {e}") from None


def _pad(n: int, alignment: int) -> int:
    return -n % alignment


def merge_parts(paths: list[Path], write: Callable[[bytes], None]) -> int:
    """Merge the parts (first part first) into one GGUF given to `write` in pieces; returns its size."""
    infos = [_read_part(p) for p in paths]
    check_parts(infos, [p.name for p in paths])
    first, align = infos[0], infos[0].alignment
    kept = [(k, span) for k, span in first.metadata_spans().items() if k not in SPLIT_KEYS]
    with open(paths[0], "rb") as f:
        header = f.read(first.data_offset)
    out = bytearray(b"GGUF")
    out += struct.pack("<IQQ", first.version, sum(len(i.tensors) for i in infos), len(kept))
    for _, (start, end) in kept:
        out += header[start:end]
    offset = 0
    for info in infos:
        for t in info.tensors:
            name = t.name.encode("utf-8")
            out += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(t.shape))
            out += struct.pack(f"<{len(t.shape)}q", *t.shape) + struct.pack("<IQ", t.type_id, offset)
            offset += t.n_bytes + _pad(t.n_bytes, align)
    out += bytes(_pad(len(out), align))
    write(bytes(out))
    size = len(out)
    for path, info in zip(paths, infos):
        with open(path, "rb") as f:
            for t in info.tensors:
                f.seek(t.file_offset)
                left = t.n_bytes
                while left:
                    block = f.read(min(COPY_CHUNK, left))
                    if not block:
                        raise SplitError(f"split GGUF part {path.name} ended inside tensor '{t.name}'")
                    write(block)
                    left -= len(block)
                write(bytes(_pad(t.n_bytes, align)))
                size += t.n_bytes + _pad(t.n_bytes, align)
    return size


def store_merged(store: Store, parts: list[Path]) -> tuple[str, int]:
    """Merge the parts into one blob of the store (hashed on the way): (digest, size)."""
    # the parts' sizes bound the merged file's (the headers merge into one): what a full disk needs
    with store.begin_blob(sum(p.stat().st_size for p in parts)) as blob:
        merge_parts(parts, blob.write)
        return blob.commit()


def refuse_part(path: Path, what: str) -> None:
    """A lone part of a split GGUF (as a stored blob) cannot be a model by itself."""
    meta = read_gguf(path).metadata
    count = meta.get("split.count", 0)
    if isinstance(count, int) and count > 1:
        raise SplitError(
            f"the {what} GGUF is part {int(meta.get('split.no', 0)) + 1} of {count} of a split model: "
            "give every part (name-00001-of-0000N.gguf first)"
        )
