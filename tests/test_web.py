"""The chat page (localrt/web/, served by localrt/api/web.py) in a real browser.

Debian's `chromium` package, driven by Playwright for Python, against a real `localrt serve` holding the
real SmolLM2, the tiny vision model (tests/fixtures_vision.py) and a tiny random model whose greedy answer
never ends. One browser is launched for the module; each test opens a fresh context (its own IndexedDB).
A test that loads the page fails on any console error, CSP violations included.

`LOCALRT_UPDATE_SCREENSHOT=1` saves the screenshots into docs/ (web-chat.png, web-settings.png,
web-phone.png); otherwise they go to the test's temporary folder.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest

from localrt.store.catalog import load_catalog
from localrt.store.importer import import_gguf
from localrt.store.store import Store
from tests.families import FAMILIES
from tests.families import forced
from tests.fixtures_vision import png_bytes
from tests.fixtures_vision import tiny_vlm
from tests.gguf_factory import write_tiny_llama
from tests.servers.registry import Registry
from tests.servers.serve import LocalrtServer

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
if not CHROMIUM.exists():
    if os.environ.get("CI"):
        raise RuntimeError(f"CI: {CHROMIUM} is missing (.ci/run installs Debian's chromium package)")
    pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extras")
expect = sync_api.expect

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SMOL = "smollm2:135m"
VLM = "tiny-vlm:latest"
ENDLESS = "tiny:latest"  # random weights: a greedy answer that never reaches an end token
THINKER = "qwen3-forced:tiny"  # a tiny Qwen3 whose Modelfile grammar forces this reply
THOUGHT = "The page folds this."
THINKING_REPLY = f"<think>\n{THOUGHT}\n</think>\n\nIt is sunny."
CODER = "smollm2:coder"  # SmolLM2 whose Modelfile grammar forces this reply
CODE = "def add(a, b):\n    return a + b"
CODE_REPLY = f"Here it is:\n\n```python\n{CODE}\n```\n"
SMOL_TEMPERATURE = "0.3"  # in SmolLM2's Modelfile here, so the settings show it as the model's default
TIMEOUT_MS = 120_000  # a bound for a busy machine, not a speed target
LIVENESS = 60.0
# llama.cpp threads: on a busy 2-core machine two spinning threads slow decoding many times over
THREADS = int(os.environ.get("LOCALRT_TEST_THREADS", "1"))
# what a reply must not run (no double quotes: the JSON-schema grammar that forces it cannot hold them)
HOSTILE = "<img src=x onerror=pwned(1)> <script>pwned(2)</script> [click](javascript:pwned(3))"


@pytest.fixture(scope="module")
def store_root(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("web") / "models"
    store = Store(root)
    system = load_catalog().find(SMOL).system
    import_gguf(
        store,
        SMOL,
        smollm2_gguf,
        system=system,
        params={"temperature": float(SMOL_TEMPERATURE), "num_thread": THREADS},
    )
    model, projector = tiny_vlm()
    import_gguf(store, VLM, model, projector=projector, params={"num_thread": THREADS})
    endless = write_tiny_llama(root.parent / "tiny.gguf", context_length=2048)
    import_gguf(store, ENDLESS, endless, params={"num_thread": THREADS})
    import_gguf(store, CODER, smollm2_gguf, params={"num_thread": THREADS, "grammar": forced(CODE_REPLY)})
    qwen3 = FAMILIES["qwen3"].write(root.parent / "qwen3.gguf")
    import_gguf(
        store,
        THINKER,
        qwen3,
        params={
            "temperature": 0,
            "num_thread": THREADS,
            "grammar": forced(THINKING_REPLY, FAMILIES["qwen3"]),
        },
    )
    return root


def start_server(store_root: Path, log: Path, env: dict[str, str] | None = None) -> LocalrtServer:
    return LocalrtServer(store_root, log, env={"LOCALRT_KEEP_ALIVE": "10m", **(env or {})})


def stop_server(server: LocalrtServer) -> None:
    assert server.stop() in (0, -signal.SIGTERM)
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="module")
def server(store_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalrtServer]:
    srv = start_server(store_root, tmp_path_factory.mktemp("web-serve") / "serve.log")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()


class Page:
    """One browser context on the server's page, recording every console error and page error."""

    def __init__(self, browser: Any, url: str, **context: Any) -> None:
        self.context = browser.new_context(accept_downloads=True, **context)
        self.context.set_default_timeout(TIMEOUT_MS)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.requested: list[str] = []
        self.page.on("request", lambda r: self.requested.append(r.url))
        self.url = url

    def open(self) -> Any:
        self.page.goto(self.url)
        self.page.wait_for_selector("body[data-ready=true]")
        return self.page

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def web(browser: Any, server: LocalrtServer) -> Iterator[Page]:
    page = Page(browser, server.url, viewport={"width": 1280, "height": 800}, color_scheme="light")
    yield page
    page.close()
    assert page.errors == []
    elsewhere = [u for u in page.requested if not u.startswith((server.url + "/", "data:", "blob:"))]
    assert elsewhere == []  # nothing fetched from another host


def screenshot(page: Any, name: str, tmp_path: Path) -> Path:
    target = DOCS / name if os.environ.get("LOCALRT_UPDATE_SCREENSHOT") else tmp_path / name
    page.screenshot(path=str(target))
    assert target.read_bytes().startswith(b"\x89PNG")
    return target


def pick(page: Any, model: str) -> None:
    page.select_option("#model", model)
    page.locator(f"body[data-model='{model}']").wait_for(state="attached")


def set_options(page: Any, **options: str) -> None:
    page.click("#settings-toggle")
    for key, value in options.items():
        page.fill(f"#opt-{key}", value)
    page.click("#settings-close")


def ask(page: Any, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def last_reply(page: Any) -> Any:
    return page.locator("article.msg.assistant").last


def wait_for_reply(page: Any) -> str:
    """The last reply's text once its numbers show (the stream's final chunk came)."""
    reply = last_reply(page)
    reply.locator(".stats", has_text="tokens/s").wait_for()
    return reply.locator(".body").inner_text()


def reference(
    server: LocalrtServer, model: str, messages: list[dict[str, Any]], options: dict[str, Any]
) -> str:
    """The same request through the official `ollama` client."""
    client = ollama.Client(host=server.url, timeout=TIMEOUT_MS / 1000)
    return client.chat(model, messages=messages, options=options).message.content


# ---- `/` and the files, without a browser -----------------------------------------------------------


def test_curl_and_the_ollama_clients_still_get_the_liveness_text(server: LocalrtServer) -> None:
    curl = subprocess.run(["curl", "-s", "-i", server.url + "/"], capture_output=True, text=True, timeout=30)
    assert curl.stdout.endswith("\n\nlocalrt is running")
    assert "content-type: text/plain" in curl.stdout.lower()
    # Go's `ollama` client checks liveness with HEAD / and these headers (api/client.go Heartbeat)
    head = httpx.head(
        server.url + "/",
        headers={
            "Accept": "application/x-ndjson",
            "Content-Type": "application/json",
            "User-Agent": "ollama/0.9",
        },
    )
    assert head.status_code == 200
    assert head.headers["content-type"].startswith("text/plain")
    browser_visit = httpx.get(
        server.url + "/", headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}
    )
    assert browser_visit.text.startswith("<!doctype html>")


def test_the_page_and_its_files_carry_their_policy_and_caching(server: LocalrtServer) -> None:
    page = httpx.get(server.url + "/", headers={"Accept": "text/html"})
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp
    assert "script-src 'self';" in csp
    assert "img-src 'self' data: blob:" in csp
    assert page.headers["cache-control"] == "no-cache"
    assert "<script>" not in page.text  # no inline script: the CSP would refuse it
    assets = re.findall(r'(?:src|href)="(/ui/[0-9a-f]{16}/[^"]+)"', page.text)
    assert sorted(a.rsplit("/", 1)[1] for a in assets) == ["app.css", "app.js", "icon.svg"]
    app = httpx.get(server.url + assets[0])
    assert app.headers["cache-control"] == "public, max-age=31536000, immutable"
    assert app.headers["content-security-policy"] == csp
    version = assets[0].split("/")[2]
    stale = assets[0].replace(version, "0" * 16)
    assert httpx.get(server.url + stale).status_code == 404  # an old release's URL is never new bytes
    assert httpx.get(server.url + f"/ui/{version}/..%2F..%2Fconfig.py").status_code == 404
    assert httpx.get(server.url + f"/ui/{version}/vendor/LICENSE.marked").status_code == 200


def test_localrt_ui_off_answers_browsers_with_the_text(
    store_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastapi.testclient import TestClient

    from localrt.api.app import create_app

    monkeypatch.setenv("LOCALRT_UI", "off")
    client = TestClient(create_app(store=Store(store_root)), base_url="http://127.0.0.1")
    visit = client.get("/", headers={"Accept": "text/html"})
    assert visit.text == "localrt is running"
    page = client.get("/ui/x/app.js")
    assert page.status_code == 404


# ---- the page in Chromium ---------------------------------------------------------------------------


def test_a_conversation_streams_keeps_its_numbers_and_survives_a_reload(
    web: Page, server: LocalrtServer, tmp_path: Path
) -> None:
    page = web.open()
    pick(page, SMOL)
    set_options(page, temperature="0", num_predict="48", num_ctx="2048")
    # every text the reply showed while it streamed: more than two means it came in pieces
    page.evaluate(
        """() => { window.drawn = new Set();
        new MutationObserver(() => { const b = document.querySelector('article.assistant:last-of-type .body');
          if (b) window.drawn.add(b.textContent); }).observe(document.getElementById('messages'),
          {childList: true, subtree: true, characterData: true}); }"""
    )
    question = "Write a Python function that adds two numbers."
    ask(page, question)
    wait_for_reply(page)
    options = {"temperature": 0, "num_predict": 48, "num_ctx": 2048}
    expected = reference(server, SMOL, [{"role": "user", "content": question}], options)
    [conversation] = stored(page)
    assert [m["role"] for m in conversation["messages"]] == ["user", "assistant"]
    assert conversation["messages"][1]["content"] == expected  # the same tokens as the official client's
    assert page.evaluate("window.drawn.size") > 2
    stats = last_reply(page).locator(".stats").inner_text()
    assert re.search(r"\d+\.\d tokens/s", stats)
    assert re.search(r"first token \d+\.\d\d s", stats)
    assert re.search(r"context \d+ / 2048 tokens", stats)
    if "```" in expected:
        assert last_reply(page).locator("pre.code code.hljs span").count() > 0  # highlighted
        assert last_reply(page).locator("button.copy").count() >= 1
    body_text = last_reply(page).locator(".body").text_content()
    screenshot(page, "web-chat.png", tmp_path)

    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert page.locator("article.msg.user .body").inner_text() == question
    assert last_reply(page).locator(".body").text_content() == body_text
    assert page.locator("#conversations li.current").inner_text().startswith(question[:20])


def stored(page: Any) -> list[dict[str, Any]]:
    """Every conversation in the page's IndexedDB, as the page saved it."""
    return page.evaluate(
        """() => new Promise((resolve, reject) => { const open = indexedDB.open('localrt');
          open.onerror = () => reject(open.error);
          open.onsuccess = () => { const all = open.result.transaction('conversations')
            .objectStore('conversations').getAll(); all.onsuccess = () => resolve(all.result); }; })"""
    )


def replies(page: Any) -> list[str]:
    [conversation] = stored(page)
    return [m["content"] for m in conversation["messages"] if m["role"] == "assistant"]


def test_edit_regenerate_rename_export_and_delete(web: Page, server: LocalrtServer, tmp_path: Path) -> None:
    page = web.open()
    pick(page, SMOL)
    set_options(page, temperature="0", num_predict="8", num_ctx="1024")
    ask(page, "Say hello.")
    wait_for_reply(page)
    options = {"temperature": 0, "num_predict": 8, "num_ctx": 1024}
    hello = reference(server, SMOL, [{"role": "user", "content": "Say hello."}], options)
    colour = reference(server, SMOL, [{"role": "user", "content": "Name a colour."}], options)
    assert replies(page) == [hello]
    page.locator("article.msg.user button", has_text="Edit").click()
    page.fill("article.msg.user textarea.edit", "Name a colour.")
    page.press("article.msg.user textarea.edit", "Enter")
    wait_for_reply(page)
    assert page.locator("article.msg").count() == 2  # the edit replaced the turn and its reply
    assert page.locator("article.msg.user .body").inner_text() == "Name a colour."
    assert replies(page) == [colour]

    last_reply(page).locator("button", has_text="Regenerate").click()
    wait_for_reply(page)
    assert replies(page) == [colour]  # greedy: the same answer again, in place of the old one
    assert page.locator("article.msg").count() == 2

    page.locator("#conversations li.current button", has_text="Rename").click()
    page.fill("#ask-input", "Colours")
    page.click("#ask-ok")
    expect(page.locator("#conversations li.current .conv-open")).to_have_text("Colours")

    with page.expect_download() as download:
        page.click("#export-json")
    exported = json.loads(Path(download.value.path()).read_text())
    assert exported["title"] == "Colours"
    assert [m["role"] for m in exported["messages"]] == ["user", "assistant"]
    with page.expect_download() as download:
        page.click("#export-md")
    markdown = Path(download.value.path()).read_text()
    assert markdown.startswith("# Colours\n")
    assert "## User\n\nName a colour." in markdown

    page.locator("#conversations li.current button", has_text="Delete").click()
    page.click("#ask-ok")
    expect(page.locator("#conversations li")).to_have_count(0)
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert page.locator("#conversations li").count() == 0  # gone from IndexedDB, not only the list


def metrics(server: LocalrtServer, model: str) -> tuple[int, int]:
    """(requests waiting or running on the model, tokens of finished answers) from /metrics."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    depth = re.search(rf'^localrt_queue_depth{{model="{re.escape(model)}"}} (\d+)$', text, re.M)
    tokens = re.search(r"^localrt_generated_tokens_total (\d+)$", text, re.M)
    assert tokens is not None, text
    return (int(depth.group(1)) if depth else 0), int(tokens.group(1))


def test_esc_stops_a_reply_and_the_server_frees_it(web: Page, server: LocalrtServer) -> None:
    page = web.open()
    pick(page, ENDLESS)
    set_options(page, temperature="0")
    _, tokens_before = metrics(server, ENDLESS)
    ask(page, "Tell me a very long story.")
    # the page's CSP refuses the string evaluation Playwright's wait_for_function uses: poll instead
    reply_length = (
        "(document.querySelector('article.assistant:last-of-type .body')?.textContent || '').length"
    )
    start = time.monotonic()
    while page.evaluate(reply_length) <= 20:
        assert time.monotonic() - start < LIVENESS, "the reply never streamed"
        page.wait_for_timeout(50)
    assert page.locator("#stop").is_visible()
    page.keyboard.press("Escape")
    last_reply(page).locator(".stats", has_text="stopped").wait_for()
    assert page.locator("#send").is_visible()
    start = time.monotonic()
    while metrics(server, ENDLESS)[0] != 0:
        assert time.monotonic() - start < LIVENESS, "the stopped generation still holds its sequence"
        time.sleep(0.05)
    assert metrics(server, ENDLESS)[1] == tokens_before  # cut, not run to its cap for nobody


def drop_and_paste(page: Any, png: bytes) -> None:
    """Drop one image on the chat and paste the same one into the prompt, as a user's browser does."""
    page.evaluate(
        """b64 => {
          const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
          const file = () => { const t = new DataTransfer(); t.items.add(new File([bytes], 'x.png', {type: 'image/png'})); return t; };
          document.querySelector('main').dispatchEvent(new DragEvent('drop', {dataTransfer: file(), bubbles: true, cancelable: true}));
          document.getElementById('prompt').dispatchEvent(new ClipboardEvent('paste', {clipboardData: file(), bubbles: true, cancelable: true}));
        }""",
        base64.b64encode(png).decode(),
    )


def test_an_image_is_attached_and_answered_by_the_vision_model(web: Page, server: LocalrtServer) -> None:
    png = png_bytes(seed=3)
    page = web.open()
    pick(page, SMOL)
    drop_and_paste(page, png)
    page.locator("#status", has_text="does not take images").wait_for()
    assert page.locator("#attachments figure").count() == 0

    pick(page, VLM)
    set_options(page, temperature="0", num_predict="6", num_ctx="512")
    drop_and_paste(page, png)
    expect(page.locator("#attachments figure")).to_have_count(2)
    page.locator("#attachments button").last.click()  # remove the pasted copy
    assert page.locator("#attachments figure").count() == 1
    ask(page, "What is in the picture?")
    wait_for_reply(page)
    assert page.locator("article.msg.user img").count() == 1
    options = {"temperature": 0, "num_predict": 6, "num_ctx": 512}
    question = "What is in the picture?"
    image = base64.b64encode(png).decode()
    with_image = reference(server, VLM, [{"role": "user", "content": question, "images": [image]}], options)
    without = reference(server, VLM, [{"role": "user", "content": question}], options)
    assert with_image != without  # the image changes this model's answer
    assert replies(page) == [with_image]


def test_a_pull_shows_its_progress(web: Page, server: LocalrtServer, tmp_path: Path) -> None:
    tiny = write_tiny_llama(tmp_path / "pulled.gguf", n_embd=128, n_ff=256)
    with Registry() as registry:
        registry.delay = 0.05  # a slow link, in 64 KiB steps
        registry.add_model("library/pulled", "1", tiny)
        name = f"{registry.address}/library/pulled:1"
        page = web.open()
        page.evaluate(
            """() => { window.progress = [];
            const bar = document.getElementById('pull-progress');
            new MutationObserver(() => window.progress.push([bar.value, bar.max])).observe(bar,
              {attributes: true, attributeFilter: ['value', 'max']}); }"""
        )
        page.fill("#pull-name", name)
        page.check("#pull-insecure")
        page.click("#pull-button")
        page.locator("#pull-status", has_text="pulled").wait_for()
    size = tiny.stat().st_size
    seen = [v for v, m in page.evaluate("window.progress") if m == size]
    assert len(set(seen)) > 3  # the bar moved in steps
    assert seen == sorted(seen)
    assert seen[-1] == size
    assert page.locator(f"#model option[value='{name}']").count() == 1
    httpx.request("DELETE", server.url + "/api/delete", json={"model": name})


def test_a_reply_with_html_and_script_runs_nothing(web: Page) -> None:
    page = web.open()
    pick(page, SMOL)
    page.evaluate("() => { window.ran = []; window.pwned = (n) => { window.ran.push(n); }; }")
    # the grammar makes the model say exactly this (a JSON string holding the markup)
    page.click("#settings-toggle")
    page.fill("#set-format", json.dumps({"const": HOSTILE}))
    page.fill("#opt-temperature", "0")
    page.click("#settings-close")
    ask(page, "Say something.")
    wait_for_reply(page)
    assert replies(page) == [json.dumps(HOSTILE)]  # the model did say it
    body = last_reply(page).locator(".body")
    shown = body.inner_text()
    assert "<img src=x onerror=pwned(1)>" in shown
    assert "<script>pwned(2)</script>" in shown
    assert body.locator("img, script, iframe, object, embed").count() == 0
    assert body.locator("a[href^='javascript']").count() == 0
    assert page.evaluate("window.ran") == []


def test_code_is_highlighted_and_copied(web: Page) -> None:
    web.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=web.url)
    page = web.open()
    pick(page, CODER)
    page.fill("#prompt", "Add two numbers")
    page.press("#prompt", "Shift+Enter")
    page.keyboard.type("in Python.")
    assert page.input_value("#prompt") == "Add two numbers\nin Python."  # Shift+Enter: a new line
    assert page.locator("article.msg").count() == 0  # ... and nothing sent
    page.press("#prompt", "Enter")
    wait_for_reply(page)
    assert replies(page) == [CODE_REPLY]
    code = last_reply(page).locator("pre.code code")
    assert code.text_content() == CODE
    assert code.locator("span.hljs-keyword").first.text_content() == "def"  # highlighted as Python
    last_reply(page).locator("button.copy").click()
    assert page.evaluate("navigator.clipboard.readText()") == CODE
    assert page.locator("#loaded li", has_text=CODER).locator("text=/MiB in RAM/").count() == 1
    page.click(f"button[aria-label='Unload {CODER}']")
    expect(page.locator("#loaded li", has_text=CODER)).to_have_count(0)


def test_thinking_is_shown_folded(web: Page) -> None:
    page = web.open()
    pick(page, THINKER)
    page.click("#settings-toggle")
    assert page.locator("#think-row").is_visible()  # offered: the model has the thinking capability
    page.select_option("#set-think", "true")
    page.click("#settings-close")
    ask(page, "Weather?")
    wait_for_reply(page)
    thinking = last_reply(page).locator("details.thinking")
    assert thinking.get_attribute("open") is None  # folded
    assert thinking.locator(".thought").text_content() == THOUGHT
    assert last_reply(page).locator(".body").inner_text() == "It is sunny."
    thinking.locator("summary").click()
    assert thinking.locator(".thought").is_visible()


def test_the_settings_show_the_models_defaults_until_changed(web: Page, tmp_path: Path) -> None:
    page = web.open()
    pick(page, SMOL)
    page.click("#settings-toggle")
    assert page.get_attribute("#opt-temperature", "placeholder") == SMOL_TEMPERATURE  # its Modelfile's
    assert page.get_attribute("#opt-top_k", "placeholder") == "40"  # the runtime's
    assert page.input_value("#opt-temperature") == ""
    assert page.get_attribute("#set-system", "placeholder") == load_catalog().find(SMOL).system
    assert page.locator("#think-row").is_hidden()  # SmolLM2 does not think
    page.fill("#set-system", "You answer in French.")
    page.fill("#opt-temperature", "0.5")
    screenshot(page, "web-settings.png", tmp_path)
    page.click("#settings-reset")
    assert page.input_value("#opt-temperature") == ""


def test_phone_width_and_dark_mode(browser: Any, server: LocalrtServer, tmp_path: Path) -> None:
    web = Page(
        browser, server.url, viewport={"width": 390, "height": 844}, color_scheme="dark", is_mobile=True
    )
    page = web.open()
    pick(page, SMOL)
    set_options(page, temperature="0", num_predict="24", num_ctx="1024")
    ask(page, "What is the capital of France?")
    wait_for_reply(page)
    assert page.locator("#sidebar").is_hidden()
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing runs off the side
    background = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert background == "rgb(22, 24, 28)"  # the dark palette
    screenshot(page, "web-phone.png", tmp_path)
    page.click("#menu")
    page.locator("#sidebar").wait_for(state="visible")
    assert page.locator("#conversations li").count() == 1
    web.close()
    assert web.errors == []


def test_with_an_api_key_the_page_asks_for_it(browser: Any, store_root: Path, tmp_path: Path) -> None:
    key = "web-test-key"
    srv = start_server(store_root, tmp_path / "serve.log", env={"LOCALRT_API_KEY": key})
    try:
        web = Page(browser, srv.url)
        sent: list[str | None] = []
        web.page.on(
            "request", lambda r: sent.append(r.headers.get("authorization")) if "/api/" in r.url else None
        )
        web.page.goto(srv.url)
        dialog = web.page.locator("#key-dialog")
        dialog.wait_for(state="visible")
        web.page.fill("#key-input", "wrong")
        web.page.click("#key-ok")
        web.page.locator("#key-message", has_text="refused").wait_for()
        web.page.fill("#key-input", key)
        web.page.click("#key-ok")
        web.page.wait_for_selector("body[data-ready=true]")
        assert web.page.locator(f"#model option[value='{SMOL}']").count() == 1
        assert f"Bearer {key}" in sent
        assert None in sent  # the first call, before the page knew the key
        web.close()
    finally:
        stop_server(srv)
    refused = [e for e in web.errors if "401" not in e]
    assert refused == []  # only the refused calls' own console lines


def test_the_page_files_are_in_the_wheel(tmp_path: Path) -> None:
    import shutil
    import zipfile

    source = tmp_path / "src"  # a copy, so that the build leaves nothing in the checkout
    for part in ("localrt", "backends", "converters", "tui", "catalog"):
        shutil.copytree(ROOT / part, source / part, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, source / part)
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*build, "-w", str(tmp_path), str(source)], check=True, timeout=300)
    wheel = next(tmp_path.glob("localrt-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    web = ROOT / "localrt" / "web"
    shipped = {f"localrt/web/{p.relative_to(web).as_posix()}" for p in web.rglob("*") if p.is_file()}
    assert len(shipped) > 20
    assert shipped - names == set()
