"""Vision models from the command line and the store's other doors: `create --mmproj`, `show`,
`run --image`, image paths in a prompt, Hugging Face repos with an `mmproj-*.gguf`, `convert`'s refusal,
and http(s) image URLs behind LOCALRT_FETCH_IMAGES with size and time limits."""

from __future__ import annotations

import asyncio
import base64
import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from localrt.runtime import images
from localrt.runtime.front import Runtime
from localrt.store.pull import pull
from localrt.store.store import Store
from tests.fixtures_vision import png_bytes
from tests.fixtures_vision import tiny_vlm
from tests.servers.hub import Hub

PARAMS = "PARAMETER temperature 0\nPARAMETER num_predict 6\nPARAMETER num_ctx 512\nPARAMETER num_thread 1\n"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def localrt(*args: str, cwd: Path | None = None, host: str | None = None) -> subprocess.CompletedProcess[str]:
    # no server answers at a free port: the CLI works in-process
    env = {**os.environ, "LOCALRT_HOST": host or f"127.0.0.1:{free_port()}"}
    done = subprocess.run(
        [sys.executable, "-m", "localrt", *args],
        input=b"",
        capture_output=True,
        timeout=300,
        env=env,
        cwd=cwd,
    )
    # decoded by hand: text mode would turn a generated "\r" into "\n"
    return subprocess.CompletedProcess(
        done.args, done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
    )


@pytest.fixture
def vision_model(models_dir: Path, tmp_path: Path) -> str:
    model, proj = tiny_vlm()
    (tmp_path / "Modelfile").write_text(f"FROM {model}\n{PARAMS}")
    result = localrt("create", "vis", "-f", str(tmp_path / "Modelfile"), "--mmproj", str(proj))
    assert result.returncode == 0, result.stderr
    return "vis"


def test_show_lists_the_projector(vision_model: str) -> None:
    result = localrt("show", vision_model)
    assert result.returncode == 0, result.stderr
    assert "Projector" in result.stdout
    assert "clip" in result.stdout
    assert "vision" in result.stdout.split("Capabilities", 1)[1]
    modelfile = localrt("show", vision_model, "--modelfile").stdout
    assert modelfile.count("\nFROM ") == 2  # the model and its projector


def test_create_and_show_through_a_running_server(tmp_path: Path) -> None:
    """With a `localrt serve` up, the CLI uploads both GGUFs (POST /api/create with two files) and
    `show` reads the projector from /api/show."""
    import signal

    from tests.servers.serve import LocalrtServer

    model, proj = tiny_vlm()
    server = LocalrtServer(tmp_path / "server-models", tmp_path / "serve.log")
    try:
        host = server.url.removeprefix("http://")
        created = localrt("create", "vis-remote", "--from", str(model), "--mmproj", str(proj), host=host)
        assert created.returncode == 0, created.stderr
        shown = localrt("show", "vis-remote", host=host)
    finally:
        assert server.stop() in (0, -signal.SIGTERM)
    resolved = Store(tmp_path / "server-models").resolve("vis-remote")
    assert resolved.projector_path is not None
    assert resolved.projector_path.read_bytes() == proj.read_bytes()
    assert "Projector" in shown.stdout
    assert "vision" in shown.stdout.split("Capabilities", 1)[1]


def test_run_with_an_image_answers_as_the_runtime_does(
    vision_model: str, models_dir: Path, tmp_path: Path
) -> None:
    picture = tmp_path / "cat picture.png"
    picture.write_bytes(png_bytes(5))
    result = localrt("run", vision_model, "describe this", "--image", str(picture))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # no libmtmd chatter

    async def expected() -> str:
        rt = Runtime(Store(models_dir))
        try:
            message = {"role": "user", "content": "describe this", "images": [picture.read_bytes()]}
            return "".join([c.content async for c in rt.chat(vision_model, [message])])
        finally:
            await rt.close()

    assert result.stdout.strip() == asyncio.run(expected()).strip()


def test_run_refuses_bad_image_files(vision_model: str, tmp_path: Path) -> None:
    text = tmp_path / "notes.png"
    text.write_text("this is not a picture")
    for path, fragment in ((tmp_path / "missing.png", "image file not found"), (text, "is not an image")):
        result = localrt("run", vision_model, "describe this", "--image", str(path))
        assert result.returncode != 0
        assert fragment in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr  # one line, no traceback


def test_image_paths_in_a_prompt_are_taken_out(tmp_path: Path) -> None:
    spaced = tmp_path / "my cat.png"
    plain = tmp_path / "dog.JPG"
    for p in (spaced, plain):
        p.write_bytes(b"x")
    escaped = str(spaced).replace(" ", "\\ ")
    text, paths = images.images_in_prompt(f"what is in {escaped} and '{plain}'? not /no/such/file.png")
    assert paths == [str(spaced), str(plain)]
    assert text == "what is in and ? not /no/such/file.png"
    assert images.images_in_prompt("no pictures here") == ("no pictures here", [])


def test_convert_says_it_cannot_write_a_projector(tmp_path: Path) -> None:
    hf = tiny_vlm()[0].parent / "hf"
    result = localrt("convert", str(hf), "--quant", "Q8_0", "-o", str(tmp_path / "out.gguf"))
    assert result.returncode != 0
    assert "vision-language model" in result.stderr
    assert "--mmproj" in result.stderr
    assert not (tmp_path / "out.gguf").exists()


def test_a_hugging_face_repo_brings_its_projector(models_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, proj = tiny_vlm()
    with Hub() as hub:
        hub.add_repo(
            "tiny-org/Tiny-VLM-GGUF",
            {"Tiny-VLM-F32.gguf": model, "mmproj-Tiny-VLM-F32.gguf": proj, "README.md": b"# tiny\n"},
        )
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        name = pull("hf.co/tiny-org/Tiny-VLM-GGUF:F32", store=Store(models_dir))
    resolved = Store(models_dir).resolve(name)
    assert resolved.model_path.read_bytes() == model.read_bytes()
    assert resolved.projector_path is not None
    assert resolved.projector_path.read_bytes() == proj.read_bytes()


# ---- http(s) image URLs ---------------------------------------------------------------------------
class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/slow.png":
            time.sleep(2)
        body = (
            png_bytes(0) if self.path in ("/cat.png", "/slow.png") else b"\0" * (images.MAX_IMAGE_BYTES + 10)
        )
        self.send_response(200)
        if self.path != "/chunked.png":
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def image_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_image_urls_need_the_setting(image_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCALRT_FETCH_IMAGES", raising=False)
    with pytest.raises(images.ImageError, match="LOCALRT_FETCH_IMAGES=1"):
        images.image_url_bytes(image_server + "/cat.png")
    monkeypatch.setenv("LOCALRT_FETCH_IMAGES", "1")
    assert images.image_url_bytes(image_server + "/cat.png") == png_bytes(0)
    data_url = "data:image/png;base64," + base64.b64encode(png_bytes(1)).decode()
    assert images.image_url_bytes(data_url) == png_bytes(1)


def test_fetched_images_are_size_and_time_limited(image_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALRT_FETCH_IMAGES", "1")
    with pytest.raises(images.ImageError, match="more than the limit"):
        images.image_url_bytes(image_server + "/big.png")  # declared too large
    with pytest.raises(images.ImageError, match="more than the limit"):
        images.image_url_bytes(image_server + "/chunked.png")  # no length given: cut off while reading
    monkeypatch.setattr(images, "FETCH_TIMEOUT_S", 0.3)
    with pytest.raises(images.ImageError, match="took longer than"):
        images.image_url_bytes(image_server + "/slow.png")
