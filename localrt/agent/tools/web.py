"""`fetch_url`: one http(s) page, with a size and a time limit, HTML reduced to its text.

It asks before it runs: a fetch reaches the network, and a URL can carry what the model read from
the user's files to anyone.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from html.parser import HTMLParser
from typing import Any
from urllib.parse import urlsplit

import httpx

from localrt.agent.tools import Limits
from localrt.agent.tools import Prepared
from localrt.agent.tools import Tool
from localrt.agent.tools import ToolResult
from localrt.agent.tools import schema
from localrt.agent.tools import string_arg

MAX_REDIRECTS = 5
TEXT_TYPES = ("text/", "application/json", "application/xml", "application/javascript", "+json", "+xml")


class _Text(HTMLParser):
    """The readable text of an HTML page: no scripts, styles or tags; block elements on their own lines."""

    BLOCKS = frozenset({"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "section"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.hidden = 0

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag in ("script", "style", "noscript", "template"):
            self.hidden += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style", "noscript", "template"):
            self.hidden = max(self.hidden - 1, 0)
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self.hidden:
            self.parts.append(data)

    def text(self) -> str:
        lines = (" ".join(line.split()) for line in "".join(self.parts).splitlines())
        return "\n".join(line for line in lines if line)


def html_text(html: str) -> str:
    parser = _Text()
    parser.feed(html)
    parser.close()
    return parser.text()


async def fetch(url: str, limits: Limits) -> ToolResult:
    deadline = time.monotonic() + limits.fetch_timeout
    body = bytearray()
    cut = False
    try:
        async with httpx.AsyncClient(
            follow_redirects=True, max_redirects=MAX_REDIRECTS, timeout=limits.fetch_timeout
        ) as http:
            async with http.stream("GET", url, headers={"User-Agent": "localrt"}) as response:
                async for block in response.aiter_bytes():
                    body.extend(block)
                    if len(body) > limits.fetch_bytes:
                        del body[limits.fetch_bytes :]
                        cut = True
                        break
                    if time.monotonic() > deadline:
                        raise httpx.ReadTimeout("the page took too long")
                status, kind = response.status_code, response.headers.get("content-type", "")
                charset = response.charset_encoding or "utf-8"
    except httpx.HTTPError as e:
        return ToolResult.failed(f"fetching {url} failed: {type(e).__name__}: {e}")
    head = f"HTTP {status} {kind or 'no content type'}, {len(body)} bytes" + (
        f" (cut at {limits.fetch_bytes})" if cut else ""
    )
    if kind and not any(t in kind for t in TEXT_TYPES):
        return ToolResult(f"{head}: not text, not shown", error=status >= 400)
    text = body.decode(charset, errors="replace")
    if "html" in kind or text.lstrip()[:15].lower().startswith(("<!doctype html", "<html")):
        text = html_text(text)
    return ToolResult(f"{head}\n\n{text}", error=status >= 400)


def fetch_url(limits: Limits) -> Tool:
    async def prepare(arguments: Mapping[str, Any]) -> Prepared | ToolResult:
        url = string_arg(arguments, "url").strip()
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return ToolResult.failed(f"only http:// and https:// URLs are fetched, not {url!r}")

        async def run() -> ToolResult:
            return await fetch(url, limits)

        return Prepared(f"fetch {url}", run, detail=url, detail_kind="arguments")

    return Tool(
        "fetch_url",
        f"Download a web page (http or https, at most {limits.fetch_bytes // 1024} KiB and "
        f"{limits.fetch_timeout:g}s) and return its text. The user approves each fetch first.",
        schema({"url": {"type": "string", "description": "the http:// or https:// address"}}, ["url"]),
        "run",
        prepare,
    )
