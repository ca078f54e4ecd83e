"""The Triton kernels (hal.kernels.triton) against hal's references, forward and backward.

Without a GPU the kernels run on CPU tensors in Triton's interpreter. Triton decides at import time
whether ``@triton.jit`` compiles or interprets — triton.language's own helpers included — so
TRITON_INTERPRET=1 is set here before triton is first imported (test modules are imported at
collection, before any test runs); if another module imported triton first, these tests skip and say
so. With a GPU they run on it, compiled. Run alone on the CPU:

    TRITON_INTERPRET=1 pytest tests/unit/test_triton_kernels.py

Shapes are small (the interpreter runs each program in numpy) but cover non-power-of-two hidden sizes,
ragged last blocks and chunks, strided views and ignored targets. Tolerances: fp32 tight; bf16/fp16
loose, and the interpreter truncates fp32 -> bf16 where GPUs round to nearest.
"""
from __future__ import annotations

import ast
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from hal import ops
from hal.downgrades import clear_downgrades, fallback_policy, recorded_downgrades
from hal.errors import FallbackRefused

from ..conftest import REPO
from ..triton_mode import interpret_unless_gpu, require_mode

DEVICE = interpret_unless_gpu()
ON_GPU = DEVICE.type == "cuda"
triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'hetero-hal[kernels]')")

from hal.kernels import triton_ops  # noqa: E402  (after TRITON_INTERPRET is set)
from hal.kernels.triton import launch, library, linear_ce, norm, swiglu  # noqa: E402

pytestmark = require_mode(DEVICE, norm._rms_norm_fwd, "tests/unit/test_triton_kernels.py")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOL: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 3e-2, "atol": 3e-2},
    torch.float16: {"rtol": 3e-3, "atol": 3e-3},
}
DTYPE_IDS = [str(d).replace("torch.", "") for d in DTYPES]


def _leaves(dtype: torch.dtype, *specs: tuple[int, ...] | torch.Tensor, seed: int = 0) -> list[torch.Tensor]:
    """float64 tensors whose values are exactly representable in ``dtype`` (shapes drawn, tensors rounded)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for spec in specs:
        t = spec if isinstance(spec, torch.Tensor) else torch.randn(*spec, generator=gen, dtype=torch.float64)
        out.append(t.to(dtype).to(torch.float64))
    return out


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def compare(kernel: Callable[..., Any], reference: Callable[..., Any], leaves: Sequence[torch.Tensor],
            dtype: torch.dtype, *, grads: Sequence[int] | None = None, build: Callable[..., tuple[Any, ...]] | None = None,
            tol: dict[str, float] | None = None, out_dtype: torch.dtype | None = None) -> None:
    """Kernel on ``dtype`` leaves (on DEVICE) against the reference on the same values in float64:
    every output (in ``out_dtype``, default ``dtype``), then every gradient (of the leaves in ``grads``,
    default all) for one random cotangent."""
    build = build or (lambda *t: t)
    tol = tol or TOL[dtype]
    grads = range(len(leaves)) if grads is None else grads
    ref_in = [t.clone().requires_grad_(i in grads) for i, t in enumerate(leaves)]
    dev_in = [t.to(dtype).to(DEVICE).requires_grad_(i in grads) for i, t in enumerate(leaves)]
    expected, actual = _as_tuple(reference(*build(*ref_in))), _as_tuple(kernel(*build(*dev_in)))
    assert len(actual) == len(expected)
    gen = torch.Generator().manual_seed(1)
    out_dtype = out_dtype or dtype
    cotangents = [torch.randn(e.shape, generator=gen, dtype=torch.float64).to(out_dtype) for e in expected]
    for a, e in zip(actual, expected):
        assert a.dtype == out_dtype and a.shape == e.shape
        torch.testing.assert_close(a.cpu().double(), e.detach(), **tol)
    torch.autograd.backward(list(expected), [c.double() for c in cotangents])
    torch.autograd.backward(list(actual), [c.to(DEVICE) for c in cotangents])
    for i in grads:
        got, want = dev_in[i].grad, ref_in[i].grad
        assert got is not None and got.dtype == dtype, f"input {i}"
        torch.testing.assert_close(got.cpu().double(), want, **tol, msg=lambda m: f"grad of input {i}: {m}")


# --- rms_norm and add_rms_norm -------------------------------------------------------------------------
NORM_SHAPES = [(3, 37), (2, 5, 64), (4, 130), (1, 1)]  # non-power-of-two and ragged hidden sizes, one 1x1


@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x, w = _leaves(dtype, shape, (shape[-1],))
    w = (w.abs() + 0.5).to(dtype).double()
    compare(library.rms_norm, ops._rms_norm, [x, w], dtype, build=lambda x, w: (x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_norm_of_a_strided_view_and_a_float32_weight(dtype: torch.dtype) -> None:
    """Rows with a stride (a transposed matrix, copied once) and the fp32 weight a bf16 model may keep."""
    x, w = _leaves(dtype, (24, 5), (24,))
    compare(library.rms_norm, ops._rms_norm, [x, w], dtype, build=lambda x, w: (x.t(), w.float() if dtype != torch.float64 else w, 1e-5))


@pytest.mark.parametrize("shape", [(3, 37), (2, 3, 130)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_add_rms_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x, r, w = _leaves(dtype, shape, shape, (shape[-1],))
    compare(library.add_rms_norm, ops._add_rms_norm, [x, r, w], dtype, build=lambda x, r, w: (x, r, w, 1e-6))


def test_add_rms_norm_keeps_the_stream_in_its_dtype() -> None:
    """h = x + residual is rounded to the dtype before it is normalised, exactly as the reference."""
    x, r, w = (t.to(torch.float16).to(DEVICE) for t in _leaves(torch.float16, (4, 24), (4, 24), (24,)))
    y, h = library.add_rms_norm(x, r, w)
    torch.testing.assert_close(h, x + r, rtol=0, atol=0)
    torch.testing.assert_close(y, ops._rms_norm(x + r, w), rtol=1e-3, atol=1e-3)


def test_add_rms_norm_of_a_half_branch_onto_a_float32_stream() -> None:
    """Mixed precision with fp32 weights: autocast's bf16 branch output added to the fp32 residual stream. The
    kernel keeps h and y in fp32 (the reference's promotion) and hands each input its gradient in its dtype."""
    xs, rs, ws = _leaves(torch.float32, (6, 40), (6, 40), (40,))
    x = xs.to(torch.bfloat16).to(DEVICE).requires_grad_(True)
    r, w = rs.float().to(DEVICE).requires_grad_(True), ws.float().to(DEVICE).requires_grad_(True)
    y, h = library.add_rms_norm(x, r, w)
    assert y.dtype == h.dtype == torch.float32
    xr, rr, wr = (t.detach().double().cpu().requires_grad_(True) for t in (x, r, w))
    ye, he = ops._add_rms_norm(xr, rr, wr)
    torch.testing.assert_close(h.cpu().double(), he.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y.cpu().double(), ye.detach(), rtol=1e-5, atol=1e-5)
    gy, gh = torch.randn(6, 40, dtype=torch.float64), torch.randn(6, 40, dtype=torch.float64)
    torch.autograd.backward([ye, he], [gy, gh])
    torch.autograd.backward([y, h], [gy.float().to(DEVICE), gh.float().to(DEVICE)])
    assert x.grad.dtype == torch.bfloat16 and r.grad.dtype == torch.float32
    torch.testing.assert_close(r.grad.cpu().double(), rr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.cpu().double(), xr.grad.to(torch.bfloat16).double(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(w.grad.cpu().double(), wr.grad, rtol=1e-4, atol=1e-4)
    clear_downgrades()
    triton_ops.triton_add_rms_norm(x.detach(), r.detach(), w.detach())  # the registry's wrapper takes it as well
    assert not [d for d in recorded_downgrades() if "add_rms_norm" in str(d)]


def test_rms_norm_backward_sums_the_weight_gradient_over_many_rows() -> None:
    """More rows than programs: each program walks several rows (the persistent grid's loop)."""
    x, w = _leaves(torch.float32, (50, 19), (19,))
    assert launch.program_count(DEVICE, 50) < 50 or ON_GPU
    compare(library.rms_norm, ops._rms_norm, [x, w], torch.float32, build=lambda x, w: (x, w, 1e-6))


# --- rotary embedding -------------------------------------------------------------------------------------
def _rope_tables(seq: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rotary_embedding_on_a_projection_view(dtype: torch.dtype) -> None:
    """q as the model makes it: (B, S, H, D) viewed as (B, H, S, D); S = 17 leaves a ragged position tile,
    D = 12 a non-power-of-two half. The model's tables are (S, D), in x's dtype, without gradients."""
    b, s, h, d = 2, 17, 3, 12
    cos, sin = _rope_tables(s, d)
    x, cos, sin = _leaves(dtype, (b, s, h, d), cos, sin)
    compare(library.rotary_embedding, ops._rotary_embedding, [x, cos, sin], dtype, grads=[0],
            build=lambda x, c, n: (x.transpose(1, 2), c, n))


def test_rotary_embedding_of_a_long_sequence_takes_the_long_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    """From LONG_SEQ positions the kernel tiles 16 positions x 4 heads (the threshold lowered here so the interpreter
    runs few programs): a ragged last tile and a head count (6) the 4-head groups do not divide, on a projection view
    as the model makes it."""
    from hal.kernels.triton import rope

    monkeypatch.setattr(rope, "LONG_SEQ", 32)
    b, s, h, d = 1, 37, 6, 4
    cos, sin = _rope_tables(s, d)
    x, cos, sin = _leaves(torch.float32, (b, s, h, d), cos, sin)
    compare(library.rotary_embedding, ops._rotary_embedding, [x, cos, sin], torch.float32, grads=[0],
            build=lambda x, c, n: (x.transpose(1, 2), c, n))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_rotary_embedding_gradients_reach_broadcast_tables(dtype: torch.dtype) -> None:
    """Trainable (1, H, S, D) tables broadcast over the batch: their gradients are summed over it."""
    x, c, n = _leaves(dtype, (2, 3, 5, 8), (1, 3, 5, 8), (1, 3, 5, 8))
    compare(library.rotary_embedding, ops._rotary_embedding, [x, c, n], dtype)


def test_rotary_embedding_of_3d_input() -> None:
    cos, sin = _rope_tables(6, 4)
    x, cos, sin = _leaves(torch.float32, (3, 6, 4), cos, sin)
    compare(library.rotary_embedding, ops._rotary_embedding, [x, cos, sin], torch.float32)


# --- swiglu -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(7, 74), (2, 3, 128), (1, 2)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_swiglu(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    (x,) = _leaves(dtype, shape)
    compare(library.swiglu, ops._swiglu, [x], dtype)


def test_swiglu_of_rows_back_to_back_in_blocks_spanning_rows() -> None:
    """Contiguous rows run as one flat range: 5 rows of 1000 halves span three 2048-output blocks, each across rows."""
    (x,) = _leaves(torch.float32, (5, 2000))
    assert swiglu._flat(x.reshape(-1, 2000), 1000) and not swiglu._flat(x[:, ::2], 500)
    compare(library.swiglu, ops._swiglu, [x], torch.float32)


def test_swiglu_of_a_strided_view_spanning_blocks() -> None:
    """Every other column of a wider matrix (a column stride of 2); 2100 halves span three 1024-blocks."""
    (x,) = _leaves(torch.float32, (3, 8400))
    compare(library.swiglu, ops._swiglu, [x], torch.float32, build=lambda x: (x[:, ::2],))


# --- fused linear + cross-entropy ----------------------------------------------------------------------------
def _ce_leaves(dtype: torch.dtype, tokens: tuple[int, ...], hidden: int, vocab: int) -> list[torch.Tensor]:
    h, w = _leaves(dtype, (*tokens, hidden), (vocab, hidden))
    return [h, (w / hidden ** 0.5).to(dtype).double()]


def _targets(tokens: tuple[int, ...], vocab: int, ignore_every: int = 4) -> torch.Tensor:
    target = torch.randint(0, vocab, tokens, generator=torch.Generator().manual_seed(2))
    target.view(-1)[::ignore_every] = -100
    return target


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_linear_cross_entropy_in_chunks_smaller_than_the_tokens(dtype: torch.dtype, reduction: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """21 tokens in chunks of 8 (the last one ragged), every 4th target ignored; a vocabulary of 50 walked
    in blocks of 16 (ragged too), so the online softmax crosses blocks."""
    monkeypatch.setattr(linear_ce, "BLOCK_V", 16)
    target = _targets((3, 7), 50)
    kernel = lambda h, w: library.linear_cross_entropy(h, w, target.to(DEVICE), reduction=reduction, chunk_size=8)
    reference = lambda h, w: ops._linear_cross_entropy(h, w, target, reduction=reduction)
    tol = TOL[dtype] if dtype == torch.float32 else {"rtol": 5e-2, "atol": 5e-2}  # bf16/fp16 logits round first
    compare(kernel, reference, _ce_leaves(dtype, (3, 7), 24, 50), dtype, tol=tol, out_dtype=torch.float32)


def test_linear_cross_entropy_default_chunk_and_a_frozen_weight() -> None:
    """Only the hidden states need a gradient: the weight's is never computed."""
    target = _targets((12,), 40, ignore_every=5)
    kernel = lambda h, w: library.linear_cross_entropy(h, w, target.to(DEVICE))
    compare(kernel, lambda h, w: ops._linear_cross_entropy(h, w, target), _ce_leaves(torch.float32, (12,), 16, 40),
            torch.float32, grads=[0], out_dtype=torch.float32)


def test_linear_cross_entropy_with_every_target_ignored_is_nan_with_zero_gradients() -> None:
    """As torch's cross_entropy: the mean over no tokens is NaN, and nothing flows back."""
    h, w = (t.float().to(DEVICE).requires_grad_() for t in _ce_leaves(torch.float32, (5,), 8, 10))
    loss = library.linear_cross_entropy(h, w, torch.full((5,), -100, device=DEVICE), chunk_size=2)
    assert torch.isnan(loss)
    loss.backward()
    assert h.grad is not None and w.grad is not None
    assert not h.grad.any() and not w.grad.any()


def test_linear_cross_entropy_backward_runs_once() -> None:
    """Its gradients are scaled in place (a weight-sized copy saved): a second backward is refused, not wrong."""
    h, w = (t.float().to(DEVICE).requires_grad_() for t in _ce_leaves(torch.float32, (6,), 8, 10))
    loss = library.linear_cross_entropy(h, w, _targets((6,), 10).to(DEVICE), chunk_size=4)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward runs once"):
        loss.backward()


def test_linear_cross_entropy_never_holds_more_than_a_chunk_of_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The row kernel only ever sees (chunk, V) logits."""
    seen: list[tuple[int, ...]] = []
    real = linear_ce._ce_rows

    class Spy:
        def __getitem__(self, grid: Any) -> Callable[..., Any]:
            def launch_(logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                seen.append(tuple(logits.shape))
                return real[grid](logits, *args, **kwargs)
            return launch_

    monkeypatch.setattr(linear_ce, "_ce_rows", Spy())
    monkeypatch.setattr(linear_ce, "check_device", lambda kernel, device: None)
    h, w = (t.float().to(DEVICE) for t in _ce_leaves(torch.float32, (10,), 8, 30))
    library.linear_cross_entropy(h, w, _targets((10,), 30).to(DEVICE), chunk_size=4)
    assert seen == [(4, 30), (4, 30), (2, 30)]


# --- as single ops: torch.library checks and torch.compile ---------------------------------------------------------
def _op_samples() -> list[tuple[Any, tuple[Any, ...]]]:
    f = lambda *shape: torch.randn(*shape, device=DEVICE, requires_grad=True)
    cos, sin = (t.float().to(DEVICE) for t in _rope_tables(5, 8))
    return [
        (torch.ops.hal_triton.rms_norm.default, (f(3, 10), f(10), 1e-6)),
        (torch.ops.hal_triton.add_rms_norm.default, (f(3, 10), f(3, 10), f(10), 1e-6)),
        (torch.ops.hal_triton.rotary_embedding.default, (f(2, 3, 5, 8), cos, sin, torch.float32, False)),
        (torch.ops.hal_triton.swiglu.default, (f(4, 12),)),
        (torch.ops.hal_triton.linear_cross_entropy.default,
         (f(6, 8), f(20, 8), _targets((6,), 20).to(DEVICE), -100, library.MEAN, 4, True, True)),
    ]


@pytest.mark.parametrize("index", range(5), ids=["rms_norm", "add_rms_norm", "rotary_embedding", "swiglu", "linear_ce"])
def test_custom_ops_pass_torch_library_opcheck(index: int) -> None:
    """Schema, fake (meta) implementation and autograd registration agree with the real op."""
    op, args = _op_samples()[index]
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_torch_compile_sees_each_kernel_as_one_op() -> None:
    """fullgraph=True: no graph break in the forward or the backward (aot_eager: no C++ compiler needed)."""
    x = torch.randn(2, 5, 16, device=DEVICE, requires_grad=True)
    w = torch.ones(16, device=DEVICE, requires_grad=True)
    gate_up = torch.randn(16, 32, device=DEVICE)

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        normed, h = library.add_rms_norm(x, x * 0.5, w)
        return (h + library.swiglu(library.rms_norm(normed, w) @ gate_up)[..., :16]).sum()

    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    loss = compiled(x, w)
    loss.backward()
    grads = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    block(x, w).backward()
    torch.testing.assert_close(grads[0], x.grad)
    torch.testing.assert_close(grads[1], w.grad)


@pytest.mark.parametrize("index", range(5), ids=["rms_norm", "add_rms_norm", "rotary_embedding", "swiglu", "linear_ce"])
def test_eager_calls_skip_the_dispatcher_and_equal_the_op(index: int) -> None:
    """An eager call runs the op's body and backward as a plain autograd.Function (no hal_triton op reaches the
    dispatcher: a dispatch mode sees aten ops only), with the outputs and gradients of the torch.library op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    op, args = _op_samples()[index]
    name = op.name().split("::")[1].split(".")[0]
    leaves = [a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a for a in args]
    if name == "linear_cross_entropy":  # its gradients come out of the forward; the reduction's d_loss scales them
        leaves = [a.detach().requires_grad_(i < 2) if isinstance(a, torch.Tensor) else a for i, a in enumerate(args)]
    with Seen() as seen:
        out = library._call(name, *leaves)
        first = out[0] if isinstance(out, tuple) else out
        first.float().sum().backward()
    assert not [o for o in seen.ops if "hal_triton" in o], seen.ops
    eager_grads = [a.grad for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad]
    again = [a.detach().requires_grad_(b.requires_grad) if isinstance(a, torch.Tensor) else a for a, b in zip(args, leaves)]
    want = op(*again)
    (want[0] if isinstance(want, tuple) else want).float().sum().backward()
    torch.testing.assert_close(first, want[0] if isinstance(want, tuple) else want)
    for got, ref in zip(eager_grads, [a.grad for a in again if isinstance(a, torch.Tensor) and a.requires_grad]):
        torch.testing.assert_close(got, ref)


def test_compiled_calls_keep_the_op() -> None:
    """What torch.compile traces is the hal_triton op (one node), not the eager path's kernel launches."""
    graphs: list[str] = []

    def backend(gm: torch.fx.GraphModule, example: Any) -> Any:
        graphs.append(gm.code)
        return gm.forward

    x, w = torch.randn(3, 8, device=DEVICE), torch.ones(8, device=DEVICE)
    torch._dynamo.reset()
    torch.compile(lambda a, b: library.rms_norm(a, b) * 2, backend=backend, fullgraph=True)(x, w)
    assert graphs and "hal_triton.rms_norm" in graphs[0], graphs


@pytest.mark.skipif(not ON_GPU, reason="inductor compiles Triton kernels only on a GPU")
def test_on_a_gpu_inductor_launches_the_kernels_itself() -> None:
    """Where Triton compiles, the ops are triton ops: inductor traces into them (no opaque op, no Python launch
    per call in a compiled layer) and the compiled forward and backward equal the eager ones."""
    assert library.TRACEABLE, "a GPU with torch.library.triton_op: the ops should be traceable"
    x = torch.randn(2, 64, 128, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(128, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = (t.to(DEVICE, torch.bfloat16) for t in _rope_tables(64, 128))
    gate_up = torch.randn(128, 256, device=DEVICE, dtype=torch.bfloat16) / 16

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        normed, h = library.add_rms_norm(x, x * 0.5, w)
        rotated = library.rotary_embedding(library.rms_norm(normed, w), cos, sin)
        return (h + library.swiglu(rotated @ gate_up)).float().square().mean()

    torch._dynamo.reset()
    compiled = torch.compile(block, backend="inductor", fullgraph=True)
    loss = compiled(x, w)
    loss.backward()
    got = (loss.detach(), x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    expected = block(x, w)
    expected.backward()
    for a, b in zip(got, (expected.detach(), x.grad, w.grad)):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


# --- in the registry ---------------------------------------------------------------------------------------------
KERNEL_OPS = ("rms_norm", "add_rms_norm", "rotary_embedding", "swiglu", "linear_cross_entropy")


def test_registered_for_cuda_and_rocm_above_the_reference_and_never_for_cpu() -> None:
    for op in KERNEL_OPS:
        impls = {i.name: i for i in ops.registry.implementations(op)}
        assert impls["triton"].backends == frozenset({"cuda"}) and impls["triton"].priority > 0
        assert impls["triton_rocm"].backends == frozenset({"rocm"})
        assert "NOT verified" in impls["triton_rocm"].source
        assert ops.registry.choose(op, "cpu", torch.float32).impl.name == "reference"
        assert ops.registry.choose(op, "cuda", torch.float64).impl.name == "reference"  # fp64: not served, no downgrade
        assert not ops.registry.choose(op, "cuda", torch.float64).skipped


@pytest.mark.skipif(ON_GPU, reason="checks the reasons given where there is no GPU")
def test_requires_says_why_not_here(monkeypatch: pytest.MonkeyPatch) -> None:
    choice = ops.registry.choose("rms_norm", "cuda", torch.bfloat16)
    assert choice.impl.name == "reference"
    assert "no cuda device" in dict(choice.skipped)["triton"]
    triton_ops.triton_missing.cache_clear()
    monkeypatch.setattr(triton_ops.importlib.util, "find_spec", lambda name: None)
    try:
        why = triton_ops.requires_triton("rocm")()
    finally:
        triton_ops.triton_missing.cache_clear()
    assert why is not None and "triton is not installed" in why and "no rocm device" in why
    assert "hetero-hal[kernels]" in why


def test_hal_never_imports_triton_when_it_loads() -> None:
    """The registry face and the custom ops import triton nowhere (the kernel modules do, when run)."""
    for rel in ("hal/kernels/triton_ops.py", "hal/kernels/triton/library.py", "hal/kernels/triton/__init__.py"):
        tree = ast.parse((REPO / rel).read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0]
        assert not [n for n in names if n.split(".")[0] == "triton"], rel


def test_inputs_a_kernel_cannot_serve_go_to_the_reference_visibly() -> None:
    x = torch.randn(3, 8, device=DEVICE)
    clear_downgrades()
    try:
        with fallback_policy("error"), pytest.raises(FallbackRefused, match="1-D weight"):
            triton_ops.triton_rms_norm(x, torch.ones(3, 8, device=DEVICE))
        with fallback_policy("allow"):
            out = triton_ops.triton_swiglu(x, dim=0)
            loss = triton_ops.triton_linear_cross_entropy(x, torch.randn(5, 8, device=DEVICE),
                                                          torch.zeros(3, dtype=torch.long, device=DEVICE), reduction="none")
        torch.testing.assert_close(out, ops._swiglu(x, dim=0))
        assert loss.shape == (3,)
        seen = {(d.subject.split(" on ")[0], d.requested, d.used) for d in recorded_downgrades()}
        assert {("swiglu", "triton", "reference"), ("linear_cross_entropy", "triton", "reference")} <= seen
    finally:
        clear_downgrades()


def test_the_wrappers_run_the_kernels_where_they_serve() -> None:
    x, w = torch.randn(4, 24, device=DEVICE), torch.rand(24, device=DEVICE) + 0.5
    clear_downgrades()
    with fallback_policy("error"):
        torch.testing.assert_close(triton_ops.triton_rms_norm(x, w), ops._rms_norm(x, w))
        normed, h = triton_ops.triton_add_rms_norm(x, x, w)
        torch.testing.assert_close(normed, ops._rms_norm(x + x, w))
        torch.testing.assert_close(triton_ops.triton_swiglu(x), ops._swiglu(x))
    assert not recorded_downgrades()


@pytest.mark.parametrize("shapes", [((2, 3, 5, 8), (5, 8), (5, 8)), ((2, 3, 5, 8), (1, 1, 5, 8), (5, 8)), ((5, 8), (2, 5, 8), (8,)),
                                    ((2, 3, 5, 8), (4, 8), (5, 8)), ((3,), (2,)), ((1,), (1, 1))])
def test_the_rotary_wrappers_broadcast_rule_is_torchs(shapes: tuple[tuple[int, ...], ...]) -> None:
    try:
        want: tuple[int, ...] | None = tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        want = None
    assert triton_ops._broadcast(*shapes) == want
