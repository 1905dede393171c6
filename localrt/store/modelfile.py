"""A minimal Modelfile (Ollama's format) and `create`: import a GGUF or derive from a stored model.

    # comment
    FROM ./model.gguf | name:tag          (a path is relative to the Modelfile)
    FROM ./mmproj.gguf                    (a second FROM: a vision model's projector, as in Ollama)
    PARAMETER temperature 0.7             (repeatable; `stop` accumulates a list)
    TEMPLATE \"\"\"...\"\"\"                  (multi-line values in triple quotes)
    SYSTEM "one line"
    LICENSE \"\"\"...\"\"\"
    DRAFT ./draft.gguf | name:tag         (a draft model for speculative decoding)
    ADAPTER ./lora.gguf | ./peft-dir | sha256:...  (repeatable: a LoRA GGUF or PEFT folder, llama.cpp only)
    FROM https://host:port/v1             (a remote model; several FROM URLs make a pool)
    PARAMETER remote_model ID             (the upstream's model id; PARAMETER api_key_env VAR for a key)
    MESSAGE user "..."                    (repeatable: few-shot turns every prompt starts with)
    REQUIRES 0.1.0                        (the oldest localrt that can run the model; checked here)
    PARSER qwen3 / RENDERER qwen3-coder   (Ollama's built-in names, mapped to our formats)

Keywords are case-insensitive; every error names its line.
"""

from __future__ import annotations

import contextlib
import errno
import math
import re
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from localrt import config
from localrt import faults
from localrt.errors import LocalrtError
from localrt.errors import ModelNotFound
from localrt.store.names import DIGEST_RE
from localrt.store.names import ModelName
from localrt.store.names import normalize_digest
from localrt.store.names import parse_name
from localrt.store.remote import REMOTE_PARAMETERS
from localrt.store.remote import is_remote_url
from localrt.store.store import MEDIA_ADAPTER
from localrt.store.store import MEDIA_DRAFT
from localrt.store.store import MEDIA_MODEL
from localrt.store.store import MEDIA_PROJECTOR
from localrt.store.store import Store
from localrt.store.store import disk_full

# Ollama's option types (api/types.go); names not listed are typed from their value.
PARAMETER_TYPES: dict[str, type] = {
    **dict.fromkeys(
        (
            "num_ctx",
            "num_batch",
            "kv_pool",
            "num_gpu",
            "main_gpu",
            "num_thread",
            "num_keep",
            "seed",
            "num_predict",
            "top_k",
            "repeat_last_n",
            "mirostat",
        ),
        int,
    ),
    **dict.fromkeys(
        (
            "temperature",
            "top_p",
            "min_p",
            "typical_p",
            "repeat_penalty",
            "presence_penalty",
            "frequency_penalty",
            "mirostat_tau",
            "mirostat_eta",
            "tfs_z",
        ),
        float,
    ),
    **dict.fromkeys(("penalize_newline", "numa", "low_vram", "use_mmap", "use_mlock", "vocab_only"), bool),
    "stop": list,
}
_PARAM_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_TRUE = {"1", "t", "true", "yes", "on"}
_FALSE = {"0", "f", "false", "no", "off"}
MESSAGE_ROLES = ("system", "user", "assistant")  # what Ollama's parser allows in a MESSAGE line
_SEMVER = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?$")

# Ollama's built-in reply parsers (model/parsers) -> (thinking, tool-call style) in the runtime's terms
# (runtime/thinking.py, runtime/toolcalls.py): thinking is "none", "tags" (<think>...</think>) or
# "harmony"; a style of None leaves the one the chat template shows (a format we do not parse).
PARSER_FORMATS: dict[str, tuple[str, str | None]] = {
    "qwen3": ("none", "hermes"),
    "qwen3-thinking": ("tags", "hermes"),
    "qwen3.5": ("tags", "hermes"),
    "ornith": ("tags", "hermes"),
    "qwen3-coder": ("none", "hermes"),  # <tool_call><function=...>: the hermes parser reads the XML form
    "qwen3-vl-instruct": ("none", "hermes"),
    "qwen3-vl-thinking": ("tags", "hermes"),
    "ministral": ("none", "mistral"),
    "passthrough": ("none", None),
    "harmony": ("harmony", "harmony"),
    "cogito": ("tags", None),
    "deepseek3": ("tags", None),
    "olmo3": ("none", None),
    "olmo3-think": ("tags", None),
    "nemotron-3-nano": ("tags", "hermes"),
    "nemotron-3.5-nano": ("tags", "hermes"),
    "functiongemma": ("none", None),
    "glm-4.7": ("tags", None),
    "gemma4": ("tags", None),
    "gemma4-no-thinking": ("none", None),
    "glm-ocr": ("none", None),
    "lfm2": ("none", None),
    "lfm2-thinking": ("tags", None),
    "laguna": ("tags", None),
    "poolside-v1": ("tags", None),
    "cohere": ("none", None),
    "glimmer": ("tags", None),
}
# Ollama's built-in prompt renderers (model/renderers): accepted and kept; prompts render through the
# GGUF's own chat template, which for these families spells the same format.
RENDERERS = frozenset(
    (
        "qwen3-coder",
        "qwen3-vl-instruct",
        "qwen3-vl-thinking",
        "qwen3.5",
        "qwen3.8",
        "ornith",
        "cogito",
        "deepseek3.1",
        "olmo3",
        "olmo3.1",
        "olmo3-think",
        "olmo3-32b-think",
        "nemotron-3-nano",
        "nemotron-3.5-nano",
        "gemma4",
        "gemma4-small",
        "gemma4-large",
        "functiongemma",
        "glm-4.7",
        "glm-ocr",
        "lfm2",
        "lfm2-thinking",
        "laguna",
        "poolside-v1",
        "cohere",
        "glimmer",
    )
)


class ModelfileError(LocalrtError):
    pass


def _parse_bool(text: str) -> bool | None:
    low = text.strip().lower()
    return True if low in _TRUE else False if low in _FALSE else None


def parse_parameter(name: str, text: str) -> Any:
    """A PARAMETER value from its text, typed by the parameter's name (or by its look when unknown)."""
    name = name.lower()
    if not _PARAM_NAME.match(name):
        raise LocalrtError(f"invalid parameter name {name!r}")
    kind = PARAMETER_TYPES.get(name)
    if kind is list:
        return [text]
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise LocalrtError(f"parameter {name} expects an integer, got {text!r}") from None
    if kind is float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise LocalrtError(f"parameter {name} expects a number, got {text!r}")
        return value
    if kind is bool:
        flag = _parse_bool(text)
        if flag is None:
            raise LocalrtError(f"parameter {name} expects true or false, got {text!r}")
        return flag
    for convert in (int, float):
        try:
            value = convert(text)
            if isinstance(value, int) or math.isfinite(value):
                return value
        except ValueError:
            pass
    flag = _parse_bool(text) if text.strip().lower() in ("true", "false") else None
    return text if flag is None else flag


def check_parameter(name: str, value: Any) -> Any:
    """An already-typed value (a catalog's TOML) checked against the parameter's type."""
    kind = PARAMETER_TYPES.get(name)
    if not _PARAM_NAME.match(name):
        raise LocalrtError(f"invalid parameter name {name!r}")
    if kind is list or isinstance(value, list):
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
            raise LocalrtError(f"parameter {name} expects a list of strings")
        return list(items)
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
        bool: isinstance(value, bool),
        None: isinstance(value, (int, float, bool, str)),
    }[kind]
    if not ok:
        raise LocalrtError(f"parameter {name} has the wrong type: {value!r}")
    return float(value) if kind is float else value


@dataclass
class Modelfile:
    from_: str | None = None
    from_line: int = 0
    parameters: dict[str, Any] = field(default_factory=dict)
    template: str | None = None
    system: str | None = None
    license: str | None = None
    draft: str | None = None
    draft_line: int = 0
    remotes: list[str] = field(default_factory=list)  # FROM https://host:port/v1 lines: a remote model
    remote_model: str | None = None  # PARAMETER remote_model: the upstream's model id
    api_key_env: str | None = None  # PARAMETER api_key_env: the variable that holds the key
    projector: str | None = None  # the second FROM: a multimodal projector GGUF
    projector_line: int = 0
    messages: list[dict[str, str]] = field(default_factory=list)  # MESSAGE lines, in order
    requires: str | None = None
    parser: str | None = None
    renderer: str | None = None
    adapters: list[tuple[str, int]] = field(default_factory=list)  # ADAPTER lines: (value, line number)

    def formats(self) -> dict[str, str]:
        """The config blob's `renderer`, `parser` and `requires` that this Modelfile sets."""
        named = {"renderer": self.renderer, "parser": self.parser, "requires": self.requires}
        return {k: v for k, v in named.items() if v}


def _value(lines: list[str], i: int, rest: str, keyword: str) -> tuple[str, int]:
    """The value starting in `rest` on line i (0-based); returns it and the index of its last line."""
    stripped = rest.strip()
    if stripped.startswith('"""'):
        body = stripped[3:]
        if '"""' in body:
            value, _, tail = body.partition('"""')
            if tail.strip():
                raise ModelfileError(
                    f'Modelfile line {i + 1}: unexpected text after closing """: {tail.strip()!r}'
                )
            return value, i
        parts = [body] if body else []  # `"""` ending a line opens a block: that newline is not content
        for j in range(i + 1, len(lines)):
            if '"""' in lines[j]:
                last, _, tail = lines[j].partition('"""')
                if tail.strip():
                    raise ModelfileError(f'Modelfile line {j + 1}: unexpected text after closing """')
                if last.strip():  # a closing `"""` on a line of its own adds no trailing newline
                    parts.append(last)
                return "\n".join(parts), j
            parts.append(lines[j])
        raise ModelfileError(f'Modelfile line {i + 1}: {keyword} opens """ but it is never closed')
    if len(stripped) >= 2 and stripped[0] == stripped[-1] == '"':
        return stripped[1:-1].replace('\\"', '"').replace("\\\\", "\\"), i
    if stripped.startswith('"'):
        raise ModelfileError(f"Modelfile line {i + 1}: unterminated quote in {keyword}")
    return stripped, i


_INSTRUCTIONS = (
    "FROM",
    "PARAMETER",
    "TEMPLATE",
    "SYSTEM",
    "LICENSE",
    "DRAFT",
    "ADAPTER",
    "MESSAGE",
    "REQUIRES",
    "PARSER",
    "RENDERER",
)


def parse_modelfile(text: str) -> Modelfile:
    """Parse Modelfile text; ModelfileError names the line of the first problem."""
    mf = Modelfile()
    lines = text.replace("\r\n", "\n").split("\n")
    licenses: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if not line or line.startswith("#"):
            i += 1
            continue
        keyword, rest = (re.split(r"\s+", line, maxsplit=1) + [""])[:2]
        word = keyword.upper()
        where = f"Modelfile line {i + 1}"
        if word not in _INSTRUCTIONS:
            raise ModelfileError(f"{where}: unknown instruction {keyword!r}")
        if not rest.strip():
            raise ModelfileError(f"{where}: {word} needs a value")
        if word == "PARAMETER":
            i = _parameter(mf, lines, i, rest, where) + 1
            continue
        if word == "MESSAGE":
            i = _message(mf, lines, i, rest, where) + 1
            continue
        value, i_end = _value(lines, i, rest, word)
        if word == "LICENSE":
            licenses.append(value)
        else:
            _instruction(mf, word, value, i + 1, where)
        i = i_end + 1
    if licenses:
        mf.license = "\n\n".join(licenses)
    return mf


def _parameter(mf: Modelfile, lines: list[str], i: int, rest: str, where: str) -> int:
    """One PARAMETER line into `mf`; returns the index of its last line."""
    pname, raw = (re.split(r"\s+", rest.strip(), maxsplit=1) + [""])[:2]
    if not raw.strip():
        raise ModelfileError(f"{where}: PARAMETER needs a name and a value")
    value, i_end = _value(lines, i, raw, f"PARAMETER {pname}")
    key = pname.lower()
    if key in REMOTE_PARAMETERS:  # the remote's settings, not sampling: kept as text, never typed
        setattr(mf, key, value.strip())
        return i_end
    try:
        parsed = parse_parameter(pname, value)
    except LocalrtError as e:
        raise ModelfileError(f"{where}: {e}") from None
    if isinstance(parsed, list) and isinstance(mf.parameters.get(key), list):
        mf.parameters[key].extend(parsed)
    else:
        mf.parameters[key] = parsed
    return i_end


def _message(mf: Modelfile, lines: list[str], i: int, rest: str, where: str) -> int:
    """One MESSAGE line (`MESSAGE role content`) into `mf`; returns the index of its last line."""
    role, raw = (re.split(r"\s+", rest.strip(), maxsplit=1) + [""])[:2]
    if role.lower() not in MESSAGE_ROLES:
        raise ModelfileError(f"{where}: MESSAGE role must be one of {', '.join(MESSAGE_ROLES)}, not {role!r}")
    if not raw.strip():
        raise ModelfileError(f"{where}: MESSAGE needs a role and a text")
    value, i_end = _value(lines, i, raw, f"MESSAGE {role}")
    mf.messages.append({"role": role.lower(), "content": value})
    return i_end


def _version(text: str) -> tuple[int, int, int] | None:
    match = _SEMVER.match(text.strip())
    return (int(match[1]), int(match[2]), int(match[3])) if match else None


def check_format_name(key: str, value: str) -> str:
    """A `requires`, `parser` or `renderer` value checked: a version this localrt meets, or one of
    Ollama's built-in names. Returns it as stored (a version without its leading v)."""
    if key == "requires":
        from localrt import __version__

        wanted, ours = _version(value), _version(__version__)
        if wanted is None:
            raise LocalrtError(f"requires must be a version such as 0.1.0, not {value!r}")
        if ours is not None and wanted > ours:
            raise LocalrtError(
                f"this model requires localrt {value.lstrip('v')} or newer (this is {__version__})"
            )
        return value.strip().lstrip("v")
    known = PARSER_FORMATS if key == "parser" else RENDERERS
    if value not in known:
        raise LocalrtError(f"unknown {key} {value!r} (known: {', '.join(sorted(known))})")
    return value


def _instruction(mf: Modelfile, word: str, value: str, line_no: int, where: str) -> None:
    """FROM / DRAFT / TEMPLATE / SYSTEM into `mf`; several FROM lines are allowed only as a pool of URLs."""
    if word == "FROM":
        if not is_remote_url(value):
            if mf.remotes:
                raise ModelfileError(f"{where}: a local FROM after a URL FROM (line {mf.from_line})")
            _add_from(mf, value, line_no, where)  # the model, or a second one: its projector
            return
        if mf.from_ is not None and not mf.remotes:
            raise ModelfileError(f"{where}: a URL FROM after a local FROM (line {mf.from_line})")
        mf.remotes.append(value.strip())
        if mf.from_ is None:
            mf.from_, mf.from_line = value, line_no
    elif word == "DRAFT":
        mf.draft, mf.draft_line = value, line_no
    elif word == "ADAPTER":
        mf.adapters.append((value.strip(), line_no))
    elif word in ("REQUIRES", "PARSER", "RENDERER"):
        try:
            setattr(mf, word.lower(), check_format_name(word.lower(), value.strip()))
        except LocalrtError as e:
            raise ModelfileError(f"{where}: {e}") from None
    elif word == "TEMPLATE":
        mf.template = value
    else:
        mf.system = value


def _add_from(mf: Modelfile, value: str, line: int, where: str) -> None:
    """The first FROM is the model, a second one its projector (Ollama's vision Modelfiles)."""
    if mf.projector is not None:
        raise ModelfileError(
            f"{where}: a third FROM (a model takes one GGUF and one projector, lines "
            f"{mf.from_line} and {mf.projector_line})"
        )
    if mf.from_ is not None:
        mf.projector, mf.projector_line = value, line
    else:
        mf.from_, mf.from_line = value, line


def looks_like_path(value: str) -> bool:
    return (
        value.startswith(("/", "./", "../", "~", ".\\")) or value.lower().endswith(".gguf") or "\\" in value
    )


def _resolve_source(value: str, base_dir: Path, store: Store, where: str) -> Path | ModelName:
    """FROM/DRAFT value -> an existing file path, or the name of a stored model."""
    candidate = Path(value).expanduser()
    if not candidate.is_absolute():
        candidate = base_dir / candidate
    if candidate.exists():
        return candidate
    if looks_like_path(value):
        raise LocalrtError(f"{where}model file not found: {value}")
    try:
        name = parse_name(value)
    except LocalrtError:
        raise LocalrtError(f"{where}{value!r} is neither a file nor a model name") from None
    if not store.exists(name):
        raise ModelNotFound(f"{where}model '{name.display}' not found, try pulling it first")
    return name


def _resolve_adapter(value: str, base_dir: Path, store: Store, where: str) -> Path | str:
    """ADAPTER value -> an existing file (relative to the Modelfile), or a stored blob's digest."""
    if DIGEST_RE.match(value):
        blob = normalize_digest(value)
        if not store.has_blob(blob):
            raise LocalrtError(f"{where}adapter blob {blob} is not in the store")
        return blob
    candidate = Path(value).expanduser()
    if not candidate.is_absolute():
        candidate = base_dir / candidate
    if not candidate.exists():
        raise LocalrtError(f"{where}adapter file not found: {value}")
    return candidate


def _layer_digests(store: Store, name: ModelName, media: str) -> list[str]:
    manifest, _ = store.read_manifest(name)
    return [layer["digest"] for layer in manifest.get("layers", []) if layer.get("mediaType") == media]


def _layer_digest(store: Store, name: ModelName, media: str) -> str | None:
    manifest, _ = store.read_manifest(name)
    return next(
        (layer["digest"] for layer in manifest.get("layers", []) if layer.get("mediaType") == media), None
    )


def create(
    name: str | ModelName,
    *,
    modelfile_text: str | None = None,
    from_path: str | Path | None = None,
    store: Store | None = None,
    base_dir: str | Path | None = None,
    quantize: str | None = None,
    remote: Sequence[str] | None = None,
    remote_model: str | None = None,
    api_key_env: str | None = None,
    insecure: bool = False,
    projector_path: str | Path | None = None,
    imatrix: str | Path | None = None,
    adapters: Sequence[str | Path] = (),
) -> ModelName:
    """`localrt create`: a model from a GGUF file or an existing model, plus Modelfile overrides.

    Args:
        name: the new model's name.
        modelfile_text: Modelfile text; its FROM is overridden by `from_path` when both are given.
        from_path: a GGUF file (or a model name) to build from.
        store: the store (default: LOCALRT_MODELS).
        base_dir: where relative FROM/DRAFT paths start (the Modelfile's folder; default: cwd).
        quantize: requantize an F32/F16/BF16 source to this file type (e.g. Q4_K_M) first.
        remote: OpenAI-compatible endpoint URLs (they replace the Modelfile's FROM): a remote model.
        remote_model, api_key_env, insecure: its upstream model id, key variable, plain-http consent.
        projector_path: a multimodal projector GGUF (mmproj) for a vision model; overrides a second FROM.
        imatrix: an importance-matrix file that weights that quantization (`localrt imatrix`).
        adapters: LoRA adapter GGUFs (`--adapter`), after the Modelfile's ADAPTER lines.
    """
    store = store or Store()
    dest = parse_name(name) if isinstance(name, str) else name
    mf = parse_modelfile(modelfile_text) if modelfile_text is not None else Modelfile()
    if remote:
        mf.remotes, mf.from_ = list(remote), str(remote[0])
    mf.adapters += [(str(path), 0) for path in adapters]
    if mf.remotes:
        if projector_path is not None:
            raise ModelfileError("--mmproj does not apply to a remote model")
        _create_remote(store, dest, mf, quantize, remote_model, api_key_env, insecure)
        return dest
    if from_path is not None:
        mf.from_, mf.from_line = str(from_path), 0
    if not mf.from_:
        raise ModelfileError("Modelfile has no FROM line (name a GGUF file or a model)")
    base = Path(base_dir) if base_dir is not None else Path.cwd()

    def where(line: int) -> str:
        return f"Modelfile line {line}: " if line else ""

    source = _resolve_source(mf.from_, base, store, where(mf.from_line))
    draft: Path | ModelName | None = None
    if mf.draft is not None:
        draft = _resolve_source(mf.draft, base, store, where(mf.draft_line))
    if projector_path is not None:
        mf.projector, mf.projector_line = str(projector_path), 0
    projector: Path | ModelName | None = None
    if mf.projector is not None:
        projector = _resolve_source(mf.projector, base, store, where(mf.projector_line))
        source, projector = _model_first(source, projector)
    lora = [_resolve_adapter(value, base, store, where(line)) for value, line in mf.adapters]
    with quantized(store, source, quantize, _load_imatrix(imatrix, quantize)) as source:
        build_model(
            store,
            dest,
            source,
            template=mf.template,
            system=mf.system,
            license_text=mf.license,
            parameters=mf.parameters,
            draft=draft,
            projector=projector,
            messages=mf.messages,
            formats=mf.formats(),
            adapters=lora,
        )
    return dest


def _create_remote(
    store: Store,
    dest: ModelName,
    mf: Modelfile,
    quantize: str | None,
    remote_model: str | None,
    api_key_env: str | None,
    insecure: bool,
) -> None:
    from localrt.store.remote import create_remote

    if quantize:
        raise ModelfileError("--quantize does not apply to a remote model (its weights live upstream)")
    if mf.messages or mf.formats():
        raise ModelfileError("MESSAGE, REQUIRES, PARSER and RENDERER do not apply to a remote model")
    if mf.draft is not None:
        raise ModelfileError("DRAFT does not apply to a remote model")
    if mf.adapters:
        raise ModelfileError("ADAPTER does not apply to a remote model (its weights live upstream)")
    create_remote(
        store,
        dest,
        mf.remotes,
        model=remote_model or mf.remote_model,
        api_key_env=api_key_env or mf.api_key_env,
        insecure=insecure,
        parameters=mf.parameters,
        system=mf.system,
        template=mf.template,
        license_text=mf.license,
    )


def _load_imatrix(path: str | Path | None, file_type: str | None, label: str | None = None) -> Any:
    """(Imatrix, the label llama-quantize would record) for --imatrix, or None; checked up front."""
    if path is None:
        return None
    from localrt.converters import imatrix as imatrix_io
    from localrt.converters.mixes import parse_file_type

    if not file_type:
        raise LocalrtError("--imatrix needs --quantize TYPE")
    imatrix_io.check_quantized(parse_file_type(file_type), imatrix_io.Imatrix())
    return imatrix_io.read(path), label or str(path)


def _model_first(
    source: Path | ModelName, projector: Path | ModelName
) -> tuple[Path | ModelName, Path | ModelName]:
    """Two FROM lines in either order, as Ollama takes them: the projector GGUF is the one of arch clip."""
    from localrt.store.importer import is_projector

    if isinstance(source, Path) and isinstance(projector, Path) and source.is_file() and projector.is_file():
        with contextlib.suppress(LocalrtError, OSError):
            if is_projector(source) and not is_projector(projector):
                return projector, source
    return source, projector


@contextlib.contextmanager
def quantized(
    store: Store, source: Path | str | ModelName, file_type: str | None, imatrix: Any = None
) -> Iterator[Path | str | ModelName]:
    """The source itself, or (with a file type) a requantized copy in a scratch folder inside the store,
    so the finished GGUF moves into blobs/ by a rename (`Store.adopt`); the folder goes afterwards.
    `imatrix`: (Imatrix, label) from _load_imatrix, weighting the quantization. A full disk is a
    StorageFull naming the file and the room it needed, and leaves nothing behind."""
    if not file_type:
        yield source
        return
    from localrt.converters.requantize import requantize

    if isinstance(source, ModelName):
        source = store.resolve(source).model_path
    elif isinstance(source, str):
        source = store.blob_path(source)
    with store.scratch(".quantize-") as tmp:
        im, label = imatrix if imatrix is not None else (None, "")
        out = tmp / "model.gguf"
        try:
            made = requantize(Path(source), out, file_type, imatrix=im, imatrix_label=label)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise disk_full(out, getattr(e, "needed", None), "the partial file was removed") from None
            raise
        faults.reach("scratch.written")
        yield made


_FORMAT_KEYS = ("renderer", "parser", "requires")


def build_model(
    store: Store,
    dest: ModelName,
    source: Path | str | ModelName,
    *,
    template: str | None = None,
    system: str | None = None,
    license_text: str | None = None,
    parameters: dict[str, Any] | None = None,
    draft: Path | str | ModelName | None = None,
    projector: Path | str | ModelName | None = None,
    messages: list[dict[str, str]] | None = None,
    formats: dict[str, str] | None = None,
    adapters: Sequence[Path | str] = (),
) -> None:
    """Write `dest` from a GGUF (path or stored digest) or from a stored model whose layers it inherits;
    the given template/system/license/parameters/draft/projector override the inherited ones, and
    MESSAGE turns (when any) replace the inherited history, as in Ollama; `adapters` (LoRA GGUFs) come
    after the inherited ones."""
    from localrt.store.importer import import_gguf

    params: dict[str, Any] = {}
    inherited_draft: str | None = None
    inherited_projector: str | None = None
    inherited_adapters: list[str] = []
    if isinstance(source, ModelName):
        # derive: inherit every layer of the stored model, then apply the overrides
        base_model = store.resolve(source)
        gguf: Path | str = _layer_digest(store, source, MEDIA_MODEL) or ""
        inherited_draft = _layer_digest(store, source, MEDIA_DRAFT)
        inherited_projector = _layer_digest(store, source, MEDIA_PROJECTOR)
        inherited_adapters = _layer_digests(store, source, MEDIA_ADAPTER)
        template = template if template is not None else base_model.template
        system = system if system is not None else base_model.system
        license_text = license_text if license_text is not None else base_model.license
        params.update(base_model.params)
        messages = messages or base_model.messages
        inherited = {k: base_model.config[k] for k in _FORMAT_KEYS if base_model.config.get(k)}
        formats = {**inherited, **(formats or {})}
    else:
        gguf = source
    params.update(parameters or {})
    draft_source: Path | str | None = inherited_draft
    if isinstance(draft, ModelName):
        draft_source = _layer_digest(store, draft, MEDIA_MODEL)
    elif draft is not None:
        draft_source = draft
    projector_source: Path | str | None = inherited_projector
    if isinstance(projector, ModelName):
        projector_source = _layer_digest(store, projector, MEDIA_PROJECTOR)
        if projector_source is None:
            raise LocalrtError(f"model '{projector.display}' has no projector to take")
    elif projector is not None:
        projector_source = projector
    import_gguf(
        store,
        dest,
        gguf,
        template=template,
        system=system,
        params=params or None,
        license=license_text,
        draft=draft_source,
        projector=projector_source,
        messages=messages or None,
        formats=formats,
        adapters=[*inherited_adapters, *adapters],
    )


def _imatrix_blob(store: Store, digest: Any, file_type: str | None) -> Any:
    """The `imatrix` field of /api/create: the digest of an uploaded importance-matrix blob."""
    if digest is None:
        return None
    if not isinstance(digest, str) or not digest:
        raise LocalrtError("imatrix must be the sha256 digest of an uploaded blob")
    blob = normalize_digest(digest)
    if not store.has_blob(blob):
        raise LocalrtError(f"blob {blob} not found: upload it with POST /api/blobs/{blob} first")
    return _load_imatrix(store.blob_path(blob), file_type, label=blob)


def create_from_request(
    name: ModelName, fields: dict[str, Any], *, store: Store, progress: Callable[[str], None]
) -> None:
    """`POST /api/create`: `from` (a stored model) or `files` (uploaded GGUF blobs), plus overrides.

    Over HTTP a source is never a server-side path: only stored models and uploaded blobs, so a
    request cannot make the server read arbitrary local files.
    """
    file_type = _check_create_fields(fields)
    if fields.get("remote") is not None:
        return _remote_from_request(name, fields, store, progress)
    files, base = fields.get("files"), fields.get("from")
    source: str | ModelName
    projector: str | None = None
    if files:
        if not isinstance(files, dict):
            raise LocalrtError("files must map file names to sha256 digests")
        ggufs = {str(f): str(d) for f, d in files.items() if str(f).lower().endswith(".gguf")}
        for digest in ggufs.values():
            blob = normalize_digest(digest)
            if not store.has_blob(blob):
                raise LocalrtError(f"blob {blob} not found: upload it with POST /api/blobs/{blob} first")
        progress("parsing GGUF")
        blobs = _merge_split_files(store, ggufs, progress)
        if not 1 <= len(blobs) <= 2:
            raise LocalrtError("files must name one .gguf file (two for a vision model and its projector)")
        source, projector = _split_projector(store, blobs)
    elif isinstance(base, str) and base:
        source = parse_name(base)
        if not store.exists(source):
            raise ModelNotFound(f"model '{source.display}' not found, try pulling it first")
    else:
        raise LocalrtError("create needs from (a model name) or files (an uploaded GGUF)")
    parameters = fields.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise LocalrtError("parameters must be an object")
    checked = {str(k).lower(): check_parameter(str(k).lower(), v) for k, v in parameters.items()}
    texts = {}
    for key in ("template", "system", "license"):
        value = fields.get(key)
        if isinstance(value, list):  # Ollama accepts license as a list of texts
            value = "\n\n".join(str(v) for v in value)
        if value is not None and not isinstance(value, str):
            raise LocalrtError(f"{key} must be a string")
        texts[key] = value
    weights = _imatrix_blob(store, fields.get("imatrix"), file_type)
    draft = _draft_from_request(store, fields.get("draft"))
    messages = _messages_from_request(fields.get("messages"))
    formats = _formats_from_request(fields)
    if file_type:
        progress(f"quantizing model to {file_type}")
    with (
        _adapters_from_request(store, fields.get("adapters")) as adapters,
        quantized(store, source, file_type, weights) as model_source,
    ):
        progress("writing manifest")
        build_model(
            store,
            name,
            model_source,
            template=texts["template"],
            system=texts["system"],
            license_text=texts["license"],
            parameters=checked,
            draft=draft,
            projector=projector,
            messages=messages,
            formats=formats,
            adapters=adapters,
        )


PEFT_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
PEFT_SLOT = "<peft>"  # where the request's PEFT folder goes among its adapters


@contextlib.contextmanager
def _adapters_from_request(store: Store, value: Any) -> Iterator[list[str | Path]]:
    """The `adapters` field of /api/create (Ollama's): file name -> sha256 digest of an uploaded blob, applied
    in the order given. A `.gguf` name is a LoRA adapter GGUF; the other files together are one PEFT adapter
    folder (`adapter_config.json` and `adapter_model.safetensors`, as Ollama takes them), laid out under
    their names in a temporary folder for the converter, which lives while the model is built."""
    value = value or {}
    if not isinstance(value, dict):
        raise LocalrtError("adapters must map file names to sha256 digests of uploaded blobs")
    out: list[str | Path] = []
    peft: dict[str, Path] = {}
    for file_name, digest in value.items():
        if not isinstance(digest, str) or not DIGEST_RE.match(digest):
            raise LocalrtError(f"adapters: {file_name} must map to the sha256 digest of an uploaded blob")
        blob = normalize_digest(digest)
        if not store.has_blob(blob):
            raise LocalrtError(f"blob {blob} not found: upload it with POST /api/blobs/{blob} first")
        name = str(file_name)
        if name.lower().endswith(".gguf"):
            out.append(blob)
            continue
        if not PEFT_FILE_NAME.fullmatch(name):  # a plain file name: nothing outside the folder
            raise LocalrtError(f"adapters: {name!r} is not a plain file name")
        if not peft:
            out.append(PEFT_SLOT)  # the folder goes where its first file was listed
        peft[name] = store.blob_path(blob)
    if not peft:
        yield out
        return
    from localrt.converters.lora import ADAPTER_CONFIG
    from localrt.converters.lora import ADAPTER_WEIGHTS

    if not {ADAPTER_CONFIG, ADAPTER_WEIGHTS} <= peft.keys():
        raise LocalrtError(
            f"adapters: a PEFT adapter needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} (got {', '.join(sorted(peft))})"
        )
    with store.scratch(".peft-") as tmp:
        folder = tmp / "adapter"
        folder.mkdir()
        for name, blob_path in peft.items():
            (folder / name).symlink_to(blob_path)
        yield [folder if item is PEFT_SLOT else item for item in out]


def _messages_from_request(value: Any) -> list[dict[str, str]]:
    """The `messages` field of /api/create: MESSAGE turns as {role, content} objects."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise LocalrtError("messages must be a list of {role, content} objects")
    out = []
    for item in value:
        role = item.get("role") if isinstance(item, dict) else None
        content = item.get("content") if isinstance(item, dict) else None
        if role not in MESSAGE_ROLES:
            raise LocalrtError(f"messages: role must be one of {', '.join(MESSAGE_ROLES)}, not {role!r}")
        if not isinstance(content, str):
            raise LocalrtError("messages: content must be a string")
        out.append({"role": role, "content": content})
    return out


def _formats_from_request(fields: dict[str, Any]) -> dict[str, str]:
    """`renderer`, `parser` and `requires` of /api/create, checked as the Modelfile's lines are."""
    out = {}
    for key in _FORMAT_KEYS:
        value = fields.get(key)
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise LocalrtError(f"{key} must be a string")
        out[key] = check_format_name(key, value.strip())
    return out


def _draft_from_request(store: Store, value: Any) -> str | ModelName | None:
    """The `draft` field of /api/create (a Modelfile's DRAFT line): the sha256 digest of an uploaded
    GGUF blob, or a stored model whose weights become the draft."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise LocalrtError("draft must be a model name or the sha256 digest of an uploaded GGUF blob")
    if DIGEST_RE.match(value):
        blob = normalize_digest(value)
        if not store.has_blob(blob):
            raise LocalrtError(f"blob {blob} not found: upload it with POST /api/blobs/{blob} first")
        return blob
    name = parse_name(value)
    if not store.exists(name):
        raise ModelNotFound(f"draft model '{name.display}' not found, try pulling it first")
    return name


def _check_create_fields(fields: dict[str, Any]) -> str | None:
    """The fields every create request is checked for first; returns the quantize file type."""
    file_type = fields.get("quantize")
    if file_type is not None and not isinstance(file_type, str):
        raise LocalrtError("quantize must be a file type such as Q4_K_M")
    if fields.get("modelfile"):
        raise LocalrtError(
            "the modelfile field is not supported: use from, files, template, system, parameters"
        )
    return file_type


def _remote_from_request(
    name: ModelName, fields: dict[str, Any], store: Store, progress: Callable[[str], None]
) -> None:
    """`POST /api/create` with `remote` (a URL or a list), `remote_model`, `api_key_env`, `insecure`."""
    from localrt.store.remote import create_remote

    if fields.get("draft") is not None:
        raise LocalrtError("draft does not apply to a remote model")
    if fields.get("adapters"):
        raise LocalrtError("adapters do not apply to a remote model (its weights live upstream)")
    urls = fields["remote"]
    urls = [urls] if isinstance(urls, str) else urls
    if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
        raise LocalrtError("remote must be a URL or a list of URLs")
    for key in ("remote_model", "api_key_env", "system", "template"):
        if fields.get(key) is not None and not isinstance(fields[key], str):
            raise LocalrtError(f"{key} must be a string")
    license_text = fields.get("license")
    if isinstance(license_text, list):  # Ollama accepts license as a list of texts
        license_text = "\n\n".join(str(v) for v in license_text)
    if license_text is not None and not isinstance(license_text, str):
        raise LocalrtError("license must be a string")
    parameters = fields.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise LocalrtError("parameters must be an object")
    progress("writing manifest")
    create_remote(
        store,
        name,
        urls,
        model=fields.get("remote_model"),
        api_key_env=fields.get("api_key_env"),
        insecure=fields.get("insecure") is True,
        parameters={str(k).lower(): check_parameter(str(k).lower(), v) for k, v in parameters.items()},
        system=fields.get("system"),
        template=fields.get("template"),
        license_text=license_text,
        key_envs=config.remote_key_envs(),  # an API client names only what the server's owner listed
    )


def _merge_split_files(store: Store, ggufs: dict[str, str], progress: Callable[[str], None]) -> list[str]:
    """The uploaded GGUFs' digests, the parts of a split GGUF (named `name-0000i-of-0000N.gguf`, all of
    them given) merged into one blob first, as Ollama stores them."""
    from localrt.store import split

    series = {f: split.split_series(f) for f in ggufs}
    firsts = [f for f, s in series.items() if s is not None and s[1] == 1]
    plain = [normalize_digest(d) for f, d in ggufs.items() if series[f] is None]
    if not any(series.values()):
        return plain
    if len(firsts) != 1:
        raise LocalrtError("files must hold the parts of one split GGUF, its -00001-of- part included")
    names = split.series_names(firsts[0])
    extra = [f for f, s in series.items() if s is not None and f not in names]
    missing = [n for n in names if n not in ggufs]
    if missing:
        raise LocalrtError(f"split GGUF {firsts[0]}: missing part(s) {', '.join(missing)}")
    if extra:
        raise LocalrtError(f"split GGUF {firsts[0]}: {', '.join(extra)} belong to another split GGUF")
    progress(f"merging {len(names)} parts")
    with store.lock("gc"):  # the parts must outlive the merge; the merged blob waits for its manifest
        digest, _ = split.store_merged(store, [store.blob_path(ggufs[n]) for n in names])
    return [digest, *plain]


def _split_projector(store: Store, blobs: list[str]) -> tuple[str, str | None]:
    """Uploaded GGUF blobs -> (model, projector or None); the projector is the one of arch clip."""
    from localrt.store.importer import is_projector

    if len(blobs) == 1:
        return blobs[0], None
    kinds = [is_projector(store.blob_path(d)) for d in blobs]
    if kinds.count(True) != 1:
        raise LocalrtError("of two .gguf files, exactly one must be a multimodal projector (mmproj)")
    return (blobs[1], blobs[0]) if kinds[0] else (blobs[0], blobs[1])
