"""GPipe: every forward, then every backward (all M micro-batches' activations live at once)."""
from __future__ import annotations

from .action import BACKWARD, FORWARD, Action
from .base import Schedule


class GPipe(Schedule):
    name = "gpipe"

    def compute_order(self, num_stages: int, num_micro_batches: int, stage: int) -> list[Action]:
        return [FORWARD(m) for m in range(num_micro_batches)] + [BACKWARD(m) for m in range(num_micro_batches)]
