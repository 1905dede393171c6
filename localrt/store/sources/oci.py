"""An Ollama-compatible OCI registry client: manifests, Bearer-token challenge, resumable verified blobs.

Safety rules (security.md 1.3, CVE-2025-51471):
- the manifest is parsed and every digest validated before anything is written;
- a token is fetched only from the registry's own host and sent only to it, never along a redirect;
- blobs land in `blobs/sha256-<hex>-partial`, are resumed with `Range`, and are renamed into place only
  after their sha256 matched; the manifest is written last, as received.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import time
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urljoin
from urllib.parse import urlsplit

import httpx

from localrt import __version__
from localrt import faults
from localrt import threads
from localrt.errors import DigestMismatch
from localrt.errors import LocalrtError
from localrt.errors import ModelNotFound
from localrt.errors import PullError
from localrt.store.names import ModelName
from localrt.store.remote import from_registry
from localrt.store.sources.common import Progress
from localrt.store.sources.common import ProgressFn
from localrt.store.sources.common import as_digest
from localrt.store.sources.common import check_free_space
from localrt.store.sources.common import partial_full
from localrt.store.store import MANIFEST_MEDIA_TYPE
from localrt.store.store import MAX_MANIFEST_BYTES
from localrt.store.store import MEDIA_MODEL
from localrt.store.store import Store
from localrt.store.store import manifest_layers
from localrt.store.store import parse_manifest

CONNECT_TIMEOUT = 5.0  # fail fast when a registry is unreachable
READ_TIMEOUT = 60.0
MAX_RETRIES = 5  # per blob, reset whenever bytes arrive
MAX_REDIRECTS = 5
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_CHALLENGE_PARAM = re.compile(r'(\w+)="([^"]*)"')


def _netloc(url: str) -> str:
    return urlsplit(url).netloc.lower()


class _Retryable(Exception):
    """A blob transfer that stopped early; the next attempt resumes from the partial file."""


class RegistryClient:
    """One registry host, one scheme; remembers the Bearer token it was given."""

    def __init__(
        self, host: str, *, insecure: bool = False, sleep: Callable[[float], None] = time.sleep
    ) -> None:
        self.host = host
        self.insecure = insecure
        self.base = f"{'http' if insecure else 'https'}://{host}"
        self.token: str | None = None
        self.answered: str | None = None  # the challenge the token was fetched for
        self.sleep = sleep
        self.http = httpx.Client(
            timeout=httpx.Timeout(READ_TIMEOUT, connect=CONNECT_TIMEOUT),
            follow_redirects=False,  # redirects are followed by hand, to control the Authorization header
            headers={"User-Agent": f"localrt/{__version__}"},
        )

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- requests ------------------------------------------------------------------------------
    def _send(
        self, method: str, url: str, headers: dict[str, str], content: bytes | None = None
    ) -> httpx.Response:
        """Send (streaming), following redirects by hand; the token only ever goes to the registry host."""
        for _ in range(MAX_REDIRECTS + 1):
            sent = dict(headers)
            if self.token and _netloc(url) == _netloc(self.base):
                sent["Authorization"] = f"Bearer {self.token}"
            built = self.http.build_request(method, url, headers=sent, content=content)
            response = self.http.send(built, stream=True)
            location = response.headers.get("location")
            if not (response.is_redirect and location):
                return response
            response.close()
            target = urljoin(url, location)
            if urlsplit(target).scheme not in ("https", "http") or (
                urlsplit(target).scheme == "http" and not self.insecure
            ):
                raise PullError(
                    f"registry {self.host} redirected to {urlsplit(target).scheme}://"
                    f"{_netloc(target)}, which is not https; refusing"
                )
            url = target
        raise PullError(f"registry {self.host}: too many redirects")

    @contextlib.contextmanager
    def request(
        self,
        method: str,
        path_or_url: str,
        headers: dict[str, str] | None = None,
        content: bytes | None = None,
    ) -> Iterator[httpx.Response]:
        """A streamed request that answers a Bearer challenge once (token fetched from the same host).
        `content` is bytes, not a stream, so the request can be sent again after the challenge."""
        url = path_or_url if "://" in path_or_url else self.base + path_or_url
        headers = headers or {}
        response = self._send(method, url, headers, content)
        challenge = response.headers.get("www-authenticate", "")
        if (
            response.status_code == 401
            and _netloc(str(response.url)) == _netloc(self.base)
            # a new challenge (none answered yet, or a wider scope: a push after a pull token)
            and (self.token is None or challenge != self.answered)
        ):
            response.close()
            self.token = self._fetch_token(challenge)
            self.answered = challenge
            response = self._send(method, url, headers, content)
        try:
            yield response
        finally:
            response.close()

    def _fetch_token(self, challenge: str) -> str:
        scheme, _, params_text = challenge.partition(" ")
        params = dict(_CHALLENGE_PARAM.findall(params_text))
        if scheme.lower() != "bearer" or "realm" not in params:
            raise PullError(f"registry {self.host} requires authentication ({challenge or 'no challenge'})")
        realm = params["realm"]
        if _netloc(realm) != _netloc(self.base) or urlsplit(realm).scheme not in ("https", "http"):
            # CVE-2025-51471: a realm on another host would collect whatever we send it
            raise PullError(
                f"registry {self.host} asked for a token from another host "
                f"({_netloc(realm) or realm}); refusing"
            )
        if urlsplit(realm).scheme == "http" and not self.insecure:
            raise PullError(f"registry {self.host} token endpoint uses http; pass --insecure")
        query = {k: v for k, v in params.items() if k in ("service", "scope")}
        response = self.http.get(realm, params=query)
        if response.status_code != 200:
            raise PullError(f"registry {self.host} refused a token: HTTP {response.status_code}")
        try:
            body = response.json()
            token = body.get("token") or body.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise PullError(f"registry {self.host} sent no token")
        return token

    # ---- manifests -----------------------------------------------------------------------------
    def fetch_manifest(self, name: ModelName) -> tuple[bytes, dict[str, Any]]:
        """The raw manifest bytes (to be stored as received) and the validated parse."""
        ref = name.digest or name.tag
        accept = f"{MANIFEST_MEDIA_TYPE}, {OCI_MANIFEST}"
        # identity: a compressed answer could expand far past the size cap before it is checked
        headers = {"Accept": accept, "Accept-Encoding": "identity"}
        with self.request("GET", f"/v2/{name.namespace}/{name.model}/manifests/{ref}", headers) as r:
            if r.status_code == 404:
                raise ModelNotFound(
                    f"pull model manifest: file does not exist: "
                    f"no {name.namespace}/{name.model}:{ref} on {self.host}"
                )
            if r.status_code == 401:
                raise PullError(
                    f"pull model manifest: {self.host} refused access to {name.display} (HTTP 401)"
                )
            if r.status_code != 200:
                raise PullError(f"pull model manifest: {self.host} answered HTTP {r.status_code}")
            raw = bytearray()
            for block in r.iter_bytes():
                raw += block
                if len(raw) > MAX_MANIFEST_BYTES:
                    raise PullError(
                        f"pull model manifest: {self.host} sent more than {MAX_MANIFEST_BYTES} bytes"
                    )
            advertised = r.headers.get("docker-content-digest", "")
        data = bytes(raw)
        actual = "sha256:" + hashlib.sha256(data).hexdigest()
        wanted = name.digest or (advertised if advertised.startswith("sha256:") else None)
        if wanted and wanted != actual:
            raise DigestMismatch(
                f"digest mismatch for manifest {name.display}: expected {wanted}, got {actual}"
            )
        try:
            manifest = parse_manifest(data)
        except LocalrtError as e:
            raise PullError(
                f"registry {self.host} sent an invalid manifest for {name.display}: {e}"
            ) from None
        return data, manifest

    # ---- blobs ---------------------------------------------------------------------------------
    def download_blob(self, name: ModelName, store: Store, digest: str, size: int, emit: ProgressFn) -> None:
        """Fill `blobs/<digest>-partial` up to `size` bytes, resuming with Range; the caller verifies."""
        partial = store.partial_path(digest)
        status = f"pulling {digest.split(':', 1)[1][:12]}"
        url = f"/v2/{name.namespace}/{name.model}/blobs/{digest}"
        failures = 0
        while True:
            offset = partial.stat().st_size if partial.exists() else 0
            if offset > size:  # not this blob's prefix: start over
                partial.unlink()
                offset = 0
            emit(Progress(status, digest, size, offset))
            if offset == size:
                partial.touch()  # the empty blob has no bytes to fetch
                return
            start = offset
            try:
                self._fetch_range(
                    url,
                    partial,
                    digest,
                    offset,
                    size,
                    store,
                    lambda n: emit(Progress(status, digest, size, n)),
                )
                return
            except (_Retryable, httpx.TransportError) as e:
                got = partial.stat().st_size if partial.exists() else 0
                failures = 1 if got > start else failures + 1
                if failures > MAX_RETRIES:
                    raise PullError(
                        f"downloading {digest[:19]} from {self.host} failed after {MAX_RETRIES} retries "
                        f"({e or type(e).__name__}); run pull again to resume"
                    ) from None
                self.sleep(min(0.25 * 2 ** (failures - 1), 4.0))

    def _fetch_range(
        self,
        url: str,
        partial: Path,
        digest: str,
        offset: int,
        size: int,
        store: Store,
        on_bytes: Callable[[int], None],
    ) -> None:
        headers = {"Accept-Encoding": "identity"}  # a blob is stored byte for byte; no decompression bombs
        if offset:
            headers["Range"] = f"bytes={offset}-"
        with self.request("GET", url, headers) as r:
            if r.status_code == 416 and offset:
                partial.unlink(missing_ok=True)
                raise PullError(
                    f"registry {self.host} has fewer bytes for {digest[:19]} than its manifest says"
                )
            if r.status_code == 404:
                raise PullError(f"registry {self.host} has no blob {digest}")
            if r.status_code in (500, 502, 503, 504):
                raise _Retryable(f"HTTP {r.status_code}")
            if r.status_code == 206:
                if not r.headers.get("content-range", "").startswith(f"bytes {offset}-"):
                    raise PullError(
                        f"registry {self.host} answered a different range than asked for {digest[:19]}"
                    )
            elif r.status_code == 200:
                offset = 0  # the server ignored Range: take the whole body
            else:
                raise PullError(f"downloading {digest[:19]}: {self.host} answered HTTP {r.status_code}")
            try:
                with open(partial, "ab" if offset else "wb") as out:
                    for (
                        block
                    ) in r.iter_bytes():  # as received, so a resume starts exactly where bytes stopped
                        if offset + len(block) > size:
                            out.close()
                            partial.unlink(missing_ok=True)
                            raise DigestMismatch(
                                f"digest mismatch for {digest}: the registry sent more than "
                                f"the {size} bytes its manifest names"
                            )
                        out.write(block)
                        faults.reach("write", offset, offset + len(block))
                        offset += len(block)
                        on_bytes(offset)
                        if threads.stopping.is_set():  # a server past its grace: stop where a pull resumes
                            raise PullError(
                                f"pulling {digest[:19]} stopped at {offset} of {size} bytes: the server is "
                                "shutting down; the partial download is kept, pull again to resume"
                            )
            except OSError as e:  # a write, or the close that flushes the last buffered bytes
                raise (partial_full(partial, size - offset, e) or e) from None
        if offset < size:
            raise _Retryable(f"connection closed at {offset} of {size} bytes")


def pull_registry(
    name: ModelName,
    store: Store,
    *,
    dest: ModelName | None = None,
    insecure: bool = False,
    progress: ProgressFn | None = None,
    expect_model_digest: str | None = None,
) -> str:
    """Pull `name` from its registry into `store` under `dest`; returns the manifest digest."""
    emit = progress or (lambda _: None)
    dest = dest or ModelName(name.host, name.namespace, name.model, name.tag)
    try:
        with RegistryClient(name.host, insecure=insecure) as client:
            return _pull(client, name, store, dest, emit, expect_model_digest)
    except httpx.ConnectTimeout:
        raise PullError(
            f"cannot reach {name.host}: connection timed out after {CONNECT_TIMEOUT:.0f}s"
        ) from None
    except httpx.ConnectError as e:
        if not insecure and "WRONG_VERSION_NUMBER" in str(e).upper():
            raise PullError(f"registry {name.host} uses http; pass --insecure") from None
        raise PullError(f"cannot reach {name.host}: {e}") from None
    except httpx.HTTPError as e:
        raise PullError(f"pulling {name.display} from {name.host} failed: {e or type(e).__name__}") from None


EMPTY_DIGEST = "sha256:" + hashlib.sha256(b"").hexdigest()


def _layer_sizes(host: str, manifest: dict[str, Any]) -> dict[str, int]:
    """Each blob's size as the manifest names it: the bound its download is held to, so it must be there."""
    layers: dict[str, int] = {}
    for layer in manifest_layers(manifest):
        size = layer.get("size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise PullError(
                f"registry {host} sent a manifest whose layer {layer['digest']} has no size "
                "(a pull needs each layer's size to bound its download)"
            )
        if size == 0 and layer["digest"] != EMPTY_DIGEST:
            raise PullError(
                f"registry {host} sent a manifest whose layer {layer['digest']} has size 0 "
                "but is not the empty blob"
            )
        layers.setdefault(layer["digest"], size)
    return layers


def _pull(
    client: RegistryClient,
    name: ModelName,
    store: Store,
    dest: ModelName,
    emit: ProgressFn,
    expect_model_digest: str | None,
) -> str:
    emit(Progress("pulling manifest"))
    raw, manifest = client.fetch_manifest(name)
    if expect_model_digest:
        expect_model_digest = as_digest(expect_model_digest)
        models = [layer["digest"] for layer in manifest["layers"] if layer.get("mediaType") == MEDIA_MODEL]
        if models != [expect_model_digest]:
            raise DigestMismatch(
                f"digest mismatch: {name.display} on {name.host} has model layer "
                f"{', '.join(models) or 'none'}, the catalog expects {expect_model_digest}"
            )
    layers = _layer_sizes(client.host, manifest)

    def missing() -> int:
        return sum(
            size - (store.partial_path(d).stat().st_size if store.partial_path(d).exists() else 0)
            for d, size in layers.items()
            if not store.has_blob(d)
        )

    check_free_space(store, missing())
    with contextlib.ExitStack() as locks:
        # sorted: two pulls sharing blobs take their locks in the same order, so neither deadlocks
        for digest in sorted(layers):
            locks.enter_context(store.lock(digest))
        fresh = []
        for digest, size in layers.items():
            if store.has_blob(digest):  # already here (another model, or the pull that held the lock)
                emit(Progress(f"pulling {digest.split(':', 1)[1][:12]}", digest, size, size))
                continue
            client.download_blob(name, store, digest, size, emit)
            fresh.append(digest)
        emit(Progress("verifying sha256 digest"))
        # under the gc lock: a concurrent `rm` must not collect these blobs before the manifest names them
        with store.lock("gc"):
            for digest in fresh:
                store.finalize_partial(digest)
            emit(Progress("writing manifest"))
            with store.lock("manifest:" + str(dest.manifest_relpath()).lower()):
                digest = store.write_manifest(dest, from_registry(store, raw))
    emit(Progress("success"))
    return digest
