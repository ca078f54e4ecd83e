"""fp8 on the replicas' wire (``parallel.replicas.fp8_wire``): the block encoding itself, on the edges that matter."""
from __future__ import annotations

import torch

from hal.parallel.replicas.fp8_wire import BLOCK, dequantize, quantize


def test_each_value_comes_back_within_its_blocks_rounding() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3 * BLOCK + 17, generator=g) * torch.logspace(-6, 2, 3 * BLOCK + 17)
    payload, scale = quantize(x)
    assert payload.dtype == torch.uint8 and payload.numel() == 4 * BLOCK and scale.numel() == 4
    back = dequantize(payload, scale, x.numel())
    blocks = torch.nn.functional.pad(x, (0, 4 * BLOCK - x.numel())).view(4, BLOCK).abs().amax(1)
    bound = (blocks / 448 * 2 ** -3).repeat_interleave(BLOCK)[: x.numel()]  # half an ulp of e4m3 at the block's top
    assert ((back - x).abs() <= torch.maximum(bound, x.abs() * 2 ** -4) + 1e-12).all()
    assert not torch.equal(back, x)  # fp8: it is rounded


def test_blocks_of_zeros_and_of_values_near_float32s_floor_stay_finite() -> None:
    """A block whose largest value is below 448 x float32's smallest normal once gave a scale of 0 and NaN (0 / 0)."""
    x = torch.zeros(2 * BLOCK)
    x[3] = 1e-44  # a subnormal float32: its block's scale (/ 448) underflows to 0
    payload, scale = quantize(x)
    back = dequantize(payload, scale, x.numel())
    assert torch.isfinite(back).all() and torch.isfinite(scale).all() and (scale > 0).all()
    assert back[BLOCK:].eq(0).all()
