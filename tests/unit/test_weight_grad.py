"""The split backward of the zero-bubble schedules: input gradients now, the linear layers' weight gradients later."""
from __future__ import annotations

import torch

from hal.parallel.models.weight_grad import WeightGradStore, collecting, split_linear, splittable


def _leaves(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.nn.Parameter, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=g, dtype=dtype, requires_grad=True)
    w1 = torch.nn.Parameter(torch.randn(6, 8, generator=g, dtype=dtype))
    w2 = torch.nn.Parameter(torch.randn(4, 6, generator=g, dtype=dtype))
    return x, w1, w2


def _two_layers(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return split_linear(torch.tanh(split_linear(x, w1)), w2).square().sum()


def test_deferred_weight_gradients_equal_the_plain_backward() -> None:
    x, w1, w2 = _leaves()
    _two_layers(x, w1, w2).backward()
    want = [t.grad.clone() for t in (x, w1, w2)]
    x, w1, w2 = _leaves()
    with splittable():
        loss = _two_layers(x, w1, w2)
    store = WeightGradStore()
    with collecting(store):
        loss.backward()
    assert len(store) == 2 and w1.grad is None and w2.grad is None  # I: only the input gradient
    torch.testing.assert_close(x.grad, want[0])
    store.run()  # W
    assert len(store) == 0
    torch.testing.assert_close(w1.grad, want[1])
    torch.testing.assert_close(w2.grad, want[2])


def test_a_split_linear_outside_a_collecting_store_computes_both_gradients_and_accumulates() -> None:
    x, w1, w2 = _leaves()
    with splittable():
        loss = _two_layers(x, w1, w2)
    loss.backward()  # no store: an ordinary backward
    first = w1.grad.clone()
    with splittable():
        loss = _two_layers(x, w1, w2)
    store = WeightGradStore()
    with collecting(store):
        loss.backward()
    store.run()
    torch.testing.assert_close(w1.grad, 2 * first)  # a deferred gradient adds to what .grad held


def test_under_autocast_the_weight_gradient_keeps_the_parameter_dtype() -> None:
    x, w1, w2 = _leaves(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = split_linear(x, w1)
        with splittable():
            split = split_linear(x, w1)
    assert split.dtype == plain.dtype == torch.bfloat16
    store = WeightGradStore()
    with collecting(store):
        split.float().sum().backward()
    store.run()
    assert w1.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    torch.testing.assert_close(w1.grad, x.detach().reshape(-1, 8).sum(0).expand(6, 8), rtol=2e-2, atol=2e-2)


def test_a_bias_gradient_is_deferred_with_its_weight_and_equals_autograds() -> None:
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(3, 5, 8, generator=g, dtype=torch.float64)
    w0, b0 = torch.randn(6, 8, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)
    upstream = torch.randn(3, 5, 6, generator=g, dtype=torch.float64)

    def leaves() -> tuple[torch.Tensor, torch.nn.Parameter, torch.nn.Parameter]:
        return x0.clone().requires_grad_(), torch.nn.Parameter(w0.clone()), torch.nn.Parameter(b0.clone())

    x, w, b = leaves()
    (torch.nn.functional.linear(x, w, b) * upstream).sum().backward()  # autograd's own linear
    want = [t.grad.clone() for t in (x, w, b)]
    torch.testing.assert_close(want[2], upstream.sum(dim=(0, 1)))

    x, w, b = leaves()
    with splittable():
        out = split_linear(x, w, b)
    store = WeightGradStore()
    with collecting(store):
        (out * upstream).sum().backward()
    assert len(store) == 1 and w.grad is None and b.grad is None  # I: the input gradient only
    torch.testing.assert_close(x.grad, want[0])
    store.run()  # W: weight and bias together
    torch.testing.assert_close(w.grad, want[1])
    torch.testing.assert_close(b.grad, want[2])

    x, w, b = leaves()
    with splittable():
        (split_linear(x, w, b) * upstream).sum().backward()  # no store: both at once
    for got, ref in zip((x.grad, w.grad, b.grad), want):
        torch.testing.assert_close(got, ref)


def test_a_qkv_bias_model_split_backward_equals_the_plain_one() -> None:
    """The decoder with Qwen2's qkv bias: every gradient, bias included, the same through the zero-bubble split."""
    from hal.parallel.config.model import ModelConfig
    from hal.parallel.models.layers import vocab_parallel_cross_entropy
    from hal.parallel.models.stage import full_model

    config = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                         max_seq_len=8, qkv_bias=True)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    grads = []
    for split in (False, True):
        model = full_model(config, 0)
        assert torch.equal(model.layers["0"].attn.qkv.bias, torch.zeros(32 + 2 * 16))  # deterministic init: zeros
        with splittable(split):
            loss = vocab_parallel_cross_entropy(model(ids[:, :-1]), ids[:, 1:], None)
        store = WeightGradStore()
        with collecting(store):
            loss.backward()
        assert (len(store) > 0) == split
        store.run()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert "layers.1.attn.qkv.bias" in grads[0] and grads[0]["layers.1.attn.qkv.bias"].abs().sum() > 0
    for name, ref in grads[0].items():
        torch.testing.assert_close(grads[1][name], ref, msg=name)


def test_a_checkpointed_stage_recomputes_the_split_linears_and_defers_their_weight_gradients() -> None:
    """Activation checkpointing under a zero-bubble schedule: the recompute in the backward runs outside the forward's
    ``splittable``, so it must build the split linears again (``decoder._Replayed``); else torch's checkpoint refuses
    the recomputed tensors, and the weight gradients are no longer deferred."""
    from hal.parallel.config.model import ModelConfig
    from hal.parallel.models.stage import build_stage

    model = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                        max_seq_len=16)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    deferred, grads = {}, {}
    for checkpoint in (False, True):
        stage = build_stage(model, range(2), first=False, last=False, tp_comm=None, sp=False, seed=0, checkpoint=checkpoint)
        with splittable():
            out = stage(x.clone().requires_grad_(True))
        store = WeightGradStore()
        with collecting(store):
            out.backward(torch.ones_like(out))
        deferred[checkpoint] = len(store)
        store.run()
        grads[checkpoint] = {n: p.grad for n, p in stage.named_parameters()}
    assert deferred[True] == deferred[False] == 8  # 4 linears a layer: qkv, o, gate_up, down
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad)
