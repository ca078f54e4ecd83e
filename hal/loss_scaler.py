"""A dynamic loss scaler for devices without float64: ``torch.amp.GradScaler`` with its one float64 operation moved.

Why: ``torch.amp.GradScaler.unscale_`` takes the scale's reciprocal in float64 on the device (exempting only MPS), and
an Ascend NPU or a Cambricon MLU has no float64 compute (the stand-ins refuse it as the devices do). torch_npu's own
scaler takes it in float32 on the device; so does this one. The scale is a power of two under the default growth
and backoff factors (2 and 0.5), whose reciprocal float32 holds exactly: the unscaled gradients are the same bits
as CUDA's float64 route gives.
"""
from __future__ import annotations

import torch
from torch.amp.grad_scaler import OptState


class Fp32ReciprocalGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose ``unscale_`` takes the reciprocal in float32 on the device."""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        if self._scale is None:
            raise RuntimeError("unscale_() before any scale(): the scaler has no scale yet")
        inv_scale = self._scale.float().reciprocal()  # float32 on the device: it has no float64
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=self._scale.device)
        optimizer_state["found_inf_per_device"] = self._unscale_grads_(optimizer, inv_scale, found_inf, False)
        optimizer_state["stage"] = OptState.UNSCALED


__all__ = ["Fp32ReciprocalGradScaler"]
