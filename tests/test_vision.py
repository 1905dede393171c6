"""Vision models: a tiny random Idefics3 (SmolVLM's architecture) converted by llama.cpp's own
convert_hf_to_gguf.py (text GGUF + `--mmproj` projector), evaluated through libmtmd.

Runtime and store checks in-process; the interfaces through a real `localrt serve` with the official
`ollama` and `openai` clients. Greedy decoding everywhere, so the same request gives the same tokens.
"""

from __future__ import annotations

import asyncio
import base64
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import ollama
import openai
import pytest

from localrt.backends.base import IMAGE_TOKEN
from localrt.backends.base import GenerateRequest
from localrt.backends.base import LoadOptions
from localrt.backends.base import SamplingParams
from localrt.backends.base import TextEvent
from localrt.errors import LocalrtError
from localrt.runtime.front import Runtime
from localrt.runtime.images import decode_image
from localrt.store.modelfile import create
from localrt.store.store import MEDIA_PROJECTOR
from localrt.store.store import Store
from tests.fixtures_vision import png_bytes
from tests.fixtures_vision import tiny_vlm
from tests.servers.llama_server import running_llama_server
from tests.servers.serve import LocalrtServer

MODEL = "tiny-vlm:latest"
TEXT_ONLY = "tiny-text:latest"
GREEDY = {"temperature": 0, "num_predict": 6, "num_ctx": 512}


@pytest.fixture(scope="module")
def vlm() -> tuple[Path, Path]:
    return tiny_vlm()


@pytest.fixture(scope="module")
def store_root(vlm: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vision") / "models"
    store = Store(root)
    model, proj = vlm
    create(MODEL, from_path=model, projector_path=proj, store=store)
    create(TEXT_ONLY, from_path=model, store=store)
    return root


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# ---- the backend: an image changes the logits ---------------------------------------------------
def first_logits(model: Any, tokens: list[int], images: list[Any]) -> np.ndarray:
    """The logprobs of the 20 likeliest first tokens after the prompt, by token id, as generate gives
    them (prefix reuse included)."""

    async def first() -> np.ndarray:
        # sampled, not greedy: this tiny random model's likeliest first token is its end token, which ends
        # the answer without a token; a seeded draw takes another, and its logprobs hold the top 20
        request = GenerateRequest(
            tokens, SamplingParams(temperature=1.0, seed=7), num_predict=1, images=images
        )
        request.logprobs, request.top_logprobs = True, 20
        async for event in model.generate(request):
            if isinstance(event, TextEvent) and event.logprobs:
                top = event.logprobs[0].top
                return np.array([v for _, v in sorted((t.token_id, t.logprob) for t in top)])
        raise AssertionError("no first token")

    return asyncio.run(first())


def test_an_image_changes_the_logits(vlm: tuple[Path, Path]) -> None:
    from localrt.backends.llamacpp import LlamaCppBackend

    model_path, proj = vlm
    m = LlamaCppBackend.load(model_path, LoadOptions(num_ctx=512, projector=proj))
    try:
        assert m.capabilities.vision
        text = m.tokenize("describe this", add_special=True)
        with_image = [text[0], IMAGE_TOKEN, *text[1:]]
        a = first_logits(m, with_image, [decode_image(png_bytes(0))])
        a_again = first_logits(m, with_image, [decode_image(png_bytes(0))])
        b = first_logits(m, with_image, [decode_image(png_bytes(1))])
        none = first_logits(m, text, [])
    finally:
        m.unload()
    # the same image: the same numbers up to float rounding (the repeat evaluates only the last token,
    # reusing the image's cells, and this model's F16 kernels round a 1-row batch differently)
    assert np.allclose(a, a_again, rtol=0, atol=1e-4)
    assert not np.array_equal(a, b)  # another picture: other logits
    assert not np.array_equal(a, none)  # no picture: other logits


# ---- the runtime -------------------------------------------------------------------------------
def ask(rt: Runtime, messages: list[dict[str, Any]]) -> tuple[str, Any]:
    async def go() -> tuple[str, Any]:
        text, final = "", None
        async for chunk in rt.chat(MODEL, messages, options=GREEDY):
            text += chunk.content
            if chunk.done:
                final = chunk
        return text, final

    return asyncio.run(go())


def test_a_second_question_about_the_same_image_encodes_nothing(store_root: Path) -> None:
    image = b64(png_bytes(0))
    rt = Runtime(Store(store_root))
    try:
        first = [{"role": "user", "content": "what is this?", "images": [image]}]
        answer, done1 = ask(rt, first)
        follow = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "and more?"}]
        _, done2 = ask(rt, follow)
        _, done3 = ask(rt, [{"role": "user", "content": "what is this?", "images": [b64(png_bytes(2))]}])
    finally:
        asyncio.run(rt.close())
    assert done1.metrics.prompt_image_tokens > 0  # the image was encoded the first time
    assert done2.metrics.prompt_image_tokens == 0  # not again for the follow-up question
    assert done2.metrics.prompt_eval_count < done1.metrics.prompt_eval_count
    assert done3.metrics.prompt_image_tokens == done1.metrics.prompt_image_tokens  # another image: encoded


def test_store_layers_show_and_capabilities(store_root: Path, vlm: tuple[Path, Path]) -> None:
    store = Store(store_root)
    resolved = store.resolve(MODEL)
    manifest, _ = store.read_manifest(resolved.name)
    assert [layer["mediaType"] for layer in manifest["layers"]].count(MEDIA_PROJECTOR) == 1
    assert resolved.projector_path is not None
    assert resolved.projector_path.read_bytes() == vlm[1].read_bytes()
    assert store.resolve(TEXT_ONLY).projector_path is None


def test_a_modelfile_with_two_from_lines(vlm: tuple[Path, Path], tmp_path: Path) -> None:
    store = Store(tmp_path / "models")
    model, proj = vlm
    # either order: the projector is the GGUF whose architecture is clip
    create("two-from", modelfile_text=f"FROM {proj}\nFROM {model}\n", store=store)
    resolved = store.resolve("two-from")
    assert resolved.model_path.read_bytes() == model.read_bytes()
    assert resolved.projector_path is not None
    assert resolved.projector_path.read_bytes() == proj.read_bytes()


def test_a_projector_is_not_a_model(vlm: tuple[Path, Path], tmp_path: Path) -> None:
    store = Store(tmp_path / "models")
    with pytest.raises(LocalrtError, match="is a multimodal projector"):
        create("only-proj", from_path=vlm[1], store=store)
    with pytest.raises(LocalrtError, match="not a multimodal projector"):
        create("proj-twice", from_path=vlm[0], projector_path=vlm[0], store=store)
    assert not (tmp_path / "models" / "manifests").exists() or not list(
        (tmp_path / "models" / "manifests").rglob("*")
    )


# ---- the interfaces, through a real server --------------------------------------------------------
@pytest.fixture(scope="module")
def server(store_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    log = tmp_path_factory.mktemp("vision-serve") / "serve.log"
    srv = LocalrtServer(store_root, log, env={"LOCALRT_KEEP_ALIVE": "10m"})
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)
    assert "Traceback" not in srv.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def client(server: LocalrtServer) -> ollama.Client:
    return ollama.Client(host=server.url)


@pytest.fixture(scope="module")
def oai(server: LocalrtServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_show_lists_the_projector_and_vision(client: ollama.Client) -> None:
    info = client.show(MODEL)
    assert "vision" in (info.capabilities or [])
    assert "vision" not in (client.show(TEXT_ONLY).capabilities or [])
    raw = httpx.post(f"{client._client.base_url}/api/show", json={"model": MODEL}).json()
    assert raw["projector_info"]["general.architecture"] == "clip"


def test_every_interface_gives_the_same_tokens(
    server: LocalrtServer, client: ollama.Client, oai: openai.OpenAI
) -> None:
    image = png_bytes(3)
    question = "describe this"
    url = server.url
    chat = httpx.post(
        f"{url}/api/chat",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": question, "images": [b64(image)]}],
            "options": GREEDY,
            "stream": False,
        },
        timeout=120,
    ).json()["message"]["content"]
    generate = httpx.post(
        f"{url}/api/generate",
        json={"model": MODEL, "prompt": question, "images": [b64(image)], "options": GREEDY, "stream": False},
        timeout=120,
    ).json()["response"]
    via_ollama = client.chat(
        MODEL, messages=[{"role": "user", "content": question, "images": [image]}], options=GREEDY
    ).message.content
    via_openai = (
        oai.chat.completions.create(
            model=MODEL,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(image)}},
                        {"type": "text", "text": question},
                    ],
                }
            ],
            temperature=0,
            max_tokens=GREEDY["num_predict"],
            extra_body={"num_ctx": GREEDY["num_ctx"]},
        )
        .choices[0]
        .message.content
    )
    without = client.chat(MODEL, messages=[{"role": "user", "content": question}], options=GREEDY)
    assert chat  # something came back
    assert generate == chat
    assert via_ollama == chat
    assert via_openai == chat
    assert without.message.content != chat  # and the image mattered


def rejected(server: LocalrtServer, path: str, body: dict[str, Any]) -> tuple[int, str]:
    r = httpx.post(server.url + path, json=body, timeout=60)
    error = r.json().get("error")
    return r.status_code, error["message"] if isinstance(error, dict) else str(error)


BAD_IMAGES = [
    ("not base64", "!!!not base64!!!", "not valid base64"),
    ("not an image", b64(b"hello, this is plain text and no picture"), "is not an image"),
    ("truncated", b64(png_bytes(0)[:200]), "corrupt or truncated"),
    ("empty", "", "is empty"),
    ("a TIFF", b64(png_bytes(0, fmt="TIFF")), "supported formats"),
    ("too many pixels", b64(png_bytes(0, size=(4200, 4100), solid=True)), "more than the limit of"),
]


@pytest.mark.parametrize("what, payload, fragment", BAD_IMAGES, ids=[b[0] for b in BAD_IMAGES])
def test_bad_images_are_clear_400s(
    server: LocalrtServer, store_root: Path, what: str, payload: str, fragment: str
) -> None:
    before = sorted(p.name for p in (store_root / "blobs").iterdir())
    for path, body in (
        ("/api/generate", {"model": MODEL, "prompt": "x", "images": [payload], "stream": False}),
        ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "x", "images": [payload]}]}),
    ):
        status, message = rejected(server, path, body)
        assert status == 400, (path, message)
        assert fragment in message, (path, message)
    url = f"data:image/png;base64,{payload}"
    status, message = rejected(
        server,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
        },
    )
    assert status == 400
    assert fragment in message
    assert sorted(p.name for p in (store_root / "blobs").iterdir()) == before  # nothing written


def test_the_byte_limit_comes_before_decoding() -> None:
    from localrt.runtime.images import MAX_IMAGE_BYTES
    from localrt.runtime.images import ImageError

    with pytest.raises(ImageError, match=f"more than the limit of {MAX_IMAGE_BYTES} bytes"):
        decode_image(png_bytes(0) + b"\0" * MAX_IMAGE_BYTES)


def test_transparent_pixels_become_white() -> None:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGBA", (2, 1), (0, 0, 0, 0)).save(out, "PNG")
    assert decode_image(out.getvalue()).rgb == b"\xff" * 6


def test_an_image_for_a_text_model_is_a_400_naming_it(server: LocalrtServer, client: ollama.Client) -> None:
    status, message = rejected(
        server, "/api/generate", {"model": TEXT_ONLY, "prompt": "x", "images": [b64(png_bytes(0))]}
    )
    assert status == 400
    assert message == f'"{TEXT_ONLY}" does not support images'
    with pytest.raises(ollama.ResponseError, match="does not support images"):
        client.chat(TEXT_ONLY, messages=[{"role": "user", "content": "x", "images": [png_bytes(0)]}])


def test_image_urls_are_refused_unless_enabled(server: LocalrtServer, oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="LOCALRT_FETCH_IMAGES=1"):
        oai.chat.completions.create(
            model=MODEL,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}],
                }
            ],
        )
    status, message = rejected(
        server,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}],
                }
            ],
        },
    )
    assert status == 400
    assert "unsupported URL scheme 'file'" in message


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_torch_and_mlx_answer_an_image_request_with_a_400(server: LocalrtServer, backend: str) -> None:
    pytest.importorskip({"torch": "torch", "mlx": "mlx.core"}[backend])
    status, message = rejected(
        server,
        "/api/generate",
        {
            "model": MODEL,
            "prompt": "x",
            "images": [b64(png_bytes(0))],
            "options": {"backend": backend, "num_predict": 1},
            "stream": False,
        },
    )
    assert status == 400
    assert f"{backend} backend does not support images" in message


@pytest.mark.oracle
def test_llama_servers_own_mtmd_agrees(server: LocalrtServer, vlm: tuple[Path, Path], tmp_path: Path) -> None:
    """llama.cpp's llama-server --mmproj on the same files and prompt: the same prompt length and the same
    greedy answer (its media marker fixed through LLAMA_MEDIA_MARKER)."""
    model, proj = vlm
    args = ["-m", str(model), "--mmproj", str(proj), "-c", "512", "-t", "1", "--no-warmup"]
    env = {"PATH": "/usr/bin:/bin", "LLAMA_MEDIA_MARKER": "<__media__>"}
    image = b64(png_bytes(3))
    turn = "<|im_start|>user\n{}describe this<|im_end|>\n<|im_start|>assistant\n"
    with running_llama_server(args, tmp_path / "llama-server.log", env=env) as url:
        theirs = httpx.post(
            url + "/completion",
            json={
                "prompt": {"prompt_string": turn.format("<__media__>"), "multimodal_data": [image]},
                "n_predict": GREEDY["num_predict"],
                "temperature": 0,
                "cache_prompt": False,
            },
            timeout=120,
        ).json()
    ours = httpx.post(
        server.url + "/api/generate",
        json={
            "model": MODEL,
            "prompt": turn.format("[img]"),
            "raw": True,
            "images": [image],
            # another num_ctx reloads the model: an empty cache, so every prompt cell is counted
            "options": {**GREEDY, "num_ctx": 768},
            "stream": False,
        },
        timeout=120,
    ).json()
    assert ours["prompt_eval_count"] == theirs["tokens_evaluated"]  # libmtmd expanded the image alike
    assert ours["response"] == theirs["content"]
