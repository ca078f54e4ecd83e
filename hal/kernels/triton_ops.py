"""Triton kernels as implementations of hal registry ops: rms_norm, add_rms_norm, rotary_embedding,
swiglu and linear_cross_entropy; loaded through the ``hal.kernels`` entry point ``triton``.

Registered for backend ``cuda`` as ``triton`` and for ``rocm`` as ``triton_rocm`` (Triton's AMD
backend; NOT verified on ROCm hardware), both above the reference. Never for ``cpu``: on CPU tensors
the kernels run only in Triton's interpreter, which the tests call directly
(``hal.kernels.triton.library``). Each ``requires`` check says why a kernel cannot run here (no
triton, no GPU, too old a Triton) and imports triton only once a GPU is there — never when hal
loads. Each wrapper serves what its kernel can; any other input (a dtype, a weight shape, a hidden
size over one block, reduction='none'…) goes to the reference through ``record_downgrade``, so
the downgrade is seen, never silent.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from hal.backend_registry import backend_for_device_type, get_backend
from hal.downgrades import Downgrade, record_downgrade
from hal.kernels.triton import library  # the custom ops: torch.library only, no triton import
from hal.ops import registry as ops_registry

# The references each kernel runs instead where it cannot serve an input (the downgrade is recorded).
_add_rms_norm, _linear_cross_entropy, _rms_norm, _rotary_embedding, _swiglu = (
    ops_registry.reference(op) for op in ("add_rms_norm", "linear_cross_entropy", "rms_norm", "rotary_embedding", "swiglu"))

if TYPE_CHECKING:
    from hal.ops.registry import OpRegistry

TRITON_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
MIN_TRITON = (3, 0)  # torch 2.4's Triton; torch 2.11 ships 3.6, torch 2.13 3.9
MAX_HIDDEN = 65536  # one program holds a whole normalised row (hal.kernels.triton.launch.MAX_FUSED_SIZE)
PRIORITY = 10  # above the reference (0), below a vendor's fused op (ascend's 20)
INSTALL_HINT = "pip install 'hetero-hal[kernels]'"
# backend -> (implementation name, Triton backend folder, note for the source column)
BACKENDS: dict[str, tuple[str, str, str]] = {
    "cuda": ("triton", "nvidia", ""),
    "rocm": ("triton_rocm", "amd", "; NOT verified on ROCm hardware"),
}


def register(registry: OpRegistry) -> None:
    """The Triton kernels on cuda and rocm, for fp32/bf16/fp16 (fp64 keeps the reference, no downgrade)."""
    for op, fn, module in WRAPPERS:
        for backend, (impl, _, note) in BACKENDS.items():
            registry.register(
                op, impl, backends=[backend], dtypes=list(TRITON_DTYPES), priority=PRIORITY,
                requires=requires_triton(backend), source=f"Triton kernel hal.kernels.triton.{module}{note}",
            )(fn)


# --- can it run here? --------------------------------------------------------------------------------
def requires_triton(backend: str) -> Callable[[], str | None]:
    """A registry ``requires`` check: None when Triton kernels can run on ``backend`` here, else why not."""

    def check() -> str | None:
        problems = []
        package = triton_missing(BACKENDS[backend][1])
        if package:
            problems.append(package)
        status = get_backend(backend).availability()
        if not status.available:
            problems.append(f"no {backend} device: {status.reason}")
        if problems:
            return "; ".join(problems)
        return triton_import_problem()

    return check


@functools.cache
def triton_missing(vendor: str) -> str | None:
    """Why the triton package (with its ``vendor`` backend) is not installed here; None if it is. No import."""
    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError) as exc:
        return f"triton cannot be found: {exc}"
    if spec is None:
        return f"triton is not installed ({INSTALL_HINT})"
    folders = [Path(p) / "backends" for p in (spec.submodule_search_locations or ())]
    if folders and not any((f / vendor).is_dir() for f in folders):
        return f"this triton has no {vendor} backend ({folders[0]})"
    return None


@functools.cache
def triton_import_problem() -> str | None:
    """Import triton (a GPU is there: the kernels are about to be used) and check its version."""
    try:
        triton = importlib.import_module("triton")
    except Exception as exc:  # a triton built for another torch / CUDA
        return f"triton failed to import: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    version = str(getattr(triton, "__version__", "0"))
    try:
        found = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
    except ValueError:
        return None  # a development build: let it run
    if found < MIN_TRITON:
        return f"triton {version} is too old for these kernels (needs {'.'.join(map(str, MIN_TRITON))}+)"
    return None


# --- not served: to the reference, visibly ------------------------------------------------------------------
def _to_reference(op: str, t: torch.Tensor, why: str) -> None:
    """Record (or refuse, under fallback: error) running the reference instead of the Triton kernel."""
    backend = backend_for_device_type(t.device.type).name
    impl = BACKENDS.get(backend, ("triton", "", ""))[0]
    record_downgrade(Downgrade("op", f"{op} on {backend}/{str(t.dtype).replace('torch.', '')}", impl, "reference", why))


def _dtype_problem(what: str, *tensors: torch.Tensor) -> str | None:
    for t in tensors:
        if t.dtype not in TRITON_DTYPES:
            return f"the Triton kernel takes float32/bfloat16/float16 {what}, not {t.dtype}"
    return None


def _broadcast(*shapes: Sequence[int]) -> tuple[int, ...] | None:
    """The shapes' broadcast (torch's rule), None where they do not broadcast. Why not ``torch.broadcast_shapes``:
    it runs torch's symbolic-shape reference in Python, tens of microseconds of host time on every eager call."""
    out = []
    for i in range(-max(len(s) for s in shapes), 0):
        sizes = {s[i] for s in shapes if len(s) >= -i} - {1}
        if len(sizes) > 1:
            return None
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _same_device(*tensors: torch.Tensor) -> bool:
    return all(t.device == tensors[0].device for t in tensors)


def _norm_problem(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    if x.dim() == 0 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        return f"the kernel takes a 1-D weight of size x.shape[-1] (x {tuple(x.shape)}, weight {tuple(weight.shape)})"
    if x.shape[-1] > MAX_HIDDEN:
        return f"hidden size {x.shape[-1]} exceeds one program's block ({MAX_HIDDEN})"
    return _dtype_problem("inputs and weight", x, weight)


# --- the wrappers --------------------------------------------------------------------------------------------
def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """hal rms_norm on the Triton kernel (hal.kernels.triton.norm)."""
    if not _same_device(x, weight):
        return _rms_norm(x, weight, eps)  # invalid for the reference too: it raises torch's own error
    why = _norm_problem(x, weight)
    if why:
        _to_reference("rms_norm", x, why)
        return _rms_norm(x, weight, eps)
    return library.rms_norm(x, weight, eps)


def triton_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """hal add_rms_norm on the Triton kernel: one read of x and residual, one write of each result."""
    if not _same_device(x, residual, weight):
        return _add_rms_norm(x, residual, weight, eps)
    why = _norm_problem(x, weight)
    if not why and residual.shape != x.shape:
        why = f"the kernel takes a residual of x's shape (x {tuple(x.shape)}, residual {tuple(residual.shape)})"
    if not why and not (residual.dtype.is_floating_point and residual.dtype.itemsize >= 2):
        why = f"the kernel takes a float16/bfloat16/float32/float64 residual, not {residual.dtype}"
    if why:
        _to_reference("add_rms_norm", x, why)
        return _add_rms_norm(x, residual, weight, eps)
    return library.add_rms_norm(x, residual, weight, eps)


def triton_rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """hal rotary_embedding on the Triton kernel (hal.kernels.triton.rope); no rotate_half copy."""
    if not _same_device(x, cos, sin):
        return _rotary_embedding(x, cos, sin)
    why = _dtype_problem("x, cos and sin", x, cos, sin)
    if not why and not 1 <= x.dim() <= 4:
        why = f"the kernel takes 1-4-D x, not {x.dim()}-D"
    if not why and x.shape[-1] % 2:
        why = f"the kernel rotates two equal halves: head dim {x.shape[-1]} is odd"
    if not why:
        shape = _broadcast(x.shape, cos.shape, sin.shape)
        if shape is None:
            return _rotary_embedding(x, cos, sin)  # does not broadcast: the reference raises torch's error
        if shape != tuple(x.shape):
            why = f"cos/sin {tuple(cos.shape)}/{tuple(sin.shape)} would broadcast x {tuple(x.shape)} to {tuple(shape)}"
    if why:
        _to_reference("rotary_embedding", x, why)
        return _rotary_embedding(x, cos, sin)
    return library.rotary_embedding(x, cos, sin)


def triton_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """hal swiglu on the Triton kernel (hal.kernels.triton.swiglu), halves along the last dim."""
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        return _swiglu(x, dim)  # invalid for the reference too: it raises its own error
    why = _dtype_problem("input", x)
    if not why and dim % x.dim() != x.dim() - 1:
        why = f"the kernel splits the last dim, not dim {dim} of a {x.dim()}-D input"
    if not why and x.shape[-1] % 2:
        why = f"the kernel needs an even size along the split dim, not {x.shape[-1]}"
    if why:
        _to_reference("swiglu", x, why)
        return _swiglu(x, dim)
    return library.swiglu(x)


def triton_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """hal linear_cross_entropy on the chunked kernel (hal.kernels.triton.linear_ce): no full logits."""
    if not _same_device(hidden, weight, target) or hidden.dim() == 0 or weight.dim() != 2:
        return _linear_cross_entropy(hidden, weight, target, ignore_index, reduction)
    why = _dtype_problem("hidden states and weight", hidden, weight)
    if not why and reduction not in ("mean", "sum"):
        why = (f"reduction={reduction!r}: the fused kernel computes gradients in the forward, which only a "
               "scalar loss allows")
    if not why and (weight.dtype != hidden.dtype or weight.shape[1] != hidden.shape[-1]):
        why = (f"the kernel takes a (V, H) weight of hidden's dtype (hidden {tuple(hidden.shape)} {hidden.dtype}, "
               f"weight {tuple(weight.shape)} {weight.dtype})")
    if not why and (target.shape != hidden.shape[:-1] or target.dtype not in (torch.int64, torch.int32)):
        why = f"the kernel takes int64/int32 targets of shape {tuple(hidden.shape[:-1])}, not {tuple(target.shape)} {target.dtype}"
    if why:
        _to_reference("linear_cross_entropy", hidden, why)
        return _linear_cross_entropy(hidden, weight, target, ignore_index, reduction)
    return library.linear_cross_entropy(hidden, weight, target, ignore_index, reduction)


WRAPPERS: tuple[tuple[str, Callable[..., object], str], ...] = (
    ("rms_norm", triton_rms_norm, "norm"),
    ("add_rms_norm", triton_add_rms_norm, "norm"),
    ("rotary_embedding", triton_rotary_embedding, "rope"),
    ("swiglu", triton_swiglu, "swiglu"),
    ("linear_cross_entropy", triton_linear_cross_entropy, "linear_ce"),
)
