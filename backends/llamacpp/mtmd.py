"""Images for the llama.cpp backend, through llama.cpp's multimodal library (libmtmd).

A `Projector` is the multimodal projector GGUF (mmproj) loaded beside the text model's weights. It turns a
prompt of text tokens with `IMAGE_TOKEN` where each image goes into a `MediaPrompt`: one entry per KV cell
(text tokens as ints, an image's cells as `ImageCell` keys made of the image's sha256, so prefix reuse
compares images by content and a second question about the same picture re-encodes nothing) plus the
libmtmd chunks that evaluate the cells not cached yet into a given llama context, sequence and position.

The backend keeps the KV bookkeeping (which cells a sequence holds); this module only knows how to expand
a prompt and how to evaluate a range of its cells. It imports llama-cpp-python's `mtmd_cpp` lazily.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from localrt.backends.base import IMAGE_TOKEN
from localrt.backends.base import ImageInput
from localrt.errors import LocalrtError

from .lib import flash_attn_type

CHUNK_TEXT, CHUNK_IMAGE = 0, 1
GGML_LOG_LEVEL_ERROR = 4


class ImageError(LocalrtError):
    """An image the projector cannot take (HTTP 400)."""

    status = 400


@dataclass(frozen=True)
class ImageCell:
    """One KV cell of an image: equal keys mean the same picture at the same offset, so the cell is reusable."""

    digest: str
    index: int


Cell = int | ImageCell


@dataclass
class ImageSpan:
    """One image chunk of a prompt: its cells are `cells[start:start + n_tokens]`."""

    start: int  # first cell of the image chunk in MediaPrompt.cells
    n_tokens: int  # KV cells it fills
    n_pos: int  # positions it advances (fewer than n_tokens for M-RoPE models)
    chunk: Any  # mtmd_input_chunk pointer, owned by one of MediaPrompt's chunk lists


@dataclass
class MediaPrompt:
    """A prompt with images, expanded to KV cells; `close()` frees libmtmd's chunks (keep the layout)."""

    cells: list[Cell] = field(default_factory=list)
    spans: list[ImageSpan] = field(default_factory=list)
    _lists: list[Any] = field(default_factory=list)
    _projector: Projector | None = None

    def position_gaps(self) -> list[tuple[int, int]]:
        """(cell count after an image, positions it did not advance) for M-RoPE images, for a record that
        outlives this prompt (the position after n cells is n minus the gaps ending at or before n)."""
        return [(s.start + s.n_tokens, s.n_tokens - s.n_pos) for s in self.spans if s.n_tokens != s.n_pos]

    def close(self) -> None:
        if self._projector is not None:
            lib = self._projector.lib
            for chunks in self._lists:
                lib.mtmd_input_chunks_free(chunks)
        self._lists.clear()
        for s in self.spans:
            s.chunk = None


_log_callback: Any = None


def _quiet(lib: Any, llama_cpp: Any) -> None:
    """Only errors of libmtmd reach stderr (it logs every projector load and image encode otherwise)."""
    global _log_callback
    if _log_callback is not None:
        return

    @llama_cpp.llama_log_callback
    def callback(level: int, text: bytes, _user: Any) -> None:
        if level == GGML_LOG_LEVEL_ERROR and text:
            import sys

            sys.stderr.write(text.decode("utf-8", errors="replace"))

    _log_callback = callback
    lib.mtmd_log_set(callback, None)
    lib.mtmd_helper_log_set(callback, None)


class Projector:
    """A loaded mmproj GGUF on a llama.cpp text model (`model_ptr`: its llama_model pointer)."""

    def __init__(
        self, path: Path, model_ptr: Any, *, n_threads: int, use_gpu: bool, flash_attn: bool | None
    ) -> None:
        import llama_cpp
        from llama_cpp import mtmd_cpp as lib

        self.lib = lib
        _quiet(lib, llama_cpp)
        if not path.is_file():
            raise LocalrtError(f"projector file not found: {path}")
        params = lib.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.print_timings = False
        params.n_threads = n_threads
        params.flash_attn_type = flash_attn_type(flash_attn)
        ctx = lib.mtmd_init_from_file(str(path).encode(), model_ptr, params)
        if not ctx:
            raise LocalrtError(f"llama.cpp could not load the projector {path.name} for this model")
        self.ctx = ctx
        if not lib.mtmd_support_vision(ctx):
            self.close()
            raise LocalrtError(f"the projector {path.name} has no vision encoder (audio-only projectors)")
        self.size = path.stat().st_size
        # libmtmd's encode helpers are not thread-safe; parallel slots share this context
        self._lock = threading.Lock()

    def expand(self, tokens: Sequence[int], images: Sequence[ImageInput]) -> MediaPrompt:
        """Text tokens with IMAGE_TOKEN placeholders -> cells and chunks (each image tokenized by libmtmd,
        which adds the model's own begin/end-of-image tokens and slices)."""
        if sum(1 for t in tokens if t == IMAGE_TOKEN) != len(images):
            placed = sum(1 for t in tokens if t == IMAGE_TOKEN)
            raise ImageError(f"the prompt places {placed} images but {len(images)} were given")
        prompt = MediaPrompt(_projector=self)
        it = iter(images)
        try:
            for t in tokens:
                if t != IMAGE_TOKEN:
                    prompt.cells.append(t)
                    continue
                self._add_image(prompt, next(it))
        except BaseException:
            prompt.close()
            raise
        return prompt

    def _add_image(self, prompt: MediaPrompt, image: ImageInput) -> None:
        lib = self.lib
        data = (ctypes.c_uint8 * len(image.rgb)).from_buffer_copy(image.rgb)
        bitmap = lib.mtmd_bitmap_init(image.width, image.height, data)
        if not bitmap:
            raise ImageError("libmtmd could not take the image")
        chunks = lib.mtmd_input_chunks_init()
        try:
            lib.mtmd_bitmap_set_id(bitmap, image.digest.encode())
            marker = lib.mtmd_default_marker()
            text = lib.mtmd_input_text(marker, len(marker), False, True)
            bitmaps = (lib.mtmd_bitmap_p_ctypes * 1)(bitmap)
            rc = lib.mtmd_tokenize(self.ctx, chunks, ctypes.byref(text), bitmaps, 1)
        finally:
            lib.mtmd_bitmap_free(bitmap)
        prompt._lists.append(chunks)
        if rc != 0:
            raise ImageError(f"the projector could not preprocess the image (libmtmd error {rc})")
        k = 0
        for i in range(lib.mtmd_input_chunks_size(chunks)):
            chunk = lib.mtmd_input_chunks_get(chunks, i)
            kind = lib.mtmd_input_chunk_get_type(chunk)
            if kind == CHUNK_TEXT:
                n = ctypes.c_size_t(0)
                ptr = lib.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                prompt.cells.extend(int(ptr[j]) for j in range(n.value))
            elif kind == CHUNK_IMAGE:
                n_tokens = int(lib.mtmd_input_chunk_get_n_tokens(chunk))
                n_pos = int(lib.mtmd_input_chunk_get_n_pos(chunk))
                prompt.spans.append(ImageSpan(len(prompt.cells), n_tokens, n_pos, chunk))
                prompt.cells.extend(ImageCell(image.digest, k + j) for j in range(n_tokens))
                k += n_tokens
            else:
                raise ImageError("the projector produced a non-image chunk for an image")

    def eval_image(self, lctx: Any, chunk: Any, n_past: int, seq_id: int, n_batch: int) -> int:
        """Encode one image chunk and decode its embeddings at n_past for seq_id; returns the next position."""
        import llama_cpp

        new_n_past = llama_cpp.llama_pos(n_past)
        with self._lock:
            rc = self.lib.mtmd_helper_eval_chunk_single(
                self.ctx, lctx, chunk, n_past, seq_id, n_batch, False, ctypes.byref(new_n_past)
            )
        if rc != 0:
            raise LocalrtError(f"llama.cpp could not evaluate the image (mtmd error {rc})")
        return int(new_n_past.value)

    def close(self) -> None:
        ctx, self.ctx = getattr(self, "ctx", None), None
        if ctx:
            self.lib.mtmd_free(ctx)
