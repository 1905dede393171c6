"""Registering remote models: `create --remote`, the Modelfile's `FROM https://...`,
what the store keeps (endpoints and the key's variable name, never the key), URL rules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from localrt.errors import LocalrtError
from localrt.store.modelfile import ModelfileError
from localrt.store.modelfile import create
from localrt.store.modelfile import parse_modelfile
from localrt.store.names import parse_name
from localrt.store.remote import check_endpoint
from localrt.store.remote import create_remote
from localrt.store.store import MEDIA_MODEL
from localrt.store.store import Store
from tests.gguf_factory import write_tiny_llama

SECRET = "sk-never-in-the-store-7d1c"


def localrt(models_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "localrt", *args],
        env={**os.environ, "LOCALRT_MODELS": str(models_dir), "LOCALRT_HOST": "127.0.0.1:9", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_create_remote_pool_from_the_cli(models_dir: Path) -> None:
    r = localrt(
        models_dir,
        "create",
        "cluster",
        "--remote",
        "https://gpu-1.example:8000/v1",
        "--remote",
        "https://gpu-2.example:8000/v1/",
        "--remote-model",
        "meta-llama/Llama-3.1-70B-Instruct",
        "--api-key-env",
        "CLUSTER_KEY",
        CLUSTER_KEY=SECRET,
    )
    assert r.returncode == 0, r.stderr
    model = Store(models_dir).resolve("cluster")
    assert model.remote == {
        "endpoints": ["https://gpu-1.example:8000/v1", "https://gpu-2.example:8000/v1"],
        "model": "meta-llama/Llama-3.1-70B-Instruct",
        "api_key_env": "CLUSTER_KEY",
        "insecure": False,
    }
    assert not any(layer["mediaType"] == MEDIA_MODEL for layer in model.manifest["layers"])  # no weights
    for path in models_dir.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes()
    listed = localrt(models_dir, "list")
    assert "cluster:latest" in listed.stdout


def test_modelfile_from_urls_is_a_pool(models_dir: Path) -> None:
    text = (
        "FROM http://127.0.0.1:8000/v1\n"
        "FROM http://localhost:8001\n"
        "PARAMETER remote_model Qwen/Qwen3-8B\n"
        "PARAMETER api_key_env MY_KEY\n"
        "PARAMETER temperature 0.3\n"
        'SYSTEM "Be brief."\n'
    )
    mf = parse_modelfile(text)
    assert mf.remotes == ["http://127.0.0.1:8000/v1", "http://localhost:8001"]
    assert mf.remote_model == "Qwen/Qwen3-8B"
    assert "remote_model" not in mf.parameters
    create("qwen", modelfile_text=text, store=Store(models_dir))
    model = Store(models_dir).resolve("qwen")
    assert model.remote["endpoints"] == ["http://127.0.0.1:8000/v1", "http://localhost:8001/v1"]
    assert model.remote["model"] == "Qwen/Qwen3-8B"
    assert model.params == {"temperature": 0.3}
    assert model.system == "Be brief."


def test_modelfile_rejects_mixing_local_and_url_from(tmp_path: Path) -> None:
    with pytest.raises(ModelfileError, match="line 2"):
        parse_modelfile("FROM ./model.gguf\nFROM https://host:8000/v1\n")
    with pytest.raises(ModelfileError, match="local FROM after a URL FROM"):
        parse_modelfile("FROM https://host:8000/v1\nFROM ./model.gguf\n")


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("ftp://host/v1", "http:// or https://"),
        ("file:///etc/passwd", "http:// or https://"),
        ("http://10.1.2.3:8000/v1", "--insecure"),
        ("http://gpu.example:8000/v1", "--insecure"),
        ("https://user:pw@host/v1", "credentials"),
        ("https://host/v1?key=1", "query"),
        ("https:///v1", "no host"),
    ],
)
def test_bad_urls_are_refused(url: str, reason: str) -> None:
    with pytest.raises(LocalrtError, match=reason.replace("?", r"\?")):
        check_endpoint(url)


def test_insecure_allows_plain_http_to_another_host() -> None:
    assert check_endpoint("http://10.1.2.3:8000/v1", insecure=True) == "http://10.1.2.3:8000/v1"
    assert check_endpoint("http://[::1]:8000") == "http://[::1]:8000/v1"


def test_cli_errors_are_one_line(models_dir: Path) -> None:
    r = localrt(models_dir, "create", "x", "--remote", "http://10.1.2.3:8000/v1", "--remote-model", "m")
    assert r.returncode == 1
    [line] = r.stderr.strip().splitlines()
    assert "--insecure" in line
    assert not Store(models_dir).exists(parse_name("x"))
    r = localrt(
        models_dir, "create", "x", "--remote", "http://10.1.2.3:8000/v1", "--remote-model", "m", "--insecure"
    )
    assert r.returncode == 0
    r = localrt(
        models_dir,
        "create",
        "y",
        "--remote",
        "https://h:1/v1",
        "--remote-model",
        "m",
        "--api-key-env",
        "sk-abc",
    )
    assert r.returncode == 1
    assert "sk-abc" not in r.stderr  # what looks like a key is not echoed back
    r = localrt(models_dir, "show", "x", "--path")
    assert r.returncode == 1
    assert "remote model" in r.stderr


def test_unreachable_upstream_without_a_model_id(models_dir: Path) -> None:
    from tests.servers.serve import free_port

    r = localrt(models_dir, "create", "x", "--remote", f"http://127.0.0.1:{free_port()}/v1")
    assert r.returncode == 1
    assert "--remote-model" in r.stderr
    assert "Traceback" not in r.stderr


def test_remote_does_not_replace_a_local_model_when_asked_not_to(models_dir: Path, tmp_path: Path) -> None:
    store = Store(models_dir)
    create("tiny", from_path=write_tiny_llama(tmp_path / "tiny.gguf"), store=store)
    with pytest.raises(LocalrtError, match="local model"):
        create_remote(store, "tiny", ["https://h:1/v1"], model="m", replace_local=False)
    assert store.resolve("tiny").remote is None
