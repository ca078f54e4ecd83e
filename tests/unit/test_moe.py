"""The single-rank MoE block: dropless routing equals the token-by-token definition (values and gradients),
the scoring and shared-expert variants, bad configs refused, and the auxiliary loss lowering imbalance."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hal.parallel.models.moe import MoE, MoEConfig, attach_aux_loss, load_balancing_loss, z_loss

H = 16


def reference_moe(module: MoE, x: torch.Tensor) -> torch.Tensor:
    """The block computed token by token and choice by choice: the definition every fast path must match."""
    tokens = x.reshape(-1, x.shape[-1])
    experts, weights, _, _ = module.router(tokens)
    ffn, rows = module.experts.ffn, []
    for t in range(tokens.shape[0]):
        acc = torch.zeros_like(tokens[t])
        for j in range(module.config.top_k):
            e = int(experts[t, j])
            up = module.experts.gate_up[e]  # (2F, H): gate rows, then up rows
            h = F.silu(up[:ffn] @ tokens[t]) * (up[ffn:] @ tokens[t])
            acc = acc + weights[t, j] * (module.experts.down[e] @ h)
        rows.append(acc)
    out = torch.stack(rows)
    if module.shared is not None:
        out = out + module.shared(tokens)
    return out.view(x.shape)


def _pair(config: MoEConfig, seed: int = 0) -> tuple[MoE, torch.Tensor]:
    torch.manual_seed(seed)
    module = MoE(H, config).double()
    x = torch.randn(3, 7, H, dtype=torch.float64)
    return module, x


@pytest.mark.parametrize("config", [
    MoEConfig(num_experts=4, top_k=2, expert_ffn_size=12),
    MoEConfig(num_experts=8, top_k=2, expert_ffn_size=8, normalize_top_k=False),
    MoEConfig(num_experts=6, top_k=3, expert_ffn_size=8, scoring="sigmoid"),
    MoEConfig(num_experts=4, top_k=1, expert_ffn_size=8, shared_ffn_size=10, shared_gate=True),
    MoEConfig(num_experts=1, top_k=1, expert_ffn_size=8),
], ids=["mixtral-like", "unnormalised", "sigmoid-top3", "qwen2moe-shared-gated", "one-expert"])
def test_dropless_block_equals_the_token_by_token_definition(config: MoEConfig) -> None:
    module, x = _pair(config)
    out, stats = module(x)
    assert module.path == "loop"  # the cpu: grouped_mm is tried on cuda only
    assert int(stats.load.sum()) == x.shape[0] * x.shape[1] * config.top_k  # dropless: every pair was computed
    want = reference_moe(module, x)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    cot = torch.randn_like(out)
    grads = torch.autograd.grad(out, list(module.parameters()), cot, allow_unused=True)
    want_grads = torch.autograd.grad(want, list(module.parameters()), cot, allow_unused=True)
    for (name, _), g, w in zip(module.named_parameters(), grads, want_grads):
        if w is None:
            assert g is None or torch.count_nonzero(g) == 0, name
        else:
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


def test_an_expert_no_token_chose_is_skipped_and_gets_no_gradient() -> None:
    module, x = _pair(MoEConfig(num_experts=4, top_k=1, expert_ffn_size=8))
    with torch.no_grad():
        module.router.gate.weight.zero_()
        module.router.gate.weight[0] = 1.0  # every token prefers expert 0 for positive sums, expert 1.. never win
        module.router.gate.weight[3] = -50.0
    out, stats = module(x.abs())
    assert stats.load.tolist()[3] == 0
    out.sum().backward()
    assert module.experts.gate_up.grad[3].abs().sum() == 0
    torch.testing.assert_close(out, reference_moe(module, x.abs()))


@pytest.mark.parametrize("kwargs, words", [
    ({"num_experts": 4, "top_k": 5, "expert_ffn_size": 8}, "top_k 5 must be between 1 and num_experts (4)"),
    ({"num_experts": 0, "top_k": 1, "expert_ffn_size": 8}, "num_experts 0"),
    ({"num_experts": 4, "top_k": 2, "expert_ffn_size": 8, "scoring": "relu"}, "scoring 'relu'"),
    ({"num_experts": 4, "top_k": 2, "expert_ffn_size": 8, "shared_gate": True}, "shared_gate needs a shared expert"),
])
def test_bad_configs_are_one_line_each(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")) as err:
        MoEConfig(**kwargs)
    assert "\n" not in str(err.value)


def test_losses_at_their_known_points() -> None:
    E, T = 4, 8
    even = torch.full((T, E), 1 / E)
    assert float(load_balancing_loss(even, torch.arange(T) % E, E, T)) == pytest.approx(1.0)
    one_hot = torch.zeros(T, E)
    one_hot[:, 0] = 1.0
    assert float(load_balancing_loss(one_hot, torch.zeros(T, dtype=torch.long), E, T)) == pytest.approx(E)
    sigmoid_even = torch.full((T, E), 0.3)  # sigmoid scores need not sum to 1: compared as shares
    assert float(load_balancing_loss(sigmoid_even, torch.arange(T) % E, E, T, "sigmoid")) == pytest.approx(1.0)
    assert float(z_loss(torch.zeros(T, E))) == pytest.approx(torch.log(torch.tensor(float(E))).item() ** 2)


def test_the_auxiliary_loss_lowers_the_imbalance_of_a_skewed_input() -> None:
    """Inputs that share one direction send most tokens to one expert; training with the aux loss spreads them."""
    def train(aux_weight: float) -> tuple[float, float]:
        torch.manual_seed(0)
        module = MoE(H, MoEConfig(num_experts=4, top_k=1, expert_ffn_size=8, aux_loss_weight=aux_weight))
        with torch.no_grad():
            module.router.gate.weight[0] += 0.5  # expert 0 favoured by the shared direction below
        gen = torch.Generator().manual_seed(1)
        skew = torch.ones(H)
        opt = torch.optim.Adam(module.parameters(), lr=2e-2)
        first = None
        for _ in range(60):
            x = torch.randn(64, H, generator=gen) * 0.3 + skew
            out, stats = module(x)
            first = first if first is not None else stats.imbalance()
            loss = (out - x).pow(2).mean() + module.loss(stats)
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            _, stats = module(torch.randn(256, H, generator=gen) * 0.3 + skew)
        return first, stats.imbalance()

    start, without = train(0.0)
    _, with_aux = train(0.5)
    assert start > 3.0  # nearly everything on one expert of 4 at the start
    assert without > 3.0 and with_aux < 0.5 * without, (start, without, with_aux)  # measured: 4.0 → 4.0 vs 1.73


def test_an_aux_loss_attached_to_the_activations_gets_its_gradient_in_their_backward() -> None:
    """The pipeline's way: the stage's output carries the aux loss; the loss downstream never sees it, yet the
    router's gradient equals that of the LM loss + weight × aux loss summed explicitly."""
    config = MoEConfig(num_experts=4, top_k=2, expert_ffn_size=8, aux_loss_weight=0.1, z_loss_weight=0.01)
    module, x = _pair(config)
    out, stats = module(x)
    downstream = attach_aux_loss(out, module.loss(stats), 0.5)  # 0.5: one of two micro-batches
    torch.testing.assert_close(downstream, out)
    got = torch.autograd.grad((downstream.pow(2).sum()) * 0.5, list(module.parameters()))
    out2, stats2 = module(x)
    want = torch.autograd.grad((out2.pow(2).sum() + module.loss(stats2)) * 0.5, list(module.parameters()))
    assert module.router.gate.weight in list(module.parameters())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert float(module.loss(stats).detach()) > 0  # the aux terms are not zero: the test could fail


@pytest.mark.parametrize("moe", [
    {"moe_num_experts": 4, "moe_top_k": 2},
    {"moe_num_experts": 8, "moe_top_k": 1, "moe_every": 2, "moe_first_dense": 1, "moe_shared_ffn_size": 16,
     "moe_shared_gate": True, "moe_ffn_hidden_size": 24},
])
def test_parameter_counts_are_the_built_models_and_flops_count_the_active_experts(moe: dict) -> None:
    from hal.parallel.config.flops import flops_per_token, model_parameters
    from hal.parallel.config.model import ModelConfig
    from hal.parallel.models.stage import full_model

    config = ModelConfig(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                         max_seq_len=8, **moe)
    built = full_model(config, 0)
    assert model_parameters(config) == sum(p.numel() for p in built.parameters())
    experts = built.moe_blocks()
    idle = sum(b.experts.gate_up.numel() + b.experts.down.numel() for b in experts.values()) \
        * (1 - config.moe_top_k / config.moe_num_experts)
    assert model_parameters(config, active=True) == model_parameters(config) - round(idle)
    dense = ModelConfig(**{**config.to_dict(), "moe_num_experts": 0, "moe_shared_ffn_size": 0, "moe_shared_gate": False})
    assert flops_per_token(config, 8) != flops_per_token(dense, 8)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_activation_checkpointing_counts_each_forward_once_and_keeps_the_gradients(compiled: bool) -> None:
    """A checkpointed MoE layer's forward runs again in the backward (the recompute); what it routed is
    tallied once, and the gradients are the plain stage's — compiled too (the tally is in the layer's graph,
    the recompute a graph of its own)."""
    from hal.parallel.config.model import ModelConfig
    from hal.parallel.models.stage import build_stage
    from hal.parallel.pipeline.compile_stage import compile_layers, eager_first_forward

    config = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                         max_seq_len=8, moe_num_experts=4, moe_top_k=2)
    ids = torch.randint(0, 64, (3, 8), generator=torch.Generator().manual_seed(0))
    runs = {}
    for checkpoint in (False, True):
        stage = build_stage(config, range(0, 2), first=True, last=True, tp_comm=None, sp=False, seed=0,
                            checkpoint=checkpoint, dtype=torch.float64)
        if compiled and checkpoint:
            compile_layers(stage, "aot_eager")
            with eager_first_forward():  # as the engine: the first forward fills hal's op caches
                stage(ids)
            stage.take_moe_tally()
            stage.zero_grad(set_to_none=True)
        stage(ids).pow(2).mean().backward()
        runs[checkpoint] = ({n: p.grad.clone() for n, p in stage.named_parameters()}, stage.take_moe_tally())
    grads, tally = runs[True]
    for name, grad in runs[False][0].items():
        torch.testing.assert_close(grads[name], grad, msg=name)
    for layer, row in tally.items():
        assert sum(row["load"]) == 3 * 8 * 2, (layer, row)  # tokens × top-k, once
        assert row == runs[False][1][layer]


def test_expert_counts_are_bincount_with_a_static_shape() -> None:
    """The per-expert counts come from a scatter-add into E zeros (no host read, no data-dependent shape), equal to
    ``torch.bincount`` — experts nobody chose included."""
    from hal.parallel.models.moe import expert_counts

    chosen = torch.randint(0, 5, (200,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(expert_counts(chosen, 8), torch.bincount(chosen, minlength=8))
    assert expert_counts(chosen, 8)[5:].sum() == 0 and expert_counts(chosen[:0], 3).tolist() == [0, 0, 0]


def test_one_rule_says_where_compiled_experts_leave_the_graph() -> None:
    """compile_layers and hal train's preflight ask the same rule: only one rank's experts on CUDA with bf16 matmuls
    (or a dtype not known yet) stay in the compiled layer's graph."""
    from hal.parallel.models.moe import experts_outside_the_graph

    assert experts_outside_the_graph(1, "cuda", matmul=torch.bfloat16) == ""
    assert experts_outside_the_graph(1, "cuda") == ""  # decided, and said, at the first forward
    assert "bf16 only" in experts_outside_the_graph(1, "cuda", matmul=torch.float32)
    assert "exchange" in experts_outside_the_graph(2, "cuda", matmul=torch.bfloat16)
    assert "loop on cpu" in experts_outside_the_graph(1, "cpu")
    assert "loop on cuda" in experts_outside_the_graph(1, "cuda", grouped=False)


def test_a_stage_moved_by_swapping_tensors_keeps_its_parameters_meta() -> None:
    """``Module.to`` swaps whole parameter objects (their ``__dict__`` with them) for tensor subclasses — the vendor
    stand-ins' devices — or under torch.__future__'s swap flag; the experts' and shards' ``hal_meta`` must survive,
    or expert shards are summed over dp as if every rank held the same experts (found on the ascend stand-in)."""
    from hal.parallel.config.model import ModelConfig
    from hal.parallel.models.layers import param_meta
    from hal.parallel.models.stage import build_stage

    config = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                         max_seq_len=8, moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16, moe_first_dense=1)
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        stage = build_stage(config, range(0, 2), first=True, last=True, tp_comm=None, sp=False, seed=0,
                            dtype=torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    metas = {n: param_meta(p) for n, p in stage.named_parameters()}
    assert all(p.dtype == torch.float64 for p in stage.parameters())
    assert metas["layers.1.mlp.experts.gate_up"] is not None and metas["layers.1.mlp.experts.down"] is not None, metas
