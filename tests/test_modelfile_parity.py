"""Modelfile lines Ollama has beyond the basics: MESSAGE (few-shot history), REQUIRES, PARSER, RENDERER.

Parsing and storing are checked on a tiny GGUF; the rendered prompt on the real SmolLM2 through the
runtime; the wire through a real `localrt serve` and the official `ollama` client.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest

import localrt
from localrt.runtime.front import Runtime
from localrt.show import modelfile_text
from localrt.store.gguf import read_gguf
from localrt.store.importer import import_gguf
from localrt.store.modelfile import ModelfileError
from localrt.store.modelfile import create
from localrt.store.modelfile import parse_modelfile
from localrt.store.store import MEDIA_MESSAGES
from localrt.store.store import Store
from tests.conftest import async_test
from tests.gguf_factory import write_tiny_llama
from tests.servers.serve import LocalrtServer

HISTORY = [
    {"role": "user", "content": "Is the sky green?"},
    {"role": "assistant", "content": "No. It is blue."},
    {"role": "user", "content": 'Say "hi" twice.'},
    {"role": "assistant", "content": "hi\nhi"},
]
MODELFILE = """FROM ./tiny.gguf
SYSTEM You answer in one word.
MESSAGE user Is the sky green?
message ASSISTANT "No. It is blue."
MESSAGE user \"\"\"Say "hi" twice.\"\"\"
MESSAGE assistant \"\"\"hi
hi\"\"\"
REQUIRES 0.0.1
PARSER qwen3-thinking
RENDERER qwen3-coder
"""
GREEDY = {"temperature": 0, "num_predict": 12, "num_ctx": 1024}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("parity") / "tiny.gguf", file_type="Q8_0")


@pytest.fixture
def store(models_dir: Path) -> Store:
    return Store(models_dir)


# ---- parsing ------------------------------------------------------------------------------------------
def test_message_lines_parse_in_order_with_quotes_and_blocks() -> None:
    assert parse_modelfile(MODELFILE).messages == HISTORY


def test_requires_parser_renderer_parse() -> None:
    mf = parse_modelfile(MODELFILE)
    assert mf.formats() == {"requires": "0.0.1", "parser": "qwen3-thinking", "renderer": "qwen3-coder"}


@pytest.mark.parametrize(
    ("text", "wanted"),
    [
        ("FROM x.gguf\nMESSAGE tool hello\n", "Modelfile line 2: MESSAGE role must be one of"),
        ("FROM x.gguf\nMESSAGE user\n", "Modelfile line 2: MESSAGE needs a role and a text"),
        ("FROM x.gguf\nPARSER qwen9\n", "Modelfile line 2: unknown parser 'qwen9'"),
        ("FROM x.gguf\nRENDERER nope\n", "Modelfile line 2: unknown renderer 'nope'"),
        ("FROM x.gguf\nREQUIRES soon\n", "Modelfile line 2: requires must be a version"),
        ("FROM x.gguf\nREQUIRES 999.0.0\n", "Modelfile line 2: this model requires localrt 999.0.0 or newer"),
    ],
)
def test_bad_lines_name_the_line_and_reason(text: str, wanted: str) -> None:
    with pytest.raises(ModelfileError) as err:
        parse_modelfile(text)
    assert str(err.value).startswith(wanted)


def test_requires_names_our_version() -> None:
    with pytest.raises(ModelfileError) as err:
        parse_modelfile("FROM x.gguf\nREQUIRES v99.1.2\n")
    assert f"(this is {localrt.__version__})" in str(err.value)


# ---- the store --------------------------------------------------------------------------------------
def test_messages_are_stored_as_ollamas_layer(tiny: Path, store: Store) -> None:
    name = create("few:shot", modelfile_text=MODELFILE, store=store, base_dir=tiny.parent)
    manifest, _ = store.read_manifest(name)
    layer = next(x for x in manifest["layers"] if x["mediaType"] == MEDIA_MESSAGES)
    assert json.loads(store.blob_path(layer["digest"]).read_bytes()) == HISTORY


def test_formats_are_kept_in_the_config_blob(tiny: Path, store: Store) -> None:
    create("few:shot", modelfile_text=MODELFILE, store=store, base_dir=tiny.parent)
    config = store.resolve("few:shot").config
    assert {k: config.get(k) for k in ("requires", "parser", "renderer")} == {
        "requires": "0.0.1",
        "parser": "qwen3-thinking",
        "renderer": "qwen3-coder",
    }


def test_show_modelfile_writes_every_line_back(tiny: Path, store: Store) -> None:
    create("few:shot", modelfile_text=MODELFILE, store=store, base_dir=tiny.parent)
    resolved = store.resolve("few:shot")
    again = parse_modelfile(modelfile_text(resolved, read_gguf(resolved.model_path)))
    assert (again.messages, again.formats()) == (HISTORY, parse_modelfile(MODELFILE).formats())


def test_show_modelfile_keeps_backslashes(tiny: Path, store: Store) -> None:
    text = 'FROM ./tiny.gguf\nMESSAGE user """\\\\server\\share"""\n'  # a UNC path: two backslashes
    create("few:slash", modelfile_text=text, store=store, base_dir=tiny.parent)
    resolved = store.resolve("few:slash")
    again = parse_modelfile(modelfile_text(resolved, read_gguf(resolved.model_path)))
    assert again.messages == [{"role": "user", "content": "\\\\server\\share"}]


def test_a_derived_model_inherits_history_and_replaces_it(tiny: Path, store: Store) -> None:
    create("few:shot", modelfile_text=MODELFILE, store=store, base_dir=tiny.parent)
    create("few:inherit", modelfile_text="FROM few:shot\nSYSTEM other\n", store=store)
    create("few:replace", modelfile_text="FROM few:shot\nMESSAGE user only this\n", store=store)
    assert store.resolve("few:inherit").messages == HISTORY
    assert store.resolve("few:replace").messages == [{"role": "user", "content": "only this"}]


def test_cli_create_refuses_a_newer_requires_in_one_line(tiny: Path, tmp_path: Path) -> None:
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text(f"FROM {tiny}\nREQUIRES 99.0.0\n")
    env = {**os.environ, "LOCALRT_MODELS": str(tmp_path / "models")}
    proc = subprocess.run(
        [sys.executable, "-m", "localrt", "create", "x", "-f", str(modelfile)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        f"Error: Modelfile line 2: this model requires localrt 99.0.0 or newer (this is {localrt.__version__})"
    ]


# ---- the rendered prompt ------------------------------------------------------------------------------
@async_test
async def test_chat_prompt_is_system_then_history_then_request(smollm2_gguf: Path, models_dir: Path) -> None:
    store = Store(models_dir)
    import_gguf(store, "plain:latest", smollm2_gguf)
    text = "FROM plain:latest\nSYSTEM Be brief.\n" + "".join(
        f'MESSAGE {m["role"]} """{m["content"]}"""\n' for m in HISTORY
    )
    create("fewshot:latest", modelfile_text=text, store=store)
    request = [{"role": "user", "content": "What is 2+2?"}]
    spelled_out = [{"role": "system", "content": "Be brief."}, *HISTORY, *request]
    runtime = Runtime(store)
    try:
        with_history, _ = await runtime.render("fewshot:latest", request)
        by_hand, _ = await runtime.render("plain:latest", spelled_out)
    finally:
        await runtime.pool.close()
    assert with_history == by_hand
    assert with_history.index("No. It is blue.") < with_history.index("What is 2+2?")


# ---- a real server and the official client --------------------------------------------------------------
@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    root = tmp_path_factory.mktemp("parity-serve")
    import_gguf(Store(root / "models"), "plain:latest", smollm2_gguf)
    srv = LocalrtServer(root / "models", root / "serve.log", env={"LOCALRT_KEEP_ALIVE": "10m"})
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)
    assert "Traceback" not in srv.log_path.read_text(errors="replace")


def test_client_create_with_messages_answers_as_the_spelled_out_chat(server: LocalrtServer) -> None:
    client = ollama.Client(host=server.url)
    client.create("fewshot:client", from_="plain:latest", system="Be brief.", messages=HISTORY)
    shown = httpx.post(server.url + "/api/show", json={"model": "fewshot:client"}, timeout=60).json()
    assert shown["messages"] == HISTORY  # the client's ShowResponse has no `messages`: read the wire
    question = {"role": "user", "content": "And the grass?"}
    got = client.chat("fewshot:client", messages=[question], options=GREEDY)
    spelled = [{"role": "system", "content": "Be brief."}, *HISTORY, question]
    want = client.chat("plain:latest", messages=spelled, options=GREEDY)
    assert got.message.content == want.message.content


def test_generate_puts_history_before_the_prompt(server: LocalrtServer) -> None:
    client = ollama.Client(host=server.url)
    client.create("fewshot:gen", from_="plain:latest", system="Be brief.", messages=HISTORY)
    got = client.generate("fewshot:gen", "And the sun?", options=GREEDY)
    spelled = [
        {"role": "system", "content": "Be brief."},
        *HISTORY,
        {"role": "user", "content": "And the sun?"},
    ]
    want = client.chat("plain:latest", messages=spelled, options=GREEDY)
    assert got.response == want.message.content


def test_api_create_takes_requires_parser_renderer(server: LocalrtServer) -> None:
    body = {
        "model": "fmt:x",
        "from": "plain:latest",
        "parser": "harmony",
        "renderer": "glm-4.7",
        "requires": "0.0.1",
    }
    assert (
        httpx.post(server.url + "/api/create", json={**body, "stream": False}, timeout=60).status_code == 200
    )
    shown = httpx.post(server.url + "/api/show", json={"model": "fmt:x"}, timeout=60).json()
    assert {k: shown.get(k) for k in ("parser", "renderer", "requires")} == {
        "parser": "harmony",
        "renderer": "glm-4.7",
        "requires": "0.0.1",
    }


def test_api_create_names_an_unknown_parser(server: LocalrtServer) -> None:
    body = {"model": "fmt:bad", "from": "plain:latest", "parser": "nonesuch", "stream": False}
    reply = httpx.post(server.url + "/api/create", json=body, timeout=60)
    assert reply.status_code == 400
    assert reply.json()["error"].startswith("unknown parser 'nonesuch'")


def test_a_thinking_parser_makes_the_model_report_thinking(server: LocalrtServer) -> None:
    client = ollama.Client(host=server.url)
    assert "thinking" not in client.show("plain:latest")["capabilities"]
    httpx.post(
        server.url + "/api/create",
        json={"model": "fmt:think", "from": "plain:latest", "parser": "qwen3-thinking", "stream": False},
        timeout=60,
    )
    assert "thinking" in client.show("fmt:think")["capabilities"]


def test_cli_create_through_a_server_carries_every_line(server: LocalrtServer, tmp_path: Path) -> None:
    modelfile = tmp_path / "Modelfile"
    lines = "".join(f'MESSAGE {m["role"]} """{m["content"]}"""\n' for m in HISTORY)
    modelfile.write_text(f"FROM plain:latest\n{lines}REQUIRES 0.0.1\nPARSER qwen3\nRENDERER olmo3\n")
    env = {**os.environ, "LOCALRT_HOST": server.url.removeprefix("http://"), "LOCALRT_MODELS": "/nonexistent"}
    proc = subprocess.run(
        [sys.executable, "-m", "localrt", "create", "fewshot:cli", "-f", str(modelfile)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    shown = httpx.post(server.url + "/api/show", json={"model": "fewshot:cli"}, timeout=60).json()
    assert {k: shown.get(k) for k in ("messages", "requires", "parser", "renderer")} == {
        "messages": HISTORY,
        "requires": "0.0.1",
        "parser": "qwen3",
        "renderer": "olmo3",
    }
