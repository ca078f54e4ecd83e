"""fp8 on the cross-island wire, with error feedback: a quarter of fp32's bytes, and no error that adds up over steps.

Why error feedback: e4m3 keeps 3 mantissa bits, so one step's rounding moves a value by up to 1/16 of its block's
scale. Each speaker keeps what its last sends rounded away (the *residual*) and adds it to its next send, so over
any run of steps the sum of what crossed the wire equals the sum of the true gradients minus the last residual:
the rounding error stays one step's worth instead of growing (Seide et al. 2014; Karimireddy et al. 2019).

The sum itself is not done in fp8: each speaker sends one message, its fp8 values then one float32 scale per block
of ``BLOCK`` values (amax / 448); every speaker gathers all of them (the bridge sends them as point-to-point
messages striped over its host channels) and adds the dequantised copies in rank order, so every replica ends
with the same float32 sum, bit for bit.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hal.collectives.communicator import Communicator

BLOCK = 1024  # values sharing one scale: 4 bytes of scale a 1 KiB block, 0.4 % beside the payload
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
TINY = torch.finfo(torch.float32).tiny


def quantize(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 payload as uint8, float32 scale a block) of a flat float32 tensor; the payload is padded to whole blocks."""
    n = values.numel()
    blocks = -(-n // BLOCK)
    padded = values.new_zeros(blocks * BLOCK) if n % BLOCK else values
    if padded is not values:
        padded[:n] = values
    shaped = padded.view(blocks, BLOCK)
    amax = shaped.abs().amax(dim=1)
    # a block of values below 448 x float32's smallest normal would get a scale of 0 (and 0 / 0): floored there
    scale = torch.where(amax > 0, (amax / E4M3_MAX).clamp_min(TINY), torch.ones_like(amax))
    payload = (shaped / scale[:, None]).to(torch.float8_e4m3fn)
    return payload.view(torch.uint8).reshape(-1), scale.to(torch.float32)


def dequantize(payload: torch.Tensor, scale: torch.Tensor, numel: int) -> torch.Tensor:
    """The float32 values ``quantize`` encoded (``numel`` of them)."""
    shaped = payload.view(torch.float8_e4m3fn).view(scale.numel(), BLOCK).to(torch.float32)
    return (shaped * scale[:, None]).reshape(-1)[:numel]


class Fp8Wire:
    """One speaker's fp8 sums: a residual per bucket it speaks for, carried from step to step."""

    def __init__(self) -> None:
        self.residuals: dict[int, torch.Tensor] = {}

    def all_reduce(self, flat: torch.Tensor, group: Communicator, bucket: int) -> int:
        """``flat`` becomes Σ over ``group`` of every speaker's (flat + its residual), each sent as fp8; returns the
        bytes this rank put on the wire."""
        residual = self.residuals.get(bucket)
        if residual is None or residual.shape != flat.shape:
            residual = self.residuals[bucket] = torch.zeros_like(flat)
        send = flat + residual
        payload, scale = quantize(send)
        mine = dequantize(payload, scale, flat.numel())
        residual.copy_(send - mine)  # what this send rounded away: added to the next
        # a step whose gradients overflowed (the loss scaler skips it) leaves no inf / NaN to poison the next ones
        torch.nan_to_num_(residual, nan=0.0, posinf=0.0, neginf=0.0)
        message = torch.cat([payload, scale.view(torch.uint8)])  # one message: the payload, then its scales
        flat.zero_()
        cut = payload.numel()
        for rank, got in enumerate(group.all_gather_list(message)):  # rank order on every speaker: one sum, same bits
            flat.add_(mine if rank == group.group_rank else dequantize(got[:cut], got[cut:].view(torch.float32), flat.numel()))
        return message.numel()

    def reset(self) -> None:
        """Forget every residual: the next send carries no feedback from the earlier ones."""
        self.residuals.clear()
