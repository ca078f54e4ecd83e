"""The Triton kernels as torch.library custom ops (namespace ``hal_triton``), with autograd and fake kernels.

Autograd and torch.compile see each op as one node: the forward op returns what its backward needs
(rstd, the fused residual), the backward is a custom op of its own, and a fake implementation gives
shapes and dtypes for tracing. Schemas are spelled out rather than inferred from annotations, so
torch 2.4-2.13 read them alike.

Where Triton compiles kernels (a GPU) and torch has ``torch.library.triton_op`` (2.6+), the ops are
triton ops instead: eager calls run the same Python launchers, but torch.compile traces *into* them and
inductor launches the kernels from its generated code. Why: an opaque custom op in a compiled layer
costs a Python dispatch and a Triton launch per call (about 0.1-0.2 ms of host time each), which left
the first pipeline stage host-bound at micro-batch 1 (4 x H200: 75k tokens/s against 189k with
inductor's own fused ops). Under Triton's interpreter (CPU tests) kernels cannot be traced, so the ops
stay opaque custom ops with the fake implementations below. ``TRACEABLE`` says which one this process has.

An eager call on plain tensors (nothing compiling or tracing) skips the dispatcher: ``_call`` runs the op's
body and its registered backward as a plain autograd.Function and launches the kernels directly, the same
computation for half the host time a call or less (the dispatcher path's custom-op wrappers cost more
than the kernels at micro-batch sizes: 135 against 64 us a forward rms_norm on an H100's host).

This module imports triton only to ask whether it interprets (``_traceable``, once, where triton is
installed); each op imports its kernel module when it first runs.

The functions at the bottom (``rms_norm``, ``add_rms_norm``, ``rotary_embedding``, ``swiglu``,
``linear_cross_entropy``) are what the registry's wrappers and the tests call.
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys
from typing import Any, Callable

import torch

NAMESPACE = "hal_triton"
MEAN, SUM = 0, 1  # linear_cross_entropy's reduction codes (the schema takes an int)
REDUCTIONS = {"mean": MEAN, "sum": SUM}


def _traceable() -> bool:
    """Whether the ops can be triton ops: torch has the API and Triton will compile, not interpret.

    Decided when the ops are defined (this module's import), without importing triton where it is not
    loaded yet: the interpreter is chosen by TRITON_INTERPRET when triton is first imported.
    """
    if not (hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton")):
        return False
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not accelerator.is_available():
        return False  # nothing for Triton to compile for: kernels run here only in the interpreter
    if "triton" in sys.modules:
        from .launch import interpreted, probe_kernel

        return not interpreted(probe_kernel())
    return os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and importlib.util.find_spec("triton") is not None


TRACEABLE = _traceable()


_IMPLS: dict[str, Callable[..., Any]] = {}  # each op's Python body, for the eager path
_EAGER: dict[str, type[torch.autograd.Function]] = {}  # each differentiable op as a plain autograd.Function
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # not fake, functional or any other tracing tensor


def _op(name: str, schema: str) -> Any:
    def define(fn: Callable[..., Any]) -> Any:
        _IMPLS[name] = fn
        if TRACEABLE:  # the schema is inferred from the annotations (they match ``schema``)
            return torch.library.triton_op(f"{NAMESPACE}::{name}", mutates_args=())(fn)
        return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=(), schema=schema)(fn)
    return define


def _autograd(op: Any, name: str, grad: Callable[..., Any], setup: Callable[..., None]) -> None:
    """The op's backward, registered twice: on the op (what torch.compile traces) and as an autograd.Function
    with the same setup and backward (what an eager call runs, ``_call``).

    The eager Function sets its context inside ``forward`` (the classic form) rather than through a separate
    ``setup_context``: with the separate form, every ``apply`` binds its arguments to the forward's signature
    with ``inspect`` — 30 µs a call on a slow host, on a path that exists to save host time.

    The eager Function does not materialise zero gradients for outputs nobody differentiated (rstd, the
    fused head's dh and dW): filling them cost 43 of 1,430 µs of linear-CE's backward on an H200. Every
    ``grad`` takes None for such an output (the traced op may still hand it zeros)."""
    op.register_autograd(grad, setup_context=setup)
    impl = _IMPLS[name]

    def forward(ctx: Any, *args: Any) -> Any:
        out = impl(*args)
        setup(ctx, args, out)
        ctx.set_materialize_grads(False)
        return out

    _EAGER[name] = type(f"_{name}_eager", (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(grad)})


def _eager(args: tuple[Any, ...]) -> bool:
    """Whether a call runs eagerly on plain tensors (nothing compiles, traces or fakes them)."""
    return not torch.compiler.is_compiling() and all(type(a) in _PLAIN for a in args if isinstance(a, torch.Tensor))


def _call(name: str, *args: Any) -> Any:
    """Run op ``name``: through the torch.library op where something traces it, else straight to its body.

    Why: an eager call through the dispatcher pays the custom-op machinery (autograd and backend wrappers,
    alias checks) and ``wrap_triton``'s dispatch — 0.1-0.3 ms of host time a call on an H200's host, more
    than the kernel takes at micro-batch sizes. The eager path runs the same body and the same backward as
    a plain autograd.Function and launches the kernels directly; torch.compile still sees the op."""
    if not _eager(args):
        return getattr(torch.ops.hal_triton, name)(*args)
    from .launch import raw_launches  # triton is imported when an op first runs, not with this module

    with raw_launches():
        if name in _EAGER and torch.is_grad_enabled():
            return _EAGER[name].apply(*args)
        return _IMPLS[name](*args)


def _fake(op: Any) -> Any:
    """``op.register_fake``, unless ``op`` is a triton op: its implementation is then its own fake."""
    if TRACEABLE:
        return lambda fn: fn
    return op.register_fake


# --- rms_norm and add_rms_norm ------------------------------------------------------------------------
@_op("rms_norm", "(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)")
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    from . import norm

    y, _, rstd = norm.rms_norm_forward(x, weight, eps)
    return y, rstd


@_op("add_rms_norm", "(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor, Tensor)")
def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from . import norm

    return norm.rms_norm_forward(x, weight, eps, residual)


@_op("rms_norm_backward", "(Tensor dy, Tensor h, Tensor weight, Tensor rstd, Tensor? d_residual) -> (Tensor, Tensor)")
def _rms_norm_backward(dy: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                       d_residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    from . import norm

    return norm.rms_norm_backward(dy, h, weight, rstd, d_residual)


@_fake(_rms_norm)
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(_rows(x), dtype=torch.float32)


@_fake(_add_rms_norm)
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y = torch.empty_like(x, memory_format=torch.contiguous_format, dtype=torch.promote_types(x.dtype, residual.dtype))
    return y, torch.empty_like(y), x.new_empty(_rows(x), dtype=torch.float32)


@_fake(_rms_norm_backward)
def _(dy: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
      d_residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(h, memory_format=torch.contiguous_format), torch.empty_like(weight)


def _rows(x: torch.Tensor) -> int:
    return math.prod(x.shape[:-1])


def _rms_norm_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.mark_non_differentiable(output[1])


def _rms_norm_grad(ctx: Any, dy: torch.Tensor, _drstd: torch.Tensor | None) -> tuple[Any, ...]:
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _call("rms_norm_backward", dy, x, weight, rstd, None)
    return dx, dw, None


def _add_rms_norm_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    _, _, weight, _ = inputs
    ctx.save_for_backward(output[1], weight, output[2])
    ctx.mark_non_differentiable(output[2])


def _add_rms_norm_grad(ctx: Any, dy: torch.Tensor, dh: torch.Tensor | None, _drstd: torch.Tensor | None,
                       ) -> tuple[Any, ...]:
    h, weight, rstd = ctx.saved_tensors
    if dy is None:  # only the sum h was differentiated (eager: grads are not materialised)
        return dh, dh, None, None
    dx, dw = _call("rms_norm_backward", dy, h, weight, rstd, dh)
    # h = x + residual: both receive h's gradient (autograd rounds it to each input's dtype where they differ)
    return dx, dx, dw, None


_autograd(_rms_norm, "rms_norm", _rms_norm_grad, _rms_norm_setup)
_autograd(_add_rms_norm, "add_rms_norm", _add_rms_norm_grad, _add_rms_norm_setup)


# --- rotary embedding -----------------------------------------------------------------------------------
@_op("rotary_embedding", "(Tensor x, Tensor cos, Tensor sin, ScalarType out_dtype, bool transpose) -> Tensor")
def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype, transpose: bool) -> torch.Tensor:
    from . import rope

    return rope.rope(x, cos, sin, out_dtype, backward=transpose)


@_fake(_rotary)
def _(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype, transpose: bool) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=out_dtype)


def _rotary_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, cos, sin, _, transpose = inputs
    ctx.transpose = transpose
    ctx.dtypes = (x.dtype, cos.dtype, sin.dtype)
    ctx.save_for_backward(x if ctx.needs_input_grad[1] or ctx.needs_input_grad[2] else None, cos, sin)


def _rotary_grad(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
    """dx is the transposed rotation of g; cos/sin (rarely trained) get theirs from plain torch ops."""
    x, cos, sin = ctx.saved_tensors
    x_dtype, cos_dtype, sin_dtype = ctx.dtypes
    dx = _call("rotary_embedding", g, cos, sin, x_dtype, not ctx.transpose) if ctx.needs_input_grad[0] else None
    dcos = dsin = None
    if x is not None:
        gf, xf = g.float(), x.float()
        if ctx.needs_input_grad[1]:
            dcos = (gf * xf).sum_to_size(cos.shape).to(cos_dtype)  # cos multiplies x in either direction
        if ctx.needs_input_grad[2]:
            dsin = _sin_grad(gf, xf, ctx.transpose).sum_to_size(sin.shape).to(sin_dtype)
    return dx, dcos, dsin, None, None


def _sin_grad(g: torch.Tensor, x: torch.Tensor, transpose: bool) -> torch.Tensor:
    """g times d(out)/d(sin). Forward: out1 = x1 c1 - x2 s1, out2 = x2 c2 + x1 s2 (g * rotate_half(x));
    transposed: out1 = x1 c1 + x2 s2, out2 = x2 c2 - x1 s1."""
    half = x.shape[-1] // 2
    g1, g2, x1, x2 = g[..., :half], g[..., half:], x[..., :half], x[..., half:]
    return torch.cat((-g2 * x1, g1 * x2) if transpose else (-g1 * x2, g2 * x1), dim=-1)


_autograd(_rotary, "rotary_embedding", _rotary_grad, _rotary_setup)


# --- swiglu ---------------------------------------------------------------------------------------------
@_op("swiglu", "(Tensor x) -> Tensor")
def _swiglu(x: torch.Tensor) -> torch.Tensor:
    from . import swiglu

    return swiglu.swiglu_forward(x)


@_op("swiglu_backward", "(Tensor dy, Tensor x) -> Tensor")
def _swiglu_backward(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    from . import swiglu

    return swiglu.swiglu_backward(dy, x)


@_fake(_swiglu)
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@_fake(_swiglu_backward)
def _(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _swiglu_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0])


def _swiglu_grad(ctx: Any, dy: torch.Tensor) -> torch.Tensor:
    (x,) = ctx.saved_tensors
    return _call("swiglu_backward", dy, x)


_autograd(_swiglu, "swiglu", _swiglu_grad, _swiglu_setup)


# --- fused linear + cross-entropy -------------------------------------------------------------------------
@_op("linear_cross_entropy", "(Tensor hidden, Tensor weight, Tensor target, int ignore_index, int reduction, "
     "int chunk_size, bool grad_hidden, bool grad_weight) -> (Tensor, Tensor, Tensor)")
def _linear_ce(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: int,
               chunk_size: int, grad_hidden: bool, grad_weight: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from . import linear_ce

    return linear_ce.linear_cross_entropy(hidden, weight, target, ignore_index, reduction, chunk_size,
                                          grad_hidden, grad_weight)


@_fake(_linear_ce)
def _(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: int,
      chunk_size: int, grad_hidden: bool, grad_weight: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    loss = hidden.new_empty((), dtype=torch.float32)
    dh = torch.empty_like(hidden, memory_format=torch.contiguous_format) if grad_hidden else hidden.new_empty(0)
    dw = torch.empty_like(weight, memory_format=torch.contiguous_format) if grad_weight else weight.new_empty(0)
    return loss, dh, dw


def _linear_ce_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    _, dh, dw = output
    ctx.save_for_backward(dh, dw)
    ctx.mark_non_differentiable(dh, dw)
    ctx.spent = False


def _linear_ce_grad(ctx: Any, d_loss: torch.Tensor, _dh: Any, _dw: Any) -> tuple[Any, ...]:
    """The forward's gradients times d_loss, scaled in place: a (V, H) weight gradient is too large to copy.
    So the backward runs once; a second one (retain_graph=True) would scale them again, and is refused."""
    if ctx.spent:
        raise RuntimeError("hal_triton::linear_cross_entropy's backward runs once: its gradients were computed "
                           "in the forward and scaled in place (use the reference for retain_graph=True)")
    ctx.spent = True
    dh, dw = ctx.saved_tensors
    scale = d_loss.to(torch.float32)
    if _eager((dh, dw, scale)):  # the Triton scale (vectorised, no host sync); traced, inductor fuses mul_
        from .launch import raw_launches
        from .linear_ce import scale_in_place

        with raw_launches():
            d_hidden = scale_in_place(dh, scale) if ctx.needs_input_grad[0] else None
            d_weight = scale_in_place(dw, scale) if ctx.needs_input_grad[1] else None
    else:
        d_hidden = dh.mul_(scale) if ctx.needs_input_grad[0] else None
        d_weight = dw.mul_(scale) if ctx.needs_input_grad[1] else None
    return d_hidden, d_weight, None, None, None, None, None, None


_autograd(_linear_ce, "linear_cross_entropy", _linear_ce_grad, _linear_ce_setup)


# --- what callers use ----------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """hal's rms_norm on the Triton kernel (x's last dim is the hidden size)."""
    return _call("rms_norm", x, weight, float(eps))[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass over each tensor."""
    y, h, _ = _call("add_rms_norm", x, residual, weight, float(eps))
    return y, h


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, in the dtype torch's promotion gives the reference."""
    out_dtype = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)
    return _call("rotary_embedding", x, cos, sin, out_dtype, False)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu of the first half of x's last dim times the second half."""
    return _call("swiglu", x)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                         reduction: str = "mean", chunk_size: int | None = None) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T, target) with at most ``chunk_size`` tokens' logits alive at once.

    hidden (..., H), weight (V, H), target (...); reduction 'mean' or 'sum'; the loss in fp32 (fp64 for fp64),
    as the reference returns it.
    """
    grads = torch.is_grad_enabled()
    loss, _, _ = _call(
        "linear_cross_entropy", hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), int(ignore_index),
        REDUCTIONS[reduction],
        int(chunk_size or 0), grads and hidden.requires_grad, grads and weight.requires_grad)
    return loss.double() if hidden.dtype == torch.float64 else loss
