"""The standard ops every backend serves, with their reference (plain PyTorch) implementations.

Use them as functions: ``from hal import ops; y = ops.rms_norm(x, w, eps=1e-6)``. Vendor fused
ops and Triton kernels (``hal.kernels.*``) register further implementations in ``registry``; callers
never change.
Reference semantics are the contract every other implementation must match.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hal.backend_registry import all_backends, backend_for_device_type
from hal.ops.registry import FLOAT_DTYPES, Contributor, OpRegistry


def _backend_name(device_type: str) -> str:
    return backend_for_device_type(device_type).name


def _backend_contributors() -> list[tuple[str, Contributor]]:
    """Plug-in backends may still add their own implementations (built-in ones live in hal.kernels)."""
    return [(f"backend {backend.name}", backend.register_ops) for backend in all_backends().values()]


# Kernel modules arrive through the hal.kernels entry points (op_registry.kernel_entry_points).
registry = OpRegistry(backend_of=_backend_name, contributors=_backend_contributors)

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T + bias (weight is (out_features, in_features))."""
    return F.linear(x, weight, bias)


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Matrix product with broadcasting, as torch.matmul."""
    return torch.matmul(a, b)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(mean(x², last dim) + eps) * weight, accumulated in fp32 for fp16/bf16 inputs."""
    xf = x.float() if x.dtype in _LOW_PRECISION else x
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(y.dtype)).to(x.dtype)


def _add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h, weight, eps), h) with h = x + residual: a pre-norm block's residual step, which a kernel
    fuses into one pass (read x and residual once, write h and the normalised h)."""
    h = x + residual
    return _rms_norm(h, weight, eps), h


def _layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """Layer normalisation over the last dimension."""
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def _softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax along ``dim``."""
    return torch.softmax(x, dim=dim)


def _gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU; ``approximate='tanh'`` for the tanh form."""
    return F.gelu(x, approximate=approximate)


def _silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x)."""
    return F.silu(x)


def _swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Split ``x`` in two halves a, b along ``dim``; return silu(a) * b (torch_npu.npu_swiglu's semantics)."""
    a, b = x.chunk(2, dim=dim)
    return F.silu(a) * b


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, cos/sin broadcast against x (torch_npu.npu_rotary_mul's semantics)."""
    return x * cos + rotate_half(x) * sin


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention over (batch, heads, seq, head_dim); k/v may have fewer heads (grouped-query attention)."""
    if k.shape[-3] != q.shape[-3]:
        groups = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(groups, dim=-3)
        v = v.repeat_interleave(groups, dim=-3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


def _cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """Cross-entropy of (N, C) logits against (N,) class indices."""
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)


def _linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T, target) for hidden (..., H), weight (V, H), target (...): the LM head and
    its loss in one op, so a kernel can chunk it over tokens and never hold the (..., V) logits. The loss is
    computed and returned in fp32 for fp16/bf16 (fp64 stays fp64): a sum over thousands of tokens rounded
    to bf16 would keep two or three significant digits of the training loss."""
    logits = F.linear(hidden, weight)
    logits = logits.float() if logits.dtype in _LOW_PRECISION else logits
    loss = _cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index, reduction)
    return loss.reshape(target.shape) if reduction == "none" else loss


def _embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows of ``weight`` picked by integer ``ids``."""
    return F.embedding(ids, weight)


linear = registry.define("linear", _linear)
matmul = registry.define("matmul", _matmul)
rms_norm = registry.define("rms_norm", _rms_norm)
add_rms_norm = registry.define("add_rms_norm", _add_rms_norm)
layer_norm = registry.define("layer_norm", _layer_norm)
softmax = registry.define("softmax", _softmax)
gelu = registry.define("gelu", _gelu)
silu = registry.define("silu", _silu)
swiglu = registry.define("swiglu", _swiglu)
rotary_embedding = registry.define("rotary_embedding", _rotary_embedding)
scaled_dot_product_attention = registry.define("scaled_dot_product_attention", _sdpa)
cross_entropy = registry.define("cross_entropy", _cross_entropy)
linear_cross_entropy = registry.define("linear_cross_entropy", _linear_cross_entropy)
embedding = registry.define("embedding", _embedding, dispatch_arg=1)

STANDARD_DTYPES = FLOAT_DTYPES
