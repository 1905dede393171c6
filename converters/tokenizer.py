"""Tokenizer metadata for GGUF: BPE from tokenizer.json (`gpt2` model) or SentencePiece from
tokenizer.model (`llama` model), special token ids, add_bos/add_eos and the chat template.

The keys, their order and their values follow llama.cpp's converter (V26 `conversion/base.py` and the
`SpecialVocab` of its gguf-py) so a converted file carries the same vocabulary metadata. Reading needs
no transformers: tokenizer.json is plain JSON, tokenizer.model a small protobuf parsed here; only the
pre-tokenizer fingerprint needs the `tokenizers` library (to encode the check text).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from localrt.converters.hf import ConvertError
from localrt.converters.hf import read_json
from localrt.converters.pretok import CHECK_TEXT
from localrt.converters.pretok import PRE_TOKENIZERS

# GGUF token types (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPECIAL_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
# special types the GGUF writer has a key for (cls has none, so llama.cpp's converter skips it)
ID_KEYS = {
    "bos": "bos_token_id",
    "eos": "eos_token_id",
    "unk": "unknown_token_id",
    "sep": "seperator_token_id",
    "pad": "padding_token_id",
    "mask": "mask_token_id",
    "eot": "eot_token_id",
    "eom": "eom_token_id",
}
ADD_KEYS = ("bos", "eos", "sep")

KVMap = dict[str, tuple[Any, str]]  # key -> (value, type); re-setting a key keeps its position


def looks_special(token: str) -> bool:
    """Added tokens that act as control tokens even when not flagged special (<|...|>, <unused..>, ...)."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


# ---- SentencePiece ---------------------------------------------------------------------------------
def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    """Protobuf wire format: (field number, wire type, value) for varint / fixed / length-delimited."""
    pos = 0
    while pos < len(buf):
        tag, pos = _varint(buf, pos)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos : pos + 8], pos + 8
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + n], pos + n
        elif wire == 5:
            value, pos = buf[pos : pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield field, wire, value


def read_sentencepiece(path: Path) -> list[tuple[bytes, float, int]]:
    """(piece, score, type) for every piece of a SentencePiece ModelProto (field 1 of the model)."""
    try:
        pieces = []
        for field, wire, value in _fields(path.read_bytes()):
            if field != 1 or wire != 2:
                continue
            piece, score, kind = b"", 0.0, NORMAL
            for f, w, v in _fields(value):
                if f == 1 and w == 2:
                    piece = bytes(v)
                elif f == 2 and w == 5:
                    score = struct.unpack("<f", v)[0]
                elif f == 3 and w == 0:
                    kind = v
            pieces.append((piece, score, kind))
    except (ValueError, IndexError, struct.error) as e:
        raise ConvertError(f"{path}: not a SentencePiece model ({e})") from None
    if not pieces:
        raise ConvertError(f"{path}: SentencePiece model has no pieces")
    return pieces


def spm_vocab(model_dir: Path, hparams: dict[str, Any]) -> tuple[list[bytes], list[float], list[int]]:
    pieces = read_sentencepiece(model_dir / "tokenizer.model")
    n = hparams.get("vocab_size") or len(pieces)
    tokens = [f"[PAD{i}]".encode() for i in range(n)]
    scores = [-10000.0] * n
    types = [UNUSED] * n
    # sentencepiece's IsUnknown / IsControl / IsUnused / IsByte; user-defined pieces stay NORMAL
    kinds = {2: UNKNOWN, 3: CONTROL, 5: UNUSED, 6: BYTE}
    for i, (piece, score, kind) in enumerate(pieces[:n]):
        tokens[i], scores[i], types[i] = piece, score, kinds.get(kind, NORMAL)
    added = read_json(model_dir / "added_tokens.json") or {}
    for text, tid in added.items():
        if tid < n:
            tokens[tid], scores[tid], types[tid] = text.encode(), -1000.0, USER_DEFINED
    config = read_json(model_dir / "tokenizer_config.json") or {}
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        tid, text = int(key), entry["content"]
        if tid >= n:
            continue
        if entry.get("special") or looks_special(text):
            types[tid] = CONTROL
        else:
            text = text.replace("\u2581", " ")  # user-defined tokens are matched pre-normalized
            types[tid] = USER_DEFINED
        scores[tid], tokens[tid] = -1000.0, text.encode()
    return tokens, scores, types


def phi3_spm_vocab(model_dir: Path, hparams: dict[str, Any]) -> tuple[list[bytes], list[float], list[int]]:
    """Phi-3's reading of a SentencePiece vocabulary: added tokens (added_tokens.json, then
    tokenizer_config's added_tokens_decoder, then tokenizer.json's added_tokens) overwrite their ids as
    USER_DEFINED, or CONTROL when flagged special, with their text as written."""
    pieces = read_sentencepiece(model_dir / "tokenizer.model")
    n = hparams.get("vocab_size") or len(pieces)
    if len(pieces) > n:
        raise ConvertError(
            f"tokenizer.model has {len(pieces)} pieces, more than vocab_size {n} of config.json"
        )
    tokens = [f"[PAD{i}]".encode() for i in range(n)]
    scores = [-10000.0] * n
    types = [UNUSED] * n
    kinds = {2: UNKNOWN, 3: CONTROL, 5: UNUSED, 6: BYTE}
    for i, (piece, score, kind) in enumerate(pieces):
        tokens[i], scores[i], types[i] = piece, score, kinds.get(kind, NORMAL)
    for text, tid in (read_json(model_dir / "added_tokens.json") or {}).items():
        if tid < n:
            tokens[tid], scores[tid], types[tid] = text.encode(), -1000.0, USER_DEFINED
    config = read_json(model_dir / "tokenizer_config.json") or {}
    entries = [(int(k), e) for k, e in (config.get("added_tokens_decoder") or {}).items()]
    entries += [
        (int(e["id"]), e) for e in (read_json(model_dir / "tokenizer.json") or {}).get("added_tokens") or []
    ]
    for tid, entry in entries:
        if tid >= n:
            raise ConvertError(f"added token {entry['content']!r} has id {tid}, outside vocab_size {n}")
        tokens[tid], scores[tid] = entry["content"].encode(), -1000.0
        types[tid] = CONTROL if entry.get("special") else USER_DEFINED
    return tokens, scores, types


# ---- GPT-2 style BPE ------------------------------------------------------------------------------
def pre_tokenizer_name(tokenizer_json: Path) -> str:
    """llama.cpp's name for the pre-tokenizer: a fingerprint of how the tokenizer splits CHECK_TEXT."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConvertError(
            "converting a BPE tokenizer needs the 'tokenizers' package (pip install tokenizers)"
        ) from None
    ids = Tokenizer.from_file(str(tokenizer_json)).encode(CHECK_TEXT).ids
    digest = hashlib.sha256(str(ids).encode()).hexdigest()
    name = PRE_TOKENIZERS.get(digest)
    if name is None:
        raise ConvertError(
            f"{tokenizer_json}: unknown BPE pre-tokenizer (fingerprint {digest}); llama.cpp "
            "would not know how to split text for it"
        )
    return name


def bpe_vocab(
    model_dir: Path, hparams: dict[str, Any], byte_fallback: bool = False
) -> tuple[list[str], list[int], str]:
    """GPT-2-style BPE from tokenizer.json. `byte_fallback`: accept a SentencePiece-style BPE
    (Gemma 3 without tokenizer.model, which llama.cpp's converter reads this way too)."""
    path = model_dir / "tokenizer.json"
    tj = json.loads(path.read_text(encoding="utf-8"))
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        raise ConvertError(f"{path}: tokenizer model {model.get('type')!r} is not supported (BPE only)")
    if model.get("byte_fallback") and not byte_fallback and not (model_dir / "tokenizer.model").is_file():
        raise ConvertError(f"{path}: SentencePiece-style BPE without tokenizer.model is not supported yet")
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    added = {a["id"]: a for a in tj.get("added_tokens") or []}
    for a in added.values():
        vocab[a["content"]] = a["id"]
    n = hparams.get("vocab_size") or len(vocab)
    if vocab and max(vocab.values()) >= n:
        raise ConvertError(f"{path}: token id {max(vocab.values())} is outside vocab_size {n} of config.json")
    by_id = {i: t for t, i in vocab.items()}
    added_text = {a["content"] for a in added.values()}
    tokens: list[str] = []
    types: list[int] = []
    for i in range(n):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
            continue
        if token in added_text:
            entry = added.get(i, {})
            if entry.get("special") or looks_special(token):
                types.append(CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(USER_DEFINED)
        else:
            types.append(NORMAL)
        tokens.append(token)
    return tokens, types, pre_tokenizer_name(path)


def bpe_merges(tj: dict[str, Any]) -> list[str]:
    """Merges as "a b" strings; the newer [a, b] form encodes spaces inside a part as U+0120."""
    merges = (tj.get("model") or {}).get("merges") or []
    if merges and isinstance(merges[0], list):
        return [
            " ".join("".join("\u0120" if c == " " else c for c in part) for part in pair) for pair in merges
        ]
    return list(merges)


# ---- special tokens, add_bos/add_eos, chat template (SpecialVocab) --------------------------------
class _Special:
    """Special token ids and flags, collected in the order llama.cpp's SpecialVocab collects them."""

    def __init__(self, model_dir: Path, load_merges: bool, n_vocab: int | None) -> None:
        self.n_vocab = n_vocab
        self.types: tuple[str, ...] = SPECIAL_TYPES
        self.ids: dict[str, int] = {}
        self.add: dict[str, bool] = {}
        self.merges: list[str] = []
        self.chat_template: Any = None
        self.lowercase: bool | None = None
        self.strip_accents: bool | None = None
        self._from_tokenizer_json(model_dir, load_merges)
        config = read_json(model_dir / "config.json") or {}
        for typ in self.types:
            tid = config.get(f"{typ}_token_id")
            if tid is None and isinstance(config.get("text_config"), dict):
                tid = config["text_config"].get(f"{typ}_token_id")
            self._set(typ, tid)
        if load_merges and not self.merges and (model_dir / "merges.txt").is_file():
            self.merges = _merges_txt(model_dir / "merges.txt")

    def _set(self, typ: str, tid: Any) -> None:
        if not isinstance(tid, int) or isinstance(tid, bool):
            return
        if tid < 0:
            raise ConvertError(f"invalid {typ} token id {tid}")
        if (self.n_vocab is None or tid < self.n_vocab) and typ not in self.ids:
            self.ids[typ] = tid

    def _normalizer(self, norm: dict[str, Any]) -> None:
        kind = norm.get("type")
        if kind == "Lowercase":
            self.lowercase = True
        elif kind == "StripAccents":
            self.strip_accents = True
        elif kind == "BertNormalizer":
            self.lowercase = norm.get("lowercase", self.lowercase)
            self.strip_accents = norm.get("strip_accents", self.strip_accents)
        elif kind == "Sequence":
            for n in norm.get("normalizers") or []:
                self._normalizer(n)

    def _from_tokenizer_json(self, model_dir: Path, load_merges: bool) -> None:
        tj = read_json(model_dir / "tokenizer.json")
        added: list[dict[str, Any]] = []
        if tj is not None:
            if load_merges:
                self.merges = bpe_merges(tj)
            if tj.get("normalizer"):
                self._normalizer(tj["normalizer"])
            added = tj.get("added_tokens") or []
        tc = read_json(model_dir / "tokenizer_config.json")
        if tj is not None:
            self._post_processor(tj.get("post_processor"), tc)
        if not tc:
            return
        self.chat_template = _chat_template(model_dir, tc)
        for typ in self.types:
            flag = tc.get(f"add_{typ}_token")
            if isinstance(flag, bool) and typ not in self.add:
                self.add[typ] = flag  # the post-processor, when it says something, wins
            entry = tc.get(f"{typ}_token")
            content = entry.get("content") if isinstance(entry, dict) else entry
            if not isinstance(content, str):
                continue
            self._set(typ, next((a.get("id") for a in added if a.get("content") == content), None))

    def _post_processor(self, pp: dict[str, Any] | None, tc: dict[str, Any] | None) -> None:
        """Whether the tokenizer adds BOS/EOS/SEP itself (ByteLevel, RobertaProcessing, TemplateProcessing)."""
        if not pp:
            return
        tc_ = tc or {}
        bos, cls, eos, sep = (tc_.get(k) for k in ("bos_token", "cls_token", "eos_token", "sep_token"))
        if not bos and cls and tc:
            tc["bos_token"] = bos = cls
        if not eos and sep and tc:
            tc["eos_token"] = eos = sep
        for proc in pp.get("processors", [pp]):
            kind = proc.get("type")
            if kind == "ByteLevel":
                self.add.setdefault("bos", False)
                self.add.setdefault("eos", False)
            elif kind == "RobertaProcessing":
                self.add.update(bos=True, eos=True, sep=True)
                if not cls and tc:
                    tc["cls_token"] = cls = proc.get("cls", [bos])[0]
                if not sep and tc:
                    tc["sep_token"] = sep = proc.get("sep", [eos])[0]
            elif kind == "TemplateProcessing":
                bos, cls, eos, sep = self._template(proc, tc, bos, cls, eos, sep)

    def _template(
        self, proc: dict[str, Any], tc: dict[str, Any] | None, bos: Any, cls: Any, eos: Any, sep: Any
    ) -> tuple[Any, Any, Any, Any]:
        """TemplateProcessing: which special tokens wrap a single sequence (bos/eos) and a pair (sep)."""
        single, pair = proc.get("single") or [], proc.get("pair") or []
        first = last = None
        if len(single) > 1:
            first = _special_id(single[0])
            if first:
                bos, cls = self._template_first(first, tc, bos, cls)
            last = _special_id(single[-1])
            if last:
                eos = self._template_last(last, tc, eos)
        if pair:
            self._template_pair(pair, first, last, tc, sep, eos)
        return bos, cls, eos, sep

    def _template_first(self, first: Any, tc: dict[str, Any] | None, bos: Any, cls: Any) -> tuple[Any, Any]:
        if not tc:
            bos = first
        elif first not in (bos, cls):
            if not bos:
                tc["bos_token"] = bos = first
            if not cls:
                tc["cls_token"] = cls = first
        self.add["bos"] = first in (bos, cls)
        return bos, cls

    def _template_last(self, last: Any, tc: dict[str, Any] | None, eos: Any) -> Any:
        if not tc:
            eos = last
        elif last != eos:
            # a trailing token other than EOS becomes EOS; the old EOS moves to EOT (or EOM)
            for extra in ("eot", "eom"):
                if extra not in self.types:
                    self.types = (*self.types, extra)
                    tc[f"{extra}_token"] = eos
                    break
            tc["eos_token"] = eos = last
        self.add["eos"] = last == eos
        return eos

    def _template_pair(
        self, pair: list[Any], first: Any, last: Any, tc: dict[str, Any] | None, sep: Any, eos: Any
    ) -> None:
        start = 1 if first and _special_id(pair[0]) == first else 0
        stop = -1 if last and _special_id(pair[-1]) == last else None
        pair = pair[slice(start, stop)]
        if not (
            pair
            and pair[0].get("Sequence", {}).get("id") == "A"
            and pair[-1].get("Sequence", {}).get("id") == "B"
        ):
            return
        middle = pair[1:-1]
        if not middle:
            return
        add_sep = False
        entry = _special_id(middle[0])
        if entry and entry in (sep, eos) and not last:
            add_sep = True
        if len(middle) == 2:
            entry = _special_id(middle[1])
            if entry and entry in (sep, eos):
                add_sep = True
        self.add["sep"] = add_sep
        if add_sep and not sep and tc:
            tc["sep_token"] = eos

    def kv(self, out: KVMap) -> None:
        """Append the keys in SpecialVocab.add_to_gguf's order."""
        if self.merges:
            out["tokenizer.ggml.merges"] = (self.merges, "arr_str")
        for typ, tid in self.ids.items():
            if typ in ID_KEYS:
                out[f"tokenizer.ggml.{ID_KEYS[typ]}"] = (tid, "u32")
        for typ, flag in self.add.items():
            if typ in ADD_KEYS:
                out[f"tokenizer.ggml.add_{typ}_token"] = (flag, "bool")
        if self.chat_template is not None:
            # a list holds named templates; the writer's add_chat_template lays out their keys
            out["tokenizer.chat_template"] = (self.chat_template, "chat_template")
        if self.lowercase is not None:
            out["tokenizer.ggml.normalizer.lowercase"] = (self.lowercase, "bool")
        if self.strip_accents is not None:
            out["tokenizer.ggml.normalizer.strip_accents"] = (self.strip_accents, "bool")


def _merges_txt(path: Path) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    if lines and lines[0].strip().startswith("#"):
        lines = lines[1:]
    return [f"{a} {b}" for a, b in (ln.split() for ln in lines if len(ln.split()) == 2)]


def _chat_template(model_dir: Path, tc: dict[str, Any]) -> Any:
    alt: Any = None
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        alt = jinja.read_text(encoding="utf-8")
        extra = sorted((model_dir / "additional_chat_templates").glob("*.jinja"))
        if extra:
            alt = [{"name": "default", "template": alt}]
            alt += [{"name": p.stem, "template": p.read_text(encoding="utf-8")} for p in extra]
    elif (model_dir / "chat_template.json").is_file():
        alt = (read_json(model_dir / "chat_template.json") or {}).get("chat_template")
    template = tc.get("chat_template", alt)
    return template if template is None or isinstance(template, (str, list)) else None


# ---- entry point ----------------------------------------------------------------------------------
def vocab_kv(
    model_dir: Path,
    hparams: dict[str, Any],
    kinds: tuple[str, ...],
    arch_name: str,
    spm_no_space_prefix: bool = False,
) -> KVMap:
    """The tokenizer keys of a converted model, in llama.cpp's order.

    `kinds` are tried in order: "spm" (tokenizer.model), "gpt2" (tokenizer.json), "phi3" (Phi-3's
    converter: GPT-2 BPE when tokenizer_config names GPT2Tokenizer, else its own SentencePiece reading).
    `spm_no_space_prefix`: a SentencePiece vocabulary gets add_space_prefix=False after its special
    tokens (Gemma).
    """
    out: KVMap = {}
    tc = read_json(model_dir / "tokenizer_config.json") or {}
    if arch_name == "llama" and tc.get("add_prefix_space") is not None:
        out["tokenizer.ggml.add_space_prefix"] = (bool(tc["add_prefix_space"]), "bool")
    for kind in kinds:
        if kind == "phi3":
            kind = "gpt2" if tc.get("tokenizer_class") == "GPT2Tokenizer" else "phi3"
        spm = {"spm": spm_vocab, "phi3": phi3_spm_vocab}.get(kind)
        if spm is not None and (model_dir / "tokenizer.model").is_file():
            tokens, scores, types = spm(model_dir, hparams)
            out["tokenizer.ggml.model"] = ("llama", "str")
            out["tokenizer.ggml.pre"] = ("default", "str")
            out["tokenizer.ggml.tokens"] = (tokens, "arr_str")
            out["tokenizer.ggml.scores"] = (scores, "arr_f32")
            out["tokenizer.ggml.token_type"] = (types, "arr_i32")
            _Special(model_dir, load_merges=False, n_vocab=len(tokens)).kv(out)
            if spm_no_space_prefix:
                out["tokenizer.ggml.add_space_prefix"] = (False, "bool")
            break
        if kind == "gpt2" and (model_dir / "tokenizer.json").is_file():
            btokens, btypes, pre = bpe_vocab(model_dir, hparams, byte_fallback=arch_name == "gemma3")
            out["tokenizer.ggml.model"] = ("gpt2", "str")
            out["tokenizer.ggml.pre"] = (pre, "str")
            out["tokenizer.ggml.tokens"] = (btokens, "arr_str")
            out["tokenizer.ggml.token_type"] = (btypes, "arr_i32")
            _Special(model_dir, load_merges=True, n_vocab=None).kv(out)
            break
    else:
        wanted = " or ".join(
            "tokenizer.json" if k == "gpt2" else "tokenizer.model" for k in dict.fromkeys(kinds)
        )
        raise ConvertError(f"{model_dir} has no {wanted}")
    if arch_name == "llama" and hparams.get("vocab_size") == 49152:
        # llama.cpp's converter turns BOS off for vocabularies of this size (Granite small models),
        # which SmolLM2 shares; mirrored so the converted files agree
        out["tokenizer.ggml.add_bos_token"] = (False, "bool")
    return out


def _special_id(item: dict[str, Any]) -> Any:
    """The id of a TemplateProcessing `SpecialToken` entry (None for a `Sequence` entry)."""
    return item.get("SpecialToken", {}).get("id")
