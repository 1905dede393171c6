"""The chat page: the static files in `localrt/web/`, served to browsers by the API app.

`GET /` answers a browser (a request whose Accept names `text/html`) with the page, and every other client
(curl, the `ollama` clients' liveness check) with Ollama's plain text. The page's files are served under
`/ui/<version>/`, where the version is a hash of all of them: they are cached for a year, and a new release
changes every URL at once. The page itself is never cached, so it always names the current version. The
page talks only to the public API (Ollama's and OpenAI's routes), so whatever it does, a script can do.
"""

from __future__ import annotations

import functools
import hashlib
import mimetypes
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter
from fastapi import Request
from fastapi.responses import HTMLResponse
from fastapi.responses import Response

from localrt.errors import LocalrtError

WEB_ROOT = Path(__file__).resolve().parents[1] / "web"
UI_PREFIX = "/ui/"
# Only this origin's own files run or load; the reply's images are data: or blob: URLs the page made.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
TYPES = {".js": "text/javascript", ".mjs": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}

router = APIRouter(include_in_schema=False)


@dataclass(frozen=True)
class Assets:
    version: str
    files: dict[str, bytes]  # path under localrt/web/ ("vendor/marked.esm.js") -> its bytes
    page: bytes  # index.html with its version placeholder filled


@functools.cache
def assets() -> Assets:
    """Every file of the page, read once: only these paths are ever served (no path reaches the disk)."""
    files = {
        p.relative_to(WEB_ROOT).as_posix(): p.read_bytes()
        for p in sorted(WEB_ROOT.rglob("*"))
        if p.is_file() and p.name != "index.html" and not p.name.startswith(".")
    }
    if not files:
        raise LocalrtError(f"the chat page's files are missing from {WEB_ROOT}")
    digest = hashlib.sha256()
    for path, data in files.items():
        digest.update(path.encode() + b"\0" + hashlib.sha256(data).digest())
    version = digest.hexdigest()[:16]
    page = (WEB_ROOT / "index.html").read_bytes().replace(b"{{version}}", version.encode())
    return Assets(version, files, page)


def wants_page(request: Request) -> bool:
    """A browser's visit to `/`: the page is on (LOCALRT_UI) and the client takes HTML."""
    return bool(getattr(request.app.state, "ui", False)) and "text/html" in request.headers.get("accept", "")


def page() -> Response:
    return HTMLResponse(
        assets().page,
        headers={**SECURITY_HEADERS, "Cache-Control": "no-cache", "Vary": "Accept"},
    )


@router.get(UI_PREFIX + "{version}/{path:path}")
async def asset(version: str, path: str) -> Response:
    found = assets()
    data = found.files.get(path)
    if data is None or version != found.version:
        # an old version's URL after an upgrade: not found, rather than new bytes cached under it
        return Response(status_code=404, headers=SECURITY_HEADERS)
    suffix = Path(path).suffix
    media = TYPES.get(suffix) or mimetypes.guess_type(path)[0] or "application/octet-stream"
    return Response(
        data,
        media_type=media,
        headers={**SECURITY_HEADERS, "Cache-Control": "public, max-age=31536000, immutable"},
    )
