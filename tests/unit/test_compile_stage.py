"""Compiled stages (``compile: true``): each decoder layer through torch.compile, the first forward eager
to fill hal's op caches, then no graph break and the same losses and gradients as the eager stage."""
from __future__ import annotations

import pytest
import torch

from hal.errors import ConfigError
from hal.parallel.config.model import ModelConfig
from hal.parallel.config.plan import ParallelPlan, parse_plan
from hal.parallel.config.topology import Topology
from hal.parallel.models.loss import token_sum_cross_entropy
from hal.parallel.models.stage import full_model
from hal.parallel.pipeline.compile_stage import compile_layers, eager_first_forward

from ..conftest import has_cuda

MODEL = ModelConfig(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, ffn_hidden_size=48, max_seq_len=16)


def _steps(stage: torch.nn.Module, batches: list[torch.Tensor], warm: bool) -> tuple[list[float], list[torch.Tensor]]:
    device = next(stage.parameters()).device
    batches = [b.to(device) for b in batches]
    loss_fn = token_sum_cross_entropy(None)
    losses = []
    for i, batch in enumerate(batches):
        context = eager_first_forward() if warm and i == 0 else torch.enable_grad()
        with context:
            logits = stage(batch[:, :-1])
        loss = loss_fn(logits, batch[:, 1:])
        loss.backward()
        losses.append(float(loss))
    return losses, [p.grad.clone() for p in stage.parameters()]


def _compiled_matches_eager(backend: str, device: str, rel: float, grad_rtol: float, grad_atol: float) -> None:
    _compiled_matches_eager_for(MODEL, backend, device, rel, grad_rtol, grad_atol)


def _compiled_matches_eager_for(model: ModelConfig, backend: str, device: str, rel: float, grad_rtol: float,
                                grad_atol: float, eager_parts: tuple[str, ...] = (),
                                dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Eager and compiled copies of one model, 3 steps each: real graphs, the same numbers, and no graph break but
    at the functions named in ``eager_parts`` (run eagerly inside a compiled layer on purpose). Returns the breaks
    by function name. In bf16 (fused kernels round differently) each gradient is compared by its relative error
    norm, at most ``grad_rtol``."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    batches = [torch.randint(0, model.vocab_size, (2, 17)) for _ in range(3)]
    eager = full_model(model, seed=3).to(device, dtype)
    compiled = full_model(model, seed=3).to(device, dtype)
    compile_layers(compiled, backend)
    torch._dynamo.reset()
    counters.clear()
    want_losses, want_grads = _steps(eager, batches, warm=False)
    got_losses, got_grads = _steps(compiled, batches, warm=True)
    breaks: dict[str, int] = {}
    for reason, count in counters["graph_break"].items():
        named = [part for part in eager_parts if f"{part} at 0x" in reason]
        assert named, f"an unexpected graph break: {reason}"
        breaks[named[0]] = breaks.get(named[0], 0) + count
    assert counters["stats"]["unique_graphs"] >= 1  # the layers really were compiled (after the eager first forward)
    assert got_losses == pytest.approx(want_losses, rel=rel, abs=rel)
    for got, want in zip(got_grads, want_grads):
        if dtype == torch.bfloat16:
            assert float((got - want).float().norm() / want.float().norm().clamp_min(1e-12)) <= grad_rtol
        else:
            torch.testing.assert_close(got, want, rtol=grad_rtol, atol=grad_atol)
    return breaks


def test_compiled_layers_match_eager_with_no_graph_break() -> None:
    _compiled_matches_eager("aot_eager", "cpu", rel=1e-6, grad_rtol=1e-5, grad_atol=1e-6)


def _split_steps(stage: torch.nn.Module, batches: list[torch.Tensor], compiled: bool) -> tuple[list[float], list[torch.Tensor], list[int]]:
    """As ``_steps`` with the zero-bubble split: forwards under ``splittable``, each backward the I half with the
    weight gradients deferred into a store, then the W half running it. Returns the deferred counts too."""
    from hal.parallel.models.weight_grad import WeightGradStore, collecting, splittable

    loss_fn = token_sum_cross_entropy(None)
    losses, deferred = [], []
    for i, batch in enumerate(batches):
        context = eager_first_forward() if compiled and i == 0 else torch.enable_grad()
        with context, splittable(True):
            logits = stage(batch[:, :-1])
        loss = loss_fn(logits, batch[:, 1:])
        store = WeightGradStore()
        with collecting(store):
            loss.backward()
        deferred.append(len(store))
        store.run()
        losses.append(float(loss.detach()))
    return losses, [p.grad.clone() for p in stage.parameters()], deferred


def _compiled_split_matches_eager(backend: str, device: str, rel: float, grad_rtol: float, grad_atol: float) -> None:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    batches = [torch.randint(0, MODEL.vocab_size, (2, 17)).to(device) for _ in range(3)]
    eager, compiled = full_model(MODEL, seed=3).to(device), full_model(MODEL, seed=3).to(device)
    compile_layers(compiled, backend)
    torch._dynamo.reset()
    counters.clear()
    want_losses, want_grads = _steps(eager, batches, warm=False)
    got_losses, got_grads, deferred = _split_steps(compiled, batches, compiled=True)
    linears = 4 * MODEL.num_layers + 1  # qkv, out, gate_up and down of every layer, and the head
    assert deferred == [linears] * 3
    assert counters["stats"]["unique_graphs"] >= 1
    assert counters["graph_break"] and all("_apply_split_linear" in r for r in counters["graph_break"])
    assert got_losses == pytest.approx(want_losses, rel=rel, abs=rel)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=grad_rtol, atol=grad_atol)


def test_a_compiled_layer_defers_its_weight_gradients_under_the_split_backward() -> None:
    """The zero-bubble schedules on compiled layers: every linear runs eagerly between the layer's graphs (the only
    graph breaks), so its weight gradient really waits for W — traced, it would be baked into the backward graph
    with no store — and the numbers are the eager stage's whole backward."""
    _compiled_split_matches_eager("aot_eager", "cpu", rel=1e-6, grad_rtol=1e-5, grad_atol=1e-6)


@pytest.mark.cuda
@pytest.mark.multiprocess  # inductor starts ptxas
@pytest.mark.skipif(not has_cuda(), reason="needs an NVIDIA GPU")
def test_on_a_gpu_inductor_compiled_layers_defer_their_weight_gradients() -> None:
    _compiled_split_matches_eager("inductor", "cuda", rel=1e-4, grad_rtol=1e-3, grad_atol=1e-5)


MOE = ModelConfig(**{**MODEL.to_dict(), "moe_num_experts": 4, "moe_top_k": 2, "moe_first_dense": 1, "moe_shared_ffn_size": 16})


def test_moe_layers_compile_whole_with_the_experts_loop_eager_visibly() -> None:
    """An MoE model compiled on the cpu: each MoE layer is one compiled module; the experts' loop (it reads the
    block sizes on the host) and the routing tally run eagerly between its graphs — the only graph breaks — with
    the eager stage's losses and gradients and the loop recorded as a downgrade."""
    from hal.downgrades import clear_downgrades, fallback_policy, recorded_downgrades

    clear_downgrades()
    with fallback_policy("allow"):
        breaks = _compiled_matches_eager_for(MOE, "aot_eager", "cpu", rel=1e-6, grad_rtol=1e-5, grad_atol=1e-6,
                                             eager_parts=("_loop_experts",))
    assert set(breaks) == {"_loop_experts"}
    seen = [d for d in recorded_downgrades() if d.subject.startswith("compile of MoE layers")]
    assert [d.subject for d in seen] == ["compile of MoE layers [1, 2]"] and "loop on cpu" in seen[0].reason


@pytest.mark.cuda
@pytest.mark.multiprocess  # inductor starts ptxas
@pytest.mark.skipif(not has_cuda(), reason="needs an NVIDIA GPU")
def test_on_a_gpu_inductor_compiled_layers_with_the_triton_kernels_match_eager() -> None:
    """The GPU path: inductor, the registry's Triton kernels (traced into where they are triton ops), fp32;
    no graph break, and the losses and gradients of the eager stage."""
    from hal import ops

    assert ops.registry.choose("rms_norm", "cuda", torch.float32).impl.name == "triton"
    _compiled_matches_eager("inductor", "cuda", rel=1e-4, grad_rtol=1e-3, grad_atol=1e-5)


def test_plan_compile_is_global_with_a_per_stage_override() -> None:
    raw = {"compile": True, "compile_backend": "aot_eager",
           "stages": [{"backend": "cpu", "devices": 1, "layers": 2}, {"backend": "cpu", "devices": 1, "layers": 1, "compile": False}]}
    plan = parse_plan(raw)
    assert [plan.stage_compiles(k) for k in range(2)] == [True, False]
    topology = Topology.from_plan(plan)
    assert [(m.compile, m.compile_backend) for m in topology.stages] == [(True, "aot_eager"), (False, "aot_eager")]
    assert ParallelPlan.from_dict(plan.to_dict()) == plan
    assert not parse_plan({"stages": [{"backend": "cpu", "devices": 1, "layers": 1}]}).stage_compiles(0)
    with pytest.raises(ConfigError, match="compile_backend"):
        parse_plan({**raw, "compile_backend": "tvm"})
    with pytest.raises(ConfigError, match="true or false"):
        parse_plan({"stages": [{"backend": "cpu", "devices": 1, "layers": 1, "compile": "yes"}]})


@pytest.mark.cuda
@pytest.mark.multiprocess  # inductor starts ptxas
@pytest.mark.skipif(not has_cuda(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_on_a_gpu_inductor_compiles_the_moe_experts_into_the_layer(dtype: torch.dtype) -> None:
    """The MoE compile path on a GPU, with the eager stage's losses and gradients. In bf16 the grouped matmul takes
    the experts' offsets on the device, so the experts are in the layer's graph: no graph break at all, no
    downgrade. In fp32 (which torch 2.11's traced grouped matmul refuses) the experts' loop runs eagerly between
    the layer's graphs, recorded as a downgrade."""
    from hal.downgrades import clear_downgrades, fallback_policy, recorded_downgrades
    from hal.parallel.models.moe import grouped_mm_traces

    clear_downgrades()
    bf16 = dtype == torch.bfloat16
    with fallback_policy("allow"):
        breaks = _compiled_matches_eager_for(MOE, "inductor", "cuda", rel=2e-2 if bf16 else 1e-4,
                                             grad_rtol=3e-2 if bf16 else 1e-3, grad_atol=1e-5,
                                             eager_parts=("_loop_experts",), dtype=dtype)
    partial = [d for d in recorded_downgrades() if d.subject.startswith("compile of MoE")]
    if grouped_mm_traces(torch.device("cuda"), dtype):
        assert not breaks and not partial
    else:
        assert set(breaks) == {"_loop_experts"} and partial


def test_a_compiled_layer_reads_the_rotary_tables_instead_of_tracing_them() -> None:
    """Llama 3 rope scaling, compiled: the traced graphs hold no float64 host math (the tables come from the eager
    first forward, kept on the attention module), Dynamo warns of no lru_cache, and the numbers are the eager ones."""
    import warnings

    from torch._dynamo.utils import counters

    scaled = ModelConfig(**{**MODEL.to_dict(), "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8}})
    graphs: list[torch.fx.GraphModule] = []

    def recording(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    batches = [torch.randint(0, scaled.vocab_size, (2, 17)) for _ in range(2)]
    eager, compiled = full_model(scaled, seed=3), full_model(scaled, seed=3)
    compile_layers(compiled, recording)  # type: ignore[arg-type]
    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got, _ = _steps(compiled, batches, warm=True)
    want, _ = _steps(eager, batches, warm=False)
    assert graphs and sum(counters["graph_break"].values()) == 0
    code = "\n".join(g.code for g in graphs)
    assert "float64" not in code and "arange" not in code, code
    assert not [w for w in seen if "lru_cache" in str(w.message)]
    assert got == pytest.approx(want, rel=1e-6, abs=1e-6)
    buffers = dict(compiled.named_buffers())
    assert "layers.0.attn.rope_cos" in buffers and "layers.0.attn.rope_cos" not in compiled.state_dict()
