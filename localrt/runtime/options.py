"""Request options, once for every backend: Ollama's names and defaults, validated with clear errors.

Precedence: request options > the model's Modelfile/catalog parameters > defaults (+ environment).
Request values are typed JSON and checked strictly (a bool is not an int); Modelfile parameters and
`/set parameter` arrive as text and are converted first (`parse_option_value`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from dataclasses import fields
from typing import Any

from localrt import config
from localrt.backends.base import KV_CACHE_TYPES
from localrt.backends.base import NUMERICS
from localrt.backends.base import SPECULATIVE_MODES
from localrt.backends.base import GenerateRequest
from localrt.backends.base import LoadOptions
from localrt.backends.base import SamplingParams
from localrt.backends.registry import ALIASES as BACKEND_ALIASES
from localrt.errors import OptionError

MAX_NUM_CTX = 1 << 20
# An open-ended answer (num_predict -1, the default) on a backend that shifts the context stops after
# this many contexts' worth of tokens, as Ollama's (its openEndedGenerationContextMultiplier): a model
# that never emits its end token would otherwise generate forever.
OPEN_ENDED_CONTEXTS = 10
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 1000
MAX_GRAMMAR_LENGTH = 64 * 1024
BACKEND_NAMES = ("auto", "llama.cpp", "mlx", "torch")
KV_ALIASES = {"int8": "q8_0", "q8": "q8_0", "q4": "q4_0", "fp16": "f16", "float16": "f16", "bfloat16": "bf16"}

# Ollama options we accept so existing clients keep working, but which change nothing here.
IGNORED_OPTIONS = frozenset(
    {
        "main_gpu",
        "use_mmap",
        "use_mlock",
        "numa",
        "low_vram",
        "f16_kv",
        "vocab_only",
        "logits_all",
        "penalize_newline",
        "tfs_z",
    }
)

# name -> (type, minimum, maximum); None = unbounded
_RANGES: dict[str, tuple[type, float | None, float | None]] = {
    "temperature": (float, 0.0, 100.0),
    "top_k": (int, 0, 1 << 20),
    "top_p": (float, 0.0, 1.0),
    "min_p": (float, 0.0, 1.0),
    "typical_p": (float, 0.0, 1.0),
    "repeat_penalty": (float, 0.0, 100.0),
    "repeat_last_n": (int, -1, MAX_NUM_CTX),
    "presence_penalty": (float, -100.0, 100.0),
    "frequency_penalty": (float, -100.0, 100.0),
    "seed": (int, None, None),
    "mirostat": (int, 0, 2),
    "mirostat_tau": (float, 0.0, 100.0),
    "mirostat_eta": (float, 0.0, 1.0),
    "num_predict": (int, -2, OPEN_ENDED_CONTEXTS * MAX_NUM_CTX),
    "num_ctx": (int, 1, MAX_NUM_CTX),
    "num_keep": (int, -1, MAX_NUM_CTX),
    "num_thread": (int, 0, 1024),
    "num_gpu": (int, -1, 100_000),
    "num_batch": (int, 1, 1 << 16),
    "kv_pool": (int, 0, None),
    "num_draft": (int, 0, 64),
}


def _default_kv_cache_type() -> str:
    return config.default_kv_cache_type()


def num_parallel() -> int:
    """LOCALRT_NUM_PARALLEL: sequences a loaded model serves at once; 0 (auto) lets the backend decide."""
    return config.num_parallel()


def _default_backend() -> str:
    return config.default_backend()


_LOAD = LoadOptions()
_REQUEST = GenerateRequest(prompt_tokens=[])


@dataclass
class Options(SamplingParams):
    """Every option of a request, under Ollama's names. The defaults of the sampling options (the
    fields of `SamplingParams`, which this extends), of the load options and of the request's own ones
    are the backend protocol's (`backends/base.py`); the environment's come from `localrt.config`."""

    stop: list[str] = field(default_factory=list)
    num_predict: int = _REQUEST.num_predict
    # load time
    num_ctx: int = field(default_factory=lambda: config.context_length())
    num_keep: int = _REQUEST.num_keep
    num_thread: int = _LOAD.num_thread
    num_gpu: int = _LOAD.num_gpu
    num_batch: int = _LOAD.num_batch
    kv_pool: int = _LOAD.kv_pool  # cells of the KV pool the sequences share; 0: num_parallel x num_ctx
    backend: str = field(default_factory=_default_backend)
    kv_cache_type: str = field(default_factory=_default_kv_cache_type)
    flash_attn: bool | None = _LOAD.flash_attn  # None = the backend decides (llama.cpp: on where supported)
    numerics: str = _LOAD.numerics  # torch engine only: weights kept quantized or dequantized (NUMERICS)
    # speculative decoding
    speculative: str = "auto"  # auto = use a draft model when one is configured, else off
    draft_model: str | None = None
    num_draft: int | None = _REQUEST.num_draft  # None = the backend's default for the mode
    # constrained output in llama.cpp's GBNF (as llama-server's `grammar`); excludes `format`
    grammar: str | None = None

    @classmethod
    def merge(cls, *layers: Mapping[str, Any] | None, lenient: tuple[bool, ...] = ()) -> Options:
        """Defaults, then each layer in order (later wins).

        A lenient layer (Modelfile/catalog parameters) may hold text values and unknown names, which are
        skipped; request layers are strict.
        """
        opts = cls()
        # environment defaults are validated too, so a bad LOCALRT_BACKEND is a clear error
        opts.backend = _check_backend(opts.backend, "LOCALRT_BACKEND")
        opts.kv_cache_type = _check_kv(opts.kv_cache_type, "LOCALRT_KV_CACHE_TYPE")
        for i, layer in enumerate(layers):
            if not layer:
                continue
            if not isinstance(layer, Mapping):
                raise OptionError("options must be an object of name: value pairs")
            is_lenient = lenient[i] if i < len(lenient) else False
            for name, value in layer.items():
                if is_lenient and name not in _FIELDS:
                    continue  # a model made for another runtime may carry parameters we do not know
                if value is None and (name in _FIELDS or name in IGNORED_OPTIONS):
                    continue  # null means "not set", as in Ollama (LangChain sends every option so)
                opts.set(name, value, from_text=is_lenient)
        return opts

    def set(self, name: str, value: Any, from_text: bool = False) -> None:
        """Validate and set one option; `from_text` converts strings first (Modelfile, /set)."""
        name = RENAMED.get(name, name)
        if name in IGNORED_OPTIONS:
            return
        if name not in _FIELDS:
            raise OptionError(f"unknown option {name!r}")
        if from_text and isinstance(value, str):
            value = parse_option_value(name, value)
        setattr(self, name, validate_option(name, value))

    # ---- views for the backend ---------------------------------------------------------------
    def sampling(self) -> SamplingParams:
        return SamplingParams(**{f.name: getattr(self, f.name) for f in fields(SamplingParams)})

    def load_options(self, model_context_length: int | None = None, draft_path: Any = None) -> LoadOptions:
        num_ctx = self.num_ctx
        if model_context_length:
            num_ctx = min(num_ctx, model_context_length)
        return LoadOptions(
            num_ctx=num_ctx,
            num_thread=self.num_thread,
            num_gpu=self.num_gpu,
            kv_cache_type=self.kv_cache_type,
            flash_attn=self.flash_attn,
            num_batch=self.num_batch,
            kv_pool=self.kv_pool,
            seed=self.seed,
            draft_model=draft_path,
            num_parallel=num_parallel(),
            numerics=self.numerics,
        )

    def max_new_tokens(self, prompt_tokens: int, context_length: int, shift: bool = False) -> int:
        """The most tokens an answer may have, Ollama's rule: -2 fills the context; with `shift` (a
        backend that shifts the context and a request that lets it) -1 and anything above
        OPEN_ENDED_CONTEXTS x the context mean that cap, past the context end; without shift every
        answer stops at the context end."""
        room = max(0, context_length - prompt_tokens)
        # the limit a negative num_predict means, and the bound on an explicit one
        limit = room if not shift or self.num_predict == -2 else OPEN_ENDED_CONTEXTS * context_length
        return limit if self.num_predict < 0 else min(self.num_predict, limit)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_FIELDS = {f.name for f in fields(Options)}
OPTION_NAMES = frozenset(_FIELDS)
RENAMED = {"draft_num_predict": "num_draft"}  # Ollama's name for the same thing


def set_names(layer: Mapping[str, Any] | None) -> set[str]:
    """The options a layer sets, by their names here (null means not set, as in `Options.merge`); names
    no option has are left out (a lenient layer's: a strict one's the merge refused)."""
    names = {RENAMED.get(name, name) for name, value in (layer or {}).items() if value is not None}
    return {name for name in names if name in _FIELDS}


def _check_number(name: str, value: Any) -> int | float:
    kind, lo, hi = _RANGES[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        expected = "an integer" if kind is int else "a number"
        raise OptionError(f"option {name!r} must be {expected}, got {_describe(value)}")
    if kind is int:
        if isinstance(value, float):
            if not value.is_integer():
                raise OptionError(f"option {name!r} must be an integer, got {value!r}")
            value = int(value)
    else:
        value = float(value)
        if not math.isfinite(value):
            raise OptionError(f"option {name!r} must be a finite number, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise OptionError(f"option {name!r} is out of range: {value!r} (allowed {_fmt(lo)} to {_fmt(hi)})")
    if name == "num_predict" and value < -2:
        raise OptionError("option 'num_predict' must be -1 (open-ended), -2 (fill the context) or >= 0")
    return value


def _check_stop(value: Any) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise OptionError(f"option 'stop' must be a string or a list of strings, got {_describe(value)}")
    value = [s for s in value if s]
    if len(value) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in value):
        raise OptionError(
            f"option 'stop': at most {MAX_STOP_STRINGS} strings of {MAX_STOP_LENGTH} characters"
        )
    return value


def _check_speculative(value: Any) -> str:
    if isinstance(value, bool):  # JSON true/false read as auto/off
        return "auto" if value else "off"
    if not isinstance(value, str) or value.strip().lower() not in SPECULATIVE_MODES:
        raise OptionError(
            f"option 'speculative' must be one of {', '.join(SPECULATIVE_MODES)}, got {_describe(value)}"
        )
    return value.strip().lower()


def _check_flash_attn(value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise OptionError(f"option 'flash_attn' must be true or false, got {_describe(value)}")


def _check_draft_model(value: Any) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise OptionError(f"option 'draft_model' must be a model name, got {_describe(value)}")
    if _looks_like_path(value):
        # a path would let any API client make the server open a file no check has read
        raise OptionError(
            f"option 'draft_model' names a stored model or a blob digest (sha256:...), not a file path: "
            f"{value!r}"
        )
    return value


def _looks_like_path(value: str) -> bool:
    """A file path rather than a model name: rooted, relative, home-based, Windows-style or a .gguf file."""
    return (
        value.startswith(("/", "~", ".")) or "\\" in value or "//" in value or value.lower().endswith(".gguf")
    )


def _check_numerics(value: Any) -> str:
    if not isinstance(value, str) or value.strip().lower() not in NUMERICS:
        raise OptionError(f"option 'numerics' must be one of {', '.join(NUMERICS)}, got {_describe(value)}")
    return value.strip().lower()


def _check_grammar(value: Any) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise OptionError(f"option 'grammar' must be a GBNF grammar (a string), got {_describe(value)}")
    if len(value) > MAX_GRAMMAR_LENGTH:
        raise OptionError(f"option 'grammar' is longer than {MAX_GRAMMAR_LENGTH} characters")
    if "root" not in value:
        raise OptionError("option 'grammar' must define the rule 'root'")
    return value


_CHECKS: dict[str, Callable[[Any], Any]] = {
    "stop": _check_stop,
    "backend": lambda v: _check_backend(v, "option 'backend'"),
    "kv_cache_type": lambda v: _check_kv(v, "option 'kv_cache_type'"),
    "speculative": _check_speculative,
    "flash_attn": _check_flash_attn,
    "draft_model": _check_draft_model,
    "grammar": _check_grammar,
    "numerics": _check_numerics,
}


def validate_option(name: str, value: Any) -> Any:
    """Check one typed value; returns it normalised (e.g. stop as a list, int-valued floats)."""
    if name in _RANGES:
        if name == "num_draft" and value is None:
            return None
        return _check_number(name, value)
    check = _CHECKS.get(name)
    if check is None:
        raise OptionError(f"unknown option {name!r}")
    return check(value)


def parse_option_value(name: str, text: str) -> Any:
    """Text (Modelfile PARAMETER, `/set parameter`) -> typed value for `validate_option`."""
    text = text.strip()
    if name in _RANGES:
        kind = _RANGES[name][0]
        try:
            return int(text) if kind is int else float(text)
        except ValueError:
            expected = "an integer" if kind is int else "a number"
            raise OptionError(f"option {name!r} must be {expected}, got {text!r}") from None
    if name == "stop":
        return [_unquote(text)]
    if name == "flash_attn":
        lowered = text.lower()
        if lowered in ("true", "1", "on", "yes"):
            return True
        if lowered in ("false", "0", "off", "no"):
            return False
        raise OptionError(f"option 'flash_attn' must be true or false, got {text!r}")
    return _unquote(text)


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


def _check_backend(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise OptionError(f"{what} must be a string, got {_describe(value)}")
    name = value.strip().lower()
    name = BACKEND_ALIASES.get(name, name)
    if name not in BACKEND_NAMES:
        raise OptionError(f"{what}: unknown backend {value!r} (use {', '.join(BACKEND_NAMES)})")
    return name


def _check_kv(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise OptionError(f"{what} must be a string, got {_describe(value)}")
    name = value.strip().lower()
    name = KV_ALIASES.get(name, name)
    if name not in KV_CACHE_TYPES:
        raise OptionError(f"{what}: unknown KV cache type {value!r} (use {', '.join(KV_CACHE_TYPES)})")
    return name


def _describe(value: Any) -> str:
    kind = {bool: "a boolean", str: "a string", list: "a list", dict: "an object", type(None): "null"}.get(
        type(value), type(value).__name__
    )
    return f"{kind} ({value!r})" if not isinstance(value, (list, dict)) else kind


def _fmt(x: float | None) -> str:
    if x is None:
        return "any"
    return str(int(x)) if float(x).is_integer() else str(x)
