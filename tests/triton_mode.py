"""How the Triton kernel tests run: compiled on a GPU, in Triton's interpreter on CPU tensors otherwise.

Triton decides when it is first imported whether ``@triton.jit`` compiles or interprets (triton.language's own
helpers included), so a test module calls ``interpret_unless_gpu`` before it imports triton, and ``require_mode``
after: where another module imported triton first, compiling, its tests skip and say how to run them alone.
"""
from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

from .conftest import has_cuda


def interpret_unless_gpu() -> torch.device:
    """The device the kernels run on; without a GPU, the interpreter switched on (if triton is not imported yet)."""
    if has_cuda():
        return torch.device("cuda")
    if "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return torch.device("cpu")


def require_mode(device: torch.device, kernel: Any, test_file: str) -> list[Any]:
    """The module's pytest marks (on a GPU Triton's compiler starts processes: multiprocess); skips the module where
    CPU tensors would meet a compiling Triton."""
    from hal.kernels.triton import launch

    if device.type == "cpu" and not launch.interpreted(kernel):
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set: run this file alone "
                    f"(TRITON_INTERPRET=1 pytest {test_file})", allow_module_level=True)
    return [pytest.mark.multiprocess] if device.type == "cuda" else []
