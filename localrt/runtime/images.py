"""Images in requests: base64 and data URLs (and, with LOCALRT_FETCH_IMAGES=1, http(s) URLs) decoded with
Pillow into RGB pixels, under format, byte and pixel-count limits, before any of it reaches a backend.

Checks come cheapest first, so a flood of images costs the server next to nothing: the count, then each
image's type (its magic bytes) and dimensions (its header, no pixels), against a per-image and a
per-request pixel limit. Only then are pixels decoded, in a small thread pool off the event loop, once
the request holds a model slot.

Placement follows Ollama: each image of a message goes where the message's content says `[img]`, the rest
in front of the content. The runtime marks the spot with a per-process marker that no user text can
forge, and the tokenizer turns each marker into `IMAGE_TOKEN`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import hashlib
import io
import re
import secrets
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from localrt import config
from localrt.backends.base import IMAGE_TOKEN
from localrt.backends.base import ImageInput
from localrt.errors import LocalrtError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MAX_IMAGE_BYTES = 20 << 20  # one encoded image
MAX_PIXELS = 4096 * 4096  # one decoded image (libmtmd resizes to the projector's size anyway)
# all images of one request: its decoded RGB (3 bytes a pixel) stays near 100 MB while it is served
MAX_REQUEST_PIXELS = 2 * MAX_PIXELS
MAX_IMAGES = 16  # per request
# decoding is CPU and memory heavy: a few threads, so a flood of images waits instead of piling up
DECODE_WORKERS = 2
FETCH_TIMEOUT_S = 10.0
PLACEHOLDER = "[img]"  # Ollama's: where in a message's text its next image goes
# Private-use code points around a random id: a user cannot type the marker, so cannot place an image
MARKER = f"\U000f0000{secrets.token_hex(8)}\U000f0001"
# each format's leading bytes: the type is known before Pillow is asked to parse anything
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
)
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=DECODE_WORKERS, thread_name_prefix="localrt-image")


class ImageError(LocalrtError):
    status = 400


@dataclass(frozen=True)
class PendingImage:
    """An image whose type and dimensions are known from its header; its pixels are not decoded yet."""

    data: bytes
    what: str
    format: str
    width: int
    height: int

    @property
    def pixels(self) -> int:
        return self.width * self.height


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise LocalrtError("images need Pillow: pip install Pillow") from None
    # Pillow's own decompression-bomb guard, set here rather than trusting its default: it warns above
    # this and refuses above twice this, a second line behind the header check below
    Image.MAX_IMAGE_PIXELS = MAX_PIXELS
    return Image


def sniff(data: bytes) -> str | None:
    """The image format its leading bytes name, or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return next((fmt for magic, fmt in _SIGNATURES if data.startswith(magic)), None)


def inspect_image(data: bytes, what: str = "image") -> PendingImage:
    """Size, type (by its magic bytes) and dimensions (from its header, no pixels decoded), checked."""
    if not data:
        raise ImageError(f"{what} is empty")
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"{what} is {len(data)} bytes, more than the limit of {MAX_IMAGE_BYTES} bytes")
    fmt = sniff(data)
    if fmt is None:
        raise ImageError(f"{what} is not an image (supported formats: {', '.join(FORMATS)})")
    image_mod = _pil()
    try:  # lazy: Pillow reads the header here, the pixels only on load()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", image_mod.DecompressionBombWarning)
            im = image_mod.open(io.BytesIO(data), formats=[fmt])
        width, height = im.size
    except image_mod.DecompressionBombError:
        raise ImageError(f"{what} has more pixels than the limit of {MAX_PIXELS} pixels") from None
    except Exception:  # a signature with no valid header behind it
        raise ImageError(f"{what} is corrupt or truncated ({fmt}: its header cannot be read)") from None
    if width < 1 or height < 1:
        raise ImageError(f"{what} has no pixels")
    if width * height > MAX_PIXELS:
        raise ImageError(f"{what} is {width}x{height} pixels, more than the limit of {MAX_PIXELS} pixels")
    return PendingImage(data, what, fmt, width, height)


def decode_pending(image: PendingImage) -> ImageInput:
    """A checked image's pixels as RGB; a clear ImageError for pixel data that is corrupt or truncated."""
    image_mod = _pil()
    try:
        im = image_mod.open(io.BytesIO(image.data), formats=[image.format])
        im.load()  # pixels are decoded here: a truncated or corrupt file fails now
        rgb = _to_rgb(im, image_mod)
    except Exception as e:
        raise ImageError(f"{image.what} is corrupt or truncated ({image.format}: {e})") from None
    return ImageInput(rgb.tobytes(), image.width, image.height, hashlib.sha256(image.data).hexdigest())


def decode_image(data: bytes, what: str = "image") -> ImageInput:
    """Encoded image bytes -> RGB pixels; a clear ImageError for anything that is not a whole image."""
    return decode_pending(inspect_image(data, what))


async def decode_all(images: Sequence[PendingImage]) -> list[ImageInput]:
    """Decode checked images in the bounded pool, off the event loop."""
    loop = asyncio.get_running_loop()
    return [await loop.run_in_executor(_POOL, decode_pending, image) for image in images]


def _to_rgb(im: Any, image_mod: Any) -> Any:
    """Transparent pixels become white (as a viewer shows them), not the black of a plain convert."""
    if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        background = image_mod.new("RGBA", rgba.size, (255, 255, 255, 255))
        return image_mod.alpha_composite(background, rgba).convert("RGB")
    return im.convert("RGB")


_DATA_URL = re.compile(r"^data:([\w.+/-]*)((?:;[\w-]+=[\w.-]+)*)(;base64)?,", re.IGNORECASE)


def decode_base64(text: str, what: str = "image") -> bytes:
    """Ollama's `images` entries: base64 (a data URL's prefix is tolerated)."""
    if not isinstance(text, str):
        raise ImageError(f"{what} must be a base64 string")
    m = _DATA_URL.match(text)
    if m:
        text = text[m.end() :]
    if len(text) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ImageError(f"{what} is more than the limit of {MAX_IMAGE_BYTES} bytes")
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{what} is not valid base64") from None


def image_url_bytes(url: str, what: str = "image_url") -> bytes:
    """An OpenAI image_url: a data URL, or (LOCALRT_FETCH_IMAGES=1) an http(s) URL fetched with limits."""
    if not isinstance(url, str) or not url:
        raise ImageError(f"{what} must be a URL string")
    m = _DATA_URL.match(url)
    if m:
        if not m.group(3):
            raise ImageError(f"{what}: only base64 data URLs are supported")
        return decode_base64(url, what)
    scheme = url.split(":", 1)[0].lower()
    if scheme not in ("http", "https"):
        raise ImageError(f"{what}: unsupported URL scheme {scheme!r} (use a base64 data URL)")
    if not config.fetch_images():
        raise ImageError(
            f"{what}: this server does not fetch image URLs (set LOCALRT_FETCH_IMAGES=1 to allow it); "
            "send the image as a base64 data URL"
        )
    return _fetch(url, what)


def _fetch(url: str, what: str) -> bytes:
    import httpx

    try:
        with httpx.stream("GET", url, timeout=FETCH_TIMEOUT_S, follow_redirects=True) as r:
            if r.status_code != 200:
                raise ImageError(f"{what}: fetching {url} answered HTTP {r.status_code}")
            declared = r.headers.get("content-length")
            if declared and declared.isdigit() and int(declared) > MAX_IMAGE_BYTES:
                raise ImageError(
                    f"{what}: {url} is {declared} bytes, more than the limit of {MAX_IMAGE_BYTES}"
                )
            out = bytearray()
            for block in r.iter_bytes():
                out += block
                if len(out) > MAX_IMAGE_BYTES:
                    raise ImageError(f"{what}: {url} is more than the limit of {MAX_IMAGE_BYTES} bytes")
            return bytes(out)
    except httpx.TimeoutException:
        raise ImageError(f"{what}: fetching {url} took longer than {FETCH_TIMEOUT_S:g} s") from None
    except httpx.HTTPError as e:
        raise ImageError(f"{what}: cannot fetch {url}: {e}") from None


def as_bytes(item: Any, what: str) -> bytes:
    """One entry of an `images` list: base64 text (the wire) or raw bytes (in-process callers)."""
    if isinstance(item, (bytes, bytearray)):
        return bytes(item)
    return decode_base64(item, what)


def count_images(messages: Sequence[dict[str, Any]]) -> int:
    """How many images the messages carry, refused above MAX_IMAGES before any is looked at."""
    n = 0
    for i, message in enumerate(messages):
        raw = message.get("images")
        if not raw:
            continue
        if not isinstance(raw, list):
            raise ImageError(f"message {i}: images must be a list of base64 strings")
        n += len(raw)
    check_count(n)
    return n


def check_count(n: int) -> None:
    """Refuse a request with more than MAX_IMAGES images, before any is read or fetched."""
    if n > MAX_IMAGES:
        raise ImageError(f"a request may carry at most {MAX_IMAGES} images; this one has {n}")


def place_images(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[PendingImage]]:
    """Check every message's `images` from their headers and put a marker where each goes; returns
    (messages, images). No pixel is decoded here (`decode_all` does that, once a model is ready)."""
    count_images(messages)
    out: list[dict[str, Any]] = []
    images: list[PendingImage] = []
    pixels = 0
    for i, message in enumerate(messages):
        raw = message.get("images")
        if not raw:
            out.append({k: v for k, v in message.items() if k != "images"})
            continue
        content = message.get("content") or ""
        if not isinstance(content, str):
            raise ImageError(f"message {i}: content must be a string")
        for item in raw:
            what = f"image {len(images)}"
            image = inspect_image(as_bytes(item, what), what)
            pixels += image.pixels
            if pixels > MAX_REQUEST_PIXELS:
                raise ImageError(
                    f"the images of a request may have at most {MAX_REQUEST_PIXELS} pixels in all; "
                    f"{what} brings them to {pixels}"
                )
            images.append(image)
        out.append(
            {**{k: v for k, v in message.items() if k != "images"}, "content": mark(content, len(raw))}
        )
    return out, images


async def check_images(
    messages: Sequence[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[PendingImage]]:
    """`place_images` with the count checked first and the base64 and header work in the bounded pool."""
    if not count_images(messages):
        return place_images(messages)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_POOL, place_images, messages)


def mark(content: str, n: int) -> str:
    """The content with n image markers: at its `[img]` placeholders in order, the rest in front."""
    head = ""
    for _ in range(n):
        if PLACEHOLDER in content:
            content = content.replace(PLACEHOLDER, MARKER, 1)
        else:
            head += MARKER
    return head + content


def split_markers(tokenize: Any) -> Any:
    """Wrap tokenize(text, add_special, parse_special) so each marker in the text becomes IMAGE_TOKEN."""

    def tok(text: str, add_special: bool, parse_special: bool) -> list[int]:
        out: list[int] = []
        for i, part in enumerate(text.split(MARKER)):
            if i:
                out.append(IMAGE_TOKEN)
            if part:
                out.extend(tokenize(part, add_special and i == 0, parse_special))
        return out

    return tok


# ---- image files named on the command line or dropped into a prompt (as Ollama's CLI takes them) ----
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")
# a path ending in an image suffix: quoted, or with backslash-escaped spaces (what a terminal drop pastes)
_PATH = re.compile(
    r"""'([^']+\.(?:png|jpe?g|webp|gif|bmp))'|"([^"]+\.(?:png|jpe?g|webp|gif|bmp))"|"""
    r"""((?:[^\s\\'"]|\\ )+\.(?:png|jpe?g|webp|gif|bmp))(?=[\s?!,;:.]|$)""",
    re.IGNORECASE,
)


def read_image_file(path: str) -> str:
    """An image file's bytes as base64 (the wire form), checked to be a decodable image first."""
    from pathlib import Path

    p = Path(path).expanduser()
    try:
        size = p.stat().st_size
        if size > MAX_IMAGE_BYTES:
            raise ImageError(f"image {path} is {size} bytes, more than the limit of {MAX_IMAGE_BYTES} bytes")
        data = p.read_bytes()
    except FileNotFoundError:
        raise ImageError(f"image file not found: {path}") from None
    except IsADirectoryError:
        raise ImageError(f"{path} is a folder, not an image") from None
    except OSError as e:
        raise ImageError(f"cannot read image {path}: {e.strerror or e}") from None
    decode_image(data, f"image {path}")
    return base64.b64encode(data).decode("ascii")


def images_in_prompt(text: str) -> tuple[str, list[str]]:
    """Paths of existing image files in a typed or dropped-in prompt -> (prompt without them, the paths)."""
    import os

    found: list[str] = []

    def take(m: re.Match[str]) -> str:
        raw = next(g for g in m.groups() if g)
        path = raw.replace("\\ ", " ")
        if not os.path.isfile(os.path.expanduser(path)):
            return m.group(0)  # not a file: leave the words as typed
        found.append(path)
        return ""

    rest = _PATH.sub(take, text)
    return (" ".join(rest.split()) if found else text), found
