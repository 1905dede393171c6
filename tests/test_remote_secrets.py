"""No secret leaves through a remote model: a real `localrt serve` with a secret in its
environment, an attacker's endpoint and a registry as real servers on 127.0.0.1.

Every way a model's config can reach the server is tried: `/api/create` through the API, a pulled
manifest, and a config that never met `create`'s URL rules. The attacker's server records every request
whole, and doubles as the server's HTTP proxy, so a plain-http request to a foreign host is seen too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from localrt.store.store import CONFIG_MEDIA_TYPE
from localrt.store.store import Store
from tests.servers.attacker import MODEL
from tests.servers.attacker import Attacker
from tests.servers.registry import Registry
from tests.servers.serve import LocalrtServer

SECRET_VAR = "CLOUD_SECRET_ACCESS_KEY"
SECRET = "sk-server-secret-93f1c0de"
LISTED_VAR = "UPSTREAM_KEY_FOR_API"  # listed in LOCALRT_REMOTE_KEY_ENVS: clients may name it
LISTED_VALUE = "listed-key-5be2"
LISTED_UNSET = "LISTED_BUT_UNSET_KEY"  # listed, but not in the server's environment
CLI_VAR = "CLI_ONLY_KEY"  # named only by the CLI, which runs as the user
CLI_VALUE = "cli-key-a81d"
FOREIGN = "http://upstream.invalid:9/v1"  # not loopback, plain http: the proxy stands for the network
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def attacker() -> Iterator[Attacker]:
    with Attacker() as server:
        yield server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, attacker: Attacker) -> Iterator[LocalrtServer]:
    root = tmp_path_factory.mktemp("remote-secrets")
    env = {
        SECRET_VAR: SECRET,
        LISTED_VAR: LISTED_VALUE,
        CLI_VAR: CLI_VALUE,
        "LOCALRT_REMOTE_KEY_ENVS": f"{LISTED_VAR}, {LISTED_UNSET}",
        "HTTP_PROXY": attacker.url,
        "http_proxy": attacker.url,
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }
    srv = LocalrtServer(root / "models", root / "serve.log", env=env)
    yield srv
    srv.stop()
    log = srv.log_path.read_text(errors="replace")
    assert "Traceback" not in log
    assert SECRET not in log


@pytest.fixture
def clean(attacker: Attacker) -> Iterator[None]:
    """Each test looks only at what the attacker received during it, and asserts it holds no secret."""
    attacker.raw.clear()
    yield
    assert not attacker.saw(SECRET)


def store_of(server: LocalrtServer) -> Store:
    return Store(Path(server.env["LOCALRT_MODELS"]))


def create(server: LocalrtServer, **fields: object) -> httpx.Response:
    return httpx.post(server.url + "/api/create", json={"stream": False, **fields}, timeout=60)


def chat(server: LocalrtServer, model: str) -> httpx.Response:
    body = {"model": model, "messages": HI, "stream": False}
    return httpx.post(server.url + "/api/chat", json=body, timeout=60)


# ---- the API -----------------------------------------------------------------------------------
@pytest.mark.usefixtures("clean")
@pytest.mark.parametrize("remote_model", [MODEL, None])
def test_api_create_cannot_name_a_server_variable(
    server: LocalrtServer, attacker: Attacker, remote_model: str | None
) -> None:
    """Without remote_model the server would ask the endpoint for its models, key attached."""
    r = create(
        server, model="steal", remote=attacker.url + "/v1", api_key_env=SECRET_VAR, remote_model=remote_model
    )
    assert r.status_code == 400, r.text
    assert "LOCALRT_REMOTE_KEY_ENVS" in r.json()["error"]
    assert httpx.post(server.url + "/api/show", json={"model": "steal"}).status_code == 404
    assert attacker.received() == []  # refused before the endpoint was contacted at all


@pytest.mark.usefixtures("clean")
def test_refusal_reads_the_same_for_set_and_unset_variables(
    server: LocalrtServer, attacker: Attacker
) -> None:
    answers = {}
    for name in (SECRET_VAR, "NO_SUCH_VARIABLE_ANYWHERE", "HOME"):
        r = create(server, model="probe", remote=attacker.url + "/v1", api_key_env=name, remote_model=MODEL)
        answers[name] = (r.status_code, r.text)
    assert len(set(answers.values())) == 1, answers
    status, text = answers[SECRET_VAR]
    assert status == 400
    assert SECRET_VAR not in text


@pytest.mark.usefixtures("clean")
def test_a_listed_variable_is_sent_to_the_endpoint(server: LocalrtServer, attacker: Attacker) -> None:
    """The control: keys do reach an endpoint when the server's owner allowed it, so the checks above
    look where a key would travel."""
    r = create(server, model="allowed", remote=attacker.url + "/v1", api_key_env=LISTED_VAR)
    assert r.status_code == 200, r.text
    assert chat(server, "allowed").status_code == 200
    assert attacker.saw(f"Bearer {LISTED_VALUE}")
    assert any("/v1/chat/completions" in p for p in attacker.paths())


@pytest.mark.usefixtures("clean")
def test_a_missing_key_is_named_neither_by_variable_nor_state(
    server: LocalrtServer, attacker: Attacker
) -> None:
    r = create(
        server, model="unset", remote=attacker.url + "/v1", api_key_env=LISTED_UNSET, remote_model=MODEL
    )
    assert r.status_code == 200, r.text
    answer = chat(server, "unset")
    assert answer.status_code == 400, answer.text
    assert LISTED_UNSET not in answer.text
    assert "not set" not in answer.text
    shown = httpx.post(server.url + "/api/show", json={"model": "unset"}).json()
    health = [e["health"] for e in shown["remote"]["endpoints"]]
    assert all("not checked" in h for h in health)
    assert not any(LISTED_UNSET in h for h in health)


# ---- a pulled manifest -------------------------------------------------------------------------
def publish_remote(registry: Registry, repo: str, remote: dict[str, object]) -> None:
    config = {"model_format": "remote", "model_family": "remote", "remote": remote}
    blob = registry.add_blob(json.dumps(config).encode())
    registry.add_manifest(
        repo,
        "latest",
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {"mediaType": CONFIG_MEDIA_TYPE, **blob},
            "layers": [],
        },
    )


def pull(server: LocalrtServer, name: str) -> httpx.Response:
    return httpx.post(
        server.url + "/api/pull", json={"model": name, "insecure": True, "stream": False}, timeout=60
    )


@pytest.mark.usefixtures("clean")
def test_pulled_remote_model_carries_no_key(server: LocalrtServer, attacker: Attacker) -> None:
    remote = {
        "endpoints": [attacker.url + "/v1"],
        "model": MODEL,
        "api_key_env": SECRET_VAR,
        "insecure": True,
    }
    with Registry() as registry:
        publish_remote(registry, "library/free-gpu", remote)
        name = f"{registry.address}/library/free-gpu:latest"
        r = pull(server, name)
        assert r.status_code == 200, r.text
    stored = store_of(server).resolve(name).remote
    assert "api_key_env" not in stored
    assert "insecure" not in stored
    assert chat(server, name).status_code == 200  # the model works, keyless
    assert any("/v1/chat/completions" in p for p in attacker.paths())  # traffic did reach the attacker


@pytest.mark.usefixtures("clean")
def test_pulled_plain_http_endpoint_is_refused_where_used(server: LocalrtServer, attacker: Attacker) -> None:
    remote = {"endpoints": [FOREIGN], "model": MODEL, "insecure": True}
    with Registry() as registry:
        publish_remote(registry, "library/plain", remote)
        name = f"{registry.address}/library/plain:latest"
        assert pull(server, name).status_code == 200
    answer = chat(server, name)
    assert answer.status_code == 400, answer.text
    assert "--insecure" in answer.json()["error"]
    assert attacker.received() == []


# ---- a config that never met create's checks ---------------------------------------------------
def write_unchecked(store: Store, name: str, remote: dict[str, object]) -> None:
    """A remote model's manifest written as is (an older store, a hand edit): no URL rule applied."""
    config = {"model_format": "remote", "model_family": "remote", "remote": remote}
    digest, size = store.add_blob_bytes(json.dumps(config).encode())
    manifest = Store.build_manifest({"mediaType": CONFIG_MEDIA_TYPE, "digest": digest, "size": size}, [])
    from localrt.store.names import parse_name

    store.write_manifest(parse_name(name), manifest)


@pytest.mark.usefixtures("clean")
@pytest.mark.parametrize("url", [FOREIGN, "ftp://127.0.0.1:9/v1", "http://user:pw@127.0.0.1:9/v1"])
def test_unchecked_endpoint_gets_neither_key_nor_prompt(
    server: LocalrtServer, attacker: Attacker, url: str
) -> None:
    write_unchecked(
        store_of(server), "unchecked", {"endpoints": [url], "model": MODEL, "api_key_env": SECRET_VAR}
    )
    try:
        answer = chat(server, "unchecked")
        assert answer.status_code == 400, answer.text
        shown = httpx.post(server.url + "/api/show", json={"model": "unchecked"}).json()
        assert shown["remote"]["endpoints"][0]["health"].startswith("refused")
    finally:
        store_of(server).remove(store_of(server).resolve("unchecked").name)
    assert attacker.received() == []


# ---- the CLI -----------------------------------------------------------------------------------
def test_cli_create_remote_writes_the_store_while_the_server_runs(
    server: LocalrtServer, attacker: Attacker, clean: None
) -> None:
    """The CLI runs as the user: it may name any variable; the running server picks the model up."""
    env = {**os.environ, **server.env}
    cmd = [
        sys.executable,
        "-m",
        "localrt",
        "create",
        "mine",
        "--remote",
        attacker.url,
        "--api-key-env",
        CLI_VAR,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert store_of(server).resolve("mine").remote["api_key_env"] == CLI_VAR
    assert chat(server, "mine").status_code == 200
    assert attacker.saw(f"Bearer {CLI_VALUE}")
