"""A GPU machine running a CPU-only llama.cpp build says so: `localrt serve` logs the compute devices the
build registered, and one line on how to reinstall when an NVIDIA or AMD GPU is present but unused."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from localrt.backends.devices import ComputeDevice
from localrt.backends.devices import build_offloads
from localrt.backends.devices import compute_devices
from localrt.backends.devices import gpu_vendors_present
from localrt.backends.devices import reinstall_hint
from tests.servers.serve import LocalrtServer

CPU = ComputeDevice("CPU", "AMD EPYC", "cpu")
CUDA = ComputeDevice("CUDA0", "NVIDIA H100", "gpu")


def test_a_cpu_build_on_an_nvidia_machine_says_how_to_reinstall() -> None:
    hint = reinstall_hint(["NVIDIA"], offloads=False)
    assert hint is not None
    assert 'CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall' in hint


def test_a_cpu_build_on_an_amd_machine_names_hip() -> None:
    hint = reinstall_hint(["AMD"], offloads=False)
    assert hint is not None
    assert 'CMAKE_ARGS="-DGGML_HIP=on"' in hint


def test_no_hint_without_a_gpu_or_with_a_gpu_build() -> None:
    assert reinstall_hint([], offloads=False) is None
    assert reinstall_hint(["NVIDIA"], offloads=True) is None


def test_a_gpu_device_in_the_registry_means_offload() -> None:
    assert build_offloads([CPU, CUDA])
    assert not build_offloads([CPU])


def test_vendors_come_from_driver_tools_and_device_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir, dev = tmp_path / "bin", tmp_path / "dev"
    bin_dir.mkdir()
    dev.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    assert gpu_vendors_present(dev) == []
    (dev / "kfd").touch()  # ROCm's compute node
    assert gpu_vendors_present(dev) == ["AMD"]
    tool = bin_dir / "nvidia-smi"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    assert gpu_vendors_present(dev) == ["NVIDIA", "AMD"]


def test_the_installed_build_lists_a_cpu_device() -> None:
    pytest.importorskip("llama_cpp")
    devices = compute_devices()
    assert devices is not None
    assert any(d.kind == "cpu" for d in devices)


def test_serve_logs_the_compute_devices(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    server = LocalrtServer(tmp_path / "models", tmp_path / "serve.log")
    server.stop()
    log = (tmp_path / "serve.log").read_text(errors="replace")
    assert "llama.cpp compute devices: CPU" in log
