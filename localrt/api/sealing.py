"""Reasoning sealed for a stateless client: OpenAI's `encrypted_content` and Anthropic's thinking
`signature`.

An agent that keeps no state on the server (`store: false`) gets the model's reasoning back as an
opaque blob and sends it back with the next request, so the reasoning can be restored into the
history. The client must neither read it nor make one up, so the blob is AES-GCM (or, without the
`cryptography` package, an HMAC-SHA256-authenticated SHA-256 counter stream) under a server key.
The key is kept in the models directory (mode 0600), so blobs survive a restart of the server.

A blob that does not open (altered, forged, or sealed by another server) is ignored, not refused:
the conversation goes on without that reasoning, as it would on a server that never saw it, and the
route says so in its `x-localrt-warning` header.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from pathlib import Path

from fastapi import Request

KEY_FILE = ".seal-key"
PREFIX = "lrt1."  # names the format, so a later one can be told apart
NONCE = 12
TAG = 16


def _load_key(root: Path) -> bytes:
    path = root / KEY_FILE
    try:
        key = path.read_bytes()
        if len(key) == 32:
            return key
    except FileNotFoundError:
        pass
    root.mkdir(parents=True, exist_ok=True)
    key = secrets.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return key


def _keystream(key: bytes, nonce: bytes, size: int) -> bytes:
    blocks = (size + 31) // 32
    return b"".join(hashlib.sha256(key + nonce + i.to_bytes(8, "big")).digest() for i in range(blocks))[:size]


class Sealer:
    """Seals and opens texts with one server key."""

    def __init__(self, root: Path) -> None:
        self._key = _load_key(root)
        try:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError:  # the fallback: encrypt-then-MAC with two keys derived from the one
            self._aead = None
        else:
            self._aead = AESGCM(self._key)
        self._enc = hmac.new(self._key, b"encrypt", hashlib.sha256).digest()
        self._mac = hmac.new(self._key, b"authenticate", hashlib.sha256).digest()

    def seal(self, text: str) -> str:
        nonce = secrets.token_bytes(NONCE)
        data = text.encode()
        if self._aead is not None:
            body = self._aead.encrypt(nonce, data, PREFIX.encode())
        else:
            cipher = bytes(a ^ b for a, b in zip(data, _keystream(self._enc, nonce, len(data)), strict=True))
            body = cipher + hmac.new(self._mac, nonce + cipher, hashlib.sha256).digest()[:TAG]
        return PREFIX + base64.urlsafe_b64encode(nonce + body).decode()

    def open(self, blob: object) -> str | None:
        """The sealed text, or None when `blob` is not one this server sealed."""
        if not isinstance(blob, str) or not blob.startswith(PREFIX):
            return None
        try:
            raw = base64.urlsafe_b64decode(blob[len(PREFIX) :].encode())
        except ValueError:
            return None
        if len(raw) < NONCE + TAG:
            return None
        nonce, body = raw[:NONCE], raw[NONCE:]
        if self._aead is not None:
            from cryptography.exceptions import InvalidTag

            try:
                data = self._aead.decrypt(nonce, body, PREFIX.encode())
            except InvalidTag:
                return None
        else:
            cipher, tag = body[:-TAG], body[-TAG:]
            want = hmac.new(self._mac, nonce + cipher, hashlib.sha256).digest()[:TAG]
            if not hmac.compare_digest(tag, want):
                return None
            data = bytes(
                a ^ b for a, b in zip(cipher, _keystream(self._enc, nonce, len(cipher)), strict=True)
            )
        try:
            return data.decode()
        except UnicodeDecodeError:
            return None


def sealer_of(request: Request) -> Sealer:
    """The server's one sealer (its key read or made on first use, next to the models)."""
    sealer = getattr(request.app.state, "sealer", None)
    if sealer is None:
        sealer = request.app.state.sealer = Sealer(request.app.state.store.root)
    return sealer
