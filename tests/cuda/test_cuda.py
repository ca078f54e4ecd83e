"""CUDA-marked tests: run on an NVIDIA machine (``pytest -m cuda``); skipped where no GPU is visible."""
from __future__ import annotations

import json

import pytest
import torch

from hal import get_backend, ops
from hal.capabilities import DtypeSupport
from hal.precision import resolve_precision

from ..conftest import has_cuda, run_hal

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not has_cuda(), reason="no NVIDIA GPU visible")]

CUDA = get_backend("cuda")


def test_devices_reports_model_memory_and_native_dtypes() -> None:
    result = run_hal("devices", "--json")
    assert result.returncode == 0, result.stderr
    cuda = next(b for b in json.loads(result.stdout)["backends"] if b["name"] == "cuda")
    assert cuda["available"] and cuda["device_count"] >= 1
    device = cuda["devices"][0]
    assert device["memory_total_bytes"] > 10 * 2**30
    assert device["dtypes"]["bf16"] == "native"
    if "H100" in device["name"] or "H200" in device["name"]:
        assert device["catalog_id"].startswith(("nvidia-h100", "nvidia-h200"))
        assert device["dtypes"]["fp8_e4m3"] == "native" and device["dtypes"]["tf32"] == "native"
    assert json.loads(run_hal("devices", "--json").stdout)["auto"]["backend"] == "cuda"


def test_streams_events_and_synchronize() -> None:
    stream = CUDA.Stream()
    start, end = CUDA.Event(enable_timing=True), CUDA.Event(enable_timing=True)
    a = torch.randn(2048, 2048, device=CUDA.device(0))
    with CUDA.stream(stream):
        start.record()
        b = a @ a
        end.record()
    CUDA.synchronize()
    assert start.elapsed_time(end) > 0 and torch.isfinite(b).all()


def test_memory_statistics_follow_allocations() -> None:
    CUDA.empty_cache()
    CUDA.reset_peak_memory_stats()
    before = CUDA.memory_allocated()
    block = torch.empty(256 * 2**20, dtype=torch.uint8, device=CUDA.device(0))
    assert CUDA.memory_allocated() - before >= 256 * 2**20
    assert CUDA.max_memory_allocated() >= CUDA.memory_allocated()
    assert CUDA.memory_reserved() >= CUDA.memory_allocated()
    del block
    free, total = CUDA.mem_get_info()
    assert 0 < free <= total


def test_rng_state_round_trip() -> None:
    CUDA.manual_seed_all(7)
    state = CUDA.get_rng_state()
    first = torch.rand(4, device=CUDA.device(0))
    CUDA.set_rng_state(state)
    assert torch.equal(first, torch.rand(4, device=CUDA.device(0)))


def test_tf32_switch_really_changes_results() -> None:
    if not CUDA.capabilities().is_native("tf32"):
        pytest.skip("no TF32 on this GPU")
    a = torch.randn(1024, 1024, device=CUDA.device(0))
    exact = (a.double() @ a.double())
    try:
        CUDA.set_reduced_precision_matmul(False)
        err_fp32 = ((a @ a).double() - exact).abs().max().item()
        CUDA.set_reduced_precision_matmul(True)
        assert CUDA.reduced_precision_matmul_enabled()
        err_tf32 = ((a @ a).double() - exact).abs().max().item()
    finally:
        CUDA.set_reduced_precision_matmul(False)
    assert err_tf32 > 10 * err_fp32


def test_deterministic_mode_gives_bitwise_equal_runs() -> None:
    try:
        CUDA.set_deterministic(True)
        x = torch.randn(4096, 512, device=CUDA.device(0))
        index = torch.randint(0, 64, (4096,), device=CUDA.device(0))
        runs = [torch.zeros(64, 512, device=CUDA.device(0)).index_add_(0, index, x) for _ in range(3)]
    finally:
        CUDA.set_deterministic(False)
    assert all(torch.equal(runs[0], r) for r in runs[1:])


def test_precision_policy_on_the_real_device() -> None:
    caps = CUDA.capabilities()
    plan = resolve_precision("bf16-mixed", CUDA, caps, "error")
    assert plan.autocast_dtype is torch.bfloat16 and not plan.downgrades
    x = torch.randn(64, 64, device=CUDA.device(0))
    with plan.autocast(CUDA):
        assert (x @ x).dtype is torch.bfloat16
    if caps.support("fp8_e4m3") is DtypeSupport.NATIVE:
        assert resolve_precision("fp8-mixed", CUDA, caps, "error").fp8_dtype is torch.float8_e4m3fn


def test_fp8_scaled_linear_is_close_to_fp64() -> None:
    if not CUDA.capabilities().is_native("fp8_e4m3"):
        pytest.skip("no fp8 on this GPU")
    from hal.precision.fp8 import scaled_linear

    x = torch.randn(256, 512, device=CUDA.device(0), dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(384, 512, device=CUDA.device(0), dtype=torch.bfloat16, requires_grad=True)
    y = scaled_linear(x, w)
    ref = x.double() @ w.double().t()
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    assert rel < 0.08, rel  # e4m3 has a 3-bit mantissa: a few percent relative error is expected
    y.float().sum().backward()
    assert x.grad is not None and w.grad is not None


def test_ops_dispatch_on_cuda_tensors() -> None:
    x = torch.randn(8, 64, device=CUDA.device(0), dtype=torch.bfloat16)
    w = torch.ones(64, device=CUDA.device(0), dtype=torch.bfloat16)
    y = ops.rms_norm(x, w)
    assert y.device.type == "cuda" and y.dtype is torch.bfloat16
    torch.testing.assert_close(y.float().cpu(), ops.rms_norm(x.float().cpu(), w.float().cpu()), rtol=2e-2, atol=2e-2)


def test_example_script_runs_under_hal_run_cuda() -> None:
    result = run_hal("run", "--backend", "cuda", "examples/cuda_train.py", "--steps", "5", "--amp", timeout=300)
    assert result.returncode == 0, result.stderr
    losses = [json.loads(line)["loss"] for line in result.stdout.splitlines() if line.startswith('{"step"')]
    assert len(losses) == 5 and all(loss == loss for loss in losses)


def test_moe_grouped_experts_take_device_offsets_and_equal_the_loop() -> None:
    """bf16 MoE block on one GPU: the grouped matmul (offsets on the device, no host read) gives the loop's outputs
    and gradients, an expert no token chose included."""
    from hal.parallel.config.model import MoEConfig
    from hal.parallel.models.moe import MoE

    config = MoEConfig(num_experts=8, top_k=2, expert_ffn_size=64)
    outs = {}
    for grouped in (True, False):
        torch.manual_seed(0)
        block = MoE(128, config, grouped=grouped).to(CUDA.device(0), torch.bfloat16)
        with torch.no_grad():
            block.router.gate.weight[7] = -10.0  # with positive inputs expert 7 is never chosen: an empty block
        x = (torch.rand(4, 96, 128, device=CUDA.device(0)) + 0.1).to(torch.bfloat16).requires_grad_()
        out, stats = block(x)
        out.float().pow(2).sum().backward()
        outs[grouped] = (block.path, out.detach().float(), x.grad.float(), block.experts.gate_up.grad.float(), stats.load)
    assert outs[True][0] == "grouped_mm" and outs[False][0] == "loop"
    assert int(outs[True][4][7]) == 0
    for got, want in zip(outs[True][1:4], outs[False][1:4]):
        assert float((got - want).norm() / want.norm()) < 2e-2


def test_the_profiles_fused_head_holds_the_weight_gradient_and_no_logits() -> None:
    """``hal profile``'s fused head on a GPU under bf16 autocast: the Triton linear-CE forms the weight's gradient in
    its forward (vocab x hidden in bf16, held each micro-batch whatever its tokens) and keeps no logits (a few hidden
    rows a token), unlike the plain head's 7 bytes a vocabulary entry (1 x H200, 2026-11-29: exactly 128256 x 2048 x 2
    and 6 x hidden bytes a token)."""
    from hal.parallel.config.model import ModelConfig
    from hal.parallel.planner.measure import _ends, _fused_head

    model = ModelConfig(vocab_size=32000, hidden_size=1024, num_layers=1, num_heads=8, num_kv_heads=4,
                        ffn_hidden_size=2816, max_seq_len=512)
    device = CUDA.device(0)

    def autocast():
        return CUDA.autocast(torch.bfloat16)

    fused = _fused_head(CUDA, model, device, 512, (1, 2), autocast, repeats=2)
    _, plain = _ends(CUDA, model, device, 512, 2, autocast, repeats=2)
    assert fused.fixed_bytes == pytest.approx(model.vocab_size * model.hidden_size * 2, rel=0.01)
    assert fused.activation_bytes < 16 * model.hidden_size < plain.activation_bytes
    assert plain.activation_bytes > 4 * model.vocab_size  # the plain head saves its logits


_FIRST_BACKWARD = """
import warnings, torch
from hal import get_backend
from hal.collectives.process_groups import device_for_rank
backend = get_backend("cuda")
device = device_for_rank(backend) if {prepared} else torch.device("cuda", 0)
if not {prepared}:
    backend.set_device(0)
lin = torch.nn.Linear(64, 64, device=device)
x = torch.randn(4, 64, device=device, requires_grad=True)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    y = lin(x)
    y.backward(torch.ones_like(y))  # the backward's first node is a matmul
    backend.synchronize()
print(sum("no current CUDA context" in str(w.message) for w in seen))
"""


@pytest.mark.parametrize("prepared", [True, False], ids=["a rank's device", "set_device alone"])
def test_a_ranks_first_backward_starting_with_a_matmul_warns_of_no_context_only_unprepared(prepared: bool) -> None:
    """A process that takes device 0 through ``device_for_rank`` readies autograd's thread for it
    (``prepare_autograd``); without that, torch 2.11 warns once that cuBLAS found no current CUDA context (the
    control: it shows the check can see the warning)."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FIRST_BACKWARD.format(prepared=prepared)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "LOCAL_RANK": "0"})
    assert done.returncode == 0, done.stderr[-2000:]
    warned = int(done.stdout.strip().splitlines()[-1])
    assert warned == (0 if prepared else 1), (prepared, done.stdout, done.stderr[-1000:])
