"""Images through the Responses and Anthropic routes: the tiny random Idefics3 of the vision track
(tests/fixtures_vision.py, evaluated through libmtmd) behind a real `localrt serve`, driven by the
official `openai` and `anthropic` packages."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import anthropic
import openai
import pytest

from localrt.store.modelfile import create
from localrt.store.store import Store
from tests.fixtures_vision import png_bytes
from tests.fixtures_vision import tiny_vlm
from tests.servers.serve import LocalrtServer

MODEL = "tiny-vlm:latest"
OPTIONS = {"temperature": 0, "num_ctx": 512}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    root = tmp_path_factory.mktemp("agents-vision")
    model, projector = tiny_vlm()
    create(MODEL, from_path=model, projector_path=projector, store=Store(root / "models"))
    srv = LocalrtServer(root / "models", root / "serve.log")
    yield srv
    srv.stop()
    assert "Traceback" not in srv.log_path.read_text(errors="replace")


def picture(seed: int) -> str:
    return base64.b64encode(png_bytes(seed)).decode()


def test_anthropic_image_blocks_reach_the_model(server: LocalrtServer) -> None:
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)

    def ask(content: list[dict]) -> anthropic.types.Message:
        return claude.messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": content}], extra_body=OPTIONS
        )

    text = {"type": "text", "text": "Describe this."}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": picture(0)}}
    plain, seen = ask([text]), ask([image, text])
    # the image's tokens are part of the prompt
    assert seen.usage.input_tokens + seen.usage.cache_read_input_tokens > (
        plain.usage.input_tokens + plain.usage.cache_read_input_tokens
    )
    assert seen.content


def test_responses_input_image_reaches_the_model(server: LocalrtServer) -> None:
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

    def ask(content: list[dict]) -> openai.types.responses.Response:
        return oai.responses.create(
            model=MODEL, input=[{"role": "user", "content": content}], max_output_tokens=4, extra_body=OPTIONS
        )

    text = {"type": "input_text", "text": "Describe this."}
    image = {"type": "input_image", "image_url": "data:image/png;base64," + picture(1)}
    assert ask([image, text]).usage.input_tokens > ask([text]).usage.input_tokens
    with pytest.raises(openai.BadRequestError, match="does not fetch image URLs"):
        ask([{"type": "input_image", "image_url": "http://127.0.0.1:9/x.png"}, text])


def test_anthropic_screenshot_in_a_tool_result_reaches_the_model(server: LocalrtServer) -> None:
    """A computer-use agent sends its screenshots back as images in tool results (this tiny model's
    template shows no tools, so the history alone carries the call)."""
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    call = {"type": "tool_use", "id": "toolu_1", "name": "computer", "input": {"action": "screenshot"}}

    def ask(result: list[dict]) -> int:
        m = claude.messages.create(
            model=MODEL,
            max_tokens=1,
            messages=[
                {"role": "user", "content": "Take a screenshot."},
                {"role": "assistant", "content": [call]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result}],
                },
            ],
            extra_body=OPTIONS,
        )
        return m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)

    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": picture(2)}}
    assert ask([image]) > ask([{"type": "text", "text": ""}])
