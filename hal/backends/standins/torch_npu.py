"""The torch_npu stand-in: Huawei Ascend's ``npu`` device over host memory, HCCL as the stand-in process group.

What it keeps of the real runtime, each from Huawei's documentation: no float64 compute on the NPU (the catalog
and ``backends/ascend.py`` say so), the HF32 switches ``torch_npu.npu.matmul.allow_hf32`` (default False) and
``torch_npu.npu.conv.allow_hf32`` (default True), and the fused operators ``hal.kernels.ascend`` calls —
``npu_rms_norm``, ``npu_rotary_mul``, ``npu_swiglu``, ``npu_fusion_attention`` — written in plain torch from their
documented semantics, refusing the arguments the documentation refuses. Their numerics are the host's, not the
NPU's kernels'.
"""
from __future__ import annotations

import types

import torch

from .host_device import Limits
from .runtime import Model, Vendor

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(f"torch_npu stand-in: {message} (as the documented operator requires)")


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """RmsNorm over gamma's trailing dims, gamma in x's dtype; returns (y, rstd) with rstd in float32."""
    _require(x.dtype in FLOATS and gamma.dtype == x.dtype, "gamma must have self's float dtype")
    _require(tuple(gamma.shape) == tuple(x.shape[x.dim() - gamma.dim():]), "gamma must match the trailing dims")
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def npu_rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half") -> torch.Tensor:
    """half mode: r1 * x + r2 * cat(-x2, x1), r1 and r2 broadcast over the documented BNSD/BSND/SBND layouts."""
    _require(rotary_mode == "half", "the stand-in has the half mode only")
    _require(x.dim() == 4 and r1.dim() == 4 and r1.shape == r2.shape, "4-D input, r1 and r2 of one shape")
    _require(x.dtype == r1.dtype == r2.dtype and x.dtype in FLOATS, "one float dtype")
    a, b, c, d = x.shape
    _require(d % 2 == 0 and d < 896 and r1.shape[-1] == d, "an even head dim below 896")
    allowed = {(1, 1, c, d), (a, 1, c, d), (a, b, c, d), (1, b, 1, d), (a, b, 1, d), (a, 1, 1, d)}
    _require(tuple(r1.shape) in allowed, f"r1 shape {tuple(r1.shape)} is not a documented layout")
    x1, x2 = torch.chunk(x, 2, -1)
    return r1 * x + r2 * torch.cat((-x2, x1), dim=-1)


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """swish(A) * B for the two halves A, B of x along dim."""
    _require(x.is_contiguous(), "a contiguous input")
    _require(x.numel() > 0 and x.shape[dim] % 2 == 0, "dim splits evenly")
    a, b = torch.split(x, x.shape[dim] // 2, dim=dim)
    return a * torch.sigmoid(a) * b


def npu_fusion_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int,
                         input_layout: str, pse: torch.Tensor | None = None, padding_mask: torch.Tensor | None = None,
                         atten_mask: torch.Tensor | None = None, scale: float = 1.0, keep_prob: float = 1.0,
                         pre_tockens: int = 2147483647, next_tockens: int = 2147483647, inner_precise: int = 0,
                         prefix: list[int] | None = None, actual_seq_qlen: list[int] | None = None,
                         actual_seq_kvlen: list[int] | None = None, sparse_mode: int = 0,
                         gen_mask_parallel: bool = True, sync: bool = False) -> tuple[torch.Tensor, ...]:
    """Attention in the BNSD layout (atten_mask True: masked out; sparse_mode 2 / 3: top-left / bottom-right causal
    from the compressed 2048 x 2048 mask), grouped kv heads; the result and softmax max / sum, as documented."""
    _require(input_layout == "BNSD", "the stand-in has the BNSD layout only")
    _require(query.dtype == key.dtype == value.dtype and query.dtype in FLOATS, "q, k, v of one float dtype")
    _require(key.shape == value.shape, "key and value of one shape")
    b, n, s_q, _ = query.shape
    n_kv, s_kv = key.shape[1], key.shape[2]
    _require(head_num == n and n % n_kv == 0, "head_num is q's heads, a multiple of kv's")
    _require(pse is None and padding_mask is None and prefix is None and keep_prob == 1.0,
             "pse, padding_mask, prefix and dropout are not in the stand-in")
    _require(pre_tockens == 2147483647 and next_tockens == 2147483647, "band modes are not in the stand-in")
    group = torch.arange(n, device=query.device) // (n // n_kv)
    k, v = key[:, group].float(), value[:, group].float()
    scores = (query.float() @ k.transpose(-1, -2)) * scale
    if atten_mask is not None:
        _require(atten_mask.dtype in (torch.bool, torch.uint8), "a bool or uint8 atten_mask")
        if sparse_mode in (0, 1):
            masked = atten_mask.bool()
        elif sparse_mode in (2, 3):
            _require(tuple(atten_mask.shape) == (2048, 2048), "sparse_mode 2 / 3 take the 2048 x 2048 mask")
            ones = torch.ones(s_q, s_kv, dtype=torch.bool, device=query.device)
            masked = ones.triu(1) if sparse_mode == 2 else ones.triu(s_kv - s_q + 1)
        else:
            raise RuntimeError(f"torch_npu stand-in: sparse_mode {sparse_mode} is not in the stand-in")
        scores = scores.masked_fill(masked, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = (probs @ v).to(query.dtype)
    return out, probs.amax(-1), probs.sum(-1), torch.empty(0, device=query.device), 0, 0, 0


def _extend(package: types.ModuleType, dev: types.ModuleType, model: Model) -> None:
    dev.matmul = types.SimpleNamespace(allow_hf32=False)  # torch_npu's defaults
    dev.conv = types.SimpleNamespace(allow_hf32=True)
    for op in (npu_rms_norm, npu_rotary_mul, npu_swiglu, npu_fusion_attention):
        setattr(package, op.__name__, op)


ASCEND = Vendor(
    backend="ascend", package="torch_npu", device_type="npu",
    models={"Ascend910B2": Model("Ascend910B2", 64)},
    limits=Limits(frozenset({torch.float64}), "the NPU has no float64 compute (torch_npu; backends/ascend.py)"),
    # HCCL's collective list has no Gather (Scatter came with newer CANN), and its reductions no float64 (CANN HCCL
    # API reference)
    ccl="hccl", ccl_lacks=frozenset({"gather"}), ccl_no_reduce=frozenset({torch.float64}), extend=_extend)

__all__ = ["ASCEND", "npu_fusion_attention", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu"]
