"""The one protocol every backend (llama.cpp, MLX, torch) implements.

A backend class is a factory: `Backend.load(path, opts)` returns a `LoadedModel`. A loaded model
tokenizes, generates (an async stream of `TextEvent`s ending in one `DoneEvent`), scores token
sequences (perplexity, KL), embeds and unloads. Sampling parameters, stop strings and speculative
settings arrive already validated by the runtime (`localrt/runtime/options.py`); backends map them.

Blocking work (decode loops) runs in a worker thread; `generate` must never block the event loop.
"""

from __future__ import annotations

import codecs
import contextlib
import threading
from collections.abc import AsyncIterator
from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Iterable
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import TYPE_CHECKING
from typing import Any
from typing import Literal
from typing import Protocol
from typing import TypeVar
from typing import runtime_checkable

from localrt import config

if TYPE_CHECKING:  # numpy comes with the backends' extras, not with the base install
    import numpy as np

T = TypeVar("T")
FinishReason = Literal["stop", "length", "cancel"]
SPECULATIVE_MODES = ("off", "draft", "lookup", "self", "auto")
KV_CACHE_TYPES = ("f16", "bf16", "f32", "q8_0", "q4_0", "fp8")
# How the torch engine holds and multiplies weights (option `numerics`; other backends ignore it):
# auto = quantized on the CPU where the file's types allow, dequantized on CUDA; quantized = kept packed
# (torch's int4/int8 weight-only kernels); dequantized = dense fp32 on the CPU (bf16 on CUDA); exact =
# dense fp32 everywhere; llama.cpp = fp32 rounded as llama.cpp's CPU kernels round (comparisons only).
NUMERICS = ("auto", "quantized", "dequantized", "exact", "llama.cpp")


# a draft model's tokens, prompt lookup (n-grams of the context), the model's own first layers
SPECULATION_METHODS = frozenset({"draft", "lookup", "self"})


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; the runtime checks requests against it before submitting them."""

    embedding: bool = True
    grammar: bool = True  # constrained output for `format: json` / JSON schema (every backend has it)
    speculative: frozenset[str] = frozenset()  # a subset of SPECULATION_METHODS
    kv_cache_types: tuple[str, ...] = ("f16",)
    devices: tuple[str, ...] = ("cpu",)
    parallel_slots: int = 1  # on a loaded model: how many requests it serves at once
    context_shift: bool = False  # generation may go on past the context end (GenerateRequest.shift)
    vision: bool = False  # on a loaded model: a projector is loaded, so GenerateRequest.images work
    rerank: bool = False  # on a loaded model: a reranker (rank pooling), so rerank() works


@dataclass
class LoadOptions:
    """Load-time settings; a change in any of them means a reload (as in Ollama)."""

    num_ctx: int = 4096
    num_thread: int = 0  # 0 = the backend decides
    num_gpu: int = -1  # layers on the GPU: -1 all that fit / auto, 0 CPU only
    kv_cache_type: str = "f16"
    flash_attn: bool | None = None  # None = auto
    num_batch: int = 512
    seed: int = -1
    draft_model: Path | None = None  # a GGUF with the same vocabulary, for speculative "draft"
    embedding: bool = False  # also prepare for embed() at load (else created lazily)
    num_parallel: int = 0  # sequences decoded at once (LOCALRT_NUM_PARALLEL); 0 = the backend's default
    projector: Path | None = None  # a multimodal projector GGUF (mmproj) for images
    numerics: str = "auto"  # the torch engine's weights and arithmetic (NUMERICS)
    adapters: tuple[Path, ...] = ()  # LoRA adapter GGUFs applied over the weights at scale 1.0, in order
    # a request's output does not depend on what is batched beside it, at a cost in prefill speed and
    # memory (LOCALRT_BATCH_INVARIANT, read when the options are made)
    batch_invariant: bool = field(default_factory=config.batch_invariant)
    # cells of the KV pool the sequences share where a backend keeps one (llama.cpp unless batch
    # invariant): 0 = num_parallel x num_ctx, else at least num_ctx (the memory fit makes it smaller)
    kv_pool: int = 0


@dataclass
class SamplingParams:
    """Ollama's sampling parameters, shared by every backend."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.9
    min_p: float = 0.0
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1  # -1 = random
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def penalty_window(self, context_length: int) -> int:
        """How many recent tokens the repeat/frequency/presence penalties look at; 0 when none is set."""
        if self.repeat_penalty == 1.0 and self.frequency_penalty == 0.0 and self.presence_penalty == 0.0:
            return 0
        return context_length if self.repeat_last_n < 0 else self.repeat_last_n


class CancelToken:
    """Set from any thread; the decode loop checks it between tokens."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()


@dataclass(frozen=True)
class GBNF:
    """A grammar in llama.cpp's GBNF, for output `format` cannot describe (a model family's tool-call
    syntax when a tool call is required; a test forcing an exact reply)."""

    text: str


IMAGE_TOKEN = -1  # stands in prompt_tokens for one image of GenerateRequest.images, in order


@dataclass(frozen=True)
class ImageInput:
    """A decoded image (the runtime checked format and limits): RGB pixels, row-major, 3 bytes each."""

    rgb: bytes
    width: int
    height: int
    digest: str  # sha256 hex of the original file bytes: the image's identity for prefix reuse


@dataclass
class OutputSettings:
    """What a request asks of its answer, the same for a loaded model (GenerateRequest) and an upstream
    (remote.RemoteRequest): sampling, length, stop strings, logprobs and format."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_predict: int = -1  # -1: until the context is full (an upstream's: no max_tokens is sent)
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    # "json", a JSON schema or GBNF (Capabilities.grammar; an upstream takes no GBNF)
    format: str | dict[str, Any] | GBNF | None = None

    @property
    def wants_logprobs(self) -> bool:
        """Each generated token comes with its logprob (asked for, or implied by top_logprobs)."""
        return self.logprobs or self.top_logprobs > 0


@dataclass
class _PromptTokens:
    prompt_tokens: list[int]  # IMAGE_TOKEN marks where each of `images` goes


# prompt_tokens has a base of its own, named last, because a dataclass's fields start with those of its
# last base: GenerateRequest(prompt_tokens, sampling, num_predict, ...) in that order, as callers pass them.
@dataclass
class GenerateRequest(OutputSettings, _PromptTokens):
    speculative: str = "off"
    num_draft: int | None = None  # None = the backend's default for the mode
    shift: bool = (
        True  # at the context end: drop old tokens and go on (Capabilities.context_shift), else stop
    )
    num_keep: int = 4  # tokens a context shift keeps at the start
    cancel: CancelToken = field(default_factory=CancelToken)
    # control tokens whose text the answer keeps (thinking tags, tool-call markers, harmony headers):
    # the runtime parses them out of the text, as llama-server's preserved tokens
    preserve_tokens: frozenset[int] = frozenset()
    images: list[ImageInput] = field(default_factory=list)  # needs Capabilities.vision
    # the model's LoRA adapters' scales for this request, one per adapter in load order (llama-server's
    # per-request `lora`); None: each at 1.0, as they loaded. Only the llama.cpp backend applies them.
    lora: tuple[float, ...] | None = None


@dataclass
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass
class TokenLogprob(TopLogprob):
    """A generated token's logprob with the most likely alternatives at its place."""

    top: list[TopLogprob] = field(default_factory=list)


@dataclass
class TextEvent:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Timings:
    """Nanoseconds and counts, the fields of Ollama's final chunk plus speculative statistics."""

    load_ns: int = 0
    prompt_eval_count: int = 0
    prompt_eval_ns: int = 0
    eval_count: int = 0
    eval_ns: int = 0
    draft_count: int = 0
    draft_accepted_count: int = 0
    cached_count: int = 0  # prompt tokens taken from the KV cache, not evaluated (OpenAI cached_tokens)
    prompt_image_tokens: int = 0  # of prompt_eval_count: cells an image encoder produced (0 on a reuse)

    def set_durations(self, start_ns: int, first_token_ns: int, now_ns: int) -> Timings:
        """The prompt's time runs from the request's start to its first token, generation's from there to
        now (without a first token all of it is the prompt's); at least 1 ns each, as clients divide."""
        first = first_token_ns or now_ns
        self.prompt_eval_ns = max(1, first - start_ns)
        self.eval_ns = max(1, now_ns - first)
        return self


@dataclass
class DoneEvent:
    finish_reason: FinishReason
    timings: Timings
    # calls an upstream returned already parsed (a remote model); local models leave them in the text
    tool_calls: list[dict[str, Any]] | None = None
    # finish_reason "stop" because of this stop string (TextAssembler.stop_sequence), not an end token
    stop_sequence: str | None = None


Event = TextEvent | DoneEvent


@dataclass
class ScoreResult:
    """`logprobs[i]` = log p(tokens[i+1] | tokens[:i+1]); `logits[i]` the raw row it came from."""

    logprobs: np.ndarray  # float64 [n-1]
    logits: np.ndarray | None = None  # float32 [n-1, n_vocab] when asked for


@runtime_checkable
class LoadedModel(Protocol):
    backend_name: str
    capabilities: Capabilities
    context_length: int  # the loaded context (num_ctx), not the trained maximum
    n_vocab: int
    memory_bytes: int  # weights + KV cache estimate
    metadata: dict[str, str]  # GGUF key/values (chat template, special tokens)
    bos_token_id: int | None
    eos_token_ids: list[int]
    add_bos: bool  # whether the vocabulary asks for a BOS at the start

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]: ...

    def detokenize(self, ids: Sequence[int], special: bool = False) -> str: ...

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry as text (special tokens included), for BOS/EOS in templates."""
        ...

    def special_tokens(self) -> list[str]:
        """Texts that become control tokens when parsed with parse_special=True (for injection safety)."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]: ...

    def cancel(self) -> None:
        """Cancel every running request of this model."""
        ...

    def expecting(self, cancel: CancelToken) -> contextlib.AbstractContextManager[None]:
        """Announce a request being prepared under the cancel token it will carry (`ModelLifetime`)."""
        ...

    async def score(self, tokens: Sequence[int], return_logits: bool = False) -> ScoreResult: ...

    async def embed(self, texts: Sequence[str | list[int]]) -> list[list[float]]:
        """One unit vector per input: a text, or the tokens it was already tokenized into."""
        ...

    def unload(self) -> None: ...

    @property
    def dead(self) -> bool:
        """It stopped on an error and serves nothing more: the runtime unloads it and loads it again."""
        ...


class Backend(Protocol):
    """What the registry hands out for a backend name: a value (EngineBackend) or a class of class
    methods (RemoteBackend); both are called the same way."""

    name: str

    def availability(self) -> tuple[bool, str]:
        """(installed, why not / what to pip install), beyond the registry's import checks."""
        ...

    def capabilities(self) -> Capabilities: ...

    def load(self, path: Path | str, opts: LoadOptions) -> LoadedModel: ...


def importable() -> tuple[bool, str]:
    """`Backend.availability` where importing the modules the registry checks (its specs' `requires`)
    is all a backend needs."""
    return True, ""


@dataclass(frozen=True)
class EngineBackend:
    """A backend whose model class loads in its constructor (llama.cpp, torch, MLX): its name, that
    class, what it can do, any check beyond the registry's import checks, and the memory a load would
    take, estimated from the file's header before loading."""

    name: str
    model_class: Callable[[Path, LoadOptions], LoadedModel]
    capabilities: Callable[[], Capabilities]
    availability: Callable[[], tuple[bool, str]] = importable
    estimate: Callable[[Path, LoadOptions], Any] | None = None  # -> backends.memory.MemoryEstimate
    # models loaded from one file (with different adapters) hold its weights once, not once each
    shares_weights: bool = False

    def load(self, path: Path | str, opts: LoadOptions) -> LoadedModel:
        return self.model_class(Path(path), opts)


# ---- helpers shared by backends ----------------------------------------------------------------
def close_each(*resources: Any) -> None:
    """Close each of `resources` that is there (not None), in order."""
    for resource in resources:
        if resource is not None:
            resource.close()


def modules_installed(modules: Sequence[str], pip_hint: str) -> tuple[bool, str]:
    """A backend's `availability()`: (True, "") or the first of `modules` not installed and what to install."""
    import importlib.util

    for module in modules:
        if importlib.util.find_spec(module) is None:
            why = "its tokenizer is llama.cpp's" if module == "llama_cpp" else "it is required"
            return False, f"{module} is not installed ({why}); {pip_hint}"
    return True, ""


class ModelLifetime:
    """A loaded model's `cancel` and `unload`: unloading cancels what runs, marks the model closed (every
    later request is refused, `checks.check_loaded`) and frees it once (`_free`)."""

    _closed: bool = False
    _active: set[CancelToken]  # the cancel tokens of the requests in flight
    engine: Any  # the model's EngineThread (None while a llama.cpp model has none)

    def expecting(self, cancel: CancelToken) -> contextlib.AbstractContextManager[None]:
        """A request being prepared (its prompt rendered), announced to the engine under the cancel token
        its `GenerateRequest` will carry, until it is submitted or the block ends: requests sent together
        start in one step (`EngineThread.gather_s`)."""
        engine = self.engine
        return engine.expecting(cancel) if engine is not None else contextlib.nullcontext()

    def cancel(self) -> None:
        """Cancel every running request of this model."""
        for token in list(self._active):
            token.cancel()

    @property
    def dead(self) -> bool:
        """Its engine thread stopped on an error (`EngineThread.died`)."""
        return self.engine is not None and self.engine.died is not None

    def unload(self) -> None:
        if self._closed:
            return
        self.cancel()
        self._closed = True
        self._free()

    def _free(self) -> None:
        raise NotImplementedError

    def _load_or_free(self, load: Callable[[], None]) -> None:
        """Run `load`; if it fails, what it made so far is freed before the error goes on (a failed load
        holds no context, thread or memory)."""
        try:
            load()
        except BaseException:
            self._free()
            raise


class StopMatcher:
    """Finds stop strings in streamed text; never releases text that could start a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.matched: str | None = None  # the stop string that ended the text (earliest; longest on a tie)

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; returns (text safe to emit now, stopped)."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        found = [(at, -len(s), s) for s in self.stops if (at := self.pending.find(s)) >= 0]
        if found:
            first, _, self.matched = min(found)
            out, self.pending = self.pending[:first], ""
            return out, True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class TextAssembler:
    """Token pieces (bytes) -> text events: incremental UTF-8, stop strings, token/logprob bookkeeping."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = StopMatcher(stops)
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []

    def add(self, token_id: int, piece: bytes, logprob: TokenLogprob | None) -> tuple[TextEvent | None, bool]:
        """Returns (event to emit or None, a stop string was hit)."""
        self._ids.append(token_id)
        if logprob is not None:
            self._logprobs.append(logprob)
        text, stopped = self._stops.push(self._utf8.decode(piece))
        if stopped:
            # the stop text itself is never emitted; neither are the tokens that only formed it
            event = TextEvent(text, self._take_ids(), self._take_logprobs()) if text else None
            return event, True
        if not text:
            return None, False
        return TextEvent(text, self._take_ids(), self._take_logprobs()), False

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the answer (None: it ended otherwise), for DoneEvent.stop_sequence."""
        return self._stops.matched

    def end(self, reason: str, timings: Timings) -> list[Event]:
        """The answer's last events: the text still held back (if any), then the done event."""
        tail = self.finish()
        done = DoneEvent(reason, timings, stop_sequence=self.stop_sequence)  # type: ignore[arg-type]
        return [done] if tail is None else [tail, done]

    def finish(self) -> TextEvent | None:
        text = self._stops.push(self._utf8.decode(b"", final=True))[0] + self._stops.flush()
        if not text and not self._ids:
            return None
        return TextEvent(text, self._take_ids(), self._take_logprobs())

    def _take_ids(self) -> list[int]:
        ids, self._ids = self._ids, []
        return ids

    def _take_logprobs(self) -> list[TokenLogprob] | None:
        if not self._logprobs:
            return None
        lps, self._logprobs = self._logprobs, []
        return lps


def common_prefix(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """How many items `a` and `b` share from their start (token ids, or llama.cpp's prompt cells)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def longest_prefix(
    candidates: Iterable[tuple[T, Sequence[Hashable]]], items: Sequence[Hashable], none: T
) -> tuple[T, int]:
    """Of `(candidate, what it holds)` pairs, the candidate sharing the longest start with `items` and
    that length (the first of equals); `(none, 0)` when none shares any."""
    best, best_n = none, 0
    for candidate, held in candidates:
        n = common_prefix(held, items)
        if n > best_n:
            best, best_n = candidate, n
    return best, best_n


def loaded_context(num_ctx: int, trained: int) -> int:
    """The context a model is loaded with: num_ctx, at most what it was trained for (when the file says),
    at least 16 tokens."""
    return max(16, min(num_ctx, trained) if trained > 0 else num_ctx)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    import numpy as np

    x = logits.astype(np.float64, copy=False)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))
