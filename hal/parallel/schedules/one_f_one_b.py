"""1F1B (Megatron's non-interleaved schedule): warm-up forwards, alternate forward/backward, cool down.

Stage s runs min(S - s - 1, M) warm-up forwards, so it holds at most min(S - s, M) micro-batches'
activations instead of GPipe's M. In the steady phase each send is posted together with the
opposite-direction receive (``send_forward_recv_backward`` / ``send_backward_recv_forward``): the
neighbour posts the mirror batch at the same time, so blocking P2P (gloo) cannot deadlock.
"""
from __future__ import annotations

from hal.parallel.schedules.action import Action, Kind
from hal.parallel.schedules.base import Schedule


def warmup(num_stages: int, num_micro_batches: int, stage: int) -> int:
    """Forwards this stage runs before its first backward."""
    return min(num_stages - stage - 1, num_micro_batches)


class OneFOneB(Schedule):
    name = "1f1b"
    fills_pipeline = True
    torch_class = "Schedule1F1B"

    def compute_order(self, num_stages: int, num_micro_batches: int, stage: int) -> list[Action]:
        w = warmup(num_stages, num_micro_batches, stage)
        order = [Action(Kind.FORWARD, m) for m in range(w)]
        for i in range(num_micro_batches - w):
            order += [Action(Kind.FORWARD, w + i), Action(Kind.BACKWARD, i)]
        return order + [Action(Kind.BACKWARD, m) for m in range(num_micro_batches - w, num_micro_batches)]

    def fuses(self, num_stages: int, num_micro_batches: int, stage: int, index: int) -> bool:
        """The steady phase: from its first forward to its last backward's predecessor."""
        w = warmup(num_stages, num_micro_batches, stage)
        return w <= index < w + 2 * (num_micro_batches - w) - 1
