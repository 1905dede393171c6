"""Memory that fits: each backend's estimate against the resident growth it predicts, and a real
`localrt serve` that makes room, fits a load down or refuses it clearly, and keeps serving, under
LOCALRT_MAX_MEMORY and under a real memory cgroup."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from localrt.backends.base import LoadOptions
from localrt.backends.devices import ComputeDevice
from localrt.backends.devices import gpu_room
from localrt.backends.llamacpp.memory import estimate as llamacpp_estimate
from localrt.backends.llamacpp.memory import gpu_layers
from localrt.backends.memory import MemoryEstimate
from localrt.runtime.memory import ladder
from localrt.store.importer import import_gguf
from localrt.store.store import Store
from tests.servers.serve import LocalrtServer

PROBE = Path(__file__).with_name("memory_probe.py")
TOLERANCE = 0.15
CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")


# ---- the estimate against what a load really holds ------------------------------------------------
def probe(backend: str, gguf: Path, context: int, parallel: int = 2) -> dict:
    env = {**os.environ, "PYTHONPATH": str(PROBE.parent.parent)}
    out = subprocess.run(
        [sys.executable, str(PROBE), backend, str(gguf), str(parallel), str(context)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])[0]


@pytest.mark.parametrize("context", [256, 512])
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_llamacpp_estimate_counts_what_it_allocates(
    model: str, context: int, smollm2_gguf: Path, gemma3_gguf: Path
) -> None:
    """The estimate's parts against the buffers llama.cpp reports allocating for the load, the same on
    any machine however busy: the KV cache to the byte (as logged, to 0.01 MiB), the weights as the
    file's tensors (the model buffer) and no more than the file. (The compute buffer is reserved for the
    worst case, and only partly touched: how much of it becomes resident is what the slow
    resident-growth test below measures.)"""
    gguf = smollm2_gguf if model == "smollm2" else gemma3_gguf
    row = probe("llama.cpp", gguf, context)
    allocated = row["allocated"]
    assert abs(row["kv"] - allocated["KV"]) <= 0.01 * (1 << 20), row
    assert allocated["model"] <= row["weights"] <= gguf.stat().st_size, row


@pytest.mark.slow
@pytest.mark.parametrize("context", [256, 512])
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
@pytest.mark.parametrize("backend", ["llama.cpp", "torch", "mlx"])
def test_estimate_within_15_percent_of_resident_growth(
    backend: str, model: str, context: int, smollm2_gguf: Path, gemma3_gguf: Path
) -> None:
    """Every sequence's context filled, so caches that grow with use hold what the estimate counts. The
    resident growth also moves with what else the machine does (pages of the model file dropped under
    memory pressure, allocator arenas): slow, for a quiet machine."""
    gguf = smollm2_gguf if model == "smollm2" else gemma3_gguf
    row = probe(backend, gguf, context)
    assert abs(row["total"] / row["growth"] - 1) <= TOLERANCE, row


# ---- a real server under LOCALRT_MAX_MEMORY --------------------------------------------------------
def serve(tmp_path: Path, smollm2_gguf: Path, gemma3_gguf: Path, **env: str) -> LocalrtServer:
    store = Store(tmp_path / "models")
    import_gguf(store, "smol", smollm2_gguf, params={"num_ctx": 512})
    import_gguf(store, "gem", gemma3_gguf, params={"num_ctx": 512})
    import_gguf(store, "smol-long", smollm2_gguf, params={"num_ctx": 8192})
    base = {"LOCALRT_NUM_PARALLEL": "1", "LOCALRT_BACKEND": "llama.cpp", "LOCALRT_KEEP_ALIVE": "10m"}
    return LocalrtServer(tmp_path / "models", tmp_path / "serve.log", env={**base, **env})


def needs(gguf: Path, context: int) -> int:
    """What the llama.cpp backend estimates for one sequence of `context` tokens."""
    return llamacpp_estimate(gguf, LoadOptions(num_ctx=context, num_parallel=1)).total


# LOCALRT_MAX_MEMORY for each situation, placed between the estimates it must separate so that a
# change in the estimate moves the limit with it
LIMITS = {
    # the small model fits, the larger one never does
    "small-only": lambda smol, gem: (needs(smol, 512) + needs(gem, 512)) // 2,
    # either model alone, never both together
    "one-at-a-time": lambda smol, gem: needs(gem, 512) + needs(smol, 512) // 2,
    # the long model at 4096 tokens, not at its 8192
    "half-context": lambda smol, gem: (needs(smol, 4096) + needs(smol, 8192)) // 2,
}


@pytest.fixture
def server(
    request: pytest.FixtureRequest, tmp_path: Path, smollm2_gguf: Path, gemma3_gguf: Path
) -> Iterator[LocalrtServer]:
    limit = LIMITS[request.param](smollm2_gguf, gemma3_gguf)
    srv = serve(tmp_path, smollm2_gguf, gemma3_gguf, LOCALRT_MAX_MEMORY=str(limit))
    try:
        yield srv
    finally:
        srv.stop()


def generate(srv: LocalrtServer, model: str, **options: int) -> httpx.Response:
    body = {"model": model, "prompt": "Hi", "stream": False, "options": {"num_predict": 2, **options}}
    return httpx.post(srv.url + "/api/generate", json=body, timeout=600)


def loaded(srv: LocalrtServer) -> dict[str, dict]:
    return {m["name"]: m for m in httpx.get(srv.url + "/api/ps", timeout=30).json()["models"]}


@pytest.mark.parametrize("server", ["small-only"], indirect=True)
def test_model_over_the_limit_is_refused_in_ollamas_words(server: LocalrtServer) -> None:
    assert generate(server, "smol").status_code == 200
    refused = generate(server, "gem")
    assert refused.status_code == 500
    assert "model requires more system memory" in refused.json()["error"]


@pytest.mark.parametrize("server", ["small-only"], indirect=True)
def test_refusal_names_the_limit(server: LocalrtServer) -> None:
    error = generate(server, "gem").json()["error"]
    assert "LOCALRT_MAX_MEMORY" in error


@pytest.mark.parametrize("server", ["small-only"], indirect=True)
def test_loaded_model_keeps_answering_after_a_refusal(server: LocalrtServer) -> None:
    generate(server, "smol")
    generate(server, "gem")
    assert "smol:latest" in loaded(server)
    assert generate(server, "smol").status_code == 200


@pytest.mark.parametrize("server", ["one-at-a-time"], indirect=True)
def test_second_model_unloads_the_idle_first(server: LocalrtServer) -> None:
    generate(server, "smol")
    assert generate(server, "gem").status_code == 200
    assert list(loaded(server)) == ["gem:latest"]


@pytest.mark.parametrize("server", ["half-context"], indirect=True)
def test_load_fitted_down_to_a_shorter_context(server: LocalrtServer) -> None:
    """8192 tokens of KV do not fit the limit; 4096 do: the model loads with the context that fits."""
    assert generate(server, "smol-long").status_code == 200
    assert loaded(server)["smol-long:latest"]["context_length"] == 4096


POOLED = LoadOptions(num_ctx=2048, num_parallel=4, batch_invariant=False)


def test_the_ladder_shrinks_a_shared_pool_before_the_sequences(smollm2_gguf: Path) -> None:
    fits = ladder("llama.cpp", smollm2_gguf, POOLED)
    assert [f.estimate.pool for f in fits[:3]] == [8192, 4096, 2048]


def test_a_smaller_pool_keeps_every_sequence(smollm2_gguf: Path) -> None:
    fits = ladder("llama.cpp", smollm2_gguf, POOLED)
    assert {f.estimate.parallel for f in fits[:3]} == {4}


def test_each_smaller_pool_needs_less(smollm2_gguf: Path) -> None:
    rams = [f.estimate.ram for f in ladder("llama.cpp", smollm2_gguf, POOLED)[:3]]
    assert rams[0] > rams[1] > rams[2]


def test_no_pool_step_under_batch_invariance(smollm2_gguf: Path) -> None:
    fits = ladder("llama.cpp", smollm2_gguf, LoadOptions(num_ctx=2048, num_parallel=4, batch_invariant=True))
    assert fits[1].changes == ("parallel 4 -> 2",)


@pytest.fixture
def pooled_server(tmp_path: Path, smollm2_gguf: Path, gemma3_gguf: Path) -> Iterator[LocalrtServer]:
    srv = serve(tmp_path, smollm2_gguf, gemma3_gguf, LOCALRT_NUM_PARALLEL="2", LOCALRT_BATCH_INVARIANT="0")
    try:
        generate(srv, "smol")
        yield srv
    finally:
        srv.stop()


def test_ps_gives_the_sequences_and_their_shared_pool(pooled_server: LocalrtServer) -> None:
    details = loaded(pooled_server)["smol:latest"]["details"]
    assert (details["parallel"], details["kv_pool"]) == (2, 1024)


def test_the_kv_pool_option_sets_the_pools_cells(pooled_server: LocalrtServer) -> None:
    """600 cells asked of a pool that could hold 2 x 512: llama.cpp's padding makes them 768 (the model
    reloads with them)."""
    assert generate(pooled_server, "smol", kv_pool=600).status_code == 200
    assert loaded(pooled_server)["smol:latest"]["details"]["kv_pool"] == 768


def test_a_kv_pool_under_one_context_holds_one_context(pooled_server: LocalrtServer) -> None:
    assert generate(pooled_server, "smol", kv_pool=100).status_code == 200
    assert loaded(pooled_server)["smol:latest"]["details"]["kv_pool"] == 512


def test_a_negative_kv_pool_is_refused(pooled_server: LocalrtServer) -> None:
    refused = generate(pooled_server, "smol", kv_pool=-1)
    assert (refused.status_code, "kv_pool" in refused.json()["error"]) == (400, True)


def test_the_ps_command_shows_the_pool(pooled_server: LocalrtServer) -> None:
    env = {**os.environ, "LOCALRT_HOST": pooled_server.url}
    out = subprocess.run(
        [sys.executable, "-m", "localrt", "ps"], env=env, capture_output=True, text=True, timeout=120
    )
    assert "512 x 2, pool 1024" in out.stdout, out.stderr


# ---- a real memory limit: the kernel's, not ours ---------------------------------------------------
@pytest.fixture
def cgroup() -> Iterator[Path]:
    if not os.access(CGROUP_MEMORY, os.W_OK):
        pytest.skip("no writable cgroup v1 memory controller here")
    group = CGROUP_MEMORY / f"localrt-test-{os.getpid()}"
    group.mkdir()
    try:
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            (CGROUP_MEMORY / "cgroup.procs").write_text(pid)
        group.rmdir()


def test_server_in_a_memory_cgroup_refuses_instead_of_being_killed(
    cgroup: Path, tmp_path: Path, smollm2_gguf: Path, gemma3_gguf: Path
) -> None:
    srv = serve(tmp_path, smollm2_gguf, gemma3_gguf)
    try:
        # charges start when the process moves in: room for the small model (about 140 MiB), not for
        # the larger one (about 330 MiB), whose load the kernel would answer by killing the server
        (cgroup / "memory.limit_in_bytes").write_text(str(220 << 20))
        (cgroup / "cgroup.procs").write_text(str(srv.proc.pid))
        refused = generate(srv, "gem")
        assert refused.status_code == 500, refused.text
        assert srv.alive()
        assert generate(srv, "smol").status_code == 200
    finally:
        srv.stop()


# ---- what the CLI shows ---------------------------------------------------------------------------
def run_estimate(tmp_path: Path, smollm2_gguf: Path, **env: str) -> subprocess.CompletedProcess[str]:
    import_gguf(Store(tmp_path / "models"), "smol", smollm2_gguf, params={"num_ctx": 512})
    return subprocess.run(
        [sys.executable, "-m", "localrt", "run", "smol", "--estimate"],
        capture_output=True,
        text=True,
        env={**os.environ, "LOCALRT_MODELS": str(tmp_path / "models"), "LOCALRT_NUM_PARALLEL": "2", **env},
        timeout=120,
    )


def test_run_estimate_prints_each_part(tmp_path: Path, smollm2_gguf: Path) -> None:
    out = run_estimate(tmp_path, smollm2_gguf).stdout
    assert [line.split()[0] for line in out.splitlines()[1:6]] == [
        "backend",
        "context",
        "weights",
        "kv",
        "buffers",
    ]


def test_run_estimate_gives_the_context_and_sequences(tmp_path: Path, smollm2_gguf: Path) -> None:
    out = run_estimate(tmp_path, smollm2_gguf).stdout
    assert "512 x 2 parallel" in out


def test_run_estimate_says_when_it_does_not_fit(tmp_path: Path, smollm2_gguf: Path) -> None:
    out = run_estimate(tmp_path, smollm2_gguf, LOCALRT_MAX_MEMORY="10MiB").stdout
    assert "does not fit" in out


def test_run_estimate_loads_nothing(tmp_path: Path, smollm2_gguf: Path) -> None:
    """No llama.cpp context is made: the estimate reads the header alone (llama.cpp would log it)."""
    out = run_estimate(tmp_path, smollm2_gguf)
    assert "llama_context" not in out.stderr


def test_bad_max_memory_is_one_line(tmp_path: Path, smollm2_gguf: Path) -> None:
    out = run_estimate(tmp_path, smollm2_gguf, LOCALRT_MAX_MEMORY="lots")
    assert out.stderr.strip().splitlines() == [
        "Error: LOCALRT_MAX_MEMORY must be a size such as 8GiB or 512MiB, not 'lots'"
    ]


# ---- GPU layers that fit (llama.cpp's n_gpu_layers for num_gpu -1) ---------------------------------
def block_bytes(gguf: Path) -> list[int]:
    """Each block's weight bytes, by gguf-py's reader (not ours)."""
    from gguf import GGUFReader

    sizes: dict[int, int] = {}
    for t in GGUFReader(gguf).tensors:
        if t.name.startswith("blk."):
            index = int(t.name.split(".")[1])
            sizes[index] = sizes.get(index, 0) + int(t.n_bytes)
    return [sizes[i] for i in sorted(sizes)]


GPU_OPTS = LoadOptions(num_ctx=512, num_parallel=1)


def test_no_gpu_room_gives_no_layers(smollm2_gguf: Path) -> None:
    assert gpu_layers(smollm2_gguf, GPU_OPTS, 0) == 0


def test_room_for_everything_gives_every_layer_and_the_output(smollm2_gguf: Path) -> None:
    n_blocks = len(block_bytes(smollm2_gguf))
    assert gpu_layers(smollm2_gguf, GPU_OPTS, 1 << 40) == n_blocks + 1


def test_more_room_never_gives_fewer_layers(smollm2_gguf: Path) -> None:
    total = llamacpp_estimate(smollm2_gguf, GPU_OPTS).total
    counts = [gpu_layers(smollm2_gguf, GPU_OPTS, total * k // 20) for k in range(21)]
    assert counts == sorted(counts)


def test_placed_layers_fit_and_one_more_would_not(smollm2_gguf: Path) -> None:
    """Half the room the whole model takes: the layers placed in it take no more than it, and the
    smallest room that places one more layer is larger than it (found by bisection over the room, so the
    test reads the placement, not the estimator's sums)."""
    room = llamacpp_estimate(smollm2_gguf, GPU_OPTS).total // 2
    n = gpu_layers(smollm2_gguf, GPU_OPTS, room)
    assert 0 < n < len(block_bytes(smollm2_gguf))
    assert llamacpp_estimate(smollm2_gguf, GPU_OPTS, room=room).gpu <= room
    low, high = room, 4 * room  # n layers at `low`, more than n at `high`
    assert gpu_layers(smollm2_gguf, GPU_OPTS, high) > n
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if gpu_layers(smollm2_gguf, GPU_OPTS, middle) == n else (low, middle)
    assert gpu_layers(smollm2_gguf, GPU_OPTS, high) == n + 1
    assert llamacpp_estimate(smollm2_gguf, GPU_OPTS, room=high).gpu > room


def test_gpu_room_is_each_gpus_free_memory_less_the_overhead() -> None:
    devices = [
        ComputeDevice("CPU", "cpu", "cpu", 1 << 34, 1 << 35),
        ComputeDevice("CUDA0", "gpu", "gpu", 8 << 30, 16 << 30),
        ComputeDevice("CUDA1", "gpu", "gpu", 4 << 30, 16 << 30),
    ]
    assert gpu_room(devices, 1 << 30) == (7 << 30) + (3 << 30)


def test_no_gpu_means_no_gpu_room() -> None:
    assert gpu_room([ComputeDevice("CPU", "cpu", "cpu", 1 << 34, 1 << 35)], 0) is None


def test_this_cpu_build_estimates_for_the_cpu(smollm2_gguf: Path) -> None:
    assert llamacpp_estimate(smollm2_gguf, GPU_OPTS).device == "CPU"


# ---- the GPU's part and the RAM's part of one estimate ------------------------------------------------
def test_no_gpu_room_leaves_everything_in_ram(smollm2_gguf: Path) -> None:
    assert llamacpp_estimate(smollm2_gguf, GPU_OPTS, room=0).gpu == 0


def test_every_layer_offloaded_leaves_less_than_the_file_in_ram(smollm2_gguf: Path) -> None:
    """Only the token embeddings (and what llama.cpp keeps on the host) stay in RAM."""
    est = llamacpp_estimate(smollm2_gguf, GPU_OPTS, room=1 << 40)
    assert est.ram < est.weights


def test_without_its_weights_a_fully_offloaded_load_puts_only_kv_and_buffers_on_the_gpu(
    smollm2_gguf: Path,
) -> None:
    """A load whose weights another loaded model already holds (one base file, other adapters)."""
    est = llamacpp_estimate(smollm2_gguf, GPU_OPTS, room=1 << 40).without_weights()
    assert est.gpu == est.kv + est.buffers


def test_without_its_weights_a_cpu_load_holds_its_kv_and_buffers(smollm2_gguf: Path) -> None:
    est = llamacpp_estimate(smollm2_gguf, GPU_OPTS, room=None).without_weights()
    assert est.ram == est.kv + est.buffers


def test_the_gpu_part_fits_the_room_it_was_sized_for(smollm2_gguf: Path) -> None:
    room = llamacpp_estimate(smollm2_gguf, GPU_OPTS, room=None).total // 2
    assert llamacpp_estimate(smollm2_gguf, GPU_OPTS, room=room).gpu <= room


def test_more_gpu_room_never_moves_more_into_ram(smollm2_gguf: Path) -> None:
    total = llamacpp_estimate(smollm2_gguf, GPU_OPTS, room=None).total
    rams = [llamacpp_estimate(smollm2_gguf, GPU_OPTS, room=total * k // 10).ram for k in range(11)]
    assert rams == sorted(rams, reverse=True)


def test_an_estimate_whose_gpu_part_overflows_the_gpus_does_not_fit() -> None:
    est = MemoryEstimate("llama.cpp", 8 << 30, 0, 0, 4096, 1, gpu=6 << 30, gpu_free=4 << 30)
    assert not est.fits(1 << 40)


def test_the_ram_check_counts_only_the_ram_part() -> None:
    est = MemoryEstimate("llama.cpp", 8 << 30, 0, 0, 4096, 1, gpu=6 << 30, gpu_free=8 << 30)
    assert est.fits(3 << 30)
