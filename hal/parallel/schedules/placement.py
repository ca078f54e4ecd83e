"""Where a pipeline's virtual stages (model chunks) sit: the map between (stage, chunk) and model order.

A plan with S stages of V chunks cuts the model into ``S * V`` virtual stages, taken in model order.
Two placements are in use:

- ``loop`` (Megatron's interleaving): chunk v of stage s is virtual stage ``v * S + s``; the model
  visits every stage V times, the last stage's chunk v feeding the first stage's chunk v + 1 over a
  wrap-around link.
- ``v`` (ZB-V, arXiv 2401.10241 §6): two chunks a stage, stage s holding virtual stages ``s`` and
  ``2S - 1 - s``. The model goes down the stages and back up, so the first stage holds both the
  model's first and last chunk (the embedding and the head, the loss), the last stage hands its first
  chunk's output to its own second chunk without any transfer, and every link joins neighbours.

Every placement keeps virtual stage 0 on stage 0 as chunk 0 and the model's last virtual stage as the
last chunk of its stage: the stage module decides embedding and head by those two facts alone.
"""
from __future__ import annotations

PLACEMENTS = ("loop", "v")


def _check(placement: str, num_stages: int, virtual_stages: int) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"placement {placement!r} is unknown; use one of {', '.join(PLACEMENTS)}")
    if placement == "v" and virtual_stages != 2:
        raise ValueError(f"the V-shaped placement holds 2 chunks a stage, got virtual_stages {virtual_stages}")


def virtual_index(stage: int, chunk: int, num_stages: int, placement: str = "loop") -> int:
    """The model-order position of ``stage``'s chunk ``chunk``."""
    if placement == "v":
        return stage if chunk == 0 else 2 * num_stages - 1 - stage
    return chunk * num_stages + stage


def position(index: int, num_stages: int, virtual_stages: int, placement: str = "loop") -> tuple[int, int]:
    """(stage, chunk) holding virtual stage ``index`` (the inverse of ``virtual_index``)."""
    _check(placement, num_stages, virtual_stages)
    if not 0 <= index < num_stages * virtual_stages:
        raise ValueError(f"virtual stage {index} does not exist; there are {num_stages * virtual_stages}")
    if placement == "v":
        return (index, 0) if index < num_stages else (2 * num_stages - 1 - index, 1)
    return index % num_stages, index // num_stages


def last_stage(num_stages: int, placement: str = "loop") -> int:
    """The stage holding the model's last chunk (the head and the loss)."""
    return 0 if placement == "v" else num_stages - 1


def neighbours(stage: int, chunk: int, num_stages: int, virtual_stages: int, placement: str = "loop",
               ) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """(stage, chunk) of the virtual stage before and after this one (None at the model's ends)."""
    j = virtual_index(stage, chunk, num_stages, placement)
    before = position(j - 1, num_stages, virtual_stages, placement) if j > 0 else None
    after = position(j + 1, num_stages, virtual_stages, placement) if j < num_stages * virtual_stages - 1 else None
    return before, after
