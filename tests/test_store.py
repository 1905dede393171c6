"""The store: Ollama's layout, verified atomic blob writes, manifests, copy, rm with blob GC."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import pytest

from localrt.errors import DigestMismatch
from localrt.errors import InvalidName
from localrt.errors import LocalrtError
from localrt.errors import ModelNotFound
from localrt.store.names import parse_name
from localrt.store.store import MEDIA_MODEL
from localrt.store.store import MEDIA_PARAMS
from localrt.store.store import MEDIA_TEMPLATE
from localrt.store.store import Store


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def put_model(store: Store, name: str, payload: bytes, params: dict | None = None) -> str:
    model_digest, model_size = store.add_blob_bytes(payload)
    layers = [{"mediaType": MEDIA_MODEL, "digest": model_digest, "size": model_size}]
    if params is not None:
        d, s = store.add_blob_bytes(json.dumps(params).encode())
        layers.append({"mediaType": MEDIA_PARAMS, "digest": d, "size": s})
    cfg_digest, cfg_size = store.add_blob_bytes(b'{"model_format":"gguf"}')
    cfg = {
        "mediaType": "application/vnd.docker.container.image.v1+json",
        "digest": cfg_digest,
        "size": cfg_size,
    }
    return store.write_manifest(parse_name(name), Store.build_manifest(cfg, layers))


def test_layout_is_ollamas(tmp_path: Path) -> None:
    store = Store(tmp_path)
    put_model(store, "smollm2:135m", b"GGUF-bytes")
    manifest = tmp_path / "manifests" / "registry.ollama.ai" / "library" / "smollm2" / "135m"
    assert manifest.is_file()
    doc = json.loads(manifest.read_text())
    assert doc["schemaVersion"] == 2
    assert doc["mediaType"] == "application/vnd.docker.distribution.manifest.v2+json"
    blob = tmp_path / "blobs" / ("sha256-" + hashlib.sha256(b"GGUF-bytes").hexdigest())
    assert blob.read_bytes() == b"GGUF-bytes"


def test_blob_stream_verifies_and_leaves_nothing_on_mismatch(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with pytest.raises(DigestMismatch, match="digest mismatch"):
        store.add_blob_stream(io.BytesIO(b"real bytes"), digest_of(b"other bytes"))
    assert [p.name for p in store.blobs.iterdir()] == []


def test_finalize_partial_rejects_wrong_bytes(tmp_path: Path) -> None:
    store = Store(tmp_path)
    digest = digest_of(b"expected")
    store.blobs.mkdir(parents=True)
    store.partial_path(digest).write_bytes(b"tampered")
    with pytest.raises(DigestMismatch, match="must be downloaded again"):
        store.finalize_partial(digest)
    assert not store.partial_path(digest).exists()
    assert not store.has_blob(digest)
    store.partial_path(digest).write_bytes(b"expected")
    assert store.finalize_partial(digest).read_bytes() == b"expected"


def test_manifest_needs_its_blobs(tmp_path: Path) -> None:
    store = Store(tmp_path)
    missing = {"mediaType": MEDIA_MODEL, "digest": digest_of(b"nope"), "size": 4}
    with pytest.raises(LocalrtError, match="missing"):
        store.write_manifest(parse_name("m"), Store.build_manifest({}, [missing]))
    assert not (tmp_path / "manifests").exists() or not any((tmp_path / "manifests").rglob("*"))


def test_manifest_with_traversal_digest_is_refused(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    bad = {"mediaType": MEDIA_MODEL, "digest": "sha256:../../x", "size": 1}
    with pytest.raises(InvalidName):
        store.write_manifest(parse_name("m"), Store.build_manifest({}, [bad]))
    outside = [p for p in tmp_path.rglob("*") if store.root not in (p, *p.parents)]
    assert outside == []
    assert not store.manifests.exists() or not any(store.manifests.rglob("*"))


def test_list_resolve_copy_remove_with_gc(tmp_path: Path) -> None:
    store = Store(tmp_path)
    put_model(store, "a:1", b"shared-weights", params={"temperature": 0.2})
    put_model(store, "b:1", b"other-weights")
    names = {e.name.display for e in store.list_models()}
    assert names == {"a:1", "b:1"}
    entry = next(e for e in store.list_models() if e.name.display == "a:1")
    assert len(entry.id) == 12
    assert entry.size > len(b"shared-weights")

    resolved = store.resolve("a:1")
    assert resolved.model_path.read_bytes() == b"shared-weights"
    assert resolved.params == {"temperature": 0.2}

    store.copy(parse_name("a:1"), parse_name("me/c:2"))
    assert store.resolve("me/c:2").model_path == resolved.model_path
    blobs_before = set(p.name for p in store.blobs.iterdir())

    store.remove(parse_name("a:1"))  # the copy still references the shared blobs
    assert set(p.name for p in store.blobs.iterdir()) == blobs_before
    store.remove(parse_name("me/c:2"))
    assert not resolved.model_path.exists()
    store.remove(parse_name("b:1"))
    assert list(store.blobs.iterdir()) == []
    assert not any(store.manifests.iterdir())  # empty folders pruned
    with pytest.raises(ModelNotFound, match="not found"):
        store.resolve("a:1")


def test_gc_keeps_partial_downloads(tmp_path: Path) -> None:
    store = Store(tmp_path)
    put_model(store, "a", b"x")
    partial = store.partial_path(digest_of(b"in flight"))
    partial.write_bytes(b"in f")
    store.remove(parse_name("a"))
    assert partial.exists()


def test_reads_an_existing_ollama_store(tmp_path: Path) -> None:
    """Written the way Ollama writes it (manifest bytes with its own formatting, template layer)."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    layers = []
    for media, data in ((MEDIA_MODEL, b"GGUF...weights"), (MEDIA_TEMPLATE, b"{{ .Prompt }}")):
        hexd = hashlib.sha256(data).hexdigest()
        (blobs / f"sha256-{hexd}").write_bytes(data)
        layers.append({"mediaType": media, "digest": f"sha256:{hexd}", "size": len(data)})
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {
            "mediaType": "application/vnd.docker.container.image.v1+json",
            "digest": layers[1]["digest"],
            "size": layers[1]["size"],
        },
        "layers": layers,
    }
    path = tmp_path / "manifests" / "registry.ollama.ai" / "library" / "llama3.2" / "latest"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(manifest, indent=3))
    store = Store(tmp_path)
    [entry] = store.list_models()
    assert entry.name.display == "llama3.2:latest"
    model = store.resolve("llama3.2")
    assert model.model_path.read_bytes() == b"GGUF...weights"
    assert model.template == "{{ .Prompt }}"
    assert store.resolve("LLAMA3.2:Latest").model_path == model.model_path  # case-insensitive


# ---- after a crash: recovery and verify -------------------------------------------------------------
def test_recovery_removes_what_killed_writes_left_and_keeps_partials(tmp_path: Path) -> None:
    store = Store(tmp_path)
    put_model(store, "kept:1", b"model-bytes")
    orphan_temp = store.blobs / ".incoming-dead"
    orphan_temp.write_bytes(b"x" * 100)
    orphan_scratch = tmp_path / ".quantize-dead"
    (orphan_scratch / "model.gguf.part").parent.mkdir()
    (orphan_scratch / "model.gguf.part").write_bytes(b"y" * 50)
    orphan_manifest = store.manifest_path(parse_name("kept:1")).parent / ".manifest-dead"
    orphan_manifest.write_bytes(b"{")
    resumable = store.partial_path(digest_of(b"not here yet"))
    resumable.write_bytes(b"not here")
    done = store.partial_path(digest_of(b"model-bytes"))  # its blob is complete already
    done.write_bytes(b"model")
    live_fd, live_temp = store.temp_file(store.blobs, ".incoming-")  # a write in progress: held
    with store.scratch(".convert-") as live_scratch:
        found = {leftover.path: leftover for leftover in store.recover()}
        assert live_temp.exists()
        assert live_scratch.is_dir()
    os.close(live_fd)
    assert sorted(found) == sorted([orphan_temp, orphan_scratch, orphan_manifest, resumable, done])
    assert [p for p, leftover in found.items() if leftover.kept] == [resumable]
    assert resumable.read_bytes() == b"not here"
    assert [p for p in (orphan_temp, orphan_scratch, orphan_manifest, done) if p.exists()] == []
    assert found[orphan_scratch].size == 50
    assert "pull again to resume" in found[resumable].line()
    assert store.resolve("kept:1").model_path.read_bytes() == b"model-bytes"  # the store itself untouched


def test_recovery_of_a_store_that_does_not_exist_is_nothing(tmp_path: Path) -> None:
    assert Store(tmp_path / "none").recover() == []
    assert not (tmp_path / "none").exists()


def flip_a_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


def test_verify_rehashes_every_blob_and_repair_removes_what_is_broken(tmp_path: Path) -> None:
    from localrt.store.verify import verify

    store = Store(tmp_path)
    put_model(store, "good:1", b"good-model" * 1000)
    put_model(store, "damaged:1", b"damaged-model" * 1000, params={"temperature": 0.1})
    put_model(store, "missing:1", b"missing-model" * 1000)
    stray, _ = store.add_blob_bytes(b"uploaded, waiting for a create")
    flip_a_byte(store.blob_path(digest_of(b"damaged-model" * 1000)))
    store.blob_path(digest_of(b"missing-model" * 1000)).unlink()
    seen: list[tuple[int, int]] = []
    report = verify(store, progress=lambda done, total: seen.append((done, total)))
    assert [p.models for p in report.problems] == [["missing:1"], ["damaged:1"]]
    assert report.broken_models == ["damaged:1", "missing:1"]
    assert report.unreferenced == [(stray, len(b"uploaded, waiting for a create"))]
    assert seen[-1] == (report.bytes, report.bytes)
    assert [done for done, _ in seen] == sorted(done for done, _ in seen)
    assert report.bytes == sum(p.stat().st_size for p in store.blobs.glob("sha256-*"))
    assert store.exists(parse_name("damaged:1"))  # verify alone changes nothing

    repaired = verify(store, repair=True)
    assert repaired.broken_models == ["damaged:1", "missing:1"]
    assert [e.name.display for e in store.list_models()] == ["good:1"]
    assert not store.has_blob(digest_of(b"damaged-model" * 1000))
    assert store.has_blob(stray)  # not broken: kept
    assert verify(store).ok


def test_verify_of_one_model_reads_only_its_blobs(tmp_path: Path) -> None:
    from localrt.store.verify import verify

    store = Store(tmp_path)
    put_model(store, "one:1", b"one" * 100)
    put_model(store, "other:1", b"other" * 100)
    flip_a_byte(store.blob_path(digest_of(b"other" * 100)))
    report = verify(store, parse_name("one:1"))
    assert report.ok
    assert report.blobs == 2  # its model blob and config
    with pytest.raises(ModelNotFound):
        verify(store, parse_name("absent:1"))


def test_verify_names_an_unreadable_manifest(tmp_path: Path) -> None:
    from localrt.store.verify import verify

    store = Store(tmp_path)
    put_model(store, "torn:1", b"weights")
    store.manifest_path(parse_name("torn:1")).write_bytes(b'{"layers": [')
    report = verify(store, repair=True)
    assert [p.models for p in report.problems] == [["torn:1"]]
    assert "is unreadable (manifest is not valid JSON)" in report.problems[0].text
    assert not store.manifest_path(parse_name("torn:1")).exists()
