"""Chat templates: the GGUF's jinja `tokenizer.chat_template`, rendered in a locked-down sandbox.

Three defences, because a chat template is code that ships inside a downloaded file:
  * jinja2's ImmutableSandboxedEnvironment (no dunders, no mutation, no unsafe callables);
  * resource limits: template and output size, range() size, `*`/`**`/`+`/`%` results, filter
    arguments, and a wall-clock budget enforced in a render thread that is interrupted on overrun;
  * special-token safety: every special-token text inside user-supplied strings is swapped for a
    placeholder before rendering and tokenized as plain text afterwards, so only the template's own
    scaffolding can produce control tokens (user text never injects `<|im_start|>system`).
"""

from __future__ import annotations

import ctypes
import functools
import json
import re
import threading
import time
from collections.abc import Callable
from collections.abc import Collection
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.sandbox import SecurityError

from localrt.errors import LocalrtError
from localrt.runtime.family_templates import TemplateChoice
from localrt.runtime.family_templates import family_choice

MAX_TEMPLATE_CHARS = 512 * 1024
MAX_OUTPUT_CHARS = 4 * 1024 * 1024
MAX_RANGE = 100_000
MAX_FILTER_INT = 100_000
RENDER_TIMEOUT_S = 2.0

_GO_TEMPLATE = re.compile(
    r"\{\{-?\s*(\.[A-Za-z]|\$|range\s|if\s|else\s*-?\}\}|end\s*-?\}\}|template\s|with\s|define\s|block\s)"
)
_PLACEHOLDER = re.compile("\ue000(\\d+)\ue001")


class TemplateError(LocalrtError):
    """A chat template that cannot be compiled or rendered: the request's fault (4xx), never a crash."""

    status = 400


def is_go_template(text: str) -> bool:
    """Ollama TEMPLATE layers are Go text/template (`{{ .Prompt }}`); we keep them but do not run them."""
    return bool(_GO_TEMPLATE.search(text))


def select_template(
    modelfile_template: str | None,
    gguf_template: str | None,
    architecture: str | None = None,
    tokens: Collection[str] = (),
) -> TemplateChoice:
    """A jinja Modelfile/catalog TEMPLATE wins, then the GGUF's own, then the family's (from the
    architecture and the vocabulary's turn markers), then ChatML."""
    if modelfile_template and modelfile_template.strip() and not is_go_template(modelfile_template):
        return TemplateChoice(modelfile_template, "modelfile")
    if gguf_template and gguf_template.strip():
        return TemplateChoice(gguf_template, "gguf")
    return family_choice(architecture, tokens)


# ---- the sandbox ---------------------------------------------------------------------------------
class _RenderTimeout(Exception):
    pass


_deadline = threading.local()


def _check_deadline() -> None:
    limit = getattr(_deadline, "value", None)
    if limit is not None and time.monotonic() > limit:
        raise _RenderTimeout()


def _check_size(value: Any) -> Any:
    if isinstance(value, (str, list, tuple, bytes)) and len(value) > MAX_OUTPUT_CHARS:
        raise SecurityError("value too large")
    return value


_FORMAT_WIDTH = re.compile(r"\d{6,}")  # a width/precision of a million or more


class _TimedRange:
    """range() with jinja's size cap that also watches the render deadline while iterating."""

    def __init__(self, *args: int) -> None:
        for a in args:
            if isinstance(a, bool) or not isinstance(a, int):
                raise SecurityError("range() takes integers")
        self._range = range(*args)
        if len(self._range) > MAX_RANGE:
            raise SecurityError(f"range too big: {len(self._range)} items (at most {MAX_RANGE})")

    def __iter__(self) -> Any:
        for i, value in enumerate(self._range):
            if i % 1024 == 0:
                _check_deadline()
            yield value

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, index: Any) -> Any:
        return self._range[index]

    def __contains__(self, value: Any) -> bool:
        return value in self._range

    def __reversed__(self) -> Any:
        return reversed(self._range)


class _GenerationTag(jinja2.ext.Extension):
    """Transformers' `{% generation %}...{% endgeneration %}` marks assistant text; render its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _SandboxEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_deadline()
        if operator == "**":
            if (
                not isinstance(right, (int, float))
                or isinstance(right, bool)
                or abs(right) > 256
                or (isinstance(left, int) and abs(left).bit_length() > 256)
            ):
                raise SecurityError("power too large")
        elif operator == "*":
            seq, count = (left, right) if isinstance(right, int) else (right, left)
            if (
                isinstance(seq, (str, list, tuple))
                and isinstance(count, int)
                and len(seq) * count > MAX_OUTPUT_CHARS
            ):
                raise SecurityError("repetition too large")
        elif operator == "+":
            if (
                isinstance(left, (str, list, tuple))
                and isinstance(right, (str, list, tuple))
                and len(left) + len(right) > MAX_OUTPUT_CHARS
            ):
                raise SecurityError("value too large")
        elif operator == "%" and isinstance(left, str) and _FORMAT_WIDTH.search(left):
            raise SecurityError("format width too large")
        return _check_size(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_deadline()
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > 10 * MAX_OUTPUT_CHARS:
                raise SecurityError("argument too large")
        return _check_size(super().call(__context, __obj, *args, **kwargs))

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # jinja returns a silent Undefined here; an escape attempt should fail loudly instead
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")

    def getattr(self, obj: Any, attribute: str) -> Any:
        _check_deadline()
        if isinstance(obj, str) and attribute in ("format", "format_map") and _FORMAT_WIDTH.search(obj):
            raise SecurityError("format width too large")
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _check_deadline()
        return super().getitem(obj, argument)


def _guard_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """Filters are called directly (not through env.call): check their size arguments and results."""

    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _check_deadline()
        values = [*args, *kwargs.values()]
        for a in values:
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_FILTER_INT:
                raise SecurityError(f"filter {name}: argument too large")
        if name == "replace":
            strs = [a for a in values if isinstance(a, str)]
            if (
                len(strs) >= 3
                and len(strs[2]) > len(strs[1])
                and len(strs[0]) + strs[0].count(strs[1] or " ") * len(strs[2]) > MAX_OUTPUT_CHARS
            ):
                raise SecurityError("filter replace: result too large")
        if name == "format" and values and isinstance(values[0], str) and _FORMAT_WIDTH.search(values[0]):
            raise SecurityError("format width too large")
        return _check_size(func(*args, **kwargs))

    return guarded


def _raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Transformers' version: plain JSON, not jinja's HTML-escaping one
    if indent is not None and (not isinstance(indent, int) or indent > 64):
        raise SecurityError("tojson: indent too large")
    return _check_size(
        json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )
    )


def _strftime_now(fmt: str) -> str:
    if not isinstance(fmt, str) or len(fmt) > 256:
        raise SecurityError("strftime_now: format too long")
    return datetime.now().strftime(fmt)


def _make_environment() -> _SandboxEnvironment:
    env = _SandboxEnvironment(
        loader=jinja2.BaseLoader(),
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.filters = {name: _guard_filter(name, f) for name, f in env.filters.items()}
    env.filters["tojson"] = _guard_filter("tojson", _tojson)
    env.globals.pop("lipsum", None)  # generates large text on request and has served as an escape hatch
    env.globals["range"] = _TimedRange
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _make_environment()


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    if len(source) > MAX_TEMPLATE_CHARS:
        raise TemplateError(
            f"chat template is too large ({len(source)} characters, at most {MAX_TEMPLATE_CHARS})"
        )
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template is invalid: {e}") from None
    except RecursionError:
        raise TemplateError("chat template is invalid: nested too deeply") from None


def _render_limited(template: jinja2.Template, variables: dict[str, Any], timeout: float) -> str:
    """Render in a worker thread with a deadline; a runaway pure-Python loop gets an async exception."""
    result: dict[str, Any] = {}

    def target() -> None:
        _deadline.value = time.monotonic() + timeout
        try:
            size, parts = 0, []
            for chunk in template.generate(**variables):
                size += len(chunk)
                if size > MAX_OUTPUT_CHARS:
                    raise SecurityError("output too large")
                _check_deadline()
                parts.append(chunk)
            result["text"] = "".join(parts)
        except BaseException as e:  # reported to the caller below
            result["error"] = e
        finally:
            _deadline.value = None

    worker = threading.Thread(target=target, name="localrt-template", daemon=True)
    worker.start()
    worker.join(timeout + 0.25)
    if worker.is_alive():
        # stuck in a loop that never reaches our hooks: interrupt it at the next bytecode
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(worker.ident or 0), ctypes.py_object(_RenderTimeout)
        )
        worker.join(1.0)
        raise TemplateError(f"chat template took longer than {timeout:g}s to render")
    error = result.get("error")
    if error is None:
        return str(result["text"])
    if isinstance(error, _RenderTimeout):
        raise TemplateError(f"chat template took longer than {timeout:g}s to render")
    if isinstance(error, SecurityError):
        raise TemplateError(f"chat template refused by the sandbox: {error}")
    if isinstance(error, jinja2.TemplateError):
        raise TemplateError(f"chat template error: {error}")
    if isinstance(error, (RecursionError, MemoryError)):
        raise TemplateError(f"chat template error: {type(error).__name__}")
    if isinstance(error, Exception):
        raise TemplateError(f"chat template failed: {type(error).__name__}: {error}")
    raise error


# ---- rendering with special-token protection --------------------------------------------------------
@dataclass
class RenderedPrompt:
    """The rendered prompt as segments: (text, parse_special). Only template scaffolding parses specials."""

    segments: list[tuple[str, bool]]

    @property
    def text(self) -> str:
        return "".join(s for s, _ in self.segments)


@functools.lru_cache(maxsize=16)
def _special_parts(specials: tuple[str, ...]) -> tuple[re.Pattern[str], frozenset[str], frozenset[str], int]:
    """For one vocabulary's special tokens: the pattern finding them (and the placeholders' marks), every
    proper prefix and every proper suffix of them, and the longest such fragment. Built once: a model
    such as Gemma 3 has thousands of special tokens, and a prompt thousands of strings to check."""
    pattern = re.compile("|".join(re.escape(t) for t in [*specials, "\ue000", "\ue001"]))
    prefixes = frozenset(s[:n] for s in specials for n in range(1, len(s)))
    suffixes = frozenset(s[-n:] for s in specials for n in range(1, len(s)))
    return pattern, prefixes, suffixes, max((len(s) - 1 for s in specials), default=0)


class _Protector:
    """Swaps special-token text (and fragments that could complete one) in user strings for placeholders."""

    def __init__(self, special_tokens: Sequence[str]) -> None:
        specials = tuple(sorted({t for t in special_tokens if t}, key=len, reverse=True))
        self.specials = specials
        self.pattern, self.prefixes, self.suffixes, self.longest = _special_parts(specials)
        self.originals: list[str] = []

    def _hold(self, text: str) -> str:
        self.originals.append(text)
        return f"\ue000{len(self.originals) - 1}\ue001"

    def protect_text(self, text: str) -> str:
        out = self.pattern.sub(lambda m: self._hold(m.group(0)), text)
        # a fragment at either end could join the template's text into a special token: the longest end
        # that begins a special token, and the longest start that ends one
        sizes = range(min(self.longest, len(out)), 0, -1)
        tail = next((out[-n:] for n in sizes if out[-n:] in self.prefixes and "\ue001" not in out[-n:]), "")
        head = next((out[:n] for n in sizes if out[:n] in self.suffixes and "\ue000" not in out[:n]), "")
        if tail and len(tail) < len(out):
            out = out[: -len(tail)] + self._hold(tail)
        if head and len(head) < len(out):
            out = self._hold(head) + out[len(head) :]
        return out

    def protect_key(self, key: Any) -> Any:
        """A mapping key (a tool's parameter name, a call's argument name) is user text like any value.
        A plain name keeps its spelling, so templates still find `type` or `properties`; only a key with
        other characters could end in a fragment that joins the template's text into a special token."""
        if not isinstance(key, str):
            return key
        if key.isidentifier():
            return self.pattern.sub(lambda m: self._hold(m.group(0)), key)
        return self.protect(key)

    def protect(self, value: Any) -> Any:
        if isinstance(value, str):
            return (
                self.protect_text(value)
                if self.specials
                else self.pattern.sub(lambda m: self._hold(m.group(0)), value)
            )
        if isinstance(value, Mapping):
            return {self.protect_key(k): self.protect(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.protect(v) for v in value]
        return value

    def segments(self, rendered: str) -> list[tuple[str, bool]]:
        out: list[tuple[str, bool]] = []
        pos = 0
        for m in _PLACEHOLDER.finditer(rendered):
            if m.start() > pos:
                out.append((rendered[pos : m.start()], True))
            index = int(m.group(1))
            out.append((self.originals[index] if index < len(self.originals) else m.group(0), False))
            pos = m.end()
        if pos < len(rendered):
            out.append((rendered[pos:], True))
        return out


def _normalize_messages(messages: Sequence[Mapping[str, Any]], typed: bool = False) -> list[dict[str, Any]]:
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TemplateError(f"message {i} must be an object with role and content")
        msg = dict(message)
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise TemplateError(f"message {i} has no role")
        content = msg.get("content")
        if content is None:
            msg["content"] = ""
        elif isinstance(content, list):  # OpenAI content parts: keep the text
            msg["content"] = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
        elif not isinstance(content, str):
            raise TemplateError(f"message {i}: content must be a string")
        if typed:  # for templates that only read content as a list of parts (vision models' templates)
            msg["content"] = [{"type": "text", "text": msg["content"]}]
        out.append(msg)
    return out


class ChatTemplate:
    def __init__(
        self,
        source: str,
        *,
        bos_token: str = "",
        eos_token: str = "",
        special_tokens: Sequence[str] = (),
        timeout: float = RENDER_TIMEOUT_S,
    ) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.special_tokens = tuple(special_tokens)
        self.timeout = timeout
        self._template = _compile(source)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
        typed_content: bool = False,
    ) -> RenderedPrompt:
        protector = _Protector(self.special_tokens)
        variables: dict[str, Any] = dict(extra or {})
        variables = protector.protect(variables)
        variables.update(
            messages=protector.protect(_normalize_messages(messages, typed_content)),
            tools=protector.protect(list(tools)) if tools else None,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            date_string=datetime.now().strftime("%d %b %Y"),
        )
        rendered = _render_limited(self._template, variables, self.timeout)
        return RenderedPrompt(protector.segments(rendered))


def tokenize_rendered(
    prompt: RenderedPrompt,
    tokenize: Callable[[str, bool, bool], list[int]],
    bos_token_id: int | None = None,
    add_bos: bool = False,
) -> list[int]:
    """Tokenize segment by segment; add BOS only when the vocabulary wants one and the template gave none."""
    tokens: list[int] = []
    for text, parse_special in prompt.segments:
        if text:
            tokens.extend(tokenize(text, False, parse_special))
    if add_bos and bos_token_id is not None and (not tokens or tokens[0] != bos_token_id):
        tokens.insert(0, bos_token_id)
    return tokens
