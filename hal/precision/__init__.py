"""Precision policy: turn the requested mode into what this device can really do.

Rules (each change goes through ``record_downgrade`` and the user's fallback policy):

=============  =====================================================================================
fp32           plain fp32; reduced-precision matmul off
tf32           TF32 matmul where the device has it; HF32 where that is the backend's format (recorded);
               otherwise plain fp32 (recorded)
bf16-mixed     autocast bf16; without native bf16 it becomes fp16-mixed with dynamic loss scaling
               (recorded); bf16 that is only emulated everywhere stays bf16 (recorded)
fp16-mixed     autocast fp16 + dynamic loss scaling (GradScaler); emulated fp16 is recorded
fp8-mixed      fp8 (e4m3) matmuls via torch._scaled_mm plus bf16 autocast, only where fp8 is native;
               otherwise an error (no fallback)
=============  =====================================================================================
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ContextManager, Mapping

from hal.capabilities import DeviceCapabilities, DtypeSupport
from hal.downgrades import Downgrade, FallbackMode, record_downgrade
from hal.errors import UnsupportedError

if TYPE_CHECKING:  # torch loads on first use: hal.config reads PRECISIONS, and ``hal --help`` loads no torch
    import torch

    from hal.backend import Backend


@dataclass(frozen=True)
class Mode:
    """What a precision mode means when the device has it natively."""

    autocast: str | None  # torch dtype name of the autocast region; None: no autocast
    loss_scaling: bool  # dynamic loss scaling (GradScaler)


# The one precision-name -> dtype/autocast map: config choices (hal.config), the policy below,
# hal train's job file and the conformance training runs all read it.
MODES: Mapping[str, Mode] = {
    "fp32": Mode(None, False),
    "tf32": Mode(None, False),
    "bf16-mixed": Mode("bfloat16", False),
    "fp16-mixed": Mode("float16", True),
    "fp8-mixed": Mode("bfloat16", False),  # the ops around the fp8 matmuls run under bf16 autocast
}
PRECISIONS: tuple[str, ...] = tuple(MODES)


def dtype_named(name: str | None) -> torch.dtype | None:
    """``"bfloat16"`` -> ``torch.bfloat16`` (None stays None)."""
    import torch

    return None if name is None else getattr(torch, name)


def autocast_dtype(mode: str) -> torch.dtype | None:
    """The autocast dtype of precision ``mode`` (None for fp32/tf32)."""
    return dtype_named(MODES[mode].autocast)


@dataclass(frozen=True)
class PrecisionPlan:
    requested: str
    mode: str  # the mode actually used
    autocast_dtype: torch.dtype | None
    loss_scaling: bool  # dynamic loss scaling (GradScaler) on
    reduced_precision_matmul: str | None  # "tf32" | "hf32" | None
    fp8_dtype: torch.dtype | None
    downgrades: tuple[Downgrade, ...] = ()

    def autocast(self, backend: Backend) -> ContextManager[Any]:
        """The autocast region for forward passes (a no-op context for fp32/tf32)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return backend.autocast(self.autocast_dtype)

    def grad_scaler(self, backend: Backend) -> Any:
        """A GradScaler that is enabled exactly when the plan uses dynamic loss scaling."""
        return backend.grad_scaler(enabled=self.loss_scaling)

    def apply(self, backend: Backend) -> None:
        """Set the backend's process-wide switches (reduced-precision matmul) to match the plan."""
        backend.set_reduced_precision_matmul(self.reduced_precision_matmul is not None)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (dtype names), so a plan resolved in one process can be handed to another."""
        return {"requested": self.requested, "mode": self.mode, "autocast_dtype": _dtype_name(self.autocast_dtype),
                "loss_scaling": self.loss_scaling, "reduced_precision_matmul": self.reduced_precision_matmul,
                "fp8_dtype": _dtype_name(self.fp8_dtype), "downgrades": [d.to_dict() for d in self.downgrades]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrecisionPlan:
        """The inverse of ``to_dict``: the plan as resolved elsewhere, with no new resolution."""
        return cls(data["requested"], data["mode"], dtype_named(data["autocast_dtype"]), bool(data["loss_scaling"]),
                   data["reduced_precision_matmul"], dtype_named(data["fp8_dtype"]),
                   tuple(Downgrade(**d) for d in data["downgrades"]))

    def describe(self) -> str:
        parts = [self.mode]
        if self.mode != self.requested:
            parts.append(f"(requested {self.requested})")
        if self.autocast_dtype is not None:
            parts.append(f"autocast {str(self.autocast_dtype).replace('torch.', '')}")
        if self.loss_scaling:
            parts.append("dynamic loss scaling")
        if self.reduced_precision_matmul:
            parts.append(f"{self.reduced_precision_matmul} matmul")
        if self.fp8_dtype is not None:
            parts.append(f"fp8 matmul {str(self.fp8_dtype).replace('torch.', '')}")
        return ", ".join(parts)


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


def _native(requested: str, mode: str, downgrades: list[Downgrade] | None = None, fp8: torch.dtype | None = None) -> PrecisionPlan:
    """A plan that runs ``mode`` as MODES defines it."""
    m = MODES[mode]
    return PrecisionPlan(requested, mode, dtype_named(m.autocast), m.loss_scaling, None, fp8, tuple(downgrades or ()))


def resolve_precision(
    requested: str, backend: Backend, caps: DeviceCapabilities, fallback: FallbackMode | None = None
) -> PrecisionPlan:
    """Resolve ``requested`` against ``caps``; every change is recorded (or refused) per ``fallback``."""
    import torch

    if requested not in PRECISIONS:
        raise UnsupportedError(f"precision {requested!r} is unknown; use one of {', '.join(PRECISIONS)}")
    downgrades: list[Downgrade] = []

    def downgrade(used: str, reason: str, requested_as: str = requested) -> None:
        item = Downgrade("precision", caps.name, requested_as, used, reason)
        downgrades.append(record_downgrade(item, fallback))

    device = caps.name
    if requested == "fp32":
        return _native(requested, "fp32")
    if requested == "tf32":
        if caps.is_native("tf32") and backend.reduced_precision_matmul_format == "tf32":
            return PrecisionPlan(requested, "tf32", None, False, "tf32", None)
        fmt = backend.reduced_precision_matmul_format
        if fmt is not None and fmt != "tf32":
            downgrade(fmt, f"{device}'s reduced-precision fp32 matmul format is {fmt.upper()}, not TF32")
            return PrecisionPlan(requested, fmt, None, False, fmt, None, tuple(downgrades))
        downgrade("fp32", f"{device} has no TF32 matmul")
        return PrecisionPlan(requested, "fp32", None, False, None, None, tuple(downgrades))
    if requested == "bf16-mixed":
        if caps.is_native("bf16"):
            return _native(requested, "bf16-mixed")
        if caps.is_native("fp16"):
            downgrade("fp16-mixed", f"{device} has no native bf16; fp16 with dynamic loss scaling instead")
            return _native(requested, "fp16-mixed", downgrades)
        if caps.support("bf16") is DtypeSupport.EMULATED:
            downgrade("bf16-mixed (emulated)", f"{device} has neither native bf16 nor native fp16; bf16 runs emulated")
            return _native(requested, "bf16-mixed", downgrades)
        raise UnsupportedError(f"precision bf16-mixed: {device} supports neither bf16 nor fp16; use precision fp32")
    if requested == "fp16-mixed":
        support = caps.support("fp16")
        if support is DtypeSupport.NATIVE:
            return _native(requested, "fp16-mixed")
        if support is DtypeSupport.EMULATED:
            downgrade("fp16-mixed (emulated)", f"{device} has no native fp16; fp16 runs emulated")
            return _native(requested, "fp16-mixed", downgrades)
        raise UnsupportedError(f"precision fp16-mixed: {device} has no fp16 ({support}); use fp32 or bf16-mixed")
    # fp8-mixed: no fallback by design — an fp8 run that silently is not fp8 would mislead.
    if not caps.is_native("fp8_e4m3"):
        raise UnsupportedError(
            f"precision fp8-mixed needs native fp8 (e.g. NVIDIA H100/H200, compute capability 8.9+); "
            f"{device} has fp8 {caps.support('fp8_e4m3')}; use bf16-mixed"
        )
    if not (hasattr(torch, "float8_e4m3fn") and hasattr(torch, "_scaled_mm")):
        raise UnsupportedError(f"precision fp8-mixed needs torch.float8_e4m3fn and torch._scaled_mm; torch {torch.__version__} "
                               "lacks them; upgrade PyTorch")
    bf16 = caps.support("bf16")
    if bf16 is not DtypeSupport.NATIVE:
        # The ops beside the fp8 matmuls run under bf16 autocast: say so when that bf16 is not native.
        if bf16 is not DtypeSupport.EMULATED:
            raise UnsupportedError(f"precision fp8-mixed runs the other ops in bf16, which {device} lacks ({bf16}); use fp32")
        downgrade("fp8-mixed (bf16 emulated)", f"{device} has native fp8 but only emulated bf16 for the ops around the fp8 matmuls")
        return _native(requested, "fp8-mixed", downgrades, torch.float8_e4m3fn)
    return _native(requested, "fp8-mixed", fp8=torch.float8_e4m3fn)
