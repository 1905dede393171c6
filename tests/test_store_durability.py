"""Each store write survives a power cut: the system calls of a real `localrt create`, `pull`, `cp` and `rm`,
recorded by strace, are in the order that makes every step durable.

A rename into blobs/ or manifests/ must follow an fsync of the file renamed (else a power cut can leave the
new name on empty or partial bytes) and be followed by an fsync of its folder before the next step (else the
rename itself can be lost while a later step survives); a manifest is renamed into place only after every
blob of its model is; `rm` makes the manifest's removal durable before it deletes any blob.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gguf_factory import small_valid_gguf
from tests.servers.registry import Registry

SYSCALLS = "fsync,fdatasync,rename,renameat,renameat2,unlink,unlinkat"
_CALL = re.compile(r"^(?P<pid>\d+)\s+(?P<name>\w+)\((?P<args>.*)\)\s+=\s+(?P<rc>-?\d+)")
_FD_PATH = re.compile(r"^\d+<(?P<path>[^>]*)>")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')


def strace_available() -> str | None:
    """Why strace cannot record a child here, or None when it can."""
    if shutil.which("strace") is None:
        return "strace is not installed (.ci/run installs it)"
    done = subprocess.run(["strace", "-f", "-o", os.devnull, "true"], capture_output=True)
    return None if done.returncode == 0 else f"strace cannot trace here: {done.stderr.decode().strip()}"


def traced(args: list[str], trace: Path, env: dict[str, str]) -> list[tuple[str, ...]]:
    """Run `localrt ARGS` under strace; its successful fsyncs, renames and unlinks, in order."""
    reason = strace_available()
    if reason:
        pytest.skip(reason)
    done = subprocess.run(
        ["strace", "-f", "-qq", "-y", "-e", f"trace={SYSCALLS}", "-o", str(trace)]
        + [sys.executable, "-m", "localrt", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return list(events(trace.read_text()))


def events(text: str) -> Iterator[tuple[str, ...]]:
    pending: dict[str, str] = {}  # pid -> a call strace split around another thread's
    for raw in text.splitlines():
        pid, _, rest = raw.partition(" ")
        if rest.endswith("<unfinished ...>"):
            pending[pid] = rest.removesuffix("<unfinished ...>")
            continue
        if rest.lstrip().startswith("<..."):
            rest = pending.pop(pid, "") + rest.split("resumed>", 1)[1]
        m = _CALL.match(f"{pid} {rest.strip()}")
        if m is None or m["rc"] != "0":
            continue
        name, args = m["name"], m["args"]
        if name in ("fsync", "fdatasync"):
            fd = _FD_PATH.match(args)
            if fd:
                yield ("fsync", fd["path"])
        elif name.startswith("rename"):
            src, dst = _QUOTED.findall(args)[:2]
            yield ("rename", src, dst)
        elif name.startswith("unlink"):
            yield ("unlink", _QUOTED.findall(args)[0])


def in_store(path: str, root: Path) -> bool:
    return Path(path).parent in (root / "blobs",) or str(root / "manifests") in path


def assert_durable_renames(calls: list[tuple[str, ...]], root: Path) -> list[tuple[int, str]]:
    """Every rename into the store: the file fsynced before, its folder fsynced after and before the next
    change to the store. Returns (position, target) of each, in order."""
    placed = []
    for i, call in enumerate(calls):
        if call[0] != "rename" or not in_store(call[2], root):
            continue
        src, dst = call[1], call[2]
        assert ("fsync", src) in calls[:i], f"{dst} was renamed into place before its bytes were fsynced"
        folder = str(Path(dst).parent)
        after = calls[i + 1 :]
        assert ("fsync", folder) in after, f"the rename to {dst} was never made durable"
        between = after[: after.index(("fsync", folder))]
        changes = [c for c in between if c[0] != "fsync" and in_store(c[-1], root)]
        assert changes == [], f"{changes[0]} happened before the rename to {dst} was made durable"
        placed.append((i, dst))
    return placed


@pytest.fixture
def root(models_dir: Path) -> Path:
    models_dir.mkdir(parents=True)
    return models_dir.resolve()


def test_create_syncs_each_blob_and_renames_the_manifest_last(root: Path, tmp_path: Path) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(small_valid_gguf())
    calls = traced(["create", "tiny", "--from", str(gguf)], tmp_path / "trace", {"LOCALRT_MODELS": str(root)})
    placed = assert_durable_renames(calls, root)
    blobs = [i for i, dst in placed if Path(dst).parent == root / "blobs"]
    manifests = [i for i, dst in placed if str(root / "manifests") in dst]
    assert len(blobs) == 2  # the GGUF and the config
    assert len(manifests) == 1
    assert max(blobs) < manifests[0]


def test_pull_syncs_the_download_before_it_becomes_a_blob(root: Path, tmp_path: Path) -> None:
    with Registry() as registry:
        registry.add_model("library/tiny", "1", os.urandom(300_000), template="{{ .Prompt }}")
        calls = traced(
            ["pull", f"{registry.address}/library/tiny:1", "--insecure"],
            tmp_path / "trace",
            {"LOCALRT_MODELS": str(root)},
        )
    placed = assert_durable_renames(calls, root)
    blobs = [(i, dst) for i, dst in placed if Path(dst).parent == root / "blobs"]
    manifests = [i for i, dst in placed if str(root / "manifests") in dst]
    assert len(blobs) == 3  # model, template, config: each from its -partial file
    assert all(calls[i][1] == dst + "-partial" for i, dst in blobs)
    assert max(i for i, _ in blobs) < manifests[0]


def test_cp_and_rm_make_the_manifest_durable_before_any_blob_goes(root: Path, tmp_path: Path) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(small_valid_gguf())
    env = {"LOCALRT_MODELS": str(root)}
    assert (
        subprocess.run(
            [sys.executable, "-m", "localrt", "create", "a", "--from", str(gguf)], env={**os.environ, **env}
        ).returncode
        == 0
    )
    copied = traced(["cp", "a", "b"], tmp_path / "cp-trace", env)
    assert [dst for _, dst in assert_durable_renames(copied, root)] == [
        str(root / "manifests/registry.ollama.ai/library/b/latest")
    ]
    kept = traced(["rm", "b"], tmp_path / "rm-b", env)  # a still names every blob: none goes
    assert [c for c in kept if c[0] == "unlink" and Path(c[1]).parent == root / "blobs"] == []
    calls = traced(["rm", "a"], tmp_path / "rm-a", env)
    manifest = str(root / "manifests/registry.ollama.ai/library/a/latest")
    aside = next(i for i, c in enumerate(calls) if c[0] == "rename" and c[1] == manifest)
    assert Path(calls[aside][2]).name.startswith(".removing-")
    synced = calls.index(("fsync", str(Path(manifest).parent)), aside)
    blob_unlinks = [
        i for i, c in enumerate(calls) if c[0] == "unlink" and Path(c[1]).parent == root / "blobs"
    ]
    assert len(blob_unlinks) == 2
    assert synced < min(blob_unlinks)
    assert ("fsync", str(root / "blobs")) in calls[max(blob_unlinks) :]
    assert calls.index(("unlink", calls[aside][2])) > max(blob_unlinks)  # the aside manifest goes last
