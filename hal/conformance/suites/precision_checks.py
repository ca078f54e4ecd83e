"""Helpers of the precision suite that do not run a case: tables, bounds, probes and rules.

Kept apart from ``suites/precision.py`` so the suite reads as a list of cases, and so the tests can
check the tables (against torch's dispatcher) and the rules (against a grid of capabilities) directly.

* global switches: ``preserved_switches`` puts back what a case may touch (reduced-precision matmul,
  deterministic algorithms, default dtype, fallback policy, the downgrade log);
* rounding bounds: unit roundoffs and the rel_l2 bound ``c * sqrt(K) * u``;
* exactness probes: matrices whose product with a permutation is exact in the asked dtype but not
  in the dtype an impostor would compute in;
* autocast op tables per device type, from PyTorch's AMP op reference;
* the loss-scaler schedule a correct dynamic scaler follows;
* the precision-policy rules over capabilities.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F

from hal.backend import Backend
from hal.capabilities import DeviceCapabilities, DtypeSupport
from hal.conformance.cases import CAPABILITY_KEY
from hal.downgrades import (
    Downgrade,
    clear_downgrades,
    fallback_mode,
    record_downgrade,
    recorded_downgrades,
    set_fallback_mode,
)
from hal.errors import FallbackRefused, UnsupportedError
from hal.precision import PrecisionPlan

# --- rounding ------------------------------------------------------------------------------------

# Unit roundoff u = 2^-p (p = significand bits incl. the implicit one): round-to-nearest error ≤ u·|x|.
UNIT_ROUNDOFF: dict[torch.dtype, float] = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}
if hasattr(torch, "float8_e4m3fn"):
    UNIT_ROUNDOFF[torch.float8_e4m3fn] = 2.0**-4

# Reduced-precision fp32 matmul formats: unit roundoff of the format the inputs are rounded to.
# TF32: 10 stored mantissa bits (NVIDIA A100 whitepaper); HF32: 11 stored mantissa bits (Ascend CANN
# docs, "--allow_hf32": "its mantissa precision (11 bits) is close to FP16 (10 bits)").
REDUCED_FORMAT_ROUNDOFF: dict[str, float] = {"tf32": 2.0**-11, "hf32": 2.0**-12}

REL_L2_CONSTANT = 1.0  # c in rel_l2 <= c * sqrt(K) * u
REDUCED_OFF_CONSTANT = 2.0  # fp32 check: rel_l2 <= 2 * sqrt(K) * 2^-24
REDUCED_ON_FLOOR = 1.0 / 16  # a reduced format's error is at least u_fmt / 16 (≈ 0.8 u_fmt for random inputs)
REDUCED_ON_CONSTANT = 2.0  # ... and at most 2 * sqrt(K) * u_fmt (2: truncating instead of rounding)


def rel_l2_bound(k: int, unit_roundoff: float, constant: float = REL_L2_CONSTANT) -> float:
    """The probabilistic rounding-error bound of a length-K dot product: c·√K·u (Higham & Mary, 2019).

    Accumulating in fp32 leaves ≈ u/2 (the output rounding); accumulating in the low format itself
    grows like √K·u/2 — both within the bound; a coarser format than asked exceeds it for small K.
    """
    return constant * math.sqrt(max(1, k)) * unit_roundoff


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||a - e|| / ||e|| in float64 on the host (non-finite entries make it inf)."""
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(a).all()):
        return math.inf
    norm = float(e.norm())
    return float((a - e).norm()) / norm if norm > 0 else float((a - e).norm())


# --- global switches ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Switches:
    """Process-wide settings a precision case may change, as found before it ran."""

    reduced_precision_matmul: bool
    deterministic: bool
    deterministic_warn_only: bool
    default_dtype: torch.dtype
    fallback: str
    downgrades: tuple[Downgrade, ...]


def save_switches(backend: Backend) -> Switches:
    return Switches(
        reduced_precision_matmul=backend.reduced_precision_matmul_enabled(),
        deterministic=torch.are_deterministic_algorithms_enabled(),
        deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
        default_dtype=torch.get_default_dtype(),
        fallback=fallback_mode(),
        downgrades=tuple(recorded_downgrades()),
    )


def restore_switches(backend: Backend, saved: Switches) -> list[str]:
    """Put back every switch that differs from ``saved``; returns the names of those restored."""
    restored: list[str] = []
    if backend.reduced_precision_matmul_enabled() != saved.reduced_precision_matmul:
        backend.set_reduced_precision_matmul(saved.reduced_precision_matmul)
        restored.append("reduced_precision_matmul")
    if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) != (
        saved.deterministic, saved.deterministic_warn_only
    ):
        backend.set_deterministic(saved.deterministic)
        torch.use_deterministic_algorithms(saved.deterministic, warn_only=saved.deterministic_warn_only)
        restored.append("deterministic")
    if torch.get_default_dtype() != saved.default_dtype:
        torch.set_default_dtype(saved.default_dtype)
        restored.append("default_dtype")
    if fallback_mode() != saved.fallback:
        set_fallback_mode(saved.fallback)  # type: ignore[arg-type]
        restored.append("fallback")
    if tuple(recorded_downgrades()) != saved.downgrades:
        # Policy cases record downgrades the user never asked for; the log must show only real ones.
        clear_downgrades()
        for item in saved.downgrades:
            record_downgrade(item, "allow")
        restored.append("downgrades")
    return restored


@contextlib.contextmanager
def preserved_switches(backend: Backend) -> Iterator[Switches]:
    """Run a block and put every global switch back as it was, also when the block raises."""
    saved = save_switches(backend)
    try:
        yield saved
    finally:
        restore_switches(backend, saved)


# --- exactness probes -------------------------------------------------------------------------------


def probe_values(dtype: torch.dtype, shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """Values exactly representable in ``dtype`` but not in the format an impostor would use.

    bfloat16: magnitudes 2^17..2^60 and 2^-60..2^-26 — outside float16's range (max 65504, smallest
    subnormal 2^-24), so a float16 computation overflows or flushes them. float16: 11 significant
    bits with a low bit set — not representable in bfloat16 (8 bits). float32: 24 significant bits
    with low bits set — not representable in TF32 (11), HF32 (12) or bfloat16.
    """
    n = shape[0] * shape[1]
    sign = torch.where(torch.rand(n, generator=generator) < 0.5, -1.0, 1.0).double()
    if dtype == torch.bfloat16:
        mant = 1.0 + torch.randint(0, 128, (n,), generator=generator).double() / 128
        big = torch.randint(17, 61, (n,), generator=generator)
        small = -torch.randint(26, 61, (n,), generator=generator)
        exp = torch.where(torch.rand(n, generator=generator) < 0.5, big, small).double()
    elif dtype == torch.float16:
        m = torch.randint(0, 128, (n,), generator=generator) * 8 + torch.randint(1, 8, (n,), generator=generator)
        mant = 1.0 + m.double() / 1024
        exp = torch.randint(-8, 9, (n,), generator=generator).double()
    elif dtype == torch.float32:
        m = torch.randint(0, 2**10, (n,), generator=generator) * 2**13 + torch.randint(1, 2**13, (n,), generator=generator)
        mant = 1.0 + m.double() / 2**23
        exp = torch.randint(-8, 9, (n,), generator=generator).double()
    else:
        raise ValueError(f"no exactness probe is defined for {dtype}")
    values = (sign * mant * torch.exp2(exp)).reshape(shape)
    as_dtype = values.to(dtype)
    if not bool((as_dtype.double() == values).all()):  # pragma: no cover - a bug in this table
        raise AssertionError(f"probe values are not exact in {dtype}")
    return as_dtype


def permutation_matrix(k: int, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """A K×K permutation matrix: ``a @ P`` moves columns, so any matmul at least as precise as a's dtype is exact."""
    perm = torch.randperm(k, generator=generator)
    p = torch.zeros(k, k, dtype=dtype)
    p[torch.arange(k), perm] = 1
    return p


def inexact_count(actual: torch.Tensor, expected: torch.Tensor) -> int:
    """Entries of ``actual`` that differ from the exact ``expected`` (NaN counts as different)."""
    a = actual.detach().to("cpu", torch.float64)
    return int((a != expected.to(torch.float64)).sum())


# --- autocast op tables --------------------------------------------------------------------------


def _randn(g: torch.Generator, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


def _rand(g: torch.Generator, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype, lo: float, hi: float) -> torch.Tensor:
    return (lo + (hi - lo) * torch.rand(shape, generator=g)).to(device=device, dtype=dtype)


OpCall = Callable[[torch.device, torch.dtype, torch.Generator], torch.Tensor]

_CALLS: dict[str, OpCall] = {
    # lower-precision list (fed fp32 inputs)
    "mm": lambda d, t, g: torch.mm(_randn(g, (8, 16), d, t), _randn(g, (16, 4), d, t)),
    "matmul": lambda d, t, g: torch.matmul(_randn(g, (2, 8, 16), d, t), _randn(g, (16, 4), d, t)),
    "bmm": lambda d, t, g: torch.bmm(_randn(g, (2, 8, 16), d, t), _randn(g, (2, 16, 4), d, t)),
    "addmm": lambda d, t, g: torch.addmm(_randn(g, (8, 4), d, t), _randn(g, (8, 16), d, t), _randn(g, (16, 4), d, t)),
    "baddbmm": lambda d, t, g: torch.baddbmm(_randn(g, (2, 8, 4), d, t), _randn(g, (2, 8, 16), d, t), _randn(g, (2, 16, 4), d, t)),
    "linear": lambda d, t, g: F.linear(_randn(g, (8, 16), d, t), _randn(g, (4, 16), d, t), _randn(g, (4,), d, t)),
    "conv1d": lambda d, t, g: F.conv1d(_randn(g, (2, 4, 16), d, t), _randn(g, (3, 4, 3), d, t)),
    "conv2d": lambda d, t, g: F.conv2d(_randn(g, (2, 4, 8, 8), d, t), _randn(g, (3, 4, 3, 3), d, t)),
    "scaled_dot_product_attention": lambda d, t, g: F.scaled_dot_product_attention(
        _randn(g, (1, 2, 8, 16), d, t), _randn(g, (1, 2, 8, 16), d, t), _randn(g, (1, 2, 8, 16), d, t)
    ),
    # float32 lists (fed low-precision inputs)
    "mse_loss": lambda d, t, g: F.mse_loss(_randn(g, (8, 16), d, t), _randn(g, (8, 16), d, t)),
    "l1_loss": lambda d, t, g: F.l1_loss(_randn(g, (8, 16), d, t), _randn(g, (8, 16), d, t)),
    "smooth_l1_loss": lambda d, t, g: F.smooth_l1_loss(_randn(g, (8, 16), d, t), _randn(g, (8, 16), d, t)),
    "nll_loss": lambda d, t, g: F.nll_loss(
        torch.log_softmax(torch.randn(8, 5, generator=g), -1).to(d, t), torch.randint(0, 5, (8,), generator=g).to(d)
    ),
    "cross_entropy": lambda d, t, g: F.cross_entropy(_randn(g, (8, 5), d, t), torch.randint(0, 5, (8,), generator=g).to(d)),
    "kl_div": lambda d, t, g: F.kl_div(
        torch.log_softmax(torch.randn(8, 5, generator=g), -1).to(d, t),
        torch.softmax(torch.randn(8, 5, generator=g), -1).to(d, t), reduction="batchmean",
    ),
    "binary_cross_entropy_with_logits": lambda d, t, g: F.binary_cross_entropy_with_logits(
        _randn(g, (8, 16), d, t), _rand(g, (8, 16), d, t, 0.0, 1.0)
    ),
    "prod": lambda d, t, g: torch.prod(_rand(g, (16,), d, t, 0.75, 1.25)),
    "cdist": lambda d, t, g: torch.cdist(_randn(g, (8, 4), d, t), _randn(g, (6, 4), d, t)),
    # on CUDA's float32 list, unlisted on CPU (there they run in the input's dtype)
    "softmax": lambda d, t, g: torch.softmax(_randn(g, (8, 16), d, t), dim=-1),
    "log_softmax": lambda d, t, g: torch.log_softmax(_randn(g, (8, 16), d, t), dim=-1),
    "layer_norm": lambda d, t, g: F.layer_norm(_randn(g, (8, 16), d, t), (16,)),
    "sum": lambda d, t, g: torch.sum(_randn(g, (8, 16), d, t)),
    # on CUDA's float32 list only
    "group_norm": lambda d, t, g: F.group_norm(_randn(g, (2, 4, 8), d, t), 2),
    "cumsum": lambda d, t, g: torch.cumsum(_randn(g, (8, 16), d, t), dim=-1),
    "exp": lambda d, t, g: torch.exp(_randn(g, (8, 16), d, t)),
    "log": lambda d, t, g: torch.log(_rand(g, (8, 16), d, t, 0.5, 2.0)),
    "norm": lambda d, t, g: torch.norm(_randn(g, (8, 16), d, t)),
}

# The dispatcher entries (aten overloads) whose Autocast<DeviceType> kernel gives each op its
# behaviour; the tests check these tables against torch._C._dispatch_has_kernel_for_dispatch_key.
ATEN: dict[str, tuple[str, ...]] = {
    "mm": ("aten::mm",), "matmul": ("aten::matmul",), "bmm": ("aten::bmm",), "addmm": ("aten::addmm",),
    "baddbmm": ("aten::baddbmm",), "linear": ("aten::linear",), "conv1d": ("aten::conv1d",),
    "conv2d": ("aten::conv2d",), "scaled_dot_product_attention": ("aten::scaled_dot_product_attention",),
    "mse_loss": ("aten::mse_loss",), "l1_loss": ("aten::l1_loss",), "smooth_l1_loss": ("aten::smooth_l1_loss",),
    "nll_loss": ("aten::nll_loss",), "kl_div": ("aten::kl_div",),
    "binary_cross_entropy_with_logits": ("aten::binary_cross_entropy_with_logits",), "prod": ("aten::prod",),
    "cdist": ("aten::cdist",), "softmax": ("aten::softmax.int",), "log_softmax": ("aten::log_softmax.int",),
    "layer_norm": ("aten::layer_norm",), "sum": ("aten::sum",), "group_norm": ("aten::group_norm",),
    "cumsum": ("aten::cumsum",), "exp": ("aten::exp",), "log": ("aten::log",), "norm": ("aten::linalg_vector_norm",),
}
# cross_entropy: CPU lists aten::cross_entropy_loss itself; CUDA lists its parts (log_softmax, nll_loss).
ATEN_BY_DEVICE: dict[str, dict[str, tuple[str, ...]]] = {
    "cpu": {"cross_entropy": ("aten::cross_entropy_loss",)},
    "cuda": {"cross_entropy": ("aten::log_softmax.int", "aten::nll_loss")},
}

LOWER_PRECISION_OPS: tuple[str, ...] = (
    "mm", "matmul", "bmm", "addmm", "baddbmm", "linear", "conv1d", "conv2d", "scaled_dot_product_attention",
)
FP32_OPS_BOTH: tuple[str, ...] = (
    "mse_loss", "l1_loss", "smooth_l1_loss", "nll_loss", "cross_entropy", "kl_div",
    "binary_cross_entropy_with_logits", "prod", "cdist",
)
FP32_OPS_CUDA_ONLY: tuple[str, ...] = (
    "softmax", "log_softmax", "layer_norm", "sum", "group_norm", "cumsum", "exp", "log", "norm",
)
UNLISTED_ON_CPU: tuple[str, ...] = ("softmax", "log_softmax", "layer_norm", "sum")

Expectation = str  # "lower" (the autocast dtype) | "fp32" | "input" (unlisted: the input's dtype) | "unknown"


@dataclass(frozen=True)
class AutocastExpectation:
    op: str
    expect: Expectation
    inputs: str  # "fp32" or "low": the dtype the op is fed
    why: str

    def expected_dtype(self, autocast_dtype: torch.dtype) -> torch.dtype | None:
        if self.expect == "lower":
            return autocast_dtype
        if self.expect == "fp32":
            return torch.float32
        if self.expect == "input":
            return autocast_dtype  # fed the low-precision dtype, unlisted ops keep it
        return None


def aten_names(op: str, device_type: str) -> tuple[str, ...]:
    return ATEN_BY_DEVICE.get(device_type, {}).get(op, ATEN.get(op, ()))


def autocast_expectations(device_type: str) -> list[AutocastExpectation]:
    """What autocast must do to each checked op on ``device_type`` (PyTorch's AMP op reference).

    cuda (also ROCm, which is device type cuda): the CUDA lists — matmul/linear/conv/sdpa run in the
    autocast dtype; softmax, log_softmax, layer_norm, group_norm, sum, cumsum, exp, log, norm and the
    losses run in float32. cpu: the CPU lists — the same lower-precision ops, and the losses, prod and
    cdist in float32; softmax/log_softmax/layer_norm/sum are on no CPU list, so they run in the
    input's dtype. Other device types (npu, mlu, ... register their own lists through their torch
    adapter): only the ops both torch lists agree on are checked; the rest are "unknown" (skipped).
    """
    out: list[AutocastExpectation] = []
    lists = "CUDA" if device_type == "cuda" else "CPU" if device_type == "cpu" else "both CPU and CUDA"
    for op in LOWER_PRECISION_OPS:
        out.append(AutocastExpectation(op, "lower", "fp32", f"on the {lists} autocast lower-precision list"))
    for op in FP32_OPS_BOTH:
        out.append(AutocastExpectation(op, "fp32", "low", f"on the {lists} autocast float32 list"))
    for op in FP32_OPS_CUDA_ONLY:
        if device_type == "cuda":
            out.append(AutocastExpectation(op, "fp32", "low", "on the CUDA autocast float32 list"))
        elif device_type == "cpu":
            if op in UNLISTED_ON_CPU:
                out.append(AutocastExpectation(op, "input", "low", "on no CPU autocast list: runs in its input's dtype"))
        else:
            out.append(AutocastExpectation(
                op, "unknown", "low",
                f"on CUDA's float32 list but not CPU's; {device_type}'s own autocast list is not documented by PyTorch",
            ))
    return out


def run_autocast_op(op: str, device: torch.device, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    return _CALLS[op](device, dtype, generator)


# --- dynamic loss scaling ------------------------------------------------------------------------


def expected_scales(
    steps: Sequence[str], init_scale: float, growth_factor: float, backoff_factor: float, growth_interval: int
) -> tuple[list[float], list[bool]]:
    """The scale after each step, and which steps are skipped, for a correct dynamic loss scaler.

    The rule (torch.amp.GradScaler's documented behaviour): a step whose gradients hold inf/NaN is
    skipped and multiplies the scale by ``backoff_factor``, resetting the clean-step count; after
    ``growth_interval`` consecutive clean steps the scale is multiplied by ``growth_factor``.
    """
    scale, clean, scales, skipped = init_scale, 0, [], []
    for kind in steps:
        if kind in ("inf", "nan"):
            scale *= backoff_factor
            clean = 0
            skipped.append(True)
        else:
            clean += 1
            if clean == growth_interval:
                scale *= growth_factor
                clean = 0
            skipped.append(False)
        scales.append(scale)
    return scales, skipped


def params_equal(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor]) -> bool:
    """Bitwise-equal parameters (NaN equals NaN), i.e. the optimizer step did not touch them."""
    return all(torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))
               and torch.equal(torch.isnan(a), torch.isnan(b)) for a, b in zip(before, after))


# --- precision-policy rules ------------------------------------------------------------------------

# The oracle's own mode -> autocast dtype table, independent of hal.precision.MODES on purpose: the
# policy cases check resolve_precision against it, so it must not be the map under test.
MODE_AUTOCAST: dict[str, torch.dtype | None] = {
    "fp32": None, "tf32": None, "hf32": None,
    "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16, "fp8-mixed": torch.bfloat16,
}


def _usable(caps: DeviceCapabilities, key: str) -> bool:
    return caps.support(key) in (DtypeSupport.NATIVE, DtypeSupport.EMULATED)


def natively_satisfied(requested: str, caps: DeviceCapabilities, fmt: str | None) -> bool:
    """Whether the device has exactly what ``requested`` asks for, so no downgrade is allowed."""
    if requested == "fp32":
        return True
    if requested == "tf32":
        return caps.is_native("tf32") and fmt == "tf32"
    if requested == "bf16-mixed":
        return caps.is_native("bf16")
    if requested == "fp16-mixed":
        return caps.is_native("fp16")
    if requested == "fp8-mixed":
        # fp8 matmuls with bf16 autocast around them: both must be native
        return (caps.is_native("fp8_e4m3") and caps.is_native("bf16") and hasattr(torch, "float8_e4m3fn")
                and hasattr(torch, "_scaled_mm"))
    raise ValueError(f"unknown precision {requested!r}")


def may_refuse(requested: str, caps: DeviceCapabilities, fmt: str | None) -> bool:
    """Whether resolving ``requested`` may end in UnsupportedError (nothing acceptable exists).

    fp32 and tf32 always have fp32 to fall back on; bf16-mixed may fall back to native fp16 or run
    emulated bf16, so it is refused only without both; fp16-mixed needs fp16 at least emulated;
    fp8-mixed has no fallback by design (a non-fp8 "fp8" run would mislead).
    """
    if requested in ("fp32", "tf32"):
        return False
    if requested == "bf16-mixed":
        return not _usable(caps, "bf16") and not caps.is_native("fp16")
    if requested == "fp16-mixed":
        return not _usable(caps, "fp16")
    # fp8-mixed: native fp8 is required; bf16 beside it may be emulated (a recorded downgrade)
    return not caps.is_native("fp8_e4m3") or not _usable(caps, "bf16") or not (
        hasattr(torch, "float8_e4m3fn") and hasattr(torch, "_scaled_mm"))


@dataclass
class PolicyObservation:
    """What resolving one mode under one fallback did, as the rules see it."""

    requested: str
    fallback: str
    outcome: PrecisionPlan | BaseException
    recorded_before: tuple[Downgrade, ...] = ()
    recorded_after: tuple[Downgrade, ...] = ()
    warnings: tuple[str, ...] = ()
    extra_violations: list[tuple[str, str]] = field(default_factory=list)


def policy_violations(obs: PolicyObservation, caps: DeviceCapabilities, fmt: str | None) -> list[tuple[str, str]]:
    """The rules a resolved plan must obey on a device with ``caps``; returns (rule, why) per broken rule."""
    req, fb, out = obs.requested, obs.fallback, obs.outcome
    native = natively_satisfied(req, caps, fmt)
    bad: list[tuple[str, str]] = []
    if isinstance(out, BaseException):
        if isinstance(out, UnsupportedError):
            if not may_refuse(req, caps, fmt):
                bad.append(("refusal_allowed", f"{req} was refused ({out}) although the device can run it or a recorded fallback"))
        elif isinstance(out, FallbackRefused):
            if fb != "error":
                bad.append(("fallback_respected", f"{req} raised FallbackRefused under fallback={fb}"))
            if native:
                bad.append(("native_no_downgrade", f"{req} needed a downgrade although the device has it natively"))
        else:
            bad.append(("unexpected_exception", f"{req} raised {type(out).__name__}: {out}"))
        return bad + obs.extra_violations
    plan = out
    if req == "fp8-mixed" and not caps.is_native("fp8_e4m3"):
        bad.append(("fp8_refused", f"fp8-mixed without native fp8 gave plan '{plan.describe()}' instead of UnsupportedError"))
    if plan.requested != req:
        bad.append(("requested_kept", f"plan.requested is {plan.requested!r}, asked {req!r}"))
    if native and (plan.mode != req or plan.downgrades):
        bad.append(("native_no_downgrade", f"{req} is native here but the plan is '{plan.describe()}' with {len(plan.downgrades)} downgrade(s)"))
    if fb == "error" and plan.downgrades:
        bad.append(("error_refuses_downgrade", f"fallback=error returned a downgraded plan '{plan.describe()}'"))
    if plan.mode not in MODE_AUTOCAST and plan.mode != fmt:
        bad.append(("known_mode", f"plan mode {plan.mode!r} is no precision mode"))
    expected_autocast = MODE_AUTOCAST.get(plan.mode)
    if plan.autocast_dtype != expected_autocast:
        bad.append(("autocast_matches_mode", f"mode {plan.mode} needs autocast {expected_autocast}, plan has {plan.autocast_dtype}"))
    if plan.loss_scaling != (plan.autocast_dtype == torch.float16):
        bad.append(("loss_scaling_iff_fp16", f"loss_scaling={plan.loss_scaling} with autocast {plan.autocast_dtype}"))
    autocast_key = CAPABILITY_KEY.get(plan.autocast_dtype) if plan.autocast_dtype is not None else None
    if autocast_key is not None and not _usable(caps, autocast_key):
        bad.append(("dtype_usable", f"autocast {autocast_key} is {caps.support(autocast_key)} on this device"))
    rpm = plan.reduced_precision_matmul
    if rpm is not None and (rpm != fmt or req != "tf32"):
        bad.append(("reduced_matmul_is_backend_format", f"plan uses {rpm} matmul; backend format is {fmt}, asked {req}"))
    if plan.mode == "tf32" and not (caps.is_native("tf32") and fmt == "tf32" and rpm == "tf32"):
        bad.append(("tf32_only_native", f"plan mode tf32 with tf32 {caps.support('tf32')}, format {fmt}, matmul {rpm}"))
    if (plan.fp8_dtype is not None) != (plan.mode == "fp8-mixed") or (
        plan.fp8_dtype is not None and not caps.is_native("fp8_e4m3")
    ):
        bad.append(("fp8_only_native", f"fp8 dtype {plan.fp8_dtype} with mode {plan.mode}, fp8 {caps.support('fp8_e4m3')}"))
    deviates = plan.mode != req or (autocast_key is not None and not caps.is_native(autocast_key))
    if deviates and not plan.downgrades:
        bad.append(("downgrade_recorded", f"plan '{plan.describe()}' differs from {req} (or uses a non-native dtype) but records no downgrade"))
    if plan.downgrades and native:
        bad.append(("no_needless_downgrade", f"{req} is native but the plan records {plan.downgrades[0].describe()}"))
    for item in plan.downgrades:
        if item.kind != "precision" or item.requested != req:
            bad.append(("downgrade_describes_request", f"downgrade {item.describe()} does not name precision {req}"))
        if item not in obs.recorded_after:
            bad.append(("downgrade_recorded", f"{item.describe()} is not in hal.recorded_downgrades()"))
        if fb == "warn" and item not in obs.recorded_before and not any(item.describe() in w for w in obs.warnings):
            bad.append(("warned", f"fallback=warn accepted {item.describe()} without a DowngradeWarning"))
    return bad + obs.extra_violations


def describe_support(caps: DeviceCapabilities, keys: Sequence[str] = ("tf32", "bf16", "fp16", "fp8_e4m3")) -> str:
    return ", ".join(f"{k} {caps.support(k)}" for k in keys)


def as_metrics(values: Mapping[str, Any]) -> dict[str, float]:
    """Floats only (booleans become 0/1), as Outcome.metrics expects."""
    return {k: float(v) for k, v in values.items()}
