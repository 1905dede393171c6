"""`push`: upload a stored model to an Ollama-compatible OCI registry (the distribution spec's push).

For each blob the manifest names (layers and config): `HEAD` asks whether the registry has it; if
not, `POST .../blobs/uploads/` opens an upload, `PATCH` sends it chunk by chunk (`Content-Range`),
and `PUT <upload>?digest=...` closes it, the registry checking the digest. The manifest goes last, so
a registry never holds a manifest that names a blob it lacks. An interrupted chunk is resumed from
the offset the registry reports (`GET <upload>`), or the upload restarts when the registry has
forgotten it. Authentication is the registry's Bearer challenge, answered only for its own host
(`RegistryClient`, shared with pull); an upload URL on another host gets no token.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urljoin

import httpx

from localrt import faults
from localrt.errors import LocalrtError
from localrt.store.names import ModelName
from localrt.store.pull import _parse_reference
from localrt.store.sources.common import Progress
from localrt.store.sources.common import ProgressFn
from localrt.store.sources.oci import CONNECT_TIMEOUT
from localrt.store.sources.oci import MAX_RETRIES
from localrt.store.sources.oci import RegistryClient
from localrt.store.store import MANIFEST_MEDIA_TYPE
from localrt.store.store import Store
from localrt.store.store import manifest_layers
from localrt.store.store import parse_manifest

CHUNK_SIZE = 32 << 20  # bytes per PATCH: big enough to be quick, small enough to resume cheaply
_RANGE = re.compile(r"^(?:bytes=)?0-(\d+)$")


class PushError(LocalrtError):
    status = 502


def push(
    name: str | ModelName,
    *,
    store: Store | None = None,
    insecure: bool = False,
    progress: ProgressFn | None = None,
    chunk_size: int = CHUNK_SIZE,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Upload the stored model `name` to the registry its name names; returns the manifest digest.

    Args:
        name: a stored model, e.g. `registry.example:5000/me/model:tag`; `http://` needs `insecure`.
        store: the store (default: LOCALRT_MODELS).
        insecure: allow a plain-http registry.
        progress: called with Ollama-shaped progress events.
        chunk_size: bytes per PATCH request.
        sleep: the back-off between retries (tests pass a no-op).
    """
    store = store or Store()
    emit = progress or (lambda _: None)
    ref, insecure = _parse_reference(name, insecure)
    emit(Progress("retrieving manifest"))
    raw = store.manifest_bytes(ref)
    manifest, digest = parse_manifest(raw), "sha256:" + hashlib.sha256(raw).hexdigest()
    layers: dict[str, int] = {}
    for layer in manifest_layers(manifest):
        if not store.has_blob(layer["digest"]):
            raise LocalrtError(f"model '{ref.display}' is damaged: blob {layer['digest']} is missing")
        layers.setdefault(layer["digest"], store.blob_path(layer["digest"]).stat().st_size)
    try:
        with RegistryClient(ref.host, insecure=insecure, sleep=sleep) as client:
            uploader = Uploader(client, ref, store, emit, max(1, chunk_size))
            for blob, size in layers.items():
                uploader.blob(blob, size)
                faults.reach("push.blob")
            emit(Progress("pushing manifest"))
            uploader.manifest(raw, str(manifest.get("mediaType") or MANIFEST_MEDIA_TYPE))
    except httpx.ConnectTimeout:
        raise PushError(
            f"cannot reach {ref.host}: connection timed out after {CONNECT_TIMEOUT:.0f}s"
        ) from None
    except httpx.ConnectError as e:
        if not insecure and "WRONG_VERSION_NUMBER" in str(e).upper():
            raise PushError(f"registry {ref.host} uses http; pass --insecure") from None
        raise PushError(f"cannot reach {ref.host}: {e}") from None
    except httpx.HTTPError as e:
        raise PushError(f"pushing {ref.display} to {ref.host} failed: {e or type(e).__name__}") from None
    emit(Progress("success"))
    return digest


class _Retry(Exception):
    """A chunk that did not land; the registry is asked where the upload stands."""


class Uploader:
    def __init__(
        self, client: RegistryClient, name: ModelName, store: Store, emit: ProgressFn, chunk_size: int
    ) -> None:
        self.client = client
        self.name = name
        self.store = store
        self.emit = emit
        self.chunk_size = chunk_size
        self.repo = f"/v2/{name.namespace}/{name.model}"

    def _fail(self, what: str, response: httpx.Response) -> PushError:
        if response.status_code in (401, 403):
            return PushError(
                f"{what}: {self.client.host} refused access to {self.name.namespace}/{self.name.model} "
                f"(HTTP {response.status_code})"
            )
        response.read()
        detail = response.text[:200].strip()
        return PushError(f"{what}: {self.client.host} answered HTTP {response.status_code} {detail}".rstrip())

    # ---- one blob ------------------------------------------------------------------------------
    def blob(self, digest: str, size: int) -> None:
        status = f"pushing {digest.split(':', 1)[1][:12]}"
        with self.client.request("HEAD", f"{self.repo}/blobs/{digest}") as r:
            if r.status_code == 200:
                self.emit(Progress(status, digest, size, size))
                return
            if r.status_code != 404:
                raise self._fail(f"checking blob {digest[:19]}", r)
        path = self.store.blob_path(digest)
        location, offset = self._open(), 0
        failures, best = 0, 0
        while True:
            self.emit(Progress(status, digest, size, offset))
            try:
                if offset < size:
                    location = self._patch(location, path, offset, min(offset + self.chunk_size, size))
                    offset = min(offset + self.chunk_size, size)
                    continue
                self._close(location, digest)
                self.emit(Progress(status, digest, size, size))
                return
            except (_Retry, httpx.TransportError) as e:
                failures += 1
                if failures > MAX_RETRIES:
                    raise PushError(
                        f"uploading {digest[:19]} to {self.client.host} failed after {MAX_RETRIES} retries "
                        f"({e or type(e).__name__}); run push again"
                    ) from None
                self.client.sleep(min(0.25 * 2 ** (failures - 1), 4.0))
                location, offset = self._where(location)
                if offset > best:  # bytes got through: the link works, keep going
                    best, failures = offset, 0

    def _open(self) -> str:
        with self.client.request("POST", f"{self.repo}/blobs/uploads/", {"Content-Length": "0"}, b"") as r:
            if r.status_code != 202 or not r.headers.get("location"):
                raise self._fail("starting an upload", r)
            return urljoin(str(r.url), r.headers["location"])

    def _patch(self, location: str, path: Path, start: int, end: int) -> str:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(end - start)
        headers = {
            "Content-Type": "application/octet-stream",
            "Content-Range": f"{start}-{end - 1}",
            "Content-Length": str(len(data)),
        }
        with self.client.request("PATCH", location, headers, data) as r:
            if r.status_code in (500, 502, 503, 504, 416):
                raise _Retry(f"HTTP {r.status_code}")
            if r.status_code != 202:
                raise self._fail(f"uploading to {location}", r)
            return urljoin(str(r.url), r.headers.get("location") or location)

    def _where(self, location: str) -> tuple[str, int]:
        """After a failed chunk: the upload and its next offset, or a fresh upload at 0 if it is gone."""
        try:
            with self.client.request("GET", location) as r:
                if r.status_code in (200, 204):
                    m = _RANGE.match(r.headers.get("range", ""))
                    return urljoin(str(r.url), r.headers.get("location") or location), int(
                        m[1]
                    ) + 1 if m else 0
        except httpx.TransportError:
            pass
        return self._open(), 0

    def _close(self, location: str, digest: str) -> None:
        url = f"{location}{'&' if '?' in location else '?'}digest={digest}"
        with self.client.request("PUT", url, {"Content-Length": "0"}, b"") as r:
            if r.status_code in (500, 502, 503, 504):
                raise _Retry(f"HTTP {r.status_code}")
            if r.status_code not in (201, 204):
                raise self._fail(f"finishing the upload of {digest[:19]}", r)

    # ---- the manifest, last ----------------------------------------------------------------------
    def manifest(self, raw: bytes, media_type: str) -> None:
        url = f"{self.repo}/manifests/{self.name.tag}"
        headers = {"Content-Type": media_type}
        with self.client.request("PUT", url, headers, raw) as r:
            if r.status_code not in (200, 201, 202):
                raise self._fail("pushing the manifest", r)
