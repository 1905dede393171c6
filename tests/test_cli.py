"""The CLI as a user meets it: real subprocesses, one-line errors, Ollama-shaped tables."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest


def localrt(
    *args: str, env: dict[str, str] | None = None, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "localrt", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        input=input,
        timeout=300,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture
def store_with_smollm2(models_dir: Path, smollm2_gguf: Path) -> Path:
    result = localrt("create", "smollm2:135m", "--from", str(smollm2_gguf))
    assert result.returncode == 0, result.stderr
    return models_dir


def test_create_list_show_path(store_with_smollm2: Path, smollm2_gguf: Path) -> None:
    listing = localrt("list")
    assert listing.returncode == 0
    header, row = listing.stdout.strip().splitlines()
    assert header.split() == ["NAME", "ID", "SIZE", "MODIFIED"]
    assert row.split()[0] == "smollm2:135m"
    assert row.split()[2:4] == ["98", "MB"]

    show = localrt("show", "smollm2:135m")
    assert show.returncode == 0, show.stderr
    fields = dict(
        line.strip().split(None, 1)
        for line in show.stdout.splitlines()
        if line.startswith("    ")
        and len(line.split()) >= 2
        and not line.strip().startswith(("context", "embedding"))
    )
    assert fields["architecture"] == "llama"
    assert fields["quantization"] == "Q4_1"
    assert fields["parameters"].startswith("13")
    assert fields["parameters"].endswith("M")
    assert "context length      8192" in show.stdout
    assert "embedding length    576" in show.stdout

    path = Path(localrt("show", "smollm2:135m", "--path").stdout.strip())
    digest = hashlib.sha256(smollm2_gguf.read_bytes()).hexdigest()
    assert path.name == f"sha256-{digest}"
    assert path.parent == store_with_smollm2 / "blobs"
    template = localrt("show", "smollm2:135m", "--template").stdout
    assert "<|im_start|>" in template


def test_cp_and_rm_collect_blobs(store_with_smollm2: Path) -> None:
    assert localrt("cp", "smollm2:135m", "me/copy").returncode == 0
    assert "me/copy:latest" in localrt("ls").stdout
    assert localrt("rm", "smollm2:135m").returncode == 0
    assert any((store_with_smollm2 / "blobs").iterdir())  # still used by the copy
    assert localrt("rm", "me/copy").returncode == 0
    assert list((store_with_smollm2 / "blobs").iterdir()) == []
    assert localrt("list").stdout.strip().splitlines() == ["NAME    ID    SIZE    MODIFIED"]


@pytest.mark.parametrize(
    "args, fragments",
    [
        (("show", "nosuchmodel"), ("not found",)),
        (("rm", "nosuchmodel:1"), ("not found",)),
        (("show", "../../etc/passwd"), ("invalid model name",)),
        (("cp", "a", "bad/../name"), ("invalid model name",)),
        (("create", "x", "--from", "/nonexistent/file.gguf"), ("/nonexistent/file.gguf",)),
        (("pull", "sha@md5:00"), ("invalid",)),
        (("frobnicate",), ("invalid choice",)),
        (("show",), ("required",)),
    ],
)
def test_user_mistakes_are_one_line(
    models_dir: Path, args: tuple[str, ...], fragments: tuple[str, ...]
) -> None:
    assert_one_line_error(localrt(*args), *fragments)


def test_create_rejects_a_file_that_is_not_gguf(models_dir: Path, tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a gguf at all" * 10)
    assert_one_line_error(localrt("create", "bogus", "--from", str(bogus)), "GGUF")
    assert not (models_dir / "manifests").exists() or not any((models_dir / "manifests").rglob("*"))


def test_unreachable_registry_is_one_line(models_dir: Path) -> None:
    # a closed local port: nothing listens there
    assert_one_line_error(localrt("pull", "127.0.0.1:9/library/none:1", "--insecure"), "127.0.0.1:9")


def test_verify_finds_a_damaged_blob_in_one_line_and_repair_names_what_to_pull(
    store_with_smollm2: Path,
) -> None:
    ok = localrt("verify")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip().splitlines()[-1].startswith("ok: 1 model(s), 2 blob(s)")
    model = next(p for p in (store_with_smollm2 / "blobs").iterdir() if p.stat().st_size > 1_000_000)
    with open(model, "r+b") as f:  # one flipped bit, as a bad sector or a torn write leaves
        f.seek(5_000_000)
        byte = f.read(1)[0]
        f.seek(5_000_000)
        f.write(bytes([byte ^ 0x10]))
    broken = localrt("verify", "smollm2:135m")
    assert_one_line_error(broken, "1 problem(s)", "--repair", "smollm2:135m")
    assert f"damaged: blob sha256:{model.name[7:]}" in broken.stdout
    repaired = localrt("verify", "--repair")
    assert_one_line_error(repaired, "pull or create again: smollm2:135m")
    assert "removed model smollm2:135m" in repaired.stdout
    assert not model.exists()
    again = localrt("verify")
    assert again.returncode == 0, again.stderr
    assert localrt("list").stdout.strip().splitlines() == ["NAME    ID    SIZE    MODIFIED"]


def test_the_cli_removes_what_a_killed_write_left_and_says_so(store_with_smollm2: Path) -> None:
    leftover = store_with_smollm2 / "blobs" / ".incoming-killed"
    leftover.write_bytes(b"x" * 2048)
    listing = localrt("list")
    assert listing.returncode == 0
    assert listing.stderr.strip() == (
        f"localrt: store: removed {leftover} (2.0 KB): a blob whose write was cut short"
    )
    assert not leftover.exists()


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Path:
    """A real 2 MiB filesystem (tmpfs) to fill up; needs root, as CI and the dev machines have."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_full_disk_is_one_line_and_leaves_nothing(tiny_disk: Path, smollm2_gguf: Path) -> None:
    result = localrt("create", "big", "--from", str(smollm2_gguf), env={"LOCALRT_MODELS": str(tiny_disk)})
    assert_one_line_error(result, "no space left on device")
    leftovers = [p for p in tiny_disk.rglob("*") if p.is_file() and p.parent.name != ".locks"]
    assert leftovers == []


# ---- an optional part that is not installed: one line naming the extra -------------------------
def without(tmp_path: Path, *modules: str) -> dict[str, str]:
    """The environment of a subprocess that cannot import `modules` (a None entry in sys.modules,
    set by a sitecustomize), as on a machine where their extra was never installed."""
    site = tmp_path / "without"
    site.mkdir(exist_ok=True)
    lines = "".join(f"sys.modules[{m!r}] = None\n" for m in modules)
    (site / "sitecustomize.py").write_text("import sys\n" + lines)
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)}


@pytest.mark.parametrize(
    "args,missing,extra",
    [
        (["convert", "org/model", "-o", "out.gguf"], "gguf", "convert"),
        (["chat", "smollm2:135m"], "textual", "tui"),
    ],
)
def test_missing_extra_is_one_line_naming_it(
    models_dir: Path, tmp_path: Path, args: list[str], missing: str, extra: str
) -> None:
    result = localrt(*args, env=without(tmp_path, missing))
    assert_one_line_error(result, f"pip install 'localrt[{extra}]'")
    assert "internal error" not in result.stderr


def test_requantizing_without_the_convert_extra_names_it(
    models_dir: Path, tmp_path: Path, smollm2_gguf: Path
) -> None:
    result = localrt(
        "create", "q:1", "--from", str(smollm2_gguf), "-q", "Q4_K_M", env=without(tmp_path, "gguf")
    )
    assert_one_line_error(result, "localrt create needs gguf", "pip install 'localrt[convert]'")


def test_serve_help_lists_every_variable_the_server_reads() -> None:
    from localrt import config

    out = localrt("serve", "--help").stdout
    assert [v.name for v in config.VARIABLES if v.section != config.TESTS and v.name not in out] == []
