"""What the remote backend says to an upstream and reads back, in OpenAI's format: request bodies from
our requests, and the upstream's answer (server-sent events or one JSON object) back into text events,
tool calls, logprobs and timings."""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from localrt.backends.base import CancelToken
from localrt.backends.base import OutputSettings
from localrt.backends.base import SamplingParams
from localrt.backends.base import TextEvent
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
@dataclass(kw_only=True)
class RemoteRequest(OutputSettings):
    """One chat or completion for the upstream. The upstream templates and tokenizes, so a request
    carries the conversation (`messages`, OpenAI `tools`) or the raw text (`prompt`), never token ids."""

    messages: list[dict[str, Any]] | None = None  # chat: the runtime's (Ollama-shaped) messages
    tools: list[dict[str, Any]] | None = None
    prompt: str | None = None  # completions: the text as given
    cancel: CancelToken = field(default_factory=CancelToken)

    @property
    def chat(self) -> bool:
        return self.messages is not None


def sampling_fields(s: SamplingParams) -> dict[str, Any]:
    """Ollama's sampling options under the names OpenAI-compatible servers take: the standard fields,
    and vLLM/SGLang/llama-server's extras (both names of the repeat penalty, as servers differ)."""
    out: dict[str, Any] = {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "repetition_penalty": s.repeat_penalty,
        "repeat_penalty": s.repeat_penalty,
    }
    if s.top_k > 0:  # 0 (Ollama's "off") means different things upstream; leave it to the server
        out["top_k"] = s.top_k
    if s.seed >= 0:
        out["seed"] = s.seed
    return out


def response_format(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    if fmt is None:
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if not isinstance(fmt, dict):  # a GBNF grammar (the grammar option, tool_choice "required")
        raise OptionError("grammars (and tool_choice 'required') are not available for remote models")
    return {"type": "json_schema", "json_schema": {"name": "response", "schema": fmt}}


def chat_body(model: str, request: RemoteRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {"messages": openai_messages(request.messages or [])}
    if request.tools:
        fields["tools"] = request.tools
    if request.logprobs:
        fields["logprobs"] = True
        fields["top_logprobs"] = request.top_logprobs
    return _streamed(model, fields, request)


def completion_body(model: str, request: RemoteRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {"prompt": request.prompt or ""}
    if request.logprobs:
        fields["logprobs"] = max(1, request.top_logprobs)  # the legacy field is a count; 0 asks for none
    return _streamed(model, fields, request)


def _streamed(model: str, fields: dict[str, Any], request: RemoteRequest) -> dict[str, Any]:
    """A streamed request's body: the model, the endpoint's own `fields` (its prompt, ...), then what
    chat and completions read the same way (sampling, length, stop strings, response format)."""
    body: dict[str, Any] = {
        "model": model,
        **fields,
        "stream": True,
        "stream_options": {"include_usage": True},
        **sampling_fields(request.sampling),
    }
    if request.num_predict > 0:
        body["max_tokens"] = request.num_predict
    if request.stop:
        body["stop"] = list(request.stop)
    rf = response_format(request.format)
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
class Answer:
    """What one upstream answer has delivered so far."""

    chat: bool
    top_logprobs: int = 0
    finish: str | None = None
    done: bool = False  # `data: [DONE]` seen
    usage: dict[str, Any] = field(default_factory=dict)
    llama_timings: dict[str, Any] = field(default_factory=dict)  # llama-server's own `timings`
    pieces: int = 0
    calls: dict[int, dict[str, str]] = field(default_factory=dict)

    def line(self, line: str) -> list[TextEvent]:
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

    def chunk(self, obj: Any) -> list[TextEvent]:
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
        event = self._choice(choices[0] if isinstance(choices[0], dict) else {})  # one answer is asked for
        return [] if event is None else [event]

    def _choice(self, choice: dict[str, Any]) -> TextEvent | None:
        if choice.get("finish_reason"):
            self.finish = str(choice["finish_reason"])
        if self.chat:
            delta = choice.get("delta") or choice.get("message") or {}
            text = delta.get("content") or ""
            self._add_calls(delta.get("tool_calls"))
            lps = chat_logprobs(choice.get("logprobs"))
        else:
            text = choice.get("text") or ""
            lps = completion_logprobs(choice.get("logprobs"), self.top_logprobs)
        if not isinstance(text, str):
            raise Garbage("sent content that is not text")
        if not text and not lps:
            return None
        self.pieces += len(lps) if lps else 1
        return TextEvent(text, [], lps)

    def _add_calls(self, deltas: Any) -> None:
        """Streamed tool calls arrive in pieces keyed by index: the name once, the arguments in parts."""
        if not isinstance(deltas, list):
            return
        for n, d in enumerate(deltas):
            if not isinstance(d, dict):
                continue
            index = d.get("index", n) if isinstance(d.get("index", n), int) else n
            call = self.calls.setdefault(index, {"name": "", "arguments": ""})
            fn = d.get("function") or {}
            call["name"] += fn.get("name") or ""
            args = fn.get("arguments")
            call["arguments"] += args if isinstance(args, str) else json.dumps(args) if args else ""

    def tool_calls(self) -> list[dict[str, Any]] | None:
        """The calls in Ollama's shape (arguments as an object)."""
        out = []
        for _, call in sorted(self.calls.items()):
            try:
                args = json.loads(call["arguments"] or "{}")
            except ValueError:
                raise Garbage(
                    f"sent tool call arguments that are not JSON: {call['arguments'][:80]!r}"
                ) from None
            out.append(
                {"function": {"name": call["name"], "arguments": args if isinstance(args, dict) else {}}}
            )
        return out or None

    def finish_reason(self) -> str:
        return "length" if self.finish == "length" else "stop"

    def timings(self, sent_ns: int, first_ns: int, end_ns: int) -> Timings:
        """Ollama's counts and durations: the usage's token counts; llama-server's own timings when it
        sends them, else the durations as seen from here (to the first token, then to the end)."""
        first = first_ns or end_ns
        t = Timings(
            prompt_eval_count=_int(self.usage.get("prompt_tokens")),
            prompt_eval_ns=max(0, first - sent_ns),
            eval_count=_int(self.usage.get("completion_tokens")) or self.pieces,
            eval_ns=max(0, end_ns - first),
        )
        lt = self.llama_timings
        if lt.get("prompt_ms") is not None and lt.get("predicted_ms") is not None:
            t.prompt_eval_ns = int(float(lt["prompt_ms"]) * 1e6)
            t.eval_ns = int(float(lt["predicted_ms"]) * 1e6)
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
