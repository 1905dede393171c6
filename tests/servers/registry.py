"""An Ollama-compatible OCI registry (the subset `ollama pull` speaks), with switches to inject faults.

GET  /v2/<ns>/<model>/manifests/<tag|digest>
HEAD/GET /v2/<ns>/<model>/blobs/<digest>        Range: bytes=N- -> 206 + Content-Range
GET  /token?service=..&scope=..                 when `token` is set, everything under /v2/ answers
                                                401 + WWW-Authenticate: Bearer until the token is sent

Uploads (the push side of the distribution spec):
POST  /v2/<ns>/<model>/blobs/uploads/           202 + Location of a new upload session
PATCH <upload>   Content-Range: a-b             appends (a must be the session's length), 202 + Range
GET   <upload>                                  204 + Range: 0-<last byte>, where an upload stands
PUT   <upload>?digest=sha256:..                 201 when the bytes hash to the digest, else 400
PUT   /v2/<ns>/<model>/manifests/<tag>          201, or 400 MANIFEST_BLOB_UNKNOWN when a blob is missing
Writes need the token issued for a `push` scope (a pull token is answered with a new challenge).
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import uuid
from pathlib import Path
from urllib.parse import parse_qs
from urllib.parse import urlsplit

from . import Handler
from . import Server

MANIFEST_MEDIA_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_MEDIA_TYPE = "application/vnd.docker.container.image.v1+json"
_MANIFEST = re.compile(r"^/v2/(?P<repo>[^/]+/[^/]+)/manifests/(?P<ref>[^/]+)$")
_BLOB = re.compile(r"^/v2/(?P<repo>[^/]+/[^/]+)/blobs/(?P<digest>sha256:[0-9a-f]{64})$")
_CDN_BLOB = re.compile(r"^/blobs/(?P<digest>sha256:[0-9a-f]{64})$")
_UPLOADS = re.compile(r"^/v2/(?P<repo>[^/]+/[^/]+)/blobs/uploads/$")
_UPLOAD = re.compile(r"^/v2/(?P<repo>[^/]+/[^/]+)/blobs/uploads/(?P<session>[0-9a-f]{32})$")
_CONTENT_RANGE = re.compile(r"^(\d+)-(\d+)$")
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

    def authorized(self, path: str) -> bool:
        """Answer the Bearer challenge when the request lacks the token its method needs."""
        app: Registry = self.app
        if not app.token or not path.startswith("/v2/"):
            return True
        write = self.command not in ("GET", "HEAD")
        accepted = {f"Bearer {app.push_token}"} | (set() if write else {f"Bearer {app.token}"})
        if self.headers.get("Authorization") in accepted:
            return True
        realm = app.realm or f"{app.url}/token"
        scope = "repository:library/x:pull,push" if write else "repository:library/x:pull"
        challenge = f'Bearer realm="{realm}",service="{app.address}",scope="{scope}"'
        self.discard_body()
        self.send_json(401, {"errors": [{"code": "UNAUTHORIZED"}]}, {"WWW-Authenticate": challenge})
        return False

    def discard_body(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        while length > 0:
            block = self.rfile.read(min(CHUNK_READ, length))
            if not block:
                break
            length -= len(block)

    def do_GET(self) -> None:
        app: Registry = self.app
        app.record(self)
        url = urlsplit(self.path)
        path = url.path
        if path == "/token":
            app.tokens_issued += 1
            scope = parse_qs(url.query).get("scope", [""])[0]
            self.send_json(200, {"token": app.push_token if "push" in scope else app.token})
            return
        if not self.authorized(path):
            return
        if m := _UPLOAD.match(path):
            app.upload_status(self, m["repo"], m["session"])
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

    def do_POST(self) -> None:
        self.app.record(self)
        path = urlsplit(self.path).path
        if not self.authorized(path):
            return
        self.discard_body()
        if m := _UPLOADS.match(path):
            self.app.open_upload(self, m["repo"])
            return
        self.send_json(404, {"errors": [{"code": "NAME_UNKNOWN"}]})

    def do_PATCH(self) -> None:
        self.app.record(self)
        path = urlsplit(self.path).path
        if not self.authorized(path):
            return
        if m := _UPLOAD.match(path):
            self.app.patch_upload(self, m["repo"], m["session"])
            return
        self.discard_body()
        self.send_json(404, {"errors": [{"code": "NAME_UNKNOWN"}]})

    def do_PUT(self) -> None:
        app: Registry = self.app
        app.record(self)
        url = urlsplit(self.path)
        if not self.authorized(url.path):
            return
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if m := _UPLOAD.match(url.path):
            app.finish_upload(self, m["repo"], m["session"], parse_qs(url.query).get("digest", [""])[0], body)
            return
        if m := _MANIFEST.match(url.path):
            app.put_manifest(self, m["repo"], m["ref"], body)
            return
        self.send_json(404, {"errors": [{"code": "NAME_UNKNOWN"}]})


CHUNK_READ = 64 * 1024


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
        # blob downloads being served at this moment, and the most there ever were at once
        self.blob_gets_now = 0
        self.most_blob_gets = 0
        self._gets_lock = threading.Lock()
        self.redirect_blobs_to: str | None = None  # base URL of a BlobHost
        # uploads
        self.uploads: dict[str, bytearray] = {}  # session id -> bytes received so far
        # cut the PATCH during which an upload reaches N bytes (those are kept), once
        self.drop_patch_after: int | None = None
        self.refuse_patches = False  # every PATCH fails at once (a link that is down)
        self.forget_uploads = False  # upload sessions vanish after a failure (the client must restart)
        super().__init__(host)

    @property
    def push_token(self) -> str | None:
        return f"{self.token}-push" if self.token else None

    # ---- uploads ----
    def open_upload(self, handler: Handler, repo: str) -> None:
        session = uuid.uuid4().hex
        self.uploads[session] = bytearray()
        location = f"/v2/{repo}/blobs/uploads/{session}"
        handler.send_bytes(202, b"", {"Location": location, "Docker-Upload-UUID": session, "Range": "0-0"})

    def upload_status(self, handler: Handler, repo: str, session: str) -> None:
        data = self.uploads.get(session)
        if data is None:
            handler.send_json(404, {"errors": [{"code": "BLOB_UPLOAD_UNKNOWN"}]})
            return
        headers = {"Location": f"/v2/{repo}/blobs/uploads/{session}", "Docker-Upload-UUID": session}
        if data:
            headers["Range"] = f"0-{len(data) - 1}"
        handler.send_bytes(204, b"", headers)

    def patch_upload(self, handler: Handler, repo: str, session: str) -> None:
        data = self.uploads.get(session)
        length = int(handler.headers.get("Content-Length") or 0)
        if (self.refuse_patches and self.drop_patch_after is None) or data is None:
            if self.forget_uploads:
                self.uploads.pop(session, None)
            handler.discard_body()
            code = 503 if self.refuse_patches else 404
            handler.send_json(
                code, {"errors": [{"code": "UNAVAILABLE" if code == 503 else "BLOB_UPLOAD_UNKNOWN"}]}
            )
            return
        m = _CONTENT_RANGE.match(handler.headers.get("Content-Range", ""))
        if m and int(m[1]) != len(data):
            handler.discard_body()
            handler.send_bytes(416, b"", {"Range": f"0-{len(data) - 1}" if data else "0-0"})
            return
        remaining = length
        while remaining > 0:
            block = handler.rfile.read(min(CHUNK_READ, remaining))
            if not block:
                return
            drop = self.drop_patch_after
            if drop is not None and len(data) + len(block) >= drop:
                self.drop_patch_after = None
                data += block[: drop - len(data)]  # what arrived before the link broke is kept
                handler.connection.shutdown(socket.SHUT_RDWR)
                handler.close_connection = True
                return
            data += block
            remaining -= len(block)
        headers = {"Location": f"/v2/{repo}/blobs/uploads/{session}", "Docker-Upload-UUID": session}
        headers["Range"] = f"0-{len(data) - 1}" if data else "0-0"
        handler.send_bytes(202, b"", headers)

    def finish_upload(self, handler: Handler, repo: str, session: str, digest: str, body: bytes) -> None:
        data = self.uploads.pop(session, None)
        if data is None:
            handler.send_json(404, {"errors": [{"code": "BLOB_UPLOAD_UNKNOWN"}]})
            return
        data += body
        if digest_of(bytes(data)) != digest:
            handler.send_json(400, {"errors": [{"code": "DIGEST_INVALID", "message": "digest mismatch"}]})
            return
        self.blobs[digest] = bytes(data)
        handler.send_bytes(
            201, b"", {"Location": f"/v2/{repo}/blobs/{digest}", "Docker-Content-Digest": digest}
        )

    def put_manifest(self, handler: Handler, repo: str, tag: str, raw: bytes) -> None:
        try:
            manifest = json.loads(raw)
            named = [layer["digest"] for layer in [*manifest["layers"], manifest["config"]]]
        except (ValueError, KeyError, TypeError):
            handler.send_json(400, {"errors": [{"code": "MANIFEST_INVALID"}]})
            return
        missing = [d for d in named if d not in self.blobs]
        if missing:
            handler.send_json(400, {"errors": [{"code": "MANIFEST_BLOB_UNKNOWN", "detail": missing}]})
            return
        digest = self.add_manifest(repo, tag, raw)
        handler.send_bytes(
            201, b"", {"Location": f"/v2/{repo}/manifests/{digest}", "Docker-Content-Digest": digest}
        )

    def dangling(self) -> list[str]:
        """Blobs that some stored manifest names but the registry lacks (must always be empty)."""
        out = []
        for raw in self.manifests.values():
            manifest = json.loads(raw)
            out += [
                layer["digest"]
                for layer in [*manifest["layers"], manifest["config"]]
                if layer["digest"] not in self.blobs
            ]
        return out

    def serve_blob(self, handler: Handler, digest: str) -> None:
        source = self.blobs.get(digest)
        if source is None:
            handler.send_json(404, {"errors": [{"code": "BLOB_UNKNOWN"}]})
            return
        if digest in self.corrupt:
            source = corrupt(source)
        drop = self.drop_after.pop(digest, None) if handler.command == "GET" else None
        with self._gets_lock:
            self.blob_gets_now += 1
            self.most_blob_gets = max(self.most_blob_gets, self.blob_gets_now)
        try:
            handler.send_ranged(
                source,
                {"Content-Type": "application/octet-stream", "Docker-Content-Digest": digest},
                drop_after=drop,
                delay=self.delay,
                honour_range=not self.ignore_range,
            )
        finally:
            with self._gets_lock:
                self.blob_gets_now -= 1

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
        config_extra: dict[str, object] | None = None,
    ) -> tuple[str, dict[str, object]]:
        """Publish a model the way `ollama push` would; returns (manifest digest, model layer).
        `config_extra` adds keys to its config blob (models of the same family share that blob)."""
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
                **(config_extra or {}),
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
