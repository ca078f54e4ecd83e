"""The CPU backend does real work behind every contract method."""
from __future__ import annotations

import time

import pytest
import torch

from hal import get_backend
from hal.errors import UnsupportedError

CPU = get_backend("cpu")


def test_identity_and_device() -> None:
    assert CPU.is_available() and CPU.device_count() == 1
    assert CPU.device() == torch.device("cpu")
    with pytest.raises(UnsupportedError, match="one device"):
        CPU.set_device(1)


def test_events_measure_elapsed_time() -> None:
    start, end = CPU.Event(enable_timing=True), CPU.Event(enable_timing=True)
    start.record()
    time.sleep(0.05)
    end.record()
    end.synchronize()
    assert 40 <= start.elapsed_time(end) <= 2000
    with pytest.raises(RuntimeError, match="enable_timing"):
        CPU.Event().elapsed_time(CPU.Event())


def test_stream_context() -> None:
    stream = CPU.Stream()
    with CPU.stream(stream):
        assert CPU.current_stream() is not None


def test_peak_memory_tracks_and_resets() -> None:
    CPU.reset_peak_memory_stats()
    before = CPU.max_memory_allocated()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    peak = CPU.max_memory_allocated()
    assert peak - before >= 60 * 2**20
    del block
    CPU.reset_peak_memory_stats()
    assert CPU.max_memory_allocated() < peak
    free, total = CPU.mem_get_info()
    assert 0 < free <= total == CPU.total_memory()


def test_rng_state_round_trip() -> None:
    CPU.manual_seed(1234)
    first = torch.rand(5)
    state = CPU.get_rng_state()
    second = torch.rand(5)
    CPU.set_rng_state(state)
    assert torch.equal(torch.rand(5), second)
    CPU.manual_seed_all(1234)
    assert torch.equal(torch.rand(5), first)


def test_reduced_precision_matmul_is_refused_not_ignored() -> None:
    CPU.set_reduced_precision_matmul(False)
    assert not CPU.reduced_precision_matmul_enabled()
    with pytest.raises(UnsupportedError, match="no TF32/HF32"):
        CPU.set_reduced_precision_matmul(True)


def test_deterministic_switch() -> None:
    try:
        CPU.set_deterministic(True)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        CPU.set_deterministic(False)
    assert not torch.are_deterministic_algorithms_enabled()


def test_autocast_and_scaler_use_explicit_dtypes() -> None:
    a = torch.randn(4, 4)
    with CPU.autocast(torch.float16):
        assert (a @ a).dtype is torch.float16
    scaler = CPU.grad_scaler(init_scale=8.0)
    assert scaler.is_enabled() and scaler.get_scale() == 8.0


def test_capabilities_merge_probe_and_catalog() -> None:
    caps = CPU.capabilities()
    assert caps.catalog_id == "cpu-generic"
    assert caps.is_native("fp32") and caps.is_native("fp64")
    assert caps.memory_bytes and caps.memory_bytes > 2**30
    assert caps.sources["memory"].startswith("probed")
