"""Remote models in the store: a manifest whose config names OpenAI-compatible endpoints, no weights.

    config blob: {"model_format": "remote", "model_family": "remote", ...,
                  "remote": {"endpoints": ["https://gpu-1:8000/v1", ...], "model": "<upstream id>",
                             "api_key_env": "VAR" | null, "insecure": false}}

A key is never written: only the name of the environment variable that holds it. Who may name which
variable is the point (docs/security.md): the CLI runs as the user and may name any; an API client only
those in LOCALRT_REMOTE_KEY_ENVS; a pulled manifest none (`from_registry` drops it). The `remote` backend
(backends/remote) reads this section when the runtime loads the model, and checks the endpoints again.
"""

from __future__ import annotations

import ipaddress
import json
import re
import urllib.parse
from collections.abc import Collection
from collections.abc import Sequence
from typing import Any

from localrt import config
from localrt.errors import LocalrtError
from localrt.errors import ModelNotFound
from localrt.store.names import ModelName
from localrt.store.names import parse_name
from localrt.store.store import CONFIG_MEDIA_TYPE
from localrt.store.store import MEDIA_LICENSE
from localrt.store.store import MEDIA_MODEL
from localrt.store.store import MEDIA_PARAMS
from localrt.store.store import MEDIA_SYSTEM
from localrt.store.store import MEDIA_TEMPLATE
from localrt.store.store import REMOTE_FORMAT
from localrt.store.store import ResolvedModel
from localrt.store.store import Store

MAX_ENDPOINTS = 64
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# Modelfile PARAMETER names that configure the remote instead of sampling
REMOTE_PARAMETERS = ("remote_model", "api_key_env")


class RemoteConfigError(LocalrtError):
    pass


def is_remote(resolved: ResolvedModel) -> bool:
    """A model whose manifest names endpoints (served upstream) rather than holding weights here."""
    return resolved.remote is not None


def is_remote_url(text: str) -> bool:
    return text.strip().lower().startswith(("http://", "https://"))


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_endpoint(url: str, insecure: bool = False) -> str:
    """A remote URL checked and normalised: http(s) only, no credentials in it, http only to loopback
    unless `insecure`; a bare `http://host:port` means its OpenAI API under /v1."""
    if not isinstance(url, str) or not url.strip():
        raise RemoteConfigError("a remote URL is empty")
    try:
        parts = urllib.parse.urlsplit(url.strip())
        port = parts.port
    except ValueError:
        raise RemoteConfigError(f"remote URL {url!r} is not a valid URL") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise RemoteConfigError(f"remote URL {url!r} must start with http:// or https://")
    if not parts.hostname:
        raise RemoteConfigError(f"remote URL {url!r} names no host")
    if parts.username or parts.password:
        raise RemoteConfigError(
            f"remote URL for {parts.hostname} carries credentials; keep keys out of URLs and use --api-key-env"
        )
    if parts.query or parts.fragment:
        raise RemoteConfigError(f"remote URL {url!r} must not have a query or fragment")
    if scheme == "http" and not insecure and not is_loopback(parts.hostname):
        raise RemoteConfigError(
            f"remote URL {url} is plain http to a host that is not loopback: prompts and keys would travel "
            "unencrypted; use https, or pass --insecure if the network is trusted"
        )
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    netloc = f"{host}:{port}" if port else host
    path = parts.path.rstrip("/") or "/v1"
    return urllib.parse.urlunsplit((scheme, netloc, path, "", ""))


def check_api_key_env(name: str | None, allowed: Collection[str] | None = None) -> str | None:
    """The variable a remote model reads its key from. `allowed` (an API client's request) limits the
    choice; its refusal reads the same whether the variable exists or not, and does not echo the name."""
    if name is None or name == "":
        return None
    if not _ENV_NAME.match(name):
        raise RemoteConfigError(
            "--api-key-env takes the name of an environment variable (like OPENAI_API_KEY), not a key"
        )
    if allowed is not None and name not in allowed:
        raise RemoteConfigError(
            "api_key_env may name only a variable listed in the server's LOCALRT_REMOTE_KEY_ENVS; "
            "to use any other, create the model with `localrt create --remote ... --api-key-env VAR`"
        )
    return name


def api_key(env_name: str | None, model: str = "") -> str | None:
    """The key from the named variable, read when it is needed; an unset or empty one is an error that
    names neither the variable nor which of the two it is (an API client must not learn what is set)."""
    if not env_name:
        return None
    value = config.secret(env_name)
    if value is None:
        raise RemoteConfigError(missing_key_message(model))
    return value


def missing_key_message(model: str) -> str:
    what = f"remote model '{model}'" if model else "this remote model"
    return f"the API key of {what} is not available to this server (see its api_key_env)"


def upstream_models(endpoint: str, key: str | None, timeout: float = 10.0) -> list[str]:
    """The model ids an endpoint serves (`GET /v1/models`); redirects are not followed, so a key
    is only ever sent to the host it was configured for."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.get(endpoint + "/models", headers=headers, timeout=timeout, follow_redirects=False)
    except httpx.HTTPError as e:
        raise LocalrtError(
            f"cannot reach {endpoint} to ask for its models ({type(e).__name__}); "
            "name the upstream's model with --remote-model"
        ) from None
    if r.status_code != 200:
        raise LocalrtError(
            f"{endpoint}/models answered HTTP {r.status_code}; name the model with --remote-model"
        )
    try:
        data = r.json().get("data") or []
        return [str(m["id"]) for m in data if isinstance(m, dict) and m.get("id")]
    except (ValueError, AttributeError, TypeError):
        raise LocalrtError(f"{endpoint}/models did not answer an OpenAI model list") from None


def pick_upstream_model(endpoints: Sequence[str], key: str | None) -> str:
    ids = upstream_models(endpoints[0], key)
    if len(ids) == 1:
        return ids[0]
    listed = ", ".join(ids[:10]) or "none"
    raise LocalrtError(
        f"{endpoints[0]} serves {len(ids)} models ({listed}); name one with --remote-model "
        "(or PARAMETER remote_model)"
    )


def create_remote(
    store: Store,
    name: ModelName | str,
    endpoints: Sequence[str],
    *,
    model: str | None = None,
    api_key_env: str | None = None,
    insecure: bool = False,
    parameters: dict[str, Any] | None = None,
    system: str | None = None,
    template: str | None = None,
    license_text: str | None = None,
    replace_local: bool = True,
    key_envs: Collection[str] | None = None,
) -> str:
    """Store a remote model; returns its manifest digest. Without `model`, the first endpoint is asked
    for the one model it serves. `key_envs` are the variables `api_key_env` may name (None: any, as
    for the CLI, which runs as the user)."""
    dest = parse_name(name) if isinstance(name, str) else name
    if dest.digest:
        raise LocalrtError(f"cannot create {dest}: a model name to write takes no @digest")
    urls = list(dict.fromkeys(check_endpoint(u, insecure) for u in endpoints))
    if not urls:
        raise RemoteConfigError("a remote model needs at least one endpoint URL")
    if len(urls) > MAX_ENDPOINTS:
        raise RemoteConfigError(f"a remote pool takes at most {MAX_ENDPOINTS} endpoints")
    env_name = check_api_key_env(api_key_env, key_envs)
    if model is not None and (not isinstance(model, str) or not model.strip()):
        raise RemoteConfigError("--remote-model must name the upstream's model id")
    if not replace_local and _is_local(store, dest):
        raise LocalrtError(f"'{dest.display}' is a local model; choose another name for the remote one")
    upstream = model.strip() if model else pick_upstream_model(urls, api_key(env_name, dest.display))
    config: dict[str, Any] = {
        "model_format": REMOTE_FORMAT,
        "model_family": REMOTE_FORMAT,
        "model_families": [REMOTE_FORMAT],
        "model_type": "",
        "file_type": "",
        "remote": {"endpoints": urls, "model": upstream, "api_key_env": env_name, "insecure": bool(insecure)},
    }
    with store.lock("gc"):
        layers = []
        texts = ((MEDIA_TEMPLATE, template), (MEDIA_SYSTEM, system), (MEDIA_LICENSE, license_text))
        for media, text in texts:
            if text is not None:
                digest, size = store.add_blob_bytes(text.encode("utf-8"))
                layers.append({"mediaType": media, "digest": digest, "size": size})
        if parameters:
            digest, size = store.add_blob_bytes(json.dumps(parameters, sort_keys=True).encode())
            layers.append({"mediaType": MEDIA_PARAMS, "digest": digest, "size": size})
        config["rootfs"] = {"type": "layers", "diff_ids": [layer["digest"] for layer in layers]}
        cfg_digest, cfg_size = store.add_blob_bytes(json.dumps(config, sort_keys=True).encode())
        manifest = Store.build_manifest(
            {"mediaType": CONFIG_MEDIA_TYPE, "digest": cfg_digest, "size": cfg_size}, layers
        )
        with store.lock("manifest:" + str(dest.manifest_relpath()).lower()):
            return store.write_manifest(dest, manifest)


# What a pulled remote config never keeps: the publisher of a manifest chooses neither which of this
# machine's secrets go to its endpoints nor plain http across the network.
LOCAL_ONLY_KEYS = ("api_key_env", "insecure")


def from_registry(store: Store, raw: bytes) -> bytes:
    """A pulled manifest as it may be stored: when its config is a remote model's, a config without
    LOCAL_ONLY_KEYS is written and named instead (the manifest's digest then differs from the
    registry's). Anything else comes back unchanged; the config blob must be in the store already."""
    try:
        manifest = json.loads(raw)
        cfg_layer = manifest["config"]
        config = json.loads(store.blob_path(cfg_layer["digest"]).read_bytes())
        section = config["remote"] if config.get("model_format") == REMOTE_FORMAT else None
    except (ValueError, KeyError, TypeError, AttributeError, OSError):
        return raw  # not a remote model's config: the store's reader judges it as any other
    if not isinstance(section, dict) or not any(k in section for k in LOCAL_ONLY_KEYS):
        return raw
    config["remote"] = {k: v for k, v in section.items() if k not in LOCAL_ONLY_KEYS}
    digest, size = store.add_blob_bytes(json.dumps(config, sort_keys=True).encode())
    manifest["config"] = {**cfg_layer, "digest": digest, "size": size}
    return json.dumps(manifest).encode()


def _is_local(store: Store, name: ModelName) -> bool:
    try:
        manifest, _ = store.read_manifest(name)
    except ModelNotFound:
        return False
    return any(layer.get("mediaType") == MEDIA_MODEL for layer in manifest.get("layers", []))


def probe(endpoint: str, key: str | None, timeout: float = 5.0) -> str:
    """One health check for `show`: "ok", or why not (`/health`, then `/v1/models`)."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    root = endpoint[: -len("/v1")] if endpoint.endswith("/v1") else endpoint
    last = ""
    for url in (root + "/health", endpoint + "/models"):
        try:
            r = httpx.get(url, headers=headers, timeout=timeout, follow_redirects=False)
        except httpx.HTTPError as e:
            return f"down ({type(e).__name__})"
        if r.status_code == 200:
            return "ok"
        last = f"down (HTTP {r.status_code})"
    return last
