"""Regional compilation of a stage: every decoder layer through ``torch.compile`` (``compile: true``).

Each layer is compiled on its own (as torchtitan does; an MoE layer around its experts, ``compile_layers``): the layers share one code object, so the
compiler traces one layer and reuses it for the rest, and the stage's embedding, head, loss and the
engine's communication stay eager. hal's ops dispatch through a per-op cache keyed by device and
dtype; a miss inside a traced region is a graph break, so the stage's first forward runs eagerly
(``torch.compiler.set_stance("force_eager")``), filling the caches with exactly the dtypes the run
uses, and compilation starts with the second, with no graph break (tests/unit/test_compile_stage.py).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from hal.downgrades import Downgrade, record_downgrade
from hal.errors import UnsupportedError

from hal.parallel.models.decoder import Stage
from hal.parallel.models.moe import MoE


def compile_layers(stage: Stage, backend: str, dynamic: bool | None = None) -> None:
    """Compile each decoder layer of ``stage`` in place (``nn.Module.compile``; ``dynamic`` as torch.compile's:
    ``hal profile`` passes False, so each row count it times gets the static graph a run of that shape gets).

    An MoE layer is compiled around its experts: the attention (with its norm), the router and the shared
    expert are compiled, the experts' block runs eagerly — it reads the per-expert token counts on the host,
    which inside a compiled region would be a graph break in every layer. That is recorded as a downgrade."""
    if not hasattr(torch.nn.Module, "compile"):
        raise UnsupportedError(f"torch {torch.__version__} has no nn.Module.compile; use torch >= 2.2 or compile: false")
    around_experts = []
    for index, layer in stage.layers.items():
        if isinstance(layer.mlp, MoE):
            for part in (layer.attn_norm, layer.attn, layer.mlp.router, layer.mlp.shared):
                if part is not None:
                    part.compile(backend=backend, dynamic=dynamic)
            around_experts.append(int(index))
        else:
            layer.compile(backend=backend, dynamic=dynamic)
    if around_experts:
        record_downgrade(Downgrade("op", f"compile of MoE layers {sorted(around_experts)}", "whole decoder layers",
                                   "attention, router and shared expert compiled; the experts eager",
                                   "the experts' block sizes are read on the host (a graph break in a compiled layer)"))


@contextlib.contextmanager
def eager_first_forward() -> Iterator[None]:
    """Run the enclosed forward eagerly (it fills hal's op caches for the dtypes in use)."""
    set_stance: Any = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:  # torch < 2.6: the first compiled call resolves the caches itself (graph breaks)
        yield
        return
    with set_stance("force_eager"):
        yield
