"""Remote models against real upstreams on 127.0.0.1: a second `localrt serve` with the real
SmolLM2 is the OpenAI-compatible upstream, and a first `localrt serve` holds the remote model; the
official `ollama` and `openai` clients drive the first one. Misbehaving upstreams are real HTTP servers
(tests/servers/broken_upstream.py). Greedy decoding and short answers keep it fast.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import ollama
import openai
import pytest

from localrt.store.importer import import_gguf
from localrt.store.remote import create_remote
from localrt.store.store import Store
from tests.agent_templates import CHATML_JSON_TOOLS
from tests.servers.broken_upstream import BrokenUpstream
from tests.servers.serve import LocalrtServer

UPSTREAM_MODEL = "smollm2:135m"
UPSTREAM_KEY = "upstream-secret-4f9a"  # the upstream's LOCALRT_API_KEY; the front reads it from FAR_KEY
GREEDY = {"temperature": 0, "seed": 1, "num_predict": 16}
# the same schemas and tool as the local-model client tests, so both paths answer one question
from tests.test_api_clients import CALL_SCHEMA  # noqa: E402
from tests.test_api_clients import CITY_SCHEMA  # noqa: E402
from tests.test_api_clients import WEATHER_TOOL  # noqa: E402

PARIS = [{"role": "user", "content": "What is the capital of France?"}]
COUNTING = "Count from one to ten thousand, one number per line."  # far longer than any test waits


def start_upstream(root: Path, smollm2_gguf: Path, name: str, port: int | None = None) -> LocalrtServer:
    models = root / name / "models"
    if not models.exists():
        # ChatML that shows tools as JSON (SmolLM2's calls are bare JSON), so the upstream takes tools
        template = CHATML_JSON_TOOLS
        import_gguf(
            Store(models),
            UPSTREAM_MODEL,
            smollm2_gguf,
            system="You are a helpful assistant.",
            template=template,
        )
    env = {"LOCALRT_API_KEY": UPSTREAM_KEY, "LOCALRT_KEEP_ALIVE": "30m"}
    return LocalrtServer(models, root / name / "serve.log", env=env, port=port)


def metric(server_url: str, name: str, label: str = "") -> float:
    """A value of the server's /metrics (0 when the series is absent)."""
    text = httpx.get(server_url + "/metrics", headers={"Authorization": f"Bearer {UPSTREAM_KEY}"}).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and label in line and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_until(condition: Callable[[], bool], limit: float = 600) -> None:
    """Poll a condition; `limit` is a liveness bound for a loaded machine, not a speed target."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "gave up waiting"
        time.sleep(0.2)


def completions_served(server_url: str) -> float:
    return metric(server_url, "localrt_requests_total", 'route="/v1/chat/completions",status="200"')


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("remote")


@pytest.fixture(scope="module")
def upstream(root: Path, smollm2_gguf: Path) -> Iterator[LocalrtServer]:
    srv = start_upstream(root, smollm2_gguf, "upstream")
    yield srv
    srv.stop()
    assert "Traceback" not in srv.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def front(root: Path, upstream: LocalrtServer) -> Iterator[LocalrtServer]:
    store = Store(root / "front" / "models")
    create_remote(store, "far", [upstream.url + "/v1"], model=UPSTREAM_MODEL, api_key_env="FAR_KEY")
    srv = LocalrtServer(store.root, root / "front.log", env={"FAR_KEY": UPSTREAM_KEY})
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM)
    log = srv.log_path.read_text(errors="replace")
    assert "Traceback" not in log
    assert UPSTREAM_KEY not in log


@pytest.fixture(scope="module")
def client(front: LocalrtServer) -> ollama.Client:
    return ollama.Client(host=front.url, timeout=300)


@pytest.fixture(scope="module")
def oai(front: LocalrtServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=front.url + "/v1", api_key="unused", max_retries=0, timeout=300)


# ---- the Ollama and OpenAI routes on a remote model ----------------------------------------------
def test_chat_streamed_and_not(client: ollama.Client) -> None:
    whole = client.chat("far", messages=PARIS, options=GREEDY)
    assert "Paris" in whole.message.content
    assert whole.prompt_eval_count > 0  # the upstream's usage, in Ollama's fields
    assert whole.eval_count > 0
    assert whole.eval_duration > 0
    parts = list(client.chat("far", messages=PARIS, options=GREEDY, stream=True))
    assert len(parts) > 2
    assert parts[-1].done
    assert "Paris" in "".join(p.message.content for p in parts)


def test_openai_chat_streamed_and_not(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(model="far", messages=PARIS, temperature=0, max_tokens=16)
    assert "Paris" in r.choices[0].message.content
    assert r.usage.completion_tokens > 0
    stream = oai.chat.completions.create(
        model="far",
        messages=PARIS,
        temperature=0,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[-1].usage.completion_tokens > 0


def test_raw_generate_uses_completions(
    client: ollama.Client, oai: openai.OpenAI, upstream: LocalrtServer
) -> None:
    before = metric(upstream.url, "localrt_requests_total", 'route="/v1/completions",status="200"')
    r = oai.completions.create(model="far", prompt="The capital of France is", temperature=0, max_tokens=4)
    assert r.choices[0].text.strip()
    g = client.generate("far", "The capital of France is", raw=True, options={**GREEDY, "num_predict": 4})
    assert g.response.strip()
    after = metric(upstream.url, "localrt_requests_total", 'route="/v1/completions",status="200"')
    assert after - before == 2


def test_tools_ollama_and_openai(client: ollama.Client, oai: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat(
        "far", messages=ask, tools=[WEATHER_TOOL], format=CALL_SCHEMA, options={**GREEDY, "num_predict": 48}
    )
    assert r.message.tool_calls, r.message
    assert r.message.tool_calls[0].function.name == "get_weather"
    assert isinstance(r.message.tool_calls[0].function.arguments["city"], str)
    # the call's result goes back through the remote model (ids pair it with the call upstream)
    follow = client.chat(
        "far",
        messages=[
            *ask,
            r.message,
            {"role": "tool", "content": '{"sky": "clear"}', "tool_name": "get_weather"},
        ],
        tools=[WEATHER_TOOL],
        options={**GREEDY, "num_predict": 4},
    )
    assert follow.done
    o = oai.chat.completions.create(
        model="far",
        messages=ask,
        tools=[WEATHER_TOOL],
        response_format={"type": "json_schema", "json_schema": {"name": "call", "schema": CALL_SCHEMA}},
        temperature=0,
        max_tokens=48,
    )
    assert o.choices[0].finish_reason == "tool_calls"
    assert o.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_json_schema_ollama_and_openai(client: ollama.Client, oai: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Where is the Eiffel Tower? Answer in JSON."}]
    r = client.chat("far", messages=ask, format=CITY_SCHEMA, options={**GREEDY, "num_predict": 48})
    jsonschema.validate(json.loads(r.message.content), CITY_SCHEMA)
    o = oai.chat.completions.create(
        model="far",
        messages=ask,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}},
        temperature=0,
        max_tokens=48,
    )
    jsonschema.validate(json.loads(o.choices[0].message.content), CITY_SCHEMA)


def test_embeddings(client: ollama.Client, oai: openai.OpenAI) -> None:
    texts = ["The cat sat on the mat.", "Stock markets fell sharply today."]
    r = client.embed("far", texts)
    assert len(r.embeddings) == 2
    assert len(r.embeddings[0]) == 576
    assert r.prompt_eval_count > 0
    o = oai.embeddings.create(model="far", input=texts[0])
    assert o.data[0].embedding == pytest.approx(r.embeddings[0], abs=1e-4)


def test_logprobs(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(
        model="far", messages=PARIS, temperature=0, max_tokens=4, logprobs=True, top_logprobs=2
    )
    first = r.choices[0].logprobs.content[0]
    assert len(first.top_logprobs) == 2
    assert first.logprob == pytest.approx(max(t.logprob for t in first.top_logprobs), abs=1e-4)


def test_tokenize_goes_upstream(front: LocalrtServer, upstream: LocalrtServer) -> None:
    ours = httpx.post(front.url + "/api/tokenize", json={"model": "far", "text": "Hello world"}).json()
    theirs = httpx.post(
        upstream.url + "/api/tokenize",
        json={"model": UPSTREAM_MODEL, "text": "Hello world"},
        headers={"Authorization": f"Bearer {UPSTREAM_KEY}"},
    ).json()
    assert ours["tokens"] == theirs["tokens"]


def test_options_the_upstream_cannot_honour_are_400(client: ollama.Client) -> None:
    for option in ({"mirostat": 2}, {"num_ctx": 8192}, {"typical_p": 0.5}):
        with pytest.raises(ollama.ResponseError) as err:
            client.chat("far", messages=PARIS, options={**GREEDY, **option})
        assert err.value.status_code == 400
        assert next(iter(option)) in str(err.value)


def test_ps_list_show_rm(front: LocalrtServer, client: ollama.Client, upstream: LocalrtServer) -> None:
    client.chat("far", messages=PARIS, options={**GREEDY, "num_predict": 1})
    [row] = [m for m in client.ps().models if m.model == "far:latest"]
    assert row.details.format == "remote"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "localrt", *args]
        return subprocess.run(cmd, capture_output=True, text=True, env=front.env, timeout=120)

    ps = run("ps")
    assert "remote (1 endpoint)" in ps.stdout
    listed = run("list")
    assert "far:latest" in listed.stdout
    shown = run("show", "far")
    assert f"{upstream.url}/v1" in shown.stdout
    assert re.search(r"/v1\s+ok", shown.stdout)
    assert UPSTREAM_MODEL in shown.stdout
    modelfile = run("show", "far", "--modelfile").stdout
    assert f"FROM {upstream.url}/v1" in modelfile
    assert "PARAMETER api_key_env FAR_KEY" in modelfile
    api = client.show("far")
    assert api.modelfile == modelfile
    # rm works on a remote model: a copy goes, the original stays
    client.copy("far", "far-copy")
    removed = run("rm", "far-copy")
    assert removed.returncode == 0
    assert "far-copy:latest" not in run("list").stdout


def test_create_remote_while_a_server_runs(front: LocalrtServer, upstream: LocalrtServer) -> None:
    """`localrt create --remote` with a server up writes the store itself (it asks the upstream for its
    one model with the key from its own environment), and the running server serves the new model."""
    cmd = [
        sys.executable,
        "-m",
        "localrt",
        "create",
        "asked",
        "--remote",
        upstream.url,
        "--api-key-env",
        "FAR_KEY",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=front.env, timeout=120)
    assert r.returncode == 0, r.stderr
    resolved = Store(Path(front.env["LOCALRT_MODELS"])).resolve("asked")
    assert resolved.remote["model"] == UPSTREAM_MODEL
    assert resolved.remote["endpoints"] == [upstream.url + "/v1"]
    answer = ollama.Client(host=front.url, timeout=300).chat("asked", messages=PARIS, options=GREEDY)
    assert "Paris" in answer.message.content
    Store(Path(front.env["LOCALRT_MODELS"])).remove(resolved.name)


def test_cancel_stops_the_upstream(front: LocalrtServer, upstream: LocalrtServer) -> None:
    """Our client goes away mid-answer: the upstream's request ends too (its own queue gauge says so)."""
    depth = lambda: metric(upstream.url, "localrt_queue_depth", f'model="{UPSTREAM_MODEL}"')  # noqa: E731
    assert depth() == 0
    generated = metric(upstream.url, "localrt_generated_tokens_total")
    body = {
        "model": "far",
        "prompt": COUNTING,
        "options": {"temperature": 0, "num_predict": 4000},
    }
    with httpx.stream("POST", front.url + "/api/generate", json=body, timeout=120) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                assert depth() == 1  # generating upstream right now
                break
    wait_until(lambda: depth() == 0, limit=60)
    # cancelled, not finished: a finished answer would have been counted in the upstream's token total
    assert metric(upstream.url, "localrt_generated_tokens_total") == generated
    assert metric(front.url, "localrt_queue_depth", 'model="far:latest"') == 0


def test_queue_limit_applies_per_remote_model(root: Path, upstream: LocalrtServer) -> None:
    store = Store(root / "queued" / "models")
    create_remote(store, "q", [upstream.url + "/v1"], model=UPSTREAM_MODEL, api_key_env="FAR_KEY")
    env = {"FAR_KEY": UPSTREAM_KEY, "LOCALRT_NUM_PARALLEL": "1", "LOCALRT_MAX_QUEUE": "1"}
    srv = LocalrtServer(store.root, root / "queued.log", env=env)
    long = {
        "model": "q",
        "prompt": COUNTING,
        "options": {"temperature": 0, "num_predict": 4000},
    }
    short = {"model": "q", "prompt": "Hi", "stream": False, "options": {"temperature": 0, "num_predict": 2}}
    waited: list[int] = []

    def wait_in_queue() -> None:
        waited.append(httpx.post(srv.url + "/api/generate", json=short, timeout=120).status_code)

    try:
        with httpx.stream("POST", srv.url + "/api/generate", json=long, timeout=120) as first:
            lines = first.iter_lines()  # kept: dropping the iterator would close the connection
            next(lines)  # running: the model's one slot is taken
            waiting = threading.Thread(target=wait_in_queue, daemon=True)
            waiting.start()
            deadline = time.monotonic() + 30
            while (
                metric(srv.url, "localrt_queue_depth", 'model="q:latest"') < 2 and time.monotonic() < deadline
            ):
                time.sleep(0.05)
            assert metric(srv.url, "localrt_queue_depth", 'model="q:latest"') == 2  # one runs, one waits
            third = httpx.post(srv.url + "/api/generate", json=short, timeout=60)
            assert third.status_code == 503
        waiting.join(timeout=120)
        assert waited == [200]  # the one in the queue was served once the slot came free
    finally:
        srv.stop()


# ---- failures ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["500", "garbage"])
def test_broken_upstream_is_a_502_naming_it(front: LocalrtServer, client: ollama.Client, mode: str) -> None:
    with BrokenUpstream(mode) as broken:
        store = Store(Path(front.env["LOCALRT_MODELS"]))
        create_remote(store, f"broken-{mode}", [broken.url + "/v1"], model="broken", api_key_env="FAR_KEY")
        with pytest.raises(ollama.ResponseError) as err:
            client.chat(f"broken-{mode}", messages=PARIS, options=GREEDY)
        assert err.value.status_code == 502
        assert broken.url in str(err.value)
        assert UPSTREAM_KEY not in str(err.value)  # the 500 echoed our Authorization header back
        r = httpx.post(
            front.url + "/v1/chat/completions", json={"model": f"broken-{mode}", "messages": PARIS}
        )
        assert r.status_code == 502
        assert broken.url in r.json()["error"]["message"]
        store.remove(store.resolve(f"broken-{mode}").name)
    assert "Paris" in client.chat("far", messages=PARIS, options=GREEDY).message.content  # still serving


def test_key_never_follows_a_redirect(front: LocalrtServer, client: ollama.Client) -> None:
    with (
        BrokenUpstream("record") as elsewhere,
        BrokenUpstream("redirect", redirect_to=elsewhere.url) as redirecting,
    ):
        store = Store(Path(front.env["LOCALRT_MODELS"]))
        create_remote(store, "redirecting", [redirecting.url + "/v1"], model="broken", api_key_env="FAR_KEY")
        with pytest.raises(ollama.ResponseError) as err:
            client.chat("redirecting", messages=PARIS, options=GREEDY)
        assert err.value.status_code == 502
        assert "redirect" in str(err.value)
        sent = [{k.lower(): v for k, v in h.items()}.get("authorization") for _, _, h in redirecting.seen]
        assert f"Bearer {UPSTREAM_KEY}" in sent
        assert elsewhere.seen == []
        store.remove(store.resolve("redirecting").name)


def test_dead_pool_is_a_502_naming_every_endpoint(front: LocalrtServer, client: ollama.Client) -> None:
    from tests.servers.serve import free_port

    ports = {free_port() for _ in range(4)}
    urls = [f"http://127.0.0.1:{p}/v1" for p in sorted(ports)[:2]]
    store = Store(Path(front.env["LOCALRT_MODELS"]))
    create_remote(store, "dead", urls, model="x")
    with pytest.raises(ollama.ResponseError) as err:
        client.chat("dead", messages=PARIS)
    assert err.value.status_code == 502
    assert all(u in str(err.value) for u in urls)
    store.remove(store.resolve("dead").name)


def test_pool_survives_a_killed_endpoint(root: Path, smollm2_gguf: Path, upstream: LocalrtServer) -> None:
    """Two endpoints; one is killed mid-run: requests keep completing on the other (a request cut off
    after its first token may fail, cleanly; none hangs), and the dead one rejoins once restarted."""
    second = start_upstream(root, smollm2_gguf, "second")
    port = second.port
    store = Store(root / "pool" / "models")
    create_remote(
        store, "pool", [upstream.url + "/v1", second.url + "/v1"], model=UPSTREAM_MODEL, api_key_env="FAR_KEY"
    )
    srv = LocalrtServer(store.root, root / "pool.log", env={"FAR_KEY": UPSTREAM_KEY})
    client = ollama.Client(host=srv.url, timeout=300)  # a hang would end as a timeout error
    results: list[tuple[float, str]] = []  # (finished at, "ok" or the error)
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                client.chat("pool", messages=PARIS, options={**GREEDY, "num_predict": 4})
                results.append((time.monotonic(), "ok"))
            except Exception as e:
                results.append((time.monotonic(), str(e)))

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    try:
        wait_until(lambda: completions_served(second.url) >= 1)  # round-robin reached the second one
        second.proc.kill()
        second.proc.wait()
        second.log.close()
        killed_at = time.monotonic()
        wait_until(lambda: sum(t > killed_at for t, _ in results) >= 3)
        after = [r for t, r in results if t > killed_at]
        # only the request cut off mid-answer (if any) may fail, with a clear message; the rest complete
        assert after[0] == "ok" or "in the middle of the answer" in after[0]
        assert after[1:] == ["ok"] * len(after[1:])
        second = start_upstream(root, smollm2_gguf, "second", port=port)
        wait_until(lambda: completions_served(second.url) >= 1)  # it rejoined the pool
    finally:
        stop.set()
        worker.join(timeout=330)
        srv.stop()
        second.stop()
    assert not worker.is_alive()
    assert "Traceback" not in srv.log_path.read_text(errors="replace")
