"""GPipe: every forward, then every backward (all M micro-batches' activations live at once)."""
from __future__ import annotations

from hal.parallel.schedules.action import Action, Kind
from hal.parallel.schedules.base import Schedule


class GPipe(Schedule):
    name = "gpipe"
    torch_class = "ScheduleGPipe"

    def compute_order(self, num_stages: int, num_micro_batches: int, stage: int) -> list[Action]:
        forwards = [Action(Kind.FORWARD, m) for m in range(num_micro_batches)]
        return forwards + [Action(Kind.BACKWARD, m) for m in range(num_micro_batches)]
