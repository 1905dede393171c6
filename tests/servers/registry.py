"""An Ollama-compatible OCI registry (the subset `ollama pull` speaks), with switches to inject faults.

GET  /v2/<ns>/<model>/manifests/<tag|digest>
HEAD/GET /v2/<ns>/<model>/blobs/<digest>        Range: bytes=N- -> 206 + Content-Range
GET  /token?service=..&scope=..                 when `token` is set, everything under /v2/ answers
                                                401 + WWW-Authenticate: Bearer until the token is sent
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from urllib.parse import urlsplit

from . import Handler, Server

MANIFEST_MEDIA_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_MEDIA_TYPE = "application/vnd.docker.container.image.v1+json"
_MANIFEST = re.compile(r"^/v2/(?P<repo>[^/]+/[^/]+)/manifests/(?P<ref>[^/]+)$")
_BLOB = re.compile(r"^/v2/(?P<repo>[^/]+/[^/]+)/blobs/(?P<digest>sha256:[0-9a-f]{64})$")
_CDN_BLOB = re.compile(r"^/blobs/(?P<digest>sha256:[0-9a-f]{64})$")
_digest_cache: dict[Path, str] = {}


def digest_of(data: bytes | Path) -> str:
    if isinstance(data, bytes):
        return "sha256:" + hashlib.sha256(data).hexdigest()
    if data not in _digest_cache:  # the real GGUF is ~98 MB: hash it once per session
        h = hashlib.sha256()
        with open(data, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
        _digest_cache[data] = "sha256:" + h.hexdigest()
    return _digest_cache[data]


def size_of(data: bytes | Path) -> int:
    return len(data) if isinstance(data, bytes) else data.stat().st_size


def corrupt(data: bytes | Path) -> bytes:
    """Same length, one byte different: a wrong blob that only a hash check catches."""
    raw = bytearray(data if isinstance(data, bytes) else data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    return bytes(raw)


class RegistryHandler(Handler):
    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        app: Registry = self.app
        app.record(self)
        path = urlsplit(self.path).path
        if path == "/token":
            app.tokens_issued += 1
            self.send_json(200, {"token": app.token})
            return
        if (
            app.token
            and path.startswith("/v2/")
            and self.headers.get("Authorization") != f"Bearer {app.token}"
        ):
            realm = app.realm or f"{app.url}/token"
            challenge = f'Bearer realm="{realm}",service="{app.address}",scope="repository:library/x:pull"'
            self.send_json(401, {"errors": [{"code": "UNAUTHORIZED"}]}, {"WWW-Authenticate": challenge})
            return
        if path == "/v2/":
            self.send_json(200, {})
            return
        if m := _MANIFEST.match(path):
            raw = app.manifests.get((m["repo"], m["ref"]))
            if raw is None:
                self.send_json(404, {"errors": [{"code": "MANIFEST_UNKNOWN", "message": "manifest unknown"}]})
                return
            self.send_bytes(
                200, raw, {"Content-Type": MANIFEST_MEDIA_TYPE, "Docker-Content-Digest": digest_of(raw)}
            )
            return
        if m := _BLOB.match(path):
            digest = m["digest"]
            if app.redirect_blobs_to and self.command == "GET":
                self.send_bytes(307, b"", {"Location": f"{app.redirect_blobs_to}/blobs/{digest}"})
                return
            app.serve_blob(self, digest)
            return
        self.send_json(404, {"errors": [{"code": "NAME_UNKNOWN"}]})


class Registry(Server):
    handler = RegistryHandler

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.manifests: dict[tuple[str, str], bytes] = {}
        self.blobs: dict[str, bytes | Path] = {}
        # fault switches
        self.token: str | None = None  # require this Bearer token
        self.realm: str | None = None  # token endpoint named in the challenge (default: our /token)
        self.tokens_issued = 0
        self.drop_after: dict[str, int] = {}  # digest -> cut the connection after N bytes, once
        self.corrupt: set[str] = set()  # digests served with one byte flipped
        self.delay: float = 0.0  # seconds of sleep per 64 KiB chunk (a slow link)
        self.ignore_range = False  # answer 200 with the whole blob, as some CDNs do
        self.redirect_blobs_to: str | None = None  # base URL of a BlobHost
        super().__init__(host)

    def serve_blob(self, handler: Handler, digest: str) -> None:
        source = self.blobs.get(digest)
        if source is None:
            handler.send_json(404, {"errors": [{"code": "BLOB_UNKNOWN"}]})
            return
        if digest in self.corrupt:
            source = corrupt(source)
        drop = self.drop_after.pop(digest, None) if handler.command == "GET" else None
        handler.send_ranged(
            source,
            {"Content-Type": "application/octet-stream", "Docker-Content-Digest": digest},
            drop_after=drop,
            delay=self.delay,
            honour_range=not self.ignore_range,
        )

    def add_blob(self, data: bytes | Path) -> dict[str, object]:
        digest = digest_of(data)
        self.blobs[digest] = data
        return {"digest": digest, "size": size_of(data)}

    def add_manifest(self, repo: str, tag: str, manifest: dict[str, object] | bytes) -> str:
        """Serve a manifest under `repo:tag` and under its own digest; return that digest."""
        raw = manifest if isinstance(manifest, bytes) else json.dumps(manifest, indent=2).encode()
        digest = digest_of(raw)
        self.manifests[(repo, tag)] = raw
        self.manifests[(repo, digest)] = raw
        return digest

    def add_model(
        self,
        repo: str,
        tag: str,
        model: bytes | Path,
        *,
        template: str | None = None,
        params: dict[str, object] | None = None,
    ) -> tuple[str, dict[str, object]]:
        """Publish a model the way `ollama push` would; returns (manifest digest, model layer)."""
        model_layer = {"mediaType": "application/vnd.ollama.image.model", **self.add_blob(model)}
        layers = [model_layer]
        if template is not None:
            layers.append(
                {"mediaType": "application/vnd.ollama.image.template", **self.add_blob(template.encode())}
            )
        if params is not None:
            layers.append(
                {
                    "mediaType": "application/vnd.ollama.image.params",
                    **self.add_blob(json.dumps(params).encode()),
                }
            )
        config = json.dumps(
            {
                "model_format": "gguf",
                "model_family": "llama",
                "architecture": "amd64",
                "os": "linux",
                "rootfs": {"type": "layers", "diff_ids": []},
            }
        ).encode()
        manifest = {
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "config": {"mediaType": CONFIG_MEDIA_TYPE, **self.add_blob(config)},
            "layers": layers,
        }
        return self.add_manifest(repo, tag, manifest), model_layer


class BlobHostHandler(Handler):
    def do_GET(self) -> None:
        app: BlobHost = self.app
        app.record(self)
        m = _CDN_BLOB.match(urlsplit(self.path).path)
        if not m:
            self.send_json(404, {})
            return
        app.registry.serve_blob(self, m["digest"])


class BlobHost(Server):
    """A second host (another loopback address) that the registry redirects blob downloads to, like a CDN."""

    handler = BlobHostHandler

    def __init__(self, registry: Registry, host: str = "127.0.0.2") -> None:
        self.registry = registry
        super().__init__(host)
