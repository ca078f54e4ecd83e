"""The onnx suite: third-party golden data — ONNX backend node tests run through the HAL ops.

Each ONNX node test whose op maps onto a HAL op (``MAPPERS``) becomes one case: its inputs go to
``ctx.device`` as torch tensors, the HAL op (dispatched by the registry, as user code would call it)
computes the result, and ``tolerances.judge`` compares it with the test's expected output under the
HAL op's category. A test whose attributes or inputs the HAL op cannot express (Gemm's alpha,
interleaved rotary, class weights, ...) is ``unsupported`` with the reason; nothing is skipped silently.
Without onnx installed every case is ``unsupported`` with the install hint.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import numpy as np
import torch

from hal.conformance.cases import Case, Context, Outcome, skip, unsupported
from hal.conformance.suites import onnx_cases
from hal.conformance.suites.onnx_cases import NodeTest
from hal.conformance.verdicts.tolerances import OP_CATEGORY, dtype_name, judge, override, tolerance_for

SUITE = "onnx"
Tensors = list["torch.Tensor | None"]


@dataclass(frozen=True)
class Mapped:
    """How one node test runs on HAL: the op, a call over the test's inputs (on the device), K."""

    op: str
    call: Callable[[Tensors], torch.Tensor]
    k: int
    note: str = ""  # e.g. outputs of the ONNX node that HAL does not produce


Mapper = Callable[[NodeTest], "Mapped | str"]  # a str is the reason the test cannot be mapped


def _hal(op: str) -> Callable[..., torch.Tensor]:
    from hal import ops

    return getattr(ops, op)


def _extra_outputs(test: NodeTest, produced: int = 1) -> str:
    if len(test.outputs) <= produced:
        return ""
    return f"output 0 compared; ONNX outputs {produced}..{len(test.outputs) - 1} have no HAL counterpart"


def _axis(test: NodeTest, rank: int, default: int = -1) -> int:
    axis = int(test.attrs.get("axis", default))
    return axis + rank if axis < 0 else axis


# --- mappers -----------------------------------------------------------------------------------------------


def _softmax(test: NodeTest) -> Mapped | str:
    x = test.inputs[0]
    assert x is not None
    axis = _axis(test, x.ndim, -1 if test.opset >= 13 else 1)
    if test.opset < 13 and axis != x.ndim - 1:
        return f"Softmax-{test.opset} flattens the input to 2-D at axis {axis}; HAL softmax normalises one dim"
    return Mapped("softmax", lambda t: _hal("softmax")(t[0], dim=axis), int(x.shape[axis]) if x.ndim else 1)


def _flatten_trailing(x: torch.Tensor, axis: int) -> torch.Tensor:
    return x.reshape(*x.shape[:axis], -1)


def _normalization(test: NodeTest, op: str) -> Mapped | str:
    x, scale = test.inputs[0], test.inputs[1]
    assert x is not None and scale is not None
    axis = _axis(test, x.ndim)
    normalized = tuple(x.shape[axis:])
    if tuple(scale.shape) != normalized:
        return f"scale of shape {tuple(scale.shape)} broadcasts over {normalized}; HAL {op} takes one weight per element"
    bias = test.inputs[2] if len(test.inputs) > 2 else None
    if bias is not None and tuple(bias.shape) != normalized:
        return f"bias of shape {tuple(bias.shape)} broadcasts over {normalized}; HAL layer_norm takes one per element"
    eps = float(test.attrs.get("epsilon", 1e-5))
    k = int(np.prod(normalized)) if normalized else 1

    def call(t: Tensors) -> torch.Tensor:
        xt, wt = t[0], t[1]
        assert xt is not None and wt is not None
        flat = _flatten_trailing(xt, axis)  # normalising dims axis.. equals normalising their flattening
        if op == "layer_norm":
            bt = t[2] if len(t) > 2 else None
            y = _hal("layer_norm")(flat, wt.reshape(-1), None if bt is None else bt.reshape(-1), eps)
        else:
            y = _hal("rms_norm")(flat, wt.reshape(-1), eps)
        return y.reshape(xt.shape)

    note = f"normalised over dims {axis}.. (flattened)" if axis != x.ndim - 1 else ""
    extra = _extra_outputs(test)
    return Mapped(op, call, k, "; ".join(n for n in (note, extra) if n))


def _gelu(test: NodeTest) -> Mapped | str:
    approximate = str(test.attrs.get("approximate", "none"))
    return Mapped("gelu", lambda t: _hal("gelu")(t[0], approximate=approximate), 1)


def _swish(test: NodeTest) -> Mapped | str:
    alpha = float(test.attrs.get("alpha", 1.0))
    if alpha != 1.0:
        return f"Swish alpha={alpha:g}; HAL silu is x * sigmoid(x) (alpha 1)"
    return Mapped("silu", lambda t: _hal("silu")(t[0]), 1)


def _swiglu(test: NodeTest) -> Mapped | str:
    alpha = float(test.attrs.get("alpha", 1.0))
    if alpha != 1.0:
        return f"SwiGLU alpha={alpha:g}; HAL swiglu is silu(a) * b (alpha 1)"
    if len(test.inputs) != 2 or any(i is None for i in test.inputs):
        return f"SwiGLU with {len(test.inputs)} input(s); mapped only as (a, b)"
    # HAL swiglu splits one tensor in halves: silu(x[..., :h]) * x[..., h:]
    return Mapped("swiglu", lambda t: _hal("swiglu")(torch.cat([t[0], t[1]], dim=-1), dim=-1), 1,
                  "a and b concatenated on the last dim")


def _matmul(test: NodeTest) -> Mapped | str:
    a = test.inputs[0]
    assert a is not None
    return Mapped("matmul", lambda t: _hal("matmul")(t[0], t[1]), int(a.shape[-1]))


def _gemm(test: NodeTest) -> Mapped | str:
    alpha, beta = float(test.attrs.get("alpha", 1.0)), float(test.attrs.get("beta", 1.0))
    a, b = test.inputs[0], test.inputs[1]
    c = test.inputs[2] if len(test.inputs) > 2 else None
    assert a is not None and b is not None
    if alpha != 1.0 or (beta != 1.0 and c is not None):
        return f"Gemm alpha={alpha:g}, beta={beta:g}: not expressible as HAL linear (x @ W.T + bias)"
    trans_a, trans_b = bool(test.attrs.get("transA", 0)), bool(test.attrs.get("transB", 0))
    k = int(a.shape[0] if trans_a else a.shape[1])
    n = int(b.shape[0] if trans_b else b.shape[1])
    if c is not None and not (c.size == 1 or (c.size == n and tuple(c.shape) in ((n,), (1, n)))):
        return f"Gemm bias of shape {tuple(c.shape)}: HAL linear takes one bias per output feature"

    def call(t: Tensors) -> torch.Tensor:
        at, bt, ct = t[0], t[1], (t[2] if len(t) > 2 else None)
        assert at is not None and bt is not None
        x = at.t() if trans_a else at
        weight = bt if trans_b else bt.t()  # linear's weight is (out_features, in_features)
        bias = None if ct is None else ct.reshape(-1).expand(n).contiguous()
        return _hal("linear")(x, weight, bias)

    return Mapped("linear", call, k, "transposes passed as views" if (trans_a or not trans_b) else "")


def _gather(test: NodeTest) -> Mapped | str:
    data, indices = test.inputs[0], test.inputs[1]
    assert data is not None and indices is not None
    if int(test.attrs.get("axis", 0)) != 0:
        return f"Gather axis={test.attrs['axis']}: HAL embedding gathers rows (axis 0)"
    if not np.issubdtype(data.dtype, np.floating):
        return f"Gather of {data.dtype} data: HAL embedding takes a float weight"
    if (indices < 0).any():
        return "negative indices (ONNX counts them from the end; HAL embedding takes 0..V-1)"

    def call(t: Tensors) -> torch.Tensor:
        dt, it = t[0], t[1]
        assert dt is not None and it is not None
        weight = dt.reshape(dt.shape[0], -1)
        return _hal("embedding")(it.long(), weight).reshape(*it.shape, *dt.shape[1:])

    return Mapped("embedding", call, 1, "data as a (rows, features) weight" if data.ndim != 2 else "")


def _cross_entropy(test: NodeTest) -> Mapped | str:
    scores, labels = test.inputs[0], test.inputs[1]
    assert scores is not None and labels is not None
    if len(test.inputs) > 2 and test.inputs[2] is not None:
        return "class weights: HAL cross_entropy has no weight argument"
    reduction = str(test.attrs.get("reduction", "mean"))
    ignore_index = int(test.attrs.get("ignore_index", -100))
    if "ignore_index" not in test.attrs and (labels == ignore_index).any():
        return "labels equal to -100 without ignore_index"
    classes = int(scores.shape[1])

    def call(t: Tensors) -> torch.Tensor:
        st, lt = t[0], t[1]
        assert st is not None and lt is not None
        logits = st.movedim(1, -1).reshape(-1, classes)  # (N, C, d1..) -> (N * d1.., C)
        loss = _hal("cross_entropy")(logits, lt.reshape(-1).long(), ignore_index=ignore_index, reduction=reduction)
        return loss.reshape(lt.shape) if reduction == "none" else loss

    notes = ["(N, C, d..) flattened to (N*d.., C)" if scores.ndim > 2 else "", _extra_outputs(test)]
    return Mapped("cross_entropy", call, classes, "; ".join(n for n in notes if n))


def _rotary(test: NodeTest) -> Mapped | str:
    x = test.inputs[0]
    assert x is not None
    if int(test.attrs.get("interleaved", 0)):
        return "interleaved rotary (pairs x[2i], x[2i+1]); HAL rotary_embedding rotates halves (rotate_half)"
    num_heads = int(test.attrs.get("num_heads", 0))
    if x.ndim == 3 and not num_heads:
        return "3-D input without num_heads"
    rd = int(test.attrs.get("rotary_embedding_dim", 0))
    has_positions = len(test.inputs) > 3 and test.inputs[3] is not None

    def call(t: Tensors) -> torch.Tensor:
        xt, cos, sin = t[0], t[1], t[2]
        assert xt is not None and cos is not None and sin is not None
        if xt.dim() == 3:  # (B, S, H*D) -> (B, H, S, D)
            b, s, _ = xt.shape
            x4 = xt.reshape(b, s, num_heads, -1).transpose(1, 2)
        else:
            x4 = xt
        if has_positions:
            positions = t[3]
            assert positions is not None
            cos, sin = cos[positions.long()], sin[positions.long()]  # (B, S, rd/2)
        width = rd or x4.shape[-1]
        # ONNX caches hold one angle per pair; rotate_half pairs i with i + width/2, so repeat the halves
        cos_full = torch.cat([cos, cos], dim=-1).unsqueeze(1)
        sin_full = torch.cat([sin, sin], dim=-1).unsqueeze(1)
        rotated = _hal("rotary_embedding")(x4[..., :width], cos_full, sin_full)
        out = torch.cat([rotated, x4[..., width:]], dim=-1) if width < x4.shape[-1] else rotated
        if xt.dim() == 3:
            out = out.transpose(1, 2).reshape(xt.shape)
        return out

    note = f"partial rotation of the first {rd} dims" if rd else ""
    return Mapped("rotary_embedding", call, 2, note)


_ATTENTION_UNMAPPED = {
    "softcap": "softcap (tanh capping of the scores)",
    "qk_matmul_output_mode": "qk_matmul_output_mode (a second output of intermediate scores)",
    "softmax_precision": "softmax_precision",
}


def _attention(test: NodeTest) -> Mapped | str:
    for attr, what in _ATTENTION_UNMAPPED.items():
        if test.attrs.get(attr, 0) not in (0, 0.0):
            return f"{what}: HAL scaled_dot_product_attention has no counterpart"
    for attr in ("left_window_size", "right_window_size"):
        if int(test.attrs.get(attr, -1)) >= 0:
            return "sliding-window attention: HAL scaled_dot_product_attention has no window argument"
    names = ("past_key", "past_value", "nonpad_kv_seqlen")
    for index, name in enumerate(names, start=4):
        if len(test.inputs) > index and test.inputs[index] is not None:
            return f"{name} (KV cache): HAL scaled_dot_product_attention takes the full K/V"
    if len(test.outputs) > 1:
        return f"{len(test.outputs)} outputs requested (present K/V or scores); HAL returns the attention output only"
    q, k, v = test.inputs[0], test.inputs[1], test.inputs[2]
    assert q is not None and k is not None and v is not None
    mask = test.inputs[3] if len(test.inputs) > 3 else None
    q_heads, kv_heads = int(test.attrs.get("q_num_heads", 0)), int(test.attrs.get("kv_num_heads", 0))
    if q.ndim == 3 and not (q_heads and kv_heads):
        return "3-D inputs without q_num_heads / kv_num_heads"
    lk = int(k.shape[-2]) if k.ndim == 4 else int(k.shape[1])
    if mask is not None and mask.shape[-1] != lk:
        return f"attn_mask over {mask.shape[-1]} keys for {lk} keys (ONNX pads it with -inf)"
    causal = bool(test.attrs.get("is_causal", 0))
    scale = test.attrs.get("scale")
    head_dim = int(q.shape[-1]) if q.ndim == 4 else int(q.shape[-1]) // q_heads

    def heads(x: torch.Tensor, n: int) -> torch.Tensor:  # (B, S, H*D) -> (B, H, S, D)
        return x.reshape(x.shape[0], x.shape[1], n, -1).transpose(1, 2)

    def call(t: Tensors) -> torch.Tensor:
        qt, kt, vt = t[0], t[1], t[2]
        assert qt is not None and kt is not None and vt is not None
        if qt.dim() == 3:
            qt, kt, vt = heads(qt, q_heads), heads(kt, kv_heads), heads(vt, kv_heads)
        mt = t[3] if len(t) > 3 else None
        is_causal = causal
        if causal and mt is not None:  # torch's SDPA takes a mask or is_causal, not both: fold causal into the mask
            allowed = torch.ones(qt.shape[-2], kt.shape[-2], dtype=torch.bool, device=qt.device).tril()
            mt = (mt & allowed) if mt.dtype == torch.bool else mt.masked_fill(~allowed, float("-inf"))
            is_causal = False
        out = _hal("scaled_dot_product_attention")(qt, kt, vt, attn_mask=mt, is_causal=is_causal,
                                                   scale=None if scale is None else float(scale))
        if t[0] is not None and t[0].dim() == 3:
            out = out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)
        return out

    notes = ["causal folded into the mask" if causal and mask is not None else "",
             "3-D inputs split into heads" if q.ndim == 3 else ""]
    return Mapped("scaled_dot_product_attention", call, max(head_dim, lk), "; ".join(n for n in notes if n))


MAPPERS: dict[str, Mapper] = {
    "Softmax": _softmax,
    "LayerNormalization": partial(_normalization, op="layer_norm"),
    "RMSNormalization": partial(_normalization, op="rms_norm"),
    "Gelu": _gelu,
    "Swish": _swish,
    "SwiGLU": _swiglu,
    "MatMul": _matmul,
    "Gemm": _gemm,
    "Gather": _gather,
    "SoftmaxCrossEntropyLoss": _cross_entropy,
    "RotaryEmbedding": _rotary,
    "Attention": _attention,
}


# --- cases ----------------------------------------------------------------------------------------------


def cases(ctx: Context) -> list[Case]:
    """One case per ONNX node test of a mapped op type (unsupported ones included, with the reason)."""
    op_types = tuple(MAPPERS)
    version = onnx_cases.onnx_version()
    if version is None:
        why = f"onnx is not installed: {onnx_cases.INSTALL_HINT}"
        return [Case(SUITE, f"{op}/onnx_missing", partial(_fixed, unsupported(why)), why, (op,)) for op in op_types]
    tests, missing = onnx_cases.load_tests(op_types)
    out: list[Case] = []
    for op_type in op_types:
        if op_type in missing:
            why = missing[op_type]
            out.append(Case(SUITE, f"{op_type}/no_tests", partial(_fixed, unsupported(why)), why, (op_type,)))
            continue
        for test in sorted(tests[op_type], key=lambda t: t.name):
            desc = f"ONNX {op_type}-{test.opset} node test {test.name} ({test.source} golden data, onnx {version})"
            out.append(Case(SUITE, f"{op_type}/{test.name}", partial(_run, test=test), desc, (op_type, test.source)))
    return out


def _fixed(outcome: Outcome, ctx: Context) -> Outcome:
    return Outcome(outcome.status, reason=outcome.reason)


def to_torch(array: np.ndarray) -> torch.Tensor:
    """A numpy array (bfloat16 from ml_dtypes included) as a CPU tensor of the same dtype."""
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(array).view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(array, copy=True))


def _run(ctx: Context, *, test: NodeTest) -> Outcome:
    mapped = MAPPERS[test.op_type](test)
    if isinstance(mapped, str):
        return unsupported(mapped)
    golden = to_torch(test.outputs[0])
    dtype = golden.dtype
    if not dtype.is_floating_point:
        return unsupported(f"{dtype_name(dtype)} output: the HAL ops compared here are floating point")
    if not ctx.dtype_supported(dtype):
        return skip(f"{ctx.backend_name} does not declare {dtype_name(dtype)}")
    tensors: Tensors = [None if a is None else to_torch(a).to(ctx.device) for a in test.inputs]
    previous = ctx.backend.reduced_precision_matmul_enabled()
    ctx.backend.set_reduced_precision_matmul(False)
    try:
        actual = mapped.call(tensors)
        ctx.backend.synchronize()
    except Exception as exc:  # the HAL op does not take this input here: reported, not a crash
        lines = str(exc).strip().splitlines()
        return unsupported(f"hal.ops.{mapped.op} raised: {type(exc).__name__}: {lines[0] if lines else ''}")
    finally:
        ctx.backend.set_reduced_precision_matmul(previous)
    expected = golden.to(torch.float64)
    tol = tolerance_for(OP_CATEGORY[mapped.op], dtype, mapped.k)
    if dtype in (torch.float16, torch.bfloat16) and mapped.op in ("scaled_dot_product_attention", "rotary_embedding"):
        finite = expected[torch.isfinite(expected)]
        peak = float(finite.abs().max()) if finite.numel() else 0.0
        if tol.rtol * peak > tol.atol:
            tol = override(tol, f"{tol.dtype} intermediates: atol = rtol x max|reference| ({peak:.3g})", atol=tol.rtol * peak)
    j = judge(actual, expected, tol, dtype)
    data: dict[str, Any] = {"hal_op": mapped.op, "source": test.source}
    if mapped.note:
        data["mapping"] = mapped.note
    tolerance: dict[str, Any] = dict(tol.to_dict())
    if j.passed:
        return Outcome("pass", metrics=j.metrics, tolerance=tolerance, reason=mapped.note, data=data)
    return Outcome("fail", metrics=j.metrics, tolerance=tolerance, failed_metric=j.failed_metric,
                   reason=j.reason, data=data)
