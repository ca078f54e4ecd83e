"""Ascend's fused ops from torch_npu as implementations of hal registry ops (rms_norm, attention,
rotary embedding, swiglu); loaded through the ``hal.kernels`` entry point ``ascend``.

torch_npu is imported lazily: by the ``requires`` checks when the registry chooses, and by the
wrappers when they run — never when this module is imported or its ops registered. Each wrapper
reproduces the reference in ``hal.ops`` exactly; argument combinations the vendor op cannot express
go to the reference through ``record_downgrade`` (never silently).

NOT verified on Ascend hardware: written against Huawei's public docs, cited next to each call.
"""
from __future__ import annotations

import importlib
import math
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable

import torch

from hal.backends.ascend import PACKAGE, AscendBackend, find_runtime
from hal.downgrades import Downgrade, record_downgrade
from hal.errors import UnsupportedError
from hal.ops import registry as ops_registry

# The references each fused op runs instead where it cannot serve an input (the downgrade is recorded).
_rms_norm, _rotary_embedding, _sdpa, _swiglu = (
    ops_registry.reference(op) for op in ("rms_norm", "rotary_embedding", "scaled_dot_product_attention", "swiglu"))

if TYPE_CHECKING:
    from hal.ops.registry import OpRegistry

NPU_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)

# Op documentation (also cited next to each call); the op-plugin repository holds torch_npu's API pages.
_OP_DOCS = "https://gitcode.com/Ascend/op-plugin/blob/master/docs/context"
DOC_RMS_NORM = "https://www.hiascend.com/document/detail/zh/Pytorch/700/apiref/apilist/ptaoplist_000860.html"
DOC_FUSION_ATTENTION = f"{_OP_DOCS}/torch_npu-npu_fusion_attention.md"
DOC_ROTARY_MUL = f"{_OP_DOCS}/torch_npu-npu_rotary_mul.md"
DOC_SWIGLU = "https://www.hiascend.com/document/detail/zh/Pytorch/600/apiref/apilist/ptaoplist_000834.html"


def register(registry: OpRegistry) -> None:
    """torch_npu's fused kernels for rms_norm, attention, rotary embedding and swiglu, on the ascend backend."""
    for op, impl, fn, doc in FUSED_OPS:
        registry.register(
            op, impl, backends=[AscendBackend.name], dtypes=list(NPU_DTYPES), priority=20,
            requires=requires_torch_npu(impl), source=f"torch_npu.{impl} ({doc})",
        )(fn)


def requires_torch_npu(attr: str) -> Callable[[], str | None]:
    """A registry ``requires`` check: None when torch_npu has ``attr``; never imports an absent package."""

    def check() -> str | None:
        package, why = _runtime()
        if package is None:
            return why
        if not callable(getattr(package, attr, None)):
            return f"this torch_npu ({getattr(package, '__version__', '?')}) has no {attr}; upgrade torch-npu"
        return None

    return check


def _runtime() -> tuple[ModuleType | None, str]:
    """torch_npu or its stand-in (``find_runtime``), or (None, why) — a ``requires`` check answers, never raises."""
    try:
        return find_runtime()
    except UnsupportedError as exc:  # another vendor runtime owns this process's device, or torch cannot host one
        return None, str(exc)


def _torch_npu() -> ModuleType:
    """torch_npu for a wrapper that runs (its ``requires`` check already imported it)."""
    return sys.modules.get(PACKAGE) or importlib.import_module(PACKAGE)


def _to_reference(op: str, impl: str, dtype: torch.dtype, why: str) -> None:
    """Record (or refuse, under fallback: error) running the reference instead of ``impl``."""
    subject = f"{op} on ascend/{str(dtype).replace('torch.', '')}"
    record_downgrade(Downgrade("op", subject, impl, "reference", why))


# --- rms_norm ------------------------------------------------------------------------------------
def npu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """hal rms_norm on torch_npu.npu_rms_norm(self, gamma, epsilon=1e-6) -> (y, rstd) (DOC_RMS_NORM)."""
    why = _rms_norm_unsupported(x, weight)
    if why:
        _to_reference("rms_norm", "npu_rms_norm", x.dtype, why)
        return _rms_norm(x, weight, eps)
    # torch_npu.npu_rms_norm(self, gamma, epsilon=1e-06) -> (y, rstd); fp16/bf16/fp32, gamma in self's dtype:
    # https://www.hiascend.com/document/detail/zh/Pytorch/700/apiref/apilist/ptaoplist_000860.html
    return _torch_npu().npu_rms_norm(x, weight, epsilon=float(eps))[0]


def _rms_norm_unsupported(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    if x.dtype not in NPU_DTYPES:
        return f"npu_rms_norm takes float16/bfloat16/float32, not {x.dtype}"
    if weight.dtype != x.dtype:
        # The op needs gamma in the input's dtype; casting it would change the reference's rounding.
        return f"npu_rms_norm needs the weight in the input's dtype (input {x.dtype}, weight {weight.dtype})"
    if weight.dim() != 1 or x.dim() < 2 or weight.shape[0] != x.shape[-1]:
        # npu_rms_norm normalises over gamma's dims; hal's reference over the last dim only.
        return f"npu_rms_norm needs a 1-D weight of size x.shape[-1] (x {tuple(x.shape)}, weight {tuple(weight.shape)})"
    if x.dim() > 8:
        return f"npu_rms_norm takes 2-8-D input, not {x.dim()}-D"
    return None


# --- scaled_dot_product_attention ------------------------------------------------------------------
_CAUSAL_MASKS: dict[torch.device, torch.Tensor] = {}


def _left_up_causal_mask(device: torch.device) -> torch.Tensor:
    """The compressed 2048x2048 mask sparse_mode=2 (leftUpCausal) documents: True above the diagonal."""
    mask = _CAUSAL_MASKS.get(device)
    if mask is None:
        mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=device), diagonal=1)
        _CAUSAL_MASKS[device] = mask
    return mask


def npu_fusion_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """hal scaled_dot_product_attention on torch_npu.npu_fusion_attention (DOC_FUSION_ATTENTION).

    Our layout is (B, H, S, D) = "BNSD"; head_num is q's head count and fewer kv heads (GQA, Nq/Nkv
    an integer) are native. The op's scale defaults to 1.0, so torch's 1/sqrt(D) is passed
    explicitly. torch's is_causal is the top-left aligned triangle = sparse_mode 2 (leftUpCausal)
    with the compressed 2048x2048 mask. A boolean attn_mask means True = attend in torch but
    True = masked out for atten_mask, so it is inverted; it goes as SS, B1SS, 11SS or BNSS, and
    query rows with every key masked come out 0 as in torch. Returns output [0] of the op's 7-tuple.
    """
    why = _sdpa_unsupported(q, k, v, attn_mask, is_causal)
    if why:
        _to_reference("scaled_dot_product_attention", "npu_fusion_attention", q.dtype, why)
        return _sdpa(q, k, v, attn_mask, is_causal, scale)
    batch, heads, s_q, head_dim = q.shape
    s_kv = k.shape[2]
    kwargs: dict[str, Any] = {
        "scale": 1.0 / math.sqrt(head_dim) if scale is None else float(scale),
        "keep_prob": 1.0,  # no dropout: the reference has none
    }
    masked: torch.Tensor | None = None
    if is_causal:
        kwargs["atten_mask"] = _left_up_causal_mask(q.device)
        kwargs["sparse_mode"] = 2
    elif attn_mask is not None:
        masked = _ascend_mask(attn_mask, batch, heads, s_q, s_kv)
        kwargs["atten_mask"] = masked
        kwargs["sparse_mode"] = 0  # defaultMask; default pre/next_tockens keep the whole mask in force
    # torch_npu.npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
    #   atten_mask=None, scale=1., keep_prob=1., pre_tockens=2147483647, next_tockens=2147483647, ...,
    #   sparse_mode=0, ...) -> (attention_out, softmax_max, softmax_sum, reserved, seed, offset, mask_len):
    # https://gitcode.com/Ascend/op-plugin/blob/master/docs/context/torch_npu-npu_fusion_attention.md
    # https://hiascend.com/document/detail/zh/Pytorch/60RC2/apiref/apilist/ptaoplist_000142.html
    out = _torch_npu().npu_fusion_attention(q, k, v, heads, "BNSD", **kwargs)[0]
    if masked is not None:
        # torch returns 0 for a query row whose keys are all masked out; the op's value there is not
        # documented, so set it on the device (no host sync).
        out = out.masked_fill(masked.all(dim=-1, keepdim=True), 0)
    return out


def _sdpa_unsupported(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool
) -> str | None:
    if is_causal and attn_mask is not None:
        # torch's answer depends on its SDPA backend (math raises, the CPU kernel intersects both).
        return "attn_mask with is_causal=True has no single torch meaning to reproduce"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "npu_fusion_attention here takes 4-D (batch, heads, seq, head_dim) q/k/v"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in NPU_DTYPES:
        return f"npu_fusion_attention needs q/k/v of one dtype in float16/bfloat16/float32 ({q.dtype}, {k.dtype}, {v.dtype})"
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        return f"npu_fusion_attention needs k and v of one shape and q's batch/head_dim (q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)})"
    if not 1 <= q.shape[-1] <= 768:
        return f"npu_fusion_attention takes head_dim 1..768, not {q.shape[-1]}"
    n_q, n_kv = q.shape[1], k.shape[1]
    if n_kv == 0 or n_q % n_kv or not 1 <= n_q <= 256:
        return f"npu_fusion_attention needs q heads (1..256) to be a multiple of kv heads ({n_q} vs {n_kv})"
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool:
            return f"npu_fusion_attention's atten_mask is boolean; an additive {attn_mask.dtype} mask cannot be expressed"
        full = (q.shape[0], n_q, q.shape[2], k.shape[2])
        try:
            fits = 2 <= attn_mask.dim() <= 4 and tuple(torch.broadcast_shapes(attn_mask.shape, full)) == full
        except RuntimeError:
            fits = False
        if not fits:
            return f"attn_mask {tuple(attn_mask.shape)} does not broadcast to {full}"
    return None


def _ascend_mask(attn_mask: torch.Tensor, batch: int, heads: int, s_q: int, s_kv: int) -> torch.Tensor:
    """torch's keep-mask as Ascend's masked-out mask, in a documented shape (SS, B1SS, 11SS, BNSS)."""
    masked = torch.logical_not(attn_mask)
    if masked.dim() == 2:
        return masked.expand(s_q, s_kv).contiguous()
    while masked.dim() < 4:
        masked = masked.unsqueeze(0)
    b = batch if masked.shape[0] != 1 else 1
    n = heads if masked.shape[1] != 1 else 1
    if n != 1:
        b = batch  # 1NSS is not a documented layout: widen to BNSS
    return masked.expand(b, n, s_q, s_kv).contiguous()


# --- rotary_embedding ----------------------------------------------------------------------------
# Broadcast patterns of r1/r2 over the first three dims that DOC_ROTARY_MUL lists for the half mode
# (1 = the input's size, 0 = size 1): BNSD: 11SD/B1SD/BNSD, BSND: 1S1D/BS1D/BSND, SBND: S11D/SB1D/SBND.
_ROTARY_PATTERNS = frozenset({(0, 0, 1), (1, 0, 1), (0, 1, 0), (1, 1, 0), (1, 0, 0), (1, 1, 1)})


def npu_rotary_mul(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """hal rotary_embedding on torch_npu.npu_rotary_mul(input, r1, r2) (DOC_ROTARY_MUL).

    The default "half" mode computes r1 * x + r2 * cat(-x2, x1) over the two halves of the last dim,
    which is the reference's x * cos + rotate_half(x) * sin with r1 = cos, r2 = sin.
    """
    if x.dim() == 4 and cos.dim() < 4 and cos.shape == sin.shape:  # hal's (S, D) tables broadcast as 11SD (BNSD)
        cos, sin = (t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) for t in (cos, sin))
    why = _rotary_unsupported(x, cos, sin)
    if why:
        _to_reference("rotary_embedding", "npu_rotary_mul", x.dtype, why)
        return _rotary_embedding(x, cos, sin)
    # torch_npu.npu_rotary_mul(input, r1, r2, rotary_mode='half') -> Tensor (4-D, same shape/dtype as input):
    # https://gitcode.com/Ascend/op-plugin/blob/master/docs/context/torch_npu-npu_rotary_mul.md
    return _torch_npu().npu_rotary_mul(x, cos, sin)


def _rotary_unsupported(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    if x.dim() != 4 or cos.dim() != 4 or cos.shape != sin.shape:
        return f"npu_rotary_mul takes 4-D input and 4-D cos/sin of one shape (x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)})"
    if not (x.dtype == cos.dtype == sin.dtype) or x.dtype not in NPU_DTYPES:
        # The reference would type-promote mixed dtypes; the op returns the input's dtype.
        return f"npu_rotary_mul needs x/cos/sin of one dtype in float16/bfloat16/float32 ({x.dtype}, {cos.dtype}, {sin.dtype})"
    head_dim = x.shape[-1]
    if head_dim % 2 or head_dim >= 896 or cos.shape[-1] != head_dim:
        return f"npu_rotary_mul needs an even head_dim below 896 shared by cos/sin (x {head_dim}, cos {cos.shape[-1]})"
    if not any(
        all((c == s) if full else (c == 1) for c, s, full in zip(cos.shape[:3], x.shape[:3], pattern))
        for pattern in _ROTARY_PATTERNS
    ):
        return f"cos/sin shape {tuple(cos.shape)} is not a broadcast layout npu_rotary_mul documents for x {tuple(x.shape)}"
    return None


# --- swiglu ----------------------------------------------------------------------------------------
def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """hal swiglu on torch_npu.npu_swiglu(input, dim=-1): silu(A) * B of the halves along dim (DOC_SWIGLU)."""
    why = None
    if x.dtype not in NPU_DTYPES or not 1 <= x.dim() <= 8 or x.numel() == 0:
        why = f"npu_swiglu takes non-empty 1-8-D float16/bfloat16/float32 input ({x.dtype}, {tuple(x.shape)})"
    elif not -x.dim() <= dim < x.dim():
        return _swiglu(x, dim)  # invalid for the reference too: raise its own error
    elif x.shape[dim] % 2:
        why = f"npu_swiglu needs an even size along dim {dim}, not {x.shape[dim]}"
    if why:
        _to_reference("swiglu", "npu_swiglu", x.dtype, why)
        return _swiglu(x, dim)
    # torch_npu.npu_swiglu(input, dim=-1) -> Tensor; no non-contiguous or empty input, even size along dim:
    # https://www.hiascend.com/document/detail/zh/Pytorch/600/apiref/apilist/ptaoplist_000834.html
    return _torch_npu().npu_swiglu(x.contiguous(), dim=dim)


FUSED_OPS: tuple[tuple[str, str, Callable[..., torch.Tensor], str], ...] = (
    ("rms_norm", "npu_rms_norm", npu_rms_norm, DOC_RMS_NORM),
    ("scaled_dot_product_attention", "npu_fusion_attention", npu_fusion_attention, DOC_FUSION_ATTENTION),
    ("rotary_embedding", "npu_rotary_mul", npu_rotary_mul, DOC_ROTARY_MUL),
    ("swiglu", "npu_swiglu", npu_swiglu, DOC_SWIGLU),
)
