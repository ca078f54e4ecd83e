"""One dynamic loss scale for the whole pipeline, when any stage trains in fp16.

fp16's narrow range needs the loss scaled up before backward (small gradients would flush to zero)
and the gradients checked for inf/NaN before the optimizer steps. torch's ``GradScaler`` does that
for one process; a pipeline has one loss (on the last stage) and gradients on every rank, so the
scale and the verdict must be the pipeline's, not a rank's: the last stage multiplies the loss by
the scale (the engine's ``loss_scale``), every gradient in the pipeline is then scaled by it, every
rank unscales its own gradients and looks for inf/NaN, the verdict is agreed over the whole world
(one MAX all-reduce of one flag), and every rank steps or skips together. The scale follows
GradScaler's rules — halve on an overflow, double after ``growth_interval`` clean steps — and is
saved in checkpoints (``state_dict``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist


@dataclass
class PipelineLossScaler:
    """GradScaler's dynamic scale, with the inf/NaN verdict agreed over every rank of the job."""

    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    growth_tracker: int = 0  # clean steps since the last change
    skipped_steps: int = 0

    def unscale(self, params: Iterable[torch.Tensor]) -> bool:
        """Divide every gradient by the scale in place; True if any of this rank's gradients is not finite."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return False
        inverse = 1.0 / self.scale
        torch._foreach_mul_(grads, inverse)
        finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
        return not bool(finite)  # one device read per step, only while fp16 scaling is on

    def agree(self, found_here: bool, group: Any = None) -> bool:
        """The world's verdict: True if any rank found an inf/NaN (a MAX all-reduce on the host group)."""
        flag = torch.tensor([1.0 if found_here else 0.0])
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item() > 0)

    def update(self, found: bool) -> None:
        """GradScaler's rule: back off on an overflow, grow after ``growth_interval`` clean steps."""
        if found:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
            return
        self.growth_tracker += 1
        if self.growth_tracker >= self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def step(self, params: list[torch.Tensor], optimizer_step: Callable[[], None], group: Any = None) -> bool:
        """Unscale, agree, then step (True) or skip (False) — the same choice on every rank; update the scale."""
        found = self.agree(self.unscale(params), group)
        if not found:
            optimizer_step()
        self.update(found)
        return not found

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "growth_tracker": self.growth_tracker,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in ("scale", "growth_factor", "backoff_factor"):
            setattr(self, name, float(state[name]))
        for name in ("growth_interval", "growth_tracker", "skipped_steps"):
            setattr(self, name, int(state[name]))


__all__ = ["PipelineLossScaler"]
