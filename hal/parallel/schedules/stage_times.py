"""What one micro-batch costs each stage, and each link: the times a schedule's order is played with.

Why: the zero-bubble family finds its orders by playing the pipeline. With unit times (the paper's
assumption, and the default) that play is blind to what a real plan has — a head on one stage, uneven
layer counts, a GPU stage beside a CPU stage, transfers that take time. ``StageTimes`` carries the measured
seconds instead (``hal train`` with ``parallel.order: measured`` fills it from a calibration step), so the
same rules place each stage's work where the real pipeline has room for it, and the simulator plays the
order with the same figures (``simulate(..., times=)``).

Times are per stage and per model chunk (``V`` chunks a stage; 1 unless interleaved): a forward, a backward's
input half ``I`` and its weight half ``W`` (a whole backward is ``I + W``). ``links``: one transfer's seconds
over each boundary ``s -> s+1`` (S - 1 values), then the wrap-around link of a loop-placed interleaved plan
(the last stage to the first) when it has one; a hand-over inside a stage costs nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from hal.parallel.schedules.action import Kind

PerChunk = tuple[tuple[float, ...], ...]  # [stage][chunk] -> seconds


@dataclass(frozen=True)
class StageTimes:
    """Seconds of one micro-batch's work per (stage, chunk), and of one transfer per link (see the module)."""

    forward: PerChunk
    backward_input: PerChunk
    backward_weight: PerChunk
    links: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        S = len(self.forward)
        shapes = {tuple(len(row) for row in table) for table in (self.forward, self.backward_input, self.backward_weight)}
        if S < 1 or len(shapes) != 1 or any(n < 1 for n in next(iter(shapes))):
            raise ValueError("stage times: forward, backward_input and backward_weight need one row per stage and one "
                             "value per chunk, all the same shape")
        values = [v for table in (self.forward, self.backward_input, self.backward_weight) for row in table for v in row]
        if any(not math.isfinite(v) or v < 0 for v in values + list(self.links)):
            raise ValueError("stage times: every time is a finite number of seconds, at least 0")
        if len(self.links) not in (0, S - 1, S):
            raise ValueError(f"stage times: links has {len(self.links)} values; give one per boundary ({S - 1}), "
                             f"plus the wrap-around link ({S}), or none")

    @classmethod
    def of(cls, forward: Sequence[Sequence[float]], backward_input: Sequence[Sequence[float]],
           backward_weight: Sequence[Sequence[float]], links: Sequence[float] = (), *, digits: int = 6,
           ) -> StageTimes:
        """From plain lists, each value rounded to ``digits`` decimals of a second (a microsecond): ranks that gathered
        the same measurements build equal objects (and the same orders), and noise below it does not change an order."""
        def r(x: float) -> float:
            x = float(x)
            return round(x, digits) if math.isfinite(x) else x  # the check names a non-finite one

        def table(rows: Sequence[Sequence[float]]) -> PerChunk:
            return tuple(tuple(r(v) for v in row) for row in rows)

        return cls(table(forward), table(backward_input), table(backward_weight), tuple(r(v) for v in links))

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    @property
    def chunks(self) -> int:
        return len(self.forward[0])

    def cost(self, kind: Kind, stage: int, chunk: int = 0) -> float:
        """Seconds of ``kind`` (F, B, I or W) for one micro-batch on one chunk of ``stage``."""
        if kind is Kind.FORWARD:
            return self.forward[stage][chunk]
        if kind is Kind.BACKWARD_INPUT:
            return self.backward_input[stage][chunk]
        if kind is Kind.BACKWARD_WEIGHT:
            return self.backward_weight[stage][chunk]
        if kind is Kind.BACKWARD:
            return self.backward_input[stage][chunk] + self.backward_weight[stage][chunk]
        raise ValueError(f"stage times cost compute actions; {kind} is not one")

    def hop(self, from_stage: int, to_stage: int) -> float:
        """One transfer's seconds between two stages: 0 inside one stage, else its boundary's (or the wrap link's)."""
        if from_stage == to_stage or not self.links:
            return 0.0
        low, high = sorted((from_stage, to_stage))
        if high - low == 1:
            return self.links[low]
        return self.links[-1] if len(self.links) == self.num_stages else 0.0

    def summary(self) -> str:
        """One line a person reads: per stage F/I/W in ms (chunks summed), then the links."""
        def ms(row: Sequence[float]) -> str:
            return f"{sum(row) * 1e3:.1f}"

        stages = ", ".join(f"stage {s} {ms(self.forward[s])}/{ms(self.backward_input[s])}/{ms(self.backward_weight[s])}"
                           for s in range(self.num_stages))
        links = "; links " + "/".join(f"{v * 1e3:.1f}" for v in self.links) + " ms" if self.links else ""
        return f"F/I/W ms: {stages}{links}"


def unit_times(num_stages: int, chunks: int = 1) -> StageTimes:
    """One time unit for every F, I and W, free transfers: the plays' default (the paper's assumption)."""
    one = tuple(tuple(1.0 for _ in range(chunks)) for _ in range(num_stages))
    return StageTimes(one, one, one)


def fit_variants(times: StageTimes) -> list[tuple[bool, ...]]:
    """Which stages a timed play lets wait for an input instead of running a ``W`` that would delay it.

    Waiting helps a stage whose neighbours wait on it less than it waits on them, and hurts the busiest stage
    (its idle time is the step's): so three variants, played and simulated side by side — nobody waits (every
    gap filled, as the unit play does), everybody waits, every stage but the busiest waits."""
    S = times.num_stages
    busy = [sum(times.forward[s]) + sum(times.backward_input[s]) + sum(times.backward_weight[s]) for s in range(S)]
    busiest = max(range(S), key=lambda s: busy[s])
    variants = [tuple(False for _ in range(S)), tuple(True for _ in range(S)), tuple(s != busiest for s in range(S))]
    return list(dict.fromkeys(variants))
