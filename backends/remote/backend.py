"""The remote backend: a model served by OpenAI-compatible upstreams (vLLM, SGLang, llama-server,
another localrt), behind a protocol of their own.

`RemoteBackend.load(path, opts)` takes the model's config blob (what the store wrote at `create
--remote`), probes the endpoints and returns a `RemoteModel`. A `RemoteModel` is not a `LoadedModel`:
it has no vocabulary and no chat template, and speaks OpenAI's API to the upstream. `forward` passes an
OpenAI request on as its client wrote it (only `model` renamed) and hands back the upstream's bytes;
`generate` sends a request the runtime translated once (`upstream.chat_body`: messages to
/v1/chat/completions, where the upstream applies its own template; `completion_body`: raw prompts to
/v1/completions) and reads the answer back. Closing either iterator (our client went away) closes the
upstream connection, and the upstream stops generating.

Retries: a request that fails before its first token is tried on the next endpoint of the pool;
after the first token it fails (a half answer cannot be resumed elsewhere). The API key comes from
the environment variable the config names, is sent only in requests to the configured endpoints,
and redirects are never followed. The endpoints are checked here, at load and before each request,
whoever wrote the config (a pulled manifest never met `create`'s checks).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from typing import ClassVar

import httpx

from localrt.backends.base import CancelToken
from localrt.backends.base import Capabilities
from localrt.backends.base import DoneEvent
from localrt.backends.base import LoadOptions
from localrt.backends.remote import upstream
from localrt.backends.remote.pool import Endpoint
from localrt.backends.remote.pool import Pool
from localrt.errors import LocalrtError
from localrt.errors import ServerBusy
from localrt.store.remote import RemoteConfigError
from localrt.store.remote import api_key
from localrt.store.remote import check_endpoint
from localrt.store.remote import missing_key_message

log = logging.getLogger("localrt.remote")
# httpx logs every request at INFO: with a health check per endpoint every few seconds that would
# bury the server's own log lines
logging.getLogger("httpx").setLevel(logging.WARNING)

SLOTS_PER_ENDPOINT = 64  # requests in flight per endpoint before the runtime's queue holds the rest
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 600.0  # between two chunks: a busy cluster may queue a request for minutes
PROBE_TIMEOUT = 5.0


class RemoteError(LocalrtError):
    """An upstream failed: 502 unless the upstream blamed the request."""

    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.status = status


class EndpointFailure(Exception):
    """This endpoint could not answer (connection, 5xx, garbage): take it out, try the next one."""

    def __init__(self, reason: str, *, busy: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.busy = busy  # 429: full, not broken; it stays in the pool


def _transport_reason(e: httpx.HTTPError) -> str:
    names = {
        httpx.ConnectError: "connection refused or unreachable",
        httpx.ConnectTimeout: "connect timed out",
        httpx.ReadTimeout: "no data within the read timeout",
        httpx.RemoteProtocolError: "the connection broke",
        httpx.ReadError: "the connection broke",
    }
    return next((text for kind, text in names.items() if isinstance(e, kind)), type(e).__name__)


@dataclass(frozen=True)
class Opened:
    """An endpoint has answered 200 and sent its first bytes: what they are and who sent them."""

    media_type: str
    endpoint: str
    length: int | None = None  # the answer's bytes, where the endpoint said (Content-Length)


class RemoteBackend:
    name: ClassVar[str] = "remote"

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        return True, ""  # httpx is part of the base install

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities(embedding=True, grammar=True, devices=("remote",))

    @classmethod
    def load(cls, path: Path | str, opts: LoadOptions) -> RemoteModel:
        """`path` is the remote model's config blob (JSON with a `remote` section)."""
        try:
            config = json.loads(Path(path).read_text(encoding="utf-8"))
            section = config["remote"]
            urls = [str(u) for u in section["endpoints"]]
            model = str(section["model"])
            key_env = section.get("api_key_env")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise LocalrtError(f"{path} is not a remote model's config") from None
        if key_env is not None and not isinstance(key_env, str):
            raise LocalrtError(f"{path} is not a remote model's config")
        return RemoteModel(urls, model, key_env, opts, insecure=section.get("insecure") is True)


class RemoteModel:
    """A model served by the pool of endpoints: generate, embed, tokenize and detokenize by the upstream;
    `memory_bytes`, `processor`, `context_length` and `capabilities.parallel_slots` are what `ps` and the
    runtime's queue read."""

    backend_name = "remote"
    memory_bytes = 0
    dead = False  # an upstream's failures are its answers' own; its pool of endpoints goes on

    def __init__(
        self,
        urls: list[str],
        model: str,
        api_key_env: str | None,
        opts: LoadOptions,
        *,
        insecure: bool = False,
    ) -> None:
        if not urls:
            raise LocalrtError("a remote model needs at least one endpoint URL")
        self.insecure = insecure
        urls = list(dict.fromkeys(check_endpoint(u, insecure) for u in urls))
        self.upstream_model = model
        self.api_key_env = api_key_env or None
        self._headers(urls[0])  # a missing key is one clear error now, not every endpoint "down"
        self.processor = f"remote ({len(urls)} endpoint{'s' if len(urls) != 1 else ''})"
        self._cancelled = 0  # bumped by cancel(): running streams compare their start value
        self._clients: dict[int, tuple[asyncio.AbstractEventLoop, httpx.AsyncClient]] = {}  # one per loop
        self._sync = httpx.Client(timeout=self._timeout(), follow_redirects=False)
        self.pool = Pool(urls, self._probe)
        if not self.pool.check_all():
            self._sync.close()
            raise RemoteError(f"no endpoint of remote model {model} answers: {self.pool.describe()}")
        self.context_length = self._upstream_context() or opts.num_ctx
        slots = opts.num_parallel or SLOTS_PER_ENDPOINT * len(urls)
        self.capabilities = Capabilities(
            embedding=True, grammar=True, devices=("remote",), parallel_slots=slots
        )
        self._slots = slots
        self.pool.start()

    # ---- plumbing ----------------------------------------------------------------------------
    @staticmethod
    def _timeout() -> httpx.Timeout:
        return httpx.Timeout(READ_TIMEOUT, connect=CONNECT_TIMEOUT)

    def _headers(self, url: str) -> dict[str, str]:
        """The headers of one request to `url`: the endpoint is checked again first, then the key is
        read from its variable (a rotated key needs no reload). A missing key is logged by name here;
        the error a client sees names neither the variable nor its state."""
        if check_endpoint(url, self.insecure) != url:
            raise RemoteError(f"{url} is not a checked endpoint of remote model {self.upstream_model}")
        try:
            key = api_key(self.api_key_env, self.upstream_model)
        except RemoteConfigError:
            log.warning(
                "the variable %s holding a remote model's API key is unset or empty", self.api_key_env
            )
            raise RemoteError(missing_key_message(self.upstream_model), 400) from None
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _scrub(self, text: str) -> str:
        """An upstream's words, minus our key should it echo it back."""
        with contextlib.suppress(RemoteConfigError):
            key = api_key(self.api_key_env, self.upstream_model)
            return text.replace(key, "***") if key else text
        return text

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        entry = self._clients.get(id(loop))
        if entry is None or entry[0] is not loop:
            limits = httpx.Limits(max_connections=self._slots + 8, max_keepalive_connections=32)
            client = httpx.AsyncClient(timeout=self._timeout(), follow_redirects=False, limits=limits)
            entry = self._clients[id(loop)] = (loop, client)
        return entry[1]

    def _probe(self, endpoint: Endpoint) -> str | None:
        """A health check: /health at the server root, else the model list."""
        try:
            headers = self._headers(endpoint.url)
        except RemoteError as e:
            return str(e)
        reason = "no answer"
        for url in (endpoint.root + "/health", endpoint.url + "/models"):
            try:
                r = self._sync.get(url, headers=headers, timeout=PROBE_TIMEOUT)
            except httpx.HTTPError as e:
                return _transport_reason(e)
            if r.status_code == 200:
                return None
            reason = f"HTTP {r.status_code}"
        return reason

    def _upstream_context(self) -> int:
        """vLLM and SGLang report the served context (`max_model_len`) in their model list."""
        for endpoint in self.pool.order():
            with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError, TypeError, RemoteError):
                r = self._sync.get(
                    endpoint.url + "/models", headers=self._headers(endpoint.url), timeout=PROBE_TIMEOUT
                )
                for item in r.json().get("data") or []:
                    if item.get("id") == self.upstream_model and isinstance(item.get("max_model_len"), int):
                        return int(item["max_model_len"])
                return 0
        return 0

    def _endpoint_failure(self, endpoint: Endpoint, status: int, raw: bytes) -> EndpointFailure:
        """A non-200 answer. The request's fault (our 4xx) or refused credentials raise RemoteError: no
        endpoint would answer better. The endpoint's fault is returned, for the caller to try the next."""
        where = f"{endpoint.url} answered HTTP {status}"
        message = self._scrub(upstream.body_message(raw))
        if status in (400, 413, 422):
            raise RemoteError(f"{where}: {message}", 400)
        if status in (401, 403):
            raise RemoteError(f"{where}: the upstream refused the credentials ({message})")
        if status == 429:
            return EndpointFailure(f"busy (HTTP 429: {message})", busy=True)
        if 300 <= status < 400:
            return EndpointFailure(f"redirected (HTTP {status}); redirects are not followed")
        return EndpointFailure(f"HTTP {status}: {message}" if message else f"HTTP {status}")

    def _all_failed(self, failures: list[str]) -> RemoteError:
        """The error once every endpoint was tried: each one's reason, in the order tried."""
        return RemoteError(
            f"every endpoint of remote model {self.upstream_model} failed: {'; '.join(failures)}"
        )

    # ---- requests ------------------------------------------------------------------------------
    async def forward(
        self, path: str, body: Mapping[str, Any], cancel: CancelToken | None = None
    ) -> AsyncIterator[Opened | bytes]:
        """The upstream's answer to an OpenAI request (`body` as its client wrote it; `model` becomes
        the upstream's id), as its bytes. First comes `Opened`, once an endpoint has answered 200 and
        sent its first bytes: an endpoint that fails before that (no connection, a 5xx, no answer, a
        page that is no API answer) is taken out and the next one tried. Then the bytes, as they come;
        a failure after the first byte is an error (a half answer cannot be resumed elsewhere).
        Closing the iterator closes the upstream connection, so the upstream stops generating."""
        body = {**body, "model": self.upstream_model}
        cancelled_at_start = self._cancelled
        failures: list[str] = []
        busy = 0
        for endpoint in self.pool.order():
            try:
                response, chunks, first = await self._open(endpoint, path, body)
            except EndpointFailure as e:
                reason = self._scrub(e.reason)
                busy += e.busy
                if not e.busy:
                    self.pool.mark_failed(endpoint, reason)
                failures.append(f"{endpoint.url} ({reason})")
                continue
            try:
                length = response.headers.get("content-length", "")
                media_type = response.headers.get("content-type", "")
                yield Opened(media_type, endpoint.url, int(length) if length.isdigit() else None)
                yield first
                async for data in chunks:
                    if (cancel is not None and cancel.cancelled) or self._cancelled != cancelled_at_start:
                        return
                    yield data
            except httpx.HTTPError as e:
                reason = _transport_reason(e)
                self.pool.mark_failed(endpoint, reason)
                raise RemoteError(f"{endpoint.url} failed in the middle of the answer: {reason}") from None
            finally:
                await response.aclose()
            self.pool.mark_ok(endpoint)
            return
        if busy and busy == len(failures):
            raise ServerBusy(f"every endpoint of {self.upstream_model} is busy: {'; '.join(failures)}")
        raise self._all_failed(failures)

    async def _open(
        self, endpoint: Endpoint, path: str, body: dict[str, Any]
    ) -> tuple[httpx.Response, AsyncIterator[bytes], bytes]:
        """The endpoint's answer up to its first bytes; EndpointFailure when the endpoint is at fault,
        RemoteError when the request is (no endpoint would answer better)."""
        client = self._client()
        request = client.build_request(
            "POST", endpoint.url + path, json=body, headers=self._headers(endpoint.url)
        )
        try:
            response = await client.send(request, stream=True)
        except httpx.HTTPError as e:
            raise EndpointFailure(_transport_reason(e)) from None
        try:
            if response.status_code != 200:
                raise self._endpoint_failure(endpoint, response.status_code, await response.aread())
            media_type = response.headers.get("content-type", "")
            if "application/json" not in media_type and "text/event-stream" not in media_type:
                raise EndpointFailure(f"answered {media_type or 'no content type'}, not an API answer")
            chunks = response.aiter_bytes()
            first = await anext(chunks, b"")
        except httpx.HTTPError as e:
            await response.aclose()
            raise EndpointFailure(_transport_reason(e)) from None
        except BaseException:
            await response.aclose()
            raise
        return response, chunks, first

    async def generate(
        self, path: str, body: dict[str, Any], cancel: CancelToken
    ) -> AsyncIterator[upstream.Delta | DoneEvent]:
        """A request the runtime translated (`upstream.chat_body`, `completion_body`), its answer read:
        `upstream.Delta`s as they come, then one `DoneEvent` with the tool calls and the timings."""
        answer = upstream.Answer(chat=path == upstream.CHAT, top_logprobs=int(body.get("top_logprobs") or 0))
        sent = time.perf_counter_ns()
        first = 0
        finish: str | None = None
        cancelled_at_start = self._cancelled
        stream = self.forward(path, body, cancel)
        async with contextlib.aclosing(stream):  # closing it closes the upstream connection
            opened = await anext(stream)
            assert isinstance(opened, Opened)
            try:
                answer.start(opened.media_type)
                async for data in stream:
                    assert isinstance(data, bytes)
                    for delta in answer.feed(data):
                        first = first or time.perf_counter_ns()
                        yield delta
                for delta in answer.end():
                    first = first or time.perf_counter_ns()
                    yield delta
                calls = answer.tool_calls()
            except upstream.Garbage as e:
                raise RemoteError(f"{opened.endpoint} {e}") from None
            except upstream.UpstreamErrorEvent as e:
                status = 400 if 400 <= e.status < 500 else 502
                raise RemoteError(f"{opened.endpoint}: {self._scrub(str(e))}", status) from None
        if cancel.cancelled or self._cancelled != cancelled_at_start:
            finish = "cancel"
        elif not answer.ended():
            raise RemoteError(f"{opened.endpoint} ended the answer before its end")
        timings = answer.timings(sent, first, time.perf_counter_ns())
        yield DoneEvent(finish or answer.finish_reason(), timings, tool_calls=calls)  # type: ignore[arg-type]

    def cancel(self) -> None:
        self._cancelled += 1

    # ---- embeddings, tokens ------------------------------------------------------------------
    async def embed_counted(self, texts: Sequence[str]) -> tuple[list[list[float]], int]:
        """Vectors and the prompt tokens the upstream counted (`/v1/embeddings`)."""
        body = {"model": self.upstream_model, "input": list(texts), "encoding_format": "float"}
        failures = []
        for endpoint in self.pool.order():
            try:
                r = await self._client().post(
                    endpoint.url + "/embeddings", json=body, headers=self._headers(endpoint.url)
                )
            except httpx.HTTPError as e:
                failures.append(f"{endpoint.url} ({_transport_reason(e)})")
                self.pool.mark_failed(endpoint, _transport_reason(e))
                continue
            if r.status_code != 200:
                failure = self._endpoint_failure(endpoint, r.status_code, r.content)
                failures.append(f"{endpoint.url} ({failure})")
                continue
            return self._vectors(endpoint, r, len(texts))
        raise self._all_failed(failures)

    @staticmethod
    def _vectors(endpoint: Endpoint, r: httpx.Response, n: int) -> tuple[list[list[float]], int]:
        try:
            obj = r.json()
            data = sorted(obj["data"], key=lambda d: d.get("index", 0))
            vectors = [[float(x) for x in d["embedding"]] for d in data]
            count = int((obj.get("usage") or {}).get("prompt_tokens") or 0)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise RemoteError(f"{endpoint.url} answered embeddings in a shape that is not OpenAI's") from None
        if len(vectors) != n:
            raise RemoteError(f"{endpoint.url} answered {len(vectors)} embeddings for {n} inputs")
        return vectors, count

    def _post_sync(self, attempts: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
        """The first of `(url suffix at the server root, body)` the upstream answers; tokenize and
        detokenize live at different paths on vLLM/llama-server (`/tokenize`) and localrt (`/api/...`)."""
        tried = []
        for endpoint in self.pool.order():
            headers = self._headers(endpoint.url)
            for suffix, body in attempts:
                try:
                    r = self._sync.post(endpoint.root + suffix, json=body, headers=headers)
                except httpx.HTTPError as e:
                    tried.append(f"{endpoint.root}{suffix} ({_transport_reason(e)})")
                    break  # this endpoint is unreachable: the next one
                if r.status_code == 200:
                    with contextlib.suppress(ValueError):
                        obj = r.json()
                        if isinstance(obj, dict):
                            return obj
                tried.append(f"{endpoint.root}{suffix} (HTTP {r.status_code})")
                if r.status_code in (400, 422):
                    raise RemoteError(
                        f"{endpoint.root}{suffix}: {self._scrub(upstream.body_message(r.content))}", 400
                    )
        raise RemoteError(
            f"the upstream of {self.upstream_model} offers no tokenizer here: {'; '.join(tried)}", 501
        )

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        m = self.upstream_model
        obj = self._post_sync(
            [
                (
                    "/tokenize",
                    {
                        "model": m,
                        "prompt": text,
                        "content": text,
                        "add_special_tokens": add_special,
                        "add_special": add_special,
                        "parse_special": parse_special,
                    },
                ),
                (
                    "/api/tokenize",
                    {"model": m, "text": text, "add_special": add_special, "parse_special": parse_special},
                ),
            ]
        )
        tokens = obj.get("tokens")
        if not isinstance(tokens, list):
            raise RemoteError(f"the tokenizer of {m} answered no token list")
        # llama-server's with_pieces form: [{"id": n, "piece": ...}]
        return [int(t["id"]) if isinstance(t, dict) else int(t) for t in tokens]

    def detokenize(self, ids: Sequence[int], special: bool = False) -> str:
        m = self.upstream_model
        obj = self._post_sync(
            [
                ("/detokenize", {"model": m, "tokens": list(ids)}),
                ("/api/detokenize", {"model": m, "tokens": list(ids)}),
            ]
        )
        for key in ("prompt", "content", "text"):  # vLLM, llama-server, localrt
            if isinstance(obj.get(key), str):
                return obj[key]
        raise RemoteError(f"the detokenizer of {m} answered no text")

    def unload(self) -> None:
        self.pool.stop()
        self._sync.close()
        clients, self._clients = list(self._clients.values()), {}
        for loop, client in clients:  # each client is closed on the loop it belongs to, if that still runs
            if not loop.is_closed():
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_close_soon, client)


_closing: set[asyncio.Task[None]] = set()


def _close_soon(client: httpx.AsyncClient) -> None:
    task = asyncio.ensure_future(client.aclose())
    _closing.add(task)  # a reference until it is done
    task.add_done_callback(_closing.discard)
