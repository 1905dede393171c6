"""What the remote backend says to an upstream and reads back, in OpenAI's format: the bodies of the
requests the runtime translated once (an Ollama or Anthropic chat; an OpenAI request is forwarded as its
client wrote it), and the upstream's answer (server-sent events or one JSON object) read into deltas
(text, thinking, logprobs), tool calls with their ids, and timings."""

from __future__ import annotations

import base64
import binascii
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from localrt.backends.base import Timings
from localrt.backends.base import TokenLogprob
from localrt.backends.base import TopLogprob
from localrt.errors import OptionError

MAX_ERROR_TEXT = 300


class Garbage(Exception):
    """The upstream answered something that is not an OpenAI response."""


class UpstreamErrorEvent(Exception):
    """An `{"error": ...}` object inside the stream."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


# ---- requests -----------------------------------------------------------------------------------
CHAT = "/chat/completions"
COMPLETIONS = "/completions"
EMBEDDINGS = "/embeddings"

# Ollama's option -> the fields OpenAI-compatible servers take for it (the repeat penalty under both
# names, as vLLM and SGLang read `repetition_penalty` and llama-server `repeat_penalty`)
SAMPLING_FIELDS = {
    "temperature": ("temperature",),
    "top_p": ("top_p",),
    "top_k": ("top_k",),
    "min_p": ("min_p",),
    "presence_penalty": ("presence_penalty",),
    "frequency_penalty": ("frequency_penalty",),
    "repeat_penalty": ("repetition_penalty", "repeat_penalty"),
    "seed": ("seed",),
    "stop": ("stop",),
}


def sampling_fields(given: Mapping[str, Any]) -> dict[str, Any]:
    """The options a request (or its model's Modelfile) set, under the names OpenAI-compatible servers
    take; what was not set is not sent, so the upstream's own defaults (its model's generation config)
    apply. `top_k` 0 and a negative `seed` (Ollama's "off" and "random") mean what the server does
    unasked, and `num_predict` -1 or -2 no max_tokens: the upstream bounds an answer by its context."""
    out: dict[str, Any] = {}
    for option, names in SAMPLING_FIELDS.items():
        value = given.get(option)
        if value is None or (option == "top_k" and value <= 0) or (option == "seed" and value < 0):
            continue
        if option == "stop" and not value:
            continue
        for name in names:
            out[name] = list(value) if option == "stop" else value
    num_predict = given.get("num_predict")
    if num_predict is not None and num_predict > 0:
        out["max_tokens"] = num_predict
    return out


def response_format(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    if fmt is None:
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if not isinstance(fmt, dict):
        raise OptionError("grammars are not available for remote models")
    return {"type": "json_schema", "json_schema": {"name": "response", "schema": fmt}}


def chat_body(
    messages: list[dict[str, Any]],
    given: Mapping[str, Any],
    *,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool | None = None,
    fmt: str | dict[str, Any] | None = None,
    top_logprobs: int | None = None,
) -> dict[str, Any]:
    """An Ollama- or Anthropic-shaped chat, translated once into OpenAI's: the runtime's (Ollama's)
    messages, and only the fields the request set. `top_logprobs` None: no logprobs asked for."""
    fields: dict[str, Any] = {"messages": openai_messages(messages)}
    if tools:
        fields["tools"] = tools
        if tool_choice is not None and tool_choice != "auto":
            fields["tool_choice"] = tool_choice
        if parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = parallel_tool_calls
    if top_logprobs is not None:
        fields["logprobs"] = True
        if top_logprobs:
            fields["top_logprobs"] = top_logprobs
    return _streamed(fields, given, fmt)


def completion_body(
    prompt: str,
    given: Mapping[str, Any],
    *,
    fmt: str | dict[str, Any] | None = None,
    top_logprobs: int | None = None,
) -> dict[str, Any]:
    """A raw prompt for the upstream's completions, with only the fields the request set."""
    fields: dict[str, Any] = {"prompt": prompt}
    if top_logprobs is not None:
        fields["logprobs"] = max(1, top_logprobs)  # the legacy field is a count; 0 asks for none
    return _streamed(fields, given, fmt)


def _streamed(
    fields: dict[str, Any], given: Mapping[str, Any], fmt: str | dict[str, Any] | None
) -> dict[str, Any]:
    """The body with what chat and completions read the same way. Always streamed from the upstream,
    with its usage: closing the stream is how a cancelled request stops the upstream's generation."""
    body: dict[str, Any] = {
        **fields,
        **sampling_fields(given),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    rf = response_format(fmt)
    if rf is not None:
        body["response_format"] = rf
    return body


def openai_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runtime's (Ollama-shaped) messages as OpenAI's: arguments as JSON text, ids pairing tool
    calls with their results, images as data-URL parts."""
    out: list[dict[str, Any]] = []
    open_ids: list[str] = []  # calls not yet answered, for tool messages that name no id
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.get("role"), "content": m.get("content") or ""}
        if m.get("images"):
            msg["content"] = [{"type": "text", "text": msg["content"]}] + [
                {"type": "image_url", "image_url": {"url": data_url(img)}} for img in m["images"]
            ]
        if m.get("tool_calls"):
            msg["tool_calls"] = [_openai_call(c, f"call_{i}_{j}") for j, c in enumerate(m["tool_calls"])]
            open_ids.extend(c["id"] for c in msg["tool_calls"])
        if msg["role"] == "tool":
            msg["tool_call_id"] = m.get("tool_call_id") or (open_ids.pop(0) if open_ids else f"call_{i}")
            if m.get("tool_name"):
                msg["name"] = m["tool_name"]
        out.append(msg)
    return out


def _openai_call(call: dict[str, Any], fallback_id: str) -> dict[str, Any]:
    fn = call.get("function") or {}
    args = fn.get("arguments", {})
    return {
        "id": call.get("id") or fallback_id,
        "type": "function",
        "function": {
            "name": fn.get("name"),
            "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
        },
    }


_IMAGE_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8", "image/jpeg"), (b"GIF8", "image/gif"))


def data_url(image: Any) -> str:
    raw = image if isinstance(image, bytes) else str(image).encode()
    try:
        head = base64.b64decode(raw[:64] + b"=" * (-len(raw[:64]) % 4))
    except (binascii.Error, ValueError):
        head = b""
    mime = next((m for magic, m in _IMAGE_MAGIC if head.startswith(magic)), "image/webp")
    return f"data:{mime};base64,{raw.decode('ascii', errors='replace')}"


# ---- answers ------------------------------------------------------------------------------------
@dataclass
class Delta:
    """A piece of the upstream's answer: text, thinking (its `reasoning_content`), their logprobs."""

    content: str = ""
    reasoning: str = ""
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Answer:
    """What one upstream answer has delivered so far, read from its bytes as they come: server-sent
    events, or one JSON object from a server that does not stream."""

    chat: bool
    top_logprobs: int = 0
    finish: str | None = None
    done: bool = False  # `data: [DONE]` seen
    usage: dict[str, Any] = field(default_factory=dict)
    llama_timings: dict[str, Any] = field(default_factory=dict)  # llama-server's own `timings`
    pieces: int = 0
    calls: dict[int, dict[str, str]] = field(default_factory=dict)
    json_body: bool = False  # the answer is one JSON object, read whole at the end
    _partial: bytes = b""  # a line not yet ended

    def start(self, media_type: str) -> None:
        """The answer's content type: an event stream or one JSON object (anything else is no answer)."""
        if "application/json" in media_type:
            self.json_body = True
        elif "text/event-stream" not in media_type:
            raise Garbage(f"answered {media_type or 'no content type'}, not an event stream")

    def feed(self, data: bytes) -> list[Delta]:
        """The deltas in the next bytes of the answer (a JSON body is kept until `end`)."""
        self._partial += data
        if self.json_body:
            return []
        *lines, self._partial = self._partial.split(b"\n")
        out: list[Delta] = []
        for line in lines:
            out += self.line(line.decode("utf-8", errors="replace"))
        return out

    def end(self) -> list[Delta]:
        """The deltas of what was left: the whole JSON body, or a last line without its newline."""
        rest, self._partial = self._partial, b""
        if not self.json_body:
            return self.line(rest.decode("utf-8", errors="replace")) if rest.strip() else []
        try:
            whole = json.loads(rest)
        except ValueError:
            raise Garbage("answered JSON that does not parse") from None
        self.done = True
        return self.chunk(whole)

    def line(self, line: str) -> list[Delta]:
        """One line of a server-sent event stream."""
        line = line.strip()
        if not line or line.startswith((":", "event:", "id:", "retry:")):
            return []
        if not line.startswith("data:"):
            raise Garbage("answered a line that is not a server-sent event")
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return []
        try:
            obj = json.loads(data)
        except ValueError:
            raise Garbage("sent an event that is not JSON") from None
        return self.chunk(obj)

    def chunk(self, obj: Any) -> list[Delta]:
        """One streamed chunk (or a whole non-streamed answer)."""
        if not isinstance(obj, dict):
            raise Garbage("sent JSON that is not an object")
        if obj.get("error") is not None:
            message, status = error_message(obj)
            raise UpstreamErrorEvent(message, status)
        choices = obj.get("choices")
        if not isinstance(choices, list) or (not choices and not obj.get("usage")):
            raise Garbage("sent an object without choices")
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        if isinstance(obj.get("timings"), dict):
            self.llama_timings = obj["timings"]
        if not choices:  # a chunk with the usage alone
            return []
        delta = self._choice(choices[0] if isinstance(choices[0], dict) else {})  # one answer is asked for
        return [] if delta is None else [delta]

    def _choice(self, choice: dict[str, Any]) -> Delta | None:
        if choice.get("finish_reason"):
            self.finish = str(choice["finish_reason"])
        reasoning: Any = ""
        if self.chat:
            message = choice.get("delta") or choice.get("message") or {}
            text = message.get("content") or ""
            # vLLM and llama-server call the thinking `reasoning_content`; newer vLLM `reasoning`
            reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
            self._add_calls(message.get("tool_calls"))
            lps = chat_logprobs(choice.get("logprobs"))
        else:
            text = choice.get("text") or ""
            lps = completion_logprobs(choice.get("logprobs"), self.top_logprobs)
        if not isinstance(text, str) or not isinstance(reasoning, str):
            raise Garbage("sent content that is not text")
        if not text and not reasoning and not lps:
            return None
        self.pieces += len(lps) if lps else 1
        return Delta(text, reasoning, lps)

    def _add_calls(self, deltas: Any) -> None:
        """Streamed tool calls arrive in pieces keyed by index: the id and name once, the arguments in
        parts."""
        if not isinstance(deltas, list):
            return
        for n, d in enumerate(deltas):
            if not isinstance(d, dict):
                continue
            index = d.get("index", n) if isinstance(d.get("index", n), int) else n
            call = self.calls.setdefault(index, {"id": "", "name": "", "arguments": ""})
            if isinstance(d.get("id"), str) and not call["id"]:
                call["id"] = d["id"]
            fn = d.get("function") or {}
            call["name"] += fn.get("name") or ""
            args = fn.get("arguments")
            call["arguments"] += args if isinstance(args, str) else json.dumps(args) if args else ""

    def tool_calls(self) -> list[dict[str, Any]] | None:
        """The calls in the runtime's (Ollama's) shape: the upstream's id, the arguments as an object."""
        out = []
        for index, call in sorted(self.calls.items()):
            try:
                args = json.loads(call["arguments"] or "{}")
            except ValueError:
                raise Garbage(
                    f"sent tool call arguments that are not JSON: {call['arguments'][:80]!r}"
                ) from None
            fn = {"index": index, "name": call["name"], "arguments": args if isinstance(args, dict) else {}}
            out.append({"id": call["id"], "function": fn} if call["id"] else {"function": fn})
        return out or None

    def finish_reason(self) -> str:
        return "length" if self.finish == "length" else "stop"

    def ended(self) -> bool:
        """Whether the answer said it was complete (a finish reason, or `[DONE]`)."""
        return self.done or self.finish is not None

    def timings(self, sent_ns: int, first_ns: int, end_ns: int) -> Timings:
        return usage_timings(self.usage, self.llama_timings, self.pieces, sent_ns, first_ns, end_ns)


class Tally:
    """What an answer forwarded byte for byte tells of its size and speed, read off its bytes as they
    pass without decoding its events: the usage (present where the client asked for it) and
    llama-server's timings, from the lines that carry them; the time of the first and the last bytes."""

    MAX_JSON = 1 << 20  # a whole JSON answer is read for its usage up to this size

    def __init__(self) -> None:
        self.sent = time.perf_counter_ns()
        self.first = 0
        self.json_body = False
        self.length: int | None = None  # the answer's bytes, where the upstream said
        self.seen = 0
        self.done = False  # an event stream's `data: [DONE]` passed
        self.usage: dict[str, Any] = {}
        self.llama_timings: dict[str, Any] = {}
        self._partial = b""

    def start(self, media_type: str, length: int | None = None) -> None:
        self.json_body = "application/json" in media_type
        self.length = length

    @property
    def complete(self) -> bool:
        """Whether the whole answer has passed (known before its stream is seen to end)."""
        return self.done or (self.length is not None and self.seen >= self.length)

    def see(self, data: bytes) -> None:
        self.first = self.first or time.perf_counter_ns()
        self.seen += len(data)
        if self.json_body:
            if len(self._partial) < self.MAX_JSON:
                self._partial += data
            return
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            if line.startswith(b"data:") and (b'"usage"' in line or b'"timings"' in line):
                self._read(line[5:])
            elif line.strip() == b"data: [DONE]":
                self.done = True

    def _read(self, text: bytes) -> None:
        try:
            obj = json.loads(text)
        except ValueError:
            return
        if isinstance(obj, dict):
            if isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
            if isinstance(obj.get("timings"), dict):
                self.llama_timings = obj["timings"]

    def timings(self, end_ns: int) -> Timings:
        if self.json_body and self._partial:
            self._read(self._partial)
            self._partial = b""
        return usage_timings(self.usage, self.llama_timings, 0, self.sent, self.first, end_ns)


def usage_timings(
    usage: dict[str, Any], llama: dict[str, Any], pieces: int, sent_ns: int, first_ns: int, end_ns: int
) -> Timings:
    """Ollama's counts and durations: the usage's token counts (else the pieces counted here);
    llama-server's own timings when it sends them, else the durations as seen from here (to the first
    token, then to the end)."""
    first = first_ns or end_ns
    t = Timings(
        prompt_eval_count=_int(usage.get("prompt_tokens")),
        prompt_eval_ns=max(0, first - sent_ns),
        eval_count=_int(usage.get("completion_tokens")) or pieces,
        eval_ns=max(0, end_ns - first),
    )
    if llama.get("prompt_ms") is not None and llama.get("predicted_ms") is not None:
        t.prompt_eval_ns = int(float(llama["prompt_ms"]) * 1e6)
        t.eval_ns = int(float(llama["predicted_ms"]) * 1e6)
    return t


def _int(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def chat_logprobs(raw: Any) -> list[TokenLogprob] | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("content"), list):
        return None
    out = []
    for item in raw["content"]:
        if not isinstance(item, dict):
            continue
        top = [
            TopLogprob(-1, str(t.get("token", "")), float(t.get("logprob", 0.0)))
            for t in item.get("top_logprobs") or []
            if isinstance(t, dict)
        ]
        out.append(TokenLogprob(-1, str(item.get("token", "")), float(item.get("logprob", 0.0)), top))
    return out or None


def completion_logprobs(raw: Any, top_n: int) -> list[TokenLogprob] | None:
    """The legacy completions shape: parallel lists of tokens, their logprobs and top maps."""
    if not isinstance(raw, dict) or not isinstance(raw.get("tokens"), list):
        return None
    tokens, values = raw["tokens"], raw.get("token_logprobs") or []
    tops = raw.get("top_logprobs") or []
    out = []
    for i, token in enumerate(tokens):
        value = values[i] if i < len(values) and values[i] is not None else 0.0
        top_map = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        top = sorted((TopLogprob(-1, str(k), float(v)) for k, v in top_map.items()), key=lambda t: -t.logprob)
        out.append(TokenLogprob(-1, str(token), float(value), top[:top_n]))
    return out or None


def error_message(obj: Any) -> tuple[str, int]:
    """An upstream error body (OpenAI's, Ollama's or llama-server's shape) -> (message, status)."""
    err = obj.get("error") if isinstance(obj, dict) else None
    status = 0
    if isinstance(err, dict):
        status = _int(err.get("code"))
        text = err.get("message") or json.dumps(err)
    elif err is not None:
        text = str(err)
    elif isinstance(obj, dict) and obj.get("detail") is not None:  # FastAPI's shape (SGLang, vLLM)
        text = str(obj["detail"])
    else:
        text = json.dumps(obj) if obj is not None else ""
    return str(text)[:MAX_ERROR_TEXT], status


def body_message(raw: bytes) -> str:
    try:
        return error_message(json.loads(raw))[0]
    except ValueError:
        text = raw.decode("utf-8", errors="replace").strip().replace("\n", " ")
        return (text[:MAX_ERROR_TEXT] + "...") if len(text) > MAX_ERROR_TEXT else text
