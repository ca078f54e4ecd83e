"""The torch_mlu stand-in: Cambricon's ``mlu`` device over host memory, CNCL as the stand-in process group.

What it keeps of the real runtime: no float64 compute (the catalog lists FP32/FP16/BF16/INT formats only), the
switches torch_mlu installs on import — ``torch.backends.mlu.matmul.allow_tf32`` (default False) and
``torch.backends.cnnl.allow_tf32`` (default True) — and the device's generation in
``get_device_properties().major`` (MLU500+: 5, which TF32 needs: an MLU370 stand-in has none).
"""
from __future__ import annotations

import types

import torch

from .host_device import Limits
from .runtime import Model, Vendor


def _extend(package: types.ModuleType, dev: types.ModuleType, model: Model) -> None:
    torch.backends.mlu = types.SimpleNamespace(matmul=types.SimpleNamespace(allow_tf32=False))  # type: ignore[attr-defined]
    torch.backends.cnnl = types.SimpleNamespace(allow_tf32=True, deterministic=False, benchmark=True)  # type: ignore[attr-defined]


CAMBRICON = Vendor(
    backend="cambricon", package="torch_mlu", device_type="mlu",
    models={"MLU590": Model("MLU590", 80, major=5), "MLU370-X8": Model("MLU370-X8", 48, major=3)},
    limits=Limits(frozenset({torch.float64}), "the MLU has no float64 compute (Cambricon lists FP32/FP16/BF16/INT "
                  "formats only; hal/catalog/devices.yaml)"),
    # CNCL publishes no dtype table: float64 reductions are refused, as backends/cambricon.py routes them
    ccl="cncl", ccl_lacks=frozenset(), ccl_no_reduce=frozenset({torch.float64}), extend=_extend)

__all__ = ["CAMBRICON"]
